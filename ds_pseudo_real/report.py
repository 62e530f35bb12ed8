"""The run's loss history: a JSONL log that reads like one run across resumes, monitor CSV files rewound to the step
a run resumes from, and the train/validation plot with the switch marked.

Owns: writing ``metrics.jsonl`` (a failed write is a warning, never the end of the run), rewriting a log up to the
step a run resumes from (atomically, the lines it drops kept in ``<file>.discarded``), reading the continuous
history, and drawing ``loss.png``. Knows nothing of engines.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional

DISCARDED = ".discarded"  # suffix of the file beside a log that keeps the lines rewinding it dropped
RESUME = "resume"

from .logs import logger


class MetricsLog:
    """JSONL, one record a line. A run started at step N (resumed, or N = 0 for a fresh start over an old history)
    first rewinds the file to the history up to step N, the records an interrupted run wrote after it moved to
    ``metrics.jsonl.discarded``, then appends ``{"event": "resume", "step": N}``: every step is in the file once,
    with the values an uninterrupted run logs."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._warned = self._line_cut = self._failed = False
        if self.path.is_file() and self.path.stat().st_size:
            lines = _lines(self.path)
            records = [_parse(line) for line in lines]
            try:
                rewrite_keeping(self.path, lines, [i for i in _history(records)
                                                   if records[i].get("step", 0) <= resume_step])
            except OSError as error:  # not even in place: readers still drop what the resume event supersedes
                logger.warning(f"could not rewind {self.path} to step {resume_step}: {error}; its later records stay "
                               f"in it")
            self._line_cut = True  # a crash mid-write can have left the last line unfinished
            self.write({"event": RESUME, "step": resume_step})

    def _terminate_partial_line(self) -> None:
        """A crash mid-write can leave the last line unfinished; start the next record on a line of its own."""
        if not self.path.is_file() or not self.path.stat().st_size:
            return
        with open(self.path, "rb") as handle:
            handle.seek(-1, 2)
            ends_with_newline = handle.read(1) == b"\n"
        if not ends_with_newline:
            with open(self.path, "a") as handle:
                handle.write("\n")

    def write(self, record: Dict) -> None:
        """Append ``record``, whole or not at all: a write that fails (a full disk) is cut back to where the file
        ended, and is a warning, the first time, as a failed save is: the record is lost, training goes on, and
        later records are written once there is room (while the file system has no free block left, they are
        lost without a try: a shorter one could still fit at the end of the file's last block, out of order)."""
        line = json.dumps(record) + "\n"
        if self._failed and not _has_room(self.path.parent, len(line)):
            return
        size = self.path.stat().st_size if self.path.is_file() else 0
        try:
            if self._line_cut:
                self._terminate_partial_line()
                size = self.path.stat().st_size
            with open(self.path, "a") as handle:
                handle.write(line)
            self._line_cut = self._failed = False
        except OSError as error:
            self._failed = True
            try:
                os.truncate(self.path, size)  # no torn record: the part of the line that fitted goes
            except OSError:
                self._line_cut = True
            if not self._warned:
                self._warned = True
                logger.warning(f"could not write {self.path}: {error}; training goes on without these records "
                               f"(later ones are written once there is room; this warning is not repeated)")


def _has_room(folder: Path, size: int) -> bool:
    try:
        stats = os.statvfs(folder)
    except OSError:
        return True
    return stats.f_bavail * stats.f_frsize >= size


def _lines(path: Path) -> List[str]:
    """The file's lines, each ending in a newline (a crash mid-write can leave the last one unfinished)."""
    return [line if line.endswith("\n") else line + "\n" for line in path.read_text().splitlines(keepends=True)]


def _parse(line: str) -> Optional[Dict]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _history(records: List[Optional[Dict]]) -> List[int]:
    """Indices of the records of the continuous history: a resume event at step N drops the records of steps after N
    written before it (files written before runs rewound them on resume); unreadable lines (None) are left out."""
    history: List[int] = []
    for i, record in enumerate(records):
        if record is None:
            continue
        if record.get("event") == RESUME:
            history = [j for j in history if records[j].get("step", 0) <= record["step"]]
        history.append(i)
    return history


def rewrite_keeping(path: Path, lines: List[str], kept: List[int]) -> None:
    """Make ``path`` hold ``lines[i]`` for the indices ``kept`` (in order), atomically (a new file renamed over it);
    the other lines are appended to ``<path>.discarded`` first, so a crash in between loses none. Nothing changes
    when every line is kept. On a full disk, where neither the copy nor the lines kept aside fit, the file is
    rewritten in place instead (it only shrinks, which needs no new block), and a warning says what was lost: a
    rewind that cannot complete leaves no line twice and none cut."""
    keep = set(kept)
    dropped = [line for i, line in enumerate(lines) if i not in keep]
    if not dropped:
        return
    aside = path.with_name(path.name + DISCARDED)
    failure: Optional[OSError] = None
    try:
        _append_whole(aside, dropped)
    except OSError as error:
        failure = error
    kept_aside = failure is None
    if kept_aside:
        handle, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as out:
                out.writelines(lines[i] for i in sorted(keep))
                out.flush()
                os.fsync(out.fileno())
            shutil.copymode(path, staged)
            os.replace(staged, path)
            return
        except OSError as error:
            failure = error
            with contextlib.suppress(OSError):
                os.unlink(staged)
    _shrink_in_place(path, lines, keep)
    logger.warning(f"could not rewind {path} through a copy ({failure}): rewound it in place; the {len(dropped)} "
                   f"lines it dropped are {f'kept in {aside}' if kept_aside else 'lost'}")


def _append_whole(path: Path, lines: List[str]) -> None:
    """Append ``lines`` to ``path``, all or none (cut back to its old end when a write fails), durably."""
    size = path.stat().st_size if path.is_file() else 0
    try:
        with open(path, "a") as handle:
            handle.writelines(lines)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


def _shrink_in_place(path: Path, lines: List[str], keep: set) -> None:
    """Rewrite ``path`` to ``lines[i]`` for ``i`` in ``keep`` without a new file: the kept lines after the first
    dropped one move up over it, then the file is cut; it only shrinks, so a full disk does not stop it."""
    first = min(i for i in range(len(lines)) if i not in keep)
    offset = sum(len(line.encode()) for line in lines[:first])
    tail = "".join(lines[i] for i in sorted(keep) if i > first).encode()
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, tail, offset)
        os.ftruncate(fd, offset + len(tail))
        os.fsync(fd)
    finally:
        os.close(fd)


def rewind_csv(path: Path, step: int) -> bool:
    """Rewind a monitor CSV file (a ``step,<name>`` header, then ``step,value`` rows) to its header and its rows up to
    ``step`` (:func:`rewrite_keeping`). A row whose step is not after the previous row's starts what a later run
    wrote from that step on, which replaces the earlier rows from there (a file an earlier resume appended to), and a
    second header is dropped. Returns whether the file has its header."""
    lines = _lines(path)
    header, steps, rows = None, [], []  # rows: line indices of the continuous history, steps increasing
    for i, line in enumerate(lines):
        first = line.split(",", 1)[0]
        if first.isdigit():
            at = bisect.bisect_left(steps, int(first))
            del steps[at:], rows[at:]
            steps.append(int(first))
            rows.append(i)
        elif header is None and first == "step":
            header = i
    rewrite_keeping(path, lines, ([] if header is None else [header]) + [i for s, i in zip(steps, rows) if s <= step])
    return header is not None


def read_records(path: Path, raw: bool = False) -> List[Dict]:
    """The run's history: every record of a continuous run, later starts replacing what they resumed over
    (``raw``: every line as written). Lines a crash left unfinished are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = [_parse(line) for line in _lines(path)]
    if raw:
        return [record for record in records if record is not None]
    return [records[i] for i in _history(records)]


def plot_history(records: Iterable[Dict], path: Path, title: str = "") -> None:
    """Train loss (light, plus a moving average), validation loss (markers) and a line at each delink."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    switches = [r["step"] for r in records if r.get("event") == "delink"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8)
        window = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, color="tab:blue", label="train loss")
    if val:
        steps, losses = zip(*val)
        ax.plot(steps, losses, "o-", color="tab:orange", label="validation loss")
    for step in switches:
        ax.axvline(step, color="tab:red", linestyle="--", label=f"delink (step {step})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
