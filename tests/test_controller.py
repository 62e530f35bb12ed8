"""The controller as a user meets it: drop-in for deepspeed.initialize, callables rebuilt at the delink,
plateau switching, LR re-warmup, no loss spike after the switch with copied or scaled moments."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_pseudo_real
from ds_pseudo_real import ds_state
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.data import ByteCorpus
from ds_pseudo_real.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import config, fixed_batch, nan_filled, tiny_gpt  # noqa: E402


class HFStyle(nn.Module):
    """A model whose layers sit at ``transformer.h`` and whose forward returns logits only."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(256, 16)
        self.transformer.h = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
        self.lm_head = nn.Linear(16, 256)

    def forward(self, x):
        h = self.transformer.wte(x)
        for block in self.transformer.h:
            h = h + block(h)
        return self.lm_head(h)


def test_own_model_with_client_optimizer_scheduler_and_param_groups():
    built = []

    def param_groups(model):
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    def make_optimizer(params):
        opt = torch.optim.AdamW(params, lr=1e-2)
        built.append(opt)
        return opt

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
           "pseudo_to_real": {"layers": "transformer.h", "groups": 2, "switch": {"at_step": 2}}}
    torch.manual_seed(0)
    engine, optimizer, _, scheduler = ds_pseudo_real.initialize(
        model=HFStyle(), config=cfg, optimizer=make_optimizer, model_parameters=param_groups,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )
    x = torch.randint(0, 256, (2, 8))
    for _ in range(3):
        loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
    assert len(built) == 2 and engine.stage == "real"
    h = engine.module.transformer.h
    assert h[0][0].weight is not h[1][0].weight
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    assert engine.lr_scheduler.last_epoch == 3 and engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    engine.engine.destroy()


def test_instances_instead_of_callables_are_refused():
    model = tiny_gpt()
    with pytest.raises(TypeError, match="optimizer: got a AdamW; pass None or a callable"):
        ds_pseudo_real.initialize(model=model, config=config(1, "fp32", "copy"), optimizer=torch.optim.AdamW(model.parameters()))


def test_groups_must_divide_the_layer_count():
    cfg = config(1, "fp32", "copy")
    cfg["pseudo_to_real"]["groups"] = 3
    with pytest.raises(ValueError, match=r"pseudo_to_real.groups: got 3; .*divide the number of layers \(4\)"):
        ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    cfg["pseudo_to_real"]["groups"] = 1
    cfg["pseudo_to_real"]["layers"] = "blocks"
    with pytest.raises(ValueError, match="pseudo_to_real.layers: GPT has no attribute path 'blocks'"):
        ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    with pytest.raises(ConfigError, match="DeepSpeed config file not found: 'missing.json'"):
        ds_pseudo_real.initialize(model=tiny_gpt(), config="missing.json")


def test_disabled_trains_the_real_model_from_the_start():
    cfg = config(2, "fp32", "copy")
    cfg["pseudo_to_real"]["enabled"] = False
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    assert engine.stage == "real"
    assert ds_pseudo_real.parameter_count(engine.module) == sum(p.numel() for p in tiny_gpt().parameters())
    for _ in range(4):
        loss = engine(*fixed_batch(1))
        engine.backward(loss)
        engine.step()
    assert engine.stage == "real" and engine.last_transition is None
    engine.engine.destroy()


def test_switch_on_validation_plateau_through_report_eval():
    cfg = config(1, "fp32", "copy")
    cfg["pseudo_to_real"]["switch"] = {"on_plateau": {"window": 1, "min_improvement": 0.5}}
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    for value in (3.0, 2.0, 1.8):
        loss = engine(*fixed_batch(1))
        engine.backward(loss)
        engine.step()
        engine.report_eval({"val_loss": value})
    assert engine.stage == "real" and engine.state.switch_step == 3
    engine.engine.destroy()


def test_lr_rewarmup_after_the_switch():
    cfg = config(1, "fp32", "copy", switch=2)
    cfg["pseudo_to_real"]["rewarmup_steps"] = 3
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    seen = []
    for _ in range(6):
        if engine.stage == "real" and not seen:
            ds_state.basic_optimizer(engine.engine).register_step_pre_hook(
                lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
        loss = engine(*fixed_batch(1))
        engine.backward(loss)
        engine.step()
    assert seen == pytest.approx([3e-3 * 0.25, 3e-3 * 0.5, 3e-3 * 0.75, 3e-3])
    assert engine.optimizer.param_groups[0]["lr"] == 3e-3  # the factor never leaks into the stored LR
    engine.engine.destroy()


def test_pseudo_lr_scale_applies_before_the_switch_only_and_under_the_rewarmup():
    """pseudo_lr_scale 0.5 at ZeRO 1: the pseudo steps take half the schedule's LR, the real ones its full value
    ramped by the re-warmup; the scheduler's LR is never changed; and a pseudo step at 0.5 x 3e-3 is, bit for bit,
    one at 1.5e-3."""
    def run(lr, scale, steps):
        cfg = config(1, "fp32", "copy", switch=2)
        cfg["optimizer"]["params"]["lr"] = lr
        cfg["pseudo_to_real"].update(rewarmup_steps=2, pseudo_lr_scale=scale)
        engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
        seen, losses, hooked = [], [], None
        for _ in range(steps):
            if hooked is not engine.engine:
                hooked = engine.engine
                ds_state.basic_optimizer(hooked).register_step_pre_hook(
                    lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
            loss = engine(*fixed_batch(1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert engine.optimizer.param_groups[0]["lr"] == lr  # the factor never leaks into the stored LR
        engine.engine.destroy()
        return seen, losses

    seen, losses = run(3e-3, 0.5, 5)
    assert seen == pytest.approx([1.5e-3, 1.5e-3, 3e-3 / 3, 3e-3 * 2 / 3, 3e-3])
    plain_seen, plain_losses = run(1.5e-3, 1.0, 2)
    assert plain_seen == seen[:2] and plain_losses == losses[:2]


@pytest.fixture(scope="module")
def corpus():
    return ByteCorpus(max_bytes=1 << 20)


@pytest.mark.parametrize("policy", ["copy", "scale"])
def test_no_loss_spike_after_the_switch_on_the_demo_model(corpus, policy):
    """Train the byte-level GPT 40 pseudo steps, delink, 5 real steps: the validation loss must not jump."""
    cfg = config(1, "fp32", policy, switch=40)
    cfg["optimizer"]["params"]["lr"] = 2e-3
    cfg["train_micro_batch_size_per_gpu"] = 8
    torch.manual_seed(0)
    engine, *_ = ds_pseudo_real.initialize(model=GPT(GPTConfig(n_layer=4, d_model=64, n_head=4, seq_len=64)), config=cfg)
    val = [corpus.batch("val", 16, 64, seed=3, step=i) for i in range(2)]

    def val_loss():
        engine.eval()
        with torch.no_grad():
            value = sum(engine(x, y).item() for x, y in val) / len(val)
        engine.train()
        return value

    at_switch, after = None, []
    for step in range(45):
        loss = engine(*corpus.batch("train", 8, 64, seed=0, step=step))
        engine.backward(loss)
        engine.step()
        if engine.global_steps == 40:
            at_switch = val_loss()
        elif engine.global_steps > 40:
            after.append(val_loss())
    assert engine.stage == "real"
    assert max(after) < at_switch + 0.05, f"{policy}: val loss {at_switch:.4f} at the switch, then {after}"
    engine.engine.destroy()


def test_transition_reports_per_rank_bytes_of_both_models():
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1, "fp32", "copy", switch=1))
    loss = engine(*fixed_batch(1))
    engine.backward(loss)
    engine.step()
    report = engine.last_transition
    real = sum(p.numel() for p in tiny_gpt().parameters())
    layer = sum(p.numel() for p in tiny_gpt().layers[0].parameters())
    pseudo = real - 3 * layer
    assert (report["parameters_before"], report["parameters_after"]) == (pseudo, real)
    for when, numel in (("before", pseudo), ("after", real)):
        memory = report[f"memory_{when}"]
        assert memory["parameters"] == 4 * numel and memory["gradients"] == 4 * numel
        # ZeRO-1 on one rank: one flat fp32 partition, padded to a multiple of 2 elements; Adam keeps two moments.
        assert 4 * numel <= memory["fp32_master"] <= 4 * (numel + 1)
        assert memory["optimizer_state"] == 2 * memory["fp32_master"]
    # where the delink's time went, in order, adding up to its total (each rounded to the millisecond)
    phases = report["phases"]
    assert list(phases) == ["gather", "release", "starts", "model", "engine", "masters", "carry"]
    assert all(seconds >= 0 for seconds in phases.values())
    assert abs(sum(phases.values()) - report["seconds"]) <= 0.01 + 0.002 * len(phases)
    # the gathered pseudo state: fp32 weights and both Adam moments of every unique parameter, where it was kept
    assert report["gathered"] == {"device": "cpu", "bytes": 3 * 4 * pseudo, "peak_bytes": 3 * 4 * pseudo}
    engine.engine.destroy()


def test_a_reset_delink_gathers_the_weights_only():
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1, "fp32", "reset", switch=1))
    engine.backward(engine(*fixed_batch(1)))
    engine.step()
    weights = 4 * engine.last_transition["parameters_before"]
    assert engine.last_transition["gathered"] == {"device": "cpu", "bytes": weights, "peak_bytes": weights}
    engine.engine.destroy()


def test_moments_deepspeed_cannot_give_stop_the_delink_instead_of_resetting(monkeypatch):
    """ZeRO 1 keeps moments in flat partitions read through safe_get_full_optimizer_state: if that fails after
    training steps, a 'copy' delink must not quietly carry nothing (which is 'reset')."""
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1, "fp32", "copy", switch=2))
    loss = engine(*fixed_batch(0))
    engine.backward(loss)
    engine.step()

    def unreadable(param, key):
        raise KeyError(key)

    monkeypatch.setattr(ds_pseudo_real.ds_state.moments, "safe_get_full_optimizer_state", unreadable)
    loss = engine(*fixed_batch(1))
    engine.backward(loss)
    with pytest.raises(RuntimeError, match=r"cannot read the Adam moments of tok_emb.weight from DeepSpeed, whose "
                                           r"optimizer has stepped \(KeyError: 'exp_avg'\); the delink would silently"):
        engine.step()
    engine.engine.destroy()


def test_the_model_is_built_on_the_device_the_engine_trains_on(monkeypatch):
    """The delink builds the real model where DeepSpeed's engine keeps it (this rank's accelerator device, from
    LOCAL_RANK), so the host never holds it; on a CPU run, on the CPU."""
    from ds_pseudo_real import device, sharing, stages

    assert device.rank_device() == torch.device("cpu")

    class Accelerator:  # what DeepSpeed's CUDA accelerator answers
        def device_name(self, index=None):
            return "cuda" if index is None else f"cuda:{index}"

    monkeypatch.setattr(device, "get_accelerator", Accelerator)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.rank_device() == torch.device("cuda", 3)
    # materialize makes each parameter on the device it is given (meta stands in for one this machine lacks),
    # ties kept, and fills it there
    skeleton = sharing.meta_skeleton(tiny_gpt())
    weights = {name: torch.ones(p.shape) for name, p in tiny_gpt().named_parameters()}
    built = stages.materialize(skeleton, weights, torch.bfloat16, torch.device("meta"))
    assert {(p.device.type, p.dtype) for p in built.parameters()} == {("meta", torch.bfloat16)}
    assert len(list(built.parameters())) == len(list(tiny_gpt().parameters()))


GRANULAR = {"granular_offload": {"levels": ["host_params", "device", "host_optimizer", "host_params"]}}
DEEPSPEED_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def poison_unfilled_moments(monkeypatch):
    """Make the delink's unfilled moments NaN (an element left unwritten shows) and its source read no moments for a
    parameter named ``idle`` (as from an optimizer that keeps none for it); returns the list that gets the element
    count of every moment allocated unfilled."""
    unfilled = []

    def poisoned(shape, device, pin_memory=False):
        moment = nan_filled(shape, device)
        unfilled.append(moment.numel())
        return moment

    full_moments = ds_state.full_moments

    def none_for_idle(engine, param, name="", device=None):
        return None if name.endswith("idle") else full_moments(engine, param, name, device)

    monkeypatch.setattr(ds_state.moments, "unfilled", poisoned)
    monkeypatch.setattr(ds_state.weights, "full_moments", none_for_idle)  # what gather_full_state reads
    return unfilled


def tiny_gpt_with_idle_parameters():
    """The tiny GPT with a parameter ``idle`` in every layer and one outside them, used in no forward."""
    model = tiny_gpt()
    for layer in model.layers:  # in no forward: a zero gradient (and no moments under poison_unfilled_moments)
        layer.register_parameter("idle", nn.Parameter(torch.zeros(7)))
    model.register_parameter("idle", nn.Parameter(torch.zeros(3)))  # an odd total: ZeRO 1/2 pad their flats
    return model


@pytest.mark.parametrize("stage, dtype, offload", [
    (0, "fp32", None), (0, "bf16", None), (1, "fp32", None), (1, "bf16", None), (2, "fp32", None), (2, "bf16", None),
    (3, "fp32", None), (3, "bf16", None),
    pytest.param(0, "fp32", GRANULAR, id="0-fp32-granular"), pytest.param(1, "fp32", GRANULAR, id="1-fp32-granular"),
    pytest.param(2, "fp32", DEEPSPEED_OFFLOAD, id="2-fp32-offload_optimizer")])
def test_moments_are_written_once_and_what_has_no_source_zeroed(stage, dtype, offload, monkeypatch):
    """The delink allocates the moments unfilled and writes them once, not zero-filled first (a second pass over 8
    bytes per real parameter): ZeRO 0 writes each parameter's state (bf16: the unfused optimizer's fp32 copy) whole,
    ZeRO 1/2 each parameter's fragment of the flat partition (on the host with DeepSpeed's offload_optimizer), granular
    offload each parameter's range of its group's host buffer (and on CUDA the device groups' states). What has no source is zeroed: a parameter whose source has
    no moments (DeepSpeed gives every trainable parameter a gradient, so that here is an optimizer that keeps none
    for a parameter it never moved), and the flat partitions' padding. The unfilled memory is NaN here, so that any
    element left unwritten shows."""
    unfilled = poison_unfilled_moments(monkeypatch)
    full_moments = ds_state.full_moments
    model = tiny_gpt_with_idle_parameters()
    seen = {}

    class Moments(ds_pseudo_real.TrainingCallback):
        def on_step_end(self, state, control):
            if control.should_delink:
                seen["pseudo"] = {n: full_moments(engine.engine, p, n)
                                  for n, p in engine.module.named_parameters()}

    cfg = config(stage, dtype, "copy", switch=2)
    if offload:
        cfg.update(offload)
        cfg["optimizer"]["params"].pop("torch_adam")
    engine, *_ = ds_pseudo_real.initialize(model=model, config=cfg, callbacks=[Moments()])
    for step in range(2):
        engine.backward(engine(*fixed_batch(step)))
        engine.step()
    assert engine.stage == "real"
    real = dict(engine.module.named_parameters())
    carried = [n for n in real if not n.endswith("idle")]
    stepped = [tensor for _, tensor in ds_state.stepped_tensors(engine.engine)]
    assert sum(unfilled) == 2 * sum(t.numel() for t in stepped)  # every moment, the idle ones' and padding too
    if stage and "granular_offload" not in (offload or {}):
        assert sum(t.numel() for t in stepped) > sum(p.numel() for p in real.values())  # the flats are padded
    states = [ds_state.optimizer_state(engine.engine, tensor) for tensor in stepped]
    assert all(not state[k].isnan().any() for state in states for k in ds_state.MOMENT_KEYS)  # all written
    assert engine.last_transition["moments_carried"] == len(carried)
    for name, param in real.items():
        moments = full_moments(engine.engine, param, name)
        if name.endswith("idle"):
            assert all(torch.equal(moments[k], torch.zeros(getattr(param, "ds_shape", param.shape)))
                       for k in ds_state.MOMENT_KEYS), name
            continue
        source = "layers.0." + name.split(".", 2)[2] if name.startswith("layers.") else name
        assert all(torch.equal(moments[k], seen["pseudo"][source][k]) for k in ds_state.MOMENT_KEYS), name
    # and the real steps after it train: finite loss, no NaN moment anywhere
    loss = engine(*fixed_batch(5))
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    assert all(not torch.isnan(m).any() for n, p in real.items()
               for m in full_moments(engine.engine, p, n).values())
    engine.engine.destroy()


def test_zero0_moments_of_a_shared_parameter_are_written_into_all_its_layers_together(monkeypatch):
    """The carry writes the moments of one shared parameter into the states of all the layers it starts at once
    (fill_copies: each piece read once), one shared parameter at a time, and the values are the policy's."""
    written = []
    fill_copies = ds_state.moments.fill_copies

    def recording(targets, source):
        written.append((len(targets), tuple(source.shape)))
        fill_copies(targets, source)

    monkeypatch.setattr(ds_state.moments, "fill_copies", recording)
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(0, "fp32", "scale", switch=1))
    engine.backward(engine(*fixed_batch(0)))
    engine.step()
    assert engine.stage == "real"
    real = dict(engine.module.named_parameters())
    layer_names = [n for n in real if n.startswith("layers.0.")]
    other_names = [n for n in real if not n.startswith("layers.")]
    # two moments per shared parameter: a layer parameter's into its 4 layers, any other's into itself
    assert sorted(written) == sorted([(4, tuple(real[n].shape)) for n in layer_names for _ in range(2)]
                                     + [(1, tuple(real[n].shape)) for n in other_names for _ in range(2)])
    first, last = (ds_state.full_moments(engine.engine, real[f"layers.{i}.fc.weight"]) for i in (0, 3))
    assert all(torch.equal(first[k], last[k]) for k in ds_state.MOMENT_KEYS)
    engine.engine.destroy()


def test_unwritten_moments_zero_exactly_what_no_write_covered():
    """The record of the delink's writes, on its own: moments that are views of one buffer (granular offload's host
    flats), writes through other views of it (DeepSpeed's fragments), overlapping and out-of-order spans, a moment
    nobody wrote, and writes outside every moment."""
    nan = float("nan")
    flat = torch.full((10,), nan)  # one host buffer holding two parameters' moments: elements 0-5 and 6-9
    first, second = flat[0:6], flat[6:10]
    alone = torch.full((2, 3), nan)  # a state of its own, never written
    whole = torch.full((4,), nan)  # a state of its own, written whole
    elsewhere = torch.full((3,), nan)  # memory no moment of the record lives in
    unwritten = ds_state.UnwrittenMoments()
    for moment in (first, second, alone, whole):
        unwritten.add(moment)
    for part, value in ((flat[3:5], 1.0), (flat[1:4], 2.0), (flat[7:9], 3.0), (whole, 4.0), (elsewhere, 5.0)):
        part.fill_(value)
        unwritten.wrote(part)
    unwritten.zero_rest()
    assert flat.tolist() == [0, 2, 2, 2, 1, 0, 0, 3, 3, 0]
    assert torch.equal(alone, torch.zeros(2, 3)) and torch.equal(whole, torch.full((4,), 4.0))
    assert torch.equal(elsewhere, torch.full((3,), 5.0))
    unwritten.zero_rest()  # the record is spent: nothing is zeroed twice
    assert torch.equal(whole, torch.full((4,), 4.0))
