"""SLURM submission: write an sbatch script into the run folder and submit it with ``sbatch``.

    python -m launch.slurm submit --nodes 64 --gpus-per-node 8 --partition P --time 10-00:00:00 \\
        --deepspeed-config configs/m6_10t.json [--output-dir DIR] [--requeue] [--dry-run] -- <train args>

Inside the job, ``srun`` starts one task per GPU and each task runs ``python -m launch.dist_env -- python
launch/train.py ...``, which derives RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from SLURM's variables.
One task per GPU, rather than one deepspeed/torchrun launcher per node, because then SLURM itself owns every rank:
it places and binds them, delivers signals (preemption, time-limit warning, scancel) straight to each rank, writes
one log per rank (``srun --output rank-%t.log``), kills the whole step when one rank fails (``--kill-on-bad-exit``),
and needs no ssh/pdsh between nodes. A per-node launcher would sit between SLURM and the ranks and have to do each
of these again.

Before srun, the batch shell runs ``python -m launch.train --check`` on the job's config, rank count and train
arguments (for the default training script): a config error stops the job there with one ``error:`` line in the
sbatch log and exit status 2, before any rank starts.

Checkpoint before the end: ``--signal=B:USR1@GRACE`` makes SLURM signal the batch shell GRACE seconds before the
time limit; the shell forwards SIGUSR1 to srun, which forwards it to every rank; the trainer saves a checkpoint at
the next step boundary and exits 0. With ``--requeue`` the shell then requeues the job (same job id, same port) if
DIR/checkpoints/latest names a new checkpoint, and the trainer resumes from it. The same happens on
``scancel --batch --signal=USR1 JOB``; ``scancel --signal=USR1 JOB`` signals only the ranks: checkpoint, then stop.
Preemption (PreemptMode=REQUEUE) sends SIGTERM to every rank directly and SLURM requeues the job by itself.

Written against SLURM 22.05 (sbatch/srun/scontrol options used here exist in 20.11 and later).
"""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCRIPT = REPO / "launch" / "train.py"
SCRIPT_NAME = "submit.sbatch"
SIGNAL_SLACK_S = 60

_TIME_FORMATS = ("MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES, "
                 "DAYS-HOURS:MINUTES:SECONDS or UNLIMITED")


def time_limit_seconds(value: str) -> Optional[int]:
    """Seconds in a SLURM ``--time`` value (None for no limit); ValueError naming the accepted formats."""
    text = value.strip()
    if text.lower() in ("infinite", "unlimited"):
        return None
    days = 0
    match = re.fullmatch(r"(\d+)-(\d+(?::\d+){0,2})", text)
    if match:
        days, rest = int(match.group(1)), match.group(2).split(":")
        hours, minutes, seconds = (list(map(int, rest)) + [0, 0])[:3]
    elif re.fullmatch(r"\d+(?::\d+){0,2}", text):
        parts = list(map(int, text.split(":")))
        hours, minutes, seconds = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    else:
        raise ValueError(f"--time {value!r}: expected {_TIME_FORMATS}")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"--time {value!r}: the time limit must be positive")
    return total


@dataclass
class JobSpec:
    """Everything the sbatch script depends on; paths absolute."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    partition: str
    time: str
    deepspeed_config: Path
    output_dir: Path
    train_args: List[str] = field(default_factory=list)
    job_name: str = "ds_pseudo_real"
    requeue: bool = False
    signal_grace_s: int = 300
    distributed_timeout_min: int = 10
    cpus_per_task: Optional[int] = None
    script: Path = DEFAULT_SCRIPT
    python: str = sys.executable
    sbatch_options: List[str] = field(default_factory=list)
    workdir: Path = field(default_factory=Path.cwd)

    def validate(self) -> None:
        """Raise ValueError naming the flag, the value and what is accepted."""
        if self.nodes < 1:
            raise ValueError(f"--nodes {self.nodes}: expected at least 1")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node}: expected 0 (CPU job) or more")
        if self.tasks_per_node < 1:
            raise ValueError(f"--tasks-per-node {self.tasks_per_node}: expected at least 1 "
                             "(it defaults to --gpus-per-node; give it for CPU jobs with --gpus-per-node 0)")
        if self.gpus_per_node and self.tasks_per_node != self.gpus_per_node:
            raise ValueError(f"--tasks-per-node {self.tasks_per_node} with --gpus-per-node {self.gpus_per_node}: "
                             "one task per GPU is the only layout this submitter writes; leave --tasks-per-node out")
        if self.distributed_timeout_min < 1:
            raise ValueError(f"--distributed-timeout-minutes {self.distributed_timeout_min}: expected at least 1")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ValueError(f"--cpus-per-task {self.cpus_per_task}: expected at least 1")
        if not re.fullmatch(r"[A-Za-z0-9_.,-]+", self.partition):
            raise ValueError(f"--partition {self.partition!r}: expected a partition name (letters, digits, _ . , -)")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job_name):
            raise ValueError(f"--job-name {self.job_name!r}: expected letters, digits, _ . -")
        limit = time_limit_seconds(self.time)
        # SLURM checks pending signals about once a minute, so the warning may come up to 60 s early: a grace that
        # close to the limit would signal the ranks while they start, before their handler exists.
        if self.signal_grace_s < 0 or (limit is not None and self.signal_grace_s + SIGNAL_SLACK_S >= limit):
            raise ValueError(f"--signal-grace {self.signal_grace_s}: expected 0 <= seconds < the time limit minus "
                             f"{SIGNAL_SLACK_S} s (--time {self.time} = {limit} s); the checkpoint signal comes "
                             f"{self.signal_grace_s}-{self.signal_grace_s + SIGNAL_SLACK_S} s before the end")
        if not self.deepspeed_config.is_file():
            raise ValueError(f"--deepspeed-config {self.deepspeed_config}: no such file")
        if not self.script.is_file():
            raise ValueError(f"--script {self.script}: no such file")
        for flag in ("--output-dir", "--deepspeed_config", "--deepspeed-config", "--local_rank"):
            if any(arg == flag or arg.startswith(flag + "=") for arg in self.train_args):
                raise ValueError(f"train argument {flag} after '--': the submitter sets it (use the submit flag "
                                 "--output-dir / --deepspeed-config; LOCAL_RANK comes from SLURM)")

    @property
    def logs_dir(self) -> Path:
        return self.output_dir / "logs"

    def train_command(self) -> List[str]:
        return [self.python, str(self.script), "--deepspeed_config", str(self.deepspeed_config),
                "--output-dir", str(self.output_dir), *self.train_args]

    def check_command(self) -> Optional[List[str]]:
        """The main job's ``--check`` for this job's ranks and train arguments; None for another training script."""
        if self.script.resolve() != DEFAULT_SCRIPT.resolve():
            return None
        return [self.python, "-m", "launch.train", "--check", str(self.deepspeed_config), "--world-size",
                str(self.nodes * self.tasks_per_node), *self.train_args]


# The script's end: the traps that pass USR1 on to the ranks, the wait for them, and the requeue after a USR1 once
# a newer checkpoint was saved.
_WAIT_AND_REQUEUE = [
    "SRUN_PID=$!",
    'SIGNALLED=""',
    "# USR1 comes to this shell alone (--signal=B:..., scancel --batch): pass it to srun, which passes it to",
    "# every rank. SIGTERM (preemption, scancel) already reaches every rank from SLURM: only note it.",
    "trap 'SIGNALLED=USR1; echo \"got SIGUSR1: asking the ranks to checkpoint\"; kill -USR1 $SRUN_PID' USR1",
    "trap 'SIGNALLED=TERM; echo \"got SIGTERM\"' TERM",
    "while :; do",
    '    wait "$SRUN_PID"; STATUS=$?',
    '    kill -0 "$SRUN_PID" 2>/dev/null || break',
    "done",
    'echo "ranks exited with status $STATUS at $(date -Is)"',
    'LATEST_AFTER=$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null)',
    'if [ "$SIGNALLED" = USR1 ] && [ "$REQUEUE" = 1 ]; then',
    "    # Requeue only after progress: a run that cannot reach its next checkpoint would otherwise loop forever.",
    '    if [ "$STATUS" = 0 ] && [ -n "$LATEST_AFTER" ] && [ "$LATEST_AFTER" != "$LATEST_BEFORE" ]; then',
    '        echo "requeueing job $SLURM_JOB_ID to resume from checkpoint $LATEST_AFTER"',
    '        scontrol requeue "$SLURM_JOB_ID"',
    "    else",
    '''        echo "not requeueing: status $STATUS, latest checkpoint '$LATEST_AFTER' (before: '$LATEST_BEFORE')"''',
    "    fi",
    "fi",
    'exit "$STATUS"',
]


def _directives(spec: JobSpec) -> List[str]:
    return [
        f"--job-name={spec.job_name}",
        f"--partition={spec.partition}",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.tasks_per_node}",
        *([f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []),
        *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else []),
        f"--time={spec.time}",
        # The submit directory, so that relative paths in the train arguments mean the same on a resubmission.
        f"--chdir={spec.workdir}",
        f"--output={spec.logs_dir}/sbatch-%j.log",
        # A requeued job appends to the same logs rather than truncating the first attempt's.
        "--open-mode=append",
        f"--signal=B:USR1@{spec.signal_grace_s}",
        "--requeue" if spec.requeue else "--no-requeue",
        *spec.sbatch_options,
    ]


def _srun_command_lines(spec: JobSpec) -> List[str]:
    """The training step: srun, the per-rank environment wrapper and the trainer, one option group a line."""
    # SLURM >= 22.05 no longer passes the job's --cpus-per-task on to srun; say it again on the step.
    srun = ["srun", "--kill-on-bad-exit=1", "--open-mode=append", f"--output={spec.logs_dir}/rank-%t.log",
            *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else [])]
    wrapper = [spec.python, "-m", "launch.dist_env", "--"]
    return [shlex.join(srun), shlex.join(wrapper), *map(shlex.join, _option_groups(spec.train_command()))]


def sbatch_script(spec: JobSpec) -> str:
    """The sbatch script for ``spec`` (pure: same spec, same text)."""
    q = shlex.quote
    check = spec.check_command()
    lines = [
        "#!/bin/bash",
        "# Written by `python -m launch.slurm submit`; `sbatch` this file again to resume the run from its latest",
        "# checkpoint (the trainer resumes from $RUN_DIR/checkpoints by itself).",
        *[f"#SBATCH {d}" for d in _directives(spec)],
        "",
        f"RUN_DIR={q(str(spec.output_dir))}",
        f"REQUEUE={int(spec.requeue)}",
        f"export PYTHONPATH={q(str(REPO))}${{PYTHONPATH:+:$PYTHONPATH}}",
        "# A collective (gloo, NCCL) that waits longer than this fails its rank, and srun then ends the step: read by",
        "# DeepSpeed's init_distributed, in minutes.",
        f"export DEEPSPEED_TIMEOUT={spec.distributed_timeout_min}",
        'mkdir -p "$RUN_DIR/logs"',
        'LATEST_BEFORE=$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null)',
        'echo "job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on $SLURM_JOB_NODELIST at $(date -Is)"',
        *([] if check is None else [
            "# The whole configuration, checked here before any rank starts: an error is one `error:` line in this log",
            "# and exit status 2.",
            shlex.join(check) + ' || exit "$?"']),
        "",
        # srun runs in the background so that the shell's traps fire while the ranks train (bash runs a trap only
        # between commands, and `wait` is interruptible).
        " \\\n    ".join(_srun_command_lines(spec)) + " &",
        *_WAIT_AND_REQUEUE,
    ]
    return "\n".join(lines) + "\n"


def _option_groups(command: List[str]) -> List[List[str]]:
    """``[prog, --a, 1, --b]`` -> ``[[prog], [--a, 1], [--b]]``: one trainer option per script line."""
    groups: List[List[str]] = []
    for arg in command:
        if not groups or arg.startswith("--"):
            groups.append([])
        groups[-1].append(arg)
    return groups


def write_script(spec: JobSpec) -> Path:
    """Write DIR/submit.sbatch; an earlier, different one is kept as submit.sbatch.<its mtime> for the record."""
    spec.logs_dir.mkdir(parents=True, exist_ok=True)
    path = spec.output_dir / SCRIPT_NAME
    text = sbatch_script(spec)
    if path.exists() and path.read_text() != text:
        path.rename(path.with_name(f"{SCRIPT_NAME}.{int(path.stat().st_mtime)}"))
    path.write_text(text)
    return path


def submit(script: Path) -> str:
    """``sbatch`` the script; return the job id."""
    if shutil.which("sbatch") is None:
        raise RuntimeError("sbatch is not on PATH: run this on a SLURM login node, or use --dry-run")
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch {script} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("submit", help="write the sbatch script into the run folder and sbatch it",
                              usage="python -m launch.slurm submit --nodes N --gpus-per-node G --partition P "
                                    "--time T --deepspeed-config CFG [options] -- [train args]")
    sub.add_argument("--nodes", type=int, required=True)
    sub.add_argument("--gpus-per-node", type=int, required=True, help="one rank per GPU; 0 for a CPU job")
    sub.add_argument("--tasks-per-node", type=int, default=None,
                     help="ranks per node (default: --gpus-per-node; required with --gpus-per-node 0)")
    sub.add_argument("--cpus-per-task", type=int, default=None, help="CPU cores per rank (data loading, CPU Adam)")
    sub.add_argument("--partition", required=True)
    sub.add_argument("--time", required=True, help=f"time limit: {_TIME_FORMATS}")
    sub.add_argument("--deepspeed-config", type=Path, required=True)
    sub.add_argument("--output-dir", type=Path, default=None,
                     help="run folder: script, logs, checkpoints, metrics (default: runs/<job-name>-<timestamp>)")
    sub.add_argument("--job-name", default="ds_pseudo_real")
    sub.add_argument("--requeue", action="store_true",
                     help="after the time-limit checkpoint, requeue the job; it resumes from the checkpoint")
    sub.add_argument("--signal-grace", type=int, default=300, dest="signal_grace_s",
                     help="seconds before the time limit at which the ranks are told to checkpoint (default 300)")
    sub.add_argument("--distributed-timeout-minutes", type=int, default=10, dest="distributed_timeout_min",
                     metavar="MINUTES", help="a collective that waits longer fails the rank and ends the step "
                                             "(DEEPSPEED_TIMEOUT; default 10)")
    sub.add_argument("--script", type=Path, default=DEFAULT_SCRIPT,
                     help="training script (default launch/train.py); it gets --deepspeed_config and --output-dir")
    sub.add_argument("--python", default=sys.executable, help="python on the compute nodes (default: this one)")
    sub.add_argument("--sbatch-option", action="append", default=[], dest="sbatch_options", metavar="OPT",
                     help="extra #SBATCH line, e.g. --sbatch-option=--account=A (repeatable)")
    sub.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    sub.add_argument("train_args", nargs=argparse.REMAINDER, help="after '--': passed to the training script")
    return parser


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    output_dir = args.output_dir or Path("runs") / f"{args.job_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = JobSpec(
        nodes=args.nodes,
        tasks_per_node=args.gpus_per_node if args.tasks_per_node is None else args.tasks_per_node,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        time=args.time,
        deepspeed_config=args.deepspeed_config.resolve(),
        output_dir=output_dir.resolve(),
        train_args=train_args,
        job_name=args.job_name,
        requeue=args.requeue,
        signal_grace_s=args.signal_grace_s,
        distributed_timeout_min=args.distributed_timeout_min,
        cpus_per_task=args.cpus_per_task,
        script=args.script.resolve(),
        python=args.python,
        sbatch_options=args.sbatch_options,
    )
    spec.validate()
    return spec


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    if args.dry_run:
        sys.stdout.write(sbatch_script(spec))
        return 0
    path = write_script(spec)
    try:
        job_id = submit(path)
    except RuntimeError as err:  # exit 2, as every error of the project's commands
        print(f"error: {err} (the script is written: {path})", file=sys.stderr)
        return 2
    print(f"submitted job {job_id}: script {path}, logs {spec.logs_dir}/ (sbatch-{job_id}.log, rank-N.log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
