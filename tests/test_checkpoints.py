"""Checkpoints across stages: exact resume before, at and right after the switch; atomic writes; the offline
pseudo -> real converter loading on another ZeRO stage and rank count with the pseudo model's logits."""
import json
import sys
from pathlib import Path

import pytest
import torch

import ds_pseudo_real
from ds_pseudo_real.checkpointing import folders as ckpt
from ds_pseudo_real.checkpointing import lock as run_lock
from ds_pseudo_real.checkpointing.convert import convert
from ds_pseudo_real.stages import parameter_numel
from conftest import run_two_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import config, fixed_batch, tiny_gpt  # noqa: E402

TOTAL, SWITCH = 8, 4


def batch_for(step):
    return fixed_batch(100 + step)


def train(engine, until):
    losses = []
    while engine.global_steps < until:
        step = engine.global_steps
        loss = engine(*batch_for(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def make(stage=2, policy="copy", seed=0, dtype="fp32", offload=None, checkpoint=None):
    cfg = config(stage, dtype, policy, switch=SWITCH)
    if checkpoint is not None:
        cfg["checkpoint"] = checkpoint
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 3e-3}}
    if offload is not None:
        cfg["granular_offload"] = offload
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(seed), config=cfg)
    return engine


@pytest.fixture(scope="module")
def uninterrupted():
    engine = make()
    losses = train(engine, TOTAL)
    assert engine.stage == "real" and engine.state.switch_step == SWITCH
    engine.engine.destroy()
    return losses


@pytest.mark.parametrize("stop_at", [SWITCH - 1, SWITCH, SWITCH + 1], ids=["before", "at", "after"])
def test_resume_reproduces_the_uninterrupted_losses(tmp_path, uninterrupted, stop_at):
    first = make()
    head = train(first, stop_at)
    first.save_checkpoint(str(tmp_path))
    saved_stage = first.stage
    first.engine.destroy()
    assert ckpt.read_sidecar(str(tmp_path), f"global_step{stop_at}")["stage"] == saved_stage
    assert saved_stage == ("pseudo" if stop_at < SWITCH else "real")

    second = make(seed=123)  # different initial weights: everything must come from the checkpoint
    path, _ = second.load_checkpoint(str(tmp_path))
    assert path is not None and second.global_steps == stop_at and second.stage == saved_stage
    tail = train(second, TOTAL)
    assert second.stage == "real" and second.state.switch_step == SWITCH
    assert head + tail == uninterrupted
    second.engine.destroy()


def fp32_masters(engine):
    return {name: ds_pseudo_real.ds_state.full_fp32_param(engine.engine, p) for name, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("offload", [None, {"levels": ["host_optimizer", "device", "host_optimizer", "host_params"]}],
                         ids=["plain", "granular_offload"])
def test_bf16_steps_after_the_delink_equal_a_resume_from_a_checkpoint_saved_there(tmp_path, stage, offload):
    """bf16 ZeRO 1/2: the delink writes the pseudo model's fp32 masters into the real engine after building it,
    which every copy the optimizer steps from (DeepSpeed's fp32 partition, the offload's host masters) follows:
    the steps after it equal those of a run resumed from a checkpoint saved right after the delink."""
    engine = make(stage=stage, dtype="bf16", offload=offload)
    train(engine, SWITCH)
    assert engine.stage == "real"
    engine.save_checkpoint(str(tmp_path), tag="delinked")
    continued = train(engine, TOTAL)
    continued_masters = fp32_masters(engine)
    engine.engine.destroy()

    resumed = make(stage=stage, dtype="bf16", offload=offload, seed=123)
    resumed.load_checkpoint(str(tmp_path), tag="delinked")
    assert train(resumed, TOTAL) == continued
    resumed_masters = fp32_masters(resumed)
    assert all(torch.equal(resumed_masters[name], value) for name, value in continued_masters.items())
    resumed.engine.destroy()


def test_failed_publish_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    engine = make()
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    train(engine, 3)

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "global_step3.partial" / "manifest.json"))

    monkeypatch.setattr(ckpt, "publish", crash)
    with pytest.raises(ckpt.CheckpointError, match="No space left on device") as raised:
        engine.save_checkpoint(str(tmp_path))
    monkeypatch.undo()
    assert f"the last good checkpoint is {tmp_path / 'global_step2'} (step 2)" in str(raised.value)
    assert not list(tmp_path.glob("*.partial"))  # removed, never named
    assert ckpt.latest_tag(str(tmp_path)) == "global_step2"
    engine.save_checkpoint(str(tmp_path))  # the run's state is intact: the next save succeeds
    assert ckpt.latest_tag(str(tmp_path)) == "global_step3"
    engine.engine.destroy()
    resumed = make(seed=5)
    path, _ = resumed.load_checkpoint(str(tmp_path))
    assert "/global_step3/" in path and resumed.global_steps == 3
    resumed.engine.destroy()


def logits(engine):
    engine.eval()
    with torch.no_grad():
        out = engine(fixed_batch(7)[0]).float()
    engine.train()
    return out


@pytest.mark.parametrize("target_stage", [0, 3])
def test_converted_checkpoint_gives_the_pseudo_logits_on_another_zero_stage(tmp_path, target_stage):
    pseudo = make(stage=2)
    train(pseudo, SWITCH - 1)
    expected = logits(pseudo)
    pseudo.save_checkpoint(str(tmp_path / "pseudo"))
    pseudo.engine.destroy()
    out = convert(str(tmp_path / "pseudo"), str(tmp_path / "real"), to_real=True)
    assert json.loads((out / ckpt.SIDECAR).read_text())["kind"] == "converted"

    real = make(stage=target_stage, seed=9)
    real.load_checkpoint(str(tmp_path / "real"))
    assert real.stage == "real" and real.global_steps == SWITCH - 1
    assert parameter_numel(real.module) == sum(p.numel() for p in tiny_gpt().parameters())
    assert torch.equal(logits(real), expected)
    # The LR schedule position is carried: WarmupLR at step 3 of 5.
    assert real.optimizer.param_groups[0]["lr"] == pytest.approx(pseudo_lr_at(SWITCH - 1))
    train(real, SWITCH + 1)
    real.engine.destroy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_converted_checkpoint_carries_host_params_groups(tmp_path, dtype):
    """ZeRO 2 with the pseudo model's shared set at host_params, stepped outside DeepSpeed's optimizer (so
    DeepSpeed's own consolidation does not see it): the converter takes its fp32 master from the offload
    optimizer's state; the real model loads them as its fp32 masters, and in fp32 gives the pseudo model's logits."""
    pseudo = make(stage=2, dtype=dtype, offload={"levels": {"0": "host_params"}})
    offload = ds_pseudo_real.ds_state.basic_optimizer(pseudo.engine)
    assert [g["placement"] for g in offload.own_param_groups] == ["layer0"]
    train(pseudo, SWITCH - 1)
    expected = logits(pseudo)
    masters = {name: offload.fp32_master(p).clone() for name, p in pseudo.module.named_parameters()
               if name.startswith("layers.0.")}
    pseudo.save_checkpoint(str(tmp_path / "pseudo"))
    pseudo.engine.destroy()
    out = convert(str(tmp_path / "pseudo"), str(tmp_path / "real"), to_real=True)
    weights = torch.load(out / "model_fp32.pt")
    for name, master in masters.items():
        for layer in range(4):  # expanded to every layer of the real model
            assert torch.equal(weights[name.replace("layers.0.", f"layers.{layer}.")], master), name
    real = make(stage=1, seed=9, dtype=dtype)
    real.load_checkpoint(str(tmp_path / "real"))
    if dtype == "fp32":
        assert torch.equal(logits(real), expected)
    loaded = fp32_masters(real)  # bf16 too: the fp32 masters are the converted weights, not their bf16 rounding
    assert all(torch.equal(value, weights[name]) for name, value in loaded.items())
    real.engine.destroy()


@pytest.mark.parametrize("source, target", [(1, 3), (3, 2)])
def test_converted_fp16_checkpoint_carries_the_loss_scaler(tmp_path, source, target, cpu_fp16):
    """fp16 with dynamic loss scaling: the converter takes the scaler's state from the checkpoint (rank 0's ZeRO
    optimizer states) and the run it is loaded into goes on with it, on another ZeRO stage."""
    pseudo = make(stage=source, dtype="fp16")
    train(pseudo, SWITCH - 1)
    saved = ds_pseudo_real.ds_state.loss_scaler_state(pseudo.engine)
    assert saved["cur_scale"] == 2**9 and saved["cur_iter"] == SWITCH - 1  # grown once from 2**8 (window 2)
    pseudo.save_checkpoint(str(tmp_path / "pseudo"))
    pseudo.engine.destroy()
    convert(str(tmp_path / "pseudo"), str(tmp_path / "real"), to_real=True)
    real = make(stage=target, seed=9, dtype="fp16")
    fresh = ds_pseudo_real.ds_state.loss_scaler_state(real.engine)
    real.load_checkpoint(str(tmp_path / "real"))
    loaded = ds_pseudo_real.ds_state.loss_scaler_state(real.engine)
    assert loaded == saved and loaded != fresh
    real.engine.destroy()


def pseudo_lr_at(step):
    engine = make(stage=1)
    train(engine, step)
    lr = engine.optimizer.param_groups[0]["lr"]
    engine.engine.destroy()
    return lr


def test_two_rank_pseudo_checkpoint_converts_and_loads_on_one_rank(tmp_path):
    script = Path(__file__).parent / "scripts" / "save_pseudo.py"
    proc = run_two_ranks(script, str(tmp_path / "pseudo"), str(tmp_path / "logits.pt"))
    assert "saved" in proc.stdout
    # Resuming it as it is on 1 rank is refused before DeepSpeed reads anything, with the command that converts it.
    same_stage = make(stage=3, seed=4)
    with pytest.raises(ckpt.CheckpointError, match="saved by 2 ranks at ZeRO stage 3; this run has 1 ranks") as raised:
        same_stage.load_checkpoint(str(tmp_path / "pseudo"))
    command = f"ds-pseudo-real convert --input {tmp_path / 'pseudo'} --tag global_step3 --output {tmp_path / 'pseudo'}_converted"
    assert command in str(raised.value) and same_stage.global_steps == 0
    same_stage.engine.destroy()
    convert(str(tmp_path / "pseudo"), str(tmp_path / "converted"))  # the shared set, consolidated from ZeRO-3
    resumed = make(stage=1, seed=4)
    resumed.load_checkpoint(str(tmp_path / "converted"))
    assert resumed.stage == "pseudo" and resumed.global_steps == 3
    assert torch.equal(logits(resumed), torch.load(tmp_path / "logits.pt"))
    resumed.engine.destroy()


def test_a_pseudo_checkpoint_converted_for_two_ranks_resumes_in_the_pseudo_stage_and_delinks_where_configured(tmp_path):
    """Saved in the pseudo stage at step 2 on 1 rank (ZeRO 2, the switch configured at step 4); on 2 ranks it is
    refused with the convert command, whose output resumes in the pseudo stage with the saved weights and LR, and
    delinks at step 4 as configured."""
    pseudo = make(stage=2)
    train(pseudo, 2)
    expected, lr = logits(pseudo).tolist(), pseudo.optimizer.param_groups[0]["lr"]
    pseudo.save_checkpoint(str(tmp_path / "pseudo"))
    pseudo.engine.destroy()
    run_lock.release(str(tmp_path / "pseudo"))  # as when the run that saved it ends
    out = convert(str(tmp_path / "pseudo"), str(tmp_path / "pseudo_converted"))
    assert json.loads((out / ckpt.SIDECAR).read_text())["stage"] == "pseudo"
    proc = run_two_ranks(Path(__file__).parent / "scripts" / "resume_converted.py", str(tmp_path / "pseudo"),
                         str(tmp_path / "pseudo_converted"))
    result = json.loads(proc.rank_stdouts[0].strip().splitlines()[-1])
    assert (f"ds-pseudo-real convert --input {tmp_path / 'pseudo'} --tag global_step2 --output "
            f"{tmp_path / 'pseudo'}_converted\n") in result["refusal"]
    assert "its stage (a pseudo-stage one goes on in the pseudo stage and delinks where configured)" in result["refusal"]
    for rank in result["ranks"]:
        assert rank["loaded"] == {"stage": "pseudo", "step": 2, "logits": expected, "lr": lr}
        assert rank["stages"] == ["pseudo", "pseudo", "real", "real", "real", "real"]  # steps 3 to 8
        assert rank["switch_step"] == SWITCH and rank["delinked_at"] == SWITCH


def test_cli_convert(tmp_path):
    from ds_pseudo_real.cli import main

    pseudo = make(stage=1)
    train(pseudo, 2)
    pseudo.save_checkpoint(str(tmp_path / "p"))
    pseudo.engine.destroy()
    assert main(["convert", "--input", str(tmp_path / "p"), "--output", str(tmp_path / "r")]) == 0
    assert ckpt.latest_tag(str(tmp_path / "r")) == "global_step2"
    with pytest.raises(ValueError, match="already a converted checkpoint"):
        convert(str(tmp_path / "r"), str(tmp_path / "again"))
