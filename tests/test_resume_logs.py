"""A run killed between checkpoints and resumed logs what an uninterrupted run logs: DeepSpeed's CSV and TensorBoard
monitors and the main job's metrics.jsonl hold every step once, with the same values, one header per CSV file; what
the interrupted runs had logged after their checkpoint is kept aside in ``*.discarded`` files; one TensorBoard event
file per run, none left empty. On 1 and 2 ranks, killed (SIGKILL, every rank) in the pseudo stage after the delink it
resumes before, and in the real stage; on 1 rank in fp16 too, where DeepSpeed's monitors log the dynamic loss scale
of every step: the resumed run's is the uninterrupted run's, across the delink and both kills."""
import json
import os
import subprocess
import sys

import pytest

from conftest import CPU_FP16, REPO, free_port, python_path

STEPS, SWITCH, SAVE_INTERVAL = 12, 6, 4
KILLS = (7, 10)  # past the save at 4 and the delink at 6 (resumed in the pseudo stage); past the save at 8 (real)
DISCARDED = [5, 6, 7, 9, 10]  # the steps the killed runs logged after the checkpoint they are resumed from
WALL_TIME = "tokens_per_s"  # measured, so it differs from run to run
RUN = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", str(1 << 20),
       "--eval-interval", "4", "--eval-batches", "2", "--log-interval", "4", "--save-interval", str(SAVE_INTERVAL)]


# dynamic loss scaling from 2**8, doubled after every 2 steps without overflow: the scale changes all along
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}


def monitored_config(tmp_path, dtype="fp32"):
    cfg = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    if dtype == "fp16":
        cfg["fp16"] = FP16
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["scheduler"]["params"].update(total_num_steps=STEPS, warmup_num_steps=2)
    cfg["pseudo_to_real"]["switch"] = {"at_step": SWITCH}
    cfg["csv_monitor"] = {"enabled": True, "job_name": "job"}
    cfg["tensorboard"] = {"enabled": True, "job_name": "job"}
    path = tmp_path / "monitored.json"
    path.write_text(json.dumps(cfg))
    return path


def launch(ranks, config, out, kill_at=None):
    """The main job on ``ranks`` ranks (torchrun for 2); with ``kill_at``, every rank killed after that step."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=python_path(), OMP_NUM_THREADS="1", **CPU_FP16)
    script = REPO / "launch" / "train.py"
    if kill_at is not None:
        script = REPO / "tests" / "scripts" / "kill_at_step.py"
        env["KILL_AT_STEP"] = str(kill_at)
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    proc = subprocess.run([*launcher, str(script), "--deepspeed_config", str(config), "--output-dir", str(out), *RUN],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    if kill_at is None:
        assert proc.returncode == 0, output
    else:
        assert proc.returncode != 0, output
    return proc.stdout


@pytest.fixture(scope="module", params=[(1, "fp32"), (2, "fp32"), (1, "fp16")],
                ids=["1-rank", "2-ranks", "1-rank-fp16"])
def runs(request, tmp_path_factory):
    """(uninterrupted run folder, killed-twice-and-resumed run folder) on 1 or 2 ranks, fp32 or fp16."""
    (ranks, dtype), tmp = request.param, tmp_path_factory.mktemp(f"resume{request.param[0]}")
    config = monitored_config(tmp, dtype)
    whole, cut = tmp / "whole", tmp / "cut"
    launch(ranks, config, whole)
    for kill_at in KILLS:
        launch(ranks, config, cut, kill_at)
        assert json.loads((cut / "metrics.jsonl").read_text().splitlines()[-1])["step"] == kill_at
    log = launch(ranks, config, cut)
    assert f"at step {KILLS[1] // SAVE_INTERVAL * SAVE_INTERVAL} (real stage)" in log
    return whole, cut


def csv_files(run):
    return {path.name: path.read_text().splitlines() for path in (run / "csv_monitor" / "job").glob("*.csv")}


def test_csv_monitor_files_equal_the_uninterrupted_runs(runs, request):
    whole, cut = (csv_files(run) for run in runs)
    assert sorted(cut) == sorted(whole) and "Train_Samples_lr.csv" in whole  # DeepSpeed's own event too
    if request.node.callspec.id.endswith("fp16"):  # the loss scale of every step, grown across the delink
        scales = [float(line.split(",")[1]) for line in whole["Train_Samples_loss_scale.csv"][1:]]
        assert len(scales) == STEPS and scales[SWITCH] > scales[SWITCH - 2] and scales[-1] > scales[SWITCH], scales
    for name, lines in whole.items():
        if WALL_TIME in name:
            lines, cut[name] = ([line.split(",")[0] for line in rows] for rows in (lines, cut[name]))
        assert cut[name] == lines, name  # one header, every step once, the same values
    steps = [int(line.split(",")[0]) for line in whole["Train_Samples_train_loss.csv"][1:]]
    per_step = steps[0]
    assert steps == [per_step * s for s in range(1, STEPS + 1)]
    dropped = (runs[1] / "csv_monitor" / "job" / "Train_Samples_train_loss.csv.discarded").read_text().splitlines()
    assert [int(line.split(",")[0]) for line in dropped] == [per_step * s for s in DISCARDED]


def scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run / "tensorboard" / "job"))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def scalar_events_per_file(run):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [sum(1 for event in EventFileLoader(str(path)).Load() if event.HasField("summary"))
            for path in sorted((run / "tensorboard" / "job").glob("events.out.tfevents.*"))]


def test_tensorboard_scalars_equal_the_uninterrupted_runs_one_event_file_per_run(runs):
    pytest.importorskip("tensorboard", reason="the TensorBoard monitor needs tensorboard (the project's [monitor] extra)")
    whole, cut = (scalars(run) for run in runs)
    assert sorted(cut) == sorted(whole) and "Train/Samples/lr" in whole and "Train/Samples/delink" in whole
    for tag, events in whole.items():
        if WALL_TIME in tag:
            events, cut[tag] = ([step for step, _ in series] for series in (events, cut[tag]))
        assert cut[tag] == events, tag
    assert len(whole["Train/Samples/train_loss"]) == STEPS
    # one writer per run (the delink keeps the run's writer), and every file has scalars in it
    assert len(scalar_events_per_file(runs[0])) == 1
    per_file = scalar_events_per_file(runs[1])
    assert len(per_file) == len(KILLS) + 1 and all(per_file), per_file


def records(run, name="metrics.jsonl"):
    """The file's records as written (no resume logic applied), without the fields that measure time."""
    lines = (run / name).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "phases")} for line in lines]


def test_metrics_jsonl_equals_the_uninterrupted_runs(runs):
    whole, cut = (records(run) for run in runs)
    assert [r for r in cut if r.get("event") != "resume"] == whole
    assert [r["step"] for r in whole if "train_loss" in r] == list(range(1, STEPS + 1))
    assert [r for r in cut if r.get("event") == "resume"] == [{"event": "resume", "step": s} for s in (4, 8)]
    dropped = records(runs[1], "metrics.jsonl.discarded")
    assert [r["step"] for r in dropped if "train_loss" in r] == DISCARDED
    assert [r["step"] for r in dropped if r.get("event") == "delink"] == [SWITCH]
