"""Convergence benchmark: does Pseudo-to-Real reach the loss of training from scratch sooner, in steps and in time?

Every variant of a regime trains the same model size on the same data order (a pure function of the seed and the
step), with the same optimizer math and LR schedule (warmup + cosine), DeepSpeed ZeRO 0 fp32, through
``ds_pseudo_real.initialize``; runs are interleaved (seed by seed, every variant in turn) so machine noise falls on
all of them. Two regimes:
  dense         the demo byte-level GPT, torch AdamW;
  memory_bound  an M6-style expert-prototyping MoE (many experts, small hidden): parameters dwarf per-token compute.
                Every variant trains through the plugin's ``granular_offload`` section at one device budget (the
                pseudo model's all-resident bytes + a fraction of the difference to the real model's): the pseudo
                model fits, the real one does not, so the planner places it and ``GranularOffloadOptimizer`` steps
                its host groups with DeepSpeed's CPU Adam; the plan is recomputed at the delink. Each run records the
                plan's levels and the bytes the optimizer held and moved per phase, checked against the plan.
Three clocks per run: steps; measured wall clock (training only, evaluation excluded, the delink included); a
deterministic cost-model clock (each phase's median measured step time, pooled over the regime's runs, x its
steps); and for memory_bound an offload clock (the cost-model step + the plan's moved bytes at a stated
host<->device bandwidth: where the device is the CPU, the measured step has the host Adam but no transfer).

    python benchmarks/convergence.py            # both regimes, 9 variants each, 3 seeds: 25-55 min on 2 CPU cores
    python benchmarks/convergence.py --quick    # smoke run, ~3 min (2 seeds, fewer variants: not for conclusions)
    python benchmarks/convergence.py --regime memory_bound --seeds 16 --arms "scratch,p2r@10% scale,p2r@25% scale"

Writes benchmarks/results/convergence_<regime>.json.gz (gzipped JSON, after every run, so an interrupted run keeps
what finished) and .png, and prints the tables.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    RESULTS, cost_model_clock, cumulative, fmt, first_crossing, machine_description, markdown_table, median,
    median_counting_missing, paired_differences, read_json, spread, value_at, write_json,
)
from ds_pseudo_real.callbacks import PSEUDO, TrainingCallback  # noqa: E402

JUMP_OFFSETS = (1, 2, 5, 10, 20)  # evaluations right after the switch, to see the loss jump


@dataclass(frozen=True)
class Arm:
    """One variant. ``kind``: ``scratch`` (the real model throughout), ``pseudo_to_real`` (shared layers until
    ``switch`` x steps, then delinked by the plugin), ``stacking`` (a ``stack_depth``-layer model until the switch,
    then its layers stacked to full depth, Gong et al. 2019 progressive stacking), ``progressive`` (``groups`` sets,
    then the ``stages``' group counts at their fractions of the run, the last one the real model). With ``budget``
    below 1 the arm trains that fraction of the regime's steps, its warmup + cosine schedule ending with them and its
    switch at its fraction of them: whether it reaches scratch's final loss within that budget, as a run planned for
    it would, rather than on the way through a schedule planned for the full run. Above 1 the pseudo phase runs longer
    than scratch's whole run (``budget`` 2, ``switch`` 0.5: as many pseudo steps as scratch has steps, then as many
    real ones), which pays only where a pseudo step costs a small fraction of a real one."""

    name: str
    kind: str = "scratch"
    switch: float = 0.0
    groups: int = 1
    optimizer_state: str = "scale"
    stack_depth: int = 0
    stages: Tuple[Tuple[int, float], ...] = ()  # progressive: (groups, at fraction of the steps) after the first
    delink_noise: float = 0.0  # pseudo_to_real.delink_noise
    rewarmup_steps: int = 0  # pseudo_to_real.rewarmup_steps: the LR ramps up again over these steps after the switch
    plateau: Optional[Tuple[int, float]] = None  # switch on a train-loss plateau (window, min_improvement) instead
    budget: float = 1.0  # the fraction of the regime's steps this arm trains, its LR schedule fitted to them
    lr_scale: float = 1.0  # this arm's peak LR over the regime's: is the scratch baseline's LR a fair one?
    pseudo_lr_scale: float = 1.0  # pseudo_to_real.pseudo_lr_scale: the LR before the real model, over the arm's
    # memory_bound: granular_offload.host_step at a fixed placement (ZeRO 1, every layer at host_params) instead of
    # the regime's planned one; None: the regime's
    host_step: Optional[str] = None
    delayed_from_step: int = 40  # granular_offload.delayed_from_step, with host_step "delayed"


@dataclass
class Regime:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    eval_interval: int
    eval_batches: int
    arms: List[Arm]
    moe: Optional[Dict[str, float]] = None
    offload: Dict[str, float] = field(default_factory=dict)


def dense_arms(n_layer: int, quick: bool) -> List[Arm]:
    if quick:
        return [Arm("scratch"), Arm("p2r@25% scale", "pseudo_to_real", 0.25), Arm("p2r@25% reset", "pseudo_to_real", 0.25,
                optimizer_state="reset"), Arm("p2r@25% G=2", "pseudo_to_real", 0.25, groups=2),
                Arm(f"stack {n_layer // 4}->{n_layer} @25%", "stacking", 0.25, stack_depth=n_layer // 4)]
    return [
        Arm("scratch"),
        Arm("p2r@10% scale", "pseudo_to_real", 0.10),
        Arm("p2r@25% scale", "pseudo_to_real", 0.25),
        Arm("p2r@50% scale", "pseudo_to_real", 0.50),
        Arm("p2r@25% copy", "pseudo_to_real", 0.25, optimizer_state="copy"),
        Arm("p2r@25% reset", "pseudo_to_real", 0.25, optimizer_state="reset"),
        Arm("p2r@25% G=2", "pseudo_to_real", 0.25, groups=2),
        Arm("p2r@25% G=4", "pseudo_to_real", 0.25, groups=4),
        Arm(f"stack {n_layer // 4}->{n_layer} @25%", "stacking", 0.25, stack_depth=n_layer // 4),
        Arm(f"p2r 1->2@10%->{n_layer}@25%", "progressive", 0.10, stages=((2, 0.10), (n_layer, 0.25))),
        Arm(f"p2r 1->2->4->{n_layer} @10/20/30%", "progressive", 0.10,
            stages=((2, 0.10), (4, 0.20), (n_layer, 0.30))),
        Arm("p2r@10% scale noise 0.01", "pseudo_to_real", 0.10, delink_noise=0.01),
        Arm("p2r@10% scale rewarmup 10", "pseudo_to_real", 0.10, rewarmup_steps=10),
        Arm("p2r plateau 5/0.02 scale", "pseudo_to_real", plateau=(5, 0.02)),
        Arm("p2r plateau 5/0.02 scale rewarmup 10", "pseudo_to_real", plateau=(5, 0.02), rewarmup_steps=10),
        Arm("p2r@10% scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.10, delink_noise=0.01, rewarmup_steps=10),
        Arm("p2r@5% scale", "pseudo_to_real", 0.05),
        Arm("p2r@5% scale noise 0.01", "pseudo_to_real", 0.05, delink_noise=0.01),
        Arm("p2r@10% G=2 scale", "pseudo_to_real", 0.10, groups=2),
        Arm("p2r@25% scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.25, delink_noise=0.01, rewarmup_steps=10),
        Arm("p2r@25% G=2 scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.25, groups=2, delink_noise=0.01,
            rewarmup_steps=10),
        Arm("p2r@40% scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.40, delink_noise=0.01, rewarmup_steps=10),
        Arm("p2r@10% G=2 scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.10, groups=2, delink_noise=0.01,
            rewarmup_steps=10),
        Arm("p2r@5% scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.05, delink_noise=0.01, rewarmup_steps=10),
        Arm("p2r@10% scale noise 0.1 rewarmup 10", "pseudo_to_real", 0.10, delink_noise=0.1, rewarmup_steps=10),
        Arm("p2r@10% G=2 scale noise 0.1 rewarmup 10", "pseudo_to_real", 0.10, groups=2, delink_noise=0.1,
            rewarmup_steps=10),
        Arm("p2r@10% G=4 scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.10, groups=4, delink_noise=0.01,
            rewarmup_steps=10),
        Arm("p2r@25% G=4 scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.25, groups=4, delink_noise=0.01,
            rewarmup_steps=10),
        Arm("p2r@5% G=4 scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.05, groups=4, delink_noise=0.01,
            rewarmup_steps=10),
        Arm("p2r@5% G=2 scale noise 0.01 rewarmup 10", "pseudo_to_real", 0.05, groups=2, delink_noise=0.01,
            rewarmup_steps=10),
        Arm("p2r@10% G=4 scale noise 0.01", "pseudo_to_real", 0.10, groups=4, delink_noise=0.01),
        Arm("scratch budget 50%", budget=0.5),
        Arm("p2r@10% scale noise 0.01 rewarmup 10 budget 50%", "pseudo_to_real", 0.10, delink_noise=0.01,
            rewarmup_steps=10, budget=0.5),
        Arm("p2r@10% scale noise 0.01 rewarmup 10 budget 40%", "pseudo_to_real", 0.10, delink_noise=0.01,
            rewarmup_steps=10, budget=0.4),
        Arm("scratch budget 200%", budget=2.0),
        Arm("scratch budget 300%", budget=3.0),
        Arm("p2r@50% scale budget 200%", "pseudo_to_real", 0.50, budget=2.0),
        Arm("p2r@67% scale budget 300%", "pseudo_to_real", 2 / 3, budget=3.0),
        # the baseline's LR: scratch at half and twice the regime's peak LR, and the best arms at twice it
        Arm("scratch lr x0.5", lr_scale=0.5),
        Arm("scratch lr x2", lr_scale=2.0),
        Arm("scratch lr x4", lr_scale=4.0),
        Arm("p2r@10% scale noise 0.01 rewarmup 10 lr x2", "pseudo_to_real", 0.10, delink_noise=0.01,
            rewarmup_steps=10, lr_scale=2.0),
        Arm("scratch budget 200% lr x2", budget=2.0, lr_scale=2.0),
        Arm("p2r@50% scale budget 200% lr x2", "pseudo_to_real", 0.50, budget=2.0, lr_scale=2.0),
        # each side at its best LR: the long pseudo phases at half the LR, scratch on the long schedules higher
        Arm("p2r@50% scale budget 200% lr x0.5", "pseudo_to_real", 0.50, budget=2.0, lr_scale=0.5),
        Arm("p2r@67% scale budget 300% lr x0.5", "pseudo_to_real", 2 / 3, budget=3.0, lr_scale=0.5),
        Arm("scratch budget 200% lr x4", budget=2.0, lr_scale=4.0),
        Arm("scratch budget 300% lr x2", budget=3.0, lr_scale=2.0),
        # each stage at its own LR (pseudo_to_real.pseudo_lr_scale): the shared model at half the regime's, the
        # real one at twice it, against scratch at twice it on the same schedule
        Arm("p2r@50% scale budget 200% lr x2 pseudo x0.25", "pseudo_to_real", 0.50, budget=2.0, lr_scale=2.0,
            pseudo_lr_scale=0.25),
        Arm("p2r@67% scale budget 300% lr x2 pseudo x0.25", "pseudo_to_real", 2 / 3, budget=3.0, lr_scale=2.0,
            pseudo_lr_scale=0.25),
        Arm("p2r@50% scale budget 200% lr x2 pseudo x0.25 rewarmup 10", "pseudo_to_real", 0.50, budget=2.0,
            lr_scale=2.0, pseudo_lr_scale=0.25, rewarmup_steps=10),
        Arm("p2r@10% scale pseudo x0.5", "pseudo_to_real", 0.10, pseudo_lr_scale=0.5),
        Arm("p2r@25% scale pseudo x0.5", "pseudo_to_real", 0.25, pseudo_lr_scale=0.5),
        Arm("p2r@10% G=4 scale noise 0.01 pseudo x0.5", "pseudo_to_real", 0.10, groups=4, delink_noise=0.01,
            pseudo_lr_scale=0.5),
        # the long first stage: the shared model's LR either side of half the regime's, two shared sets, and a
        # shallow model (its step does fewer layers' work) grown to full depth
        Arm("p2r@67% scale budget 300% lr x0.35", "pseudo_to_real", 2 / 3, budget=3.0, lr_scale=0.35),
        Arm("p2r@67% scale budget 300% lr x0.7", "pseudo_to_real", 2 / 3, budget=3.0, lr_scale=0.7),
        Arm("p2r@67% G=2 scale budget 300% lr x0.5", "pseudo_to_real", 2 / 3, groups=2, budget=3.0, lr_scale=0.5),
        Arm(f"stack {n_layer // 2}->{n_layer} @67% budget 300%", "stacking", 2 / 3, stack_depth=n_layer // 2,
            budget=3.0),
        Arm(f"stack {n_layer // 4}->{n_layer} @67% budget 300%", "stacking", 2 / 3, stack_depth=n_layer // 4,
            budget=3.0),
        Arm(f"stack {n_layer // 4}->{n_layer} @67%", "stacking", 2 / 3, stack_depth=n_layer // 4),
        # the strong baseline: scratch on 5x the regime's steps at three peak LRs, and the arms at the same budget
        Arm("scratch budget 500%", budget=5.0),
        Arm("scratch budget 500% lr x0.5", budget=5.0, lr_scale=0.5),
        Arm("scratch budget 500% lr x2", budget=5.0, lr_scale=2.0),
        Arm("p2r@60% scale budget 500% lr x0.7", "pseudo_to_real", 0.60, budget=5.0, lr_scale=0.7),
        Arm("p2r@80% scale budget 500% lr x0.7", "pseudo_to_real", 0.80, budget=5.0, lr_scale=0.7),
        # each stage at its own LR: the shared model lower, the real one at the regime's; and the dense regime's
        # best sharing schedule at equal steps, on the long budget
        Arm("p2r@60% scale budget 500% pseudo x0.7", "pseudo_to_real", 0.60, budget=5.0, pseudo_lr_scale=0.7),
        Arm("p2r@10% G=4 scale noise 0.01 pseudo x0.5 budget 500%", "pseudo_to_real", 0.10, groups=4,
            delink_noise=0.01, pseudo_lr_scale=0.5, budget=5.0),
        Arm("p2r@20% scale pseudo x0.5 budget 500%", "pseudo_to_real", 0.20, pseudo_lr_scale=0.5, budget=5.0),
        # growth of the shared set: one set, then two, four and the real model
        Arm(f"p2r 1->2->4->{n_layer} @40/60/80% budget 500% lr x0.7", "progressive", 0.40,
            stages=((2, 0.40), (4, 0.60), (n_layer, 0.80)), budget=5.0, lr_scale=0.7),
        Arm(f"stack {n_layer // 4}->{n_layer} @60% budget 500%", "stacking", 0.60, stack_depth=n_layer // 4,
            budget=5.0),
        # the host step one step late against the exact one, at one placement (memory_bound; ``Arm.host_step``)
        Arm("scratch host_params sequential", host_step="sequential"),
        Arm("scratch host_params delayed", host_step="delayed"),
        Arm("scratch host_params delayed from 0", host_step="delayed", delayed_from_step=0),
        Arm("p2r@25% scale host_params sequential", "pseudo_to_real", 0.25, host_step="sequential"),
        Arm("p2r@25% scale host_params delayed", "pseudo_to_real", 0.25, host_step="delayed"),
    ]


def memory_bound_arms(n_layer: int, quick: bool) -> List[Arm]:
    """The dense regime's variants (the smoke run: scratch and one switch)."""
    if quick:
        return [Arm("scratch"), Arm("p2r@25% scale", "pseudo_to_real", 0.25)]
    return dense_arms(n_layer, quick=False)


def select_arms(arms: List[Arm], names: Optional[str]) -> List[Arm]:
    """The arms named in ``names`` (comma-separated, in the regime's order), or all of them when None."""
    if names is None:
        return arms
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [a.name for a in arms]
    unknown = [n for n in wanted if n not in known]
    if unknown or "scratch" not in wanted:
        raise SystemExit(f"--arms: got {wanted}; accepted: a comma-separated subset of {known} that includes "
                         f"'scratch' (every variant is compared with it)")
    return [a for a in arms if a.name in wanted]


def regimes(args) -> List[Regime]:
    out = []
    if args.regime in ("dense", "both"):
        out.append(Regime(
            "dense", args.n_layer, args.d_model, args.n_head, args.seq_len, args.batch_size,
            args.steps or (60 if args.quick else 400), args.lr, args.warmup, args.eval_interval or (20 if args.quick else 40),
            args.eval_batches, select_arms(dense_arms(args.n_layer, args.quick), args.arms),
        ))
    if args.regime in ("memory_bound", "both"):
        out.append(Regime(
            "memory_bound", args.n_layer, args.d_model, args.n_head, args.seq_len, args.batch_size,
            args.mb_steps or (30 if args.quick else 160), args.lr, args.warmup,
            args.eval_interval or (10 if args.quick else 25), args.eval_batches,
            select_arms(memory_bound_arms(args.n_layer, args.quick), args.arms),
            moe=dict(num_experts=args.experts, num_prototypes=args.prototypes, ffn=args.expert_ffn,
                     capacity_factor=args.capacity_factor, balance_coeff=0.01),
            offload=dict(bandwidth_gbps=args.bandwidth_gbps, budget_fraction=args.budget_fraction),
        ))
        out[-1].offload.update(offload_budget(out[-1]))
    return out


def offload_budget(regime: Regime) -> Dict[str, int]:
    """The device budget every memory-bound variant trains under: the fully shared pseudo model's all-resident
    bytes + ``budget_fraction`` x (the real model's - the pseudo model's), in the planner's byte model with the
    activation estimate the ``granular_offload`` section is given."""
    import torch

    from benchmarks.common import build_gpt
    from ds_pseudo_real.offload.planner import TrainingSetup, estimate_activation_bytes, place, uniform_groups

    with torch.device("meta"):
        model = build_gpt(regime.n_layer, regime.d_model, regime.n_head, regime.seq_len, regime.moe)
    layer = sum(p.numel() for p in model.layers[0].parameters())
    other = sum(p.numel() for p in model.parameters()) - layer * regime.n_layer
    activation = estimate_activation_bytes(regime.batch_size, regime.seq_len, regime.d_model, regime.n_head,
                                           regime.n_layer, "fp32")
    setup = TrainingSetup("fp32", 0, 1, activation, 0)
    pseudo = place(uniform_groups(regime.n_layer, layer, other, 1), {}, setup).device_bytes
    real = place(uniform_groups(regime.n_layer, layer, other), {}, setup).device_bytes
    return {"budget_bytes": int(pseudo + regime.offload["budget_fraction"] * (real - pseudo)),
            "activation_bytes": activation, "pseudo_resident_bytes": pseudo, "real_resident_bytes": real}


# ---- one run -------------------------------------------------------------------------------------------------
def ds_config(regime: Regime, pseudo_to_real: Dict, arm: Optional["Arm"] = None) -> Dict:
    """The DeepSpeed config of every run of ``regime``. With a device budget (memory_bound) it has a
    ``granular_offload`` section, and every group of every variant, resident or offloaded, is stepped by DeepSpeed's
    CPU Adam kernel (the device being the CPU); without one, torch AdamW steps the whole model. An arm with a
    ``host_step`` trains at ZeRO 1 with every layer (its experts included) at host_params: the layers the offload
    steps itself, where the host step's mode matters."""
    adamw = {"lr": regime.lr, "betas": [0.9, 0.95], "weight_decay": 0.01}
    config = {
        "train_micro_batch_size_per_gpu": regime.batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": adamw if "budget_bytes" in regime.offload else {**adamw, "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": regime.steps,
                                                           "warmup_num_steps": regime.warmup, "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 0},
        "pseudo_to_real": pseudo_to_real,
    }
    if "budget_bytes" in regime.offload and arm is not None and arm.host_step is not None:
        levels = {str(i): "host_params" for i in range(regime.n_layer)}  # a layer's experts are in its group
        config["zero_optimization"] = {"stage": 1}
        config["granular_offload"] = {"levels": {**levels, "other": "device"}, "host_step": arm.host_step,
                                      "activation_bytes": regime.offload["activation_bytes"]}
        if arm.host_step == "delayed":
            config["granular_offload"]["delayed_from_step"] = arm.delayed_from_step
    elif "budget_bytes" in regime.offload:
        config["granular_offload"] = {"device_memory": regime.offload["budget_bytes"],
                                      "activation_bytes": regime.offload["activation_bytes"]}
    return config


def arm_regime(regime: Regime, arm: Arm) -> Regime:
    """``regime`` as ``arm`` trains it: its steps (and so its LR schedule) cut to the arm's budget, its peak LR
    scaled by the arm's ``lr_scale``."""
    if arm.budget == 1.0 and arm.lr_scale == 1.0:
        return regime
    return replace(regime, steps=max(1, round(arm.budget * regime.steps)), lr=regime.lr * arm.lr_scale)


def switch_step(regime: Regime, arm: Arm) -> Optional[int]:
    """The step an arm switches at, None for scratch and for a switch on a plateau (known once it happens)."""
    return None if arm.kind == "scratch" or arm.plateau else stage_step(regime, arm.switch)


def stage_step(regime: Regime, fraction: float) -> int:
    return max(1, round(fraction * regime.steps))


def progressive_ptr(regime: Regime, arm: "Arm") -> Dict:
    """The plugin's schedule for a progressive arm: ``groups`` sets, then each stage's at its fraction of the run."""
    schedule = [{"groups": arm.groups}] + [
        {"at_step": stage_step(regime, fraction), **({} if groups == regime.n_layer else {"groups": groups})}
        for groups, fraction in arm.stages]
    return {"layers": "layers", "schedule": schedule, "optimizer_state": arm.optimizer_state}


def build_engine(regime: Regime, n_layer: int, seed: Optional[int], ptr: Dict, arm: Optional["Arm"] = None):
    import torch

    import ds_pseudo_real
    from benchmarks.common import build_gpt

    if seed is not None:
        torch.manual_seed(seed)
    model = build_gpt(n_layer, regime.d_model, regime.n_head, regime.seq_len, regime.moe)
    engine, _, _, _ = ds_pseudo_real.initialize(model=model, config=ds_config(regime, ptr, arm))
    return engine


def stacking_ptr(arm: "Arm", switch: int) -> Dict:
    """Progressive stacking through the plugin: the first ``stack_depth`` layers until the switch, then grown to
    full depth with layer i starting from layer i mod depth (moments copied along, the LR schedule kept)."""
    return {"layers": "layers", "schedule": [{"depth": arm.stack_depth}, {"at_step": switch}],
            "optimizer_state": arm.optimizer_state}


def evaluate(engine, corpus, regime: Regime) -> float:
    import torch

    engine.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(regime.eval_batches):
            x, y = corpus.batch("val", regime.batch_size, regime.seq_len, seed=1234, step=i)
            total += float(engine(x.to(engine.device), y.to(engine.device)))
    engine.train()
    return total / regime.eval_batches


class BeforeTransition(TrainingCallback):
    """Evaluates the model a transition is about to replace, once a trigger has decided it (the transition runs
    right after the callbacks, inside ``engine.step()``): ``evaluated`` [(step, val loss)]; ``fetched_bytes``: the
    host_params fetches of those evaluations (not the step's)."""

    def __init__(self, engine, corpus, regime: Regime):
        self.engine, self.corpus, self.regime = engine, corpus, regime
        self.evaluated: List[Tuple[int, float]] = []
        self.fetched_bytes = 0

    def on_step_end(self, state, control) -> None:
        if control.should_delink and state.stage == PSEUDO:
            store = getattr(offload_counters(self.engine)[0], "host_params", None)
            before = store.fetched_bytes if store is not None else 0
            self.evaluated.append((state.global_step, evaluate(self.engine, self.corpus, self.regime)))
            self.fetched_bytes += (store.fetched_bytes if store is not None else 0) - before


def unique_numel(module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def offload_counters(engine):
    """The granular offload optimizer stepping now (None without offload) and its bytes moved so far: gradient
    copies to the host and master copies back, plus parameter fetches at ``host_params``."""
    from ds_pseudo_real import ds_state
    from ds_pseudo_real.offload import GranularOffloadOptimizer

    optimizer = ds_state.basic_optimizer(engine.engine)
    if not isinstance(optimizer, GranularOffloadOptimizer):
        return None, 0
    fetched = optimizer.host_params.fetched_bytes if optimizer.host_params is not None else 0
    return optimizer, optimizer.moved_bytes + fetched


def plan_record(plan) -> Dict:
    """What a run keeps of an :class:`OffloadPlan`: levels, the budget and the predicted bytes."""
    from ds_pseudo_real.offload import PlacementLevel

    return {"levels": plan.levels(),
            "level_counts": {lvl.value: sum(p.level is lvl for p in plan.placements) for lvl in PlacementLevel},
            "budget_bytes": plan.budget_bytes, "device_bytes": plan.device_bytes, "host_bytes": plan.host_bytes,
            "optimizer_device_bytes": plan.optimizer_device_bytes, "optimizer_host_bytes": plan.optimizer_host_bytes,
            "moved_bytes_per_step": plan.moved_bytes_per_step}


def record_offload_step(records: Dict[str, Dict], phase: str, plan, moved: int, held: Optional[Dict[str, int]]) -> None:
    """Add one step of ``phase`` (under ``plan``, moving ``moved`` bytes, after which the optimizer held ``held``;
    None on the step whose end delinked: that optimizer is gone) to ``records``: the plan, the distinct bytes
    moved per step, the bytes held after the phase's latest step, and whether both are the plan's prediction."""
    record = records.setdefault(phase, {"plan": plan_record(plan), "moved_bytes_per_step": [], "held_bytes": None})
    if moved not in record["moved_bytes_per_step"]:
        record["moved_bytes_per_step"].append(moved)
    if held is not None:
        record["held_bytes"] = held
    predicted = record["plan"]
    record["matches_plan"] = (record["moved_bytes_per_step"] == [predicted["moved_bytes_per_step"]]
                              and record["held_bytes"] == {"device": predicted["optimizer_device_bytes"],
                                                           "host": predicted["optimizer_host_bytes"]})


def run_arm(regime: Regime, arm: Arm, seed: int, corpus, verbose: bool = True) -> Dict:
    """Train one variant for its budget of ``regime.steps`` steps; the record holds every step's phase, times and
    loss."""
    from benchmarks.common import timed_step

    regime = arm_regime(regime, arm)
    switch = switch_step(regime, arm)
    if arm.kind == "stacking":
        engine = build_engine(regime, regime.n_layer, seed, stacking_ptr(arm, switch), arm)
        first_phase = f"shallow{arm.stack_depth}"
    elif arm.kind == "progressive":
        engine = build_engine(regime, regime.n_layer, seed, progressive_ptr(regime, arm), arm)
        first_phase = f"pseudo_g{arm.groups}"
    else:
        trigger = ({"on_plateau": {"metric": "train_loss", "window": arm.plateau[0],
                                   "min_improvement": arm.plateau[1]}} if arm.plateau
                   else {"at_step": switch or regime.steps + 1})
        ptr = {"enabled": arm.kind == "pseudo_to_real", "layers": "layers", "groups": arm.groups,
               "switch": trigger, "optimizer_state": arm.optimizer_state,
               "delink_noise": arm.delink_noise, "rewarmup_steps": arm.rewarmup_steps,
               "pseudo_lr_scale": arm.pseudo_lr_scale}
        engine = build_engine(regime, regime.n_layer, seed, ptr, arm)
        first_phase = f"pseudo_g{arm.groups}" if arm.kind == "pseudo_to_real" else "real"
    placed = "" if arm.host_step is None else " host_params"  # its own step costs: not pooled with the regime's
    first_phase += placed
    params = {first_phase: unique_numel(engine.module)}
    before_transition = BeforeTransition(engine, corpus, regime)
    engine.callbacks.callbacks.append(before_transition)  # after the trigger: it sees the decision
    eval_steps = set(range(regime.eval_interval, regime.steps + 1, regime.eval_interval)) | {regime.steps}
    for at in ([switch] if switch else []) + [stage_step(regime, f) for _, f in arm.stages]:
        eval_steps |= {at} | {at + d for d in JUMP_OFFSETS if at + d <= regime.steps}
    phases, compute_s, optimizer_s, step_s, train_loss = [], [], [], [], []
    evals = [(0, evaluate(engine, corpus, regime))]
    transition = None
    phase = first_phase
    offload: Dict[str, Dict] = {}
    for step in range(regime.steps):
        x, y = corpus.batch("train", regime.batch_size, regime.seq_len, seed=seed, step=step)
        x, y = x.to(engine.device), y.to(engine.device)
        optimizer, moved_before = offload_counters(engine)
        evaluation_fetched = before_transition.fetched_bytes
        plan = getattr(engine, "offload_plan", None)  # the controller's; a delink inside step() replaces it
        loss, forward_backward, optimizer_step = timed_step(engine, x, y)
        if optimizer is not None:
            fetched = optimizer.host_params.fetched_bytes if optimizer.host_params is not None else 0
            current = offload_counters(engine)[0] is optimizer
            evaluation_fetched = before_transition.fetched_bytes - evaluation_fetched
            moved = optimizer.moved_bytes + fetched - moved_before - evaluation_fetched
            record_offload_step(offload, phase, plan, moved, optimizer.held_bytes() if current else None)
        if engine.last_transition is not None and transition is None:
            t = engine.last_transition
            transition = {k: t[k] for k in ("step", "seconds", "parameters_before", "parameters_after", "optimizer_state",
                                            "moments_carried")}
            if switch is None:  # a plateau switch: evaluate around it as around a fixed one
                switch = t["step"]
                eval_steps |= {switch} | {switch + d for d in JUMP_OFFSETS if switch + d <= regime.steps}
        phases.append(phase)
        compute_s.append(forward_backward)
        optimizer_s.append(optimizer_step)
        step_s.append(forward_backward + optimizer_step)
        train_loss.append(float(loss.detach()))
        now = ("real" + placed if engine.stage == "real" else phase if arm.kind == "stacking"
               else f"pseudo_g{engine.groups}" + placed)
        if now != phase:  # after a transition: the next steps cost what the new model's do
            phase = now
            params[phase] = unique_numel(engine.module)
        if step + 1 in eval_steps:
            evals.append((step + 1, evaluate(engine, corpus, regime)))
    if verbose:
        print(f"  [{regime.name}] seed {seed} {arm.name:<22} final val {evals[-1][1]:.4f}  train "
              f"{sum(step_s):6.1f}s" + (f"  switch@{switch} in {transition['seconds']:.2f}s" if transition else "")
              + "".join(f"  {p}: {r['plan']['level_counts']} moved {r['moved_bytes_per_step']} B/step"
                        f"{'' if r['matches_plan'] else ' NOT AS PLANNED'}" for p, r in offload.items()),
              flush=True)
    engine.engine.destroy()
    return {
        "arm": arm.name, "seed": seed, "switch_step": switch, "parameters": params, "transition": transition,
        "phases": phases, "compute_s": compute_s, "optimizer_s": optimizer_s, "step_s": step_s,
        "train_loss": train_loss, "eval_steps": [s for s, _ in evals], "val_loss": [v for _, v in evals],
        "val_before_transition": before_transition.evaluated,
        "offload": offload,
    }


# ---- clocks ----------------------------------------------------------------------------------------------------
def phase_medians(runs: Sequence[Dict], key: str) -> Dict[str, float]:
    """Median of ``key`` (a per-step time list) per phase, pooled over runs; the first step of each phase of each
    run (allocation warm-up) and the step that did the switch are left out."""
    pooled: Dict[str, List[float]] = {}
    for run in runs:
        switch = run["switch_step"]
        for i, (phase, value) in enumerate(zip(run["phases"], run[key])):
            if i == 0 or (switch is not None and i in (switch - 1, switch)):
                continue
            pooled.setdefault(phase, []).append(value)
    return {phase: median(values) for phase, values in pooled.items()}


def offload_step_costs(regime: Regime, runs: Sequence[Dict], step_cost: Dict[str, float]) -> Dict:
    """Per phase: the plan every run of the regime trained under (they must agree), the bytes measured against
    it, and the offload-model step = the cost-model step (measured, with the host Adam of the plan's offloaded
    groups) + the plan's moved bytes at ``bandwidth_gbps`` (the transfer a CPU-as-device run does not pay)."""
    bandwidth = regime.offload["bandwidth_gbps"] * 1e9
    out = {"budget_bytes": regime.offload["budget_bytes"],
           "budget_rule": f"the fully shared pseudo model's all-resident bytes + {regime.offload['budget_fraction']}"
                          f" x (the real model's - the pseudo model's)",
           "bandwidth_bytes_per_s": bandwidth, "phases": {}}
    for phase in step_cost:
        records = [r["offload"][phase] for r in runs if phase in r.get("offload", {})]
        plans = {str(sorted(rec["plan"]["levels"].items())) for rec in records}
        if len(plans) != 1:
            raise ValueError(f"phase {phase}: the runs trained under {len(plans)} different plans; expected one")
        plan = records[0]["plan"]
        transfer = plan["moved_bytes_per_step"] / bandwidth
        out["phases"][phase] = {
            **plan, "runs": len(records), "runs_matching_plan": sum(rec["matches_plan"] for rec in records),
            "measured_moved_bytes_per_step": sorted({m for rec in records for m in rec["moved_bytes_per_step"]}),
            "measured_held_bytes": [dict(t) for t in {tuple(sorted(rec["held_bytes"].items())) for rec in records}],
            "measured_step_s": step_cost[phase], "transfer_s": transfer, "step_s": step_cost[phase] + transfer,
        }
    return out


# ---- the analysis ----------------------------------------------------------------------------------------------
def loss_jump(run: Dict) -> Optional[float]:
    """Highest validation loss in the 20 steps after the switch minus the loss of the model the switch replaced
    (>0: it went up). That model is evaluated as the transition is decided (``val_before_transition``): a delink
    leaves the loss as it was, but a growth or a delink with noise does not, so the loss after the switch step
    is not the one before it. Runs stored without it are measured from the loss after the switch step."""
    s = run["switch_step"]
    if s is None:
        return None
    at = dict(zip(run["eval_steps"], run["val_loss"]))
    before = dict(run.get("val_before_transition", [])).get(s, at.get(s))
    after = [at[s + d] for d in JUMP_OFFSETS if s + d in at]
    return max(after) - before if after and before is not None else None


def steps_in_real_steps(steps: Optional[float], switch: int, pseudo_cost: float) -> Optional[float]:
    """The cost, in real steps, of ``steps`` steps of a run that switches from pseudo to real steps at ``switch``, a
    pseudo step costing ``pseudo_cost`` of a real one: min(steps, switch) x r + max(steps - switch, 0). A run that
    gets there before its switch has paid for the pseudo steps it took only. None stays None (never)."""
    if steps is None:
        return None
    return min(steps, switch) * pseudo_cost + max(steps - switch, 0.0)


def pseudo_cost_for_goal(steps_to_target: Sequence[Optional[float]], switch_steps: Sequence[int],
                         total_steps: Union[int, Sequence[Optional[float]]], goal: float = 0.5) -> Optional[float]:
    """The largest cost of a pseudo step, as a fraction of a real step, at which an arm that trains ``switch_steps[i]``
    pseudo steps and then real ones, and reaches scratch's final loss after ``steps_to_target[i]`` steps (None:
    never), takes a median over all seeds (never counting as infinitely slow) of at most ``goal`` x scratch's time
    (``total_steps`` real steps, or per seed the steps a baseline took, None where it never got there). Seed i's
    ratio is :func:`steps_in_real_steps` / total. None when even free pseudo steps would not bring the median there;
    at most 1."""
    totals = [total_steps] * len(switch_steps) if isinstance(total_steps, (int, float)) else list(total_steps)
    triples = list(zip(steps_to_target, switch_steps, totals))

    def median_at(r: float) -> Optional[float]:
        return median_counting_missing([None if n is None or not t else steps_in_real_steps(n, w, r) / t
                                        for n, w, t in triples])

    at_zero = median_at(0.0)
    if at_zero is None or at_zero > goal:
        return None
    if median_at(1.0) <= goal:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if median_at(middle) <= goal else (low, middle)
    return low


def same_schedule_scratch(regime: Regime, arm: Arm) -> Optional[Arm]:
    """For a variant trained on a schedule other than the regime's (``budget`` or ``lr_scale`` != 1), the scratch arm
    trained on the same one, if the regime has it: a longer or higher LR schedule alone may reach scratch's final
    loss sooner, so the variant's own gain is measured against that arm too."""
    if arm.kind == "scratch" or (arm.budget, arm.lr_scale) == (1.0, 1.0):
        return None
    return next((a for a in regime.arms
                 if a.kind == "scratch" and (a.budget, a.lr_scale) == (arm.budget, arm.lr_scale)), None)


def versus_same_schedule(arm: Arm, same: Arm, rows: Dict[int, Dict], per_run: Dict, by: Dict,
                         clocks: Dict) -> Dict:
    """``arm`` against the scratch arm ``same`` on its schedule, seed by seed: the ratios of their steps and clocks
    to the regime scratch's final loss, their final losses paired, and the pseudo step cost at which the arm would
    take half the steps ``same`` took."""
    control = {s: per_run[(same.name, s)] for s in rows if (same.name, s) in per_run}
    out: Dict[str, Any] = {"arm": same.name, "seeds": sorted(control)}
    for metric in ["steps_to_target"] + [f"{c}_to_target" for c in clocks]:
        ratios = {s: rows[s][metric] / c[metric] if rows[s][metric] is not None and c[metric] else None
                  for s, c in control.items()}
        out[f"{metric.removesuffix('_to_target')}_to_target_ratio"] = {"per_seed": ratios, **spread(list(ratios.values()))}
    out["final_val_paired"] = paired_differences({s: rows[s]["final_val"] for s in control},
                                                 {s: c["final_val"] for s, c in control.items()})
    if arm.kind == "pseudo_to_real" and not arm.stages:
        seeds = sorted(control)
        out["pseudo_cost_for_half_time"] = pseudo_cost_for_goal(
            [rows[s]["steps_to_target"] for s in seeds], [by[(arm.name, s)]["switch_step"] for s in seeds],
            [control[s]["steps_to_target"] for s in seeds])
    return out


def analyse(regime: Regime, runs: List[Dict], clocks: Dict[str, Dict[str, float]], reference: str = "scratch") -> Dict:
    """Per arm and seed: steps/time to reach the ``reference`` arm's final validation loss (same seed; the regime's
    scratch by default, or a strong baseline such as scratch on a 5x schedule), loss at equal steps and at the
    reference's total time, loss jump; then spread over seeds and differences paired by seed against the reference
    (the keys say "scratch" whichever arm it is: ``reference`` names it)."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs if (reference, r["seed"]) in by})
    per_run = {}
    for run in runs:
        if run["seed"] not in seeds:
            continue
        scratch = by[(reference, run["seed"])]
        target = scratch["val_loss"][-1]
        row = {"final_val": run["val_loss"][-1], "loss_jump": loss_jump(run), "target": target}
        steps_at = first_crossing(run["eval_steps"], run["val_loss"], target)
        row["steps_to_target"] = steps_at
        for clock, costs in clocks.items():
            times = [0.0] + (cumulative(run["step_s"]) if costs is None else cost_model_clock(run["phases"], costs))
            scratch_times = [0.0] + (cumulative(scratch["step_s"]) if costs is None
                                     else cost_model_clock(scratch["phases"], costs))
            eval_times = [times[s] for s in run["eval_steps"]]
            row[f"{clock}_total"] = times[-1]
            row[f"{clock}_to_target"] = None if steps_at is None else value_at(list(range(len(times))), times, steps_at)[0]
            value, ended = value_at(eval_times, run["val_loss"], scratch_times[-1])
            row[f"{clock}_val_at_scratch_time"] = value
            row[f"{clock}_ended_before_scratch_time"] = ended
            # equal time: both curves at the earlier of the two ends, so neither is read past its last point
            common_end = min(times[-1], scratch_times[-1])
            scratch_eval_times = [scratch_times[s] for s in scratch["eval_steps"]]
            row[f"{clock}_equal_time_delta"] = (value_at(eval_times, run["val_loss"], common_end)[0]
                                                - value_at(scratch_eval_times, scratch["val_loss"], common_end)[0])
            row[f"{clock}_equal_time_at"] = common_end
        per_run[(run["arm"], run["seed"])] = row
    arms = []
    for arm in regime.arms:
        rows = {s: per_run[(arm.name, s)] for s in seeds if (arm.name, s) in per_run}
        base = {s: per_run[(reference, s)] for s in seeds}
        entry = {"arm": asdict(arm), "switch_step": switch_step(arm_regime(regime, arm), arm), "seeds": sorted(rows)}
        metrics = ["final_val", "loss_jump", "steps_to_target"] + [
            f"{c}_{m}" for c in clocks for m in ("total", "to_target", "val_at_scratch_time", "equal_time_delta",
                                                 "equal_time_at")]
        for metric in metrics:
            values = {s: r[metric] for s, r in rows.items()}
            entry[metric] = {"per_seed": values, **spread(list(values.values()))}
            if metric in ("final_val",) or metric.endswith("val_at_scratch_time"):
                entry[metric]["paired_minus_scratch"] = paired_differences(values, {s: b[metric] for s, b in base.items()})
        for clock in clocks:
            entry[f"{clock}_ended_before_scratch_time"] = sum(r[f"{clock}_ended_before_scratch_time"] for r in rows.values())
        for metric in ["steps_to_target"] + [f"{c}_to_target" for c in clocks]:
            scratch_metric = "steps_to_target" if metric == "steps_to_target" else metric
            ratios = {s: (r[metric] / base[s][scratch_metric]) if r[metric] is not None and base[s][scratch_metric] else None
                      for s, r in rows.items()}
            entry[f"{metric}_ratio_to_scratch"] = {"per_seed": ratios, **spread(list(ratios.values()))}
        arm_runs = [by[(arm.name, s)] for s in rows]
        entry["step_time_median_s"] = phase_medians(arm_runs, "step_s")
        entry["compute_time_median_s"] = phase_medians(arm_runs, "compute_s")
        entry["optimizer_time_median_s"] = phase_medians(arm_runs, "optimizer_s")
        entry["parameters"] = arm_runs[0]["parameters"]
        # first phase / real step time within each run: both measured minutes apart, so load drift cancels better
        # than in the pooled medians (where scratch's real steps and the variants' pseudo steps ran at other times)
        same_run = [phase_medians([r], "step_s") for r in arm_runs]
        entry["first_over_real_step_same_run"] = spread(
            [m[r["phases"][0]] / m["real"] for m, r in zip(same_run, arm_runs) if r["phases"][0] != "real" and r["phases"][0] in m and "real" in m])
        same_run_opt = [phase_medians([r], "optimizer_s") for r in arm_runs]
        entry["first_over_real_optimizer_same_run"] = spread(
            [m[r["phases"][0]] / m["real"] for m, r in zip(same_run_opt, arm_runs) if r["phases"][0] != "real" and r["phases"][0] in m and "real" in m])
        delinks = [r["transition"]["seconds"] for r in arm_runs if r["transition"]]
        entry["transition_seconds"] = spread(delinks)
        if arm.kind == "pseudo_to_real" and not arm.stages and reference == "scratch":
            # what a pseudo step would have to cost for this arm to reach the 2x goal (median of all <= 0.5)
            reached = [rows[s]["steps_to_target"] for s in rows]
            switches = [by[(arm.name, s)]["switch_step"] for s in rows]
            entry["pseudo_cost_for_half_time"] = pseudo_cost_for_goal(reached, switches, regime.steps)
            # the same clock with free pseudo steps: the real steps alone, the least any pseudo cost could give
            entry["ratio_with_free_pseudo_steps"] = median_counting_missing(
                [None if n is None else steps_in_real_steps(n, w, 0.0) / regime.steps for n, w in zip(reached, switches)])
        same = same_schedule_scratch(regime, arm) if reference == "scratch" else None
        if same is not None:
            entry["vs_same_schedule_scratch"] = versus_same_schedule(arm, same, rows, per_run, by, clocks)
        arms.append(entry)
    return {"arms": arms, "reference": reference}


def print_tables(regime: Regime, summary: Dict, clocks: Sequence[str], costs: Dict) -> str:
    reference = summary.get("reference", "scratch")
    lines = [f"\n## {regime.name}: {regime.n_layer} layers, hidden {regime.d_model}, seq {regime.seq_len}, batch "
             f"{regime.batch_size}, {regime.steps} steps" + (f", MoE {regime.moe}" if regime.moe else "")
             + ("" if reference == "scratch" else f"; target and ratios: {reference}'s final loss and totals")]
    lines.append("cost-model step seconds per phase (pooled medians): "
                 + ", ".join(f"{k} {v:.4f}" for k, v in sorted(costs.items())))
    header = ["variant", "final val (mean±sd)", f"Δ vs {reference}, paired", "steps to target (ratio)"]
    header += [f"{c} to target (ratio)" for c in clocks] + [f"Δ val at equal {c} time" for c in clocks]
    header += ["jump at switch", "pseudo/real step, same run", "params pseudo→real"]
    rows = []
    for entry in summary["arms"]:
        fv = entry["final_val"]
        diff = fv.get("paired_minus_scratch", {})
        row = [entry["arm"]["name"], f"{fmt(fv['mean'])}±{fmt(fv['std'])}",
               f"{fmt(diff.get('mean'), signed=True)}±{fmt(diff.get('std'))} ({diff.get('negative', 0)}/{diff.get('n', 0)} <0"
               + (f", t {fmt(diff.get('t'), 2, signed=True)}, sign p {fmt(diff.get('sign_p'), 3)})" if diff.get("n") else ")")]
        for metric in ["steps_to_target"] + [f"{c}_to_target" for c in clocks]:
            value, ratio = entry[metric], entry[f"{metric}_ratio_to_scratch"]
            miss = f", {value['missing']} never" if value["missing"] else ""
            median_all = "∞" if ratio["median_all"] is None else fmt(ratio["median_all"], 2)
            row.append(f"{fmt(value['mean'], 0 if metric == 'steps_to_target' else 1)} "
                       f"({fmt(ratio['mean'], 2)}±{fmt(ratio['std'], 2)}{miss}; median of all {median_all})")
        for c in clocks:
            d = entry[f"{c}_equal_time_delta"]
            row.append(f"{fmt(d['mean'], signed=True)}±{fmt(d['std'])}")
        row.append(fmt(entry["loss_jump"]["mean"], signed=True))
        ratio = entry["first_over_real_step_same_run"]
        row.append(f"{fmt(ratio['mean'], 2)}±{fmt(ratio['std'], 2)}" if ratio["n"] else "-")
        row.append("→".join(f"{v:,}" for v in entry["parameters"].values()))
        rows.append(row)
    lines.append(markdown_table(header, rows))
    needed = [(e["arm"]["name"], e["pseudo_cost_for_half_time"], e["ratio_with_free_pseudo_steps"],
               e["steps_to_target"]["missing"]) for e in summary["arms"] if "pseudo_cost_for_half_time" in e]
    if needed:
        lines.append("the pseudo/real step cost at which the median over all seeds would reach scratch's final loss in "
                     "half its time (from the steps each seed took and its switch step; in brackets the median "
                     "ratio with free pseudo steps): " + "; ".join(
                         f"{name} {'none would' if r is None else f'<= {r:.2f}'} "
                         f"({'∞' if free is None else f'{free:.2f}'}" + (f", {missing} never" if missing else "") + ")"
                         for name, r, free, missing in needed))
    for e in summary["arms"]:
        same = e.get("vs_same_schedule_scratch")
        if same is None:
            continue
        diff, r = same["final_val_paired"], same.get("pseudo_cost_for_half_time", "-")
        ratios = "; ".join(
            f"{key.removesuffix('_to_target_ratio')} to target {fmt(v['mean'], 2)}±{fmt(v['std'], 2)} (median of all "
            + ("∞" if v["median_all"] is None else fmt(v["median_all"], 2)) + (f", {v['missing']} never" if v["missing"] else "") + ")"
            for key, v in same.items() if key.endswith("_to_target_ratio"))
        lines.append(f"{e['arm']['name']} against {same['arm']} (the same LR schedule): final val "
                     f"{fmt(diff['mean'], signed=True)}±{fmt(diff['std'])} ({diff['negative']}/{diff['n']} lower"
                     + (f", sign p {fmt(diff['sign_p'], 3)}" if diff["n"] else "") + f"); {ratios}; pseudo/real step "
                     "cost for half its steps " + ("none would" if r is None else r if isinstance(r, str) else f"<= {r:.2f}"))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(regime: Regime, runs: List[Dict], clocks: Dict[str, Optional[Dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("steps", None)] + list(clocks.items())
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3
    scratch_runs = [r for r in runs if r["arm"] == "scratch"]
    top = max(sum(r["val_loss"][i] for r in scratch_runs) / len(scratch_runs)
              for i in range(len(scratch_runs[0]["val_loss"])) if scratch_runs[0]["eval_steps"][i] >= 0.15 * regime.steps)
    bottom = min(min(r["val_loss"]) for r in runs)
    for ax, (clock, costs) in zip(axes, panels):
        for color, arm in zip(colors, regime.arms):
            arm_runs = [r for r in runs if r["arm"] == arm.name]
            if not arm_runs:
                continue
            xs_all, ys = [], []
            for r in arm_runs:
                if clock == "steps":
                    xs = r["eval_steps"]
                else:
                    t = [0.0] + (cumulative(r["step_s"]) if costs is None else cost_model_clock(r["phases"], costs))
                    xs = [t[s] for s in r["eval_steps"]]
                xs_all.append(xs)
                ys.append(r["val_loss"])
            n = min(len(y) for y in ys)
            mean_x = [sum(x[i] for x in xs_all) / len(xs_all) for i in range(n)]
            mean_y = [sum(y[i] for y in ys) / len(ys) for i in range(n)]
            style = "-" if arm.kind != "stacking" else "--"
            ax.plot(mean_x, mean_y, style, color=color, label=arm.name, linewidth=1.4 if arm.kind != "scratch" else 2.4)
            s = switch_step(arm_regime(regime, arm), arm)
            if s is not None and s in arm_runs[0]["eval_steps"]:
                i = arm_runs[0]["eval_steps"].index(s)
                ax.plot([mean_x[i]], [mean_y[i]], "v", color=color, markersize=8)
        ax.set_xlabel({"steps": "step", "wall": "measured wall-clock s (training only)",
                       "gpu_wall": "measured GPU-run wall-clock s (training only)",
                       "cost": "cost-model s (phase median x steps)",
                       "offload": "offload-model s (measured + modelled transfer)"}.get(clock, clock))
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom - 0.02, top + 0.02)
    axes[0].set_ylabel("validation loss (nats/byte)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{regime.name}: validation loss, mean over seeds; ▼ = switch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_stored(stored: Sequence[Dict], tags: Sequence[str]) -> Dict:
    """Results files of separate runs of one regime on the same seeds, as one: every arm in order of first appearance.
    An arm stored in several files must have run alike in each (the same validation losses, seed for seed: the losses
    are a function of the code, the seed and the arm), else the files do not belong together."""
    first = stored[0]
    seeds = first["seeds"]
    arms: Dict[str, Dict] = {}
    runs: Dict[Tuple[str, int], Dict] = {}
    for tag, one in zip(tags, stored):
        if one["seeds"] != seeds:
            raise SystemExit(f"--merge: {tag} has seeds {one['seeds']}, {tags[0]} has {seeds}")
        for arm in one["regime"]["arms"]:
            arms.setdefault(arm["name"], arm)
        for run in one["runs"]:
            key = (run["arm"], run["seed"])
            if key in runs and runs[key]["val_loss"] != run["val_loss"]:
                raise SystemExit(f"--merge: {run['arm']} seed {run['seed']} has other losses in {tag} than before")
            runs.setdefault(key, run)
    return {"regime": {**first["regime"], "arms": list(arms.values())}, "seeds": seeds,
            "machine": {**first["machine"], "merged_from": dict(zip(tags, (one["machine"] for one in stored)))},
            "elapsed_s": sum(one["elapsed_s"] for one in stored), "offload_model": None,  # recomputed from all runs
            "runs": list(runs.values())}


# a run's per-step series, most of a file's bytes, as stored: rounded to these decimals (seconds to 10 us, training
# losses to 1e-4), which the analysis reads as sums and medians over hundreds of steps; ``step_s``, their sum, is not
# stored but added back when read
STORED_DECIMALS = {"compute_s": 5, "optimizer_s": 5, "train_loss": 4}


def lean(run: Dict) -> Dict:
    """``run`` as stored (``STORED_DECIMALS``); validation losses as measured (``merge_stored`` compares them)."""
    return {k: [round(x, STORED_DECIMALS[k]) for x in v] if k in STORED_DECIMALS else v
            for k, v in run.items() if k != "step_s"}


def results_file(out_dir: Path, regime_name: str, tag: str) -> Path:
    """Where a run of ``regime_name`` under ``tag`` is stored: gzipped JSON (per-step series are most of its bytes)."""
    return out_dir / f"convergence_{regime_name}{tag}.json.gz"


def read_stored(out_dir: Path, regime_name: str, tag: str) -> Dict:
    """A stored run, from its gzipped file, or from the plain .json that runs stored before wrote."""
    path = results_file(out_dir, regime_name, tag)
    if not path.exists() and path.with_suffix("").exists():
        path = path.with_suffix("")
    stored = read_json(path)
    for run in stored["runs"]:
        run.setdefault("step_s", [c + o for c, o in zip(run["compute_s"], run["optimizer_s"])])
    return stored


def run_regime(regime: Regime, seeds: Sequence[int], corpus, out_dir: Path, tag: str,
               runs: Optional[List[Dict]] = None, elapsed: float = 0.0, machine: Optional[Dict] = None,
               offload: Optional[Dict] = None, baseline: Optional[str] = None) -> Dict:
    """Train every variant (unless ``runs`` are given, from an earlier results file), then analyse and plot; with a
    ``baseline`` arm, analyse again against its final loss and totals (the strong baseline)."""
    if baseline is not None and baseline not in {arm.name for arm in regime.arms}:
        raise SystemExit(f"--baseline: {baseline!r} is not an arm of this run; its arms: "
                         f"{[arm.name for arm in regime.arms]}")
    path = results_file(out_dir, regime.name, tag)
    plot_path = out_dir / f"convergence_{regime.name}{tag}.png"
    started = time.perf_counter() - elapsed
    machine = machine or machine_description()
    if runs is None:
        print(f"\n# regime {regime.name}: {len(regime.arms)} variants x {len(seeds)} seeds, {regime.steps} steps each",
              flush=True)
        runs = []
        for i, seed in enumerate(seeds):  # interleaved: every variant of a seed before the next seed
            for arm in regime.arms:
                runs.append(run_arm(regime, arm, seed, corpus))
                # after every run: an interrupted run keeps what finished, and --reanalyse reads its whole seeds
                write_json(path, {"regime": asdict(regime), "seeds": list(seeds[:i + 1]), "machine": machine,
                                  "elapsed_s": time.perf_counter() - started, "runs": runs})
    step_cost = phase_medians(runs, "step_s")
    # the measured clock: on a GPU, with real offload (host Adam, host<->device copies), the GPU clock
    wall = "gpu_wall" if machine.get("cuda") else "wall"
    clocks: Dict[str, Optional[Dict[str, float]]] = {wall: None, "cost": step_cost}
    if "budget_bytes" in regime.offload and offload is None:
        offload = offload_step_costs(regime, runs, step_cost)
    if offload is not None:
        clocks["offload"] = {phase: v["step_s"] for phase, v in offload["phases"].items()}
    summary = analyse(regime, runs, clocks)
    table = print_tables(regime, summary, list(clocks), step_cost)
    strong = None
    if baseline is not None:
        strong_summary = analyse(regime, runs, clocks, reference=baseline)
        strong = {"arm": baseline, "summary": strong_summary,
                  "table_markdown": print_tables(regime, strong_summary, list(clocks), step_cost)}
    print("pooled medians per phase: forward+backward "
          + ", ".join(f"{k} {v:.4f}s" for k, v in sorted(phase_medians(runs, "compute_s").items()))
          + "; optimizer step " + ", ".join(f"{k} {v:.4f}s" for k, v in sorted(phase_medians(runs, "optimizer_s").items())),
          flush=True)
    if offload and "runs_matching_plan" in next(iter(offload["phases"].values()), {}):
        print(f"granular offload at a device budget of {offload['budget_bytes']:,} B ({offload['budget_rule']}):")
        for phase, v in offload["phases"].items():
            verdict = ("equal to the plan's prediction in every run" if v["runs_matching_plan"] == v["runs"]
                       else f"NOT equal to the plan's prediction in {v['runs'] - v['runs_matching_plan']} of {v['runs']} runs")
            print(f"  {phase}: levels {v['level_counts']}, planned device {v['device_bytes']:,} B; optimizer held "
                  f"{v['measured_held_bytes']} (plan device {v['optimizer_device_bytes']:,}, host "
                  f"{v['optimizer_host_bytes']:,}), moved {v['measured_moved_bytes_per_step']} B/step (plan "
                  f"{v['moved_bytes_per_step']:,}): {verdict}", flush=True)
            print(f"  {phase}: offload-model step = measured {v['measured_step_s']:.4f}s + transfer "
                  f"{v['transfer_s']:.4f}s = {v['step_s']:.4f}s", flush=True)
    payload = {
        "regime": asdict(regime), "seeds": list(seeds), "machine": machine,
        "elapsed_s": time.perf_counter() - started, "cost_model_step_s": step_cost, "offload_model": offload,
        "clocks": {k: ("measured" if v is None else v) for k, v in clocks.items()},
        "summary": summary, "table_markdown": table, "strong_baseline": strong, "runs": [lean(r) for r in runs],
    }
    write_json(path, payload)
    plot(regime, runs, {k: v for k, v in clocks.items()}, plot_path)
    print(f"wrote {path} and {plot_path} ({payload['elapsed_s']:.0f}s)", flush=True)
    return payload


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps, variants and seeds (~2 min)")
    p.add_argument("--regime", choices=("dense", "memory_bound", "both"), default="both")
    p.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 3, quick 2)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first seed (seeds are first-seed, first-seed + 1, ...): fresh seeds to confirm an arm on")
    p.add_argument("--arms", default=None,
                   help="comma-separated variant names to run (default: all of the regime's), scratch included")
    p.add_argument("--steps", type=int, default=None, help="dense steps (default 400, quick 60)")
    p.add_argument("--mb-steps", type=int, default=None, help="memory-bound steps (default 160, quick 30)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=None)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--experts", type=int, default=128, help="memory-bound: experts per layer")
    p.add_argument("--prototypes", type=int, default=4, help="memory-bound: expert prototypes (k top-1)")
    p.add_argument("--expert-ffn", type=int, default=64, help="memory-bound: expert hidden size")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--bandwidth-gbps", type=float, default=12.0,
                   help="memory-bound offload model: host<->device GB/s (12: PCIe 3 x16, the paper's V100 era)")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="memory-bound offload model: device budget = pseudo model's bytes + this x (real's - pseudo's)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    p.add_argument("--corpus-bytes", type=int, default=4 << 20)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default=None,
                   help="suffix of the results files, convergence_<regime><tag>.json.gz (default '', quick '_quick')")
    p.add_argument("--baseline", default=None,
                   help="an arm of --arms whose final loss is also a target (a strong baseline, e.g. 'scratch budget "
                        "500%%'): every arm's time to it over its total, and final losses paired against it")
    p.add_argument("--reanalyse", action="store_true",
                   help="no training: analyse and plot the runs stored in the results files again")
    p.add_argument("--merge", default=None,
                   help="with --reanalyse: comma-separated tags of stored runs of the same seeds to analyse together "
                        "(their common arms, scratch at least, must have identical losses), written under --tag")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.common import init_single_process

    init_single_process(args.threads)
    from ds_pseudo_real.data import ByteCorpus

    seeds = list(range(args.first_seed, args.first_seed + (args.seeds or (2 if args.quick else 3))))
    tag = args.tag if args.tag is not None else ("_quick" if args.quick else "")
    corpus = None if args.reanalyse else ByteCorpus(max_bytes=args.corpus_bytes)
    for regime in regimes(args):
        if args.reanalyse:
            if args.merge:
                stored = merge_stored([read_stored(args.out, regime.name, t) for t in args.merge.split(",")],
                                      args.merge.split(","))
            else:
                stored = read_stored(args.out, regime.name, tag)
            stored_regime = dict(stored["regime"], arms=[Arm(**a) for a in stored["regime"]["arms"]])
            complete = [r for r in stored["runs"] if r["seed"] in stored["seeds"]]
            run_regime(Regime(**stored_regime), stored["seeds"], None, args.out, tag, complete,
                       stored["elapsed_s"], stored["machine"], stored.get("offload_model"), args.baseline)
        else:
            run_regime(regime, seeds, corpus, args.out, tag, baseline=args.baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
