"""STAND-IN (tests only): the subset of Megatron-LM's flags a tiny GPT run needs, same names and defaults."""
import argparse

import torch


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments (stand-in)", allow_abbrev=False)
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="Transformer FFN hidden size.")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="Maximum sequence length.")
    g.add_argument("--vocab-size", type=int, default=128, help="Stand-in only: vocabulary of the synthetic data.")
    g = parser.add_argument_group(title="training")
    g.add_argument("--seq-length", type=int, default=None, help="Sequence length.")
    g.add_argument("--micro-batch-size", type=int, default=None, help="Batch size per model instance.")
    g.add_argument("--global-batch-size", type=int, default=None, help="Training batch size.")
    g.add_argument("--train-iters", type=int, default=None, help="Total number of iterations to train over.")
    g.add_argument("--lr", type=float, default=None, help="Initial learning rate.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay coefficient.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient clipping based on global L2 norm.")
    g.add_argument("--seed", type=int, default=1234, help="Random seed.")
    g.add_argument("--bf16", action="store_true", help="Run model in bfloat16 mode.")
    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None, help="Output directory to save checkpoints to.")
    g.add_argument("--save-interval", type=int, default=None, help="Number of iterations between checkpoint saves.")
    g.add_argument("--load", type=str, default=None, help="Directory containing a model checkpoint.")
    g.add_argument("--ckpt-step", type=int, default=None, help="Checkpoint step to load model from.")
    g = parser.add_argument_group(title="logging")
    g.add_argument("--log-json", type=str, default=None, help="Stand-in only: write per-iteration figures here.")
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Degree of tensor model parallelism.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="Degree of expert model parallelism.")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="Use distributed optimizer.")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap DDP grad reduce.")
    g = parser.add_argument_group(title="moe")
    g.add_argument("--num-experts", type=int, default=None, help="Number of Experts in MoE (None means no MoE)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Number of experts to route to for each token.")
    g.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], help="Load balancing strategy.")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Scaling coefficient for the aux loss.")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="The capacity factor for each expert.")
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather", choices=["allgather", "alltoall"],
                   help="The type of token dispatcher to use.")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
    validate_args(args)
    return args


def validate_args(args):
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters", "lr"):
        assert getattr(args, name) is not None, f"--{name.replace('_', '-')} must be given"
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.iteration = 0
    args.curr_iteration = 0


def core_transformer_config_from_args(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                  num_attention_heads=args.num_attention_heads, tensor_model_parallel_size=args.tensor_model_parallel_size,
                  expert_model_parallel_size=args.expert_model_parallel_size, use_cpu_initialization=True,
                  params_dtype=torch.bfloat16 if args.bf16 else torch.float32, bf16=args.bf16,
                  gradient_accumulation_fusion=False, bias_activation_fusion=False,
                  masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                  attention_dropout=0.0, hidden_dropout=0.0)
    if args.num_experts:
        kwargs.update(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                      moe_router_load_balancing_type=args.moe_router_load_balancing_type,
                      moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_expert_capacity_factor=args.moe_expert_capacity_factor,
                      moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=False,
                      add_bias_linear=False)
    return TransformerConfig(**kwargs)
