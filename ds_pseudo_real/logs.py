"""What a run prints: the plugin's lines through Python ``logging`` (the ``ds_pseudo_real`` logger), rank 0 at INFO
and the other ranks at WARNING, and each repeated warning of the libraries shown once per process.

Owns: the logger and its handler (INFO to stdout as ``[ds_pseudo_real] ...``, warnings to stderr as
``[ds_pseudo_real] WARNING: ...``, the streams looked up at each line, so that a redirection or pytest's capture
sees them), the choice of ranks (``DS_PSEUDO_REAL_LOG_ALL_RANKS=1``, or the main job's ``--log-all-ranks``: every rank
at INFO, each line naming its rank), and the filters it puts on DeepSpeed's logger and on Python's ``warnings``.
Must not touch models, engines or files.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

LOGGER_NAME = "ds_pseudo_real"
ALL_RANKS_ENV = "DS_PSEUDO_REAL_LOG_ALL_RANKS"
PREFIX = "[ds_pseudo_real] "
DEEPSPEED_LOGGER = "DeepSpeed"  # deepspeed.utils.logging.logger (DeepSpeed 0.19.8)


def process_rank() -> int:
    """This process's rank: the process group's, else ``$RANK`` (set by every launcher before the group exists)."""
    dist = sys.modules.get("torch.distributed")  # never imported here: a process without it is rank $RANK
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def all_ranks() -> bool:
    """Whether every rank logs at INFO (``DS_PSEUDO_REAL_LOG_ALL_RANKS`` set to anything but empty or 0)."""
    return os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")


def log_all_ranks() -> None:
    """From now on every rank of this process logs at INFO (the main job's ``--log-all-ranks``)."""
    os.environ[ALL_RANKS_ENV] = "1"


class RankFilter(logging.Filter):
    """Records below WARNING from rank 0 only, unless every rank is asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or all_ranks() or process_rank() == 0


class Once(logging.Filter):
    """Each message (level and text) once per process: a library repeats the same warning for every engine it
    builds and every step it takes."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _Lines(logging.Handler):
    """``<prefix>message`` on stdout, ``<prefix>WARNING: message`` (ERROR: ...) on stderr, flushed at once: a rank's
    lines interleave with the other ranks' and its launcher's."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if all_ranks():
                text = f"rank {process_rank()}: {text}"
            if record.levelno >= logging.WARNING:
                stream, text = sys.stderr, f"{record.levelname}: {text}"
            else:
                stream = sys.stdout
            stream.write(self.prefix + text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: a failed line never ends the run
            self.handleError(record)


def _configured(name: str, prefix: str) -> logging.Logger:
    """The logger ``name`` with its handler and rank filter (once per process). Like DeepSpeed's own logger it does
    not propagate to the root logger: a script's ``logging.basicConfig`` would print each line twice."""
    logger = logging.getLogger(name)
    if not any(isinstance(h, _Lines) for h in logger.handlers):
        handler = _Lines(prefix)
        handler.addFilter(RankFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


logger = _configured(LOGGER_NAME, PREFIX)
# The main job's own lines (progress, summary): the job's output itself, without the plugin's prefix.
job_logger = _configured(LOGGER_NAME + ".job", "")


def quiet_libraries() -> None:
    """Each repeated warning once per process: DeepSpeed's logger (its INFO lines from rank 0 only, as its own
    ``log_dist`` does for most of them), and Python's ``warnings`` by their text (the default shows a message once
    per line of code that raises it, and megatron.core raises the same one from three modules; the ``once`` filter
    would not help, as CPython keeps its record per module). ``-W``, ``PYTHONWARNINGS`` and a script's own filters
    still decide what is shown at all. Idempotent."""
    deepspeed_logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, Once) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(Once())
        deepspeed_logger.addFilter(RankFilter())
    if not getattr(warnings.showwarning, "shows_each_text_once", False):
        warnings.showwarning = _each_text_once(warnings.showwarning)


def _each_text_once(show):
    """``warnings.showwarning`` (the hook Python documents for replacing) that passes each (text, category) on once."""
    shown = set()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if (str(message), category) not in shown:
            shown.add((str(message), category))
            show(message, category, filename, lineno, file, line)

    showwarning.shows_each_text_once = True
    return showwarning
