"""What the end-to-end tests on a real SLURM cluster share: start a cluster with its script (or skip, saying why),
submit the main job through ``python -m launch.slurm submit``, and read a job's state, logs and losses. A ``Cluster``
carries the SLURM_CONF its clients read, so that tests on the one-node and the two-node cluster never mix them up."""
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

REPO = Path(__file__).resolve().parents[2]
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Cluster:
    """A running cluster: the slurm.conf its clients (and, through sbatch's exported environment, its jobs) read."""

    slurm_conf: str

    @classmethod
    def start(cls, script: Path) -> "Cluster":
        """Run the cluster's start script (idempotent); skip the test, with the script's reason, when it fails."""
        try:
            proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            pytest.skip(f"SLURM cannot be started here: {script.name} did not finish ({err})")
        if proc.returncode != 0:
            pytest.skip(f"SLURM cannot be started here: {script.name} exited {proc.returncode}: "
                        f"{proc.stderr.strip()[-600:]}")
        confs = re.findall(r"^SLURM_CONF=(.+)$", proc.stdout, re.M)
        assert confs, f"{script.name} printed no SLURM_CONF=...: {proc.stdout!r}"
        return cls(confs[-1])

    def env(self) -> Dict[str, str]:
        """The submitter's environment (sbatch exports it to the job), without the single-process rank variables."""
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        env.update({"OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
                    "SLURM_CONF": self.slurm_conf})
        return env

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, scontrol, scancel, sinfo) against this cluster."""
        return subprocess.run(list(command), capture_output=True, text=True, env=self.env(), check=check,
                              timeout=60)

    def default_partition(self) -> str:
        names = self.run("sinfo", "--noheader", "--format", "%P").stdout.split()
        defaults = [p.rstrip("*") for p in names if p.endswith("*")]
        return defaults[0] if defaults else names[0]

    def submit(self, jobs: List[str], config: Path, run: Path, *options: str, train_args=()) -> str:
        """``python -m launch.slurm submit OPTIONS --deepspeed-config CONFIG --output-dir RUN -- TRAIN_ARGS``."""
        cmd = [sys.executable, "-m", "launch.slurm", "submit", *options, "--deepspeed-config", str(config),
               "--output-dir", str(run), "--", *train_args]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=self.env(), timeout=60)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
        job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
        jobs.append(job_id)
        return job_id

    def sbatch(self, jobs: List[str], script: Path) -> str:
        job_id = self.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]
        jobs.append(job_id)
        return job_id

    def job_state(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (finished jobs stay listed for MinJobAge=300 s)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if out.returncode != 0:
            return {}
        return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)

    def node_states(self) -> Dict[str, str]:
        """{node: sinfo's short state}: "idle", "mix", "alloc", "down*" (a '*': not answering), ..."""
        out = self.run("sinfo", "--noheader", "--Node", "--format", "%N %t").stdout.split()
        return dict(zip(out[::2], out[1::2]))

    def node_addresses(self) -> Dict[str, str]:
        """{node: NodeAddr}, the address slurmctld reaches its slurmd at."""
        out = self.run("scontrol", "show", "node", "-o").stdout
        return dict(re.findall(r"NodeName=(\S+) .*?NodeAddr=(\S+)", out))

    def cancel_unfinished(self, job_ids: List[str]) -> None:
        """Cancel what a test left queued or running (it would hold the CPUs)."""
        for job_id in job_ids:
            if self.job_state(job_id).get("JobState") not in FINISHED | {None}:
                self.run("scancel", job_id, check=False)

    def wait_for(self, condition, what: str, job_id: str, run: Path, timeout: float = 600) -> None:
        """Poll ``condition()`` until true; on timeout fail with the job's state and the tail of every log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.5)
        tails = "\n".join(f"--- {name}\n{text[-2000:]}" for name, text in logs(run).items())
        pytest.fail(f"timed out after {timeout} s waiting for {what}; job {job_id}: {self.job_state(job_id)}\n{tails}")

    def wait_finished(self, job_id: str, run: Path) -> Dict[str, str]:
        self.wait_for(lambda: self.job_state(job_id).get("JobState") in FINISHED, f"job {job_id} to finish", job_id,
                      run)
        return self.job_state(job_id)

    def release_requeued(self, job_id: str) -> None:
        """SLURM holds a requeued job for ~2 minutes (BeginTime); release it sooner. Not at once: slurmd refuses a
        job credential issued within a second or so of the requeue's revocation ("Job credential revoked")."""
        time.sleep(3)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def logs(run: Path) -> Dict[str, str]:
    return {path.name: path.read_text(errors="replace") for path in sorted((run / "logs").glob("*.log"))}


def train_losses(run: Path) -> Dict[int, float]:
    """{step: train loss} from rank 0's metrics.jsonl (a step trained again after a resume: its last record)."""
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


def metrics_step(run: Path) -> int:
    """Last optimizer step rank 0 recorded (0 before the first)."""
    return max(train_losses(run), default=0)


def assert_checkpoint(run: Path, step: int) -> None:
    latest = run / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"global_step{step}"
    assert any((run / "checkpoints" / f"global_step{step}").iterdir())


def tiny_config_with_switch(directory: Path, switch_step: int) -> Path:
    """configs/tiny_cpu.json with the delink moved to ``switch_step``, so that a run crosses it in seconds."""
    config = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    config["pseudo_to_real"]["switch"] = {"at_step": switch_step}
    path = directory / f"tiny_cpu_switch{switch_step}.json"
    path.write_text(json.dumps(config))
    return path
