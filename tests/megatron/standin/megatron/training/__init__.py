"""STAND-IN for Megatron-LM's ``megatron.training`` package, for tests only.

Megatron-LM's training package is not installable here (the registry has only megatron-core), so this small
package offers the same entry points the drop-in run module relies on -- ``pretrain``, ``get_args``,
``training.setup_model_and_optimizer``, ``training.train_step`` called from ``training.train``,
``arguments.parse_args(extra_args_provider)`` -- built on real megatron.core models, DDP, optimizers and
schedules. It is written from Megatron-LM's public interface, not copied, and covers only a tiny GPT on CPU.
"""
from .global_vars import get_args
from .training import pretrain

__all__ = ["get_args", "pretrain"]
