"""What a newcomer waits for: the import time of the first commands, and the first run of the README's main job.

    python benchmarks/first_hour.py                      # both parts: about 5 minutes on 2 idle cores
    python benchmarks/first_hour.py --imports-only       # the commands only: a minute
    python benchmarks/first_hour.py --repo /tmp/old      # another checkout's commands (a before/after comparison)

Imports: each command of ``COMMANDS`` runs ``--rounds`` times (wall time, median) and once under
``python -X importtime``: the import time in all (the sum of every module's own time), the cumulative time of the
heavy packages, and whether it imported megatron. First run: the README's command, ``deepspeed launch/train.py
--deepspeed_config configs/tiny_cpu.json``, into a fresh output folder and a fresh, empty ``TORCH_EXTENSIONS_DIR``
(so DeepSpeed's C++ ops it needs are built, as on a new machine): its wall time, the longest time it printed nothing
(and the line that ended it), and the machine's load average, sampled every 5 s while it ran. Writes the figures
into ``--out`` (default ``benchmarks/results/first_hour.json``) and prints them.

Absolute seconds depend on the machine and its load: the load measured alongside is part of every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, machine_description  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (name, arguments after ``python``), run from the repository's root; {scratch}: a folder with docs.jsonl
COMMANDS = [
    ("ds-pseudo-real --help", ["-m", "ds_pseudo_real.cli", "--help"]),
    ("python launch/train.py --help", ["launch/train.py", "--help"]),
    ("python -m launch.train --check configs/tiny_cpu.json",
     ["-m", "launch.train", "--check", "configs/tiny_cpu.json"]),
    ("ds-pseudo-real preprocess --help", ["-m", "ds_pseudo_real.cli", "preprocess", "--help"]),
    ("ds-pseudo-real preprocess (100 documents, bytes)", ["-m", "ds_pseudo_real.cli", "preprocess", "--input",
                                                          "{scratch}/docs.jsonl", "--output-prefix", "{scratch}/docs"]),
    ("ds-pseudo-real plan --config configs/offload_m6_10t.json --device-memory 32GB --world-size 512",
     ["-m", "ds_pseudo_real.cli", "plan", "--config", "configs/offload_m6_10t.json", "--device-memory", "32GB",
      "--world-size", "512"]),
]
HEAVY = ("torch", "deepspeed", "megatron.core", "transformers", "matplotlib", "pydantic", "numpy")
MAIN_JOB = ["launch/train.py", "--deepspeed_config", "configs/tiny_cpu.json"]
LOAD_SAMPLE_S = 5.0


def environment(repo: Path, **extra: str) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(repo), **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return env


def parse_importtime(text: str) -> Dict[str, object]:
    """``-X importtime``'s report: the sum of every module's own time, each heavy package's cumulative time (its
    first, outermost import), and the top-level packages imported."""
    own, heavy, packages = 0, {}, set()
    for line in text.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        fields = line[len("import time:"):].split("|")
        try:
            self_us, cumulative_us = int(fields[0]), int(fields[1])
        except ValueError:
            continue  # the header line
        name = fields[2].strip()
        own += self_us
        top = name.split(".")[0]
        packages.add(top)
        if name in HEAVY:
            heavy[name] = max(heavy.get(name, 0), cumulative_us)
    return {"import_s": round(own / 1e6, 3), "heavy_s": {k: round(v / 1e6, 3) for k, v in sorted(heavy.items())},
            "megatron_imported": "megatron" in packages}


def measure_command(repo: Path, args: List[str], rounds: int) -> Dict[str, object]:
    walls = []
    for _ in range(rounds):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *args], cwd=repo, env=environment(repo), capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
    profiled = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=repo, env=environment(repo),
                              capture_output=True, text=True)
    return {"exit_status": proc.returncode, "wall_s_median": round(statistics.median(walls), 3),
            "wall_s": [round(w, 3) for w in walls], **parse_importtime(profiled.stderr)}


class LoadSampler:
    """The 1-minute load average every ``LOAD_SAMPLE_S`` seconds, in a thread, while a command runs."""

    def __init__(self):
        self.samples: List[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(LOAD_SAMPLE_S)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> Dict[str, float]:
        return {"min": min(self.samples), "mean": round(statistics.mean(self.samples), 2), "max": max(self.samples)}


def first_run(repo: Path, steps: Optional[int], launcher: str) -> Dict[str, object]:
    """The README's main job in a fresh output folder with an empty op cache: wall time, longest silence, load."""
    with tempfile.TemporaryDirectory(prefix="first_hour_") as scratch:
        out, ops = Path(scratch) / "run", Path(scratch) / "torch_extensions"
        command = [launcher, *MAIN_JOB, "--output-dir", str(out)] + (["--steps", str(steps)] if steps else [])
        env = environment(repo, TORCH_EXTENSIONS_DIR=str(ops), PYTHONUNBUFFERED="1")
        load_before = os.getloadavg()[0]
        lines, silences = [], []
        with LoadSampler() as load:
            start = last = time.perf_counter()
            proc = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1)
            for line in proc.stdout:
                now = time.perf_counter()
                silences.append((now - last, line.rstrip()))
                lines.append(line.rstrip())
                last = now
            status = proc.wait()
            wall = time.perf_counter() - start
        silences.append((time.perf_counter() - last, "(exit)"))
        longest = max(silences, key=lambda item: item[0])
        built = sorted(p.name for p in ops.iterdir()) if ops.is_dir() else []
    return {"command": " ".join(command[:1] + MAIN_JOB) + (f" --steps {steps}" if steps else ""),
            "exit_status": status, "wall_s": round(wall, 1), "output_lines": len(lines),
            "longest_silence_s": round(longest[0], 1), "line_after_longest_silence": longest[1][:200],
            "ops_built": built, "load_before": load_before, "load_during": load.summary(),
            "last_lines": lines[-10:]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose commands are measured")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each command (the median is reported)")
    parser.add_argument("--imports-only", action="store_true", help="measure the commands only, not the first run")
    parser.add_argument("--steps", type=int, default=None, help="the first run's --steps (default: the job's, 600)")
    parser.add_argument("--launcher", default=str(Path(sys.executable).with_name("deepspeed")),
                        help="the command that starts the job (default: this venv's deepspeed)")
    parser.add_argument("--out", type=Path, default=RESULTS / "first_hour.json")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    result: Dict[str, object] = {"machine": machine_description(), "repo": str(repo),
                                 "load_before": os.getloadavg()[0], "commands": {}}
    with tempfile.TemporaryDirectory(prefix="first_hour_commands_") as scratch:
        Path(scratch, "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n"
                                                       for i in range(100)))
        for name, command in COMMANDS:
            figures = measure_command(repo, [arg.format(scratch=scratch) for arg in command], args.rounds)
            result["commands"][name] = figures
            heavy = ", ".join(f"{k} {v:.2f}" for k, v in figures["heavy_s"].items())
            print(f"{name}: {figures['wall_s_median']:.2f} s (exit {figures['exit_status']}); imports "
                  f"{figures['import_s']:.2f} s ({heavy}); megatron imported: {figures['megatron_imported']}",
                  flush=True)
    result["load_after_commands"] = os.getloadavg()[0]
    if not args.imports_only:
        run = first_run(repo, args.steps, args.launcher)
        result["first_run"] = run
        print(f"first run: {run['command']}: {run['wall_s']:.0f} s, exit {run['exit_status']}, ops built "
              f"{run['ops_built']}, longest silence {run['longest_silence_s']:.1f} s (before: "
              f"{run['line_after_longest_silence'][:100]!r}); load {run['load_before']:.2f} before, "
              f"{run['load_during']} during", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
