"""Which checkpoint a resume reads and whether this run may, and did, resume from it.

Owns: choosing a checkpoint and refusing one that does not verify, refusing one whose layout (layers, stage, ZeRO
stage, ranks) this run cannot load before DeepSpeed reads it, and comparing the state DeepSpeed's load restored
with the one saved. Must not load, save or build anything (``checkpoint_io`` loads, the stage builder builds) nor
lay out folders (``checkpoint`` does).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from . import checkpoint as ckpt
from . import ds_state
from .callbacks import PSEUDO, REAL
from .config import ConfigError
from .stages import StageBuilder


def choose(load_dir: Optional[str], tag: Optional[str], mode: str) -> Optional[Tuple[str, str, ckpt.Verdict]]:
    """The checkpoint a load reads, as (folder of checkpoints, tag, its verdict under ``checkpoint.verify``
    ``mode``): with no ``tag`` the newest in ``load_dir`` that verifies
    (:func:`~ds_pseudo_real.checkpoint.select_resume`; None when there is none), else ``load_dir/tag`` (or ``tag``
    as a path), which must verify."""
    if tag is None:
        chosen = ckpt.select_resume(load_dir, mode)
        return None if chosen is None else (load_dir, *chosen)
    load_dir, tag = ckpt.resolve(load_dir, tag)
    verdict = ckpt.verify(load_dir, tag, mode)
    if not verdict.ok:
        raise ckpt.CheckpointError(
            f"checkpoint {verdict.folder} cannot be loaded: {'; '.join(verdict.problems)}"
        )
    return load_dir, tag, verdict


def check_compatible(stages: StageBuilder, stage: str, load_dir: str, tag: str, side: Dict[str, Any]) -> None:
    """Refuse, before DeepSpeed reads anything, a checkpoint (its sidecar ``side``) that this run, with the engine
    ``stages`` holds and in ``stage`` (``pseudo`` or ``real``), cannot load, saying what to do instead."""
    where = f"checkpoint {os.path.join(load_dir, tag)}"
    if side["num_layers"] != stages.num_layers or side["layers"] != stages.layer_path:
        raise ConfigError(
            f"{where} has {side['num_layers']} layers at {side['layers']!r}; "
            f"this model has {stages.num_layers} at {stages.layer_path!r}"
        )
    converted = f"{os.path.normpath(load_dir)}_converted"
    if side["stage"] == PSEUDO and stage == REAL:
        raise ConfigError(
            f"{where} is a pseudo-stage checkpoint but this run is in the real stage "
            f"(pseudo_to_real.enabled is false?); expand it to the real model with `ds-pseudo-real convert "
            f"--to-real --input {load_dir} --tag {tag} --output {converted}` and resume from "
            f"{os.path.join(converted, tag)}"
        )
    saved = (side.get("depth", stages.num_layers), side["groups"])
    if side["stage"] == PSEUDO and saved not in stages.stages:
        groups = [groups for _, groups in stages.stages]
        raise ConfigError(f"{where} has {saved[1]} parameter groups of {saved[0]} layers; this run's stages have "
                          f"{groups[:-1] if groups[-1] == stages.num_layers else groups}"
                          f" (pseudo_to_real.groups or schedule)")
    if side["kind"] == "converted":
        return
    world = ckpt.rank_and_world()[1]
    zero = stages.engine.zero_optimization_stage()
    saved_world, saved_zero = side.get("world_size", world), side.get("zero_stage", zero)
    if saved_zero != zero or (zero > 0 and saved_world != world):
        raise ckpt.CheckpointError(
            f"{where} was saved by {saved_world} ranks at ZeRO stage {saved_zero}; this run has {world} ranks at "
            f"ZeRO stage {zero}, and DeepSpeed's ZeRO optimizer state only loads on the layout that saved it. "
            f"Convert it, then resume from the converted one, which keeps the weights, steps, LR schedule, "
            f"trigger state and its stage (a pseudo-stage one goes on in the pseudo stage and delinks where "
            f"configured); Adam moments start at zero:\n  ds-pseudo-real convert --input {load_dir} --tag {tag} "
            f"--output {converted}\nand run with --resume-from {os.path.join(converted, tag)} "
            f"(or go back to {saved_world} ranks at ZeRO stage {saved_zero})"
        )


def check_state_restored(engine, folder: str, side: Dict[str, Any], optimizer_loaded: bool) -> None:
    """Collective: raise :class:`~ds_pseudo_real.checkpoint.CheckpointError` on every rank when DeepSpeed's load
    left any rank with other weights, or (when it loaded the optimizer state) other fp32 masters or moments, than
    that rank saved (its :func:`~ds_pseudo_real.ds_state.state_fingerprint` in the sidecar), instead of training
    on from them. Checkpoints saved without fingerprints are not checked."""
    saved = side.get("state")
    rank, world = ckpt.rank_and_world()
    if saved is not None and len(saved) != world:  # ZeRO 0 on another world size: every rank holds all
        saved = [saved[0]] * world if engine.zero_optimization_stage() == 0 else None
    expected = saved[rank] if saved is not None else None
    found = ds_state.state_fingerprint(engine) if expected is not None else None
    differ = []
    for part in ("weights", "optimizer") if optimizer_loaded else ("weights",):
        if found is not None and expected.get(part) is not None and any(
                abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(found[part], expected[part])):
            differ.append(part)
    reports = ckpt.gather(differ)
    ranks = [r for r, parts in enumerate(reports) if parts]
    if ranks:
        names = {"weights": "weights", "optimizer": "optimizer state (fp32 masters, moments)"}
        what = " and ".join(names[p] for p in names if any(p in parts for parts in reports))
        swapped = " (ZeRO-3 with offload_optimizer nvme: the swapped sub-groups were read from the checkpoint's "\
                  "offloaded_tensors files)" if ds_state.swapped_sub_groups(engine) else ""
        here = (f"; on rank {rank}: " + ", ".join(f"{p} sum and sum of squares {found[p]}, saved {expected[p]}"
                                                  for p in differ)) if differ else ""
        raise ckpt.CheckpointError(
            f"DeepSpeed loaded checkpoint {folder}, but the {what} of rank {', '.join(map(str, ranks))} are not "
            f"the ones saved{swapped}{here}; training on would silently start from another state")
