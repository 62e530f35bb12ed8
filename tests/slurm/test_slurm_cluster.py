"""End-to-end through a real SLURM cluster (tests/slurm/start_local_cluster.sh: one node on this machine): the
submitter's sbatch script, srun with 2 tasks, the environment derivation, per-rank logs, the checkpoint on SIGUSR1,
resubmission and requeue. Skips, saying why, where SLURM cannot be started."""
import json
import re
import subprocess

import pytest
from slurm_jobs import REPO, Cluster, assert_checkpoint, logs, metrics_step, tiny_config_with_switch, train_losses

from launch.dist_env import master_port_for_job

START_CLUSTER = REPO / "tests" / "slurm" / "start_local_cluster.sh"
STANDIN = REPO / "tests" / "slurm" / "standin_train.py"
SWITCH_STEP = 20


@pytest.fixture(scope="module")
def cluster():
    """Start (or find) the local one-node cluster."""
    return Cluster.start(START_CLUSTER)


@pytest.fixture(scope="module")
def partition(cluster):
    return cluster.default_partition()


@pytest.fixture
def jobs(cluster):
    """Job ids a test submitted."""
    submitted = []
    yield submitted
    cluster.cancel_unfinished(submitted)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """configs/tiny_cpu.json with the delink at step 20."""
    return tiny_config_with_switch(tmp_path_factory.mktemp("config"), SWITCH_STEP)


def submit(cluster, jobs, partition, config, run, *extra, train_args=()):
    return cluster.submit(jobs, config, run, "--nodes", "1", "--gpus-per-node", "0", "--tasks-per-node", "2",
                          "--partition", partition, *extra, train_args=train_args)


def node_idle(cluster):
    return list(cluster.node_states().values()) == ["idle"]


def first_host():
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def reference_run(cluster, partition, tiny_config, tmp_path_factory):
    """An uninterrupted 2-rank, 30-step job through the delink at step 20: (job id, run folder, final job state)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    submitted = []
    job_id = submit(cluster, submitted, partition, tiny_config, run, "--time", "15", train_args=["--steps", "30"])
    try:
        state = cluster.wait_finished(job_id, run)
    finally:
        cluster.cancel_unfinished(submitted)
    return job_id, run, state


def test_two_rank_job_trains_through_the_delink(reference_run):
    job_id, run, state = reference_run
    out = logs(run)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert (run / "submit.sbatch").read_text().startswith("#!/bin/bash")
    port = master_port_for_job(job_id)
    for rank in (0, 1):
        text = out[f"rank-{rank}.log"]
        assert f"dist_env: rank {rank}/2 local {rank}/2 node 0/1 master {first_host()}:{port} on host" in text
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


def test_config_error_stops_the_job_before_any_rank_starts(cluster, partition, jobs, tmp_path):
    """The batch shell checks the configuration before srun: one ``error:`` line in the batch log, the job FAILED
    with exit code 2, no rank started (no rank log)."""
    config = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**config, "pseudo_to_reel": config["pseudo_to_real"]}))
    run = tmp_path / "run"
    job_id = submit(cluster, jobs, partition, bad, run, "--time", "15")
    state = cluster.wait_finished(job_id, run)
    out = logs(run)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), out
    assert list(out) == [f"sbatch-{job_id}.log"], out
    errors = [line for line in out[f"sbatch-{job_id}.log"].splitlines() if line.startswith("error:")]
    assert errors == ["error: invalid config:"] and "did you mean 'pseudo_to_real'?" in out[f"sbatch-{job_id}.log"]


def test_usr1_checkpoints_and_resubmission_resumes(cluster, partition, jobs, tiny_config, reference_run, tmp_path):
    run = tmp_path / "run"
    job_id = submit(cluster, jobs, partition, tiny_config, run, "--time", "15", train_args=["--steps", "40"])
    cluster.wait_for(lambda: metrics_step(run) >= 5, "rank 0 to record step 5", job_id, run)
    # Without --batch, scancel signals every rank (not the batch shell): checkpoint, then the job ends.
    cluster.run("scancel", "--signal=USR1", job_id)
    state = cluster.wait_finished(job_id, run)
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
    second = cluster.sbatch(jobs, run / "submit.sbatch")
    state = cluster.wait_finished(second, run)
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


def test_time_limit_warning_checkpoints_requeues_and_resumes(cluster, partition, jobs, tiny_config, tmp_path):
    """--time 2 --signal-grace 30: SLURM signals the batch shell 30-90 s before the end (it checks once a minute).
    Uses the stand-in trainer: this is about the SLURM plumbing; train.py's own SIGUSR1 path is tested above."""
    run = tmp_path / "run"
    job_id = submit(cluster, jobs, partition, tiny_config, run, "--time", "2", "--signal-grace", "30", "--requeue",
                    "--script", str(STANDIN), train_args=["--steps", "100000", "--step-seconds", "0.5"])
    cluster.wait_for(lambda: "requeueing job" in logs(run).get(f"sbatch-{job_id}.log", ""), "the requeue", job_id,
                     run, timeout=180)
    out = logs(run)
    assert "got SIGUSR1: asking the ranks to checkpoint" in out[f"sbatch-{job_id}.log"]
    step = int(re.search(r"saved checkpoint at step (\d+) on signal SIGUSR1", out["rank-0.log"]).group(1))
    assert f"saved checkpoint at step {step} on signal SIGUSR1" in out["rank-1.log"]
    cluster.wait_for(lambda: cluster.job_state(job_id).get("Restarts") == "1"
                     and cluster.job_state(job_id).get("JobState") == "PENDING" and node_idle(cluster),
                     "the requeued job to wait on an idle node", job_id, run, 60)
    cluster.release_requeued(job_id)
    resumed = f"resumed from {run}/checkpoints/global_step{step} at step {step}"
    cluster.wait_for(lambda: all(resumed in logs(run)[f"rank-{r}.log"] for r in (0, 1)), "the resume", job_id, run,
                     180)
    assert f"job {job_id} attempt 2 on" in logs(run)[f"sbatch-{job_id}.log"]
    assert cluster.job_state(job_id)["JobState"] == "RUNNING"
