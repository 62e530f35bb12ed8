"""DeepSpeed's pipeline engine: ds_pseudo_real.initialize takes a PipelineModule, ties its layers per sharing group
with DeepSpeed's TiedLayerSpec, delinks them into untied layers with the weights and Adam moments carried (loss on a
fixed batch bit-identical across the switch, fp32; fp16's loss scaler too), and resumes from its per-layer checkpoint
files in either stage;
on 2 stages (2 ranks) and on 2 stages x 2 data-parallel ranks (4 ranks), every case of a layout in one launch. On 2
stages, with granular offload too: each stage plans its own layers (a tied set as one layer), the real stage is
planned again at the delink, and the losses are those without offload, bit for bit."""
import json
import sys
from pathlib import Path

import deepspeed
import pytest

import ds_pseudo_real
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.pipeline import TIE_KEY, layer_indices, mapped_name, stage_specs
from conftest import CPU_FP16, run_two_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import pipeline_delink  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_delink.py"


def _results(proc, ranks, cases):
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == ranks * len(cases), proc.stdout[-3000:]
    return results


def _case(result):
    return (result["zero"], result["groups"], result["policy"], result["dtype"]) + (
        (result["offload"],) if result["offload"] else ())


@pytest.mark.parametrize("ranks", [2, 4], ids=["2stages", "2stages-x-2dp"])
def test_pipeline_delink_and_resume(ranks, tmp_path):
    offload = ranks == 2  # the offloaded cases on 2 stages only: the 4-rank launch stays short
    cases = pipeline_delink.CASES + (pipeline_delink.OFFLOAD_CASES if offload else [])
    proc = run_two_ranks(SCRIPT, str(tmp_path), *(["offload"] if offload else []), ranks=ranks, timeout=900,
                         env_extra=CPU_FP16)
    results = _results(proc, ranks, cases)
    for result in results:
        pipeline_delink.check(result)
    for case in cases:
        of_case = [r for r in results if _case(r) == case]
        assert sorted(r["stage_id"] for r in of_case) == sorted([0, 1] * (ranks // 2))
        # the loss DeepSpeed averages over the data-parallel ranks and sends to every stage: one curve for all
        assert len({json.dumps(r["losses"]) for r in of_case}) == 1, case
    if offload:
        _check_offloaded(results)
        refused = [json.loads(line[len("REFUSED "):]) for line in proc.stdout.splitlines()
                   if line.startswith("REFUSED ")]
        assert sorted(r["rank"] for r in refused) == [0, 1], proc.stdout[-3000:]
        messages = {r["rank"]: r["message"] for r in refused}
        assert "granular_offload.levels: got 'host_params' for ['layer1'], a module that other pipeline stages" \
            in messages[0], messages
        assert "for a group of another stage" in messages[1] and "accepted for it: 'device' or 'host_optimizer'" \
            in messages[1], messages


WIDTH, VOCAB = pipeline_delink.WIDTH, pipeline_delink.VOCAB
BLOCK, EMBEDDING = 2 * WIDTH + WIDTH * WIDTH + WIDTH, VOCAB * WIDTH
# each stage's plan, group -> (numel, level), in the pseudo and the real stage: a stage plans only the layers it holds
# (stage 0: the embedding, blocks 1 and 2; stage 1: blocks 3 and 4, and the head, which is the embedding used
# through a forward_fn and so planned as 'other'); a pseudo stage's tied set is one layer, numbered by its first spec
# on the stage, at its size once
PLANS = {
    "spanning": {
        "pseudo": {0: {"layer0": (EMBEDDING, "device"), "layer1": (BLOCK, "host_optimizer")},
                   1: {"layer3": (BLOCK, "host_optimizer"), "other": (EMBEDDING, "device")}},
        "real": {0: {"layer0": (EMBEDDING, "device"), "layer1": (BLOCK, "host_optimizer"),
                     "layer2": (BLOCK, "host_params")},
                 1: {"layer3": (BLOCK, "host_optimizer"), "layer4": (BLOCK, "host_params"),
                     "other": (EMBEDDING, "device")}}},
    "in_stage": {
        "pseudo": {0: {"layer0": (EMBEDDING, "device"), "layer1": (BLOCK, "host_params")},
                   1: {"layer3": (BLOCK, "host_params"), "other": (EMBEDDING, "device")}},
        "real": {0: {"layer0": (EMBEDDING, "device"), "layer1": (BLOCK, "host_params"),
                     "layer2": (BLOCK, "host_optimizer")},
                 1: {"layer3": (BLOCK, "host_params"), "layer4": (BLOCK, "host_optimizer"),
                     "other": (EMBEDDING, "device")}}},
}


def _check_offloaded(results):
    """Every offloaded case: the losses of its case without offload (DeepSpeed's AdamW) bit for bit (before, at and after the delink,
    and resumed), and each stage's plan in each stage its own layers, the host bytes held the planned ones."""
    by_case = {(_case(r), r["rank"]): r for r in results}
    for *case, levels in pipeline_delink.OFFLOAD_CASES:
        if levels == "no_offload":
            continue
        for rank in (0, 1):
            offloaded, plain = by_case[((*case, levels), rank)], by_case[((*case, "no_offload"), rank)]
            # before, across the delink and the first real step bit for bit (resumed: the run's own, check())
            assert (offloaded["pre"], offloaded["post"]) == (plain["pre"], plain["post"]), (levels, rank)
            first_real = pipeline_delink.SWITCH + 1
            assert offloaded["losses"][:first_real] == plain["losses"][:first_real], (levels, rank)
            # and after it: DeepSpeed's FusedAdam (the reference) and granular offload step with the same CPU
            # kernel, whose bias correction both replay to the uninterrupted run's after the delink
            assert offloaded["losses"] == plain["losses"], (levels, rank)
            stage = offloaded["stage_id"]
            for when, expected in PLANS[levels].items():
                plan = offloaded["plans"][when]
                assert {name: tuple(group[:2]) for name, group in plan.items()} == expected[stage], (levels, when)
                for name, (numel, level, planned, held) in plan.items():
                    assert held == planned, (levels, when, name, planned, held)
                    if level == "host_optimizer":  # one data-parallel rank: master, gradient, two moments in fp32
                        assert held == 4 * 4 * numel, (levels, when, name, held)


def _spec(cls):
    from deepspeed.pipe import LayerSpec

    return LayerSpec(cls)


def test_layers_are_named_by_class_and_tied_per_group():
    specs = [_spec(pipeline_delink.Embed), *[_spec(pipeline_delink.Block) for _ in range(4)],
             _spec(pipeline_delink.Embed)]
    indices = layer_indices(specs, "type:block")  # case-insensitive, as DeepSpeed's partition_method
    assert indices == [1, 2, 3, 4]
    tied = stage_specs(specs, indices, 2, ["fc.weight"])
    assert [getattr(s, "key", None) for s in tied] == [None, f"{TIE_KEY}0", f"{TIE_KEY}0", f"{TIE_KEY}2",
                                                       f"{TIE_KEY}2", None]
    assert tied[1].tied_weight_attr == ["fc.weight"] and tied[0] is specs[0]
    untied = stage_specs(tied, indices, 4, ["fc.weight"])
    assert [type(s).__name__ for s in untied] == ["LayerSpec"] * 6
    layer_of = dict(zip(indices, range(4)))
    assert mapped_name(f"tied_modules.{TIE_KEY}2.fc.weight", layer_of) == "layers.2.fc.weight"
    assert mapped_name("3.fc.weight", layer_of) == "layers.2.fc.weight"
    assert mapped_name("0.emb.weight", layer_of) == "0.emb.weight"
    assert mapped_name("tied_modules.embed.weight", layer_of) == "tied_modules.embed.weight"


def test_layers_that_are_not_layer_specs_of_a_class_are_refused():
    from deepspeed.pipe import TiedLayerSpec

    specs = [_spec(pipeline_delink.Embed), _spec(pipeline_delink.Block)]
    with pytest.raises(ConfigError, match=r"pseudo_to_real.layers: got 'layers'; a PipelineModule names its layers "
                                          r"by class.*'type:<regex of the class name>'"):
        layer_indices(specs, "layers")
    with pytest.raises(ConfigError, match=r"'type:Transformer' matches none of .*\['Block', 'Embed'\]"):
        layer_indices(specs, "type:Transformer")
    with pytest.raises(ConfigError, match=r"matches layers \{1: 'TiedLayerSpec'\}.*give each of them as a LayerSpec"):
        layer_indices([specs[0], TiedLayerSpec("b", pipeline_delink.Block)], "type:Block")


@pytest.mark.parametrize("change, message", [
    ({"switch": {"at_tokens": 100}}, r"pseudo_to_real: at_tokens is not supported with a PipelineModule"),
    ({"schedule": [{"depth": 2}, {"at_step": 3}]}, r"pseudo_to_real.schedule\[0\].depth: got 2"),
])
def test_what_a_pipeline_cannot_do_is_refused(change, message):
    deepspeed.init_distributed()
    from deepspeed.pipe import LayerSpec, PipelineModule

    specs = [LayerSpec(pipeline_delink.Embed), *[LayerSpec(pipeline_delink.Block) for _ in range(4)]]
    cfg = pipeline_delink.config(1, 1, "copy")
    section = {k: v for k, v in cfg["pseudo_to_real"].items() if k not in ("groups", "switch")} \
        if "schedule" in change else cfg["pseudo_to_real"]
    cfg["pseudo_to_real"] = {**section, **change}
    with pytest.raises(ConfigError, match=message):
        ds_pseudo_real.initialize(model=PipelineModule(specs, num_stages=1, loss_fn=pipeline_delink.loss_fn),
                                  config=cfg)
