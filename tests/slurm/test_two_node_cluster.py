"""End-to-end on two SLURM nodes on this machine (tests/slurm/start_two_node_cluster.sh: node1 and node2, each with
its own hostname and loopback address and one fake GPU): ranks on two hosts through each launch path (launch.slurm
submit, the deepspeed launcher on the generated hostfile, the Megatron drop-in), a node lost mid-run, signals to the
ranks of both nodes, and the one-node run's losses and weights bit for bit. CPU, gloo, fp32, one rank per node
(two in the time-limit stand-in job).
Skips, saying why, where the cluster cannot be started (no root, no namespaces).

One main job carries most assertions: it trains 20 steps through the delink at 12, checkpointing every 4; node2 is
killed after step 5 (SLURM requeues the job, which resumes from step 4 once node2 is back); scancel --signal=USR1
then stops it with a checkpoint, and its script, sbatch'ed again, finishes the run."""
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import free_port, python_path
from slurm_jobs import REPO, Cluster, assert_checkpoint, logs, metrics_step, tiny_config_with_switch, train_losses

from launch.dist_env import master_port_for_job

START_CLUSTER = REPO / "tests" / "slurm" / "start_two_node_cluster.sh"
PARTITION = "two"  # the cluster's, with node1 and node2
STANDIN = REPO / "tests" / "slurm" / "standin_train.py"
SWITCH_STEP, STEPS, SAVE_INTERVAL, KILL_AFTER = 12, 20, 4, 5
# start_two_node_cluster.sh sets SlurmdTimeout=10: a silent node is DOWN 10-30 s later, and its jobs requeued.
LOST_NODE_BOUND_S = 60
MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
MEGATRON_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")
MEGATRON_PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): (\d+)")


@pytest.fixture(scope="module")
def cluster():
    return Cluster.start(START_CLUSTER)


@pytest.fixture(scope="module")
def jobs(cluster):
    """Job ids this module submitted; what is left running at its end is cancelled."""
    submitted = []
    yield submitted
    cluster.cancel_unfinished(submitted)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return tiny_config_with_switch(tmp_path_factory.mktemp("config"), SWITCH_STEP)


@pytest.fixture(scope="module")
def one_node_run(cluster, jobs, config, tmp_path_factory):
    """The uninterrupted 2-rank run on one node: the losses and weights the two-node run must reproduce."""
    run = tmp_path_factory.mktemp("one_node") / "run"
    job_id = cluster.submit(jobs, config, run, "--nodes", "1", "--gpus-per-node", "0", "--tasks-per-node", "2",
                            "--partition", PARTITION, "--time", "15", train_args=["--steps", str(STEPS)])
    state = cluster.wait_finished(job_id, run)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), logs(run)
    return run


@dataclass
class MainRun:
    run: Path
    job_id: str
    resubmitted: str
    latest_at_loss: str  # checkpoints/latest when SLURM requeued the job
    killed_after_step: int  # the last step the run had recorded when node2 was killed (KILL_AFTER or later)
    requeued_after_s: float  # from the kill to SLURM's requeue
    time_limit_job: tuple


@pytest.fixture(scope="module")
def main_run(cluster, jobs, config, one_node_run, tmp_path_factory, request):
    """The main job's story (module docstring). The time-limit job is submitted once node2 is back, so that its
    minute of waiting for SLURM's warning overlaps the rest of the module."""
    run = tmp_path_factory.mktemp("two_nodes") / "run"
    job_id = cluster.submit(jobs, config, run, "--nodes", "2", "--gpus-per-node", "1", "--partition", PARTITION,
                            "--time", "15", "--requeue",
                            train_args=["--steps", str(STEPS), "--save-interval", str(SAVE_INTERVAL)])
    cluster.wait_for(lambda: metrics_step(run) >= KILL_AFTER, f"step {KILL_AFTER}", job_id, run)
    try:
        # On a loaded machine the job trains on for a few steps while this reacts: the step is read, not assumed.
        killed_after_step, killed = metrics_step(run), time.monotonic()
        subprocess.run(["bash", str(START_CLUSTER), "kill-node", "node2"], check=True, capture_output=True)
        cluster.wait_for(lambda: cluster.job_state(job_id).get("Restarts") == "1", "the requeue", job_id, run,
                         LOST_NODE_BOUND_S * 3)
        requeued_after_s = time.monotonic() - killed
        print(f"node2 killed after step {killed_after_step}: job {job_id} requeued {requeued_after_s:.1f} s later")
        latest_at_loss = (run / "checkpoints" / "latest").read_text().strip()
    finally:
        subprocess.run(["bash", str(START_CLUSTER), "start-node", "node2"], check=True, capture_output=True)
    cluster.wait_for(lambda: set(cluster.node_states().values()) == {"idle"}, "node2 back", job_id, run, 60)
    time_limit_job = request.getfixturevalue("time_limit_job")
    cluster.release_requeued(job_id)
    cluster.wait_for(lambda: '"event": "resume"' in (run / "metrics.jsonl").read_text()
                     and metrics_step(run) > killed_after_step, "the resumed run to pass the lost steps", job_id, run)
    # Without --batch, scancel signals every rank on both nodes (not the batch shell): checkpoint, then the end.
    cluster.run("scancel", "--signal=USR1", job_id)
    state = cluster.wait_finished(job_id, run)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), logs(run)
    resubmitted = cluster.sbatch(jobs, run / "submit.sbatch")
    state = cluster.wait_finished(resubmitted, run)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), logs(run)
    return MainRun(run, job_id, resubmitted, latest_at_loss, killed_after_step, requeued_after_s, time_limit_job)


@pytest.fixture(scope="module")
def time_limit_job(cluster, jobs, config, tmp_path_factory):
    """The stand-in trainer, two ranks per node (beside the main job's one), --time 2: SLURM's warning comes 30-90 s
    after its start."""
    run = tmp_path_factory.mktemp("time_limit") / "run"
    job_id = cluster.submit(jobs, config, run, "--nodes", "2", "--gpus-per-node", "0", "--tasks-per-node", "2",
                            "--partition", PARTITION, "--time", "2", "--signal-grace", "30", "--requeue",
                            "--script", str(STANDIN), train_args=["--steps", "100000", "--step-seconds", "0.5"])
    return job_id, run


def rank_lines(text, pattern):
    return re.findall(pattern, text, re.M)


def test_ranks_run_on_both_hosts_with_the_first_as_master(main_run):
    """Every attempt put rank 0 on node1 and rank 1 on node2 (each with local rank 0), both meeting at node1."""
    out = logs(main_run.run)
    for job_id, attempts in ((main_run.job_id, 2), (main_run.resubmitted, 1)):
        port = master_port_for_job(job_id)
        for rank, host in enumerate(("node1", "node2")):
            expected = f"dist_env: rank {rank}/2 local 0/1 node {rank}/2 master node1:{port} on host {host}"
            assert out[f"rank-{rank}.log"].count(expected) == attempts, out[f"rank-{rank}.log"][-3000:]
    for rank, host in enumerate(("node1", "node2")):
        assert rank_lines(out[f"rank-{rank}.log"], rf"^rank {rank}/2 started on (\S+)$") == [host] * 3
    assert f"job {main_run.job_id} attempt 1 on node[1-2]" in out[f"sbatch-{main_run.job_id}.log"]


def test_lost_node_fails_the_job_which_is_requeued_and_resumes(main_run):
    """node2 killed (slurmd and its rank): rank 0 fails at once (gloo sees the connection closed), SLURM marks
    node2 DOWN and requeues the job (--requeue) within the bound, and the job resumes from the last checkpoint."""
    out = logs(main_run.run)
    batch = out[f"sbatch-{main_run.job_id}.log"]
    assert main_run.requeued_after_s < LOST_NODE_BOUND_S, main_run.requeued_after_s
    assert re.search(r"Connection (closed|reset) by peer", out["rank-0.log"])  # gloo's error, the socket's state
    assert "srun: error: Node failure on node2" in batch
    # requeued: SLURM requeues a --requeue job on a node failure, not on its batch shell's failure. (slurmstepd's
    # "CANCELLED ... DUE TO NODE FAILURE" line is printed only when the batch shell still runs as slurmctld cancels
    # the job; here rank 0's own error may end srun and the shell first, a race that timing decides.)
    assert f"job {main_run.job_id} attempt 2 on node[1-2]" in batch
    # the last checkpoint before the loss: at most SAVE_INTERVAL steps before it, before the switch
    step = main_run.killed_after_step // SAVE_INTERVAL * SAVE_INTERVAL
    assert main_run.killed_after_step < SWITCH_STEP, main_run.killed_after_step
    assert main_run.latest_at_loss in (f"global_step{step}", f"global_step{step + SAVE_INTERVAL}")
    step = int(main_run.latest_at_loss[len("global_step"):])
    assert f"resumed from {main_run.run}/checkpoints/global_step{step} at step {step} (pseudo stage)" \
        in out["rank-0.log"]
    # the steps the lost attempt trained after its checkpoint were set aside, and trained again
    discarded = (main_run.run / "metrics.jsonl.discarded").read_text()
    assert f'"step": {step + 1},' in discarded and f'"step": {step},' not in discarded
    assert main_run.killed_after_step <= step or f'"step": {main_run.killed_after_step},' in discarded


def test_usr1_reaches_the_ranks_on_both_nodes(main_run):
    """scancel --signal=USR1: both ranks, each signalled by its own node's slurmd, save one checkpoint at the same
    step and stop; the job ends COMPLETED (not requeued), and its script sbatch'ed again resumes there."""
    out = logs(main_run.run)
    saved = [rank_lines(out[f"rank-{r}.log"], r"^saved checkpoint at step (\d+) on signal (\S+)") for r in (0, 1)]
    assert saved[0] == saved[1] and len(saved[0]) == 1 and saved[0][0][1] == "SIGUSR1", saved
    step = int(saved[0][0][0])
    assert KILL_AFTER < step < SWITCH_STEP
    assert f"resumed from {main_run.run}/checkpoints/global_step{step} at step {step} (pseudo stage)" \
        in out["rank-0.log"]
    assert f"job {main_run.resubmitted} attempt 1 on node[1-2]" in out[f"sbatch-{main_run.resubmitted}.log"]
    for rank in (0, 1):
        assert rank_lines(out[f"rank-{rank}.log"], r"^rank \d finished at step (\d+) stage (\w+)$") == \
            [(str(STEPS), "real")]
    assert f"delinked at step {SWITCH_STEP}" in out["rank-0.log"]
    assert_checkpoint(main_run.run, STEPS)


def checkpoint_tensors(directory):
    """{file/key path: tensor} of every .pt file of a checkpoint."""
    tensors = {}

    def walk(value, key):
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")

    for path in sorted(directory.glob("*.pt")):
        walk(torch.load(path, map_location="cpu", weights_only=False), path.name)
    return tensors


def test_same_losses_and_weights_as_the_one_node_run(main_run, one_node_run):
    """Two hosts, a lost node, a USR1 stop and a resubmission later: every step's loss is the uninterrupted
    one-node run's, and the last checkpoint (model, fp32 masters, Adam's moments) is equal tensor for tensor."""
    losses = train_losses(main_run.run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == train_losses(one_node_run)
    mine, reference = (checkpoint_tensors(run / "checkpoints" / f"global_step{STEPS}")
                       for run in (main_run.run, one_node_run))
    assert sorted(mine) == sorted(reference) and len(mine) > 100
    assert [key for key in mine if not torch.equal(mine[key], reference[key])] == []


def test_deepspeed_launcher_on_the_generated_hostfile(cluster, jobs, config, one_node_run, tmp_path):
    """Inside a two-node allocation: `launch.hostfile --from-slurm`, then the deepspeed launcher on each node
    (srun, one per node, --no_ssh --node_rank $SLURM_NODEID): rank 0 on node1, rank 1 on node2, the one-node losses."""
    run, hostfile = tmp_path / "run", tmp_path / "hostfile"
    deepspeed = Path(sys.executable).with_name("deepspeed")
    train = [str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config),
             "--output-dir", str(run), "--steps", "3", "--eval-batches", "1"]
    script = tmp_path / "deepspeed.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=1 --partition={PARTITION} --time=10 "
        f"--output={tmp_path}/logs/sbatch-%j.log",
        "set -e",
        f"cd {REPO}",
        f"{sys.executable} -m launch.hostfile --from-slurm -o {hostfile}",
        'export MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)',  # node1
        f"srun --output={tmp_path}/logs/node-%n.log bash -c "
        + shlex.quote(f"{deepspeed} --hostfile {hostfile} --no_ssh --node_rank $SLURM_NODEID --master_addr $MASTER "
                      f"--master_port {free_port()} {shlex.join(train)}"),
        ""]))
    (tmp_path / "logs").mkdir()
    job_id = cluster.sbatch(jobs, script)
    state = cluster.wait_finished(job_id, tmp_path)
    out = logs(tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert hostfile.read_text() == "node1 slots=1\nnode2 slots=1\n"  # slots: SLURM_GPUS_ON_NODE
    for node, host in enumerate(("node1", "node2")):
        assert f"rank {node}/2 started on {host}" in out[f"node-{node}.log"]
        assert f"rank {node} finished at step 3 stage pseudo" in out[f"node-{node}.log"]
    reference = train_losses(one_node_run)
    assert train_losses(run) == {step: reference[step] for step in (1, 2, 3)}


def megatron_losses(text):
    return {int(i): float(loss) for i, loss in MEGATRON_LOSS.findall(text)}


@pytest.mark.skipif(not (MEGATRON_LM and Path(MEGATRON_LM, "pretrain_gpt.py").is_file()),
                    reason="MEGATRON_LM_PATH names no Megatron-LM checkout with pretrain_gpt.py (tag core_v0.16.1)")
def test_megatron_drop_in_across_two_nodes(cluster, jobs, tmp_path):
    """Megatron-LM's own pretrain_gpt.py through the drop-in, one rank per node started by srun through
    launch.dist_env, delinking at iteration 3 of 6: the losses of the same command under torchrun on one node."""
    sys.path.insert(0, str(REPO / "tests" / "megatron"))  # where pytest puts it when it collects that directory
    from megatron_lm import SCRIPT, TINY, pretrain

    flags = [*TINY, "--train-iters", "6", "--pseudo-to-real-switch-iter", "3"]
    command = [sys.executable, "-m", "launch.dist_env", "--", sys.executable, "-m", "megatron_patches.run",
               str(SCRIPT), *flags]
    script = tmp_path / "megatron.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=1 --partition={PARTITION} --time=10 "
        f"--output={tmp_path}/logs/sbatch-%j.log --chdir={tmp_path}",
        f"export PYTHONPATH={shlex.quote(python_path(MEGATRON_LM))}",
        f"srun --kill-on-bad-exit=1 --output={tmp_path}/logs/rank-%t.log {shlex.join(command)}",
        ""]))
    (tmp_path / "logs").mkdir()
    job_id = cluster.sbatch(jobs, script)
    state = cluster.wait_finished(job_id, tmp_path)
    out = logs(tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out
    port = master_port_for_job(job_id)
    for rank, host in enumerate(("node1", "node2")):
        assert f"dist_env: rank {rank}/2 local 0/1 node {rank}/2 master node1:{port} on host {host}" \
            in out[f"rank-{rank}.log"]
    assert [int(n) for n in MEGATRON_PARAMS.findall(out["rank-0.log"])] == [68_544, 68_544 + 3 * 49_984]
    two_nodes_losses = megatron_losses(out["rank-1.log"])  # Megatron logs the loss on the last rank
    assert sorted(two_nodes_losses) == list(range(1, 7))
    # compiled as in the job (the Megatron tests' launches run Megatron's fused functions eagerly)
    one_node = pretrain(2, *flags, cwd=tmp_path, env_extra={"TORCH_COMPILE_DISABLE": "0"})
    assert two_nodes_losses == megatron_losses(one_node.stdout)


def test_time_limit_warning_checkpoints_on_both_nodes(cluster, main_run):
    """SLURM's time-limit warning reaches the batch shell on node1, which passes SIGUSR1 through srun to the 4 ranks
    on both nodes: all save at the same step, the job requeues itself and resumes on both nodes. Ranks 0-1 run on
    node1 and 2-3 on node2, local ranks 0 and 1 on each; each resolves its own host to its node's address and the
    master to node1's."""
    job_id, run = main_run.time_limit_job
    cluster.wait_for(lambda: "requeueing job" in logs(run).get(f"sbatch-{job_id}.log", ""), "the requeue", job_id, run,
                     timeout=180)
    out = logs(run)
    saved = [rank_lines(out[f"rank-{r}.log"], r"^saved checkpoint at step (\d+) on signal SIGUSR1\b")
             for r in range(4)]
    assert saved.count(saved[0]) == 4 and len(saved[0]) >= 1, saved
    step = saved[0][0]
    resumed = f"resumed from {run}/checkpoints/global_step{step} at step {step}"

    def resumed_on_both():
        return all(resumed in logs(run).get(f"rank-{r}.log", "") for r in range(4))

    def held():  # requeued, waiting for its BeginTime
        state = cluster.job_state(job_id)
        return state.get("JobState") == "PENDING" and state.get("Restarts", "0") != "0"

    cluster.wait_for(lambda: held() or resumed_on_both(), "the requeued job", job_id, run, 60)
    if held():
        cluster.release_requeued(job_id)
    cluster.wait_for(resumed_on_both, "the resume", job_id, run, 180)
    addresses = cluster.node_addresses()
    port = master_port_for_job(job_id)
    for rank in range(4):
        node, local = divmod(rank, 2)
        host = f"node{node + 1}"
        text = logs(run)[f"rank-{rank}.log"]
        assert text.count(f"dist_env: rank {rank}/4 local {local}/2 node {node}/2 master node1:{port} on host {host}") \
            >= 2
        started = rank_lines(text, rf"^rank {rank}/4 started on (.*)$")
        assert started[:2] == [f"{host} ({addresses[host]}) local_rank {local} master node1:{port} "
                               f"({addresses['node1']})"] * 2, started
