"""Activation checkpointing in the main job's models (``"checkpoint_activations": true`` in the gpt, m6 or hf
section): each layer keeps only its input and runs its forward again in the backward, with the same loss and
gradients bit for bit, for layers that share parameters too, at every ZeRO stage and across the delink; the
settings that would otherwise be ignored (DeepSpeed's own ``activation_checkpointing`` section) or that would plan
for other activations than the job keeps stop the job naming the keys."""
import dataclasses
import json

import pytest
import torch

from ds_pseudo_real import sharing
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.models.build import model_spec
from ds_pseudo_real.models.gpt import GPT, GPTConfig
from ds_pseudo_real.moe.architecture import M6_TINY
from ds_pseudo_real.report import read_records
from ds_pseudo_real.run_config import RunConfig
from conftest import REPO, run_main_job, run_two_ranks


def measure(model, idx, targets):
    """Loss, gradients (by name), how many times each layer's forward started (a recompute stops once it has what the
    backward needs), and the bytes autograd saved for the backward outside the recomputed regions. The random state
    starts the same for every model measured (dropout)."""
    torch.manual_seed(2)
    calls = [0] * len(model.layers)
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(model.layers)]
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return loss.item(), grads, calls, saved[0]


def checkpointed_pair(build, switch_on):
    plain, recomputing = build(), build()
    recomputing.load_state_dict(plain.state_dict())
    switch_on(recomputing)
    return plain, recomputing


@pytest.mark.parametrize("shared", [False, True], ids=["real", "pseudo"])
def test_gpt_recomputes_each_layer_with_the_same_loss_and_gradients(shared):
    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16))
        return sharing.apply_sharing(model, "layers") if shared else model

    plain, recomputing = checkpointed_pair(build, lambda m: setattr(m.cfg, "checkpoint_activations", True))
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    loss, grads, calls, saved = measure(plain, idx, idx)
    loss_r, grads_r, calls_r, saved_r = measure(recomputing, idx, idx)
    assert loss_r == loss
    assert grads_r.keys() == grads.keys() and all(torch.equal(grads_r[k], grads[k]) for k in grads)
    assert calls == [1] * 4 and calls_r == [2] * 4  # every layer ran again in the backward
    # Outside the layers autograd keeps the embeddings' and the head's tensors; the layers keep nothing but inputs.
    assert saved_r < saved / 3, (saved_r, saved)


def test_m6_recomputes_each_block_with_the_same_loss_gradients_and_balance_loss():
    import deepspeed

    deepspeed.init_distributed()
    from ds_pseudo_real.models.m6 import M6GPT

    arch = dataclasses.replace(M6_TINY, vocab_size=256)

    def build():
        torch.manual_seed(0)
        return M6GPT(arch, capacity_factor=1.0)  # tokens dropped: routing must be recomputed exactly

    plain, recomputing = checkpointed_pair(build, lambda m: setattr(m, "checkpoint_activations", True))
    idx = torch.randint(0, 256, (2, arch.seq_length), generator=torch.Generator().manual_seed(1))
    loss, grads, calls, saved = measure(plain, idx, idx)
    loss_r, grads_r, calls_r, saved_r = measure(recomputing, idx, idx)
    assert loss_r == loss  # language-model loss plus the balance loss of every block
    assert grads_r.keys() == grads.keys() and all(torch.equal(grads_r[k], grads[k]) for k in grads)
    gate = [k for k in grads if "gate" in k]
    assert gate and all(grads[k].abs().sum() > 0 for k in gate)  # the balance loss reaches the gates
    assert calls == [1] * arch.num_layers and calls_r == [2] * arch.num_layers
    assert saved_r < saved / 3, (saved_r, saved)
    assert all(not hasattr(layer, "balance_loss") for layer in recomputing.layers)  # nothing kept on the modules


def job_config(tmp_path, name, model_section, zero=2, steps=8, switch=4):
    cfg = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["zero_optimization"] = {"stage": zero}
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=2)
    cfg["pseudo_to_real"]["switch"] = {"at_step": switch}
    cfg.update(model_section)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def run_job(*args, expect=0):
    proc = run_main_job(*args, expect=expect)
    return proc.stdout + proc.stderr


RUN = ["--corpus-bytes", str(1 << 20), "--eval-interval", "4", "--eval-batches", "2", "--log-interval", "4"]
GPT_SECTION = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 32}


def losses(out):
    rows = read_records(out / "metrics.jsonl")
    return [r["train_loss"] for r in rows if "train_loss" in r], {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def test_main_job_recomputes_and_trains_as_without_under_zero_2_across_the_delink(tmp_path):
    """ZeRO 2 reduces a parameter's gradient when its hook fires: the pseudo model's layers share theirs, so a
    reentrant recompute would fire it once per layer and stop the job; this one trains exactly as without."""
    runs = {}
    for name, recompute in (("keeps", False), ("recomputes", True)):
        out = tmp_path / name
        section = {"gpt": {**GPT_SECTION, "checkpoint_activations": recompute}}
        log = run_job("--deepspeed_config", str(job_config(tmp_path, name, section)), "--output-dir", str(out), *RUN)
        assert "delinked at step 4" in log and "rank 0 finished at step 8 stage real" in log
        runs[name] = losses(out)
        assert ("checkpoint_activations True" in log) == recompute
    assert runs["recomputes"] == runs["keeps"]
    assert len(runs["keeps"][0]) == 8


def test_m6_on_two_ranks_recomputes_through_the_expert_all_to_all(tmp_path):
    """EP 2: the recompute of each block runs its all-to-all again on both ranks, in the backward; the run trains
    exactly as without, pseudo stage, delink and real stage."""
    m6 = json.loads((REPO / "configs" / "m6_tiny.json").read_text())
    runs = {}
    for name, recompute in (("keeps", False), ("recomputes", True)):
        sections = {"m6": {**m6["m6"], "checkpoint_activations": recompute},
                    "pseudo_to_real": {**m6["pseudo_to_real"], "switch": {"at_step": 4}}}
        cfg = json.loads(job_config(tmp_path, name, sections, zero=1).read_text())
        cfg.pop("granular_offload", None)
        path = tmp_path / f"m6_{name}.json"
        path.write_text(json.dumps(cfg))
        out = tmp_path / f"m6_{name}"
        proc = run_two_ranks(REPO / "launch" / "train.py", "--deepspeed_config", str(path), "--output-dir", str(out),
                             *RUN)
        assert "expert_parallel 2" in proc.stdout and "rank 1 finished at step 8 stage real" in proc.stdout
        runs[name] = losses(out)
    assert runs["recomputes"] == runs["keeps"]


def planned_activations(checkpointing):
    """A granular_offload section whose activation estimate recomputes, or keeps, each layer's activations."""
    return {"device_memory": "1GB", "activations": {"micro_batch": 1, "seq_len": 32, "hidden": 64, "heads": 4,
                                                    "checkpointing": checkpointing}}


@pytest.mark.parametrize("config, words", [
    ({"activation_checkpointing": {"partition_activations": False}},
     ["activation_checkpointing", '"gpt": {"checkpoint_activations": true}']),
    ({"m6": {"preset": "m6-tiny"}, "granular_offload": planned_activations(True)},
     ["granular_offload.activations.checkpointing is true", "m6.checkpoint_activations is false"]),
    ({"gpt": {"checkpoint_activations": True}, "granular_offload": planned_activations(False)},
     ["granular_offload.activations.checkpointing is false", "gpt.checkpoint_activations is true"]),
    ({"gpt": {"checkpoint_activations": "yes"}}, ["gpt.checkpoint_activations", "Input should be a valid boolean"]),
])
def test_settings_the_job_would_not_honour_stop_it_naming_the_keys(config, words):
    with pytest.raises(ConfigError) as error:
        model_spec(RunConfig.load(config, world_size=1), {}, vocab_size=256)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_the_main_job_refuses_deepspeeds_section_before_building_a_model(tmp_path):
    path = job_config(tmp_path, "ds_section", {"activation_checkpointing": {"partition_activations": False}})
    log = run_job("--deepspeed_config", str(path), "--output-dir", str(tmp_path / "out"), *RUN, expect=2)
    assert "activation_checkpointing: the main job's models do not call DeepSpeed's" in log
    assert "model:" not in log


def test_hugging_face_model_recomputes_through_transformers_own_switch():
    pytest.importorskip("transformers", reason="the hf model section needs transformers (the project's [hf] extra)")
    from ds_pseudo_real.models.build import build_model

    config = {"model_type": "gpt2", "n_layer": 3, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 64}
    models = []
    for recompute in (False, True):
        spec = model_spec(RunConfig.load({"hf": {"config": dict(config), "checkpoint_activations": recompute}},
                                         world_size=1), {"seq_len": 16}, vocab_size=256)
        models.append(build_model(spec, seed=0))
    plain, recomputing = models
    assert recomputing.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    for model in models:  # what measure() counts: transformers recomputes a block's forward, its hooks stay outside
        model.layers = torch.nn.ModuleList(block.attn for block in model.model.transformer.h)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads, calls, _ = measure(plain, idx, idx)
    loss_r, grads_r, calls_r, _ = measure(recomputing, idx, idx)
    assert calls == [1] * 3 and calls_r == [2] * 3
    assert loss_r == loss  # GPT-2's dropout draws the same numbers again in the recompute
    assert all(torch.equal(grads_r[k], grads[k]) for k in grads)


class ReentrantGPT(GPT):
    """The same GPT with each layer under torch's reentrant checkpoint: what the main job does not do."""

    def forward(self, idx, targets):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
        return torch.nn.functional.cross_entropy(self.head(self.ln_f(x)).view(-1, 256), targets.reshape(-1))


def train_in_process(stage, recompute, steps=6, switch=3, model_class=GPT):
    import ds_pseudo_real

    torch.manual_seed(0)
    model = model_class(GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16, checkpoint_activations=recompute))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "pseudo_to_real": {"layers": "layers", "switch": {"at_step": switch}}}
    engine, *_ = ds_pseudo_real.initialize(model=model, config=config)
    batches = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps * 2):
        x = torch.randint(0, 256, (2, 16), generator=batches)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.stage == "real"
    engine.engine.destroy()
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_recompute_trains_as_without_at_every_zero_stage_with_accumulation_and_a_delink(stage):
    """Layers sharing their parameters, recomputed under each ZeRO stage with 2 micro-batches per step, then the
    real model: the losses are those of the run that keeps its activations, bit for bit."""
    assert train_in_process(stage, True) == train_in_process(stage, False)


def test_a_reentrant_recompute_of_shared_layers_stops_zero_2():
    """Why the main job refuses DeepSpeed's section: a reentrant recompute runs each layer's backward as a graph of
    its own, so the shared parameters' gradient hooks fire once per layer, and ZeRO 2 stops at the second."""
    with pytest.raises(AssertionError, match="has already been reduced"):
        train_in_process(2, False, model_class=ReentrantGPT)
