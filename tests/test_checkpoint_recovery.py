"""Checkpoints that are verified and recoverable: a damaged newest checkpoint is moved aside and the newest one that
verifies is resumed (with the uninterrupted run's losses); none that verifies stops with every reason; stale
partial folders go at start; a full disk names the file and the last good checkpoint; retention keeps the last N
and the last pseudo-stage one; a world size or ZeRO stage that cannot load says what to run; the metrics history
is rewound to the step a run resumes from, what it drops kept aside."""
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_pseudo_real import ds_state, report
from ds_pseudo_real.checkpointing import folders as ckpt
from ds_pseudo_real.checkpointing import lock as run_lock
from ds_pseudo_real.checkpointing.resume import select_resume
from ds_pseudo_real.checkpointing.verify import verify
from ds_pseudo_real.config import ConfigError, split_checkpoint_options
from ds_pseudo_real.report import MetricsLog, read_records, rewind_csv
from conftest import python_path, run_two_ranks
from test_checkpoints import TOTAL, logits, make, train

SAVED_AT = (2, 3, 5, 6)  # pseudo, pseudo, real, real (the delink happens at step SWITCH = 4)


# ---- the folder layout, without engines ---------------------------------------------------------------------
def fake_checkpoint(root: Path, step: int, stage: str = "real", payload: bytes = b"", run_id: str = None) -> str:
    tag = f"global_step{step}"
    staged = root / ckpt.partial_tag(tag)
    (staged / "sub").mkdir(parents=True)
    (staged / "mp_rank_00_model_states.pt").write_bytes(payload or bytes(range(256)) * (40 + step))
    (staged / "sub" / "zero_pp_rank_0_optim_states.pt").write_bytes(b"x" * 1000)
    run = {} if run_id is None else {"run_id": run_id}
    ckpt.publish(str(root), tag, {"stage": stage, "global_step": step, "kind": "deepspeed", **run})
    return tag


def flip_byte(path: Path, offset: int = None) -> None:
    data = bytearray(path.read_bytes())
    where = len(data) // 2 if offset is None else offset
    data[where] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_and_verify_finds_each_kind_of_damage(tmp_path):
    tag = fake_checkpoint(tmp_path, 7)
    manifest = json.loads((tmp_path / tag / ckpt.MANIFEST).read_text())
    expected = [ckpt.SIDECAR, "mp_rank_00_model_states.pt", "sub/zero_pp_rank_0_optim_states.pt"]
    assert sorted(manifest["files"]) == sorted(expected)
    assert manifest["files"]["sub/zero_pp_rank_0_optim_states.pt"]["size"] == 1000
    good = verify(str(tmp_path), tag)
    assert good.ok and good.files == 3 and good.nbytes == sum(f["size"] for f in manifest["files"].values())

    flip_byte(tmp_path / tag / "mp_rank_00_model_states.pt")  # same size, other contents
    assert verify(str(tmp_path), tag).problems == ["mp_rank_00_model_states.pt fails its crc32 check "
                                                        "(contents changed since it was saved)"]
    assert verify(str(tmp_path), tag, "size").ok  # what the cheaper modes cannot see
    assert verify(str(tmp_path), tag, "none").ok
    path = tmp_path / tag / "sub" / "zero_pp_rank_0_optim_states.pt"
    path.write_bytes(path.read_bytes()[:500])
    assert "sub/zero_pp_rank_0_optim_states.pt has 500 bytes, the manifest says 1,000 (cut short or overwritten)" \
        in verify(str(tmp_path), tag, "size").problems
    path.unlink()
    assert "sub/zero_pp_rank_0_optim_states.pt is missing" in verify(str(tmp_path), tag, "size").problems
    (tmp_path / tag / ckpt.MANIFEST).unlink()
    assert verify(str(tmp_path), tag, "none").problems == [f"{ckpt.MANIFEST} is missing"]
    (tmp_path / tag / ckpt.SIDECAR).write_bytes(b"\xff{")
    assert verify(str(tmp_path), tag, "none").problems == [f"{ckpt.SIDECAR} is not readable JSON"]


def test_checksum_work_is_split_between_ranks_by_bytes():
    sizes = {f"f{i}": size for i, size in enumerate([90, 50, 40, 30, 20, 10, 5])}
    shares = [ckpt.share_of(sizes, rank, 3) for rank in range(3)]
    assert sorted(n for share in shares for n in share) == sorted(sizes)  # every file exactly once
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert loads == [90, 80, 75]


def test_select_resume_moves_damaged_newer_ones_aside_and_repoints_latest(tmp_path, capsys):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step, stage="pseudo" if step < 4 else "real")
    (tmp_path / "global_step6" / ckpt.SIDECAR).unlink()
    flip_byte(tmp_path / "global_step4" / "mp_rank_00_model_states.pt")
    (tmp_path / "notes9").mkdir()  # a folder of the user's: never a candidate, never moved
    tag, verdict = select_resume(str(tmp_path))
    assert (tmp_path / "notes9").is_dir()
    assert tag == "global_step2" and verdict.ok
    assert (tmp_path / "global_step6.invalid" / "mp_rank_00_model_states.pt").is_file()  # moved, not deleted
    assert (tmp_path / "global_step4.invalid").is_dir() and not (tmp_path / "global_step4").exists()
    assert (tmp_path / ckpt.LATEST).read_text() == "global_step2"
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / 'global_step6'} (step 6) is damaged: {ckpt.SIDECAR} is missing; moved aside to " \
           f"global_step6.invalid" in err
    assert "global_step4 (step 4) is damaged: mp_rank_00_model_states.pt fails its crc32 check" in err
    # A second damaged global_step4 later gets its own name beside the first.
    fake_checkpoint(tmp_path, 4)
    (tmp_path / "global_step4" / "mp_rank_00_model_states.pt").unlink()
    assert select_resume(str(tmp_path))[0] == "global_step2"
    assert (tmp_path / "global_step4.invalid.2").is_dir()


def test_select_resume_refuses_when_none_verifies_and_never_when_empty(tmp_path):
    assert select_resume(str(tmp_path / "absent")) is None
    assert select_resume(str(tmp_path)) is None
    for step in (2, 4):
        fake_checkpoint(tmp_path, step)
    flip_byte(tmp_path / "global_step2" / "mp_rank_00_model_states.pt")
    (tmp_path / "global_step4" / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError) as raised:
        select_resume(str(tmp_path))
    message = str(raised.value)
    assert f"no checkpoint in {tmp_path} can be resumed from" in message
    assert f"global_step4 (step 4): {ckpt.MANIFEST} is missing" in message
    assert "global_step2 (step 2): mp_rank_00_model_states.pt fails its crc32 check" in message
    assert "--no-resume" in message and "--resume-from" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "global_step4", "latest"]  # nothing moved
    # `latest` naming a checkpoint that is gone, with no checkpoint folder left, is not a fresh start either.
    for step in (2, 4):
        shutil.rmtree(tmp_path / f"global_step{step}")
    with pytest.raises(ckpt.CheckpointError, match="has a 'latest' file but no checkpoint folder"):
        select_resume(str(tmp_path))


def test_latest_with_garbage_bytes_is_a_warning_not_a_traceback(tmp_path, capsys):
    fake_checkpoint(tmp_path, 3)
    (tmp_path / ckpt.LATEST).write_bytes(b"\xff\xfe\x00\x9c garbage")
    assert ckpt.latest_tag(str(tmp_path)) is None
    assert select_resume(str(tmp_path))[0] == "global_step3"
    assert "holds bytes that are not a tag; looking for the newest checkpoint that verifies" in capsys.readouterr().err
    assert (tmp_path / ckpt.LATEST).read_text() == "global_step3"


def test_stale_partial_and_retired_folders_are_cleaned_at_start(tmp_path, capsys):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    (tmp_path / "global_step6.partial").mkdir()  # a save killed mid-write
    os.replace(tmp_path / "global_step4", tmp_path / "global_step4.old")  # killed between publish's two renames
    (tmp_path / "latest.tmp").write_text("global_st")
    done = ckpt.remove_stale(str(tmp_path))
    assert len(done) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "global_step4", "latest"]
    assert verify(str(tmp_path), "global_step4").ok
    assert f"removed {tmp_path / 'global_step6.partial'}: a save that did not finish" in capsys.readouterr().out


def test_prune_keeps_the_last_n_and_the_last_pseudo_checkpoint(tmp_path):
    for step, stage in ((1, "pseudo"), (2, "pseudo"), (3, "real"), (4, "real"), (5, "real")):
        fake_checkpoint(tmp_path, step, stage)
    (tmp_path / "global_step0.invalid").mkdir()
    assert ckpt.prune(str(tmp_path), None) == []
    assert ckpt.prune(str(tmp_path), 2) == ["global_step3", "global_step1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step0.invalid", "global_step2", "global_step4", "global_step5", "latest"]


def test_prune_removes_only_this_runs_checkpoints(tmp_path):
    for step, run in ((1, "old"), (2, "old"), (3, "new"), (4, "new"), (5, "new")):
        fake_checkpoint(tmp_path, step, run_id=run)
    assert ckpt.prune(str(tmp_path), 1, "new") == ["global_step4", "global_step3"]
    assert ckpt.prune(str(tmp_path), 1, "other") == []
    assert [c.tag for c in ckpt.list_checkpoints(str(tmp_path))] == ["global_step5", "global_step2", "global_step1"]


def test_a_tag_of_another_run_is_never_replaced(tmp_path):
    fake_checkpoint(tmp_path, 2, run_id="first")
    fake_checkpoint(tmp_path, 3)  # written before runs were recorded
    (tmp_path / "global_step4").mkdir()
    assert ckpt.foreign_checkpoint(str(tmp_path), "global_step2", "first") is None  # its own: replaced as before
    assert ckpt.foreign_checkpoint(str(tmp_path), "global_step9", "second") is None  # a free name
    refusal = ckpt.foreign_checkpoint(str(tmp_path), "global_step2", "second")
    assert refusal.startswith(f"{tmp_path / 'global_step2'} is a checkpoint (step 2) of another run, first, which "
                              f"this run (second) would replace; checkpoints of another run are never replaced: "
                              f"move it out of {tmp_path}, or save into another folder")
    assert "of another run, not recorded, which this run (second)" in ckpt.foreign_checkpoint(
        str(tmp_path), "global_step3", "second")
    assert ckpt.foreign_checkpoint(str(tmp_path), "global_step3", "") is None  # resumed from one: the same history
    assert "is a folder that is not a complete checkpoint" in ckpt.foreign_checkpoint(
        str(tmp_path), "global_step4", "")


def test_temporary_files_of_two_writers_never_collide(tmp_path, monkeypatch):
    """Another run writing ``latest`` between this one's write and rename: each renames its own temporary file."""
    real_replace = os.replace
    interleaved = []

    def other_run_writes_first(source, target):
        if not interleaved:
            interleaved.append(source)
            ckpt.write_atomic(Path(target), "global_step9")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", other_run_writes_first)
    ckpt.write_atomic(tmp_path / ckpt.LATEST, "global_step5")
    assert (tmp_path / ckpt.LATEST).read_text() == "global_step5" and os.listdir(tmp_path) == [ckpt.LATEST]


HOLD_LOCK = ("import sys; from ds_pseudo_real.checkpointing import lock; lock.acquire(sys.argv[1]); "
             "print('held', flush=True); sys.stdin.read()")


def test_the_run_lock_refuses_a_second_process_naming_the_first_and_frees_with_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=python_path())
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path), "--flag"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline() == "held\n"
    record = json.loads((tmp_path / run_lock.LOCK_FILE).read_text())
    assert (record["host"], record["pid"]) == (socket.gethostname(), holder.pid)
    assert record["command"] == f"-c {tmp_path} --flag"
    with pytest.raises(ckpt.CheckpointError) as refused:
        run_lock.claim(str(tmp_path))
    assert str(refused.value) == (
        f"{tmp_path} is in use by another run (host {record['host']}, pid {holder.pid}, since {record['started']} "
        f"(-c {tmp_path} --flag)), which holds {tmp_path / run_lock.LOCK_FILE}; wait for that run to end or stop it, "
        f"or give this run another folder")
    holder.stdin.close()
    assert holder.wait(timeout=60) == 0
    assert (tmp_path / run_lock.LOCK_FILE).read_text() == ""  # released at exit
    run_lock.claim(str(tmp_path))  # the kernel dropped the lock with the process
    run_lock.claim(str(tmp_path))  # held by this process already
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert run_lock.taken_over(str(tmp_path)) is None
    intruder = dict(record, host="node7")  # a run that "took" it where locks do not exclude each other
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(intruder))
    assert run_lock.taken_over(str(tmp_path)).startswith(
        f"{tmp_path / run_lock.LOCK_FILE} now names the run of host node7, pid {holder.pid}")


@pytest.mark.parametrize("holder, refused", [
    ({"host": socket.gethostname(), "pid": os.getppid()}, True),  # running here
    ({"host": "node7", "pid": 1}, True),  # another host: cannot be checked
    ({"host": socket.gethostname(), "pid": 2 ** 22 + 1}, False),  # gone: taken over
], ids=["live_here", "other_host", "gone"])
def test_without_file_locks_the_record_is_the_lock(tmp_path, monkeypatch, holder, refused):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(dict(holder, started="then", command="x")))
    if refused:
        with pytest.raises(run_lock.FolderInUse, match=r"this file system keeps no locks \(No locks available\), so "
                                                         r"the record is the only guard: if that run is over, delete"):
            run_lock.acquire(str(tmp_path))
    else:
        run_lock.acquire(str(tmp_path))
        assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_checkpoint_options_are_validated_and_removed_from_deepspeeds_section():
    section = {"verify": "size", "keep_last": 3, "tag_validation": "Fail"}
    rest, options = split_checkpoint_options({"checkpoint": section})
    assert (options.verify, options.keep_last) == ("size", 3) and rest["checkpoint"] == {"tag_validation": "Fail"}
    assert split_checkpoint_options({})[1].verify == "checksum"
    bad_mode = r"checkpoint.verify: Input should be 'checksum', 'size' or 'none' \(got 'md5'\)"
    with pytest.raises(ConfigError, match=bad_mode):
        split_checkpoint_options({"checkpoint": {"verify": "md5"}})
    with pytest.raises(ConfigError, match=r"checkpoint.keep_last: Input should be greater than or equal to 1"):
        split_checkpoint_options({"checkpoint": {"keep_last": 0}})


def test_metrics_history_is_rewound_to_the_resumed_step_keeping_what_it_drops(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 6):
        log.write({"step": step, "train_loss": 5.0 - step})
    with open(path, "a") as handle:
        handle.write('{"step": 6, "train_lo')  # a crash mid-line
    before = path.read_text().splitlines()
    log = MetricsLog(path, resume_step=3)  # the checkpoint kept steps 1..3
    for step in range(4, 7):
        log.write({"step": step, "train_loss": 10.0 + step})
    written = [json.loads(line) for line in path.read_text().splitlines()]  # each step once, as written
    assert [r["step"] for r in written if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["train_loss"] for r in written if "train_loss" in r][2:] == [2.0, 14.0, 15.0, 16.0]
    assert {"event": "resume", "step": 3} in written and read_records(path) == written
    assert (tmp_path / "metrics.jsonl.discarded").read_text().splitlines() == before[3:]  # the tail, kept aside
    assert not [p.name for p in tmp_path.iterdir() if p.name not in ("metrics.jsonl", "metrics.jsonl.discarded")]
    MetricsLog(path, resume_step=0)  # --no-resume: an explicit fresh start supersedes everything
    assert [r for r in read_records(path) if "train_loss" in r] == [] == [
        r for r in read_records(path, raw=True) if "train_loss" in r]
    assert len((tmp_path / "metrics.jsonl.discarded").read_text().splitlines()) == 3 + 7  # then the whole file


def test_history_written_before_rewinding_reads_and_rewinds_as_one_run(tmp_path):
    """A metrics.jsonl that an earlier version appended to across a resume, and a monitor CSV file that DeepSpeed
    appended to (a second header, steps again): read, and rewound, as the continuous history."""
    path = tmp_path / "metrics.jsonl"
    old = [{"step": s, "train_loss": float(s)} for s in (1, 2, 3, 4)] + [{"event": "resume", "step": 2}] + [
        {"step": s, "train_loss": 10.0 + s} for s in (3, 4, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    assert [r["train_loss"] for r in read_records(path) if "train_loss" in r] == [1.0, 2.0, 13.0, 14.0, 15.0]
    MetricsLog(path, resume_step=4)
    assert [r.get("train_loss", r.get("event")) for r in read_records(path, raw=True)] == [
        1.0, 2.0, "resume", 13.0, 14.0, "resume"]
    csv = tmp_path / "Train_Samples_loss.csv"
    csv.write_text("step,loss\n8,1.0\n16,2.0\n24,3.0\nstep,loss\n16,2.5\n24,3.5\n32,4.")
    assert rewind_csv(csv, 24)
    assert csv.read_text() == "step,loss\n8,1.0\n16,2.5\n24,3.5\n"
    assert (tmp_path / "Train_Samples_loss.csv.discarded").read_text() == "16,2.0\n24,3.0\nstep,loss\n32,4.\n"
    assert rewind_csv(csv, 24) and csv.read_text() == "step,loss\n8,1.0\n16,2.5\n24,3.5\n"  # nothing more


def test_a_metrics_write_that_fails_is_one_warning_and_the_next_record_starts_a_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write({"step": 1})

    def full_disk(file, mode="r"):  # the disk fills mid-line
        if "a" not in mode:
            return open(file, mode)
        with open(file, mode) as handle:
            handle.write('{"step": 9, "tr')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "open", full_disk, raising=False)
    log.write({"step": 2})
    log.write({"step": 3})
    monkeypatch.undo()  # room again
    log.write({"step": 4})
    assert [r["step"] for r in read_records(path)] == [1, 4]
    assert capsys.readouterr().err.splitlines() == [
        f"[ds_pseudo_real] WARNING: could not write {path}: [Errno 28] No space left on device; training goes on "
        f"without these records (later ones are written once there is room; this warning is not repeated)"]


# ---- through the controller -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at SAVED_AT of one run, and that run's losses to TOTAL."""
    folder = tmp_path_factory.mktemp("saved")
    engine = make()
    losses = []
    for step in SAVED_AT:
        losses += train(engine, step)
        engine.save_checkpoint(str(folder))
    losses += train(engine, TOTAL)
    engine.engine.destroy()
    return folder, losses


@pytest.fixture()
def run_dir(saved, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[0], folder)
    return folder


def resume(folder, tag=None, **kwargs):
    engine = make(seed=123, **kwargs)
    path, _ = engine.load_checkpoint(None if folder is None else str(folder), tag)
    return engine, path


@pytest.mark.parametrize("damage", ["flipped", "truncated", "no_sidecar"])
def test_damaged_newest_checkpoint_resumes_the_previous_one_exactly(saved, run_dir, damage, capsys):
    newest = run_dir / "global_step6"
    if damage == "flipped":
        flip_byte(newest / "mp_rank_00_model_states.pt")
    elif damage == "truncated":
        victim = newest / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    else:
        (newest / ckpt.SIDECAR).unlink()
    engine, path = resume(run_dir)
    assert "/global_step5/" in path and engine.global_steps == 5 and engine.stage == "real"
    assert (run_dir / "global_step6.invalid").is_dir() and not newest.exists()
    assert (run_dir / ckpt.LATEST).read_text() == "global_step5"
    captured = capsys.readouterr()
    assert f"checkpoint {newest} (step 6) is damaged" in captured.err
    assert f"verified {run_dir / 'global_step5'}: " in captured.out and "checksum in" in captured.out
    assert train(engine, TOTAL) == saved[1][5:]
    engine.engine.destroy()


def test_verify_none_loads_without_reading_and_a_damaged_file_names_the_checkpoint(run_dir):
    victim = run_dir / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    engine = make(seed=123, checkpoint={"verify": "none"})
    with pytest.raises(ckpt.CheckpointError) as raised:
        engine.load_checkpoint(str(run_dir))
    message = str(raised.value)
    assert f"DeepSpeed could not load checkpoint {run_dir / 'global_step6'}" in message
    assert "it was not verified (checkpoint.verify: none)" in message
    assert "--resume-from" in message and "global_step5" in message
    engine.engine.destroy()


def test_resume_from_a_tag_or_a_folder_and_an_explicit_damaged_one_fails(saved, run_dir):
    engine, path = resume(run_dir, "global_step3")
    assert engine.global_steps == 3 and engine.stage == "pseudo"
    assert train(engine, TOTAL) == saved[1][3:]
    engine.engine.destroy()
    engine, path = resume(None, str(run_dir / "global_step5"))
    assert engine.global_steps == 5 and engine.stage == "real"
    engine.engine.destroy()
    flip_byte(run_dir / "global_step2" / "mp_rank_00_model_states.pt")
    engine = make(seed=123)
    with pytest.raises(ckpt.CheckpointError, match="global_step2 cannot be loaded: mp_rank_00_model_states.pt fails"):
        engine.load_checkpoint(str(run_dir), "global_step2")
    with pytest.raises(ckpt.CheckpointError, match="--resume-from 'global_step9': no such checkpoint"):
        engine.load_checkpoint(str(run_dir), "global_step9")
    assert (run_dir / "global_step2").is_dir()  # an explicit choice is reported, not moved
    engine.engine.destroy()


def test_another_zero_stage_is_refused_with_the_convert_command_that_works(saved, run_dir):
    expected = logits_at(run_dir, "global_step5")
    engine = make(stage=1, seed=123)
    refused = "saved by 1 ranks at ZeRO stage 2; this run has 1 ranks at ZeRO stage 1"
    with pytest.raises(ckpt.CheckpointError, match=refused) as raised:
        engine.load_checkpoint(str(run_dir), "global_step5")
    assert engine.global_steps == 0  # refused before DeepSpeed loaded anything
    command = str(raised.value).split("\n")[1].split()
    assert command[:2] == ["ds-pseudo-real", "convert"]
    from ds_pseudo_real.cli import main

    assert main(command[1:]) == 0  # a real-stage checkpoint converts too
    converted = Path(command[command.index("--output") + 1]) / "global_step5"
    engine.load_checkpoint(None, str(converted))
    assert engine.global_steps == 5 and engine.stage == "real"
    assert torch.equal(logits(engine), expected)
    engine.engine.destroy()


def logits_at(folder, tag):
    engine, _ = resume(folder, tag)
    out = logits(engine)
    engine.engine.destroy()
    return out


def test_keep_last_keeps_the_newest_and_the_last_pseudo_checkpoint(tmp_path):
    engine = make(checkpoint={"keep_last": 2})
    for step in SAVED_AT:
        train(engine, step)
        engine.save_checkpoint(str(tmp_path))
    engine.engine.destroy()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step3", "global_step5", "global_step6"]
    assert ckpt.read_sidecar(str(tmp_path), "global_step3")["stage"] == "pseudo"


def test_a_fresh_run_never_replaces_another_runs_checkpoint_and_a_resumed_one_goes_on_as_that_run(tmp_path):
    first = make()
    train(first, 2)
    first.save_checkpoint(str(tmp_path))
    first.engine.destroy()
    saved = ckpt.read_sidecar(str(tmp_path), "global_step2")
    assert saved["run_id"] == first.run_id and saved["written_by"]["pid"] == os.getpid()
    second = make(seed=3)  # started over (--no-resume): another run
    train(second, 2)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(
            f"checkpoint {tmp_path / 'global_step2'} was not saved: {tmp_path / 'global_step2'} is a checkpoint "
            f"(step 2) of another run, {first.run_id} (written on host {socket.gethostname()} by pid {os.getpid()}")):
        second.save_checkpoint(str(tmp_path))
    assert ckpt.read_sidecar(str(tmp_path), "global_step2") == saved and verify(str(tmp_path), "global_step2").ok
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "latest", run_lock.LOCK_FILE, "zero_to_fp32.py",
                                            "zero_to_torch.py"]
    second.engine.destroy()
    resumed = make(seed=4)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.run_id == first.run_id
    resumed.save_checkpoint(str(tmp_path))  # its own run's checkpoint: replaced, as a resumed run redoes steps
    assert ckpt.read_sidecar(str(tmp_path), "global_step2")["run_id"] == first.run_id
    resumed.engine.destroy()


def mount_tmpfs(path: Path, size: int) -> None:
    options = f"size={size}" if not path.is_mount() else f"remount,size={size}"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"a small file system is needed to fill the disk for real; mount failed: {proc.stderr.strip()}")


def test_disk_full_names_the_file_and_the_last_good_checkpoint_and_the_next_save_succeeds(saved, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount_tmpfs(disk, 64 << 20)
    try:
        engine = make()
        train(engine, 2)
        engine.save_checkpoint(str(disk))
        one = sum(f.stat().st_size for f in (disk / "global_step2").rglob("*") if f.is_file())
        mount_tmpfs(disk, one * 3 // 2)  # room for half of the next checkpoint
        train(engine, 3)
        with pytest.raises(ckpt.CheckpointError) as raised:
            engine.save_checkpoint(str(disk))
        message = str(raised.value)
        assert "No space left on device" in message
        assert re.search(re.escape(str(disk)) + r"/global_step3\.[0-9a-f]{12}\.partial/", message)
        assert f"the last good checkpoint is {disk / 'global_step2'} (step 2)" in message
        assert sorted(p.name for p in disk.iterdir() if p.is_dir()) == ["global_step2"]  # the partial folder is gone
        mount_tmpfs(disk, 64 << 20)  # space freed
        engine.save_checkpoint(str(disk))
        assert verify(str(disk), "global_step3").ok
        engine.engine.destroy()
        engine, _ = resume(disk)
        assert engine.global_steps == 3 and train(engine, TOTAL) == saved[1][3:]
        engine.engine.destroy()
    finally:
        run_lock.release(str(disk))  # this process's lock file keeps the file system busy
        subprocess.run(["umount", str(disk)], check=False)


def test_a_write_failing_on_one_of_two_ranks_raises_on_both_and_the_run_goes_on(tmp_path):
    proc = run_two_ranks(Path(__file__).parent / "scripts" / "save_failure.py", str(tmp_path / "ckpt"))
    result = json.loads(proc.rank_stdouts[0].strip().splitlines()[-1])
    assert result["errors"][0] == result["errors"][1]  # the same error on both ranks, and no hang
    message = result["errors"][0]
    assert message.startswith(f"could not save checkpoint {tmp_path / 'ckpt' / 'global_step3'} (rank 1): OSError: "
                              f"[Errno 28] No space left on device: ")
    assert "optim_states.pt" in message
    assert f"the last good checkpoint is {tmp_path / 'ckpt' / 'global_step2'} (step 2)" in message
    assert not result["partial_left"] and result["latest"] == "global_step3"
    assert result["resumed_step"] == 3 and result["same_tail"]


def test_a_load_that_leaves_other_weights_is_refused_on_every_rank_before_training_on(saved, run_dir, monkeypatch):
    """The sidecar holds each rank's sums and sums of squares of the working weights, fp32 masters and moments it
    saved; a load after which they differ (DeepSpeed restoring nothing, or something else) stops with the folder
    named, instead of a run that goes on from another state. A load that restores them goes on as before (every
    resume test here)."""
    side = ckpt.read_sidecar(str(run_dir), "global_step5")
    resumed, _ = resume(run_dir, "global_step5")
    assert side["state"] == [ds_state.state_fingerprint(resumed.engine)]  # one rank's sums and sums of squares
    resumed.engine.destroy()
    engine = make(seed=123)
    deepspeed_load = type(engine.engine).load_checkpoint

    def loads_then_loses_a_weight(self, *args, **kwargs):
        loaded = deepspeed_load(self, *args, **kwargs)
        with torch.no_grad():
            next(self.module.parameters()).add_(1e-3)
        return loaded

    monkeypatch.setattr(type(engine.engine), "load_checkpoint", loads_then_loses_a_weight)
    with pytest.raises(ckpt.CheckpointError, match=r"DeepSpeed loaded checkpoint .*global_step5, but the weights of "
                                                   r"rank 0 are not the ones saved; on rank 0: weights sum and sum of "):
        engine.load_checkpoint(str(run_dir), "global_step5")
    engine.engine.destroy()
