"""The run's loss history: a JSONL log that survives resumes, and the train/validation plot with the switch marked.

Owns: appending to ``metrics.jsonl`` (never rewritten; a failed write is a warning, never the end of the run),
reading its continuous history, and drawing ``loss.png``. Knows nothing of engines.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, List

from .checkpoint import warn


class MetricsLog:
    """Append-only JSONL: never rewritten. A run started at step N (resumed, or N = 0 for a fresh start over an old
    history) appends ``{"event": "resume", "step": N}``; :func:`read_records` then drops the records of steps after
    N written before it (the tail the checkpoint did not keep), so the history stays continuous."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._warned = self._line_cut = False
        if self.path.is_file() and self.path.stat().st_size:
            self._terminate_partial_line()
            self.write({"event": RESUME, "step": resume_step})

    def _terminate_partial_line(self) -> None:
        """A crash or a full disk mid-write can leave the last line unfinished; start the next record on a line of
        its own."""
        if not self.path.is_file() or not self.path.stat().st_size:
            return
        with open(self.path, "rb") as handle:
            handle.seek(-1, 2)
            ends_with_newline = handle.read(1) == b"\n"
        if not ends_with_newline:
            with open(self.path, "a") as handle:
                handle.write("\n")

    def write(self, record: Dict) -> None:
        """Append ``record``. A write that fails (a full disk) is a warning, the first time, as a failed save is: the
        record is lost, training goes on, and later records are written, each on a line of its own, once there is
        room."""
        try:
            if self._line_cut:
                self._terminate_partial_line()
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self._line_cut = False
        except OSError as error:
            self._line_cut = True
            if not self._warned:
                self._warned = True
                warn(f"could not write {self.path}: {error}; training goes on without these records (later ones "
                     f"are written once there is room; this warning is not repeated)")


RESUME = "resume"


def read_records(path: Path, raw: bool = False) -> List[Dict]:
    """The run's history: every record of a continuous run, later starts replacing what they resumed over
    (``raw``: every line as written). Lines a crash left unfinished are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if raw:
        return records
    history: List[Dict] = []
    for record in records:
        if record.get("event") == RESUME:
            history = [r for r in history if r.get("step", 0) <= record["step"]]
        history.append(record)
    return history


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
