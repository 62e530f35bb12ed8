"""Shared test set-up: one fixed C++ extension cache (DeepSpeed's ops built once, for the modules that need them),
one py-cpuinfo answer per session, DeepSpeed's fp16 path on the CPU for the tests that ask for it (``cpu_fp16``,
``CPU_FP16``), a single-process distributed environment, the PYTHONPATH of the processes tests start, helpers to run
2-rank jobs on gloo."""
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ds_pseudo_real.ports import rendezvous_port

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# py-cpuinfo asked once per session, not by every process at every CPU Adam and op load (tests/site/cpuinfo_cache.py):
# in the pytest processes and, through tests/site's sitecustomize on their PYTHONPATH, in every process they start.
SITE = Path(__file__).resolve().parent / "site"
sys.path.insert(0, str(SITE))
import cpu_fp16 as _cpu_fp16  # noqa: E402
import cpuinfo_cache  # noqa: E402

if cpuinfo_cache.CACHE_ENV not in os.environ:  # the first pytest process of the session: its workers inherit it
    os.environ[cpuinfo_cache.CACHE_ENV] = str(Path(tempfile.mkdtemp(prefix="ds_pseudo_real_cpuinfo_")) / "cpuinfo.json")
cpuinfo_cache.install()


def python_path(*more) -> str:
    """The PYTHONPATH of a process a test starts: the repository, tests/site, then ``more``."""
    return os.pathsep.join([str(REPO), str(SITE), *map(str, more)])


os.environ["PYTHONPATH"] = python_path(*[entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                         if entry and entry not in (str(REPO), str(SITE))])


# Files (scopes) that take minutes on 2 cores, slowest first: the scheduler below starts them first, so that no
# worker is left with one of them at the end while the other is idle. Any other file goes after these, the files
# with the most tests first.
# test_nvme_offload.py comes after the files that need only the ops built first (.ci/run builds the NVMe tier's op
# last).
SLOW_FIRST = ["tests/slurm", "tests/megatron/test_megatron_run.py", "tests/megatron/test_megatron_layouts.py",
              "tests/test_main_job.py", "tests/test_data.py", "tests/offload/test_optimizer.py",
              "tests/test_checkpoints.py", "tests/test_ds_delink.py", "tests/test_nvme_offload.py",
              "tests/test_recompute_main_job.py", "tests/test_resume_logs.py"]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (.ci/run runs ``-n 2``): a test file stays on one worker, so that its module fixtures
    (trained engines, launched runs) are built once, and the SLURM files share one worker, since their jobs share the
    clusters' few CPUs and would otherwise queue behind each other's time limits. ``SLOW_FIRST`` go first."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/slurm" if path.startswith("tests/slurm/") else path

        def _assign_work_unit(self, node) -> None:
            slow = [scope for scope in SLOW_FIRST if scope in self.workqueue]
            if slow:
                self.workqueue.move_to_end(slow[0], last=False)
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


def free_port() -> int:
    """A port for a job's rendezvous, below the range the kernel numbers gloo's and every connection's ports from
    (``ds_pseudo_real.ports``): the job binds it seconds later, after its imports."""
    return rendezvous_port()


@pytest.fixture(scope="session", autouse=True)
def single_process_dist_env():
    """DeepSpeed looks for these before falling back to MPI discovery (which fails without mpi4py)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # not left to the interpreter's teardown, where gloo can abort
        dist.destroy_process_group()


# The environment that makes DeepSpeed's CPU accelerator report fp16 support in a process a test starts
# (tests/site/cpu_fp16.py says what that runs and what it skips): give it to ``run_two_ranks(env_extra=...)``.
CPU_FP16 = {_cpu_fp16.ENV: "1"}


@contextlib.contextmanager
def fp16_on_cpu():
    """DeepSpeed's fp16 path on the CPU in this process and the processes it starts, until the block ends (for a
    module fixture; tests take the ``cpu_fp16`` fixture)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_cpu_fp16.ENV, "1")
        patch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: True)
        yield


@pytest.fixture
def cpu_fp16():
    """DeepSpeed's fp16 path on the CPU for this test and the processes it starts (tests/site/cpu_fp16.py)."""
    with fp16_on_cpu():
        yield


def pytest_configure(config):
    config.addinivalue_line("markers", "no_ops: the module builds no DeepSpeed engine, so its tests do not wait for "
                                       "DeepSpeed's C++ ops to be built or loaded")


@pytest.fixture(scope="session")
def deepspeed_ops(request):
    """Build (or load from TORCH_EXTENSIONS_DIR) DeepSpeed's CPU ops once per test process, before a test or rank
    that needs them, so that 2-rank subprocesses never compile the same op at the same time. Each build is said on
    the terminal (what, where, how long: ``ds_state.op_builds``), past pytest's capture."""
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder

    from ds_pseudo_real.ds_state.op_builds import announce_op_builds

    announce_op_builds()
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for builder in (CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder):
            builder().load(verbose=False)
    yield


@pytest.fixture(scope="module", autouse=True)
def deepspeed_ops_unless_pure(request):
    """The ops for every module but those marked ``no_ops`` (``pytestmark = pytest.mark.no_ops``): a test that needs
    no op never waits for a build."""
    if request.node.get_closest_marker("no_ops") is None:
        request.getfixturevalue("deepspeed_ops")
    yield


# Set in the environment of every job a test launches (``launch_marker``): every process of that launch, children of
# its ranks included, carries it.
LAUNCH_MARKER = "DS_PSEUDO_REAL_TEST_LAUNCH"


def launch_marker(env: dict) -> str:
    """Give the launch whose environment ``env`` is a marker of its own (returned)."""
    env[LAUNCH_MARKER] = uuid.uuid4().hex
    return env[LAUNCH_MARKER]


def processes_of_launch(marker: str) -> list:
    """The live processes (zombies left out: they have ended) whose environment carries ``marker``."""
    import psutil

    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and process.environ().get(LAUNCH_MARKER) == marker:
                found.append(process)
        except psutil.Error:  # ended meanwhile, or not ours to read
            continue
    return found


def nothing_left_of_launch(marker: str, timeout: float = 10.0) -> str:
    """Wait up to ``timeout`` s for every process of the launch ``marker`` to end; kill what is left and return a
    description of it ('' when nothing was left)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        left = processes_of_launch(marker)
        if not left:
            return ""
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    described = []
    for process in left:
        try:
            described.append(f"pid {process.pid} (parent {process.ppid()}, {process.status()}, started "
                             f"{time.time() - process.create_time():.1f} s ago): {' '.join(process.cmdline())[:300]}")
            process.kill()
        except psutil.Error:
            continue
    return "; ".join(described)


def run_main_job(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    """``launch/train.py ARGS`` in one process (the job's own single-rank defaults); fail the test with the output
    if it does not exit ``expect``."""
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
    marker = launch_marker(env)
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stdout[-4000:] + proc.stderr[-4000:]
    left = nothing_left_of_launch(marker)
    assert not left, f"the main job left processes behind: {left}"
    return proc


def run_two_ranks(script: Path, *args: str, timeout: float = 600, env_extra=None, ranks: int = 2
                  ) -> subprocess.CompletedProcess:
    """Run ``script`` on 2 (``ranks``) gloo ranks with torchrun; fail the test with the output if it exits non-zero.

    Each rank's stdout goes to a file of its own (torchrun's ``--redirects``); the result's ``stdout`` is torchrun's
    then rank 0's, rank 1's, ... whole, and ``rank_stdouts`` has each rank's: lines of two ranks written to one pipe
    can interleave mid-line (a block flushed from Python's buffer, a write over the pipe's atomic size), which loses
    a line to a parser."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    marker = launch_marker(env)
    with tempfile.TemporaryDirectory(prefix="rank-stdouts-") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), "--log-dir", logs, "--redirects", "1", str(script), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        by_rank = sorted(Path(logs).glob("*/attempt_*/*/stdout.log"),
                         key=lambda f: (f.parent.parent.name, int(f.parent.name)))
        stdouts = [f.read_text(errors="replace") for f in by_rank]
    proc.stdout += "".join(stdouts)
    proc.rank_stdouts = stdouts
    if proc.returncode != 0:
        tails = "".join(f"--- stdout of rank {rank}\n{out[-3000:]}\n" for rank, out in enumerate(stdouts))
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{tails}--- stderr\n{proc.stderr[-6000:]}")
    left = nothing_left_of_launch(marker)
    assert not left, f"{' '.join(cmd)} left processes behind: {left}"
    return proc
