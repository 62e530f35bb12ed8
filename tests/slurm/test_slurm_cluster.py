"""End-to-end through a real SLURM cluster (tests/slurm/start_local_cluster.sh: one node on this machine): the
submitter's sbatch script, srun with 2 tasks, the environment derivation, per-rank logs, the checkpoint on SIGUSR1,
resubmission and requeue. Skips, saying why, where SLURM cannot be started."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.dist_env import master_port_for_job

REPO = Path(__file__).resolve().parents[2]
START_CLUSTER = REPO / "tests" / "slurm" / "start_local_cluster.sh"
STANDIN = REPO / "tests" / "slurm" / "standin_train.py"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
SWITCH_STEP = 20


@pytest.fixture(scope="module")
def partition():
    """Start (or find) the local cluster; its default partition."""
    try:
        proc = subprocess.run(["bash", str(START_CLUSTER)], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"SLURM cannot be started here: {START_CLUSTER.name} did not finish ({err})")
    if proc.returncode != 0:
        pytest.skip(f"SLURM cannot be started here: {START_CLUSTER.name} exited {proc.returncode}: "
                    f"{proc.stderr.strip()[-600:]}")
    out = subprocess.run(["sinfo", "--noheader", "--format", "%P"], capture_output=True, text=True, check=True)
    defaults = [p.rstrip("*") for p in out.stdout.split() if p.endswith("*")]
    return defaults[0] if defaults else out.stdout.split()[0]


def cancel_unfinished(job_ids):
    """Cancel what a test left queued or running (it would hold the CPUs)."""
    for job_id in job_ids:
        if job_state(job_id).get("JobState") not in FINISHED | {None}:
            subprocess.run(["scancel", job_id], capture_output=True)


@pytest.fixture
def jobs():
    """Job ids a test submitted."""
    submitted = []
    yield submitted
    cancel_unfinished(submitted)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """configs/tiny_cpu.json with the delink moved to step 20, so that a run crosses it in seconds, not minutes."""
    config = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    config["pseudo_to_real"]["switch"] = {"at_step": SWITCH_STEP}
    path = tmp_path_factory.mktemp("config") / "tiny_cpu_switch20.json"
    path.write_text(json.dumps(config))
    return path


def job_env():
    """The submitter's environment (sbatch exports it to the job), without the single-process rank variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]})
    return env


def submit(jobs, partition, config, run, *extra, train_args=()):
    cmd = [sys.executable, "-m", "launch.slurm", "submit", "--nodes", "1", "--gpus-per-node", "0",
           "--tasks-per-node", "2", "--partition", partition, "--deepspeed-config", str(config),
           "--output-dir", str(run), *extra, "--", *train_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=job_env(), timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    jobs.append(job_id)
    return job_id


def job_state(job_id):
    """``scontrol show job`` as a dict (finished jobs stay listed for MinJobAge=300 s)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if out.returncode != 0:
        return {}
    return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)


def node_idle():
    out = subprocess.run(["sinfo", "--noheader", "--format", "%t"], capture_output=True, text=True)
    return out.stdout.split() == ["idle"]


def logs(run):
    return {path.name: path.read_text(errors="replace") for path in sorted((run / "logs").glob("*.log"))}


def wait_for(condition, what, job_id, run, timeout=600):
    """Poll ``condition()`` until true; on timeout fail with the job's state and the tail of every log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(1)
    tails = "\n".join(f"--- {name}\n{text[-2000:]}" for name, text in logs(run).items())
    pytest.fail(f"timed out after {timeout} s waiting for {what}; job {job_id}: {job_state(job_id)}\n{tails}")


def wait_finished(job_id, run):
    wait_for(lambda: job_state(job_id).get("JobState") in FINISHED, f"job {job_id} to finish", job_id, run)
    return job_state(job_id)


def train_losses(run):
    """{step: train loss} from rank 0's metrics.jsonl."""
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


def metrics_step(run):
    """Last optimizer step rank 0 recorded (0 before the first)."""
    return max(train_losses(run), default=0)


def first_host():
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


def assert_checkpoint(run, step):
    latest = run / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"global_step{step}"
    assert any((run / "checkpoints" / f"global_step{step}").iterdir())


@pytest.fixture(scope="module")
def reference_run(partition, tiny_config, tmp_path_factory):
    """An uninterrupted 2-rank, 30-step job through the delink at step 20: (job id, run folder, final job state)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    submitted = []
    job_id = submit(submitted, partition, tiny_config, run, "--time", "15", train_args=["--steps", "30"])
    try:
        state = wait_finished(job_id, run)
    finally:
        cancel_unfinished(submitted)
    return job_id, run, state


def test_two_rank_job_trains_through_the_delink(reference_run):
    job_id, run, state = reference_run
    out = logs(run)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert (run / "submit.sbatch").read_text().startswith("#!/bin/bash")
    port = master_port_for_job(job_id)
    for rank in (0, 1):
        text = out[f"rank-{rank}.log"]
        assert f"dist_env: rank {rank}/2 local {rank}/2 node 0/1 master {first_host()}:{port}" in text
        assert f"rank {rank}/2 started" in text
        assert f"rank {rank} finished at step 30 stage real" in text
    assert f"delinked at step {SWITCH_STEP}" in out["rank-0.log"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stages = {r["step"]: r["stage"] for r in records if "train_loss" in r}
    assert sorted(stages) == list(range(1, 31))
    assert stages[SWITCH_STEP] == "pseudo" and stages[SWITCH_STEP + 1] == "real" and stages[30] == "real"
    assert [r["step"] for r in records if r.get("event") == "delink"] == [SWITCH_STEP]
    assert (run / "loss.png").stat().st_size > 0
    assert_checkpoint(run, 30)


def test_config_error_stops_the_job_before_any_rank_starts(partition, jobs, tmp_path):
    """The batch shell checks the configuration before srun: one ``error:`` line in the batch log, the job FAILED
    with exit code 2, no rank started (no rank log)."""
    config = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**config, "pseudo_to_reel": config["pseudo_to_real"]}))
    run = tmp_path / "run"
    job_id = submit(jobs, partition, bad, run, "--time", "15")
    state = wait_finished(job_id, run)
    out = logs(run)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), out
    assert list(out) == [f"sbatch-{job_id}.log"], out
    errors = [line for line in out[f"sbatch-{job_id}.log"].splitlines() if line.startswith("error:")]
    assert errors == ["error: invalid config:"] and "did you mean 'pseudo_to_real'?" in out[f"sbatch-{job_id}.log"]


def test_usr1_checkpoints_and_resubmission_resumes(partition, jobs, tiny_config, reference_run, tmp_path):
    run = tmp_path / "run"
    job_id = submit(jobs, partition, tiny_config, run, "--time", "15", train_args=["--steps", "40"])
    wait_for(lambda: metrics_step(run) >= 5, "rank 0 to record step 5", job_id, run)
    # Without --batch, scancel signals every rank (not the batch shell): checkpoint, then the job ends.
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    state = wait_finished(job_id, run)
    out = logs(run)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out
    saved = [re.search(r"saved checkpoint at step (\d+) on signal (\S+)", out[f"rank-{r}.log"]) for r in (0, 1)]
    assert all(saved), out
    step = int(saved[0].group(1))
    assert int(saved[1].group(1)) == step and "SIGUSR1" in {m.group(2) for m in saved}
    assert 5 <= step < SWITCH_STEP, f"signal landed at step {step}; this test wants it before the delink"
    assert "finished at step" not in out["rank-0.log"] + out["rank-1.log"]
    assert_checkpoint(run, step)

    # The documented way to go on: sbatch the recorded script again.
    proc = subprocess.run(["sbatch", "--parsable", str(run / "submit.sbatch")], capture_output=True, text=True,
                          env=job_env(), check=True)
    second = proc.stdout.strip().split(";")[0]
    jobs.append(second)
    state = wait_finished(second, run)
    out = logs(run)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert re.search(rf"resumed from {re.escape(str(run))}/checkpoints/global_step{step}\S* at step {step} "
                     r"\(pseudo stage\)", out["rank-0.log"]), out["rank-0.log"]
    assert f"delinked at step {SWITCH_STEP}" in out["rank-0.log"]
    for rank in (0, 1):
        assert f"rank {rank} finished at step 40 stage real" in out[f"rank-{rank}.log"]
    assert_checkpoint(run, 40)
    # Resumed, not restarted: after the checkpoint the losses are the uninterrupted run's (same seed, data order).
    reference = train_losses(reference_run[1])
    resumed = train_losses(run)
    for later in (step + 1, SWITCH_STEP, SWITCH_STEP + 1, 30):
        assert resumed[later] == pytest.approx(reference[later], rel=1e-3), later


def test_time_limit_warning_checkpoints_requeues_and_resumes(partition, jobs, tiny_config, tmp_path):
    """--time 2 --signal-grace 30: SLURM signals the batch shell 30-90 s before the end (it checks once a minute).
    Uses the stand-in trainer: this is about the SLURM plumbing; train.py's own SIGUSR1 path is tested above."""
    run = tmp_path / "run"
    job_id = submit(jobs, partition, tiny_config, run, "--time", "2", "--signal-grace", "30", "--requeue",
                    "--script", str(STANDIN), train_args=["--steps", "100000", "--step-seconds", "0.5"])
    wait_for(lambda: "requeueing job" in logs(run).get(f"sbatch-{job_id}.log", ""), "the requeue", job_id, run,
             timeout=180)
    out = logs(run)
    assert "got SIGUSR1: asking the ranks to checkpoint" in out[f"sbatch-{job_id}.log"]
    step = int(re.search(r"saved checkpoint at step (\d+) on signal SIGUSR1", out["rank-0.log"]).group(1))
    assert f"saved checkpoint at step {step} on signal SIGUSR1" in out["rank-1.log"]
    wait_for(lambda: job_state(job_id).get("Restarts") == "1" and job_state(job_id).get("JobState") == "PENDING"
             and node_idle(), "the requeued job to wait on an idle node", job_id, run, 60)
    # SLURM holds a requeued job for ~2 minutes (BeginTime); release it sooner. Not at once: slurmd refuses a job
    # credential issued within a second or so of the requeue's revocation ("Job credential revoked", job FAILED).
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    resumed = f"resumed from {run}/checkpoints/global_step{step} at step {step}"
    wait_for(lambda: all(resumed in logs(run)[f"rank-{r}.log"] for r in (0, 1)), "the resume", job_id, run, 180)
    assert f"job {job_id} attempt 2 on" in logs(run)[f"sbatch-{job_id}.log"]
    assert job_state(job_id)["JobState"] == "RUNNING"
