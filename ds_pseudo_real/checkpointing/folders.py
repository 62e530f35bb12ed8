"""Checkpoint folders on disk: atomic publication, the plugin's sidecar, a verified manifest, resume selection,
clean-up of crashed saves, and retention.

Owns: the folder layout (``<tag>.<writer>.partial`` while written, renamed to ``<tag>``; ``latest``; ``<tag>.invalid``
for a damaged checkpoint moved aside; ``run.lock``, see ``run_lock``), ``pseudo_to_real.json`` (stage, step, layout,
the run it belongs to) and ``manifest.json`` (size and crc32 of every file). Knows nothing of DeepSpeed: the
controller decides what to save and load. Functions marked collective must be called on every rank when
torch.distributed is initialized (they split the checksum work between ranks and agree on the outcome); the rest
are rank 0's. Assumes one file system shared by all ranks.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
import zlib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import run_lock
from .logs import logger

SIDECAR = "pseudo_to_real.json"
MANIFEST = "manifest.json"
CLIENT_KEY = "ds_pseudo_real"  # the plugin's entry in DeepSpeed's client_state
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"
INVALID_SUFFIX = ".invalid"
RETIRED_SUFFIX = ".old"
SIDECAR_FORMAT = 2  # 1: no manifest (written before verification existed)
CHUNK = 16 << 20
_STEP_IN_TAG = re.compile(r"(\d+)$")
_DEFAULT_TAG = re.compile(r"global_step\d+")  # the tag DeepSpeed and the plugin give a checkpoint by default

FileEntry = Dict[str, Any]  # {"size": bytes, "crc32": "8 hex digits"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or resumed from; the message says which one, why, and what to do."""


class VerifyMode(str, Enum):
    CHECKSUM = "checksum"  # sizes and crc32 of every file (reads every byte)
    SIZE = "size"  # sizes only
    NONE = "none"  # only that the sidecar and manifest are there and readable


def partial_tag(tag: str, writer: str = "") -> str:
    """The folder ``tag`` is written into before it is published, named after the run writing it (``writer``)."""
    return f"{tag}.{writer}{PARTIAL_SUFFIX}" if writer else tag + PARTIAL_SUFFIX


def log(message: str) -> None:
    logger.info(message)


def warn(message: str) -> None:
    logger.warning(message)


# ---- collectives (no-ops in a single process) ----------------------------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> Tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def gather(obj: Any) -> List[Any]:
    """``obj`` of every rank, in rank order (collective)."""
    dist = _dist()
    if dist is None:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


# ---- files ------------------------------------------------------------------------------------------------------
class ChecksumWriter:
    """A write-only file object that keeps the size and crc32 of what passes through it, and the OSError the file
    raised, if any (``torch.save`` turns it into its own "unexpected pos" RuntimeError)."""

    def __init__(self, handle):
        self.handle = handle
        self.size = 0
        self.crc = 0
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            written = self.handle.write(data)
        except OSError as error:
            self.error = error
            raise
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(memoryview(data).cast("B"))
        return written

    def flush(self) -> None:
        self.handle.flush()

    def entry(self) -> FileEntry:
        return {"size": self.size, "crc32": f"{self.crc:08x}"}


def save_with_checksum(save: Callable[[Any], None], path: str) -> FileEntry:
    """Run ``save(file_object)`` into ``path``, flushed and fsynced; returns the file's manifest entry. Raises the
    file system's OSError (e.g. ``[Errno 28] No space left on device``, with the path) when a write fails."""
    with open(path, "wb") as handle:
        writer = ChecksumWriter(handle)
        try:
            save(writer)
            handle.flush()
            os.fsync(handle.fileno())
        except Exception as error:
            cause = writer.error or (error if isinstance(error, OSError) else None)
            if cause is not None:
                raise OSError(cause.errno, cause.strerror, path) from error
            raise
    return writer.entry()


def file_entry(path: Path, checksum: bool = True) -> FileEntry:
    size = path.stat().st_size
    if not checksum:
        return {"size": size}
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": size, "crc32": f"{crc:08x}"}


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
def _lock(folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        run_lock.acquire(folder)
    except (OSError, run_lock.FolderInUse) as error:
        raise CheckpointError(str(error)) from None


def claim(folder: str) -> None:
    """Make ``folder`` and hold its lock (``run_lock``) on rank 0 for the life of this process, so that no other run
    writes into it meanwhile; every rank raises the same CheckpointError, naming the run that holds it, when another
    one does (collective)."""
    failure = None
    if rank_and_world()[0] == 0:
        try:
            _lock(folder)
        except CheckpointError as error:
            failure = str(error)
    failure = gather(failure)[0]
    if failure is not None:
        raise CheckpointError(failure)


@contextlib.contextmanager
def holding(folder: str) -> Iterator[None]:
    """``claim`` for one process that writes into ``folder`` for a while (``ds-pseudo-real convert``): the lock is
    given up after the block, unless this process held it before."""
    held_before = run_lock.holds(folder)
    _lock(folder)
    try:
        yield
    finally:
        if not held_before:
            run_lock.release(folder)


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
        log(line)
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
    :func:`select_resume`, which also checks the files and falls back to older checkpoints."""
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


@dataclass
class Verdict:
    """What verifying one checkpoint found; ``problems`` is empty when it can be loaded."""

    folder: Path
    mode: str
    problems: List[str] = field(default_factory=list)
    files: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    legacy: bool = False  # written before manifests: nothing to check the files against

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.legacy:
            return f"{self.folder} has no {MANIFEST} (written by an older version): loaded without verification"
        if self.mode == VerifyMode.NONE.value:
            return f"{self.folder}: file verification is off (checkpoint.verify: none)"
        rate = self.nbytes / max(self.seconds, 1e-9) / 2**30
        return (f"verified {self.folder}: {self.files} files, {self.nbytes / 2**20:,.1f} MiB, "
                f"{self.mode} in {self.seconds:.2f} s ({rate:.2f} GiB/s)")


def _structure_problems(folder: Path) -> Tuple[List[str], Optional[Dict[str, Any]], bool]:
    """(problems, manifest, legacy) from the folder, the sidecar and the manifest alone."""
    if not folder.is_dir():
        return [f"{folder} is not there"], None, False
    sidecar_path = folder / SIDECAR
    if not sidecar_path.is_file():
        return [f"{SIDECAR} is missing"], None, False
    sidecar = _read_json(sidecar_path)
    if sidecar is None:
        return [f"{SIDECAR} is not readable JSON"], None, False
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        if sidecar.get("format", 1) < SIDECAR_FORMAT:
            return [], None, True
        return [f"{MANIFEST} is missing"], None, False
    manifest = _read_json(manifest_path)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return [f"{MANIFEST} is not readable"], None, False
    return [], manifest, False


def _check_file(folder: Path, name: str, expected: FileEntry, checksum: bool) -> Optional[str]:
    path = folder / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != expected["size"]:
        return f"{name} has {size:,} bytes, the manifest says {expected['size']:,} (cut short or overwritten)"
    if checksum and file_entry(path)["crc32"] != expected["crc32"]:
        return f"{name} fails its crc32 check (contents changed since it was saved)"
    return None


def verify(load_dir: str, tag: str, mode: str = VerifyMode.CHECKSUM.value) -> Verdict:
    """Check ``load_dir/tag`` against its manifest (collective: each rank reads its share of the files)."""
    mode = VerifyMode(mode).value
    folder = Path(load_dir) / tag
    problems, manifest, legacy = _structure_problems(folder)
    verdict = Verdict(folder, mode, problems, legacy=legacy)
    if problems or legacy or mode == VerifyMode.NONE.value:
        return verdict
    files: Dict[str, FileEntry] = manifest["files"]
    rank, world = rank_and_world()
    start = time.perf_counter()
    mine = share_of({name: entry["size"] for name, entry in files.items()}, rank, world)
    checksum = mode == VerifyMode.CHECKSUM.value
    found = [p for p in (_check_file(folder, name, files[name], checksum) for name in mine) if p]
    results = gather((found, time.perf_counter() - start))
    verdict.problems = sorted(p for part, _ in results for p in part)
    verdict.seconds = max(seconds for _, seconds in results)
    verdict.files = len(files)
    verdict.nbytes = sum(entry["size"] for entry in files.values())
    return verdict


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
        warn(f"{latest_problem}; looking for the newest checkpoint that verifies")
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
            warn(f"checkpoint {root / bad.tag} (step {bad.step}) is damaged: {'; '.join(bad_verdict.problems)}{where}; "
                 f"resuming from the newest one that verifies, {candidate.tag} (step {candidate.step})")
        if move_aside and latest != candidate.tag:
            write_atomic(root / LATEST, candidate.tag)
    barrier()
    return candidate.tag, verdict


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
        log(f"removed checkpoint {Path(save_dir) / tag} (checkpoint.keep_last: {keep_last})")
    return removed
