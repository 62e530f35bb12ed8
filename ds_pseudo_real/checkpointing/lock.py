"""The lock that keeps two runs out of one output folder: ``<folder>/run.lock``, held by the process that took it
until that process ends.

Owns: taking the lock (``fcntl.flock``, exclusive, without waiting), the holder's record in the file (host, pid,
start time, command) and reading it back for error messages, checks and the line naming a run it takes over from.
Also a run's claim on a folder: :func:`claim` takes the lock on rank 0 and gives every rank the outcome (another
run's lock is a :class:`~ds_pseudo_real.checkpointing.CheckpointError` naming it), :func:`prepare` also clears what
crashed saves left. Knows nothing of torch.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Any, Dict, Iterator, Optional, Tuple

from ..logs import logger
from ..ranks import barrier, gather, rank_and_world
from . import folders

LOCK_FILE = "run.lock"
_HELD: Dict[str, Tuple[int, Dict[str, Any]]] = {}  # by real path: (descriptor, the record written) of each lock held
# flock() answers these where the file system keeps no locks (Lustre without -o flock, some FUSE file systems)
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class FolderInUse(RuntimeError):
    """Another run holds the folder's lock; the message names it and what to do."""


def _record() -> Dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv)[:300]}


def describe(holder: Dict[str, Any]) -> str:
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('started')} "
            f"({holder.get('command')})")


def _read(fd: int) -> Optional[Dict[str, Any]]:
    """The holder recorded in the lock file (read through ``fd``: with POSIX locks, as NFS maps ``flock``, closing any
    other descriptor of the file would drop this process's lock), or None when it is empty or not a record."""
    size = os.fstat(fd).st_size
    try:
        record = json.loads(os.pread(fd, size, 0).decode()) if size else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _write(fd: int, record: Optional[Dict[str, Any]]) -> None:
    data = (json.dumps(record) + "\n").encode() if record else b""
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _running_here(holder: Dict[str, Any]) -> bool:
    """Whether the holder's process still runs on this host (False for another host's: it cannot be asked)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def acquire(folder: str) -> None:
    """Hold ``folder``'s lock for the rest of this process's life (a no-op when this process holds it already), and
    record this process in it; raise :class:`FolderInUse` naming the run that holds it.

    On a file system without locks (flock fails with ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL), the record is the lock: a
    holder whose process is gone from this host is taken over; one on another host is refused (it cannot be checked),
    until someone who knows that run is over deletes the file."""
    if holds(folder):
        return
    path = os.path.join(folder, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        no_locks = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd) or {}
            gone = holder.get("host") == socket.gethostname() and not _running_here(holder)
            raise FolderInUse(
                f"{folder} is in use by another run ({describe(holder)}), which holds {path}"
                + (" (that process has ended, but one it started still holds the lock)" if gone else "")
                + "; wait for that run to end or stop it, or give this run another folder") from None
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                raise
            no_locks = error
        holder = _read(fd)
        if no_locks is not None and holder is not None:
            if _running_here(holder) or holder.get("host") != socket.gethostname():
                raise FolderInUse(
                    f"{folder} is in use by another run ({describe(holder)}), recorded in {path}; this file system "
                    f"keeps no locks ({no_locks.strerror}), so the record is the only guard: if that run is over, "
                    f"delete {path}")
            logger.info(f"{path}: took over from the run of {describe(holder)}, whose process is gone (this file "
                        f"system keeps no locks)")
        elif holder is not None:  # the lock was free, yet its record names a run that never gave it up
            logger.info(f"{path}: took over from the run of {describe(holder)}, which ended without giving the lock "
                        f"up (killed, or its host went down)")
        record = _record()
        _write(fd, record)
    except BaseException:
        os.close(fd)
        raise
    _HELD[os.path.realpath(folder)] = (fd, record)


def taken_over(folder: str) -> Optional[str]:
    """Why this process may no longer write into ``folder``: its lock file now names another run (which can only
    happen where locks do not exclude each other, e.g. NFS mounted with ``local_lock`` on several hosts); None while
    it names this process."""
    fd, record = _HELD[os.path.realpath(folder)]
    holder = _read(fd)
    if holder == record:
        return None
    return (f"{os.path.join(folder, LOCK_FILE)} now names the run of {describe(holder or {})} instead of this one "
            f"({describe(record)}): another run is writing into {folder}, so locks on this file system do not keep "
            f"runs apart; stop one of them")


def holds(folder: str) -> bool:
    """Whether this process holds ``folder``'s lock."""
    return os.path.realpath(folder) in _HELD


def holder_record(folder: str) -> Dict[str, Any]:
    """What this process recorded in ``folder``'s lock file (it must hold the lock)."""
    return dict(_HELD[os.path.realpath(folder)][1])


def release(folder: str) -> None:
    """Give ``folder``'s lock up before this process ends (nothing when it does not hold it): empty the record, if it
    is still this process's (so that a file system without locks sees the run end), and close the file."""
    held = _HELD.pop(os.path.realpath(folder), None)
    if held is None:
        return
    fd, record = held
    try:
        if _read(fd) == record:
            _write(fd, None)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- a run's claim on a folder --------------------------------------------------------------------------------
def _lock(folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        acquire(folder)
    except (OSError, FolderInUse) as error:
        raise folders.CheckpointError(str(error)) from None


def claim(folder: str) -> None:
    """Make ``folder`` and hold its lock on rank 0 for the life of this process, so that no other run
    writes into it meanwhile; every rank raises the same CheckpointError, naming the run that holds it, when another
    one does (collective)."""
    failure = None
    if rank_and_world()[0] == 0:
        try:
            _lock(folder)
        except folders.CheckpointError as error:
            failure = str(error)
    failure = gather(failure)[0]
    if failure is not None:
        raise folders.CheckpointError(failure)


def prepare(folder: str) -> None:
    """Collective, before a run's first save or load in ``folder``: :func:`claim` it, then rank 0 removes what crashed
    saves left (:func:`.folders.remove_stale`) once no rank can still be writing there."""
    barrier()
    claim(folder)
    if rank_and_world()[0] == 0:
        folders.remove_stale(folder)
    barrier()


@contextlib.contextmanager
def holding(folder: str) -> Iterator[None]:
    """``claim`` for one process that writes into ``folder`` for a while (``ds-pseudo-real convert``): the lock is
    given up after the block, unless this process held it before."""
    held_before = holds(folder)
    _lock(folder)
    try:
        yield
    finally:
        if not held_before:
            release(folder)


@atexit.register
def _release_all() -> None:
    for folder in list(_HELD):
        release(folder)
