"""Checkpoint folders on disk: atomic publication, the plugin's sidecar, the manifest, clean-up of crashed saves,
and retention (``verify`` checks a folder against its manifest, ``resume`` chooses the one a resume reads).

Owns: the folder layout (``<tag>.<writer>.partial`` while written, renamed to ``<tag>``; ``latest``; ``<tag>.invalid``
for a damaged checkpoint moved aside; ``run.lock``, see ``lock``), ``pseudo_to_real.json`` (stage, step, layout,
the run it belongs to) and ``manifest.json`` (size and crc32 of every file). Knows nothing of DeepSpeed (``engine_io``
decides what to save and load) nor of ranks: its functions are rank 0's. Assumes one file system shared by all
ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..checksums import FileEntry, file_entry
from ..logs import logger

SIDECAR = "pseudo_to_real.json"
MANIFEST = "manifest.json"
CLIENT_KEY = "ds_pseudo_real"  # the plugin's entry in DeepSpeed's client_state
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"
INVALID_SUFFIX = ".invalid"
RETIRED_SUFFIX = ".old"
SIDECAR_FORMAT = 2  # 1: no manifest (written before verification existed)
_STEP_IN_TAG = re.compile(r"(\d+)$")
_DEFAULT_TAG = re.compile(r"global_step\d+")  # the tag DeepSpeed and the plugin give a checkpoint by default


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or resumed from; the message says which one, why, and what to do."""


class VerifyMode(str, Enum):
    CHECKSUM = "checksum"  # sizes and crc32 of every file (reads every byte)
    SIZE = "size"  # sizes only
    NONE = "none"  # only that the sidecar and manifest are there and readable


def partial_tag(tag: str, writer: str = "") -> str:
    """The folder ``tag`` is written into before it is published, named after the run writing it (``writer``)."""
    return f"{tag}.{writer}{PARTIAL_SUFFIX}" if writer else tag + PARTIAL_SUFFIX


def list_files(folder: Path) -> List[str]:
    """Every regular file under ``folder`` (relative, sorted), the manifest itself excepted."""
    return sorted(
        str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST
    )


def share_of(sizes: Dict[str, int], rank: int, world: int) -> List[str]:
    """This rank's part of the files, balanced by bytes (largest first onto the least loaded rank)."""
    loads = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = loads.index(min(loads))
        loads[target] += sizes[name]
        if target == rank:
            mine.append(name)
    return mine


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # never another writer's temporary file
    with open(tmp, "x") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---- writing ----------------------------------------------------------------------------------------------------
def run_of(sidecar: Dict[str, Any]) -> str:
    """The run a checkpoint belongs to: the id of the run that began its history from step 0 (a resumed run goes on
    under the id of the checkpoint it resumed from); "" for checkpoints written before runs were recorded."""
    return sidecar.get("run_id", "")


def foreign_checkpoint(save_dir: str, tag: str, run_id: str) -> Optional[str]:
    """Why the run ``run_id`` must not publish ``tag`` into ``save_dir``: another run's checkpoint (or a folder that
    is no checkpoint) has that name, and publishing would replace it. None when the name is free or this run's own."""
    folder = Path(save_dir) / tag
    if not folder.exists():
        return None
    sidecar = _read_json(folder / SIDECAR)
    if sidecar is not None and run_of(sidecar) == run_id:
        return None
    if sidecar is None:
        what = "a folder that is not a complete checkpoint"
    else:
        writer = sidecar.get("written_by") or {}
        what = (f"a checkpoint (step {sidecar.get('global_step')}) of another run, {run_of(sidecar) or 'not recorded'}"
                + (f" (written on host {writer.get('host')} by pid {writer.get('pid')} at {writer.get('started')})"
                   if writer else ""))
    return (f"{folder} is {what}, which this run ({run_id or 'not recorded'}) would replace; checkpoints of another "
            f"run are never replaced: move it out of {save_dir}, or save into another folder (a run resumed from a "
            f"checkpoint goes on as that checkpoint's run, and replaces that run's later checkpoints)")


def publish(save_dir: str, tag: str, sidecar: Dict[str, Any], written: Optional[Dict[str, FileEntry]] = None,
            writer: str = "") -> None:
    """Rank 0, after every rank finished writing ``partial_tag(tag, writer)``: add the sidecar and the manifest
    (entries of ``written``, checksummed while they were written; every other file is read here), then rename it to
    ``<tag>`` and point ``latest`` at it."""
    root = Path(save_dir)
    staged = root / partial_tag(tag, writer)
    write_atomic(staged / SIDECAR, json.dumps(dict(sidecar, format=SIDECAR_FORMAT), indent=1))
    entries = dict(written or {})
    for name in list_files(staged):
        if name not in entries:
            entries[name] = file_entry(staged / name)
    manifest = {"format": 1, "tag": tag, "global_step": sidecar.get("global_step"), "checksum": "crc32",
                "files": dict(sorted(entries.items()))}
    write_atomic(staged / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(staged)
    final = root / tag
    if final.exists():
        retired = root / (tag + RETIRED_SUFFIX)
        _remove_tree(retired)
        os.replace(final, retired)
        os.replace(staged, final)
        _remove_tree(retired)
    else:
        os.replace(staged, final)
    write_atomic(root / LATEST, tag)
    _fsync_dir(root)


def remove_stale(save_dir: str) -> List[str]:
    """Rank 0, at start: remove ``.partial`` folders of saves that never finished, and put back a ``<tag>.old``
    whose replacement never arrived. Returns what was done, one line each (also logged)."""
    root = Path(save_dir)
    done = []
    if not root.is_dir():
        return done
    for path in sorted(root.iterdir()):
        if path.is_dir() and path.name.endswith(PARTIAL_SUFFIX):
            _remove_tree(path)
            done.append(f"removed {path}: a save that did not finish")
        elif path.is_dir() and path.name.endswith(RETIRED_SUFFIX):
            final = root / path.name[: -len(RETIRED_SUFFIX)]
            if final.exists():
                _remove_tree(path)
                done.append(f"removed {path}: replaced by {final.name}")
            else:
                os.replace(path, final)
                done.append(f"restored {final} from {path.name}: its replacement was never published")
        elif path.is_file() and path.name.endswith(".tmp"):
            path.unlink()
            done.append(f"removed {path}: an unfinished write")
    for line in done:
        logger.info(line)
    return done


# ---- reading ----------------------------------------------------------------------------------------------------
def read_sidecar(load_dir: str, tag: str) -> Dict[str, Any]:
    path = Path(load_dir) / tag / SIDECAR
    if not path.is_file():
        raise CheckpointError(f"{path} not found: {load_dir}/{tag} is not a complete ds_pseudo_real checkpoint")
    try:
        return json.loads(path.read_bytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is damaged: {error}") from None


def read_latest(load_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """(the tag ``latest`` names, or None; what is wrong with ``latest``, or None)."""
    path = Path(load_dir) / LATEST
    if not path.is_file():
        return None, None
    try:
        tag = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{path} holds bytes that are not a tag"
    if not tag or not tag.isprintable() or "/" in tag:
        return None, f"{path} holds {tag[:40]!r}, not a tag"
    if not (Path(load_dir) / tag).is_dir():
        return tag, f"{path} names {tag!r}, which is not there"
    return tag, None


def latest_tag(load_dir: str) -> Optional[str]:
    """The tag ``latest`` names when that checkpoint is complete (has its sidecar), else None. Resuming uses
    :func:`.resume.select_resume`, which also checks the files and falls back to older checkpoints."""
    tag, problem = read_latest(load_dir)
    if tag is None or problem is not None:
        return None
    return tag if (Path(load_dir) / tag / SIDECAR).is_file() else None


@dataclass
class Candidate:
    tag: str
    step: int  # -1 when neither the sidecar, the manifest nor the tag tells
    stage: Optional[str] = None


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_bytes().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _looks_like_checkpoint(path: Path) -> bool:
    if (path / SIDECAR).exists() or (path / MANIFEST).exists() or _DEFAULT_TAG.fullmatch(path.name):
        return True
    return any(path.glob("*model_states.pt"))


def list_checkpoints(load_dir: str) -> List[Candidate]:
    """The checkpoint folders in ``load_dir``, complete or damaged, newest (highest step) first; folders being
    written, moved aside or retired are not candidates."""
    root = Path(load_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if not path.is_dir() or name.startswith(".") or INVALID_SUFFIX in name:
            continue
        if name.endswith((PARTIAL_SUFFIX, RETIRED_SUFFIX)) or not _looks_like_checkpoint(path):
            continue
        meta = _read_json(path / SIDECAR) or _read_json(path / MANIFEST) or {}
        step = meta.get("global_step")
        if not isinstance(step, int):
            match = _STEP_IN_TAG.search(name)
            step = int(match.group(1)) if match else -1
        found.append((step, path.stat().st_mtime, Candidate(name, step, meta.get("stage"))))
    return [c for *_, c in sorted(found, key=lambda item: (item[0], item[1]), reverse=True)]


def resolve(load_dir: Optional[str], tag_or_path: str) -> Tuple[str, str]:
    """(folder, tag) for ``--resume-from``: a tag inside ``load_dir``, or the path of a checkpoint folder."""
    if load_dir is not None and (Path(load_dir) / tag_or_path).is_dir():
        return load_dir, tag_or_path
    path = Path(tag_or_path)
    if path.is_dir():
        resolved = path.resolve()
        return str(resolved.parent), resolved.name
    raise CheckpointError(
        f"--resume-from {tag_or_path!r}: no such checkpoint (neither a tag in {load_dir} nor a folder); "
        f"checkpoints there: {[c.tag for c in list_checkpoints(load_dir)] if load_dir else []}"
    )


def last_good(save_dir: str) -> str:
    """Words for the newest complete checkpoint in ``save_dir`` (for error messages)."""
    tag = latest_tag(save_dir)
    if tag is None:
        return f"there is no complete checkpoint in {save_dir} yet"
    step = read_sidecar(save_dir, tag).get("global_step")
    return f"the last good checkpoint is {Path(save_dir) / tag} (step {step})"


def prune(save_dir: str, keep_last: Optional[int], run_id: str = "") -> List[str]:
    """Rank 0, after a checkpoint was published: of the run ``run_id``'s complete checkpoints, keep the
    ``keep_last`` newest and the newest pseudo-stage one (what ``ds-pseudo-real convert`` needs); delete the others.
    Other runs' checkpoints, damaged, moved-aside and foreign folders are never touched. Returns the tags removed
    (also logged)."""
    if keep_last is None:
        return []
    sidecars = {c.tag: _read_json(Path(save_dir) / c.tag / SIDECAR) for c in list_checkpoints(save_dir)}
    complete = [c for c in list_checkpoints(save_dir) if sidecars[c.tag] is not None and run_of(sidecars[c.tag]) == run_id]
    keep = {c.tag for c in complete[:keep_last]}
    pseudo = next((c for c in complete if c.stage == "pseudo"), None)
    if pseudo is not None:
        keep.add(pseudo.tag)
    removed = [c.tag for c in complete if c.tag not in keep]
    for tag in removed:
        _remove_tree(Path(save_dir) / tag)
        logger.info(f"removed checkpoint {Path(save_dir) / tag} (checkpoint.keep_last: {keep_last})")
    return removed
