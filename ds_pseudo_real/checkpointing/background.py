"""Checkpoints written in the background (``checkpoint.async_save``): the training loop waits only while the state is
copied to host memory; a thread of each rank writes, checksums and fsyncs that rank's files from the copy, and rank
0's publishes the checkpoint once every rank's files are durable.

Owns: the host snapshot (copies that keep the storage sharing torch.save sees, in buffers reused from one save to
the next), the writer thread of each rank, and the agreement between the ranks on how a save ended. That agreement
is a collective, so the training thread makes it, at step boundaries and saves, never a writer thread (a collective
from a second thread would interleave with the training thread's on the same process group). Knows nothing of
DeepSpeed: the caller hands it the files to write and how to publish them; the folder layout is ``checkpoint``'s.
"""
from __future__ import annotations

import copy
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import checksums
from ..checksums import FileEntry
from ..ranks import gather, log_rank0, rank_and_world

WRITING, PUBLISHING = "writing", "publishing"


class HostSnapshot:
    """Host copies of the tensors of one checkpoint at a time. A tensor is copied with its whole storage, once per
    storage, and rebuilt as a view of the copy, so that torch.save writes the copy as it would the original (a
    shared parameter once, a view as a view). The next snapshot reuses the buffers (pinned when they hold a device's
    tensors): host memory stays at one snapshot, the bytes of this rank's checkpoint files."""

    def __init__(self):
        self._free: Dict[Tuple[int, bool], List[torch.UntypedStorage]] = {}  # (bytes, pinned): buffers to reuse
        self._held: List[torch.UntypedStorage] = []  # the buffers of the snapshot being taken or written
        self._copies: Dict[Tuple[str, int], torch.UntypedStorage] = {}  # (device, address) of a storage: its copy
        self._devices: set = set()

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes() for buffer in self._held)

    def begin(self) -> None:
        """Start a snapshot: the previous one's write is over, its buffers are free."""
        for buffer in self._held:
            self._free.setdefault((buffer.nbytes(), buffer.is_pinned()), []).append(buffer)
        self._held, self._copies, self._devices = [], {}, set()

    def end(self) -> None:
        """The snapshot is complete once this returns (device copies waited for); buffers it did not reuse are freed."""
        if self._devices:
            torch.accelerator.synchronize()
        self._free, self._copies = {}, {}

    def copy(self, obj: Any) -> Any:
        """``obj`` with every tensor in it (in dicts, lists and tuples) replaced by its host copy; other values are
        deep-copied, so that nothing the training loop changes later reaches the checkpoint."""
        if torch.is_tensor(obj):
            return self.tensor(obj)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # the dict's own class (OrderedDict, defaultdict)
            for key, value in obj.items():
                out[key] = self.copy(value)
            return out
        if isinstance(obj, (list, tuple)):
            items = [self.copy(value) for value in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return copy.deepcopy(obj)

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host copy of ``tensor`` (its storage copied once per snapshot)."""
        source = tensor.detach()
        if source.device.type == "meta":
            return source
        if source.layout != torch.strided:
            return source.to("cpu", copy=True)
        storage = source.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        host = self._copies.get(key) if storage.nbytes() else None
        if host is None:
            pinned = storage.device.type != "cpu"
            free = self._free.get((storage.nbytes(), pinned))
            host = free.pop() if free else torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                       pin_memory=pinned).untyped_storage()
            host.copy_(storage, non_blocking=pinned)
            self._held.append(host)
            if pinned:
                self._devices.add(storage.device)
            if storage.nbytes():
                self._copies[key] = host
        copied = torch.empty(0, dtype=source.dtype).set_(host, source.storage_offset(), source.size(),
                                                          source.stride())
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
        return copied.requires_grad_() if tensor.requires_grad else copied


Writer = Callable[[Any], None]  # writes one file's contents into a file object


@dataclass
class BackgroundSave:
    """One checkpoint in flight. ``files``: this rank's, written from the snapshot in a thread;
    ``summary``: what else each rank computes there (its state fingerprint), handed with the files' manifest entries
    to ``publish`` (rank 0, again in a thread) once every rank's files are durable; ``failed``: what a failure on any
    rank does on every rank (given each rank's report, None where it went well; raises)."""

    folder: str  # the checkpoint it becomes
    directory: str  # the folder it is written into
    files: Dict[str, Writer]  # by path relative to ``directory``
    summary: Callable[[], Any]
    publish: Callable[[List[Tuple[Dict[str, FileEntry], Any]]], None]
    failed: Callable[[List[Optional[str]]], None]
    blocked_s: float  # how long the training loop waited for the snapshot
    started: float = field(default_factory=time.perf_counter)
    phase: str = WRITING
    finished: Optional[float] = None  # when rank 0 published it
    _thread: Optional[threading.Thread] = None
    _outcome: Optional[Tuple[str, Any]] = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._run(self._write)

    def _run(self, work: Callable[[], Any]) -> None:
        def run():
            try:
                self._outcome = work()
            except Exception as error:  # reported to every rank by the next agreement
                self._outcome = ("failed", f"{type(error).__name__}: {error}")

        self._outcome = None
        self._thread = threading.Thread(target=run, name="ds_pseudo_real checkpoint writer", daemon=True)
        self._thread.start()

    def _write(self) -> Tuple[str, Any]:
        """Write the files; the summary (a pass over the snapshot, on the CPU) is computed meanwhile in a second
        thread, while this one mostly waits for the disk: a save takes the longer of the two, not their sum."""
        summary: Dict[str, Any] = {}

        def summarize():
            try:
                summary["value"] = self.summary()
            except Exception as error:  # raised by the writer thread once its files are written
                summary["error"] = error

        summing = threading.Thread(target=summarize, name="ds_pseudo_real checkpoint summary", daemon=True)
        summing.start()
        entries = {}
        try:
            for name, writer in self.files.items():
                if self._stop.is_set():
                    return "failed", "stopped: another rank's part of this save failed"
                entries[name] = checksums.save_with_checksum(writer, os.path.join(self.directory, name))
        finally:
            summing.join()
        if "error" in summary:
            raise summary["error"]
        return "written", (entries, summary["value"])

    def publish_in_background(self, parts: List[Tuple[Dict[str, FileEntry], Any]]) -> None:
        """Rank 0, once every rank's part (``parts``, in rank order) is written: ``publish`` it in a thread."""
        def work():
            self.publish(parts)
            self.finished = time.perf_counter()
            return "published", None

        self._run(work)

    def report(self, block: bool) -> Tuple[str, Any]:
        """This rank's state for the agreement: ("busy", None), ("written", (manifest entries, summary)) in the
        writing phase, ("published", None) or ("failed", message)."""
        if block:
            self._thread.join()
        outcome = self._outcome
        if outcome is None:
            return "busy", None
        if self.phase == PUBLISHING and outcome[0] == "written":  # the ranks other than 0: their part is done
            return "done", None
        return outcome

    def stop(self) -> None:
        """Stop after the file being written, and wait for it (another rank failed)."""
        self._stop.set()
        self._thread.join()


class BackgroundCheckpoints:
    """The run's checkpoints written in the background, one at a time: a save waits for the one in flight, so host
    memory holds one snapshot. ``poll`` (collective) moves the one in flight on; the training thread calls it."""

    def __init__(self):
        self.snapshot = HostSnapshot()
        self._pending: Optional[BackgroundSave] = None
        self.waits = 0  # saves (and loads, ends of runs) that waited for the one in flight
        self.wait_s = 0.0
        self.published: List[Dict[str, float]] = []  # per checkpoint: blocked_s, total_s (rank 0's)

    @property
    def in_flight(self) -> Optional[str]:
        """The folder the checkpoint being written will have, or None."""
        return None if self._pending is None else self._pending.folder

    def start(self, save: BackgroundSave) -> None:
        if self._pending is not None:
            raise RuntimeError(f"a checkpoint save started while {self._pending.folder} is still in flight")
        self._pending = save
        save.start()

    def poll(self, block: bool = False) -> None:
        """Collective, on every rank while a checkpoint is in flight (a no-op otherwise): agree on where its write
        stands. Once every rank's files are written, rank 0's thread publishes it; a failure on any rank stops the
        others' writers and raises on every rank (``BackgroundSave.failed``). ``block``: until it is published."""
        while self._pending is not None:
            pending = self._pending
            reports = gather(pending.report(block))
            failures = [message if state == "failed" else None for state, message in reports]
            if any(failures):
                self._pending = None
                pending.stop()
                pending.failed(failures)
                return
            if pending.phase == WRITING and all(state == "written" for state, _ in reports):
                pending.phase = PUBLISHING
                if rank_and_world()[0] == 0:
                    pending.publish_in_background([payload for _, payload in reports])
            elif pending.phase == PUBLISHING and reports[0][0] == "published":
                self._pending = None
                if pending.finished is not None:
                    self.published.append({"blocked_s": pending.blocked_s,
                                           "total_s": pending.finished - pending.started})
                    log_rank0(f"checkpoint {pending.folder} published; written in the background in "
                              f"{pending.finished - pending.started:.2f} s (the loop waited {pending.blocked_s:.2f} s "
                              f"for its snapshot)")
            elif not block:
                return

    def wait(self, before: str) -> None:
        """Collective: block until the checkpoint in flight is published (raising its failure), saying how long it
        took, and count the wait; ``before``: what waits for it."""
        if self._pending is None:
            return
        folder, start = self._pending.folder, time.perf_counter()
        try:
            self.poll(block=True)
        finally:
            waited = time.perf_counter() - start
            self.waits += 1
            self.wait_s += waited
            log_rank0(f"waited {waited:.2f} s for the checkpoint in flight ({folder}) before {before}")
