"""Atomic checkpoint folders and the plugin's sidecar file.

Owns: writing a tag under a temporary name and renaming it into place, the ``latest`` pointer (replaced
atomically), and ``pseudo_to_real.json`` (stage, step, layout) read before the engine loads anything. A crash
mid-write leaves the previous checkpoint and ``latest`` untouched. Assumes one filesystem shared by all ranks.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

SIDECAR = "pseudo_to_real.json"
CLIENT_KEY = "ds_pseudo_real"  # the plugin's entry in DeepSpeed's client_state
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"


def partial_tag(tag: str) -> str:
    return tag + PARTIAL_SUFFIX


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def publish(save_dir: str, tag: str, sidecar: Dict[str, Any]) -> None:
    """Rank 0, after every rank finished writing ``<tag>.partial``: make it the checkpoint ``tag`` and ``latest``."""
    root = Path(save_dir)
    staged = root / partial_tag(tag)
    write_atomic(staged / SIDECAR, json.dumps(sidecar, indent=1))
    final = root / tag
    if final.exists():
        retired = root / (tag + ".old")
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        os.replace(staged, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staged, final)
    write_atomic(root / LATEST, tag)


def latest_tag(load_dir: str) -> Optional[str]:
    path = Path(load_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    return tag if (Path(load_dir) / tag / SIDECAR).is_file() else None


def read_sidecar(load_dir: str, tag: str) -> Dict[str, Any]:
    path = Path(load_dir) / tag / SIDECAR
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {load_dir}/{tag} is not a complete ds_pseudo_real checkpoint")
    return json.loads(path.read_text())
