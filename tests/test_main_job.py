"""The main job end to end on the embedded corpus: pseudo stage, delink, real stage, loss history, plot, resume."""
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ds_pseudo_real.models.gpt import Block, GPTConfig
from ds_pseudo_real.checkpointing import folders as ckpt
from ds_pseudo_real.checkpointing.verify import verify
from ds_pseudo_real.report import read_records
from conftest import REPO, free_port, python_path, run_main_job, run_two_ranks

TINY = ["--n-layer", "4", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", str(1 << 20),
        "--eval-interval", "6", "--eval-batches", "2", "--log-interval", "6"]


def tiny_config(tmp_path, steps=24, switch=12):
    cfg = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 8
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=4)
    cfg["pseudo_to_real"]["switch"] = {"at_step": switch}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    return path


def run_single(*args):
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def records(out):
    return read_records(out / "metrics.jsonl")


def test_main_job_trains_both_stages_writes_history_and_resumes(tmp_path):
    out = tmp_path / "run"
    log = run_single("--deepspeed_config", str(tiny_config(tmp_path)), "--output-dir", str(out), *TINY)
    assert "delinked at step 12" in log and "rank 0 finished at step 24 stage real" in log
    rows = records(out)
    delinks = [r for r in rows if r.get("event") == "delink"]
    assert len(delinks) == 1 and delinks[0]["step"] == 12
    layer = sum(p.numel() for p in Block(GPTConfig(d_model=32, n_head=2)).parameters())
    assert delinks[0]["parameters_after"] - delinks[0]["parameters_before"] == 3 * layer
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(val) == [6, 12, 18, 24]
    assert val[12] < val[6] and val[24] < val[18] < val[12]  # falls in the pseudo stage and in the real stage
    assert [r["stage"] for r in rows if "train_loss" in r] == ["pseudo"] * 12 + ["real"] * 12
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "latest").read_text() == "global_step24"
    summary = log[log.index("done: step 24 of 24, steps 1-24 in this run, "):].splitlines()
    assert summary[1].startswith("  stages: pseudo (1 parameter group) steps 1-12; delinked at step 12 in ")
    assert summary[1].endswith("(1 -> 4 parameter groups); real (4 parameter groups) steps 13-24")
    assert summary[2] == f"  final loss: train {rows[-1]['train_loss']:.4f}, validation {val[24]:.4f} (step 24)"
    assert summary[3:5] == [f"  checkpoint: {out}/checkpoints/global_step24",
                            f"  metrics: {out}/metrics.jsonl; plot: {out}/loss.png"]

    # Continue the same run to step 30 with a longer schedule: resumes in the real stage from step 24.
    log = run_single("--deepspeed_config", str(tiny_config(tmp_path, steps=30)), "--output-dir", str(out), *TINY)
    assert "resumed from" in log and "at step 24 (real stage)" in log
    assert "rank 0 finished at step 30 stage real" in log
    steps = [r["step"] for r in records(out) if "train_loss" in r]
    assert steps == list(range(1, 31))

    # The same command again: the run is finished; it says so and how to go on, and changes nothing.
    history = (out / "metrics.jsonl").read_bytes()
    log = run_single("--deepspeed_config", str(tiny_config(tmp_path, steps=30)), "--output-dir", str(out), *TINY)
    assert f"{out} has finished already: its checkpoint {out}/checkpoints/global_step30 is at step 30" in log
    assert "--steps N (N > 30)" in log and "training 30 steps" not in log
    assert (out / "metrics.jsonl").read_bytes() == history and ckpt.latest_tag(str(out / "checkpoints")) == "global_step30"


def test_main_job_resumes_from_a_chosen_checkpoint_keeps_history_and_never_starts_over(tmp_path):
    out = tmp_path / "run"
    config = str(tiny_config(tmp_path, steps=18, switch=9))
    run_single("--deepspeed_config", config, "--output-dir", str(out), *TINY, "--save-interval", "6")
    first = (out / "metrics.jsonl").read_text().splitlines()
    log = run_single("--deepspeed_config", config, "--output-dir", str(out), *TINY, "--resume-from", "global_step6")
    assert "at step 6 (pseudo stage)" in log and "rank 0 finished at step 18 stage real" in log
    assert (out / "metrics.jsonl").read_text().splitlines()[:6] == first[:6]  # rewound to step 6 ...
    assert (out / "metrics.jsonl.discarded").read_text().splitlines() == first[6:]  # ... the rest kept aside
    history = records(out)
    assert [r["step"] for r in history if "train_loss" in r] == list(range(1, 19))
    assert [r["step"] for r in history if r.get("event") == "delink"] == [9]
    assert {"event": "resume", "step": 6} in history

    # Every checkpoint damaged: the job stops with one message listing each, and rewrites nothing.
    for states in (out / "checkpoints").glob("global_step*/mp_rank_00_model_states.pt"):
        data = bytearray(states.read_bytes())
        data[len(data) // 2] ^= 0xFF
        states.write_bytes(bytes(data))
    before = (out / "metrics.jsonl").read_bytes()
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--deepspeed_config", config,
                           "--output-dir", str(out), *TINY], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: no checkpoint in {out / 'checkpoints'} can be resumed from:"]
    for step in (6, 12, 18):
        assert f"  global_step{step} (step {step}): mp_rank_00_model_states.pt fails its crc32 check" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == before


def test_main_job_on_two_ranks(tmp_path):
    out = tmp_path / "run2"
    proc = run_two_ranks(REPO / "launch" / "train.py", "--deepspeed_config", str(tiny_config(tmp_path, steps=12, switch=6)),
                         "--output-dir", str(out), *TINY)
    assert "rank 0 finished at step 12 stage real" in proc.stdout
    assert "rank 1 finished at step 12 stage real" in proc.stdout
    assert [r["step"] for r in records(out) if r.get("event") == "delink"] == [6]
    # rank 0 alone says what the job and the plugin do; each rank says it started and finished
    for line in ("training 12 steps from step 0", "step 12/12 | stage real", "[ds_pseudo_real] delinked at step 6",
                 "done: step 12 of 12", "rank 0 memory real"):
        assert proc.stdout.count(line) == 1, (line, proc.stdout[-3000:])
    assert "rank 1 memory" not in proc.stdout and proc.stdout.count(" started on ") == 2


def test_console_script_help_lists_commands():
    from ds_pseudo_real.cli import main

    assert main(["--help"]) == 0
    assert main(["bogus"]) == 2


def test_main_job_destroys_its_process_group_before_it_returns(tmp_path):
    """A rank that leaves with gloo's process group alive can abort in the interpreter's teardown (SIGABRT after a
    run that passed: gloo's worker threads still hold tensors there), which fails the job. ``main`` destroys the
    group, on success and on the plugin's errors."""
    driver = ("import sys; import torch.distributed as dist; from launch.train import main; rc = main(sys.argv[1:]); "
              "print('process group alive after main:', dist.is_initialized()); sys.exit(rc)")
    config = tiny_config(tmp_path, steps=2, switch=1)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(config.read_text()), "pseudo_to_rael": {}}))
    for path, status in ((config, 0), (bad, 2)):
        env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
        proc = subprocess.run([sys.executable, "-c", driver, "--deepspeed_config", str(path), "--output-dir",
                               str(tmp_path / path.stem), *TINY], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "process group alive after main: False" in proc.stdout, proc.stdout[-3000:]
    assert "pseudo_to_rael" in proc.stderr


def test_main_job_runs_the_exit_handlers_and_leaves_without_the_interpreters_teardown(tmp_path):
    """As a script, the job leaves with os._exit once the exit handlers have run: the teardown it skips is where a C++
    thread still joinable aborts a rank whose run passed; the handlers (monitors' flushes) still run, once."""
    driver = ("import atexit, runpy, sys\n"
              "atexit.register(print, 'exit handler ran', flush=True)\n"
              "class Collected:\n"
              "    def __del__(self):\n"
              "        print('teardown ran', flush=True)\n"
              "kept = Collected()  # collected when the interpreter tears its modules down\n"
              "sys.argv = sys.argv[1:]\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
    proc = subprocess.run([sys.executable, "-c", driver, str(REPO / "launch" / "train.py"), "--deepspeed_config",
                           str(tiny_config(tmp_path, steps=2, switch=1)), "--output-dir", str(tmp_path / "run"),
                           *TINY], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 finished at step 2 stage real" in proc.stdout
    assert proc.stdout.count("exit handler ran") == 1 and "teardown ran" not in proc.stdout


def start_single(logs, *args) -> subprocess.Popen:
    """``launch/train.py ARGS`` in one process, in the background, its output in ``logs``.out/.err."""
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
    return subprocess.Popen([sys.executable, str(REPO / "launch" / "train.py"), *map(str, args)], env=env, cwd=REPO,
                            stdout=open(f"{logs}.out", "w"), stderr=open(f"{logs}.err", "w"))


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_second_run_on_the_same_output_folder_is_refused_and_the_first_loses_nothing(tmp_path):
    """The same command started twice on one folder: the second stops at once with one error naming the first
    (its host and pid), and writes nothing there; the first trains on, stops on SIGTERM with a checkpoint, and every
    checkpoint it wrote is its own and verifies, its metrics one run's steps."""
    out = tmp_path / "run"
    command = ["--deepspeed_config", tiny_config(tmp_path, steps=5000, switch=12), "--output-dir", out, *TINY,
               "--save-interval", "5"]
    first = start_single(tmp_path / "first", *command)
    try:
        wait_for(lambda: (out / "checkpoints" / "latest").is_file(), "the first run's first checkpoint")
        second = run_main_job(*map(str, command), expect=2)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"host {socket.gethostname()}, pid {first.pid}" in errors[0], errors[0]
        assert first.poll() is None  # untouched by the second run
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            first.kill()
    log = Path(f"{tmp_path / 'first'}.out").read_text()
    stopped = int(re.search(r"saved checkpoint at step (\d+) on signal SIGTERM", log).group(1))
    folder = out / "checkpoints"
    tags = sorted((c.tag for c in ckpt.list_checkpoints(str(folder))), key=lambda t: int(t[len("global_step"):]))
    assert tags == [f"global_step{s}" for s in range(5, stopped + 1, 5)] + [f"global_step{stopped}"] * (stopped % 5 > 0)
    for tag in tags:
        assert verify(str(folder), tag).ok, tag
        assert ckpt.read_sidecar(str(folder), tag)["written_by"]["pid"] == first.pid
    assert ckpt.latest_tag(str(folder)) == f"global_step{stopped}"
    steps = [r["step"] for r in read_records(out / "metrics.jsonl", raw=True) if "train_loss" in r]
    assert steps == list(range(1, stopped + 1))


def processes_of(out: Path):
    """The processes (launchers and ranks) whose command line names the run folder ``out``."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if str(out) in " ".join(process.info["cmdline"] or []) and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


@pytest.mark.parametrize("launcher, sig", [("torchrun", signal.SIGUSR1), ("deepspeed", signal.SIGTERM)])
def test_a_launcher_killed_by_a_signal_it_does_not_pass_on_leaves_no_rank_training(tmp_path, launcher, sig):
    """torchrun dies of SIGUSR1, the one-node ``deepspeed`` command of SIGTERM, without signalling the ranks: every
    rank notices that its launcher is gone, the ranks save one checkpoint at the step they reached, which verifies,
    and exit; no process of the run is left."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()})
    start = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] if launcher == "torchrun" else
             [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2"])
    command = [*start, "--master_port", str(free_port()), str(REPO / "launch" / "train.py"), "--deepspeed_config",
               str(tiny_config(tmp_path, steps=5000, switch=12)), "--output-dir", str(out), *TINY]
    log = tmp_path / "log"
    top = subprocess.Popen(command, env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "step 6/5000" in log.read_text(), "the ranks' first progress line")
        ranks = [p for p in processes_of(out) if p.info["cmdline"][1:3] == ["-u", str(REPO / "launch" / "train.py")]]
        top.send_signal(sig)
        assert top.wait(timeout=60) != 0  # it died of the signal, or (deepspeed) of its default handling
        wait_for(lambda: not processes_of(out), "every process of the run to end", timeout=120)
    finally:
        for process in processes_of(out):
            process.kill()
    text = log.read_text()
    assert len(ranks) == 2, text[-3000:]
    # A rank that noticed first may stop both at the next step boundary, before the other one's watch looks.
    assert re.search(r"\[ds_pseudo_real\] rank [01]: its launcher .* is gone; stopping as on SIGTERM", text), text[-3000:]
    saved = re.findall(r"saved checkpoint at step (\d+) on signal (?:SIGTERM|from another rank)", text)
    assert len(saved) == 2 and saved[0] == saved[1], text[-3000:]
    folder = str(out / "checkpoints")
    assert ckpt.latest_tag(folder) == f"global_step{saved[0]}"
    assert verify(folder, f"global_step{saved[0]}").ok
    assert ckpt.read_sidecar(folder, f"global_step{saved[0]}")["world_size"] == 2


def test_a_switch_after_the_last_step_is_a_warning_at_start(tmp_path):
    proc = run_main_job("--deepspeed_config", str(tiny_config(tmp_path, steps=3, switch=12)), "--output-dir",
                        str(tmp_path / "run"), *TINY)
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert warnings == ["[ds_pseudo_real] WARNING: the next delink is planned at step 12, after this run's last step 3 "
                        "(--steps, else scheduler.params.total_num_steps): this run trains only the pseudo model"]
    assert proc.stdout.index("training 3 steps from step 0") < proc.stdout.index("step 3/3")
    assert "rank 0 finished at step 3 stage pseudo" in proc.stdout


def test_a_full_disk_under_the_logs_is_one_warning_each_and_the_run_ends_as_without_it(tmp_path):
    """The run folder on a file system with two free pages (the checkpoints elsewhere): the CSV monitor's LR file
    takes one at step 1, metrics.jsonl the other, so the monitor's next file fails at once, metrics.jsonl when its
    page is full, and loss.png at the end, with ENOSPC. Each is one warning; training goes on to its final
    checkpoint and exit 0."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    out = tmp_path / "run"
    out.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(out)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small file system is needed to fill the disk for real; mount failed: {mounted.stderr.strip()}")
    try:
        (tmp_path / "checkpoints").mkdir()
        (out / "checkpoints").symlink_to(tmp_path / "checkpoints")
        with open(out / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"x" * 4096)
            except OSError as error:
                assert error.errno == errno.ENOSPC
            filler.truncate(filler.tell() // 4096 * 4096 - 2 * 4096)  # two free pages
        config = json.loads(tiny_config(tmp_path, steps=40, switch=6).read_text())
        config["csv_monitor"] = {"enabled": True, "job_name": "tiny"}
        (tmp_path / "monitored.json").write_text(json.dumps(config))
        proc = run_main_job("--deepspeed_config", str(tmp_path / "monitored.json"), "--output-dir", str(out), *TINY)
        written = read_records(out / "metrics.jsonl")
    finally:
        subprocess.run(["umount", str(out)], check=False)
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for what in (str(out / "metrics.jsonl"), "DeepSpeed's monitors' events", str(out / "loss.png")):
        lines = [line for line in warnings if line.startswith(f"[ds_pseudo_real] WARNING: could not write {what}: ")]
        assert len(lines) == 1 and "[Errno 28] No space left on device" in lines[0], (what, warnings)
    assert "delinked at step 6" in proc.stdout and "rank 0 finished at step 40 stage real" in proc.stdout
    assert ckpt.latest_tag(str(tmp_path / "checkpoints")) == "global_step40"
    assert verify(str(tmp_path / "checkpoints"), "global_step40").ok
    steps = [r["step"] for r in written if "train_loss" in r]
    assert 10 < len(steps) < 40 and steps == list(range(1, len(steps) + 1))  # what fitted in the page
