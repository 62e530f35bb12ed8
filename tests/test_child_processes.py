"""Every process a run starts ends with it (``ds_pseudo_real.child_processes``): the launcher and every rank killed
with SIGKILL at a save, at the switch or mid-step, nothing that carries the launch's environment is alive a few
seconds later: not Megatron's checkpoint writers, its persistent async-save worker, the Manager process that keeps
its write results, nor anything else a rank started. After a normal end the same is checked for every launch the
suite makes (``conftest.run_two_ranks``, ``run_main_job``, ``megatron/megatron_lm.launch``)."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, free_port, launch_marker, nothing_left_of_launch, processes_of_launch, python_path

sys.path.insert(0, str(Path(__file__).parent / "megatron"))
from megatron_lm import SCRIPT, TINY, needs_megatron_lm  # noqa: E402
from test_main_job import TINY as MAIN_TINY, tiny_config, wait_for  # noqa: E402

CHILDREN = '''
import multiprocessing, os, signal, sys, threading, time
sys.path.insert(0, {repo!r})
from ds_pseudo_real.child_processes import end_children_with_this_process

def sleep():
    time.sleep(600)

def start_grandchildren():  # as Megatron's persistent async worker forks its file writers
    if os.fork() == 0:
        sleep()
    multiprocessing.get_context("spawn").Process(target=sleep).start()
    open({pids!r} + ".grandchildren", "w").close()
    sleep()

if __name__ == "__main__":  # a spawned child imports this file again, without running this part
    if {install}:
        end_children_with_this_process()
    spawn, fork = multiprocessing.get_context("spawn"), multiprocessing.get_context("fork")
    manager = spawn.Manager()  # as Megatron's write results queue
    started = [manager._process, fork.Process(target=sleep), spawn.Process(target=sleep),
               spawn.Process(target=start_grandchildren)]
    for process in started[1:]:
        process.start()

    def from_a_thread():  # the kernel's parent-death signal follows the thread that forked: a watch instead
        for context in (fork, spawn):
            started.append(context.Process(target=sleep))
            started[-1].start()

    thread = threading.Thread(target=from_a_thread)
    thread.start()
    thread.join()
    pid = os.fork()
    if pid == 0:
        sleep()
    while not os.path.exists({pids!r} + ".grandchildren"):
        time.sleep(0.1)
    time.sleep(1.0)  # the children run past their start, the thread that started two of them is gone
    with open({pids!r}, "w") as out:
        out.write(" ".join(str(p.pid) for p in started) + f" {{pid}}")
    os.kill(os.getpid(), signal.SIGKILL)
'''


def start_children(tmp_path, install: bool):
    """A process that starts children every way the ranks' libraries do (a spawned Manager, forked and spawned
    processes from the main thread and from another thread, a bare fork, a spawned child that forks and spawns
    children of its own), then is killed: the children's pids and the launch's marker."""
    script, pids = tmp_path / f"children_{install}.py", tmp_path / f"pids_{install}"
    script.write_text(CHILDREN.format(repo=str(REPO), install=install, pids=str(pids)))
    env = dict(os.environ)
    marker = launch_marker(env)
    # no pipe: children that outlive it would hold it open
    proc = subprocess.run([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "stderr", "w"), timeout=120)
    if proc.returncode != -signal.SIGKILL:
        nothing_left_of_launch(marker, timeout=0)  # kills what it started
        pytest.fail(f"exited {proc.returncode}: {(tmp_path / 'stderr').read_text()[-3000:]}")
    return [int(pid) for pid in pids.read_text().split()], marker


def test_every_child_of_a_killed_process_ends_with_it(tmp_path):
    pids, marker = start_children(tmp_path, install=True)
    assert len(pids) == 7
    assert nothing_left_of_launch(marker, timeout=5.0) == ""


def test_without_the_hooks_the_children_outlive_it(tmp_path):
    """The control: the same children without ``end_children_with_this_process`` are still alive afterwards."""
    pids, marker = start_children(tmp_path, install=False)
    time.sleep(1.0)
    alive = {p.pid for p in processes_of_launch(marker)}
    nothing_left_of_launch(marker, timeout=0)  # kills them
    assert alive >= set(pids)  # and the resource tracker they keep


def command_line(process) -> str:
    """A process's command line, empty for one that ended or is a zombie (a child that just exited)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def children(process) -> list:
    try:
        return process.children()
    except psutil.NoSuchProcess:
        return []


class Launch:
    """A launcher command in the background, its output in a file, its processes marked."""

    def __init__(self, command, tmp_path, extra_env=None):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update({"OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", **(extra_env or {})})
        self.marker = launch_marker(env)
        self.log = tmp_path / "launch.log"
        self.top = subprocess.Popen([str(c) for c in command], env=env, cwd=REPO, stdout=open(self.log, "w"),
                                    stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text()

    def kill_launcher_and_ranks_when(self, text: str, timeout: float = 600) -> None:
        """Once ``text`` is in the output: SIGKILL to the launchers and the ranks they started, at once (as a node's
        OOM killer or a lost job would), none to what the ranks started."""
        wait_for(lambda: text in self.text() or self.top.poll() is not None, repr(text), timeout)
        assert self.top.poll() is None, f"the launch ended before {text!r}:\n{self.text()[-4000:]}"
        top = psutil.Process(self.top.pid)
        launchers = [top] + [p for p in top.children(recursive=True) if "deepspeed.launcher.launch" in command_line(p)]
        ranks = [child for launcher in launchers for child in children(launcher) if child not in launchers]
        assert ranks, self.text()[-3000:]
        for process in launchers + ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.top.wait(timeout=30)

    def assert_nothing_left(self) -> None:
        left = nothing_left_of_launch(self.marker, timeout=10.0)
        assert not left, f"left behind by the killed launch: {left}\n{self.text()[-3000:]}"


def megatron_launch(tmp_path, *flags):
    return Launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   free_port(), "-m", "megatron_patches.run", SCRIPT, *TINY, "--train-iters", "50",
                   "--save", tmp_path / "ckpt", "--save-interval", "1", *flags], tmp_path,
                  {"PYTHONPATH": python_path(os.environ.get("MEGATRON_LM_PATH", ""))})


@needs_megatron_lm
def test_the_megatron_drop_in_killed_at_the_switch_with_async_saves_leaves_nothing(tmp_path):
    """``--async-save`` with Megatron's persistent worker, a torch_dist save every iteration and a layout switch at
    iteration 3: killed when the pseudo model is saved at the switch."""
    launch = megatron_launch(tmp_path, "--async-save", "--use-persistent-ckpt-worker", "--ckpt-format", "torch_dist",
                             "--pseudo-to-real-switch-iter", "3", "--pseudo-to-real-real-layout", "tp=2")
    try:
        launch.kill_launcher_and_ranks_when("iteration 3: pseudo model saved")
    finally:
        launch.assert_nothing_left()


@needs_megatron_lm
def test_the_megatron_drop_in_killed_mid_step_leaves_nothing(tmp_path):
    """Synchronous torch_dist saves every iteration, no layout switch, the delink at iteration 2: killed during
    the iterations after it."""
    launch = megatron_launch(tmp_path, "--ckpt-format", "torch_dist", "--pseudo-to-real-switch-iter", "2")
    try:
        launch.kill_launcher_and_ranks_when(" iteration        4/")
    finally:
        launch.assert_nothing_left()


def main_job_launch(tmp_path, launcher):
    config = tiny_config(tmp_path, steps=5000, switch=6)
    config.write_text(json.dumps({**json.loads(config.read_text()), "checkpoint": {"async_save": True}}))
    start = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] if launcher == "torchrun" else
             [Path(sys.executable).with_name("deepspeed"), "--num_gpus", "2"])
    return Launch([*start, "--master_port", free_port(), REPO / "launch" / "train.py", "--deepspeed_config", config,
                   "--output-dir", tmp_path / "run", *MAIN_TINY, "--save-interval", "1"], tmp_path,
                  {"PYTHONPATH": python_path()})


@pytest.mark.parametrize("launcher, when", [("torchrun", "step 12/5000"), ("deepspeed", "delinked at step 6")])
def test_the_main_job_killed_with_a_save_in_flight_leaves_nothing(tmp_path, launcher, when):
    """A checkpoint written in the background after every step: under torchrun killed mid-run, under the deepspeed
    launcher at the delink."""
    launch = main_job_launch(tmp_path, launcher)
    try:
        launch.kill_launcher_and_ranks_when(when)
    finally:
        launch.assert_nothing_left()
