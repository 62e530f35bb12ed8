"""What the delink holds besides the engines: the gathered fp32 pseudo weights and moments wait on the host (the
device, on an accelerator, holds at most one parameter's of them at a time, as DeepSpeed hands each over), and
``delink_noise`` makes one noisy copy at a time, written into its layer and dropped, instead of every copy but the
first layers' at once (the real model in fp32). The report gives the most it held at once (``gathered.peak_bytes``);
here that is checked against the bytes of the tensors alive while the real model is filled, measured apart."""
import gc
import sys
import warnings
import zlib
from pathlib import Path

import torch

import ds_pseudo_real
from ds_pseudo_real import ds_state, stages
from ds_pseudo_real.sharing import layer_index_of

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import BeforeDelink, config, fixed_batch, tiny_gpt  # noqa: E402

NOISE = 0.01


def live_cpu_tensor_bytes() -> int:
    """Bytes of the host storages of every tensor Python holds now (each storage counted once), but those ``gc.freeze``
    set apart (``gc.get_objects`` leaves them out)."""
    storages = {}
    with warnings.catch_warnings():  # a deprecated torch.distributed object warns when asked for its type
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def delink(noise, monkeypatch):
    """A fp32 ZeRO 1 delink of the 4-layer GPT after one step: its report, the pseudo fp32 masters just before it,
    the real fp32 masters after it and the most host tensor bytes alive while a parameter of the real model was
    being filled, of tensors made after this started: what was alive before (earlier tests' leftovers, which would
    otherwise count, or be freed between two calls) is collected or frozen out of the count, which also keeps each
    count to this delink's objects, not the whole process's."""
    filled = []
    fill = stages.fill_copies

    def measured(targets, source):
        filled.append(live_cpu_tensor_bytes())
        fill(targets, source)

    monkeypatch.setattr(stages, "fill_copies", measured)
    gc.collect()
    gc.freeze()
    try:
        return _delink(noise, filled)
    finally:
        gc.unfreeze()


def _delink(noise, filled):
    engine_ref = [None]
    before = BeforeDelink(engine_ref, fixed_batch(9), masters=True)
    cfg = config(1, "fp32", "copy", switch=1)
    cfg["pseudo_to_real"]["delink_noise"] = noise
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg, callbacks=[before])
    engine_ref[0] = engine
    engine.backward(engine(*fixed_batch(0)))
    engine.step()
    assert engine.stage == "real"
    real = {name: ds_state.full_fp32_param(engine.engine, p) for name, p in engine.module.named_parameters()}
    report = engine.last_transition
    engine.engine.destroy()
    return report, before.seen["masters"], real, max(filled)


def test_the_delink_holds_the_gathered_state_on_the_host_and_one_noisy_copy_at_a_time(monkeypatch):
    plain_report, plain_peak = delink(0.0, monkeypatch)[::3]  # nothing else of it kept: the peaks compare alike
    report, pseudo, real, peak = delink(NOISE, monkeypatch)
    layer = dict(tiny_gpt().layers[0].named_parameters())
    largest = 4 * max(p.numel() for p in layer.values())  # the largest layer parameter in fp32
    noisy = [name for name in real if layer_index_of(name, "layers") not in (None, 0) and real[name].numel() > 1]
    # measured: the noise adds at most one parameter's fp32 copy to what is alive while the real model is filled
    # (all of them at once would be 3 layers' worth here)
    assert 0 < peak - plain_peak <= largest, (peak - plain_peak, largest)
    # reported: the gathered state (fp32 weights and two moments of every pseudo parameter), on the host, and the
    # largest noisy copy beside it
    pseudo_numel = sum(p.numel() for p in pseudo.values())
    assert plain_report["gathered"] == {"device": "cpu", "bytes": 12 * pseudo_numel, "peak_bytes": 12 * pseudo_numel}
    assert report["gathered"] == {"device": "cpu", "bytes": 12 * pseudo_numel,
                                  "peak_bytes": 12 * pseudo_numel + max(4 * real[n].numel() for n in noisy)}
    # the values are those the noise has always given: the shared fp32 value plus delink_noise x its standard
    # deviation x a normal draw keyed by the copy's name, bit for bit; each group's first layer keeps the shared value
    for name, value in real.items():
        index = layer_index_of(name, "layers")
        source = pseudo[name if index is None else name.replace(f"layers.{index}.", "layers.0.", 1)]
        if name in noisy:
            draw = torch.randn(source.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            source = source + NOISE * source.std() * draw
        assert torch.equal(value, source), name


def test_the_noise_is_made_where_the_gathered_values_are_and_only_for_the_copies():
    """delink_noise draws on the CPU (the same noise on every rank and device) and adds it where the gathered value
    is (meta stands in for a device this machine lacks); a group's first layer and parameters outside the layers
    keep the shared tensor itself."""
    shared, head = torch.empty(4, 4, device="meta"), torch.empty(3, device="meta")
    starts = stages.Starts({"layers.0.fc.weight": shared, "layers.1.fc.weight": shared, "head.bias": head},
                               NOISE, "layers")
    assert starts["layers.0.fc.weight"] is shared and starts["head.bias"] is head
    noisy = starts["layers.1.fc.weight"]
    assert noisy is not shared and noisy.device.type == "meta" and noisy.shape == (4, 4)
    assert list(starts) == ["layers.0.fc.weight", "layers.1.fc.weight", "head.bias"]
    assert starts.made_on_read("layers.1.fc.weight") and not starts.made_on_read("layers.0.fc.weight")
    assert not stages.Starts(dict(starts._shared), 0.0, "layers").made_on_read("layers.1.fc.weight")

