"""Every process a rank starts through Python ends when the rank ends, however the rank ends: killed (SIGKILL), by a
signal, an exception or a normal exit. A process left behind holds its CUDA context, pinned memory and the run's
files on a GPU node, and under SLURM keeps the allocation's cgroup busy.

Owns: the hooks that make a rank's children die with it. Must not start processes itself. Written against CPython
3.10-3.12's ``multiprocessing`` (``spawn.get_command_line``, the command line of every spawned and forkserver child)
and Linux's ``prctl(PR_SET_PDEATHSIG)``; children started by ``subprocess`` run a program of their own and are
that program's to end (they are short-lived compiler or tool runs here).

Which children this covers, in the main job and the Megatron drop-in: Megatron's checkpoint writer processes
(forked), its ``--async-save`` workers (forked, or spawned and persistent), the Manager process that keeps its write
results (spawned; megatron-core 0.16.1 ``filesystem_async.get_write_results_queue``), DataLoader workers, and
anything else started with ``os.fork`` or ``multiprocessing``, and what those start in turn (the persistent worker
forks the file writers): a forked child inherits the hooks, a spawned one installs them first thing. Each child gets
the kernel's parent-death signal (SIGKILL when its parent exits), set as it starts; a child forked by a thread other
than the main one is watched by a thread of its own instead (the kernel signals at the exit of the thread that
forked, not of the process). The
resource tracker ``multiprocessing`` starts needs nothing: it exits once every process holding its pipe is gone,
after unlinking what they left.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import List, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_SECONDS = 0.5

_installed = False
_forking: Optional[tuple] = None  # (pid, whether the main thread forks), written before each fork


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """This process gets ``signum`` when the thread of ``parent`` that started it exits; if ``parent`` is already
    gone, it exits now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        watch_parent(parent)  # not Linux, or refused: watch instead
    if os.getppid() != parent:
        os._exit(1)


def watch_parent(parent: int, interval: float = WATCH_SECONDS) -> threading.Thread:
    """A daemon thread that ends this process (SIGKILL) once ``parent`` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def _before_fork() -> None:
    global _forking
    _forking = (os.getpid(), threading.current_thread() is threading.main_thread())


def _ends_with_parent(parent: int, from_main_thread: bool) -> None:
    """In a new child of ``parent``: end with it (the kernel's signal when the main thread started the child, else
    a watching thread), or now if it is already gone."""
    if from_main_thread:
        die_with_parent(parent)
    else:
        watch_parent(parent)
        if os.getppid() != parent:
            os._exit(1)


def _after_fork_in_child() -> None:
    if _forking is not None:  # the hooks themselves are inherited with the parent's memory
        _ends_with_parent(*_forking)


def start_spawned_child(parent: int, from_main_thread: bool) -> None:
    """In a spawned child of ``parent``, first thing: end with it, and make what the child starts end with the
    child (a fresh interpreter inherits nothing of its parent's hooks)."""
    _ends_with_parent(parent, from_main_thread)
    end_children_with_this_process()


def _spawned_child_prologue(parent: int, from_main_thread: bool) -> str:
    """Python run first by a spawned child (lines before its ``-c`` program), before it unpickles anything: this
    file loaded by its path (the standard library only: the child has not yet got its parent's ``sys.path``, and the
    package's own ``__init__`` would import torch) and :func:`start_spawned_child` called."""
    return (f"import importlib.util as _util\n"
            f"_spec = _util.spec_from_file_location('_child_processes', {os.path.abspath(__file__)!r})\n"
            f"_lifetime = _util.module_from_spec(_spec)\n"
            f"_spec.loader.exec_module(_lifetime)\n"
            f"_lifetime.start_spawned_child({parent}, {from_main_thread})\n")


def _with_prologue(get_command_line):
    def get_command_line_with_prologue(**kwds) -> List[str]:
        command = list(get_command_line(**kwds))
        if "-c" in command:
            index = command.index("-c") + 1
            prologue = _spawned_child_prologue(os.getpid(), threading.current_thread() is threading.main_thread())
            command[index] = prologue + command[index]
        return command

    get_command_line_with_prologue.unwrapped = get_command_line
    return get_command_line_with_prologue


def end_children_with_this_process() -> None:
    """From now on, every process this one forks or spawns (through ``os.fork``, ``multiprocessing`` or
    ``torch.multiprocessing``, at any depth) ends when this one ends. Call it once, early, in a rank; idempotent."""
    global _installed
    if _installed:
        return
    import multiprocessing.spawn

    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    multiprocessing.spawn.get_command_line = _with_prologue(multiprocessing.spawn.get_command_line)
    _installed = True
