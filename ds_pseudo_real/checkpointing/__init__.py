"""Checkpointing of a run: saving the engine it is handed (verified, atomic, in the background when asked), choosing
the checkpoint a resume reads and restoring it into the engine of its stage (which the caller builds in between),
converting one to another layout, the lock a run holds on its folder, and when a training loop saves.

The modules: ``engine_io`` (:class:`Checkpoints`: save, choose, restore), ``folders`` (the layout on disk,
publication, retention), ``verify`` (a checkpoint's files against its manifest), ``resume`` (the checkpoint a
resume reads, whether this run may load it, and whether the load restored what was saved), ``background`` (the
writer threads of ``async_save``), ``lock`` (``run.lock``), ``convert`` (``ds-pseudo-real convert``) and ``policy``
(the interval saves). Builds no stage and no engine. Importing the package or its folder-level modules loads no DeepSpeed: ``Checkpoints`` and
``Chosen`` (which need it) are loaded when first named.
"""
from .folders import CheckpointError
from .lock import claim
from .policy import CheckpointPolicy

__all__ = ["Checkpoints", "Chosen", "CheckpointError", "claim", "CheckpointPolicy"]


def __getattr__(name: str):
    if name == "Checkpoints":
        from .engine_io import Checkpoints

        return Checkpoints
    if name == "Chosen":
        from .resume import Chosen

        return Chosen
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
