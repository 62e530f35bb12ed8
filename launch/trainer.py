"""The main job's training loop over parts made elsewhere: the engine (``ds_pseudo_real.initialize``), the corpus,
the checkpoint policy (``ds_pseudo_real.checkpointing.policy``) and the run's report (``run_report``).

Owns: a step's micro-batches and their loss sum over the ranks, evaluation, and stopping at a step boundary on a
signal (every rank at the same step). Must not build, save or print: it calls the parts that do.
"""
from __future__ import annotations

import signal
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from launch.launcher_watch import watch_launcher


class StopOnSignal:
    """Turns SIGUSR1/SIGTERM into a flag checked at step boundaries (all ranks agree through an all-reduce); a rank
    whose launcher is gone (killed by a signal it does not pass on) sends itself SIGTERM."""

    def __init__(self):
        self.received: Optional[str] = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)
        watch_launcher()

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name


def sum_over_ranks(values: List[torch.Tensor], device: torch.device) -> List[float]:
    """Each of the scalars ``values`` summed over the ranks, in one all-reduce of a tensor on ``device`` (the
    engine's: NCCL takes device tensors only)."""
    total = torch.stack([v.detach().float().reshape(()).to(device) for v in values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.tolist()


@torch.no_grad()
def evaluate(engine, corpus, args, batch_size: int, seq_len: int, rank: int, world: int) -> float:
    engine.eval()
    total = torch.zeros((), device=engine.device)
    for i in range(args.eval_batches):
        x, y = corpus.batch("val", batch_size, seq_len, seed=1234, step=i, rank=rank)
        total += engine(x.to(engine.device), y.to(engine.device)).float()
    engine.train()
    return sum_over_ranks([total], engine.device)[0] / (args.eval_batches * world)


class Trainer:
    """Trains ``engine`` on ``corpus`` up to ``job.steps``, with ``job``'s micro batch and accumulation steps and
    ``args``' seed and evaluation schedule, on rank ``rank`` of ``world``; saves as ``checkpoints`` says, reports to
    ``report``, stops when ``stopper`` got a signal on any rank."""

    def __init__(self, engine, corpus, job, args, checkpoints, report, stopper: StopOnSignal, rank: int, world: int):
        self.engine, self.corpus, self.job, self.args = engine, corpus, job, args
        self.checkpoints, self.report, self.stopper = checkpoints, report, stopper
        self.rank, self.world = rank, world

    def run(self) -> Optional[str]:
        """Train to the last step; returns None there, or the signal's name once it stopped and saved for it."""
        engine, steps = self.engine, self.job.steps
        while engine.global_steps < steps:
            stage, groups = engine.stage, engine.groups
            train_loss, stopping = self._step()
            done = engine.global_steps
            self.report.step_done(stage, groups, train_loss)
            if done % self.args.eval_interval == 0 or done == steps:
                engine.report_eval({"val_loss": self.report.validation(self.evaluate())})
            self.report.step_reported()
            self.checkpoints.after_step(done, steps)
            if stopping:
                signal_name = self.stopper.received or "from another rank"
                self.checkpoints.at_stop(done, signal_name)
                return signal_name
        return None

    def _step(self) -> Tuple[float, bool]:
        """One optimizer step of the job's micro-batches: its mean loss over them and the ranks, and whether any rank
        got a stop signal (it rides along in the loss sum's all-reduce)."""
        engine, job = self.engine, self.job
        step = engine.global_steps
        loss_sum = torch.zeros((), device=engine.device)
        for m in range(job.gas):
            x, y = self.corpus.batch("train", job.micro, job.spec.seq_len, self.args.seed, step * job.gas + m,
                                     self.rank)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            loss_sum += loss.detach().float()
            self.checkpoints.keep_going(engine.step)  # a checkpoint written in the background may fail here
        loss_total, stopping = sum_over_ranks([loss_sum, torch.tensor(float(bool(self.stopper.received)))],
                                              engine.device)
        return loss_total / (job.gas * self.world), stopping > 0

    def evaluate(self) -> float:
        return evaluate(self.engine, self.corpus, self.args, self.job.micro, self.job.spec.seq_len, self.rank,
                        self.world)
