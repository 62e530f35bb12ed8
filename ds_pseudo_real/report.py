"""The run's loss history: a JSONL log that survives resumes, and the train/validation plot with the switch marked.

Owns: writing and trimming ``metrics.jsonl`` and drawing ``loss.png``. Knows nothing of engines.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, List


class MetricsLog:
    """Append-only JSONL; on resume at step N, records of steps after N (from the lost tail) are dropped."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_records(self.path) if r.get("step", 0) <= resume_step] if resume_step else []
        with open(self.path, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: Dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def read_records(path: Path) -> List[Dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
