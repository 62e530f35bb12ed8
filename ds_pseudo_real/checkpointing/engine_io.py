"""Checkpoints of the run through its DeepSpeed engine: save and publish; choose the one to resume from; restore it
into the engine handed over.

Owns: what a checkpoint of the current stage holds, what resuming from one restores, and that the load restored
what was saved. Must not build a stage or an engine: between :meth:`Checkpoints.choose` and
:meth:`Checkpoints.restore` the run's controller builds the engine of the chosen checkpoint's stage. Which
checkpoint, and whether this run may resume from it, is ``resume``'s; the folders are ``folders``' (knowing nothing
of DeepSpeed).
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any, Dict, Optional, Tuple

import torch

from .. import ds_state
from ..callbacks import REAL, RunState, TrainingState
from ..carry import EngineProgress
from ..config import CheckpointOptions
from ..ranks import barrier, gather, is_rank0, log_rank0, rank_and_world
from . import folders as ckpt
from . import lock, resume
from .resume import Chosen
from .background import BackgroundCheckpoints, BackgroundSave

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
    sidecar records. A failure on any rank is a :class:`~ds_pseudo_real.checkpointing.CheckpointError` on every rank."""
    saved = side.get("swapped_state_files")
    if saved is None or ds_state.swapped_state_files(engine) is None:
        return
    rank, world = rank_and_world()
    failure = None
    try:
        if len(saved) != world or saved[rank] is None:
            raise RuntimeError(f"the checkpoint names the swap files of {len(saved)} ranks; this run has {world}")
        ds_state.restore_swapped_optimizer_state(engine, folder, saved[rank], moments=optimizer_loaded)
    except (OSError, RuntimeError, KeyError) as error:
        failure = f"{type(error).__name__}: {error}"
    reports = gather(failure)
    ranks = [r for r, report in enumerate(reports) if report]
    if ranks:
        raise ckpt.CheckpointError(
            f"could not restore the optimizer state swapped to NVMe from checkpoint {folder} (rank "
            f"{', '.join(map(str, ranks))}): {reports[ranks[0]]}")
    ds_state.regather_persistent_parameters(engine)


def check_state_restored(engine, folder: str, side: Dict[str, Any], optimizer_loaded: bool) -> None:
    """Collective: raise :class:`~ds_pseudo_real.checkpointing.CheckpointError` on every rank when DeepSpeed's load
    left any rank with other weights, or (when it loaded the optimizer state) other fp32 masters or moments, than
    that rank saved (its :func:`~ds_pseudo_real.ds_state.state_fingerprint` in the sidecar), instead of training
    on from them. Checkpoints saved without fingerprints are not checked."""
    saved = side.get("state")
    rank, world = rank_and_world()
    if saved is not None and len(saved) != world:  # ZeRO 0 on another world size: every rank holds all
        saved = [saved[0]] * world if engine.zero_optimization_stage() == 0 else None
    expected = saved[rank] if saved is not None else None
    found = ds_state.state_fingerprint(engine) if expected is not None else None
    differ = []
    for part in ("weights", "optimizer") if optimizer_loaded else ("weights",):
        if found is not None and expected.get(part) is not None and any(
                abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(found[part], expected[part])):
            differ.append(part)
    reports = gather(differ)
    ranks = [r for r, parts in enumerate(reports) if parts]
    if ranks:
        names = {"weights": "weights", "optimizer": "optimizer state (fp32 masters, moments)"}
        what = " and ".join(names[p] for p in names if any(p in parts for parts in reports))
        swapped = (" (ZeRO-3 with offload_optimizer nvme: the swapped sub-groups were read from the checkpoint's "
                   "offloaded_tensors files)" if ds_state.swapped_sub_groups(engine) else "")
        here = (f"; on rank {rank}: " + ", ".join(f"{p} sum and sum of squares {found[p]}, saved {expected[p]}"
                                                  for p in differ)) if differ else ""
        raise ckpt.CheckpointError(
            f"DeepSpeed loaded checkpoint {folder}, but the {what} of rank {', '.join(map(str, ranks))} are not "
            f"the ones saved{swapped}{here}; training on would silently start from another state")


class Checkpoints:
    """Saves and resumes the run: the engine the run's stage builder ``stages`` holds (read only: its ``engine``,
    ``layer_path``, ``num_layers``, ``depth``, ``groups`` and ``stages``), and the training state and callbacks of
    ``run`` (which a load replaces). ``options``: the plugin's keys of the
    ``checkpoint`` section; ``pseudo_to_real``: whether the run has a pseudo stage (``pseudo_to_real.enabled``).

    ``run_id`` is rank 0's id for this controller (which also names its temporary folders) until it resumes from
    a checkpoint, whose run it then goes on as. With ``checkpoint.async_save``, a save returns once the state is
    copied to host memory and the rest happens in the background (``background``); ``poll`` at every
    step boundary moves it on.
    """

    def __init__(self, stages, run: RunState, options: CheckpointOptions, *, pseudo_to_real: bool):
        self._stages = stages
        self._run = run
        self._options = options
        self._pseudo_to_real = pseudo_to_real
        self._prepared_dirs: set = set()
        self._writer = gather(uuid.uuid4().hex[:12])[0]
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
            "world_size": rank_and_world()[1],
            "run_id": self.run_id,
        }

    def _prepare_dir(self, folder: str) -> None:
        """Once per folder and run, before the first save or load there (:func:`.lock.prepare`)."""
        if folder not in self._prepared_dirs:
            lock.prepare(folder)
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
        refusal = (lock.taken_over(save_dir) or ckpt.foreign_checkpoint(save_dir, tag, self.run_id)
                   if is_rank0() else None)
        refusal = gather(refusal)[0]
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
            barrier()  # the closing barrier of DeepSpeed's save_checkpoint, which this rank skipped
        self._raise_if_save_failed(save_dir, tag, failure)
        every = gather(written)
        fingerprints = gather(ds_state.state_fingerprint(engine))  # compared after a load, per rank
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
        barrier()
        return os.path.join(save_dir, tag)

    def _full_sidecar(self, save_dir: str) -> Dict[str, Any]:
        """Collective: the sidecar but the state fingerprints (rank 0's; {} on the others)."""
        swap_files = gather(ds_state.swapped_state_files(self._stages.engine))  # NVMe: each rank's saved files
        if not is_rank0():
            return {}
        swapped = {"swapped_state_files": swap_files} if any(f is not None for f in swap_files) else {}
        return {**self._sidecar(), "written_by": lock.holder_record(save_dir), **swapped}

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
            barrier()  # the closing barrier of DeepSpeed's save_checkpoint, which this rank skipped
        snapshot.end()
        self._raise_if_save_failed(save_dir, tag, failure)
        sidecar = self._full_sidecar(save_dir)
        run_id, keep_last, writer = self.run_id, self._options.keep_last, self._writer

        def publish(parts) -> None:  # rank 0's writer thread, once every rank's files are durable
            refusal = lock.taken_over(save_dir)
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
        raised here, on every rank (:class:`~ds_pseudo_real.checkpointing.background.BackgroundCheckpoints.poll`)."""
        if self.background is not None:
            self.background.poll()

    def wait(self, before: str = "going on") -> None:
        """Collective: until the checkpoint written in the background, if any, is published (or its failure
        raised); ``before`` is what waits, for the log line."""
        if self.background is not None:
            self.background.wait(before)

    def _raise_if_save_failed(self, save_dir: str, tag: str, failure: Optional[BaseException]) -> None:
        """Collective: every rank raises when any rank's part of the save failed; rank 0 removes the partial folder."""
        reports = gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        if any(reports):
            self._save_failed(save_dir, tag, reports, cause=failure)

    def _save_failed(self, save_dir: str, tag: str, reports, cause: Optional[BaseException] = None,
                     background: bool = False) -> None:
        """Collective, once ``reports`` (each rank's failure or None) name one: rank 0 removes the partial folder once
        every rank has stopped writing, and every rank raises the same CheckpointError."""
        ranks = [rank for rank, report in enumerate(reports) if report]
        staged = os.path.join(save_dir, ckpt.partial_tag(tag, self._writer))
        barrier()
        if is_rank0():
            shutil.rmtree(staged, ignore_errors=True)
        barrier()
        raise ckpt.CheckpointError(
            f"could not save checkpoint {os.path.join(save_dir, tag)} (rank {', '.join(map(str, ranks))}"
            f"{', written in the background' if background else ''}): {reports[ranks[0]]}; the partial folder "
            f"{staged} was removed and the run's state is intact; {ckpt.last_good(save_dir)}"
        ) from cause

    # ---- resuming --------------------------------------------------------------------------------------------
    def choose(self, load_dir: Optional[str], tag: Optional[str] = None, verify: Optional[str] = None
               ) -> Optional[Chosen]:
        """The checkpoint a load reads (see :meth:`~ds_pseudo_real.controller.PseudoToRealController.load_checkpoint`),
        verified and checked against this run's layout (:func:`.resume.choose`); None when ``load_dir`` holds none
        (the monitors are rewound: the run starts here). Collective. The controller then builds the engine of its
        stage and restores it."""
        self.wait("loading a checkpoint")
        if tag is None:
            if load_dir is None:
                raise ValueError("load_checkpoint: give load_dir, or tag as the path of a checkpoint folder")
            self._prepare_dir(load_dir)
        chosen = resume.choose(load_dir, tag, verify or self._options.verify, self._stages, self._run.state.stage)
        if chosen is None:
            self.rewind_monitors()
        return chosen

    def restore(self, chosen: Chosen, **kwargs) -> Tuple[str, Dict]:
        """``chosen`` (a DeepSpeed checkpoint) loaded into the current engine, which must be of its stage: the
        engine's state by DeepSpeed (``kwargs`` are ``load_checkpoint``'s), what DeepSpeed leaves out (NVMe-swapped
        sub-groups, the CPU Adam kernel's bias correction), checked against the state saved; then the plugin's
        state. Returns DeepSpeed's (path, client state)."""
        engine, load_dir, tag = self._stages.engine, chosen.load_dir, chosen.tag
        loading = dict(kwargs)
        if chosen.side.get("swapped_state_files") and ds_state.swapped_state_files(engine) is not None:
            # DeepSpeed loads ZeRO-3 weights without the optimizer state through zero_to_fp32, which cannot read
            # sub-groups swapped to NVMe; under NVMe its full load reads no optimizer state anyway (it only copies
            # the swap files): restore_swapped_state puts back the weights, and the moments only if asked
            loading["load_optimizer_states"] = True
        try:
            path, client = engine.load_checkpoint(load_dir, tag, **loading)
        except Exception as error:
            verified = chosen.verdict.ok and not chosen.verdict.legacy and chosen.mode != "none"
            raise ckpt.CheckpointError(
                f"DeepSpeed could not load checkpoint {chosen.folder}: {type(error).__name__}: {error}; "
                f"{'it verified' if verified else 'it was not verified'} (checkpoint.verify: {chosen.mode}); resume "
                f"from another one with --resume-from TAG|PATH: "
                f"{[c.tag for c in ckpt.list_checkpoints(load_dir) if c.tag != tag]}"
            ) from error
        if path is None:
            raise ckpt.CheckpointError(f"DeepSpeed could not load checkpoint {chosen.folder}")
        optimizer_loaded = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        restore_swapped_state(engine, chosen.folder, chosen.side, optimizer_loaded)
        if optimizer_loaded:
            ds_state.replay_cpu_adam_steps(engine)
        check_state_restored(engine, chosen.folder, chosen.side, optimizer_loaded)
        client = dict(client or {})
        self._resumed(chosen, client.pop(CLIENT_KEY))
        log_rank0(f"resumed from {chosen.folder} at step {engine.global_steps} ({self._run.state.stage} stage)")
        return path, client

    def restore_converted(self, chosen: Chosen) -> Tuple[str, Dict]:
        """``chosen`` (a checkpoint of ``ds-pseudo-real convert``), whose weights the current engine was built from
        (:meth:`Chosen.converted_weights`): its steps, LR schedule position and fp16 loss scaler, then the plugin's
        state; Adam moments start at zero."""
        engine = self._stages.engine
        trainer = torch.load(os.path.join(chosen.folder, "trainer_state.pt"), map_location="cpu", weights_only=False)
        EngineProgress(steps={"global_steps": trainer["global_steps"], "global_samples": trainer["global_samples"],
                              "skipped_steps": trainer["skipped_steps"],
                              "micro_steps": trainer["global_steps"] * engine.gradient_accumulation_steps()},
                       scheduler_state=trainer.get("lr_scheduler") if engine.lr_scheduler is not None else None,
                       lrs=[group["lr"] for group in engine.optimizer.param_groups], counters={},
                       loss_scale=trainer.get("loss_scale")).give_to(engine)
        if trainer.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
            sync_lr_with_scheduler(engine.lr_scheduler, engine.optimizer)
        client = dict(trainer.get("client_state") or {})
        self._resumed(chosen, client.pop(CLIENT_KEY, None))
        if chosen.side["stage"] == REAL:
            self._run.state.stage = REAL
            self._run.state.switch_step = self._run.state.switch_step or engine.global_steps
        log_rank0(f"loaded converted {chosen.side['stage']}-stage checkpoint {chosen.folder} at step "
                  f"{engine.global_steps}; Adam moments start at zero")
        return chosen.folder, client

    def _resumed(self, chosen: Chosen, plugin: Optional[Dict[str, Any]]) -> None:
        """The plugin's state restored (when saved), the monitors rewound to the step, the run going on as the
        checkpoint's."""
        if plugin is not None:
            state = self._run.state = TrainingState.from_dict(plugin["state"])
            state.groups = self._stages.groups  # checkpoints before progressive schedules do not record it
            if state.stage == REAL and self._pseudo_to_real:
                state.transitions_done = len(self._stages.stages) - 1
            self._run.callbacks.load_state_dict(plugin["callbacks"])
        self.rewind_monitors()
        self.run_id = chosen.run  # resumed: this run goes on as the checkpoint's

    def rewind_monitors(self) -> None:
        """See :meth:`~ds_pseudo_real.controller.PseudoToRealController.rewind_monitors`."""
        ds_state.rewind_monitors(self._stages.engine)
