"""The generated sbatch script and the submit command's validation, without a cluster."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import python_path

from launch.slurm import REPO, JobSpec, main, sbatch_script, time_limit_seconds


def spec(tmp_path, **changes):
    config = tmp_path / "ds.json"
    config.write_text("{}")
    values = dict(nodes=64, tasks_per_node=8, gpus_per_node=8, partition="gpu", time="10-00:00:00",
                  deepspeed_config=config, output_dir=tmp_path / "run", train_args=["--steps", "100"],
                  python="/opt/venv/bin/python")
    values.update(changes)
    return JobSpec(**values)


def directives(script):
    return [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_multi_node_script_one_task_per_gpu(tmp_path):
    script = sbatch_script(spec(tmp_path, requeue=True, cpus_per_task=10, sbatch_options=["--account=m6"],
                                distributed_timeout_min=7))
    run = tmp_path / "run"
    assert directives(script) == [
        "--job-name=ds_pseudo_real", "--partition=gpu", "--nodes=64", "--ntasks-per-node=8", "--gpus-per-node=8",
        "--cpus-per-task=10", "--time=10-00:00:00", f"--chdir={Path.cwd()}", f"--output={run}/logs/sbatch-%j.log",
        "--open-mode=append", "--signal=B:USR1@300", "--requeue", "--account=m6"]
    srun = script[script.index("\nsrun "):script.index(" &\n")].replace("\\\n", " ").split()
    assert srun[:6] == ["srun", "--kill-on-bad-exit=1", "--open-mode=append", f"--output={run}/logs/rank-%t.log",
                        "--cpus-per-task=10", "/opt/venv/bin/python"]
    assert srun[6:] == ["-m", "launch.dist_env", "--", "/opt/venv/bin/python", str(REPO / "launch" / "train.py"),
                        "--deepspeed_config", str(tmp_path / "ds.json"), "--output-dir", str(run), "--steps", "100"]
    assert "REQUEUE=1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    # the collective timeout every rank's DeepSpeed reads, exported before srun starts them
    assert "\nexport DEEPSPEED_TIMEOUT=7\n" in script and script.index("DEEPSPEED_TIMEOUT") < script.index("\nsrun ")
    # the configuration is checked for the job's 512 ranks before srun starts any
    check = (f"/opt/venv/bin/python -m launch.train --check {tmp_path / 'ds.json'} --world-size 512 --steps 100 "
             '|| exit "$?"\n')
    assert check in script and script.index(check) < script.index("\nsrun ")
    assert "--check" not in sbatch_script(spec(tmp_path, script=Path(__file__)))  # another training script


def test_cpu_job_has_no_gpu_directive_and_no_requeue(tmp_path):
    script = sbatch_script(spec(tmp_path, nodes=1, tasks_per_node=2, gpus_per_node=0, time="10"))
    assert "--ntasks-per-node=2" in directives(script)
    assert not any(d.startswith(("--gpus", "--gres")) for d in directives(script))
    assert "--no-requeue" in directives(script) and "REQUEUE=0" in script
    assert "\nexport DEEPSPEED_TIMEOUT=10\n" in script  # DeepSpeed 0.19.8's own default, pinned


def test_script_is_valid_bash_and_quotes_odd_paths(tmp_path):
    odd = tmp_path / "my run's dir"
    script = sbatch_script(spec(tmp_path, output_dir=odd, train_args=["--note", "a b;c"]))
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "'a b;c'" in script and "RUN_DIR='" in script


@pytest.mark.parametrize("value,seconds", [("10", 600), ("5:30", 330), ("1:00:00", 3600), ("2-3", 2 * 86400 + 10800),
                                           ("10-00:00:00", 864000), ("1-00:01", 86460), ("UNLIMITED", None)])
def test_time_limit_seconds(value, seconds):
    assert time_limit_seconds(value) == seconds


@pytest.mark.parametrize("changes,fragment", [
    (dict(time="10 days"), "--time '10 days': expected MINUTES"),
    (dict(time="0"), "--time '0': the time limit must be positive"),
    (dict(tasks_per_node=4), "--tasks-per-node 4 with --gpus-per-node 8"),
    (dict(gpus_per_node=0, tasks_per_node=0), "--tasks-per-node 0: expected at least 1"),
    (dict(time="5", signal_grace_s=300), "--signal-grace 300: expected 0 <= seconds < the time limit"),
    (dict(time="2", signal_grace_s=60), "--signal-grace 60: .* the checkpoint signal comes 60-120 s before the end"),
    (dict(train_args=["--output-dir", "x"]), "train argument --output-dir after '--'"),
    (dict(distributed_timeout_min=0), "--distributed-timeout-minutes 0: expected at least 1"),
    (dict(partition="gpu partition"), "--partition 'gpu partition'"),
    (dict(deepspeed_config=Path("/nonexistent.json")), "--deepspeed-config /nonexistent.json: no such file"),
])
def test_validation_names_flag_and_value(tmp_path, changes, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        spec(tmp_path, **changes).validate()


def test_dry_run_prints_and_writes_nothing(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text("{}")
    run = tmp_path / "run"
    assert main(["submit", "--nodes", "2", "--gpus-per-node", "4", "--partition", "p", "--time", "60",
                 "--deepspeed-config", str(config), "--output-dir", str(run), "--dry-run", "--", "--steps", "7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --nodes=2" in out and "--steps 7" in out
    assert not run.exists()


def test_submit_cli_error_names_the_flag(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launch.slurm", "submit", "--nodes", "1", "--gpus-per-node", "0",
                          "--partition", "p", "--time", "60", "--deepspeed-config", str(tmp_path / "none.json"),
                          "--dry-run"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert "--tasks-per-node 0: expected at least 1" in out.stderr


# Stand-ins for srun and scontrol, to run the batch script's signal and requeue logic outside SLURM: srun "trains"
# until SIGUSR1, then (if FAKE_SAVES=1) writes checkpoints/latest like the trainer and exits 0.
FAKE_SRUN = """#!/bin/bash
trap 'echo "srun got USR1" >>"$FAKE_CALLS"; [ "$FAKE_SAVES" = 1 ] && mkdir -p "$FAKE_RUN/checkpoints" &&
      echo global_step7 >"$FAKE_RUN/checkpoints/latest"; exit 0' USR1
echo "srun $*" >>"$FAKE_CALLS"
while :; do sleep 0.05; done
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >>"$FAKE_CALLS"
"""
FAKE_PYTHON = """#!/bin/bash
echo "python $*" >>"$FAKE_CALLS"
"""


def stand_ins(bin_dir, **scripts):
    bin_dir.mkdir()
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("requeue,saves,requeued", [(True, True, True), (True, False, False), (False, True, False)])
def test_batch_shell_forwards_usr1_and_requeues_only_after_a_new_checkpoint(tmp_path, requeue, saves, requeued):
    bin_dir, run, calls = tmp_path / "bin", tmp_path / "run", tmp_path / "calls"
    stand_ins(bin_dir, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL, python=FAKE_PYTHON)
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(spec(tmp_path, output_dir=run, requeue=requeue, python=str(bin_dir / "python"))))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "gpu[001-064]",
           "FAKE_CALLS": str(calls), "FAKE_RUN": str(run), "FAKE_SAVES": str(int(saves))}
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.monotonic() + 30
    while not (calls.exists() and "srun " in calls.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR1)
    out = shell.communicate(timeout=30)[0]
    assert shell.returncode == 0, out
    lines = calls.read_text().splitlines()
    assert lines[0].startswith(f"python -m launch.train --check {tmp_path / 'ds.json'} --world-size 512")
    assert lines[1].startswith("srun --kill-on-bad-exit=1") and "srun got USR1" in lines
    assert "got SIGUSR1: asking the ranks to checkpoint" in out
    assert ("scontrol requeue 123" in lines) == requeued, (lines, out)
    if requeue and not saves:
        assert "not requeueing: status 0, latest checkpoint '' (before: '')" in out


def test_batch_shell_passes_the_ranks_exit_status_on(tmp_path):
    bin_dir = tmp_path / "bin"
    stand_ins(bin_dir, srun="#!/bin/bash\nexit 3\n", python="#!/bin/bash\n")
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(spec(tmp_path, requeue=True, python=str(bin_dir / "python"))))
    out = subprocess.run(["bash", str(script)], env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "5"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and "ranks exited with status 3" in out.stdout


def test_batch_shell_stops_on_a_config_error_before_any_rank_starts(tmp_path):
    """The real check (this Python, the main job's validation) on a config with a misspelled section: one
    ``error:`` line in the batch log, exit status 2, srun never called."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    stand_ins(bin_dir, srun=FAKE_SRUN)
    config = tmp_path / "ds.json"
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(spec(tmp_path, nodes=1, tasks_per_node=2, gpus_per_node=0, python=sys.executable,
                                         train_args=[])))
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "pseudo_to_reel": {}}')
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, env={
        "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "6", "FAKE_CALLS": str(calls), "PYTHONPATH": python_path()})
    assert out.returncode == 2, out.stdout + out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("error:")] == ["error: invalid config:"]
    assert "did you mean 'pseudo_to_real'?" in out.stderr and "Traceback" not in out.stderr
    assert not calls.exists()  # no srun
