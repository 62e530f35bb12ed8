"""Running Megatron-LM's own ``pretrain_gpt.py`` through the drop-in, for the tests: the launch, the tiny CPU model's
flags, and what a run's log says (losses, gradient norms, parameter counts, the drop-in's warnings).

Runs the unmodified script of a Megatron-LM checkout (tag core_v0.16.1, matching the megatron-core wheel) named by
``MEGATRON_LM_PATH``; CI points it at ../shared/third_party/megatron-lm. Tiny GPT (4 layers, hidden 64), mock data
and Megatron's NullTokenizer, CPU, gloo; losses are read from Megatron's own log lines.

Megatron prints a run's first iteration without resetting its loss accumulator, so the second iteration a process
logs is the mean of its first two: that one line of each (resumed) run is left out of the comparisons.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, Optional

import pytest
from conftest import free_port, launch_marker, nothing_left_of_launch, python_path

from megatron_patches.run import TRACKER_FILE

# What workers/run_sequence.py prints (stdout and stderr) before each of its runs, followed by the run's name.
RUN_MARKER = "=== run "
MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
SCRIPT = Path(MEGATRON_LM or ".") / "pretrain_gpt.py"
needs_megatron_lm = pytest.mark.skipif(
    not SCRIPT.is_file(),
    reason=("MEGATRON_LM_PATH is not set" if MEGATRON_LM is None else f"MEGATRON_LM_PATH={MEGATRON_LM} holds no "
            "pretrain_gpt.py") + ": these tests run Megatron-LM's own training script (a checkout of tag "
           "core_v0.16.1; CI sets ../shared/third_party/megatron-lm)")

# What a CPU smoke run of Megatron-LM needs besides the model: gloo, no fused kernels it cannot build, and the
# batches read in the rank's own process (Megatron's default forks 2 loader workers per run: forked from a process
# that runs several runs, its threads from the runs before, a worker deadlocked once and the rank waited forever).
CPU = ["--distributed-backend", "gloo", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
       "--num-workers", "0"]
TINY = [*CPU, "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--transformer-impl", "local",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000",
        "--log-interval", "1"]
# M6 expert prototyping: 4 experts in 2 prototypes, split over 2 expert-parallel ranks.
M6 = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "none",
      "--m6-expert-prototypes", "2", "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2"]

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|.*?"
                  r"lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|")
# fp16's dynamic loss scale, on the same log lines
SCALE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.E+-]+) \|")
# Printed by Megatron-LM each time it initialises (once per pass of the script).
LAYOUT = re.compile(r"using world size: \d+, data-parallel size: (\d+),.*?tensor-model-parallel size: (\d+), "
                    r"pipeline-model-parallel size: (\d+)")
PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)")


class Log:
    """What one run printed: its losses, gradient norms, loss scales and times (ms) by iteration (the second loss
    each pass of the script logged left out, see the module docstring), the (data, tensor, pipeline) parallel sizes
    of each pass,
    the parameter count of each model it built on tensor and pipeline rank 0, in order (and on every (tensor,
    pipeline) rank: ``stage_params``), the drop-in's warnings (stderr) and notes (stdout), and its delink lines."""

    def __init__(self, stdout: str, stderr: str = ""):
        passes = [LOSS.findall(text) for text in LAYOUT.split(stdout)[::LAYOUT.groups + 1]]
        self.layouts = [tuple(map(int, sizes)) for sizes in LAYOUT.findall(stdout)]
        self.iterations, self.losses, self.grad_norms, self.times_ms = [], {}, {}, {}
        for logged in passes:
            for n, (i, ms, loss, norm) in enumerate(logged):
                self.iterations.append(int(i))
                if n != 1:
                    self.losses[int(i)] = float(loss)
                self.grad_norms[int(i)], self.times_ms[int(i)] = float(norm), float(ms)
        self.loss_scales = {int(i): float(scale) for i, scale in SCALE.findall(stdout)}
        counts = [((int(tp), int(pp)), int(n)) for tp, pp, n in PARAMS.findall(stdout)]
        self.params = [n for rank, n in counts if rank == (0, 0)]
        self.stage_params: Dict[tuple, list] = {}
        for rank, n in counts:
            self.stage_params.setdefault(rank, []).append(n)
        self.warnings = [line for line in stderr.splitlines() if line.startswith("[megatron_patches] WARNING")]
        self.notes = [line for line in stdout.splitlines() if line.startswith("[megatron_patches] ")]
        self.delinks = [line for line in stdout.splitlines() if line.startswith("[ds_pseudo_real] delinked at ")]


def pretrain(nproc: int, *flags: str, cwd: Path, expect_ok: bool = True, env_extra: Optional[dict] = None
             ) -> subprocess.CompletedProcess:
    return launch(nproc, "-m", "megatron_patches.run", str(SCRIPT), *flags, cwd=cwd, expect_ok=expect_ok,
                  env_extra=env_extra)


def launch(nproc: int, *program: str, cwd: Path, expect_ok: bool = True, env_extra: Optional[dict] = None,
           timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(MEGATRON_LM or "")})
    # Megatron's fused functions (bias-GeLU, bias-dropout-add, ...) run eagerly: megatron.core.jit wraps them in
    # torch.compile, which traces them again in every process and on the CPU builds them with the C++ compiler (a
    # 1-rank run of the tiny model through the switch: 13-14 s of CPU compiled, 8.3 s eager). The runs here compare
    # with each other, all eager; the two-node SLURM test (tests/slurm/test_two_node_cluster.py) runs the drop-in
    # with them compiled (env_extra={"TORCH_COMPILE_DISABLE": "0"} for a launch compared with it).
    env["TORCH_COMPILE_DISABLE"] = "1"
    env.update(env_extra or {})
    marker = launch_marker(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), *program]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
    # every process the ranks started (Megatron's checkpoint writers, its results Manager) ended with them
    left = nothing_left_of_launch(marker)
    assert not left, f"{' '.join(cmd)} left processes behind: {left}"
    return proc


def train(nproc: int, *flags: str, cwd: Path) -> Log:
    proc = pretrain(nproc, *TINY, *flags, cwd=cwd)
    return Log(proc.stdout, proc.stderr)


class Sequence:
    """Runs of ``pretrain_gpt.py`` through the drop-in, launched together (workers/run_sequence.py: one launch, one
    process per rank for all of them): ``train`` and ``resume_from`` add a run, ``logs`` launches them all and returns
    each run's ``Log`` by name. Nothing of one run reaches the next: test_megatron_run's async run, last in its
    launch, prints the first run's losses exactly."""

    def __init__(self, nproc: int, cwd: Path):
        self.nproc, self.cwd, self.steps = nproc, cwd, []

    def train(self, name: str, *flags: str) -> None:
        self.steps.append({"run": name, "argv": [str(SCRIPT), *TINY, *flags]})

    def resume_from(self, name: str, saved: Path, iteration: int, *flags: str) -> Path:
        """Add a run of the command on a copy of ``saved``'s checkpoint of ``iteration`` (see ``resume_from``);
        returns its checkpoint directory."""
        directory = self.cwd / name
        self.steps.append({"copy": [str(saved), iteration, str(directory)]})
        self.train(name, *flags, "--save", str(directory), "--load", str(directory))
        return directory

    def logs(self) -> Dict[str, Log]:
        steps = self.cwd / f"steps_{len(list(self.cwd.glob('steps_*.json')))}.json"
        steps.write_text(json.dumps(self.steps))
        runs = [step["run"] for step in self.steps if "run" in step]
        proc = launch(self.nproc, str(Path(__file__).parent / "workers" / "run_sequence.py"), str(steps),
                      cwd=self.cwd, timeout=300 + 120 * len(runs))
        outputs = [proc.stdout.split(RUN_MARKER), proc.stderr.split(RUN_MARKER)]
        logs = {}
        for stdout, stderr in zip(*(output[1:] for output in outputs)):
            name, stdout = stdout.split("\n", 1)
            logs[name] = Log(stdout, stderr.split("\n", 1)[1])
        assert list(logs) == runs, f"runs logged: {list(logs)}, launched: {runs}"
        return logs


def copy_checkpoint(saved: Path, iteration: int, directory: Path) -> Path:
    """A new checkpoint folder holding only ``saved``'s checkpoint of ``iteration`` (as after a crash right after
    it was written)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(saved / name, directory / name)
    (directory / TRACKER_FILE).write_text(str(iteration))
    return directory


def resume_from(saved: Path, iteration: int, nproc: int, *flags: str, cwd: Path, name: Optional[str] = None
                ) -> tuple:
    """Relaunch the run's command on a copy of its checkpoint of ``iteration``: returns (the resumed run's log, its
    own checkpoint directory)."""
    directory = copy_checkpoint(saved, iteration, cwd / (name or f"resumed_from_{iteration}"))
    return train(nproc, *flags, "--save", str(directory), "--load", str(directory), cwd=cwd), directory


def check_resumed_run(full: Log, resumed: Log, first: int, last: int) -> None:
    assert resumed.iterations == list(range(first, last + 1))
    assert resumed.losses == {i: full.losses[i] for i in resumed.losses}
    assert len(resumed.losses) == last - first  # every iteration but the second logged one compared


def same_losses(reference: Log, run: Log, iterations: Iterable[int], tolerance: float) -> None:
    """``run``'s losses and gradient norms at ``iterations`` are ``reference``'s, to ``tolerance`` (absolute, on the
    printed values)."""
    iterations = list(iterations)
    assert [run.losses[i] for i in iterations] == pytest.approx([reference.losses[i] for i in iterations],
                                                                abs=tolerance, rel=0)
    assert [run.grad_norms[i] for i in iterations] == pytest.approx(
        [reference.grad_norms[i] for i in iterations], abs=1e-3, rel=0)  # printed to 3 decimals
