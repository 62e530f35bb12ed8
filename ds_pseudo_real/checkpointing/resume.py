"""Which checkpoint a resume reads and whether this run may resume from it.

Owns: choosing a checkpoint (the newest that verifies; damaged newer ones moved aside, never deleted) and refusing
one that does not verify, and refusing one whose layout (layers, stage, ZeRO stage, ranks) this run cannot load
before DeepSpeed reads it. Must not load, save or build anything (``engine_io`` loads and checks what the load
restored, the run's stage builder builds) nor lay out folders (``folders`` does).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..callbacks import PSEUDO, REAL
from ..config import ConfigError
from ..logs import logger
from ..ranks import barrier, rank_and_world
from . import folders as ckpt
from .folders import (
    INVALID_SUFFIX, LATEST, Candidate, CheckpointError, VerifyMode, list_checkpoints, read_latest, write_atomic,
)
from .verify import Verdict, verify


def choose(load_dir: Optional[str], tag: Optional[str], mode: str, stages, stage: str) -> Optional["Chosen"]:
    """The checkpoint a load reads, verified under ``checkpoint.verify`` ``mode`` and checked against this run
    (:func:`check_compatible`, with ``stages`` and ``stage``): with no ``tag`` the newest in ``load_dir`` that
    verifies (:func:`select_resume`; None when there is none), else ``load_dir/tag`` (or ``tag`` as a path), which
    must verify. Collective."""
    if tag is None:
        found = select_resume(load_dir, mode)
        if found is None:
            return None
        tag, verdict = found
    else:
        load_dir, tag = ckpt.resolve(load_dir, tag)
        verdict = verify(load_dir, tag, mode)
        if not verdict.ok:
            raise CheckpointError(f"checkpoint {verdict.folder} cannot be loaded: {'; '.join(verdict.problems)}")
    logger.info(verdict.summary())  # rank 0's line
    check_compatible(stages, stage, load_dir, tag, verdict.sidecar)
    return Chosen(load_dir, tag, verdict, verdict.sidecar, mode)


def _aside_name(root: Path, tag: str) -> Path:
    target = root / (tag + INVALID_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = root / f"{tag}{INVALID_SUFFIX}.{n}"
    return target


def select_resume(load_dir: str, mode: str = VerifyMode.CHECKSUM.value,
                  move_aside: bool = True) -> Optional[Tuple[str, Verdict]]:
    """The newest checkpoint in ``load_dir`` that verifies, with its verdict; None when there is no checkpoint at
    all (collective). A damaged newer one is named in a warning and, with ``move_aside``, renamed to
    ``<tag>.invalid`` (never deleted); ``latest`` is pointed at the one chosen. Raises CheckpointError when
    checkpoints exist but none verifies, listing each and why."""
    rank, _ = rank_and_world()
    latest, latest_problem = read_latest(load_dir)
    if latest_problem and rank == 0:
        logger.warning(f"{latest_problem}; looking for the newest checkpoint that verifies")
    candidates = list_checkpoints(load_dir)
    if not candidates:
        if latest is not None or latest_problem is not None:
            raise CheckpointError(
                f"{load_dir} has a '{LATEST}' file but no checkpoint folder "
                f"({latest_problem or f'it names {latest!r}'}); "
                f"resume from another folder with --resume-from, or start over explicitly with --no-resume"
            )
        return None
    rejected: List[Tuple[Candidate, Verdict]] = []
    for candidate in candidates:
        verdict = verify(load_dir, candidate.tag, mode)
        if verdict.ok:
            break
        rejected.append((candidate, verdict))
    else:
        listing = "\n".join(f"  {c.tag} (step {c.step}): {'; '.join(v.problems)}" for c, v in rejected)
        raise CheckpointError(
            f"no checkpoint in {load_dir} can be resumed from:\n{listing}\n"
            f"nothing was moved or deleted; pick one with --resume-from TAG|PATH, "
            f"or start over explicitly with --no-resume"
        )
    root = Path(load_dir)
    if rank == 0:
        for bad, bad_verdict in rejected:
            where = ""
            if move_aside:
                target = _aside_name(root, bad.tag)
                os.replace(root / bad.tag, target)
                where = f"; moved aside to {target.name}"
            logger.warning(f"checkpoint {root / bad.tag} (step {bad.step}) is damaged: "
                           f"{'; '.join(bad_verdict.problems)}{where}; resuming from the newest one that verifies, "
                           f"{candidate.tag} (step {candidate.step})")
        if move_aside and latest != candidate.tag:
            write_atomic(root / LATEST, candidate.tag)
    barrier()
    return candidate.tag, verdict


def check_compatible(stages, stage: str, load_dir: str, tag: str, side: Dict[str, Any]) -> None:
    """Refuse, before DeepSpeed reads anything, a checkpoint (its sidecar ``side``) that this run cannot load, saying
    what to do instead. ``stages``: what the run's stage builder holds, read only (its ``engine``, ``layer_path``,
    ``num_layers`` and ``stages``, the (layers, parameter groups) of each stage); ``stage``: ``pseudo`` or ``real``."""
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
    world = rank_and_world()[1]
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


@dataclass(frozen=True)
class Chosen:
    """A checkpoint chosen to resume from: in ``load_dir`` as ``tag``, its verdict, its sidecar and the
    ``checkpoint.verify`` mode it was checked under."""

    load_dir: str
    tag: str
    verdict: Verdict
    side: Dict[str, Any]
    mode: str

    @property
    def folder(self) -> str:
        return os.path.join(self.load_dir, self.tag)

    @property
    def run(self) -> str:
        """The run it belongs to, which a run resuming from it goes on as."""
        return ckpt.run_of(self.side)

    @property
    def converted(self) -> bool:
        return self.side["kind"] == "converted"

    def stage(self, num_layers: int) -> Tuple[int, int]:
        """(layers, parameter groups) of the model it holds, for a model of ``num_layers`` layers."""
        if self.side["stage"] == REAL:
            return num_layers, num_layers
        return self.side.get("depth", num_layers), self.side["groups"]

    def converted_weights(self) -> Dict[str, torch.Tensor]:
        """A converted checkpoint's fp32 weights by parameter name, for the stage builder."""
        return torch.load(os.path.join(self.folder, "model_fp32.pt"), map_location="cpu", weights_only=True)
