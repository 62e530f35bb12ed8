"""Whether a checkpoint can be resumed from: its files against its manifest, each rank checking its share.

Owns: verification. Must not choose among checkpoints (``resume`` does), load anything (``engine_io`` does) nor write
checkpoints (``folders`` publishes them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..checksums import FileEntry, file_entry
from ..ranks import gather, rank_and_world
from .folders import MANIFEST, SIDECAR, SIDECAR_FORMAT, VerifyMode, _read_json, share_of


@dataclass
class Verdict:
    """What verifying one checkpoint found; ``problems`` is empty when it can be loaded. ``sidecar``: its
    ``pseudo_to_real.json`` as read for the check (None when that is missing or damaged)."""

    folder: Path
    mode: str
    problems: List[str] = field(default_factory=list)
    sidecar: Optional[Dict[str, Any]] = None
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


def _structure_problems(folder: Path) -> Tuple[List[str], Optional[Dict[str, Any]], Optional[Dict[str, Any]], bool]:
    """(problems, sidecar, manifest, legacy) from the folder, the sidecar and the manifest alone."""
    if not folder.is_dir():
        return [f"{folder} is not there"], None, None, False
    sidecar_path = folder / SIDECAR
    if not sidecar_path.is_file():
        return [f"{SIDECAR} is missing"], None, None, False
    sidecar = _read_json(sidecar_path)
    if sidecar is None:
        return [f"{SIDECAR} is not readable JSON"], None, None, False
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        if sidecar.get("format", 1) < SIDECAR_FORMAT:
            return [], sidecar, None, True
        return [f"{MANIFEST} is missing"], sidecar, None, False
    manifest = _read_json(manifest_path)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return [f"{MANIFEST} is not readable"], sidecar, None, False
    return [], sidecar, manifest, False


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
    problems, sidecar, manifest, legacy = _structure_problems(folder)
    verdict = Verdict(folder, mode, problems, sidecar, legacy=legacy)
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
