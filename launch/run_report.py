"""What the main job says about its run: a progress line every ``--log-interval`` steps, ``metrics.jsonl`` (rank 0),
DeepSpeed's monitors, the delinks, and the closing summary.

Owns: those lines, records and events. Must not train, evaluate or save: the trainer hands it each step's results.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch.distributed as dist

from ds_pseudo_real import logs
from ds_pseudo_real.ds_state import MONITOR_SECTIONS
from ds_pseudo_real.report import MetricsLog, plot_history, read_records
from ds_pseudo_real.sharing import parameter_count

say = logs.job_logger.info  # the job's own lines, from rank 0 (every rank with --log-all-ranks)
warn = logs.logger.warning  # the plugin's warnings, from every rank


class RunReport:
    """The reports of a run of ``steps`` steps into ``out`` from ``start_step``, each step ``tokens_per_step``
    tokens; ``log_interval``: steps between progress lines. Rank 0 keeps ``metrics.jsonl``."""

    def __init__(self, engine, out: Path, steps: int, start_step: int, tokens_per_step: int, log_interval: int,
                 rank: int):
        self.engine, self.out, self.steps, self.start_step = engine, out, steps, start_step
        self.tokens_per_step, self.log_interval, self.rank = tokens_per_step, log_interval, rank
        self.log = MetricsLog(out / "metrics.jsonl", resume_step=start_step) if rank == 0 else None
        self.seen_transition = engine.last_transition
        self.run_start = self.window_start = time.perf_counter()
        self.window_steps = 0
        self.record: Dict[str, Any] = {}
        self.events: Dict[str, float] = {}

    def starting(self, parameters_total: int) -> None:
        engine = self.engine
        say(f"training {self.steps} steps from step {self.start_step}: {self.tokens_per_step} tokens/step, stage "
            f"{engine.stage}, {parameter_count(engine.module):,} parameters per rank, {parameters_total:,} in total, "
            f"output {self.out}")
        if self.rank == 0 and (switch_step(engine) or 0) > self.steps:
            warn(f"the next delink is planned at step {switch_step(engine)}, after this run's last step {self.steps} "
                 f"(--steps, else scheduler.params.total_num_steps): this run trains only the {engine.stage} model")

    def step_done(self, stage: str, groups: int, train_loss: float) -> None:
        """The step just ended (in ``stage`` with ``groups`` parameter groups), and the delink it made, if any."""
        done, engine = self.engine.global_steps, self.engine
        self.window_steps += 1
        self.record = {"step": done, "stage": stage, "groups": groups, "train_loss": round(train_loss, 5),
                       "lr": engine.optimizer.param_groups[0]["lr"], "tokens": done * self.tokens_per_step}
        self.events = {"train_loss": train_loss, "stage": 0.0 if stage == "pseudo" else 1.0}
        if engine.last_transition is not self.seen_transition:
            self.seen_transition = engine.last_transition
            self.events["delink"] = float(self.seen_transition["parameters_after_total"])
            if self.log:
                event = {k: v for k, v in self.seen_transition.items() if not k.startswith("offload_plan")}
                self.log.write({"event": "delink", **event})

    def validation(self, loss: float) -> float:
        """The step's validation loss, as recorded (rounded); returned for the callbacks."""
        self.record["val_loss"] = self.events["val_loss"] = round(loss, 5)
        return self.record["val_loss"]

    def step_reported(self) -> None:
        """The step's record written, its progress line printed when due, its events to DeepSpeed's monitors."""
        record, done = self.record, self.record["step"]
        if self.log:
            self.log.write(record)
        if done % self.log_interval == 0 or "val_loss" in record or done == self.steps:
            elapsed = time.perf_counter() - self.window_start
            rate = self.window_steps * self.tokens_per_step / max(elapsed, 1e-9)
            self.events["tokens_per_s"] = rate
            val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
            say(f"step {done}/{self.steps} | stage {record['stage']} | loss {record['train_loss']:.4f}{val} | "
                f"{rate:,.0f} tokens/s | lr {record['lr']:.2e} | "
                f"{progress(done, self.start_step, self.steps, switch_step(self.engine), self.run_start)}")
            self.window_start, self.window_steps = time.perf_counter(), 0
        write_monitor(self.engine, self.events, done, self.tokens_per_step)

    def closing(self, checkpoint: Path, title: str, seconds: float) -> None:
        """Rank 0: the loss plot and the closing summary."""
        if self.rank != 0:
            return
        history = read_records(self.out / "metrics.jsonl")
        plot: Optional[Path] = self.out / "loss.png"
        try:
            plot_history(history, plot, title=title)
        except OSError as error:  # like a failed log write: the run itself is done and saved
            warn(f"could not write {plot}: {error}")
            plot = None
        say(closing_summary(history, self.out, checkpoint, plot, self.start_step, self.steps, self.tokens_per_step,
                            seconds))


def switch_step(engine) -> Optional[int]:
    """The step the next transition is planned at, while it is ahead (a step trigger only: tokens and plateaus are
    not known)."""
    trigger = engine.next_trigger
    return None if trigger is None else trigger.at_step


def progress(done: int, start: int, steps: int, switch: Optional[int], run_start: float) -> str:
    """ETA from this run's mean step time so far, and the time to the switch when one is planned."""
    per_step = (time.perf_counter() - run_start) / max(done - start, 1)
    text = f"eta {format_seconds(per_step * (steps - done))}"
    if switch is not None and switch > done:
        text += f" | switch in {switch - done} steps (~{format_seconds(per_step * (switch - done))})"
    return text


def format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def default_monitor_paths(ds_config: Mapping[str, Any], out: Path) -> Tuple[Dict[str, Any], List[str]]:
    """DeepSpeed's monitors enabled in the config, and the config with tensorboard and csv_monitor writing under the
    run folder where their section gives no ``output_path``."""
    ds_config, enabled = copy.deepcopy(dict(ds_config)), []
    for name in MONITOR_SECTIONS:
        section = ds_config.get(name)
        if isinstance(section, dict) and section.get("enabled"):
            enabled.append(name)
            if name in ("tensorboard", "csv_monitor") and not section.get("output_path"):
                section["output_path"] = str(out / name)
    return ds_config, enabled


def write_monitor(engine, events: dict, step: int, tokens_per_step: int) -> None:
    """The main job's scalars through DeepSpeed's own monitor (rank 0; DeepSpeed 0.19.8 logs the LR itself), against
    samples like DeepSpeed's own ``Train/Samples/*`` events."""
    monitor = engine.monitor
    if not monitor.enabled or dist.get_rank() != 0:
        return
    samples = engine.global_samples
    monitor.write_events([(f"Train/Samples/{name}", value, samples) for name, value in events.items()]
                         + [("Train/Samples/tokens", step * tokens_per_step, samples)])


def stage_spans(history: List[Mapping[str, Any]]) -> List[str]:
    """The run's stages from its history: ``pseudo (1 parameter group) steps 1-150``, each delink between them."""
    spans: List[List[Any]] = []  # [stage, groups, first step, last step]
    delinks = {r["step"]: r for r in history if r.get("event") == "delink"}
    for record in (r for r in history if "train_loss" in r):
        if spans and spans[-1][:2] == [record["stage"], record["groups"]]:
            spans[-1][3] = record["step"]
        else:
            spans.append([record["stage"], record["groups"], record["step"], record["step"]])
    parts = []
    for stage, groups, first, last in spans:
        delink = delinks.get(first - 1)
        if delink is not None:
            parts.append(f"delinked at step {first - 1} in {delink.get('seconds', 0):.2f} s "
                         f"({delink.get('groups_before')} -> {delink.get('groups_after')} parameter groups)")
        plural = "s" if groups != 1 else ""
        parts.append(f"{stage} ({groups} parameter group{plural}) steps {first}-{last}")
    return parts


def closing_summary(history: List[Mapping[str, Any]], out: Path, checkpoint: Path, plot: Optional[Path],
                    start_step: int, steps: int, tokens_per_step: int, seconds: float) -> str:
    """What the run did and where it left it: stages and delinks, steps, tokens, the last losses, the time, the
    checkpoint, metrics and plot, and how to go on."""
    train = [r for r in history if "train_loss" in r]
    val = [r for r in history if "val_loss" in r]
    losses = [f"train {train[-1]['train_loss']:.4f}"] if train else []
    if val:
        losses.append(f"validation {val[-1]['val_loss']:.4f} (step {val[-1]['step']})")
    return "\n".join([
        f"done: step {steps} of {steps}, steps {start_step + 1}-{steps} in this run, {format_seconds(seconds)} in "
        f"all; {steps * tokens_per_step:,} tokens trained on",
        "  stages: " + "; ".join(stage_spans(history) or ["none recorded"]),
        "  final loss: " + (", ".join(losses) or "not recorded"),
        f"  checkpoint: {checkpoint}",
        f"  metrics: {out / 'metrics.jsonl'}" + (f"; plot: {plot}" if plot else ""),
        f"  next: the same command trains on from step {steps} with --steps N (N > {steps}); --no-resume or another "
        f"--output-dir starts over",
    ])


def finished_already(out: Path, ckpt_dir: Path, step: int, steps: int) -> str:
    return (f"{out} has finished already: its checkpoint {ckpt_dir / f'global_step{step}'} is at step {step}, and "
            f"this run is to end at step {steps} (--steps, else scheduler.params.total_num_steps), so there is "
            f"nothing to train. To train on, run the same command with --steps N (N > {step}); to start over, add "
            f"--no-resume or give another --output-dir")
