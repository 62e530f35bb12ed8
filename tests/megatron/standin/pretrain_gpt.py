"""STAND-IN user script shaped like Megatron-LM's pretrain_gpt.py (tests only): a model_provider building a
megatron.core GPTModel from the parsed flags, a forward_step with Megatron's loss-function contract, synthetic
data, and ``pretrain(...)`` under ``__main__``. The drop-in run module must work on it without any edit."""
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron.training import get_args, pretrain
from megatron.training.arguments import core_transformer_config_from_args


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    args = get_args()
    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process)


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1))
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.float().view(1)])}


def forward_step(data_iterator, model):
    tokens = next(data_iterator)
    args = get_args()
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
    attention_mask = torch.tril(torch.ones(1, 1, args.seq_length, args.seq_length)) < 0.5
    labels = torch.roll(tokens, -1, 1)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, torch.ones_like(tokens, dtype=torch.float))


def train_valid_test_datasets_provider(train_val_test_num_samples):
    from megatron.core import parallel_state

    args = get_args()
    g = torch.Generator().manual_seed(args.seed + parallel_state.get_data_parallel_rank())
    batches = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=g)
               for _ in range(4)]  # a small fixed set, cycled: the loss falls quickly
    train = (batches[i % len(batches)] for i in range(10**9))
    return train, None, None


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)
