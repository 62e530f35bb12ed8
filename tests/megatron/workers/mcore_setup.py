"""Tiny megatron.core GPT set-up shared by the worker scripts (run under torchrun on gloo, CPU)."""
import json
import warnings

warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist

from megatron_patches import cpu_compat


def init(tp: int = 1, ep: int = 1, seed: int = 1, etp=None):
    """CPU patches, gloo process group, Megatron's parallel state (``etp``: expert tensor parallelism, default TP)."""
    cpu_compat.install()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed)
    return dist.get_rank()


def config(num_layers=4, tp=1, ep=1, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=num_layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  use_cpu_initialization=True, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                  gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
                  bias_dropout_fusion=False, apply_rope_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


VOCAB, SEQ, BATCH = 128, 16, 2


def gpt(cfg, layer_spec=None, shared_groups=None, seed=0):
    """A GPTModel; with ``shared_groups`` its decoder is the shared-parameter block."""
    import contextlib

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_patches.shared_block import shared_parameter_decoder

    torch.manual_seed(seed)
    context = shared_parameter_decoder(shared_groups) if shared_groups else contextlib.nullcontext()
    with context:
        return GPTModel(config=cfg, transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(),
                        vocab_size=VOCAB, max_sequence_length=32)


def batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    labels = torch.roll(tokens, -1, 1)
    return tokens, position_ids, mask, labels


def report(path: str, result: dict) -> None:
    """Rank 0 writes the figures the pytest side asserts on."""
    if dist.get_rank() == 0:
        with open(path, "w") as handle:
            json.dump(result, handle)
