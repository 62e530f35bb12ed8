"""Delink on every ZeRO stage and dtype: loss on a fixed batch right before and after, moments carried, the fp32
masters carried exactly (bf16 and fp16 included), Adam step counter, the loss scaler (fp16: its scale each step as
DeepSpeed's own scaler gives it), the real model built where the engine trains (and the pseudo state gathered on the
host). fp16 on the CPU needs DeepSpeed's CPU accelerator to report it (tests/site/cpu_fp16.py). Imported by the single-rank test; run under torchrun for 2 ranks (prints JSON
lines on rank 0), or with ``--check`` (the GPU check: each case checked on every rank, exit status 1 if one
fails); ``--stages 1,3`` runs those ZeRO stages only."""
import json
import os
import sys

import torch
import torch.distributed as dist

import ds_pseudo_real
from ds_pseudo_real import ds_state
from ds_pseudo_real.callbacks import TrainingCallback
from ds_pseudo_real.models import GPT, GPTConfig
from ds_pseudo_real.sharing import source_parameter
from ds_pseudo_real.stages import parameter_numel

SWITCH = 3
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
PROBE = "layers.{}.fc.weight"


def config(stage, dtype, policy, switch=SWITCH, torch_adam=True):
    """``torch_adam`` False: DeepSpeed's own choice for "AdamW" (its FusedAdam, on the CPU accelerator too)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": torch_adam}},
        "zero_optimization": {"stage": stage},
        "pseudo_to_real": {"layers": "layers", "groups": 1, "switch": {"at_step": switch}, "optimizer_state": policy},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # dynamic loss scaling from 2**8, doubled after every 2 steps without overflow
        cfg["fp16"] = FP16
    return cfg


def tiny_gpt(seed=0, layers=4):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=layers, d_model=32, n_head=2, seq_len=16))


def odd_gpt(seed=0):
    """tiny_gpt with a parameter of 7 elements in every layer and one of 3 outside them (in no forward): counts that
    no data-parallel size above 1 divides, so that ZeRO pads the last rank's partition of them."""
    model = tiny_gpt(seed)
    for layer in model.layers:
        layer.register_parameter("odd", torch.nn.Parameter(torch.randn(7)))
    model.register_parameter("odd", torch.nn.Parameter(torch.randn(3)))
    return model


def fixed_batch(seed):
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(seed))
    return x, x.roll(-1, 1)


def train_until(engine, until, batch_seed):
    """Step ``engine`` on ``fixed_batch(batch_seed(step))`` until its global step is ``until``; the losses."""
    losses = []
    while engine.global_steps < until:
        loss = engine(*fixed_batch(batch_seed(engine.global_steps)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def on_device(engine, batch):
    """``batch`` where the engine's model is (DeepSpeed leaves the inputs where they are)."""
    return tuple(t.to(engine.device) for t in batch)


def device_peak(engine, reset=False):
    """The accelerator's peak allocated bytes since the last reset (then reset it), None off CUDA."""
    device = torch.device(engine.device)
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def eval_loss(engine, batch):
    engine.eval()
    with torch.no_grad():
        loss = engine(*on_device(engine, batch)).float().item()
    engine.train()
    return loss


class BeforeDelink(TrainingCallback):
    """Runs after the trigger fired and before the controller delinks: the pseudo engine is still live.
    ``masters``: also record every parameter's full fp32 master (a collective under ZeRO-3)."""

    def __init__(self, engine_ref, probe_batch, masters=False):
        self.engine_ref, self.batch, self.seen, self.masters = engine_ref, probe_batch, {}, masters

    def on_step_end(self, state, control):
        if control.should_delink:
            engine = self.engine_ref[0]
            self.seen["loss"] = eval_loss(engine, self.batch)
            param = dict(engine.module.named_parameters()).get(PROBE.format(0))
            if param is not None:
                self.seen["moments"] = ds_state.full_moments(engine.engine, param)
            step = ds_state.step_counters(engine.engine)["state_step"]
            self.seen["adam_step"] = None if step is None else float(step)
            self.seen["scaler"] = ds_state.loss_scaler_state(engine.engine)
            if self.masters:
                self.seen["masters"] = {name: ds_state.full_fp32_param(engine.engine, p)
                                        for name, p in engine.module.named_parameters()}
            device_peak(engine, reset=True)  # from here to the end of engine.step(): the delink's device peak


def nan_filled(shape, device, pin_memory=False):
    """``ds_state.moments.unfilled`` poisoned: the memory the delink leaves unfilled is NaN, so an element it never
    writes shows."""
    return torch.full(torch.Size([shape]) if isinstance(shape, int) else shape, float("nan"), device=device)


def masters_carried(engine, pseudo_masters):
    """Names of the real model's parameters whose fp32 master is not, bit for bit, its source's pseudo master."""
    old, new = (engine.num_layers, 1), (engine.num_layers, engine.num_layers)
    return [name for name, p in engine.module.named_parameters()
            if not torch.equal(ds_state.full_fp32_param(engine.engine, p),
                               pseudo_masters[source_parameter(name, engine.layer_path, old, new)[0]])]


def run_case(stage, dtype, policy, torch_adam=True):
    rank = dist.get_rank() if dist.is_initialized() else 0
    probe = fixed_batch(99)
    ref = [None]
    before = BeforeDelink(ref, probe, masters=True)
    engine, *_ = ds_pseudo_real.initialize(model=odd_gpt(), config=config(stage, dtype, policy, torch_adam=torch_adam),
                                            callbacks=[before])
    ref[0] = engine
    train = on_device(engine, fixed_batch(1 + rank))
    losses, scalers, skipped = [], [], []
    for _ in range(SWITCH + 3):
        loss = engine(*train)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        scalers.append(ds_state.loss_scaler_state(engine.engine))
        skipped.append(engine.skipped_steps)
        if engine.global_steps == SWITCH:
            delink_peak = device_peak(engine, reset=True)
            scaler_post = scalers[-1]
            post = eval_loss(engine, probe)
            masters_differ = masters_carried(engine, before.seen["masters"])
            last = dict(engine.module.named_parameters())[PROBE.format(3)]
            moments = ds_state.full_moments(engine.engine, last)
            step = ds_state.step_counters(engine.engine)["state_step"]
            expected = before.seen["moments"]
            if policy == "scale":
                expected = {"exp_avg": expected["exp_avg"] / 4, "exp_avg_sq": expected["exp_avg_sq"] / 16}
            moments_ok = (moments is None) if policy == "reset" else all(
                torch.equal(moments[k], expected[k]) for k in expected
            )
            # every element of every moment this rank holds is written or zeroed: its padding too
            states = [ds_state.optimizer_state(engine.engine, t) for _, t in ds_state.stepped_tensors(engine.engine)]
            moments_written = not any(state[k].isnan().any() for state in states for k in ds_state.MOMENT_KEYS
                                      if k in state)
    result = {
        "stage": stage, "dtype": dtype, "policy": policy, "pre": before.seen["loss"], "post": post,
        "moments_ok": moments_ok, "moments_written": moments_written, "masters_differ": masters_differ, "adam_step": None if step is None else float(step), "pseudo_adam_step": before.seen["adam_step"],
        "global_steps": engine.global_steps, "final_stage": engine.stage, "losses": losses,
        # the loss scaler's state before and right after the delink, after every step, and the skipped steps so far
        "scaler_pre": before.seen["scaler"], "scaler_post": scaler_post, "scalers": scalers, "skipped": skipped,
        "optimizer": type(ds_state.basic_optimizer(engine.engine)).__name__,
        "params_after": parameter_numel(engine.module),
        # where the real model's parameters (this rank's ZeRO-3 partitions) are, and where the engine trains
        "devices": sorted({getattr(p, "ds_tensor", p).device.type for p in engine.module.parameters()}),
        "engine_device": torch.device(engine.device).type,
        # where the gathered pseudo state waited: the host, whatever the engine's device
        "gathered_device": torch.device(engine.last_transition["gathered"]["device"]).type,
        # on CUDA: the device's peak allocated bytes during the delink and during the real steps after it (recorded,
        # not checked: DeepSpeed's engine build has transients of its own)
        "device_peak_bytes": {"delink": delink_peak, "real_steps": device_peak(engine)},
    }
    engine.engine.destroy()
    return result


def check(result):
    """Raise AssertionError naming the case when ``result`` breaks what the delink promises."""
    tag = f"ZeRO-{result['stage']} {result['dtype']} {result['policy']}"
    if result["dtype"] in ("fp32", "fp16"):  # fp16: the real layers' working weights are their set's
        assert result["pre"] == result["post"], f"{tag}: loss changed across the delink {result['pre']} -> {result['post']}"
    else:
        assert abs(result["pre"] - result["post"]) <= 2**-7 * abs(result["pre"]), f"{tag}: {result}"
    assert result["moments_ok"], f"{tag}: optimizer state not carried per policy"
    assert result["moments_written"], f"{tag}: moments left unwritten (NaN where the memory was poisoned)"
    # The real model's fp32 masters are the pseudo masters, not their rounding to the working dtype.
    assert not result["masters_differ"], f"{tag}: fp32 masters not carried exactly: {result['masters_differ'][:3]}"
    # The step counter continues from the pseudo optimizer's (bias correction unchanged); reset starts over.
    assert result["adam_step"] == (None if result["policy"] == "reset" else result["pseudo_adam_step"]), tag
    assert result["pseudo_adam_step"] is not None and result["pseudo_adam_step"] >= SWITCH, tag
    assert result["final_stage"] == "real" and result["global_steps"] == SWITCH + 3, tag
    expected_params = sum(p.numel() for p in odd_gpt().parameters())
    assert result["params_after"] == expected_params, tag
    assert result["devices"] == [result["engine_device"]], f"{tag}: real model on {result['devices']}"
    assert result["gathered_device"] == "cpu", f"{tag}: pseudo state gathered on {result['gathered_device']}"
    # the loss scaler goes on across the delink: in fp16 the scale each step equals what DeepSpeed's own dynamic
    # scaler gives for the run's overflows (none here: it doubles every 2 steps, once after the switch)
    assert result["scaler_post"] == result["scaler_pre"], f"{tag}: loss scaler not carried: {result}"
    if result["dtype"] == "fp16":
        expected = deepspeed_scales(result["skipped"])
        assert [s["cur_scale"] for s in result["scalers"]] == expected, f"{tag}: {result['scalers']} != {expected}"
        assert max(expected[SWITCH:]) > expected[SWITCH - 1], f"{tag}: the scale should grow after the switch"


def deepspeed_scales(skipped):
    """The loss scale after each step that DeepSpeed 0.19.8's own scaler (ZeRO 1-3's ``DynamicLossScaler``) gives
    with :data:`FP16` for the overflows ``skipped`` says (the skipped-step count after each step)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2.0 ** FP16["initial_scale_power"], scale_window=FP16["loss_scale_window"],
                               min_scale=1, delayed_shift=FP16["hysteresis"], consecutive_hysteresis=False)
    scales = []
    for before, after in zip([0] + skipped, skipped):
        scaler.update_scale(after > before)
        scales.append(scaler.cur_scale)
    return scales


def matrix(stages=(0, 1, 2, 3)):
    """(ZeRO stage, dtype, optimizer_state) of every case; fp16 at ZeRO 1-3 (the plugin refuses it at stage 0, where
    DeepSpeed 0.19.8 does not scale the loss: ``TrainingFacts.refuse_unscaled_fp16``)."""
    return [(s, d, p) for s in stages for d in ("fp32", "bf16", "fp16") if (s, d) != (0, "fp16")
            for p in (("copy", "scale") if d == "fp32" else ("copy",))]


if __name__ == "__main__":
    import deepspeed

    deepspeed.init_distributed()
    import ds_pseudo_real.controller  # noqa: F401

    if "--poison-unfilled" in sys.argv[1:]:  # the memory the delink leaves unfilled is NaN: an element unwritten shows
        ds_state.moments.unfilled = nan_filled

    args = sys.argv[1:]
    stages = [int(s) for s in args[args.index("--stages") + 1].split(",")] if "--stages" in args else (0, 1, 2, 3)
    failed = 0
    cases = matrix(stages)
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():  # DeepSpeed's CPU accelerator (tests/site/cpu_fp16.py)
        cases = [case for case in cases if case[1] != "fp16"]
        if dist.get_rank() == 0:
            print(f"skipped: the fp16 cases ({get_accelerator().device_name()} reports no fp16 support)", flush=True)
    for case in cases:
        out = run_case(*case)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(out), flush=True)
        if "--check" in sys.argv[1:]:  # the GPU check: each case's verdict, and the exit status
            try:
                check(out)
                print(f"rank {dist.get_rank()} ok: {case}", flush=True)
            except AssertionError as error:
                failed += 1
                print(f"rank {dist.get_rank()} FAILED: {case}: {error}", flush=True)
    dist.destroy_process_group()
    # the results are out: leave without the interpreter's teardown, where a C++ thread of gloo or DeepSpeed still
    # joinable under load can abort a rank (std::terminate) after a run that passed
    sys.stdout.flush()
    os._exit(1 if failed else 0)
