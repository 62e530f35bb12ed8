"""DeepSpeed's C++ op builds said out loud: what is built, that it happens once and where it is cached; a build lock
that a killed build left (torch would wait for it forever, without a word) named with what to delete; and the
shared-memory all-reduce op, which only DeepSpeed's inference calls, left unbuilt by the main job.

Owns: the two patches (``OpBuilder.jit_load`` wrapped, ``deepspeed.comm.torch.build_shm_op`` replaced), each
installed once and undone by :func:`undo_op_build_patches`, and reading a build lock's state. Builds nothing itself.
Written against DeepSpeed 0.19.8 (every JIT build goes through ``OpBuilder.jit_load``; ``TorchBackend.__init__``
calls ``build_shm_op`` and only ``inference_all_reduce`` uses what it built) and torch 2.13 (``cpp_extension.load``
builds ``<extensions dir>/<op>/<op>.so`` while it holds ``<op>/lock``, a ``FileBaton``: a file created with
``O_EXCL`` and kept open by its holder until the build ends, which every other process polls for as long as it
exists).
"""
from __future__ import annotations

import functools
import importlib
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from ..logs import logger
from .guard import SUPPORTED_VERSIONS

LOCK = "lock"
# File systems whose files only this host's processes can hold open: a lock no process here holds is stale at once.
LOCAL_FILESYSTEMS = frozenset("ext2 ext3 ext4 xfs btrfs tmpfs overlay zfs f2fs reiserfs jfs bcachefs".split())
# On a shared file system another host may be building: a lock is stale once nothing in its folder changed this long.
SHARED_STALE_AFTER_S = 30 * 60
HEARTBEAT_S = 30.0
_PATCHES: List[Tuple[object, str, object]] = []  # (owner, attribute, original) of each patch installed


class StaleBuildLock(RuntimeError):
    """A build lock no live build holds; the message names the file to delete."""


def build_folder(name: str) -> str:
    """Where torch builds and caches the op ``name``: ``$TORCH_EXTENSIONS_DIR/<name>``, else torch's default root
    (torch 2.13's own function, which ``cpp_extension.load`` calls; it creates the folder)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def is_built(folder: str, name: str) -> bool:
    return os.path.isfile(os.path.join(folder, f"{name}.so"))


def lock_holders(path: str) -> Optional[List[int]]:
    """The pids of this host's processes that hold ``path`` open (a ``FileBaton``'s holder keeps it open); None when
    that cannot be told (no ``/proc``, or a process whose descriptors this user may not read)."""
    if not os.path.isdir("/proc"):
        return None
    target, holders, unreadable = os.path.realpath(path), [], False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fds = f"/proc/{entry}/fd"
        try:
            names = os.listdir(fds)
        except PermissionError:
            unreadable = True
            continue
        except OSError:  # the process ended meanwhile
            continue
        for fd in names:
            try:
                if os.readlink(f"{fds}/{fd}") == target:
                    holders.append(int(entry))
                    break
            except OSError:
                continue
    return holders if holders or not unreadable else None


def filesystem_type(path: str) -> Optional[str]:
    """The type of the file system ``path`` is on (``/proc/mounts``' longest matching mount point); None unknown."""
    path, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if (len(fields) >= 3 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/"))
                        and len(fields[1]) >= len(best)):
                    best, kind = fields[1], fields[2]
    except OSError:
        return None
    return kind


def _idle_seconds(folder: str) -> float:
    """Seconds since anything in ``folder`` changed (a live build writes its objects and ninja's log there)."""
    newest = 0.0
    for entry in os.scandir(folder):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return time.time() - newest


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"pid {pid}" + (f" ({command[:120]})" if command else "")


def stale_lock_message(name: str, lock: str, why: str) -> str:
    return (f"{lock} is a build lock of DeepSpeed's op {name} that {why}: a build killed while it ran left it, and "
            f"every later run would wait for it forever; delete it (rm {lock}) and run again (the op is then built "
            f"again, once, in {os.path.dirname(lock)})")


def wait_for_build_lock(name: str, folder: str, poll_s: float = 1.0) -> None:
    """Return once ``folder`` has no build lock. While a live build holds it, say so (once, then every
    ``HEARTBEAT_S``); raise :class:`StaleBuildLock` when no process holds it: at once on a local file system (only
    this host's processes can), on a shared one once nothing in the folder changed for ``SHARED_STALE_AFTER_S``."""
    lock = os.path.join(folder, LOCK)
    said, last_said, local = None, 0.0, filesystem_type(folder) in LOCAL_FILESYSTEMS
    while os.path.exists(lock):
        holders = lock_holders(lock)
        if holders == [] and local:
            time.sleep(min(poll_s, 0.5))  # a holder releasing closes the file a moment before it removes it
            if os.path.exists(lock) and lock_holders(lock) == []:
                raise StaleBuildLock(stale_lock_message(name, lock, "no process holds"))
            continue
        if holders == [] and _idle_seconds(folder) > SHARED_STALE_AFTER_S:
            raise StaleBuildLock(stale_lock_message(
                name, lock, f"no process on this host holds and nothing in its folder changed for "
                            f"{SHARED_STALE_AFTER_S // 60} minutes (a shared file system: a build on another host "
                            f"would have)"))
        if holders:
            news = "held by " + ", ".join(map(_describe, holders))
        elif holders is None:
            news = f"its holder cannot be told (processes this user may not inspect); if no build runs, delete {lock}"
        else:
            news = (f"held by no process on this host: a build on another host sharing this folder? If none runs "
                    f"anywhere, delete {lock}")
        if news != said or time.monotonic() - last_said > HEARTBEAT_S:
            logger.info(f"waiting for the build of DeepSpeed's op {name} in {folder} ({news})")
            said, last_said = news, time.monotonic()
        time.sleep(poll_s)


class Heartbeat:
    """A line every ``every`` seconds while a block runs: ``message(seconds so far)``."""

    def __init__(self, message: Callable[[float], str], every: float = HEARTBEAT_S):
        self.message, self.every = message, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="op-build-heartbeat", daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(self.every):
            logger.info(self.message(time.monotonic() - start))

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _said_out_loud(jit_load: Callable) -> Callable:
    @functools.wraps(jit_load)
    def said_jit_load(self, verbose: bool = True):
        folder = build_folder(self.name)
        wait_for_build_lock(self.name, folder)
        if is_built(folder, self.name):
            return jit_load(self, verbose)
        logger.info(f"building DeepSpeed's C++ op {self.name} into {folder}: once (later runs load it from there; "
                    f"TORCH_EXTENSIONS_DIR picks the folder), a minute or more on 2 idle cores, several when busy")
        start = time.monotonic()
        with Heartbeat(lambda s: f"still building DeepSpeed's op {self.name} ({s:.0f} s so far)"):
            module = jit_load(self, verbose)
        logger.info(f"built DeepSpeed's op {self.name} in {time.monotonic() - start:.0f} s")
        return module

    said_jit_load.ds_pseudo_real_patch = True
    return said_jit_load


def _written_for(owner: object, attribute: str) -> bool:
    """Whether this DeepSpeed is a release the patches were written against and has ``owner.attribute``: on any
    other the patches stay out (they are conveniences; the run goes on without them)."""
    import deepspeed
    from packaging.version import Version

    low, high = SUPPORTED_VERSIONS["deepspeed"]
    return (Version(low) <= Version(Version(deepspeed.__version__).base_version) < Version(high)
            and hasattr(owner, attribute))


def _patch(owner: object, attribute: str, replacement: object) -> None:
    _PATCHES.append((owner, attribute, getattr(owner, attribute)))
    setattr(owner, attribute, replacement)


def announce_op_builds() -> None:
    """From now on every JIT build of a DeepSpeed op in this process says what it builds, where and how long it
    took, and waits for a build lock only while a live build holds it (:func:`wait_for_build_lock`). Idempotent."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if _written_for(OpBuilder, "jit_load") and not getattr(OpBuilder.jit_load, "ds_pseudo_real_patch", False):
        _patch(OpBuilder, "jit_load", _said_out_loud(OpBuilder.jit_load))


def skip_inference_all_reduce_op() -> None:
    """``deepspeed.init_distributed`` on the CPU builds (the first time: tens of seconds, minutes on a busy machine)
    and loads a shared-memory op that only DeepSpeed's inference all-reduce uses; training never calls it. For a
    process that only trains (the main job): its backend is made without it. Idempotent."""
    # by its name: ``import deepspeed.comm.torch as ...`` binds the attribute deepspeed.comm.torch, which is torch
    torch_backend = importlib.import_module("deepspeed.comm.torch")
    if (_written_for(torch_backend, "build_shm_op")
            and not getattr(torch_backend.build_shm_op, "ds_pseudo_real_patch", False)):
        def build_shm_op():
            return None

        build_shm_op.ds_pseudo_real_patch = True
        _patch(torch_backend, "build_shm_op", build_shm_op)


def undo_op_build_patches() -> None:
    while _PATCHES:
        owner, attribute, original = _PATCHES.pop()
        setattr(owner, attribute, original)


def installed_patches() -> Dict[str, object]:
    """``owner.attribute`` -> the original, for each patch in place (for tests and reports)."""
    return {f"{getattr(owner, '__name__', owner)}.{attribute}": original for owner, attribute, original in _PATCHES}
