"""Progressive delinking: a schedule of stages 1 -> 2 -> 4 parameter groups, each transition exact in process (the
loss on a fixed batch unchanged in fp32, the moments split per policy), checkpoints that record the stage and resume
exactly, and the schedule's errors."""
import math
import sys
from pathlib import Path

import pytest
import torch

import ds_pseudo_real
from ds_pseudo_real import ds_state
from ds_pseudo_real.config import ConfigError, parse_pseudo_to_real
from ds_pseudo_real.sharing import count_shared_groups
from ds_pseudo_real.stages import parameter_numel

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import BeforeDelink, eval_loss, fixed_batch, tiny_gpt  # noqa: E402

SCHEDULE = [{"groups": 1}, {"groups": 2, "at_step": 3}, {"at_step": 5}]


def config(stage=1, policy="scale", schedule=SCHEDULE):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "pseudo_to_real": {"layers": "layers", "schedule": schedule, "optimizer_state": policy},
    }


@pytest.mark.parametrize("section, message", [
    ({"schedule": [{"groups": 1}, {"at_step": 5}], "groups": 2}, "give either 'schedule' or ['groups'], not both"),
    ({"schedule": [{"groups": 1}]}, "give at least two stages"),
    ({"schedule": [{"groups": 1, "at_step": 2}, {"at_step": 5}]}, "schedule[0]: the first stage gives 'groups'"),
    ({"schedule": [{"groups": 1}, {"groups": 2}, {"at_step": 5}]}, "schedule[1]: give exactly one of at_step"),
    ({"schedule": [{"groups": 1}, {"at_step": 2}, {"groups": 4, "at_step": 5}]}, "only the last stage may omit"),
    ({"schedule": [{"groups": 1}, {"groups": 2, "at_step": 5}, {"at_step": 5}]},
     "schedule[2].at_step: got 5; it must come after the previous stage's 5"),
])
def test_schedule_shape_errors_name_the_key(section, message):
    with pytest.raises(ConfigError) as error:
        parse_pseudo_to_real({"pseudo_to_real": section})
    assert message in str(error.value)


def test_schedule_groups_must_divide_and_split():
    ptr = parse_pseudo_to_real({"pseudo_to_real": {"schedule": [{"groups": 2}, {"groups": 3, "at_step": 2},
                                                               {"at_step": 4}]}})
    with pytest.raises(ConfigError, match=r"schedule\[1\].groups: got 3; .*divide the number of layers \(4\)"):
        ptr.stage_groups(4)
    with pytest.raises(ConfigError, match=r"schedule\[1\].groups: got 3; each stage's groups must be a larger "
                                          r"multiple of the previous stage's \(2\)"):
        ptr.stage_groups(12)
    ok = parse_pseudo_to_real({"pseudo_to_real": {"schedule": SCHEDULE}})
    assert ok.stage_groups(4) == [1, 2, 4] and [t.at_step for t in ok.triggers] == [3, 5]
    legacy = parse_pseudo_to_real({"pseudo_to_real": {"groups": 2, "switch": {"at_step": 7}}})
    assert legacy.stage_groups(4) == [2, 4] and [t.at_step for t in legacy.triggers] == [7]


class Probe(BeforeDelink):
    """Before every transition: the loss on the probe batch and the moments of the probe layers."""

    def __init__(self, engine_ref, batch):
        super().__init__(engine_ref, batch)
        self.before = []

    def on_step_end(self, state, control):
        if control.should_delink:
            engine = self.engine_ref[0]
            named = dict(engine.module.named_parameters())
            moments = {name: ds_state.full_moments(engine.engine, named[name])
                       for name in ("layers.0.fc.weight", "layers.2.fc.weight") if name in named}
            self.before.append({"step": state.global_step, "loss": eval_loss(engine, self.batch),
                                "moments": moments, "groups": engine.groups})


def train(engine, steps, rank=0):
    batch = fixed_batch(1 + rank)
    losses = []
    while engine.global_steps < steps:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_progressive_schedule_is_exact_at_every_transition(stage):
    probe_batch = fixed_batch(99)
    ref = [None]
    probe = Probe(ref, probe_batch)
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(stage), callbacks=[probe])
    ref[0] = engine
    layer = sum(p.numel() for p in tiny_gpt().layers[0].parameters())
    rest = sum(p.numel() for p in tiny_gpt().parameters()) - 4 * layer
    seen = {}
    for _ in range(6):
        train(engine, engine.global_steps + 1)
        if engine.last_transition is not None and engine.last_transition["step"] not in seen:
            report = engine.last_transition
            named = dict(engine.module.named_parameters())
            seen[report["step"]] = {
                "loss": eval_loss(engine, probe_batch), "report": report,
                "groups": count_shared_groups(engine.module, "layers"),
                "numel": parameter_numel(engine.module),
                "moments": {name: ds_state.full_moments(engine.engine, named[name])
                            for name in ("layers.0.fc.weight", "layers.1.fc.weight", "layers.2.fc.weight",
                                         "layers.3.fc.weight") if name in named},
            }
    assert sorted(seen) == [3, 5] and [b["step"] for b in probe.before] == [3, 5]
    first, second = seen[3], seen[5]
    # 1 -> 2 groups at step 3, 2 -> 4 (the real model) at step 5, each with the loss unchanged, bit for bit.
    assert (first["report"]["groups_before"], first["report"]["groups_after"]) == (1, 2)
    assert (second["report"]["groups_before"], second["report"]["groups_after"]) == (2, 4)
    assert probe.before[0]["loss"] == first["loss"] and probe.before[1]["loss"] == second["loss"]
    assert first["groups"] == 2 and first["numel"] == rest + 2 * layer
    assert second["groups"] == 4 and second["numel"] == rest + 4 * layer
    assert engine.stage == "real" and engine.state.transitions_done == 2
    # Scale: a group of 2 layers of the shared set's 4 -> moments / 2 and / 4; then each of 2 -> / 2 and / 4.
    shared = probe.before[0]["moments"]["layers.0.fc.weight"]
    for name in ("layers.0.fc.weight", "layers.2.fc.weight"):
        assert torch.equal(first["moments"][name]["exp_avg"], shared["exp_avg"] / 2)
        assert torch.equal(first["moments"][name]["exp_avg_sq"], shared["exp_avg_sq"] / 4)
    for leader, members in (("layers.0.fc.weight", ("layers.0.fc.weight", "layers.1.fc.weight")),
                            ("layers.2.fc.weight", ("layers.2.fc.weight", "layers.3.fc.weight"))):
        pair = probe.before[1]["moments"][leader]
        for name in members:
            assert torch.equal(second["moments"][name]["exp_avg"], pair["exp_avg"] / 2)
            assert torch.equal(second["moments"][name]["exp_avg_sq"], pair["exp_avg_sq"] / 4)
    engine.engine.destroy()


def test_resume_in_a_middle_stage_is_exact(tmp_path):
    whole, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1))
    expected = train(whole, 7)
    whole.engine.destroy()

    first, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1))
    head = train(first, 4)
    assert first.groups == 2 and first.stage == "pseudo"
    first.save_checkpoint(str(tmp_path))
    first.engine.destroy()

    resumed, *_ = ds_pseudo_real.initialize(model=tiny_gpt(seed=5), config=config(1))
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.groups == 2 and resumed.global_steps == 4 and resumed.state.transitions_done == 1
    tail = train(resumed, 7)
    assert head + tail == expected and resumed.stage == "real" and resumed.last_transition["step"] == 5
    resumed.engine.destroy()


def test_a_checkpoint_of_a_stage_the_schedule_lacks_is_refused(tmp_path):
    first, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1))
    train(first, 4)
    first.save_checkpoint(str(tmp_path))
    first.engine.destroy()
    other, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(
        1, schedule=[{"groups": 1}, {"at_step": 3}]))
    with pytest.raises(ConfigError, match=r"has 2 parameter groups of 4 layers; this run's stages have \[1\]"):
        other.load_checkpoint(str(tmp_path))
    other.engine.destroy()


def test_main_job_runs_a_schedule_and_logs_each_transition(tmp_path):
    import json
    import os
    import subprocess

    from conftest import REPO, free_port, python_path
    from ds_pseudo_real.report import read_records

    cfg = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    cfg["scheduler"]["params"].update(total_num_steps=8, warmup_num_steps=2)
    cfg["pseudo_to_real"] = {"layers": "layers", "optimizer_state": "scale",
                             "schedule": [{"groups": 1}, {"groups": 2, "at_step": 3}, {"at_step": 6}]}
    (tmp_path / "job.json").write_text(json.dumps(cfg))
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--deepspeed_config",
                           str(tmp_path / "job.json"), "--output-dir", str(tmp_path / "run"), "--n-layer", "4",
                           "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", str(1 << 20),
                           "--eval-interval", "4", "--eval-batches", "1", "--log-interval", "1"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "switch in 2 steps" in proc.stdout and "switch in 1 steps" in proc.stdout  # to step 3, then to step 6
    assert "parameter groups 1 -> 2" in proc.stdout and "parameter groups 2 -> 4" in proc.stdout
    rows = read_records(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["groups_before"], r["groups_after"]) for r in rows if r.get("event") == "delink"] == [
        (3, 1, 2), (6, 2, 4)]
    assert [r["groups"] for r in rows if "train_loss" in r] == [1, 1, 1, 2, 2, 2, 4, 4]


def test_a_middle_stage_checkpoint_converts_in_its_stage_or_to_the_real_model(tmp_path):
    from ds_pseudo_real.checkpointing.convert import convert

    first, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(2))
    train(first, 4)
    probe = fixed_batch(99)
    expected = eval_loss(first, probe)
    first.save_checkpoint(str(tmp_path / "mid"))
    first.engine.destroy()
    convert(str(tmp_path / "mid"), str(tmp_path / "converted"))
    resumed, *_ = ds_pseudo_real.initialize(model=tiny_gpt(seed=3), config=config(2))
    resumed.load_checkpoint(str(tmp_path / "converted"))
    assert resumed.stage == "pseudo" and resumed.groups == 2 and resumed.global_steps == 4
    assert resumed.next_trigger.at_step == 5 and eval_loss(resumed, probe) == expected
    resumed.engine.destroy()
    out = convert(str(tmp_path / "mid"), str(tmp_path / "real"), to_real=True)
    weights = torch.load(out / "model_fp32.pt")
    for rest in ("fc.weight", "ln1.bias"):  # layers 0-1 from the first group's set, 2-3 from the second's
        assert torch.equal(weights[f"layers.0.{rest}"], weights[f"layers.1.{rest}"])
        assert torch.equal(weights[f"layers.2.{rest}"], weights[f"layers.3.{rest}"])
        assert not torch.equal(weights[f"layers.1.{rest}"], weights[f"layers.2.{rest}"])
    real, *_ = ds_pseudo_real.initialize(model=tiny_gpt(seed=3), config=config(1))
    real.load_checkpoint(str(tmp_path / "real"))
    assert real.stage == "real" and real.groups == 4 and real.global_steps == 4 and real.next_trigger is None
    assert eval_loss(real, probe) == expected
    real.engine.destroy()


GROW = [{"depth": 2}, {"at_step": 3}]


class Snapshot(BeforeDelink):
    """Before the growth: every parameter's fp32 value and the moments of layer 0's fc weight."""

    def on_step_end(self, state, control):
        if control.should_delink:
            engine = self.engine_ref[0]
            named = dict(engine.module.named_parameters())
            self.seen["weights"] = {n: ds_state.full_fp32_param(engine.engine, p) for n, p in named.items()}
            self.seen["moments"] = ds_state.full_moments(engine.engine, named["layers.0.fc.weight"])


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_shallow_model_grows_by_stacking_copies_of_itself(stage):
    ref = [None]
    snap = Snapshot(ref, fixed_batch(99))
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(stage, "copy", GROW), callbacks=[snap])
    ref[0] = engine
    layer = sum(p.numel() for p in tiny_gpt().layers[0].parameters())
    rest = sum(p.numel() for p in tiny_gpt().parameters()) - 4 * layer
    assert len(engine.module.layers) == 2 and parameter_numel(engine.module) == rest + 2 * layer
    shallow = train(engine, 3)
    report = engine.last_transition
    assert (report["step"], report["layers_before"], report["layers_after"]) == (3, 2, 4)
    assert engine.stage == "real" and len(engine.module.layers) == 4 and count_shared_groups(engine.module, "layers") == 4
    assert parameter_numel(engine.module) == rest + 4 * layer
    before = snap.seen["weights"]
    named = dict(engine.module.named_parameters())
    for name, param in named.items():  # G_stack's operator: layer i starts from layer i mod 2
        index = int(name.split(".")[1]) % 2 if name.startswith("layers.") else None
        source = name if index is None else "layers.{}.{}".format(index, name.split(".", 2)[2])
        assert torch.equal(ds_state.full_fp32_param(engine.engine, param), before[source]), name
    moments = ds_state.full_moments(engine.engine, named["layers.2.fc.weight"])
    assert all(torch.equal(moments[k], snap.seen["moments"][k]) for k in ("exp_avg", "exp_avg_sq"))
    # The grown model computes what a 4-layer GPT holding the stacked weights computes.
    stacked = tiny_gpt(seed=7)
    stacked.load_state_dict({n: before[n if not n.startswith("layers.") else "layers.{}.{}".format(
        int(n.split(".")[1]) % 2, n.split(".", 2)[2])] for n, _ in stacked.named_parameters()}, strict=False)
    stacked.eval()
    with torch.no_grad():
        expected = stacked(*fixed_batch(99)).item()
    assert eval_loss(engine, fixed_batch(99)) == expected
    assert len(shallow) == 3 and all(math.isfinite(loss) for loss in train(engine, 5))  # the grown model trains
    engine.engine.destroy()


def test_resume_in_the_shallow_stage_is_exact(tmp_path):
    whole, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1, "copy", GROW))
    expected = train(whole, 5)
    whole.engine.destroy()
    first, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1, "copy", GROW))
    head = train(first, 2)
    first.save_checkpoint(str(tmp_path))
    first.engine.destroy()
    resumed, *_ = ds_pseudo_real.initialize(model=tiny_gpt(seed=5), config=config(1, "copy", GROW))
    resumed.load_checkpoint(str(tmp_path))
    assert len(resumed.module.layers) == 2 and resumed.global_steps == 2
    assert head + train(resumed, 5) == expected and len(resumed.module.layers) == 4
    resumed.engine.destroy()


@pytest.mark.parametrize("schedule, message", [
    ([{"depth": 2, "groups": 1}, {"at_step": 3}], "schedule[0]: the first stage gives 'groups' (or 'depth'"),
    ([{"depth": 2}, {"groups": 2, "at_step": 3}, {"at_step": 5}], "a shallow first stage ('depth') grows into the real"),
    ([{"groups": 1}, {"depth": 2, "at_step": 3}], "schedule[1].depth: only the first stage may be shallow"),
])
def test_shallow_schedule_errors(schedule, message):
    with pytest.raises(ConfigError) as error:
        parse_pseudo_to_real({"pseudo_to_real": {"schedule": schedule}})
    assert message in str(error.value)


def test_a_depth_that_does_not_stack_into_the_model_is_refused():
    ptr = parse_pseudo_to_real({"pseudo_to_real": {"schedule": [{"depth": 3}, {"at_step": 3}]}})
    with pytest.raises(ConfigError, match=r"schedule\[0\].depth: got 3; .*accepted values \[1, 2\]"):
        ptr.stages(4)
    assert ptr.stages(6) == [(3, 3), (6, 6)]


def test_delink_noise_breaks_the_symmetry_of_the_copies_the_same_way_every_time():
    cfg = config(1, "copy", [{"groups": 1}, {"at_step": 2}])
    cfg["pseudo_to_real"]["delink_noise"] = 0.01
    runs = []
    for _ in range(2):
        engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
        train(engine, 2)
        named = dict(engine.module.named_parameters())
        runs.append({n: ds_state.full_fp32_param(engine.engine, p) for n, p in named.items()})
        engine.engine.destroy()
    first, second = runs
    assert all(torch.equal(first[n], second[n]) for n in first)  # the noise is keyed by name, not by chance
    shared = first["layers.0.fc.weight"]
    for layer in (1, 2, 3):
        copy = first[f"layers.{layer}.fc.weight"]
        relative = float((copy - shared).std() / shared.std())
        assert 0.005 < relative < 0.02, (layer, relative)  # 0.01 x the shared tensor's spread
    assert not torch.equal(first["layers.1.fc.weight"], first["layers.2.fc.weight"])
    with pytest.raises(ConfigError, match="delink_noise"):
        parse_pseudo_to_real({"pseudo_to_real": {"delink_noise": -1}})
