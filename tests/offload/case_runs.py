"""A script of cases (``run_host_step.py``, ``run_delayed_step.py``: ``run_training.run_each_case``) run on one rank
and on two: each rank prints one JSON line per case after ``RESULT``."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from conftest import CPU_FP16, REPO, free_port, python_path, run_two_ranks


def on_one_rank(script: Path, cases: Sequence[str], folder: Path) -> Dict[str, Dict]:
    """The cases' results, by case, from ``script`` run as one rank (CPU fp16 on)."""
    env = {**os.environ, "PYTHONPATH": python_path(), "OFFLOAD_TEST_DIR": str(folder), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           **CPU_FP16}
    proc = subprocess.run([sys.executable, str(script), *cases], env=env, capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return {r["case"]: r for r in results(proc.stdout)}


def results(stdout: str) -> List[Dict]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def on_two_ranks(script: Path, cases: Sequence[str], folder: Path) -> Dict[str, List[Dict]]:
    """The cases' results, by case, one per rank, from ``script`` run on 2 gloo ranks."""
    proc = run_two_ranks(script, *cases, env_extra={"OFFLOAD_TEST_DIR": str(folder)})
    by_case: Dict[str, List[Dict]] = {}
    for stdout in proc.rank_stdouts:
        for result in results(stdout):
            by_case.setdefault(result["case"], []).append(result)
    return by_case
