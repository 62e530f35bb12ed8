"""Files written with their size and crc32 taken as the bytes pass, and the same read back: what a checkpoint's
manifest records of each file.

Owns: the checksummed writer and a file's entry. Must not know checkpoints' folders (``checkpointing.folders``).
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Optional

FileEntry = Dict[str, Any]  # {"size": bytes, "crc32": "8 hex digits"}
CHUNK = 16 << 20


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
