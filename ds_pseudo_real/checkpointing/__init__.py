"""Checkpointing: when a run saves (``policy``)."""
