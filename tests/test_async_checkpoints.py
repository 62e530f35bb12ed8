"""Checkpoints written in the background (``checkpoint.async_save``): the save returns after the host snapshot, the
run trains on while the files are written, and the result is the synchronous save's: exact resume (fp32) from saves
taken in quick succession, right before the delink and right after it; a full disk in the background raises the
synchronous save's CheckpointError at the next step, the last good checkpoint named; a process killed during the
background write resumes from the previous checkpoint."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from ds_pseudo_real import checksums
from ds_pseudo_real.checkpointing import folders as ckpt
from ds_pseudo_real.checkpointing import lock as run_lock
from ds_pseudo_real.checkpointing.background import BackgroundSave
from ds_pseudo_real.checkpointing.verify import verify
from conftest import python_path, run_two_ranks
from test_checkpoint_recovery import mount_tmpfs
from test_checkpoints import SWITCH, TOTAL, make, train

ASYNC = {"async_save": True}
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture()
def slow_writes(monkeypatch):
    """Every checkpoint file takes 0.3 s longer to write, so that the steps after a save run while it is written."""
    real = checksums.save_with_checksum

    def slow(save, path):
        time.sleep(0.3)
        return real(save, path)

    monkeypatch.setattr(checksums, "save_with_checksum", slow)


def test_the_writer_sums_the_snapshot_while_it_writes_the_files(tmp_path):
    """A background save takes the longer of its file writes and its fingerprint pass, not their sum: the summary is
    computed while the files are written (here a file's write waits until the summary has started); its failure is
    the save's."""
    summing = threading.Event()

    def write(handle):
        assert summing.wait(timeout=10), "the summary did not start while the files were being written"
        handle.write(b"state")

    def summary():
        summing.set()
        return {"weights": [1.0, 1.0]}

    def background_save(summary):
        save = BackgroundSave(str(tmp_path / "t"), str(tmp_path), {"f.pt": write}, summary=summary,
                              publish=lambda parts: None, failed=lambda reports: None, blocked_s=0.0)
        save.start()
        return save.report(block=True)

    assert background_save(summary) == (
        "written", ({"f.pt": {"size": 5, "crc32": f"{zlib.crc32(b'state'):08x}"}}, {"weights": [1.0, 1.0]}))

    def failing():
        summing.set()
        raise ValueError("a fingerprint that could not be taken")

    assert background_save(failing) == ("failed", "ValueError: a fingerprint that could not be taken")


@pytest.fixture(scope="module")
def uninterrupted():
    engine = make()
    losses = train(engine, TOTAL)
    engine.engine.destroy()
    return losses


def test_saves_in_quick_succession_and_around_the_delink_resume_exactly(tmp_path, uninterrupted, slow_writes, capsys):
    """Saves at 2 and 3 (the second waits for the first), the one of step 3 (pseudo) still being written while step 4
    delinks, one at 4 (real) right after: each is published, verifies, and resumes to the uninterrupted run's losses."""
    engine = make(checkpoint=ASYNC)
    losses = train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    assert engine.checkpoint_in_flight == str(tmp_path / "global_step2")
    assert ckpt.latest_tag(str(tmp_path)) is None  # not published yet: the step below trains while it is written
    losses += train(engine, 3)
    engine.save_checkpoint(str(tmp_path))  # waits for step 2's
    background = engine._checkpoints.background
    assert background.waits == 1 and ckpt.latest_tag(str(tmp_path)) == "global_step2"
    assert engine.stage == "pseudo" and engine.checkpoint_in_flight == str(tmp_path / "global_step3")
    losses += train(engine, SWITCH)  # the delink, while step 3's pseudo checkpoint is written from its snapshot
    assert engine.stage == "real"
    engine.save_checkpoint(str(tmp_path))
    losses += train(engine, TOTAL)
    still_writing = engine.checkpoint_in_flight is not None
    engine.wait_for_checkpoints()
    assert engine.checkpoint_in_flight is None and background.waits == 2 + still_writing
    assert losses == uninterrupted
    assert re.search(r"waited \d+\.\d\d s for the checkpoint in flight \(.*global_step2\) before saving the next one",
                     capsys.readouterr().out)
    engine.engine.destroy()
    for step, stage in ((2, "pseudo"), (3, "pseudo"), (4, "real")):
        tag = f"global_step{step}"
        assert verify(str(tmp_path), tag).ok and ckpt.read_sidecar(str(tmp_path), tag)["stage"] == stage
        resumed = make(seed=123)
        resumed.load_checkpoint(str(tmp_path), tag)  # the state fingerprint saved in the background is checked here
        assert resumed.stage == stage and train(resumed, TOTAL) == uninterrupted[step:]
        resumed.engine.destroy()
    assert ckpt.latest_tag(str(tmp_path)) == "global_step4"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(ckpt.PARTIAL_SUFFIX)]


def test_a_full_disk_in_the_background_raises_at_the_next_step_and_the_next_save_succeeds(tmp_path, uninterrupted):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount_tmpfs(disk, 64 << 20)
    try:
        engine = make(checkpoint=ASYNC)
        train(engine, 2)
        engine.save_checkpoint(str(disk))
        engine.wait_for_checkpoints()
        one = sum(f.stat().st_size for f in (disk / "global_step2").rglob("*") if f.is_file())
        mount_tmpfs(disk, one * 3 // 2)  # room for half of the next checkpoint
        train(engine, 3)
        engine.save_checkpoint(str(disk))  # the snapshot only: nothing is written yet
        with pytest.raises(ckpt.CheckpointError) as raised:
            for _ in range(50):  # the failure surfaces at a step boundary once the writer has hit it
                train(engine, engine.global_steps + 1)
                time.sleep(0.05)
        message = str(raised.value)
        assert message.startswith(f"could not save checkpoint {disk / 'global_step3'} (rank 0, written in the "
                                  f"background): OSError: [Errno 28] No space left on device: "), message
        assert f"the last good checkpoint is {disk / 'global_step2'} (step 2)" in message
        assert sorted(p.name for p in disk.iterdir() if p.is_dir()) == ["global_step2"]  # the partial folder is gone
        assert engine.checkpoint_in_flight is None and ckpt.latest_tag(str(disk)) == "global_step2"
        mount_tmpfs(disk, 64 << 20)  # space freed: the run goes on and saves again
        step = engine.global_steps
        engine.save_checkpoint(str(disk))
        engine.wait_for_checkpoints()
        assert verify(str(disk), f"global_step{step}").ok
        engine.engine.destroy()
        resumed = make(seed=123)
        resumed.load_checkpoint(str(disk))
        assert resumed.global_steps == step and train(resumed, TOTAL) == uninterrupted[step:]
        resumed.engine.destroy()
    finally:
        run_lock.release(str(disk))  # this process's lock file keeps the file system busy
        subprocess.run(["umount", str(disk)], check=False)


def test_killed_during_the_background_write_the_previous_checkpoint_is_resumed(tmp_path, uninterrupted):
    """SIGKILL while the files of step 3 are being written (the writer is made slow): step 2's checkpoint stays the
    latest and verifies, and a new run resumes from it exactly, the partial folder removed."""
    script = SCRIPTS / "async_save_killed.py"
    env = {**os.environ, "PYTHONPATH": python_path(Path(__file__).parent),
           "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29000 + os.getpid() % 1000)}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("writing "):
                break
        else:
            pytest.fail(f"the script ended before its background write: {proc.stderr.read()[-3000:]}")
        assert line.strip() == f"writing {tmp_path / 'global_step3'}"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = [p.name for p in tmp_path.iterdir() if p.name.endswith(ckpt.PARTIAL_SUFFIX)]
    assert len(partial) == 1 and partial[0].startswith("global_step3.")  # killed mid-write
    assert ckpt.latest_tag(str(tmp_path)) == "global_step2" and verify(str(tmp_path), "global_step2").ok
    resumed = make(seed=123)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 2 and train(resumed, TOTAL) == uninterrupted[2:]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(ckpt.PARTIAL_SUFFIX)]  # removed at the start
    resumed.engine.destroy()


def test_two_ranks_publish_only_once_both_are_durable_and_share_a_failure(tmp_path):
    """Rank 1 writes slowly: step boundaries pass with rank 0's files durable and nothing published. Then rank 1's
    background write fails (ENOSPC): both ranks raise the same CheckpointError at the same step, the partial folder
    goes, and a later save and a resume from it work."""
    proc = run_two_ranks(SCRIPTS / "async_save_two_ranks.py", str(tmp_path / "ckpt"))
    result = json.loads(proc.rank_stdouts[0].strip().splitlines()[-1])
    assert result["unpublished_steps_while_rank1_wrote"] >= 1
    assert result["published"] == "global_step2" and result["verified"]
    errors = result["errors"]
    assert errors[0] == errors[1] and errors[0]["step"] == errors[1]["step"]
    message = errors[0]["message"]
    assert message.startswith(f"could not save checkpoint {tmp_path / 'ckpt' / result['failing']} (rank 1, written in "
                              f"the background): OSError: [Errno 28] No space left on device: "), message
    assert f"the last good checkpoint is {tmp_path / 'ckpt' / 'global_step2'} (step 2)" in message
    assert not result["partial_left"] and result["latest"] == result["saved"]
    assert f"global_step{result['resumed_step']}" == result["saved"] and result["same_tail"]


def test_the_main_job_stopped_by_sigterm_publishes_the_checkpoint_in_flight_and_says_so(tmp_path):
    """launch/train.py saving every step in the background: on SIGTERM it waits for the checkpoint in flight (the
    stop's own step, so not written twice), says so with the time it took, and exits 0 with it published."""
    from test_main_job import TINY, start_single, tiny_config, wait_for

    config = tiny_config(tmp_path, steps=5000, switch=12)
    config.write_text(json.dumps({**json.loads(config.read_text()), "checkpoint": ASYNC}))
    out = tmp_path / "run"
    folder = out / "checkpoints"
    job = start_single(tmp_path / "job", "--deepspeed_config", config, "--output-dir", out, *TINY,
                       "--save-interval", "1")
    try:
        wait_for(lambda: (folder / "latest").is_file(), "the first checkpoint")
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0
    finally:
        if job.poll() is None:
            job.kill()
    log = Path(f"{tmp_path / 'job'}.out").read_text()
    stopped = int(re.search(r"saved checkpoint at step (\d+) on signal SIGTERM \(\d+\.\d\d s after the step ended\)",
                            log).group(1))
    assert (f"stopping on signal SIGTERM at step {stopped}: waiting for the checkpoint being written in the "
            f"background, {folder / f'global_step{stopped}'}") in log
    assert ckpt.latest_tag(str(folder)) == f"global_step{stopped}"
    assert verify(str(folder), f"global_step{stopped}").ok
    assert not [p for p in folder.iterdir() if p.name.endswith(ckpt.PARTIAL_SUFFIX)]
