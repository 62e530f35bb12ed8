"""launch/train.py whose ranks each kill themselves with SIGKILL right after step ``KILL_AT_STEP`` is logged (its
metrics.jsonl record and monitor events written, no checkpoint): a crash between two checkpoints, at an exact step.
Arguments are launch/train.py's."""
import os
import signal
import sys

from launch import run_report, train

KILL_AT = int(os.environ["KILL_AT_STEP"])
write_monitor = run_report.write_monitor


def write_then_die(engine, events, step, tokens_per_step):
    write_monitor(engine, events, step, tokens_per_step)
    if step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)


run_report.write_monitor = write_then_die
sys.exit(train.main(sys.argv[1:]))
