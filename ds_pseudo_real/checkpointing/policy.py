"""When a training loop saves: every ``interval`` steps, at a stop signal, at the end.

Owns: the interval policy and what each save's failure means for the run (an interval save or a background write
that fails is a warning and training goes on; the stop's and the end's are errors). Must not write files itself:
the engine it is handed saves (``ds_pseudo_real.initialize``'s, verified and atomic).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from .folders import CheckpointError
from ..logs import logger


class CheckpointPolicy:
    """The saves of a run into ``folder`` through ``engine`` (a ``ds_pseudo_real.initialize`` controller): one every
    ``interval`` steps (0: at the end only) before the last step, one at a stop signal, one at the end."""

    def __init__(self, engine, folder: Path, interval: int, rank: int):
        self.engine, self.folder, self.interval, self.rank = engine, folder, interval, rank

    def keep_going(self, action: Callable[[], object]) -> None:
        """Run ``action``, which may save or finish a checkpoint (``engine.step`` finishes one written in the
        background): its CheckpointError, raised on every rank, is a warning from rank 0, and training goes on (the
        next save tries again; the last good checkpoint is named)."""
        try:
            action()
        except CheckpointError as error:
            if self.rank == 0:
                logger.warning(str(error))

    def after_step(self, step: int, last_step: int) -> None:
        """The interval's save after ``step``, if it is due and not the last step (the end saves that one)."""
        if self.interval and step % self.interval == 0 and step < last_step:
            self.keep_going(lambda: self.engine.save_checkpoint(str(self.folder)))

    def at_stop(self, step: int, signal_name: str) -> None:
        """On a stop signal: the checkpoint of ``step``, published before the ranks exit. With
        ``checkpoint.async_save``, the checkpoint still being written is finished first, and when it is this very
        step's (the interval's) it is not written again; the time taken is printed, for sizing the grace period
        before SIGKILL (SLURM's ``--signal-grace``, its KillWait after a preemption's SIGTERM). A failure of the
        stop's own save is raised (the job exits 2)."""
        start = time.perf_counter()
        in_flight: Optional[str] = self.engine.checkpoint_in_flight
        if in_flight is not None:
            logger.info(f"stopping on signal {signal_name} at step {step}: waiting for the checkpoint being written in "
                        f"the background, {in_flight}")
            try:
                self.engine.wait_for_checkpoints()
            except CheckpointError as error:
                if self.rank == 0:
                    logger.warning(str(error))
                in_flight = None
        if in_flight is None or Path(in_flight).name != f"global_step{step}":
            self.engine.save_checkpoint(str(self.folder))
            self.engine.wait_for_checkpoints()
        print(f"saved checkpoint at step {step} on signal {signal_name} ({time.perf_counter() - start:.2f} s after "
              f"the step ended)", flush=True)

    def at_end(self) -> Path:
        """The last interval's checkpoint finished (a failure a warning), then the final one saved and published (a
        failure raised). Returns the final checkpoint's folder."""
        self.keep_going(self.engine.wait_for_checkpoints)
        self.engine.save_checkpoint(str(self.folder))
        self.engine.wait_for_checkpoints()
        return self.folder / f"global_step{self.engine.global_steps}"
