"""In-process delink with DeepSpeed: the loss is continuous across the switch for ZeRO 0-3, fp32, bf16 and fp16
(dynamic loss scaling), on 1, 2 and 3 gloo ranks; the fp32 masters, the optimizer-state policy and the loss scaler are
carried exactly and the Adam step count continues."""
import json
import re
import sys
from pathlib import Path

import deepspeed
import pytest
import torch

import ds_pseudo_real
from conftest import CPU_FP16, run_two_ranks
from ds_pseudo_real import ds_state
from ds_pseudo_real.callbacks import TrainingCallback

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import delink_matrix  # noqa: E402

check = delink_matrix.check


@pytest.mark.parametrize("case", delink_matrix.matrix(), ids=lambda c: "-".join(map(str, c)))
def test_delink_single_rank(case, request):
    if case[1] == "fp16":
        request.getfixturevalue("cpu_fp16")
    check(delink_matrix.run_case(*case))


def test_delink_reset_policy_starts_fresh_moments():
    result = delink_matrix.run_case(1, "fp32", "reset")
    assert result["pre"] == result["post"]
    assert result["moments_ok"] and result["adam_step"] is None


@pytest.mark.parametrize("policy", ["copy", "scale"])
def test_delink_continues_the_step_count_of_deepspeeds_fused_adam(policy):
    """DeepSpeed's FusedAdam (its "AdamW" without ``torch_adam``) counts steps in the state of the last parameter of
    each group it steps. At ZeRO 0 it steps the model's parameters one by one, so the first state's count says 0:
    read from there, the real model's first step ran with step-1 bias correction on the carried moments. The run
    must train as under ZeRO 1, where one flat tensor per group holds the count: the same losses, bit for bit."""
    zero0, zero1 = (delink_matrix.run_case(stage, "fp32", policy, torch_adam=False) for stage in (0, 1))
    assert zero0["optimizer"] == zero1["optimizer"] == "FusedAdam"
    assert zero0["pseudo_adam_step"] == zero1["pseudo_adam_step"] == delink_matrix.SWITCH
    check(zero0)
    check(zero1)
    assert zero0["losses"] == zero1["losses"]


def test_delink_two_ranks():
    """Each rank holds part of every flat partition: the moments the delink leaves unfilled (NaN here) are written
    or zeroed on both, partition boundaries and the last rank's padding included."""
    proc = run_two_ranks(Path(__file__).parent / "scripts" / "delink_matrix.py", "--poison-unfilled", timeout=900,
                         env_extra=CPU_FP16)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(delink_matrix.matrix())
    for result in results:
        check(result)


def test_delink_three_ranks():
    """On 3 ranks every parameter's element count leaves the last partitions padded (ZeRO 1-3): each case of the
    matrix is checked on every rank (``--check``: the exit status says whether one failed)."""
    proc = run_two_ranks(Path(__file__).parent / "scripts" / "delink_matrix.py", "--poison-unfilled", "--check",
                         timeout=900, ranks=3, env_extra=CPU_FP16)
    passed = set(re.findall(r"rank (\d) ok: (\([^)]*\))", proc.stdout))  # the ranks' lines may interleave
    assert passed == {(str(rank), str(case)) for rank in range(3) for case in delink_matrix.matrix()}


@pytest.mark.parametrize("stage, dtype", [(1, "bf16"), (2, "bf16"), (2, "fp32")])
def test_delink_builds_the_real_model_in_the_working_dtype(stage, dtype, monkeypatch):
    """ZeRO 1/2: every rank builds the whole real model before DeepSpeed takes it, in the dtype it trains in, so that
    in bf16 the host never holds the real model in fp32 (half the bytes)."""
    handed = []
    initialize = deepspeed.initialize

    def recording(*args, model, **kwargs):
        handed.append({(p.dtype, p.device.type) for p in model.parameters()})
        return initialize(*args, model=model, **kwargs)

    monkeypatch.setattr(deepspeed, "initialize", recording)
    result = delink_matrix.run_case(stage, dtype, "copy")
    check(result)
    assert len(handed) == 2  # the pseudo model as given, then the real model the delink built
    assert handed[1] == {(torch.bfloat16 if dtype == "bf16" else torch.float32, "cpu")}  # where it trains, here


class Poison(TrainingCallback):
    """An inf in the gradient of the pseudo model's shared ``param`` at the optimizer step ``at`` (1-based): an
    overflow in fp16, which DeepSpeed skips."""

    def __init__(self, param, at):
        self.step = 0
        param.register_hook(lambda grad: torch.full_like(grad, float("inf")) if self.step + 1 == at else grad)

    def on_step_end(self, state, control):
        self.step = state.global_step


def fp16_run(stage, checkpoints=None, resume_from=None, poison_at=None):
    """The delink matrix's fp16 model at ZeRO ``stage``, its loss scale halved at every overflow (hysteresis 1),
    trained to step 6 with the trigger at step 3; ``checkpoints``: saved there after steps 3 and 5; ``resume_from``:
    (folder, tag) loaded first. Returns, per step trained, the loss, the stage after it, the skipped-step count and
    the loss scaler's state, and the step the delink happened at."""
    config = delink_matrix.config(stage, "fp16", "copy")
    config["fp16"] = dict(config["fp16"], hysteresis=1)
    model = delink_matrix.odd_gpt()
    callbacks = [Poison(model.layers[0].fc.weight, poison_at)] if poison_at else []
    engine, *_ = ds_pseudo_real.initialize(model=model, config=config, callbacks=callbacks)
    if resume_from is not None:
        engine.load_checkpoint(*resume_from)
    steps = []
    while engine.global_steps < 6:
        loss = engine(*delink_matrix.fixed_batch(engine.global_steps))
        engine.backward(loss)
        engine.step()
        steps.append({"step": engine.global_steps, "loss": loss.item(), "stage": engine.stage,
                      "skipped": engine.skipped_steps, "scaler": ds_state.loss_scaler_state(engine.engine)})
        if checkpoints is not None and engine.global_steps in (3, 5):
            engine.save_checkpoint(str(checkpoints), tag=f"step{engine.global_steps}")
    switched = engine.last_transition["step"] if engine.last_transition else None
    engine.engine.destroy()
    return steps, switched


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_delink_waits_past_a_skipped_switch_step_and_resumes_exactly(stage, cpu_fp16, tmp_path):
    """fp16 with dynamic loss scaling, the trigger at step 3 and an inf in the shared set's gradient at step 3:
    DeepSpeed skips the step and halves the scale; the delink does not start the real model from that step's
    (unchanged) weights but waits for step 4, which DeepSpeed applies; the skipped step and the scale go on in the
    real engine. Checkpoints saved in either stage (after the skipped step 3, with the delink pending; after step 5,
    real) resume in a new engine to the same losses and loss scaler states, step by step."""
    steps, switched = fp16_run(stage, tmp_path, poison_at=3)
    by_step = {s["step"]: s for s in steps}
    assert [s["skipped"] for s in steps] == [0, 0, 1, 1, 1, 1]
    assert by_step[3]["stage"] == "pseudo" and by_step[4]["stage"] == "real" and switched == 4
    scales = [s["scaler"]["cur_scale"] for s in steps]
    # 2**8; at step 3 the end of the first growth window (2 steps), but an overflow: halved instead of doubled;
    # after it, doubled every 2 steps without overflow: at step 6, across the delink
    assert scales == [2**8, 2**8, 2**7, 2**7, 2**7, 2**8], scales
    assert by_step[3]["scaler"]["last_overflow_iter"] == by_step[6]["scaler"]["last_overflow_iter"] == 2
    for tag, first in (("step3", 4), ("step5", 6)):
        resumed, resumed_switch = fp16_run(stage, resume_from=(str(tmp_path), tag))
        assert resumed == steps[first - 1:], tag
        assert resumed_switch == (4 if tag == "step3" else None), tag
