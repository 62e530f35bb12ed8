"""The benchmarks' arithmetic and code paths: clocks, steps-to-target, paired differences, the analysis of synthetic
runs, the M6 MoE layer against a direct computation, progressive stacking on a DeepSpeed engine, the M6-10T count,
the host step benchmark's arms.
No timing is asserted: speed figures are ratios the benchmarks measure side by side."""
import gzip
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import common, convergence  # noqa: E402


def test_cost_model_clock_charges_each_phase_its_cost():
    clock = common.cost_model_clock(["pseudo", "pseudo", "real", "real", "real"], {"pseudo": 0.5, "real": 2.0})
    assert clock == [0.5, 1.0, 3.0, 5.0, 7.0]
    with pytest.raises(KeyError, match="shallow"):
        common.cost_model_clock(["shallow"], {"real": 1.0})


def test_first_crossing_interpolates_and_reports_never():
    steps, losses = [0, 10, 20, 30], [3.0, 2.0, 1.5, 1.0]
    assert common.first_crossing(steps, losses, 1.75) == pytest.approx(15.0)
    assert common.first_crossing(steps, losses, 1.5) == pytest.approx(20.0)
    assert common.first_crossing(steps, losses, 3.5) == 0.0
    assert common.first_crossing(steps, losses, 0.9) is None
    # the FIRST crossing, even if the curve goes back up later
    assert common.first_crossing([0, 1, 2, 3], [2.0, 1.0, 3.0, 0.5], 1.2) == pytest.approx(0.8)


def test_value_at_interpolates_and_flags_a_curve_that_ended():
    assert common.value_at([0, 10, 20], [3.0, 2.0, 1.0], 15) == (pytest.approx(1.5), False)
    assert common.value_at([0, 10, 20], [3.0, 2.0, 1.0], 20) == (1.0, False)
    assert common.value_at([0, 10, 20], [3.0, 2.0, 1.0], 25) == (1.0, True)


def test_paired_differences_match_seed_by_seed():
    arm = {0: 1.70, 1: 1.80, 2: None}
    base = {0: 1.75, 1: 1.78, 2: 1.70, 3: 1.60}
    out = common.paired_differences(arm, base)
    assert out["seeds"] == [0, 1]
    assert out["differences"] == pytest.approx([-0.05, 0.02])
    assert out["mean"] == pytest.approx(-0.015)
    assert out["std"] == pytest.approx(math.sqrt((0.035**2 + 0.035**2) / 1))
    assert out["negative"] == 1
    assert common.spread([None, None])["n"] == 0


def test_median_over_all_seeds_counts_a_seed_that_never_reached_as_infinitely_slow():
    assert common.spread([0.4, None, 0.6, 0.5])["median_all"] == pytest.approx(0.55)  # 0.4 0.5 0.6 inf
    assert common.spread([0.4, None, 0.6, 0.5])["mean"] == pytest.approx(0.5)  # the reached seeds only
    assert common.spread([0.4, None, None, 0.5])["median_all"] is None  # the median is infinite
    assert common.spread([0.7, None, None])["median_all"] is None
    assert common.spread([0.3, 0.9, 0.5])["median_all"] == pytest.approx(0.5)


def test_paired_statistics_t_and_sign_test():
    out = common.paired_differences({0: 0.9, 1: 0.8, 2: 1.3}, {0: 1.0, 1: 1.0, 2: 1.0})
    assert out["differences"] == pytest.approx([-0.1, -0.2, 0.3])
    assert out["t"] == pytest.approx(out["mean"] / (out["std"] / math.sqrt(3)))
    assert out["sign_p"] == pytest.approx(1.0)  # 2 of 3 below: 2 x P(X <= 1), X ~ Bin(3, 1/2) = 2 x 4/8, capped
    # 10 of 10 below: 2 / 2**10; 9 of 10: 2 x 11 / 2**10; ties leave the count
    assert common.sign_test_p(10, 0) == pytest.approx(2 / 1024)
    assert common.sign_test_p(9, 1) == pytest.approx(22 / 1024)
    assert common.sign_test_p(0, 0) is None
    assert common.paired_differences({0: 1.0}, {0: 1.5})["t"] is None


def test_select_arms_keeps_the_regime_order_and_requires_scratch():
    arms = convergence.memory_bound_arms(8, quick=False)
    chosen = convergence.select_arms(arms, "p2r@25% scale, scratch")
    assert [a.name for a in chosen] == ["scratch", "p2r@25% scale"]
    assert convergence.select_arms(arms, None) == arms
    with pytest.raises(SystemExit, match="--arms.*p2r@99%"):
        convergence.select_arms(arms, "scratch,p2r@99%")
    with pytest.raises(SystemExit, match="includes 'scratch'"):
        convergence.select_arms(arms, "p2r@10% scale")


def test_the_gpu_checks_convergence_arms_are_arms_of_the_regime_with_their_control():
    """A misspelt arm in benchmarks/gpu/check.sh would cost a device session its convergence part: every arm it
    names is one of the memory-bound regime's, its baseline is one of them, and each of its pseudo-to-real and
    growth arms has scratch on its budget beside it (the baseline, or the same-schedule scratch)."""
    import re

    script = (REPO / "benchmarks" / "gpu" / "check.sh").read_text()
    call = re.search(r'benchmarks/convergence\.py --regime memory_bound.*?--tag', script, re.S).group(0)
    names = re.search(r'--arms "([^"]+)"', call).group(1)
    baseline = re.search(r'--baseline "([^"]+)"', call).group(1)
    arms = convergence.memory_bound_arms(8, quick=False)
    chosen = convergence.select_arms(arms, names)
    by_name = {a.name: a for a in chosen}
    assert by_name[baseline].kind == "scratch" and by_name[baseline].budget == 5.0
    regime = convergence.Regime("t", 8, 8, 2, 4, 1, 160, 2e-3, 1, 1, 1, chosen)
    staged = [a for a in chosen if a.kind in ("pseudo_to_real", "stacking")]
    assert {a.kind for a in staged} == {"pseudo_to_real", "stacking"}
    assert all(convergence.same_schedule_scratch(regime, a) in chosen or a.budget == by_name[baseline].budget
               for a in staged)


def _run(arm, seed, evals, phases, step_s, switch=None):
    return {"arm": arm, "seed": seed, "switch_step": switch, "parameters": {"real": 10}, "transition": None,
            "phases": phases, "compute_s": step_s, "optimizer_s": [0.0] * len(step_s), "step_s": step_s,
            "train_loss": [0.0] * len(step_s), "eval_steps": [s for s, _ in evals], "val_loss": [v for _, v in evals]}


def test_analysis_of_synthetic_runs():
    """Scratch ends at 1.0 after 4 steps of 1 s; the arm reaches 1.0 at step 2 (pseudo steps cost 0.5 s, measured
    time 0.6 s): steps ratio 0.5, cost-model ratio (0.5 + 0.5) / 4, the jump at its switch is +0.2."""
    regime = convergence.Regime("t", 2, 8, 2, 4, 1, 4, 1e-3, 1, 1, 1, [convergence.Arm("scratch"),
                                convergence.Arm("p2r", "pseudo_to_real", 0.25)])
    scratch = _run("scratch", 0, [(0, 3.0), (1, 2.0), (2, 1.5), (3, 1.2), (4, 1.0)], ["real"] * 4, [1.0] * 4)
    arm = _run("p2r", 0, [(0, 3.0), (1, 1.2), (2, 1.0), (3, 0.9), (4, 0.8)], ["pseudo_g1", "pseudo_g1", "real", "real"],
               [0.6, 0.6, 1.0, 1.0], switch=1)
    clocks = {"wall": None, "cost": {"pseudo_g1": 0.5, "real": 1.0}}
    summary = convergence.analyse(regime, [scratch, arm], clocks)
    by = {e["arm"]["name"]: e for e in summary["arms"]}
    p2r = by["p2r"]
    assert p2r["steps_to_target"]["mean"] == pytest.approx(2.0)
    assert p2r["steps_to_target_ratio_to_scratch"]["mean"] == pytest.approx(0.5)
    assert p2r["cost_to_target"]["mean"] == pytest.approx(1.0)
    assert p2r["cost_to_target_ratio_to_scratch"]["mean"] == pytest.approx(0.25)
    assert p2r["wall_to_target"]["mean"] == pytest.approx(1.2)
    assert p2r["final_val"]["paired_minus_scratch"]["mean"] == pytest.approx(-0.2)
    # the arm's 4 steps cost 3 s: by scratch's total (4 s) it had ended, at its final loss
    assert p2r["cost_val_at_scratch_time"]["mean"] == pytest.approx(0.8)
    assert p2r["cost_ended_before_scratch_time"] == 1
    # equal time = the earlier end (3 s): the arm at 0.8, scratch at step 3 -> 1.2
    assert p2r["cost_equal_time_delta"]["mean"] == pytest.approx(-0.4)
    # scratch's own curve at its own total time
    assert by["scratch"]["cost_val_at_scratch_time"]["mean"] == pytest.approx(1.0)
    assert p2r["loss_jump"]["mean"] == pytest.approx(-0.2)  # highest val in the steps after the switch - val at it
    assert by["scratch"]["steps_to_target_ratio_to_scratch"]["mean"] == pytest.approx(1.0)


def test_analysis_against_a_strong_baseline():
    """``reference``: the targets and ratios are a longer scratch run's. Scratch x2 ends at 0.6 after 8 real steps
    (8 s); the arm (2 pseudo steps of 0.5 s, then 6 real ones: 7 s) reaches 0.6 at step 6 (5 s): 0.625 of the
    baseline's cost; the regime's scratch never reaches it; the seed without a baseline run is left out."""
    regime = convergence.Regime("t", 2, 8, 2, 4, 1, 4, 1e-3, 1, 1, 1, [
        convergence.Arm("scratch"), convergence.Arm("scratch x2", budget=2.0),
        convergence.Arm("p2r", "pseudo_to_real", 0.25, budget=2.0)])
    scratch = _run("scratch", 0, [(0, 3.0), (2, 1.5), (4, 1.0)], ["real"] * 4, [1.0] * 4)
    long = _run("scratch x2", 0, [(0, 3.0), (4, 1.0), (8, 0.6)], ["real"] * 8, [1.0] * 8)
    arm = _run("p2r", 0, [(0, 3.0), (2, 1.4), (4, 0.8), (6, 0.6), (8, 0.5)], ["pseudo_g1"] * 2 + ["real"] * 6,
               [0.5] * 2 + [1.0] * 6, switch=2)
    lone = _run("scratch", 1, [(0, 3.0), (4, 1.0)], ["real"] * 4, [1.0] * 4)  # seed 1: no baseline run
    clocks = {"cost": {"pseudo_g1": 0.5, "real": 1.0}}
    summary = convergence.analyse(regime, [scratch, long, arm, lone], clocks, reference="scratch x2")
    assert summary["reference"] == "scratch x2"
    by = {e["arm"]["name"]: e for e in summary["arms"]}
    p2r = by["p2r"]
    assert p2r["seeds"] == [0]
    assert p2r["steps_to_target"]["mean"] == pytest.approx(6.0)
    assert p2r["cost_to_target"]["mean"] == pytest.approx(5.0)
    assert p2r["cost_to_target_ratio_to_scratch"]["median_all"] == pytest.approx(5.0 / 8.0)
    assert p2r["final_val"]["paired_minus_scratch"]["mean"] == pytest.approx(-0.1)
    assert by["scratch"]["steps_to_target"]["missing"] == 1  # 160-step scratch never reaches the long run's loss
    assert by["scratch x2"]["cost_to_target_ratio_to_scratch"]["mean"] == pytest.approx(1.0)
    assert "vs_same_schedule_scratch" not in p2r and "pseudo_cost_for_half_time" not in p2r
    table = convergence.print_tables(regime, summary, list(clocks), clocks["cost"])
    assert "Δ vs scratch x2, paired" in table and "scratch x2's final loss" in table


def test_the_jump_at_a_switch_is_measured_from_the_model_the_switch_replaced():
    """A growth changes the model inside the switch step, so the loss evaluated after that step is already the grown
    model's: the jump is measured from the loss evaluated as the transition was decided (1.8), not from it (2.2)."""
    run = _run("stack", 0, [(0, 3.0), (1, 2.2), (2, 2.5), (3, 2.0)], ["shallow1", "real", "real"], [1.0] * 3,
               switch=1)
    assert convergence.loss_jump(run) == pytest.approx(0.3)  # a run stored without the loss before the switch
    run["val_before_transition"] = [[1, 1.8]]
    assert convergence.loss_jump(run) == pytest.approx(0.7)


def test_runs_evaluate_the_model_a_transition_replaces():
    """A delink leaves the loss as it was, bit for bit (fp32): the model evaluated as it is decided scores what the
    real model scores right after the switch step. A growth does not: the shallow model scores otherwise."""
    common.init_single_process()
    from ds_pseudo_real.data import ByteCorpus

    corpus = ByteCorpus(max_bytes=1 << 18)
    regime = convergence.Regime("t", 2, 16, 2, 8, 2, 6, 1e-2, 2, 3, 1, [])
    delinked = convergence.run_arm(regime, convergence.Arm("p2r", "pseudo_to_real", 0.34), 0, corpus, verbose=False)
    grown = convergence.run_arm(regime, convergence.Arm("stack 1->2", "stacking", 0.34, stack_depth=1), 0, corpus,
                                verbose=False)
    for run in (delinked, grown):
        assert run["switch_step"] == 2 and [s for s, _ in run["val_before_transition"]] == [2]
    after = {r["arm"]: dict(zip(r["eval_steps"], r["val_loss"]))[2] for r in (delinked, grown)}
    assert delinked["val_before_transition"][0][1] == after["p2r"]
    assert grown["val_before_transition"][0][1] != after["stack 1->2"]


def test_an_arm_on_a_longer_schedule_is_also_compared_with_scratch_on_that_schedule():
    """Scratch (4 steps) ends at 1.0, the target. Scratch on a schedule twice as long reaches 1.0 at step 3 (3 s);
    the arm on that schedule, pseudo until step 4 at 0.5 s a step, at step 2 (1 s): 1/3 of the same-schedule
    scratch's time, and half its 3 steps for a pseudo step of at most 0.75 of a real one. It ends 0.1 lower."""
    long_scratch = convergence.Arm("scratch budget 200%", budget=2.0)
    long_arm = convergence.Arm("p2r budget 200%", "pseudo_to_real", 0.5, budget=2.0)
    regime = convergence.Regime("t", 2, 8, 2, 4, 1, 4, 1e-3, 1, 1, 1,
                                [convergence.Arm("scratch"), long_scratch, long_arm])
    scratch = _run("scratch", 0, [(0, 3.0), (2, 1.5), (4, 1.0)], ["real"] * 4, [1.0] * 4)
    control = _run(long_scratch.name, 0, [(0, 3.0), (2, 2.0), (3, 1.0), (8, 0.6)], ["real"] * 8, [1.0] * 8)
    arm = _run(long_arm.name, 0, [(0, 3.0), (2, 1.0), (8, 0.5)], ["pseudo_g1"] * 4 + ["real"] * 4,
               [0.5] * 4 + [1.0] * 4, switch=4)
    arm["optimizer_s"] = [0.1] * 8
    summary = convergence.analyse(regime, [scratch, control, arm], {"cost": {"pseudo_g1": 0.5, "real": 1.0}})
    by = {e["arm"]["name"]: e for e in summary["arms"]}
    same = by[long_arm.name]["vs_same_schedule_scratch"]
    assert same["arm"] == long_scratch.name
    assert same["steps_to_target_ratio"]["per_seed"] == {0: pytest.approx(2 / 3)}
    assert same["cost_to_target_ratio"]["per_seed"] == {0: pytest.approx(1 / 3)}
    assert same["final_val_paired"]["mean"] == pytest.approx(-0.1)
    assert same["pseudo_cost_for_half_time"] == pytest.approx(0.75, abs=1e-9)
    # against the regime's scratch, as before: 1 s of its 4
    assert by[long_arm.name]["cost_to_target_ratio_to_scratch"]["per_seed"] == {0: pytest.approx(0.25)}
    assert "vs_same_schedule_scratch" not in by["scratch"] and "vs_same_schedule_scratch" not in by[long_scratch.name]


def test_stored_runs_of_the_same_seeds_merge_and_disagreeing_ones_do_not():
    scratch = _run("scratch", 0, [(0, 3.0), (4, 1.0)], ["real"] * 4, [1.0] * 4)
    a = _run("a", 0, [(0, 3.0), (4, 0.9)], ["real"] * 4, [1.0] * 4)
    b = _run("b", 0, [(0, 3.0), (4, 0.8)], ["real"] * 4, [1.0] * 4)

    def stored(runs, arms):
        return {"regime": {"arms": [{"name": n} for n in arms]}, "seeds": [0], "machine": {"commit": "x"},
                "elapsed_s": 1.0, "runs": runs}

    merged = convergence.merge_stored([stored([scratch, a], ["scratch", "a"]), stored([dict(scratch), b],
                                       ["scratch", "b"])], ["_1", "_2"])
    assert [arm["name"] for arm in merged["regime"]["arms"]] == ["scratch", "a", "b"]
    assert [r["arm"] for r in merged["runs"]] == ["scratch", "a", "b"] and merged["elapsed_s"] == 2.0
    assert set(merged["machine"]["merged_from"]) == {"_1", "_2"}
    other = dict(scratch, val_loss=[3.0, 1.1])
    with pytest.raises(SystemExit, match="scratch seed 0 has other losses in _2"):
        convergence.merge_stored([stored([scratch], ["scratch"]), stored([other], ["scratch"])], ["_1", "_2"])
    with pytest.raises(SystemExit, match="seeds"):
        convergence.merge_stored([stored([scratch], ["scratch"]), {**stored([scratch], ["scratch"]), "seeds": [1]}],
                                 ["_1", "_2"])


def test_results_are_stored_gzipped_and_reanalysed_from_either_form(tmp_path):
    """A results file is gzipped JSON (its per-step series are most of its bytes: rounded, and the step time, the
    sum of its parts, added back when read). --reanalyse and --merge read it, and the plain .json that runs stored
    before wrote, alike; what they write is gzipped too."""
    regime = convergence.Regime("dense", 2, 8, 2, 4, 1, 6, 1e-3, 1, 1, 1, [convergence.Arm("scratch"),
                                convergence.Arm("p2r", "pseudo_to_real", 0.5)])
    scratch = _run("scratch", 0, [(0, 3.0), (3, 1.5), (6, 1.0)], ["real"] * 6, [1.0] * 6)
    arm = _run("p2r", 0, [(0, 3.0), (3, 1.0), (6, 0.8)], ["pseudo_g1"] * 3 + ["real"] * 3, [0.5] * 3 + [1.0] * 3,
               switch=3)
    for run in (scratch, arm):
        run["optimizer_s"] = [0.1] * 6
        run["compute_s"] = [t - 0.1 for t in run["step_s"]]
    convergence.run_regime(regime, [0], None, tmp_path, "_new", [scratch, arm], machine={"commit": "x"})
    assert not (tmp_path / "convergence_dense_new.json").exists()
    new = json.loads(gzip.decompress((tmp_path / "convergence_dense_new.json.gz").read_bytes()))
    stored = [convergence.lean(scratch), convergence.lean(arm)]
    assert new["runs"] == stored and "step_s" not in stored[0] and (tmp_path / "convergence_dense_new.png").exists()
    assert convergence.read_stored(tmp_path, "dense", "_new")["runs"][1]["step_s"] == pytest.approx(arm["step_s"])
    only_scratch = {**new, "regime": {**new["regime"], "arms": new["regime"]["arms"][:1]}, "runs": [scratch]}
    (tmp_path / "convergence_dense_old.json").write_text(json.dumps(only_scratch))

    def reanalysed(*flags):
        convergence.main(["--regime", "dense", "--reanalyse", "--out", str(tmp_path), *flags])
        return json.loads(gzip.decompress((tmp_path / f"convergence_dense{flags[-1]}.json.gz").read_bytes()))

    old = reanalysed("--tag", "_old")
    assert old["runs"] == stored[:1] and [a["arm"]["name"] for a in old["summary"]["arms"]] == ["scratch"]
    merged = reanalysed("--merge", "_new,_old", "--tag", "_both")
    by = {e["arm"]["name"]: e for e in merged["summary"]["arms"]}
    assert merged["runs"] == stored
    assert by["p2r"]["final_val"]["paired_minus_scratch"]["mean"] == pytest.approx(-0.2)


def test_phase_medians_skip_first_and_switch_steps():
    run = _run("p2r", 0, [(0, 1.0)], ["pseudo_g1"] * 3 + ["real"] * 3, [9.0, 1.0, 50.0, 60.0, 2.0, 2.0], switch=3)
    assert convergence.phase_medians([run], "step_s") == {"pseudo_g1": 1.0, "real": 2.0}


def test_m6_moe_layer_equals_direct_per_token_computation():
    """With capacity for every token, each token's output is the sum over prototypes of its chosen expert's
    gated output (gate = its softmax score within the prototype)."""
    torch.manual_seed(0)
    moe_cls = common._moe_classes()[0]
    moe = moe_cls(d_model=8, ffn=16, num_experts=8, num_prototypes=2, capacity_factor=8.0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 5, 8)
    out = moe(x)
    flat = x.reshape(-1, 8)
    scores = torch.softmax(moe.router(flat).view(-1, 2, 4), dim=-1)
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for proto in range(2):
            e_local = int(scores[t, proto].argmax())
            e = proto * 4 + e_local
            h = torch.nn.functional.gelu(flat[t] @ moe.w1[e]) @ moe.w2[e]
            expected[t] += scores[t, proto, e_local] * h
    torch.testing.assert_close(out.reshape(-1, 8), expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert moe.w1.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_m6_moe_layer_drops_tokens_over_capacity():
    torch.manual_seed(0)
    moe = common._moe_classes()[0](d_model=4, ffn=4, num_experts=2, num_prototypes=1, capacity_factor=0.5)
    with torch.no_grad():
        torch.nn.init.normal_(moe.w1)  # the bare layer leaves its expert weights to the model's initializer
        torch.nn.init.normal_(moe.w2)
        moe.router.weight.zero_()
        moe.router.weight[0] += 1.0  # every token prefers expert 0 when its features sum positive
    x = torch.ones(1, 8, 4)
    out = moe(x)
    # capacity = ceil(0.5 * 8 / 2) = 2: only two of the eight tokens get an output
    assert int((out.abs().sum(-1) > 0).sum()) == 2


def test_the_stacking_arm_grows_through_the_plugins_schedule():
    """The stacking arm is a config choice: a 1-layer start grown after 2 steps into 2 layers by the plugin (layer 1
    = layer 0, Adam moments and step count carried, LR schedule position kept), and training goes on."""
    common.init_single_process()
    from ds_pseudo_real import ds_state
    from ds_pseudo_real.callbacks import TrainingCallback
    from ds_pseudo_real.data import ByteCorpus

    class BeforeGrowth(TrainingCallback):
        seen = {}

        def on_step_end(self, state, control):
            if control.should_delink:
                named = dict(engine.module.named_parameters())
                self.seen.update(weights={n: p.detach().clone() for n, p in named.items()},
                                 moments=ds_state.full_moments(engine.engine, named["layers.0.fc.weight"]),
                                 lr=engine.optimizer.param_groups[0]["lr"])

    regime = convergence.Regime("t", 2, 16, 2, 8, 2, 6, 1e-2, 2, 3, 1, [])
    arm = convergence.Arm("stack 1->2", "stacking", 0.34, stack_depth=1)
    engine = convergence.build_engine(regime, 2, 0, convergence.stacking_ptr(arm, 2))
    engine.callbacks.callbacks.append(BeforeGrowth())
    assert len(engine.module.layers) == 1
    corpus = ByteCorpus(max_bytes=1 << 18)
    for step in range(2):
        x, y = corpus.batch("train", 2, 8, seed=0, step=step)
        engine.backward(engine(x, y))
        engine.step()
    seen = BeforeGrowth.seen
    params = dict(engine.module.named_parameters())
    assert len(engine.module.layers) == 2 and engine.global_steps == 2 and engine.last_transition["layers_after"] == 2
    torch.testing.assert_close(params["layers.1.fc.weight"], seen["weights"]["layers.0.fc.weight"], rtol=0, atol=0)
    torch.testing.assert_close(params["tok_emb.weight"], seen["weights"]["tok_emb.weight"], rtol=0, atol=0)
    carried = ds_state.full_moments(engine.engine, params["layers.1.fc.weight"])
    torch.testing.assert_close(carried["exp_avg_sq"], seen["moments"]["exp_avg_sq"], rtol=0, atol=0)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(seen["lr"])
    x, y = corpus.batch("train", 2, 8, seed=0, step=2)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 3
    assert not torch.equal(params["layers.1.fc.weight"], params["layers.0.fc.weight"])
    engine.engine.destroy()


def test_memory_bound_smoke_trains_through_granular_offload_as_planned():
    """A 2-layer MoE at the memory-bound budget rule: the pseudo model fits on the device, the real one does not.
    Scratch and Pseudo-to-Real train through ``granular_offload``; the bytes the optimizer holds and moves in each
    phase equal the plan's, the delink recomputes the plan, and the offload clock adds the plan's transfer."""
    common.init_single_process()
    from ds_pseudo_real.data import ByteCorpus

    arms = [convergence.Arm("scratch"), convergence.Arm("p2r@50% scale", "pseudo_to_real", 0.5)]
    regime = convergence.Regime("memory_bound", 2, 16, 2, 8, 2, 4, 1e-2, 1, 2, 1, arms,
                                moe=dict(num_experts=8, num_prototypes=2, ffn=16, capacity_factor=1.25,
                                         balance_coeff=0.01),
                                offload=dict(bandwidth_gbps=10.0, budget_fraction=0.5))
    regime.offload.update(convergence.offload_budget(regime))
    budget = regime.offload
    assert budget["pseudo_resident_bytes"] < budget["budget_bytes"] < budget["real_resident_bytes"]
    corpus = ByteCorpus(max_bytes=1 << 18)
    runs = [convergence.run_arm(regime, arm, 0, corpus, verbose=False) for arm in arms]
    scratch, p2r = runs
    assert list(scratch["offload"]) == ["real"] and list(p2r["offload"]) == ["pseudo_g1", "real"]
    pseudo, real = p2r["offload"]["pseudo_g1"], p2r["offload"]["real"]
    assert pseudo["plan"]["level_counts"]["device"] == 2 and pseudo["moved_bytes_per_step"] == [0]
    assert real["plan"]["level_counts"]["host_optimizer"] == 1
    assert real["plan"]["levels"] == scratch["offload"]["real"]["plan"]["levels"]
    for record in (pseudo, real, scratch["offload"]["real"]):
        plan = record["plan"]
        assert record["moved_bytes_per_step"] == [plan["moved_bytes_per_step"]]
        assert record["held_bytes"] == {"device": plan["optimizer_device_bytes"], "host": plan["optimizer_host_bytes"]}
        assert record["matches_plan"]
    # a host_optimizer group moves its fp32 gradient to the host and its fp32 master back: 8 bytes per parameter
    host_numel = real["plan"]["optimizer_host_bytes"] // 16  # master + gradient buffer + two moments, fp32
    assert real["plan"]["moved_bytes_per_step"] == 8 * host_numel > 0
    costs = convergence.offload_step_costs(regime, runs, {"pseudo_g1": 1.0, "real": 2.0})
    assert costs["phases"]["real"]["step_s"] == pytest.approx(2.0 + real["plan"]["moved_bytes_per_step"] / 10e9)
    assert costs["phases"]["pseudo_g1"]["step_s"] == 1.0
    assert costs["phases"]["real"]["runs_matching_plan"] == 2


def test_delink_benchmark_m6_10t_host_figure_from_the_parameter_counts():
    from benchmarks import delink

    plan = delink.m6_10t_plan_only()
    # 48 layers x (14,684,160 dense + 10,240 / 512 experts x 20,447,232) + 22,161,408 embedding parameters
    assert plan["layer_parameters_per_rank"] == 14_684_160 + 20 * 20_447_232 == 423_628_800
    assert plan["rank_real_parameters"] == 22_161_408 + 48 * 423_628_800 == 20_356_343_808
    gathered = 12 * (22_161_408 + 423_628_800)  # fp32 weights and two moments of the rank's pseudo parameters
    assert plan["host_bytes_per_rank_fp32_host_build"] == 4 * 20_356_343_808 + gathered
    assert plan["host_bytes_per_rank_bf16_host_build"] == 2 * 20_356_343_808 + gathered
    assert plan["host_bytes_per_rank_today"] == gathered
    assert plan["host_bytes_per_node_today"] == 8 * plan["host_bytes_per_rank_today"]
    # the real stage trains through granular offload (it cannot fit 32 GiB GPUs): the planner's host bytes, with
    # the gathered state beside them, against 1.2x of them plus one fp32 layer
    assert plan["real_stage_levels"]["host_params"] > 0
    real_host = plan["real_stage_host_bytes_per_rank"]
    assert real_host > 2 * plan["rank_real_parameters"]  # at least the host layers' bf16 parameters
    assert plan["peak_host_bytes_per_rank"] == real_host + gathered
    assert plan["goal_host_bytes_per_rank"] == 1.2 * real_host + 4 * 423_628_800
    assert plan["peak_host_bytes_per_rank"] < plan["goal_host_bytes_per_rank"]
    assert delink.rss_bytes() > 0 and delink.rss_bytes("VmHWM") >= delink.rss_bytes()


def test_the_pseudo_step_cost_an_arm_needs_for_the_2x_goal():
    """Seed i's clock ratio is (switch x r + steps - switch) / total: with steps 100, 110 and never at a switch at 40
    of 160, the median is the 110 seed's, (40 r + 70) / 160 <= 0.5 for r <= 0.25."""
    from benchmarks.convergence import pseudo_cost_for_goal

    assert pseudo_cost_for_goal([100.0, 110.0, None], [40, 40, 40], 160) == pytest.approx(0.25, abs=1e-9)
    # free pseudo steps are not enough when the real steps alone take over half of scratch's time
    assert pseudo_cost_for_goal([130.0, 140.0, 150.0], [40, 40, 40], 160) is None
    # a seed that never reaches the target pulls the median up: two of three never
    assert pseudo_cost_for_goal([60.0, None, None], [40, 40, 40], 160) is None
    assert pseudo_cost_for_goal([50.0, 60.0], [40, 40], 160) == 1.0  # any pseudo cost up to a real step's


def test_a_target_reached_before_the_switch_costs_only_the_pseudo_steps_taken():
    """A pseudo phase longer than scratch's run (budget above 1) may reach scratch's final loss before it delinks:
    120 pseudo steps of a 320-step pseudo phase cost 120 r, so r <= 2/3 gives half of scratch's 160 steps, and free
    pseudo steps give 0 (not the 320 pseudo steps the run had not taken, nor a negative count of real steps)."""
    from benchmarks.convergence import pseudo_cost_for_goal, steps_in_real_steps

    assert pseudo_cost_for_goal([120.0], [320], 160) == pytest.approx(2 / 3, abs=1e-9)
    assert steps_in_real_steps(120.0, 320, 0.0) == 0.0
    assert steps_in_real_steps(120.0, 320, 0.5) == 60.0
    assert steps_in_real_steps(400.0, 320, 0.5) == 160 + 80  # 320 pseudo steps at half a real one, then 80 real
    assert steps_in_real_steps(None, 320, 0.5) is None


def test_the_host_step_arms_train_every_layer_at_host_params_under_zero_1_as_planned():
    """An arm with a ``host_step`` trains at ZeRO 1 with every layer at host_params (the layers the offload steps
    itself), in phases of their own (not pooled with the regime's planned placement): its bytes held and moved are
    the plan's, the delayed one's with its second gradient buffer and fp32 master; one step late from the first
    step, the delayed arm's first loss is the sequential one's and its later ones are not."""
    common.init_single_process()
    from ds_pseudo_real.data import ByteCorpus

    sequential = convergence.Arm("scratch host_params sequential", host_step="sequential")
    delayed = convergence.Arm("scratch host_params delayed from 0", host_step="delayed", delayed_from_step=0)
    regime = convergence.Regime("memory_bound", 2, 16, 2, 8, 2, 4, 1e-2, 1, 2, 1,
                                [convergence.Arm("scratch"), sequential, delayed],
                                moe=dict(num_experts=8, num_prototypes=2, ffn=16, capacity_factor=1.25,
                                         balance_coeff=0.01),
                                offload=dict(bandwidth_gbps=10.0, budget_fraction=0.5))
    regime.offload.update(convergence.offload_budget(regime))
    config = convergence.ds_config(regime, {}, delayed)
    assert config["zero_optimization"] == {"stage": 1}
    assert config["granular_offload"]["levels"] == {"0": "host_params", "1": "host_params", "other": "device"}
    assert (config["granular_offload"]["host_step"], config["granular_offload"]["delayed_from_step"]) == ("delayed", 0)
    assert "granular_offload" in convergence.ds_config(regime, {}) and "zero_optimization" in config
    corpus = ByteCorpus(max_bytes=1 << 18)
    runs = [convergence.run_arm(regime, arm, 0, corpus, verbose=False) for arm in (sequential, delayed)]
    for run in runs:
        assert set(run["phases"]) == {"real host_params"}
        record = run["offload"]["real host_params"]
        assert record["plan"]["level_counts"] == {"device": 1, "host_optimizer": 0, "host_params": 2}
        assert record["matches_plan"], record
    import torch

    with torch.device("meta"):
        model = common.build_gpt(regime.n_layer, regime.d_model, regime.n_head, regime.seq_len, regime.moe)
    layer_numel = sum(p.numel() for p in model.layers.parameters())
    held = [run["offload"]["real host_params"]["held_bytes"]["host"] for run in runs]
    assert held[1] - held[0] == 8 * layer_numel  # a second gradient buffer and an fp32 master, 4 B each
    assert runs[1]["train_loss"][0] == runs[0]["train_loss"][0]
    assert runs[1]["train_loss"][1:] != runs[0]["train_loss"][1:]


def test_a_budgeted_arm_trains_its_fraction_of_the_steps_on_a_schedule_fitted_to_them():
    """budget 0.5 of 8 steps: 4 steps, the warmup + cosine schedule planned for those 4 (not halfway down one
    planned for 8), the switch at 25 % of the 4; scratch keeps the regime's 8, and the analysis costs the arm's own
    phases."""
    common.init_single_process()
    from ds_pseudo_real.data import ByteCorpus

    arm = convergence.Arm("p2r@25% budget 50%", "pseudo_to_real", 0.25, budget=0.5)
    regime = convergence.Regime("t", 2, 16, 2, 8, 2, 8, 1e-2, 1, 2, 1, [convergence.Arm("scratch"), arm])
    fitted = convergence.arm_regime(regime, arm)
    assert (fitted.steps, regime.steps, convergence.arm_regime(regime, regime.arms[0]) is regime) == (4, 8, True)
    assert convergence.ds_config(fitted, {})["scheduler"]["params"]["total_num_steps"] == 4
    corpus = ByteCorpus(max_bytes=1 << 18)
    runs = [convergence.run_arm(regime, a, 0, corpus, verbose=False) for a in regime.arms]
    assert [len(r["phases"]) for r in runs] == [8, 4]
    assert runs[1]["switch_step"] == 1 and runs[1]["phases"] == ["pseudo_g1", "real", "real", "real"]
    summary = convergence.analyse(regime, runs, {"cost": {"pseudo_g1": 1.0, "real": 2.0}})
    entry = summary["arms"][1]
    assert entry["switch_step"] == 1 and entry["cost_total"]["per_seed"][0] == 1.0 + 3 * 2.0


def test_an_arm_with_another_peak_lr_trains_at_it_and_is_compared_with_scratch_at_it():
    """lr x2: the arm's config has twice the regime's peak LR on the regime's schedule; a variant at lr x2 on a
    longer schedule has for control the scratch arm at lr x2 on that schedule, not the one at the regime's LR."""
    fast = convergence.Arm("scratch lr x2", lr_scale=2.0)
    long_plain = convergence.Arm("scratch budget 200%", budget=2.0)
    long_fast = convergence.Arm("scratch budget 200% lr x2", budget=2.0, lr_scale=2.0)
    arm = convergence.Arm("p2r budget 200% lr x2", "pseudo_to_real", 0.5, budget=2.0, lr_scale=2.0)
    arm_short = convergence.Arm("p2r lr x2", "pseudo_to_real", 0.1, lr_scale=2.0)
    regime = convergence.Regime("t", 2, 16, 2, 8, 2, 8, 1e-2, 1, 2, 1,
                                [convergence.Arm("scratch"), fast, long_plain, long_fast, arm, arm_short])
    params = lambda a: convergence.ds_config(convergence.arm_regime(regime, a), {})  # noqa: E731
    assert params(fast)["optimizer"]["params"]["lr"] == 2e-2
    assert params(fast)["scheduler"]["params"]["total_num_steps"] == 8
    assert params(arm)["optimizer"]["params"]["lr"] == 2e-2 and params(arm)["scheduler"]["params"]["total_num_steps"] == 16
    assert params(long_plain)["optimizer"]["params"]["lr"] == 1e-2
    assert convergence.same_schedule_scratch(regime, arm) is long_fast
    assert convergence.same_schedule_scratch(regime, arm_short) is fast
    assert convergence.same_schedule_scratch(regime, fast) is None


def test_the_delink_timing_reports_each_delink_against_one_and_three_copies(tmp_path):
    """benchmarks/overhead.py --delink-only at a tiny size: every delink of the run timed with its phases, beside
    one and three clones of the real parameters, and the real model it built of the right size."""
    from benchmarks import overhead
    from ds_pseudo_real.models import GPT, GPTConfig

    assert overhead.main(["--delink-only", "--big-layers", "3", "--big-d-model", "128", "--delinks", "2",
                          "--copy-repeats", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "overhead_delink.json").read_text())["delink"]
    real = sum(p.numel() for p in GPT(GPTConfig(seq_len=8, n_layer=3, d_model=128, n_head=1)).parameters())
    assert result["real_parameters"] == result["parameters_after"] == real
    assert len(result["delinks_s"]) == len(result["delinks_phases"]) == 2 and len(result["three_copies_s_all"]) == 2
    assert all(list(phases) == ["gather", "release", "starts", "model", "engine", "masters", "carry"]
               for phases in result["delinks_phases"])
    assert result["last_delink_over_three_copies"] == pytest.approx(
        result["delinks_s"][1] / result["three_copies_s_median"])


def test_the_layouts_benchmark_reads_each_pass_of_its_run():
    """benchmarks/layouts.py: a real layout as Megatron-LM's flags, and tokens/s per pass from Megatron's own time
    per iteration, past the warm-up (the run itself is measured, not timed here)."""
    from benchmarks import layouts
    from megatron_patches.run import parse_layout

    assert layouts.layout_flags(parse_layout("tp=2,sp=1")) == ["--tensor-model-parallel-size", "2",
                                                               "--sequence-parallel"]
    assert layouts.layout_flags(parse_layout("pp=2,sp=0")) == ["--pipeline-model-parallel-size", "2"]
    line = " iteration {i}/ 4 | consumed samples: 8 | elapsed time per iteration (ms): {ms} | lm loss: 5.1E+00 |\n"
    log = "".join(f"{layouts.PASS_MARK}{n}\n" + "".join(line.format(i=i, ms=ms) for i, ms in enumerate(times, 1))
                  for n, times in enumerate([[900.0, 100.0, 120.0, 110.0], [950.0, 200.0, 260.0, 240.0]]))
    measured = layouts.tokens_per_second(log, passes=2, warmup=1, tokens_per_iteration=1000)
    assert [m["iteration_ms"] for m in measured] == [110.0, 240.0]
    assert [m["tokens_per_s"] for m in measured] == pytest.approx([1000 / 0.110, 1000 / 0.240])
    with pytest.raises(RuntimeError, match="pass 0: no iteration after the 4 warm-up ones"):
        layouts.tokens_per_second(log, passes=2, warmup=4, tokens_per_iteration=1000)


@pytest.mark.parametrize("clip,dtype", [(0.0, "fp32"), (1e-6, "fp32"), (0.0, "bf16")],
                         ids=["no_clipping", "clipping_every_step", "bf16"])
def test_the_host_step_benchmark_compares_arms_on_the_same_losses(tmp_path, clip, dtype):
    """A tiny run of benchmarks/host_step.py: the sequential and overlapped arms give the same losses; without
    clipping every own group after the first step is stepped during the backward, with a norm that clips every step
    the first step ahead is redone and the later ones are held sequential. The delayed arm steps every step late,
    and its losses differ."""
    import os
    import subprocess

    out = tmp_path / "host_step.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    flags = ["--hidden", "64", "--layers", "2", "--vocab", "64", "--rounds", "2", "--block", "2", "--clip", str(clip),
             "--dtype", dtype, "--arms", "sequential", "overlapped", "delayed", "--triad-numel", str(2**18),
             "--out", str(out)]
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_step.py"), *flags], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows, bandwidth = result["rows"], result["memory_bandwidth"]
    assert 0 < bandwidth["one_thread_gb_per_s"] and 0 < bandwidth["two_threads_gb_per_s"]
    assert bandwidth["two_over_one"] == bandwidth["two_threads_gb_per_s"] / bandwidth["one_thread_gb_per_s"]
    assert "two bandwidth-bound streams overlapped take at least" in proc.stdout
    assert rows["overlapped"]["losses"] == rows["sequential"]["losses"]
    assert rows["overlapped"]["losses_equal_to_sequential"]
    overlapped, delayed = rows["overlapped"], rows["delayed"]
    assert delayed["steps_delayed"] == (1 + 2) * 2  # every step of (warm-up + 2 rounds) x 2-step blocks
    assert not delayed["losses_equal_to_sequential"] and delayed["max_loss_difference"] > 0
    assert overlapped["steps_delayed"] is None
    if clip:
        assert overlapped["redone"] == overlapped["stepped_ahead"] > 0 and overlapped["held"] > 0
    else:
        assert overlapped["stepped_ahead"] > 0 and overlapped["redone"] == overlapped["held"] == 0
