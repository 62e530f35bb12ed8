"""What a newcomer meets first, without a DeepSpeed engine: the help, the commands' imports, the mistakes refused in
one line before anything is written, the job's closing words, the logs of rank 0 only, a stale build lock, a port
another job holds, and a metrics log rewound on a full disk."""
import errno
import json
import logging
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import REPO, free_port, python_path
from ds_pseudo_real import logs
from ds_pseudo_real.config import ConfigError

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops


def run(*args, env=None, timeout=300):
    full = dict(os.environ, PYTHONPATH=python_path(), **(env or {}))
    return subprocess.run([sys.executable, *args], env=full, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_the_main_jobs_help_exits_0_and_describes_it_whole():
    proc = run("launch/train.py", "--help")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert ("The main job: a GPT, the M6 MoE or a Hugging Face causal LM on the embedded byte corpus or Megatron "
            "indexed datasets, pseudo stage -> delink -> real stage.") in text
    assert "--allow-demo-corpus" in text and "--log-all-ranks" in text


def test_help_and_check_import_only_what_they_use():
    """``ds-pseudo-real --help`` imports neither torch nor DeepSpeed; ``--check`` on a DeepSpeed config validates it
    with DeepSpeed's own classes and imports no megatron."""
    probe = ("import sys\n"
             "from ds_pseudo_real.cli import main\n"
             "assert main(['--help']) == 0\n"
             "heavy = lambda: sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'deepspeed', 'megatron'})\n"
             "print('after --help:', heavy())\n"
             "from launch.train import main as job\n"
             "assert job(['--check', 'configs/tiny_cpu.json']) == 0\n"
             "print('after --check:', heavy())\n")
    proc = run("-c", probe)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "after --help: []" in proc.stdout
    assert "after --check: ['deepspeed', 'torch']" in proc.stdout and "ok: configs/tiny_cpu.json" in proc.stdout


# ---- mistakes: one line each, refused before the run lock is taken ----------------------------------------------
def job_config(tmp_path, **changes):
    config = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    return str(path)


def read_job(*argv, world=1):
    from launch.job import read_job
    from launch.train import parse_args

    return read_job(parse_args(list(argv)), world)


def test_check_refuses_what_building_the_engine_refuses(tmp_path):
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(ConfigError, match=r"optimizer.type: got 'SGD'; granular_offload steps Adam-family optimizers "
                                          r"only, accepted: 'Adam', 'AdamW'"):
        read_job("--check", job_config(tmp_path, optimizer=sgd, granular_offload={"device_memory": "1GB"}))
    with pytest.raises(ConfigError, match=r"pseudo_to_real.layers: got 'blocks'; the main job's gpt model has its "
                                          r"layer list at 'layers'"):
        read_job("--check", job_config(tmp_path, pseudo_to_real={"layers": "blocks", "switch": {"at_step": 2}}))


def test_deepspeeds_own_sections_name_the_key_where_it_is_and_the_closest_one():
    from ds_pseudo_real.run_config import check_deepspeed_sections

    for config, expected in [
        ({"zero_optimization": {"stgae": 1}},
         "  stgae: Extra inputs are not permitted (got 1), at zero_optimization.stgae; did you mean "
         "'zero_optimization.stage'?"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"devce": "cpu"}}},
         "at zero_optimization.offload_param.devce; did you mean 'zero_optimization.offload_param.device'?"),
        ({"bf16": {"enabeld": True}}, "at bf16.enabeld; did you mean 'bf16.enabled'?"),
        ({"tensorboard": {"enabeld": True}}, "tensorboard.enabeld: Extra inputs are not permitted (got True); did you "
                                             "mean 'tensorboard.enabled'?"),
    ]:
        with pytest.raises(ConfigError) as error:
            check_deepspeed_sections(config, 2, 1)
        assert expected in str(error.value), str(error.value)


def test_a_config_error_the_job_finds_writes_nothing(tmp_path):
    """Refused after the process group starts (every rank reads the config), before the run lock is taken; and the
    start builds no C++ op (DeepSpeed's shared-memory all-reduce, for inference only, is left out: an empty
    extensions folder stays empty)."""
    out, ops = tmp_path / "run", tmp_path / "torch_extensions"
    config = job_config(tmp_path, pseudo_to_real={"layers": "blocks", "switch": {"at_step": 2}})
    proc = run("launch/train.py", "--deepspeed_config", config, "--output-dir", str(out),
               env={"MASTER_PORT": str(free_port()), "TORCH_EXTENSIONS_DIR": str(ops)})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: pseudo_to_real.layers: got 'blocks'; the main job's gpt model has its layer list at 'layers': give "
        "that, or leave the key out"]
    assert not out.exists()  # no run lock, no data cache
    assert "rank 0/1 started" in proc.stdout and not any(ops.glob("*/*.so"))  # no op built on the way


def test_a_large_model_on_the_demo_corpus_needs_a_flag(tmp_path):
    demo = str(REPO / "configs" / "m6_10t.json")  # the model, without a data section
    with pytest.raises(ConfigError, match=r"would train this m6 model of 1.01e\+13 parameters on the embedded byte "
                                          r"corpus.*--allow-demo-corpus"):
        read_job("--check", demo, world=512)
    assert read_job("--check", demo, "--allow-demo-corpus", world=512).spec.num_layers == 48
    data = tmp_path / "m6_10t_data.json"  # the README's example: the model and a dataset
    data.write_text(json.dumps({**json.loads(Path(demo).read_text()), "data": {"prefix": str(tmp_path / "corpus")}}))
    with pytest.raises(ConfigError, match=rf"data: {tmp_path}/corpus.bin and {tmp_path}/corpus.idx missing"):
        read_job("--check", str(data), world=512)
    assert read_job("--check", job_config(tmp_path)).spec.kind == "gpt"  # the demo's own model is not large


@pytest.mark.parametrize("shape", [{}, {"n_layer": 3, "d_model": 32, "n_head": 2, "mlp_ratio": 2, "bias": False,
                                     "vocab_size": 300, "seq_len": 17}], ids=["default", "other"])
def test_the_gpts_parameter_count_without_building_it_is_the_built_models(shape):
    from ds_pseudo_real.models.gpt import GPT, GPTConfig

    config = GPTConfig(**shape)
    assert config.parameter_count() == sum(p.numel() for p in GPT(config).parameters())


def test_slurm_submit_errors_exit_2_like_every_other(tmp_path, monkeypatch, capsys):
    from launch import slurm

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    config = tmp_path / "ds.json"
    config.write_text("{}")
    status = slurm.main(["submit", "--nodes", "1", "--gpus-per-node", "0", "--tasks-per-node", "1", "--partition",
                         "p", "--time", "10", "--deepspeed-config", str(config), "--output-dir", str(tmp_path / "run")])
    assert status == 2
    assert capsys.readouterr().err.startswith("error: sbatch is not on PATH: run this on a SLURM login node")


def test_a_port_another_job_holds_is_one_line_naming_it_and_the_flag(tmp_path):
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if held.family == socket.AF_INET6:
            held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = run("launch/train.py", "--deepspeed_config", job_config(tmp_path), "--output-dir", str(tmp_path / "run"),
                   env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: port {port} on 127.0.0.1 (MASTER_PORT) is in use by "
                                                     f"another process"), errors
    assert "deepspeed --master_port" in errors[0] and "torchrun --master_port" in errors[0]


def test_a_pure_test_module_never_waits_for_deepspeeds_ops(tmp_path):
    """A module that builds no engine (marked ``no_ops``) runs in a fresh extensions folder without building any of
    DeepSpeed's C++ ops (on a fresh venv: the three ops took 1,361 s before the first test of such a module ran)."""
    ops = tmp_path / "torch_extensions"
    proc = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ports.py",
               env={"TORCH_EXTENSIONS_DIR": str(ops)})
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not any(ops.glob("*/*.so")) and not any(ops.glob("*/lock"))


def test_an_interval_save_on_a_full_disk_is_a_warning_naming_the_last_good_checkpoint(tmp_path):
    """The checkpoints on a file system with room for one: the save at step 4 is published, those at steps 8 and 12
    fail (a warning each, naming step 4's checkpoint as the last good one) and training goes on; the final save fails
    too, which ends the job with one error and exit status 2."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    out, disk = tmp_path / "run", tmp_path / "disk"
    out.mkdir()
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small file system is needed to fill the disk for real; mount failed: {mounted.stderr.strip()}")
    try:
        (out / "checkpoints").symlink_to(disk)
        config = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
        config["train_micro_batch_size_per_gpu"] = 8
        config["scheduler"]["params"].update(total_num_steps=16, warmup_num_steps=4)
        config["pseudo_to_real"]["switch"] = {"at_step": 6}
        (tmp_path / "job.json").write_text(json.dumps(config))
        proc = run("launch/train.py", "--deepspeed_config", str(tmp_path / "job.json"), "--output-dir", str(out),
                   "--n-layer", "4", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes",
                   str(1 << 20), "--eval-interval", "8", "--eval-batches", "2", "--save-interval", "4",
                   env={"MASTER_PORT": str(free_port())}, timeout=600)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    last_good = f"the last good checkpoint is {out}/checkpoints/global_step4 (step 4)"
    warnings_ = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert [w.split(" (rank 0)")[0] for w in warnings_] == [
        f"[ds_pseudo_real] WARNING: could not save checkpoint {out}/checkpoints/global_step{step}" for step in (8, 12)]
    assert all("No space left on device" in w and w.endswith(last_good) for w in warnings_), warnings_
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(last_good) and "global_step16" in errors[0]
    assert "step 16/16" in proc.stdout and "Traceback" not in proc.stderr


# ---- the closing summary ----------------------------------------------------------------------------------------
def test_the_closing_summary_names_stages_losses_time_and_where_everything_is(tmp_path):
    from launch.run_report import closing_summary, finished_already

    history = [{"step": s, "stage": "pseudo", "groups": 1, "train_loss": 3.0 - s / 10} for s in (1, 2)]
    history += [{"event": "delink", "step": 2, "seconds": 0.25, "groups_before": 1, "groups_after": 4}]
    history += [{"step": s, "stage": "real", "groups": 4, "train_loss": 2.5 - s / 10} for s in (3, 4)]
    history[-1]["val_loss"] = 2.25
    text = closing_summary(history, tmp_path, tmp_path / "checkpoints" / "global_step4", tmp_path / "loss.png", 0, 4,
                           1024, 75.4)
    assert text.splitlines() == [
        "done: step 4 of 4, steps 1-4 in this run, 1m15s in all; 4,096 tokens trained on",
        "  stages: pseudo (1 parameter group) steps 1-2; delinked at step 2 in 0.25 s (1 -> 4 parameter groups); "
        "real (4 parameter groups) steps 3-4",
        "  final loss: train 2.1000, validation 2.2500 (step 4)",
        f"  checkpoint: {tmp_path}/checkpoints/global_step4",
        f"  metrics: {tmp_path}/metrics.jsonl; plot: {tmp_path}/loss.png",
        "  next: the same command trains on from step 4 with --steps N (N > 4); --no-resume or another --output-dir "
        "starts over"]
    done = finished_already(tmp_path, tmp_path / "checkpoints", 4, 4)
    assert done.startswith(f"{tmp_path} has finished already: its checkpoint {tmp_path}/checkpoints/global_step4 is "
                           f"at step 4") and "--steps N (N > 4)" in done and "--no-resume" in done


# ---- logs: rank 0 at INFO, the others at WARNING, library warnings once -------------------------------------------
def test_rank_0_logs_info_the_others_warnings_unless_all_ranks_are_asked(monkeypatch, capsys):
    monkeypatch.delenv(logs.ALL_RANKS_ENV, raising=False)
    for rank in (0, 1):
        monkeypatch.setattr(logs, "process_rank", lambda rank=rank: rank)
        logs.logger.info("the delink took 1 s")
        logs.logger.warning("a save failed")
        logs.job_logger.info("step 10/20")
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[ds_pseudo_real] the delink took 1 s", "step 10/20"]
    assert captured.err.splitlines() == ["[ds_pseudo_real] WARNING: a save failed"] * 2
    monkeypatch.setenv(logs.ALL_RANKS_ENV, "1")
    logs.logger.info("the delink took 1 s")
    assert capsys.readouterr().out == "[ds_pseudo_real] rank 1: the delink took 1 s\n"


def test_a_library_warning_repeated_is_shown_once():
    deepspeed_logger = logging.getLogger(logs.DEEPSPEED_LOGGER)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep()
    deepspeed_logger.addHandler(keep)
    once = f"Attempting to get learning rate from scheduler before it has started ({os.getpid()}, {time.time()})"
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.resetwarnings()
            logs.quiet_libraries()
            for _ in range(3):
                deepspeed_logger.warning(once)
            warnings.warn(once)  # raised from two lines, as megatron.core does
            warnings.warn(once)
    finally:
        deepspeed_logger.removeHandler(keep)
    assert seen == [once]
    assert [str(w.message) for w in shown] == [once]


# ---- the run lock, a build lock, a port ---------------------------------------------------------------------------
def test_taking_over_a_lock_that_another_run_left_names_it(tmp_path, capsys):
    from ds_pseudo_real.checkpointing import lock as run_lock

    left = {"host": "node7", "pid": 4242, "started": "2026-12-01T10:00:00+0000", "command": "launch/train.py"}
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(left))
    run_lock.acquire(str(tmp_path))
    try:
        assert capsys.readouterr().out == (
            f"[ds_pseudo_real] {tmp_path / run_lock.LOCK_FILE}: took over from the run of host node7, pid 4242, since "
            f"2026-12-01T10:00:00+0000 (launch/train.py), which ended without giving the lock up (killed, or its "
            f"host went down)\n")
    finally:
        run_lock.release(str(tmp_path))


def test_a_build_lock_no_process_holds_is_named_with_what_to_delete(tmp_path):
    from ds_pseudo_real.ds_state.op_builds import StaleBuildLock, wait_for_build_lock

    (tmp_path / "lock").touch()
    started = time.monotonic()
    with pytest.raises(StaleBuildLock) as stale:
        wait_for_build_lock("cpu_adam", str(tmp_path), poll_s=0.1)
    assert time.monotonic() - started < 5
    assert str(stale.value).startswith(f"{tmp_path}/lock is a build lock of DeepSpeed's op cpu_adam that no process "
                                       f"holds: a build killed while it ran left it")
    assert f"delete it (rm {tmp_path}/lock) and run again" in str(stale.value)


def test_a_build_lock_a_live_build_holds_is_waited_for_and_named(tmp_path, capsys):
    from ds_pseudo_real.ds_state.op_builds import wait_for_build_lock

    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time\nfd = os.open({str(lock)!r}, "
                               f"os.O_CREAT | os.O_EXCL)\nprint('held', flush=True)\ntime.sleep(2)\nos.close(fd)\n"
                               f"os.remove({str(lock)!r})"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    wait_for_build_lock("cpu_adam", str(tmp_path), poll_s=0.1)
    assert holder.wait(timeout=30) == 0 and not lock.exists()
    assert f"waiting for the build of DeepSpeed's op cpu_adam in {tmp_path} (held by pid {holder.pid}" in \
        capsys.readouterr().out


# ---- metrics.jsonl rewound on a full disk -------------------------------------------------------------------------
def test_a_rewind_on_a_full_disk_leaves_no_record_twice_and_none_cut(tmp_path, capsys):
    """An interrupted run logged steps 1-25 and is resumed at step 20 on a disk with no free block: the lines after
    step 20 cannot be kept aside nor the file copied, so it is cut in place; the records of the resumed run then
    fill what is left of the file's last block, and the one that does not fit is not left half written."""
    from ds_pseudo_real.report import MetricsLog

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small file system is needed to fill the disk for real; mount failed: {mounted.stderr.strip()}")
    try:
        path = disk / "metrics.jsonl"
        record = lambda step: {"step": step, "stage": "pseudo", "train_loss": 3.25, "lr": 0.001}  # noqa: E731
        path.write_text("".join(json.dumps(record(step)) + "\n" for step in range(1, 26)))
        with open(disk / "filler", "wb", buffering=0) as filler:
            with pytest.raises(OSError) as full:
                while True:
                    filler.write(b"x" * 4096)
            assert full.value.errno == errno.ENOSPC
        log = MetricsLog(path, resume_step=20)
        for step in range(21, 80):
            log.write(record(step))
        lines = path.read_text().splitlines(keepends=True)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    rows = [json.loads(line) for line in lines]  # every line whole
    assert all(line.endswith("\n") for line in lines)
    steps = [row["step"] for row in rows if "train_loss" in row]
    assert steps == list(range(1, len(steps) + 1)) and 25 < len(steps) < 79  # each step once; the file's block full
    assert rows[20] == {"event": "resume", "step": 20}
    warned = capsys.readouterr().err.splitlines()
    assert warned[0] == (f"[ds_pseudo_real] WARNING: could not rewind {path} through a copy ([Errno 28] No space left "
                         f"on device): rewound it in place; the 5 lines it dropped are lost")
    assert warned[1].startswith(f"[ds_pseudo_real] WARNING: could not write {path}: [Errno 28] No space left")
    assert len(warned) == 2
