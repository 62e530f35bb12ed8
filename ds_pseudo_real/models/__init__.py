"""Reference models for the demo job, the tests and the benchmarks."""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
