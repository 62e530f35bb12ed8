"""Pseudo-to-Real on DeepSpeed's pipeline engine: a PipelineModule of 4 identical blocks between an embedding and
a head that is the embedding (the model's own TiedLayerSpec, on both stages) over 2 stages, its blocks tied with
TiedLayerSpec in the pseudo stage (groups 1: one set over both stages, DeepSpeed all-reducing its gradients between
them; groups 2: one set inside each stage), delinked at step 3.

Run under torchrun on 2 ranks (2 stages) or 4 (2 stages x 2 data-parallel ranks); rank 0 prints every rank's
``RESULT {json}`` line of each case. Each case: the loss on a fixed batch right before and right after the delink, the
fp32 masters and Adam moments carried, the tied set equal on every stage that holds it, and the run resumed from
its pseudo checkpoint (step 2) and from its real one (step 5) with the same losses.

``pipeline_delink.py FOLDER offload`` (2 ranks) runs the cases of ``OFFLOAD_CASES`` after them: a case of ``CASES``
with a ``granular_offload`` section, whose losses must be that case's bit for bit, and each stage's plan (group ->
numel, level; planned and held host bytes) in each stage."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import ds_pseudo_real
from ds_pseudo_real import ds_state
from ds_pseudo_real.callbacks import TrainingCallback
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.ds_state import basic_optimizer
from ds_pseudo_real.ds_state.moments import relink_optimizer_state
from ds_pseudo_real.pipeline import TIE_KEY, mapped_name
from ds_pseudo_real.sharing import source_parameter

SWITCH, STEPS, LAYERS, WIDTH, VOCAB = 3, 6, 4, 16, 64
MICRO_BATCHES = 2


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)

    def forward(self, x):
        return self.emb(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


def unembed(embed, x):
    """The head: the embedding's own weight (tied, as GPT models tie them), on the last stage."""
    return x @ embed.emb.weight.t()


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def pipeline_module():
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(0)
    specs = [TiedLayerSpec("embed", Embed, tied_weight_attr=["emb.weight"]),
             *[LayerSpec(Block) for _ in range(LAYERS)],
             TiedLayerSpec("embed", Embed, forward_fn=unembed, tied_weight_attr=["emb.weight"])]
    return PipelineModule(specs, num_stages=2, loss_fn=loss_fn, partition_method="type:Block")


LAYER_OF = {index: index - 1 for index in range(1, LAYERS + 1)}  # spec index -> layer
EMBEDDING = "tied_modules.embed.emb.weight"


def config(zero, groups, policy, dtype="fp32", offload=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        "pseudo_to_real": {"layers": "type:Block", "groups": groups, "switch": {"at_step": SWITCH},
                           "optimizer_state": policy},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # dynamic loss scaling from 2**8, doubled after every 2 steps without overflow
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}
    if offload is not None:  # granular offload steps AdamW with DeepSpeed's kernels: so does its reference
        del cfg["optimizer"]["params"]["torch_adam"]
        # no clipping: at ZeRO 1 DeepSpeed's gradient norm sums its groups' squares, one group per layer with
        # granular offload and one flat group without, whose sums can differ in the last bit (docs/pipeline.md)
        cfg["gradient_clipping"] = 0.0
        if LEVELS[offload] is not None:
            cfg["granular_offload"] = {"levels": LEVELS[offload]}
    return cfg


def batches(step, data_rank):
    """The micro batches of ``step`` on data-parallel rank ``data_rank``; step 0: the probe batch."""
    generator = torch.Generator().manual_seed(1000 * step + data_rank)
    out = []
    for _ in range(MICRO_BATCHES):
        x = torch.randint(0, VOCAB, (2, 8), generator=generator)
        out.append((x, x.roll(-1, 1)))
    return out


def data_rank(engine):
    return engine.grid.get_data_parallel_rank()


def eval_loss(engine):
    return engine.eval_batch(iter(batches(0, data_rank(engine)))).item()


def masters(engine):
    """Every parameter's full fp32 master by mapped name (collective over the stage's data-parallel group)."""
    return {mapped_name(name, LAYER_OF): ds_state.full_fp32_param(engine.engine, p)
            for name, p in engine.module.named_parameters()}


def probe_param(engine):
    """A layer's parameter this rank holds: (mapped name, parameter), the last one in the module's order."""
    layers = [(mapped_name(n, LAYER_OF), p) for n, p in engine.module.named_parameters()
              if mapped_name(n, LAYER_OF).startswith("layers.") and n.endswith("fc.weight")]
    return layers[-1]


def plan_report(engine):
    """This stage's offload plan, group -> [numel, level, planned host bytes, host bytes the optimizer holds]."""
    plan, optimizer = engine.offload_plan, basic_optimizer(engine.engine)
    if plan is None:
        return None
    held = optimizer.held_bytes_by_group()
    return {p.group.name: [p.group.numel, p.level.value, p.bytes.host, held[p.group.name]["host"]]
            for p in plan.placements}


class BeforeDelink(TrainingCallback):
    def __init__(self, ref):
        self.ref, self.seen = ref, {}

    def on_step_end(self, state, control):
        if control.should_delink:
            engine = self.ref[0]
            self.seen["plan"] = plan_report(engine)
            name, param = probe_param(engine)
            relink_optimizer_state(engine.engine)  # ZeRO 1 links a group's moments at the first group's step
            step = ds_state.step_counters(engine.engine)["state_step"]
            self.seen.update(loss=eval_loss(engine), masters=masters(engine), probe=name,
                             scaler=ds_state.loss_scaler_state(engine.engine),
                             moments=ds_state.full_moments(engine.engine, param),
                             adam_step=None if step is None else float(step),
                             tied_sum=float(param.detach().double().sum()))


def train(engine, first, last):
    return [engine.train_batch(iter(batches(step, data_rank(engine)))).item() for step in range(first, last + 1)]


def run_case(zero, groups, policy, dtype, folder, offload=None):
    rank = dist.get_rank()
    ref = [None]
    before = BeforeDelink(ref)
    cfg = config(zero, groups, policy, dtype, offload)
    engine, *_ = ds_pseudo_real.initialize(model=pipeline_module(), config=cfg, callbacks=[before])
    ref[0] = engine
    pseudo_sets = len({id(p) for n, p in engine.module.named_parameters() if TIE_KEY in n})
    losses = train(engine, 1, 2)
    engine.save_checkpoint(folder, "pseudo")
    losses += train(engine, 3, SWITCH)
    scaler_post = ds_state.loss_scaler_state(engine.engine)
    post = eval_loss(engine)
    carried = masters(engine)
    old, new = (LAYERS, groups), (LAYERS, LAYERS)
    differ = [name for name, value in carried.items()
              if not torch.equal(value, before.seen["masters"][source_parameter(name, "layers", old, new)[0]])]
    name, param = probe_param(engine)
    relink_optimizer_state(engine.engine)
    moments = ds_state.full_moments(engine.engine, param)
    expected = before.seen["moments"]
    members = LAYERS // groups
    if policy == "scale":
        expected = {"exp_avg": expected["exp_avg"] / members, "exp_avg_sq": expected["exp_avg_sq"] / members**2}
    step = ds_state.step_counters(engine.engine)["state_step"]
    losses += train(engine, SWITCH + 1, 5)
    engine.save_checkpoint(folder, "real")
    losses += train(engine, 6, STEPS)
    scaler_end = ds_state.loss_scaler_state(engine.engine)
    result = {
        "rank": rank, "zero": zero, "groups": groups, "policy": policy, "dtype": dtype, "offload": offload,
        "stage_id": engine.engine.stage_id,
        "pre": before.seen["loss"], "post": post, "losses": losses, "masters_differ": differ,
        "scaler_pre": before.seen["scaler"], "scaler_post": scaler_post, "scaler_end": scaler_end,
        "probe": [before.seen["probe"], name],
        "moments_ok": all(torch.equal(moments[k], expected[k]) for k in expected),
        "adam_step": None if step is None else float(step), "pseudo_adam_step": before.seen["adam_step"],
        "final_stage": engine.stage, "global_steps": engine.global_steps, "pseudo_sets": pseudo_sets,
        "real_tied": sum(TIE_KEY in n for n, _ in engine.module.named_parameters()),
        "embedding_tied": EMBEDDING in dict(engine.module.named_parameters()),
        "tied_sums": None,
        "parameters_total": [engine.last_transition[f"parameters_{when}_total"] for when in ("before", "after")],
    }
    result["plans"] = {"pseudo": before.seen["plan"], "real": plan_report(engine)}
    sums = [None] * dist.get_world_size()
    dist.all_gather_object(sums, before.seen["tied_sum"])
    result["tied_sums"] = sums
    engine.engine.destroy()

    resumed = {}
    for tag, first in (("pseudo", 3), ("real", 6)):
        engine, *_ = ds_pseudo_real.initialize(model=pipeline_module(), config=cfg)
        engine.load_checkpoint(folder, tag)
        resumed[tag] = {"stage": engine.stage, "step": engine.global_steps,
                        "losses": train(engine, first, STEPS), "final_stage": engine.stage,
                        "scaler_end": ds_state.loss_scaler_state(engine.engine)}
        engine.engine.destroy()
    result["resumed"] = resumed
    return result


# (ZeRO stage, groups, optimizer_state, dtype); bf16, fp16: the fp32 masters carried, the 16-bit weights made from
# them (fp16 at ZeRO 1: the plugin refuses it at stage 0, TrainingFacts.refuse_unscaled_fp16)
CASES = [(1, 1, "copy", "fp32"), (0, 2, "scale", "fp32"), (1, 1, "copy", "bf16"), (1, 1, "copy", "fp16")]
# granular offload levels by layer number: a PipelineModule's spec index (the embedding is 0, the blocks 1-4, the
# head 5). A pseudo stage's tied set is planned as the layer of its first spec on the stage (1 on stage 0, 3 on
# stage 1), the other layers' entries wait for the real stage. "spanning": groups 1, the set both stages hold at
# host_optimizer (DeepSpeed steps it and all-reduces its gradients between the stages); "in_stage": groups 2, each
# stage's set at host_params. "no_offload": the reference, DeepSpeed's own AdamW (the kernel the offload steps with)
LEVELS = {"spanning": {"1": "host_optimizer", "2": "host_params", "3": "host_optimizer", "4": "host_params"},
          "in_stage": {"1": "host_params", "2": "host_optimizer", "3": "host_params", "4": "host_optimizer"},
          "no_offload": None}
# (ZeRO stage, groups, optimizer_state, dtype, offload): each offloaded case after its reference
OFFLOAD_CASES = [(1, 1, "copy", "fp32", "no_offload"), (1, 1, "copy", "fp32", "spanning"),
                 (0, 2, "scale", "fp32", "no_offload"), (0, 2, "scale", "fp32", "in_stage")]


def check(result):
    tag = (f"rank {result['rank']} ZeRO-{result['zero']} groups {result['groups']} {result['policy']} "
           f"{result['dtype']}")
    assert result["pre"] == result["post"], f"{tag}: loss changed across the delink {result['pre']} -> {result['post']}"
    assert not result["masters_differ"], f"{tag}: masters not carried: {result['masters_differ']}"
    # the loss scaler (fp16's dynamic scale; a constant one otherwise) goes on across the delink: in fp16 2**8,
    # doubled at steps 3 and 5 (window 2), its step counter the run's
    assert result["scaler_post"] == result["scaler_pre"], f"{tag}: {result['scaler_pre']} -> {result['scaler_post']}"
    if result["dtype"] == "fp16":
        assert result["scaler_end"]["cur_scale"] == 2**10 and result["scaler_end"]["cur_iter"] == STEPS, tag
    assert result["moments_ok"], f"{tag}: moments not carried per policy ({result['probe']})"
    assert result["adam_step"] == result["pseudo_adam_step"] == SWITCH, tag
    assert result["final_stage"] == "real" and result["global_steps"] == STEPS, tag
    assert result["real_tied"] == 0, f"{tag}: the real module still ties {result['real_tied']} parameters"
    # the whole pipeline's parameters, each tied set once: the embedding (= head), the blocks' sets
    block = 2 * WIDTH + WIDTH * WIDTH + WIDTH
    assert result["parameters_total"] == [VOCAB * WIDTH + result["groups"] * block, VOCAB * WIDTH + LAYERS * block], tag
    assert result["embedding_tied"], f"{tag}: the model's own tie (embedding and head) is gone in the real module"
    # one tied set on each rank with groups 1 (both stages hold it), one per stage's group with groups 2
    assert result["pseudo_sets"] == 4, f"{tag}: {result['pseudo_sets']} tied parameters (Block has 4)"
    if result["groups"] == 1:  # the set DeepSpeed keeps on both stages stayed equal: its gradient was all-reduced
        assert len(set(result["tied_sums"])) == 1, f"{tag}: tied set differs between stages {result['tied_sums']}"
    if not result["resumed"]:
        return
    pseudo, real = result["resumed"]["pseudo"], result["resumed"]["real"]
    assert (pseudo["stage"], pseudo["step"], pseudo["final_stage"]) == ("pseudo", 2, "real"), f"{tag}: {pseudo}"
    assert pseudo["losses"] == result["losses"][2:], f"{tag}: resumed from pseudo {pseudo} vs {result['losses']}"
    assert (real["stage"], real["step"]) == ("real", 5), f"{tag}: {real}"
    assert real["losses"] == result["losses"][5:], f"{tag}: resumed from real {real} vs {result['losses']}"
    # resumed in either stage, the scaler ends where the uninterrupted run's does (fp16 losses would not show a
    # wrong power-of-two scale: it cancels exactly unless a gradient overflows)
    assert pseudo["scaler_end"] == real["scaler_end"] == result["scaler_end"], f"{tag}: {pseudo} {real}"


if __name__ == "__main__":
    import deepspeed

    deepspeed.init_distributed()
    folder = sys.argv[1]
    for case in CASES + (OFFLOAD_CASES if sys.argv[2:] == ["offload"] else []):
        out = run_case(*case[:4], os.path.join(folder, "-".join(map(str, case))), *case[4:])
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, out)  # printed by one rank: the ranks' lines would interleave
        if dist.get_rank() == 0:
            sys.stdout.write("".join(f"RESULT {json.dumps(result)}\n" for result in every))
            sys.stdout.flush()
    if sys.argv[2:] == ["offload"]:  # the set both stages hold, at host_params on stage 0 only: refused on both
        refused = config(1, 1, "copy", "fp32", "no_offload")
        refused["granular_offload"] = {"levels": {"1": "host_params"}}
        try:
            ds_pseudo_real.initialize(model=pipeline_module(), config=refused)
        except ConfigError as error:
            # One write per line (print writes the newline apart): both ranks print at once, into one pipe
            sys.stdout.write(f"REFUSED {json.dumps({'rank': dist.get_rank(), 'message': str(error)})}\n")
            sys.stdout.flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as delink_matrix: no interpreter teardown, where a gloo thread can abort a rank after a pass
