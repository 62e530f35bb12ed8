"""The embedded default corpus: bytes of the Python standard library's own source files.

Every machine with Python has it, so the demo needs no download. Files are split into train and validation by a
hash of their relative path (deterministic, independent of file order), and batches are drawn as a pure function
of (seed, step, rank): resuming at step N reproduces the data order without saving sampler state.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch


def stdlib_source_files(root: Optional[Path] = None) -> List[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation_file(relative_path: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < val_fraction


class ByteCorpus:
    """Train and validation byte streams, each capped at ``max_bytes`` (taken in file order)."""

    def __init__(self, root: Optional[Path] = None, val_fraction: float = 0.05, max_bytes: int = 8 << 20):
        root = Path(root or sysconfig.get_paths()["stdlib"])
        train, val = [], []
        sizes = [0, 0]
        for path in stdlib_source_files(root):
            is_val = is_validation_file(path.relative_to(root).as_posix(), val_fraction)
            budget = max_bytes if not is_val else max(max_bytes * val_fraction, 1 << 16)
            if sizes[is_val] >= budget:
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            (val if is_val else train).append(data)
            sizes[is_val] += len(data)
        if not train or not val:
            raise RuntimeError(f"no Python source files found under {root}")
        self.train = torch.from_numpy(np.frombuffer(b"".join(train), dtype=np.uint8).copy())
        self.val = torch.from_numpy(np.frombuffer(b"".join(val), dtype=np.uint8).copy())

    def batch(self, split: str, batch_size: int, seq_len: int, seed: int, step: int, rank: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, ``batch_size x seq_len`` int64, a pure function of its arguments."""
        data = self.train if split == "train" else self.val
        key = hashlib.sha256(f"{seed}/{split}/{step}/{rank}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        return window[:, :-1], window[:, 1:]
