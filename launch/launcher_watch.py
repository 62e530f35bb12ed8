"""A rank's watch on the launcher that started it: when the launcher is gone (killed by a signal it neither handles
nor forwards), the rank sends itself SIGTERM, so that it stops as it would if the launcher had passed the signal on
(the main job saves a checkpoint at the next step boundary), instead of training on as an orphan.

Owns: finding the launcher processes from the rank's environment and parents, and the watch thread. Written against
torch 2.13's torchrun, which starts every rank itself and sets ``TORCHELASTIC_RUN_ID`` (the launcher is the rank's
parent), and DeepSpeed 0.19.8's one-node ``deepspeed`` command, which starts ``deepspeed.launcher.launch``, which
starts every rank and sets ``CROSS_RANK`` (the launchers are the rank's parent and grandparent).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import List, Optional, Tuple

import psutil

POLL_SECONDS = 1.0


def _parent_of(pid: int) -> Optional[int]:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def launcher_chain() -> List[Tuple[int, int, str]]:
    """(pid, its parent's pid at start, name) of each launcher above this process, nearest first: its parent stays
    ``pid``'s parent while that launcher lives; empty when no launcher this module knows started the process."""
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return [(os.getpid(), parent, "torchrun")]
    if "CROSS_RANK" in os.environ:
        grandparent = _parent_of(parent)
        chain = [(os.getpid(), parent, "deepspeed.launcher.launch")]
        return chain + ([(parent, grandparent, "the deepspeed command")] if grandparent is not None else [])
    return []


def _gone(chain: List[Tuple[int, int, str]]) -> Optional[str]:
    for child, parent, name in chain:
        if _parent_of(child) not in (parent, None):  # reparented: its parent has exited (None: the child exited)
            return f"{name} (pid {parent})"
    return None


def watch_launcher(poll_seconds: float = POLL_SECONDS) -> Optional[threading.Thread]:
    """Start the watch (a daemon thread; None when no known launcher started this process). When a launcher above
    the rank exits, it says so on stderr and sends this process SIGTERM, once."""
    chain = launcher_chain()
    if not chain:
        return None

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            gone = _gone(chain)
            if gone is not None:
                print(f"[ds_pseudo_real] rank {os.environ.get('RANK', '?')}: its launcher {gone} is gone; stopping as "
                      f"on SIGTERM", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
