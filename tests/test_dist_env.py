"""Multi-node environment derivation (launch.dist_env) and the DeepSpeed hostfile (launch.hostfile), without a
cluster: SLURM's variables are given as plain dicts; the collective timeout every process group of a rank gets."""
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import run_two_ranks

from launch.dist_env import (DistEnv, expand_nodelist, from_slurm, master_port_for_job, parse_tasks_per_node,
                             split_top_level)
from launch.hostfile import hostfile_from_slurm, hostfile_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NODELISTS = {
    "gpu[001-004,010]": ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"],
    "node1,node2": ["node1", "node2"],
    "n[9-11]": ["n9", "n10", "n11"],
    "n[08-10]": ["n08", "n09", "n10"],
    "a[1-2]-ib[0-1],login": ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1", "login"],
    "rack1-[3,5]": ["rack1-3", "rack1-5"],
    "solo": ["solo"],
}


@pytest.mark.parametrize("nodelist,hosts", NODELISTS.items())
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_nodelist_agrees_with_scontrol():
    """The pure-Python parser is the fallback for scontrol; where scontrol can run, they must give the same hosts."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (tests/slurm/start_local_cluster.sh installs it)")
    for nodelist, hosts in NODELISTS.items():
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"scontrol cannot run here (no slurm.conf?): {out.stderr.strip()[:200]}")
        assert out.stdout.split() == hosts, nodelist


@pytest.mark.parametrize("bad,fragment", [("gpu[001-004", "never closed"), ("gpu]1[", "closes no"),
                                          ("gpu[4-1]", "backwards"), ("gpu[a-b]", "'a-b'"),
                                          ("n[1-2]x", "text after"), ("", "names no host")])
def test_expand_nodelist_errors_name_the_value(bad, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        expand_nodelist(bad)
    assert repr(bad) in str(err.value)


def test_split_top_level_keeps_bracket_commas():
    assert split_top_level("gpu[001-004,010],cpu[1,2],x") == ["gpu[001-004,010]", "cpu[1,2]", "x"]


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("8(x4),7") == [8, 8, 8, 8, 7]
    assert parse_tasks_per_node("2") == [2]
    with pytest.raises(ValueError, match="'8x4'"):
        parse_tasks_per_node("8x4")


def test_master_port_is_deterministic_and_outside_the_ephemeral_range():
    assert master_port_for_job("1234567") == master_port_for_job(1234567) == 20000 + 4567
    ports = {master_port_for_job(job) for job in range(5000, 5100)}
    assert len(ports) == 100 and all(20000 <= port < 30000 for port in ports)
    with pytest.raises(ValueError, match="SLURM_JOB_ID='12_3'"):
        master_port_for_job("12_3")


def task_environ(procid, nodes=5, per_node=8, nodelist="gpu[001-004,010]", job_id="987654"):
    """What srun gives task ``procid`` of a ``nodes`` x ``per_node`` step with block distribution."""
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NTASKS": str(nodes * per_node), "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_PROCID": str(procid), "SLURM_NODEID": str(procid // per_node), "SLURM_LOCALID": str(procid % per_node),
    }


def test_from_slurm_node_3_of_gpu001_to_gpu010_with_8_tasks_per_node():
    env = from_slurm(task_environ(3 * 8 + 5))
    assert env == DistEnv(rank=29, local_rank=5, world_size=40, local_world_size=8, node_rank=3, num_nodes=5,
                          master_addr="gpu001", master_port=20000 + 7654)
    assert env.as_environ() == {"RANK": "29", "LOCAL_RANK": "5", "WORLD_SIZE": "40", "LOCAL_WORLD_SIZE": "8",
                                "NODE_RANK": "3", "GROUP_RANK": "3", "MASTER_ADDR": "gpu001", "MASTER_PORT": "27654"}


def test_every_task_of_a_job_agrees_on_the_rendezvous_and_ranks_are_a_permutation():
    envs = [from_slurm(task_environ(procid)) for procid in range(40)]
    assert {(e.master_addr, e.master_port, e.world_size) for e in envs} == {("gpu001", 27654, 40)}
    assert sorted(e.rank for e in envs) == list(range(40))
    assert sorted((e.node_rank, e.local_rank) for e in envs) == [(n, l) for n in range(5) for l in range(8)]


def test_from_slurm_uneven_nodes_and_step_nodelist():
    """A step on part of the allocation: rank 0 sits on the step's first node, not the job's."""
    environ = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[001-004]", "SLURM_STEP_NODELIST": "gpu[003-004]",
               "SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "4,3", "SLURM_PROCID": "6", "SLURM_NODEID": "1",
               "SLURM_LOCALID": "2"}
    env = from_slurm(environ)
    assert (env.master_addr, env.local_world_size, env.num_nodes, env.master_port) == ("gpu003", 3, 2, 20042)


def test_from_slurm_uses_the_given_host_resolver():
    env = from_slurm(task_environ(0), first_host=lambda nodelist: f"resolved:{nodelist}")
    assert env.master_addr == "resolved:gpu[001-004,010]"


@pytest.mark.parametrize("change,fragment", [
    ({"SLURM_PROCID": None}, "SLURM_PROCID is not set"),
    ({"SLURM_LOCALID": "8"}, "SLURM_LOCALID=8 is not below this node's 8 tasks"),
    ({"SLURM_PROCID": "40"}, "SLURM_PROCID=40 is not below SLURM_NTASKS=40"),
    ({"SLURM_NTASKS": "32"}, "sums to 40 tasks, SLURM_NTASKS=32"),
    ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x': expected a non-negative integer"),
    ({"SLURM_JOB_NODELIST": None, "SLURM_STEP_NODELIST": None}, "nor SLURM_JOB_NODELIST is set"),
])
def test_from_slurm_errors_name_the_variable_and_value(change, fragment):
    environ = task_environ(0)
    for key, value in change.items():
        environ.pop(key) if value is None else environ.__setitem__(key, value)
    with pytest.raises((KeyError, ValueError), match=fragment):
        from_slurm(environ)


def test_wrapper_exports_the_variables_and_execs_the_command():
    """``python -m launch.dist_env -- CMD`` as srun runs it; the pure-Python parser stands in for scontrol."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    environ.update(task_environ(13))
    environ["PATH"] = os.path.dirname(sys.executable)  # no scontrol on PATH
    environ["PYTHONPATH"] = REPO
    show = "import os; print(*(os.environ[k] for k in ('RANK','LOCAL_RANK','WORLD_SIZE','MASTER_ADDR','MASTER_PORT')))"
    out = subprocess.run([sys.executable, "-m", "launch.dist_env", "--", sys.executable, "-c", show], env=environ,
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["13", "5", "40", "gpu001", "27654"]
    assert f"rank 13/40 local 5/8 node 1/5 master gpu001:27654 on host {os.uname().nodename}\n" in out.stderr


def test_hostfile_text_is_what_deepspeed_parses():
    from deepspeed.launcher.runner import _parse_hostfile

    text = hostfile_text(expand_nodelist("gpu[001-004,010]"), 8)
    assert text.splitlines()[0] == "gpu001 slots=8"
    assert dict(_parse_hostfile(text.splitlines())) == {h: 8 for h in NODELISTS["gpu[001-004,010]"]}


def test_hostfile_from_slurm_allocation():
    assert hostfile_from_slurm({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "4"}) == \
        "n1 slots=4\nn2 slots=4\n"
    assert hostfile_from_slurm({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}) == \
        "n1 slots=2\nn2 slots=2\nn3 slots=1\n"


@pytest.mark.parametrize("hosts,slots,fragment", [(["a", "a"], 8, "listed twice"), (["a"], 0, "slots=0"),
                                                  (["a", "b"], [1], "2 hosts but 1 slot counts")])
def test_hostfile_errors(hosts, slots, fragment):
    with pytest.raises(ValueError, match=fragment):
        hostfile_text(hosts, slots)


def test_every_group_of_the_job_times_out_as_set():
    """A group DeepSpeed makes without a timeout (new_group, as its ZeRO data-parallel group) gives up on a rank that
    never joins after the job's collective timeout (here 2 s), not after torch's default (30 minutes on gloo): rank 0
    fails with gloo's timeout while its peer, alive 8 s, still holds the connection open (without the job's timeout it
waits for the peer to exit: "Connection closed by peer")."""
    proc = run_two_ranks(os.path.join(REPO, "tests", "scripts", "group_timeout.py"), "8", "2", timeout=120)
    assert re.search(r"rank 0: the all-reduce failed: .*Timed out waiting 2000ms", proc.stdout), proc.stdout[-3000:]
