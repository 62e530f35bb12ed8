"""Checkpoints of the run through its DeepSpeed engine: save and publish, restore, convert hand-off.

Owns: what a checkpoint of the current stage holds and what resuming from one restores. Must not build engines
itself (the stage builder does), choose a checkpoint or check that this run may and did resume from it
(``resume_checks`` does) nor lay out folders (``checkpoint`` does, knowing nothing of DeepSpeed).
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any, Dict, Optional, Tuple

import torch

from . import checkpoint as ckpt
from . import ds_state, resume_checks, run_lock
from .background_checkpoint import BackgroundCheckpoints, BackgroundSave
from .callbacks import REAL, RunState, TrainingState
from .config import CheckpointOptions
from .rank0 import is_rank0, log_rank0
from .stages import StageBuilder

CLIENT_KEY = ckpt.CLIENT_KEY


def sync_lr_with_scheduler(scheduler, optimizer) -> None:
    """Set the optimizer's LRs to what ``scheduler`` gives at its current position (after load_state_dict)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    elif hasattr(scheduler, "last_batch_iteration"):
        scheduler.step(scheduler.last_batch_iteration)


def restore_swapped_state(engine, folder: str, side: Dict[str, Any], optimizer_loaded: bool) -> None:
    """Under ZeRO-3 with ``offload_optimizer: nvme``, restore the fp32 masters and working weights, and (when the
    optimizer state is loaded) the moments and step counters, that DeepSpeed's load leaves out
    (:func:`~ds_pseudo_real.ds_state.restore_swapped_optimizer_state`), from the checkpoint's files named as the
    sidecar records. A failure on any rank is a :class:`~ds_pseudo_real.checkpoint.CheckpointError` on every rank."""
    saved = side.get("swapped_state_files")
    if saved is None or ds_state.swapped_state_files(engine) is None:
        return
    rank, world = ckpt.rank_and_world()
    failure = None
    try:
        if len(saved) != world or saved[rank] is None:
            raise RuntimeError(f"the checkpoint names the swap files of {len(saved)} ranks; this run has {world}")
        ds_state.restore_swapped_optimizer_state(engine, folder, saved[rank], moments=optimizer_loaded)
    except (OSError, RuntimeError, KeyError) as error:
        failure = f"{type(error).__name__}: {error}"
    reports = ckpt.gather(failure)
    ranks = [r for r, report in enumerate(reports) if report]
    if ranks:
        raise ckpt.CheckpointError(
            f"could not restore the optimizer state swapped to NVMe from checkpoint {folder} (rank "
            f"{', '.join(map(str, ranks))}): {reports[ranks[0]]}")
    ds_state.regather_persistent_parameters(engine)


class CheckpointIO:
    """Saves and resumes the run: the engine the ``stages`` builder holds (which it asks for a checkpoint's stage),
    and the training state and callbacks of ``run`` (which a load replaces). ``options``: the plugin's keys of the
    ``checkpoint`` section; ``pseudo_to_real``: whether the run has a pseudo stage (``pseudo_to_real.enabled``).

    ``run_id`` is rank 0's id for this controller (which also names its temporary folders) until it resumes from
    a checkpoint, whose run it then goes on as. With ``checkpoint.async_save``, a save returns once the state is
    copied to host memory and the rest happens in the background (``background_checkpoint``); ``poll`` at every
    step boundary moves it on.
    """

    def __init__(self, stages: StageBuilder, run: RunState, options: CheckpointOptions, *, pseudo_to_real: bool):
        self._stages = stages
        self._run = run
        self._options = options
        self._pseudo_to_real = pseudo_to_real
        self._prepared_dirs: set = set()
        self._writer = ckpt.gather(uuid.uuid4().hex[:12])[0]
        self.run_id = self._writer
        self.background: Optional[BackgroundCheckpoints] = None  # made by the first save with async_save on

    # ---- saving ----------------------------------------------------------------------------------------------
    def _plugin_state(self) -> Dict[str, Any]:
        return {"state": self._run.state.to_dict(), "callbacks": self._run.callbacks.state_dict()}

    def _sidecar(self, kind: str = "deepspeed") -> Dict[str, Any]:
        stages, engine = self._stages, self._stages.engine
        return {
            "kind": kind,
            "stage": self._run.state.stage,
            "global_step": engine.global_steps,
            "layers": stages.layer_path,
            "num_layers": stages.num_layers,
            "groups": stages.groups,
            "depth": stages.depth,
            "zero_stage": engine.zero_optimization_stage(),
            "world_size": ckpt.rank_and_world()[1],
            "run_id": self.run_id,
        }

    def _prepare_dir(self, folder: str) -> None:
        """Once per folder and run, before the first save or load there: rank 0 creates it, takes its lock for the
        life of the process (:func:`~ds_pseudo_real.checkpoint.claim`: another run holding it is a CheckpointError on
        every rank) and removes what crashed saves left (after a barrier, so that no rank is still writing)."""
        if folder in self._prepared_dirs:
            return
        ckpt.barrier()
        ckpt.claim(folder)
        if is_rank0():
            ckpt.remove_stale(folder)
        ckpt.barrier()
        self._prepared_dirs.add(folder)

    def save(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict] = None) -> str:
        """See :meth:`~ds_pseudo_real.controller.PseudoToRealController.save_checkpoint`."""
        self.wait("saving the next one")  # one snapshot in flight
        start = time.perf_counter()
        engine = self._stages.engine
        tag = tag or f"global_step{engine.global_steps}"
        client = dict(client_state or {})
        client[CLIENT_KEY] = self._plugin_state()
        self._prepare_dir(save_dir)
        refusal = (run_lock.taken_over(save_dir) or ckpt.foreign_checkpoint(save_dir, tag, self.run_id)
                   if is_rank0() else None)
        refusal = ckpt.gather(refusal)[0]
        if refusal is not None:
            raise ckpt.CheckpointError(f"checkpoint {os.path.join(save_dir, tag)} was not saved: {refusal}")
        staged = os.path.join(save_dir, ckpt.partial_tag(tag, self._writer))
        if self._options.async_save:  # read at each save: the option may be switched during a run
            self.background = self.background or BackgroundCheckpoints()
            return self._save_in_background(save_dir, tag, client, staged, start)
        written, failure = {}, None
        try:
            with ds_state.checksummed_writes(engine, staged) as written:
                engine.save_checkpoint(save_dir, tag=os.path.basename(staged), client_state=client,
                                       save_latest=False)
        except (OSError, RuntimeError) as error:
            failure = error
            ckpt.barrier()  # the closing barrier of DeepSpeed's save_checkpoint, which this rank skipped
        self._raise_if_save_failed(save_dir, tag, failure)
        every = ckpt.gather(written)
        fingerprints = ckpt.gather(ds_state.state_fingerprint(engine))  # compared after a load, per rank
        sidecar = self._full_sidecar(save_dir)
        if is_rank0():
            try:
                merged = {name: entry for part in every for name, entry in part.items()}
                ckpt.publish(save_dir, tag, {**sidecar, "state": fingerprints}, merged, self._writer)
            except OSError as error:
                failure = error
        self._raise_if_save_failed(save_dir, tag, failure)
        if is_rank0():
            ckpt.prune(save_dir, self._options.keep_last, self.run_id)
        ckpt.barrier()
        return os.path.join(save_dir, tag)

    def _full_sidecar(self, save_dir: str) -> Dict[str, Any]:
        """Collective: the sidecar but the state fingerprints (rank 0's; {} on the others)."""
        swap_files = ckpt.gather(ds_state.swapped_state_files(self._stages.engine))  # NVMe: each rank's saved files
        if not is_rank0():
            return {}
        swapped = {"swapped_state_files": swap_files} if any(f is not None for f in swap_files) else {}
        return {**self._sidecar(), "written_by": run_lock.holder_record(save_dir), **swapped}

    def _save_in_background(self, save_dir: str, tag: str, client: Dict, staged: str, start: float) -> str:
        """``checkpoint.async_save``: DeepSpeed's save with each file's state copied to host memory instead of
        written, and the tensors the state fingerprint sums; writing, checksums, fsync, the fingerprint, the
        manifest and the publication are the writer threads' (:class:`BackgroundSave`).

        DeepSpeed's own decoupled engine (``checkpoint.writer.decoupled``) is no such snapshot: it hands the live
        tensors to a writer process, and the next optimizer step waits until that process has written them; and
        torch.distributed.checkpoint.async_save writes its own format, which DeepSpeed's load cannot read."""
        engine, snapshot = self._stages.engine, self.background.snapshot
        snapshot.begin()
        files, terms, failure = {}, None, None
        try:
            with ds_state.checksummed_writes(engine, staged, snapshot=snapshot.copy) as files:
                engine.save_checkpoint(save_dir, tag=os.path.basename(staged), client_state=client,
                                       save_latest=False)
            terms = ds_state.fingerprint_terms(engine, snapshot.tensor)
        except (OSError, RuntimeError) as error:
            failure = error
            ckpt.barrier()  # the closing barrier of DeepSpeed's save_checkpoint, which this rank skipped
        snapshot.end()
        self._raise_if_save_failed(save_dir, tag, failure)
        sidecar = self._full_sidecar(save_dir)
        run_id, keep_last, writer = self.run_id, self._options.keep_last, self._writer

        def publish(parts) -> None:  # rank 0's writer thread, once every rank's files are durable
            refusal = run_lock.taken_over(save_dir)
            if refusal is not None:
                raise ckpt.CheckpointError(refusal)
            merged = {name: entry for entries, _ in parts for name, entry in entries.items()}
            ckpt.publish(save_dir, tag, {**sidecar, "state": [fingerprint for _, fingerprint in parts]}, merged,
                         writer)
            ckpt.prune(save_dir, keep_last, run_id)

        folder = os.path.join(save_dir, tag)
        self.background.start(BackgroundSave(
            folder, staged, files, summary=lambda: ds_state.fingerprint_of(terms), publish=publish,
            failed=lambda reports: self._save_failed(save_dir, tag, reports, background=True),
            blocked_s=time.perf_counter() - start))
        return folder

    def poll(self) -> None:
        """Collective at every step boundary: where the checkpoint written in the background stands; its failure is
        raised here, on every rank (:class:`~ds_pseudo_real.background_checkpoint.BackgroundCheckpoints.poll`)."""
        if self.background is not None:
            self.background.poll()

    def wait(self, before: str = "going on") -> None:
        """Collective: until the checkpoint written in the background, if any, is published (or its failure
        raised); ``before`` is what waits, for the log line."""
        if self.background is not None:
            self.background.wait(before)

    def _raise_if_save_failed(self, save_dir: str, tag: str, failure: Optional[BaseException]) -> None:
        """Collective: every rank raises when any rank's part of the save failed; rank 0 removes the partial folder."""
        reports = ckpt.gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        if any(reports):
            self._save_failed(save_dir, tag, reports, cause=failure)

    def _save_failed(self, save_dir: str, tag: str, reports, cause: Optional[BaseException] = None,
                     background: bool = False) -> None:
        """Collective, once ``reports`` (each rank's failure or None) name one: rank 0 removes the partial folder once
        every rank has stopped writing, and every rank raises the same CheckpointError."""
        ranks = [rank for rank, report in enumerate(reports) if report]
        staged = os.path.join(save_dir, ckpt.partial_tag(tag, self._writer))
        ckpt.barrier()
        if is_rank0():
            shutil.rmtree(staged, ignore_errors=True)
        ckpt.barrier()
        raise ckpt.CheckpointError(
            f"could not save checkpoint {os.path.join(save_dir, tag)} (rank {', '.join(map(str, ranks))}"
            f"{', written in the background' if background else ''}): {reports[ranks[0]]}; the partial folder "
            f"{staged} was removed and the run's state is intact; {ckpt.last_good(save_dir)}"
        ) from cause

    # ---- resuming --------------------------------------------------------------------------------------------
    def load(self, load_dir: Optional[str], tag: Optional[str] = None, *, verify: Optional[str] = None,
             **kwargs) -> Tuple[Optional[str], Dict]:
        """See :meth:`~ds_pseudo_real.controller.PseudoToRealController.load_checkpoint`."""
        mode = verify or self._options.verify
        self.wait("loading a checkpoint")
        if tag is None:
            if load_dir is None:
                raise ValueError("load_checkpoint: give load_dir, or tag as the path of a checkpoint folder")
            self._prepare_dir(load_dir)
        chosen = resume_checks.choose(load_dir, tag, mode)
        if chosen is None:
            self.rewind_monitors()  # the run starts here: what an earlier one logged after this step goes
            return None, {}
        load_dir, tag, verdict = chosen
        log_rank0(verdict.summary())
        side = ckpt.read_sidecar(load_dir, tag)
        resume_checks.check_compatible(self._stages, self._run.state.stage, load_dir, tag, side)
        if side["kind"] == "converted":
            return self._load_converted(load_dir, tag, side)
        stages = self._stages
        num_layers = stages.num_layers
        stage = (num_layers,) * 2 if side["stage"] == REAL else (side.get("depth", num_layers), side["groups"])
        if stage != (stages.depth, stages.groups):  # a later stage's checkpoint: that stage's model first
            stages.release()
            stages.build(*stage, None, self._run.state)
        loading = dict(kwargs)
        if side.get("swapped_state_files") and ds_state.swapped_state_files(stages.engine) is not None:
            # DeepSpeed loads ZeRO-3 weights without the optimizer state through zero_to_fp32, which cannot read
            # sub-groups swapped to NVMe; under NVMe its full load reads no optimizer state anyway (it only copies
            # the swap files): restore_swapped_state puts back the weights, and the moments only if asked
            loading["load_optimizer_states"] = True
        try:
            path, client = stages.engine.load_checkpoint(load_dir, tag, **loading)
        except Exception as error:
            raise ckpt.CheckpointError(
                f"DeepSpeed could not load checkpoint {os.path.join(load_dir, tag)}: {type(error).__name__}: {error}; "
                f"{'it verified' if verdict.ok and not verdict.legacy and mode != 'none' else 'it was not verified'}"
                f" (checkpoint.verify: {mode}); resume from another one with --resume-from TAG|PATH: "
                f"{[c.tag for c in ckpt.list_checkpoints(load_dir) if c.tag != tag]}"
            ) from error
        if path is None:
            raise ckpt.CheckpointError(f"DeepSpeed could not load checkpoint {load_dir}/{tag}")
        optimizer_loaded = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        engine = stages.engine
        restore_swapped_state(engine, os.path.join(load_dir, tag), side, optimizer_loaded)
        if optimizer_loaded:
            ds_state.replay_cpu_adam_steps(engine)
        resume_checks.check_state_restored(engine, os.path.join(load_dir, tag), side, optimizer_loaded)
        client = dict(client or {})
        self._restore_plugin_state(client.pop(CLIENT_KEY))
        self.rewind_monitors()
        self.run_id = ckpt.run_of(side)  # resumed: this run goes on as the checkpoint's
        log_rank0(f"resumed from {os.path.join(load_dir, tag)} at step {engine.global_steps} "
                  f"({self._run.state.stage} stage)")
        return path, client

    def rewind_monitors(self) -> None:
        """See :meth:`~ds_pseudo_real.controller.PseudoToRealController.rewind_monitors`."""
        ds_state.rewind_monitors(self._stages.engine)

    def _restore_plugin_state(self, plugin: Dict[str, Any]) -> None:
        state = self._run.state = TrainingState.from_dict(plugin["state"])
        state.groups = self._stages.groups  # checkpoints before progressive schedules do not record it
        if state.stage == REAL and self._pseudo_to_real:
            state.transitions_done = len(self._stages.stages) - 1
        self._run.callbacks.load_state_dict(plugin["callbacks"])

    def _load_converted(self, load_dir: str, tag: str, side: Dict[str, Any]) -> Tuple[str, Dict]:
        """A checkpoint of ``ds-pseudo-real convert``: the model of its stage built from its fp32 weights, its steps,
        LR schedule position, fp16 loss scaler and plugin state restored; Adam moments start at zero."""
        folder = os.path.join(load_dir, tag)
        weights = torch.load(os.path.join(folder, "model_fp32.pt"), map_location="cpu", weights_only=True)
        trainer = torch.load(os.path.join(folder, "trainer_state.pt"), map_location="cpu", weights_only=False)
        stages = self._stages
        stages.release()
        if side["stage"] == REAL:
            stages.build(stages.num_layers, stages.num_layers, weights, self._run.state)
        else:
            stages.build(side.get("depth", stages.num_layers), side["groups"], weights, self._run.state)
        engine = stages.engine
        for key in ("global_steps", "global_samples", "skipped_steps"):
            setattr(engine, key, trainer[key])
        engine.micro_steps = trainer["global_steps"] * engine.gradient_accumulation_steps()
        ds_state.set_loss_scaler_state(engine, trainer.get("loss_scale"))
        if trainer.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
            sync_lr_with_scheduler(engine.lr_scheduler, engine.optimizer)
        client = dict(trainer.get("client_state") or {})
        plugin = client.pop(CLIENT_KEY, None)
        if plugin is not None:
            self._restore_plugin_state(plugin)
        if side["stage"] == REAL:
            self._run.state.stage = REAL
            self._run.state.switch_step = self._run.state.switch_step or engine.global_steps
        self.rewind_monitors()
        self.run_id = ckpt.run_of(side)
        log_rank0(f"loaded converted {side['stage']}-stage checkpoint {folder} at step {engine.global_steps}; Adam "
                  f"moments start at zero")
        return folder, client
