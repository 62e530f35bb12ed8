"""DeepSpeed's monitors (TensorBoard, CSV, W&B, Comet): one writer per run, rewound to the step a run resumes
from, a failed write a warning. Wraps the monitor instance only; its events are DeepSpeed's (DeepSpeed 0.19.8)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict

from .guard import check_places


# DeepSpeed 0.19.8's monitor sections (deepspeed/monitor/config.py, get_monitor_config), each {"enabled": ...}.
MONITOR_SECTIONS = ("tensorboard", "csv_monitor", "wandb", "comet")


def without_monitors(ds_config: Dict[str, Any]) -> Dict[str, Any]:
    """``ds_config`` with every monitor section disabled: for an engine that is given the run's monitor after it is
    built (DeepSpeed 0.19.8 builds a ``MonitorMaster`` in every engine, and its TensorBoard monitor opens a new
    event file at once, which would stay empty)."""
    return {key: {**value, "enabled": False} if key in MONITOR_SECTIONS and isinstance(value, dict) else value
            for key, value in ds_config.items()}


def _monitor_places(monitor) -> Dict[str, Any]:
    places = {"MonitorMaster": monitor}
    for name, attribute in (("TensorBoardMonitor", "tb_monitor"), ("csvMonitor", "csv_monitor")):
        if getattr(monitor, attribute, None) is not None:
            places[name] = getattr(monitor, attribute)
    return places


def rewind_monitors(engine) -> None:
    """Make what DeepSpeed's TensorBoard and CSV monitors wrote read as if the run had stopped at the engine's
    current step (its ``global_samples``: DeepSpeed 0.19.8 writes its ``Train/Samples/*`` events against it), so that
    the events a resumed run writes next replace what an interrupted run wrote after its checkpoint.

    TensorBoard: DeepSpeed's ``TensorBoardMonitor`` builds its ``SummaryWriter`` at initialize, before the step a run
    resumes from is known, and without ``purge_step``; its writer gets what ``SummaryWriter(purge_step=samples + 1)``
    writes first, a ``SessionLog.START`` event at that step, on which TensorBoard drops every event of the earlier
    files at or after it. CSV: every file of ``csvMonitor.log_dir`` is rewound to its rows up to ``samples``
    (:func:`~ds_pseudo_real.report.rewind_csv`, the rows dropped kept in ``<file>.discarded``), and noted as having
    its header (``csvMonitor.filenames``), which it otherwise writes again the first time a process writes a file.
    W&B and Comet keep their history on their servers and are left as they are."""
    monitor = engine.monitor
    check_places("monitors", {"DeepSpeedEngine": engine, **_monitor_places(monitor)})
    samples = engine.global_samples
    writer = getattr(monitor.tb_monitor, "summary_writer", None)
    if writer is not None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # as torch's SummaryWriter writes them

        writer.file_writer.add_event(Event(step=samples + 1, session_log=SessionLog(status=SessionLog.START)))
        writer.flush()
    csv = monitor.csv_monitor
    if csv is not None and csv.enabled and csv.log_dir:
        from pathlib import Path

        from ..report import rewind_csv

        for path in sorted(Path(csv.log_dir).glob("*.csv")):
            if rewind_csv(path, samples) and path.stem not in csv.filenames:
                csv.filenames.append(path.stem)


def warn_on_failed_monitor_writes(engine, warn: Callable[[str], None]) -> None:
    """Make the engine's monitor (DeepSpeed's ``MonitorMaster``: its TensorBoard, CSV, W&B and Comet writers, which
    ``engine.step`` writes through too) treat a write that fails with an OSError (a full disk) as a save that fails
    is treated: ``warn`` the first time, and training goes on; the events of that call are lost. Wraps the write of
    that monitor instance, once (the controller hands one monitor from engine to engine)."""
    monitor = engine.monitor
    if hasattr(monitor.write_events, "__wrapped__"):
        return
    write = monitor.write_events
    warned = []

    @functools.wraps(write)
    def write_events(*args, **kwargs):
        try:
            return write(*args, **kwargs)
        except OSError as error:
            if not warned:
                warned.append(error)
                warn(f"could not write DeepSpeed's monitors' events: {error}; training goes on without them (later "
                     f"events are written once there is room; this warning is not repeated)")

    monitor.write_events = write_events
