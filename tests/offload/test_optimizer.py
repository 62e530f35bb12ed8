"""GranularOffloadOptimizer under DeepSpeed ZeRO 0/1/2 on 1 and 2 gloo ranks, dense and with DeepSpeed MoE experts
placed per layer, fp32, bf16 and fp16 (dynamic loss scaling, ZeRO 1/2): the same losses and loss scaler states as
training without offload with the same Adam kernel, the bytes held and moved equal to the plan's (in total and per
group), and exact checkpoint resumes. In fp16 an inf in one rank's gradient, in a device, host_optimizer or own
group, makes every rank skip the step and halve the scale, as without offload.

host_params layers under ZeRO 1/2 or bf16 are stepped outside DeepSpeed's optimizer (own groups): bit for bit the
no-offload run without gradient clipping (``@clip0``); with DeepSpeed's default clipping (1.0) their gradient norm
joins DeepSpeed's global norm in another summation order, so losses, norms and weights agree to float rounding."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from case_runs import results
from conftest import CPU_FP16, REPO, free_port, python_path, run_two_ranks

SCRIPT = Path(__file__).with_name("run_training.py")
LEVELS = {"d": "device", "o": "host_optimizer", "p": "host_params"}
EXPERTS = 4 * (32 * 64 + 64 + 64 * 32 + 32)  # expert parameters per MoE layer of TinyLM(ep_size=...): 16768


def run_one_rank(*cases, tmp_path):
    # A port of its own: the pytest process may already hold MASTER_PORT for its own process group.
    env = {**os.environ, "PYTHONPATH": python_path(), "OFFLOAD_TEST_DIR": str(tmp_path),
           "MASTER_PORT": str(free_port()), **CPU_FP16}
    proc = subprocess.run([sys.executable, str(SCRIPT), *cases], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return results(proc.stdout)


def expected_levels(case):
    case = case.partition("@clip")[0]
    if case.startswith("moe:"):
        _, _, _, letters, experts = case.split(":")
        names = [f"layer{i}" for i in range(len(letters) - 1)] + [f"layer{i}.experts" for i in range(len(experts))]
        return {**{n: LEVELS[c] for n, c in zip(names, letters[:-1] + experts)}, "other": LEVELS[letters[-1]]}
    stage, dtype, letters, *groups = case.split(":")
    size = 4 // int(groups[0]) if groups else 1
    names = [f"layer{i * size}" for i in range(len(letters) - 1)] + ["other"]
    return {n: LEVELS[c] for n, c in zip(names, letters)}


def check(result):
    assert result["levels"] == expected_levels(result["case"])
    assert result["own_groups"] == ([name for name, level in result["levels"].items() if level == "host_params"]
                                    if outside_deepspeed(result["case"]) else [])
    assert result["losses"][0] != result["losses"][-1]  # it trained
    if result["own_groups"] and result["clipping"] != 0:
        assert result["ref_norms"][0] > 1.0, "the case is meant to clip"
        assert result["norms"] == pytest.approx(result["ref_norms"], rel=1e-6), "own gradients missing in the norm"
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-6)
        assert result["params_max_diff"] < (1e-5 if stage_dtype(result["case"])[1] == "fp32" else 2**-7)
    else:
        assert result["losses"] == result["ref_losses"], "offloaded losses differ from no offload"
        assert result["params_equal"], "offloaded weights differ from no offload"
        if result["own_groups"]:  # reported, not applied: joined to DeepSpeed's norm in another order
            assert result["norms"] == pytest.approx(result["ref_norms"], rel=1e-6)
        else:
            assert result["norms"] == result["ref_norms"]
    assert result["held"] == {"device": result["plan"]["device"], "host": result["plan"]["host"]}
    assert result["moved"] == result["plan"]["moved"]
    for name, plan in result["plan_by_group"].items():
        assert result["held_by_group"][name] == {"device": plan["device"], "host": plan["host"]}, name
        if result["levels"][name] != "host_params":  # a host_params group's fetches are the store's, not counted here
            assert result["moved_by_group"].get(name, 0) == plan["moved"], name
    assert result["peak_buffer"] == result["plan_buffer"]
    # streamed gradients (ZeRO 1/2): one parameter's at a time on the device, within the plan's one-layer bound
    assert 0 < result["peak_streamed"] <= result["plan_streamed"] if streams(result["case"]) and result["own_groups"] \
        else result["peak_streamed"] == result["plan_streamed"] == 0
    assert result["after_reload"] == result["after_save"], "resume in the same engine left the trajectory"
    assert result["after_load"] == result["after_save"], "resume in a fresh engine left the trajectory"
    # the loss scaler (fp16's dynamic scale; a constant 1 otherwise) as without offload, step by step, and resumed
    assert result["scales"] == result["ref_scales"]
    after = result["scales_after"]
    assert after["reload"] == after["load"] == after["save"]
    if stage_dtype(result["case"])[1] == "fp16":  # 2**8, doubled after every 2 steps without overflow
        assert [s["cur_scale"] for s in result["scales"] + after["save"]] == [2**8, 2**8, 2**9, 2**9, 2**10, 2**10]


def check_overflow(result):
    """An ``overflow:`` case on one rank: the inf in the last rank's gradient at OVERFLOW_AT (step 2 of 0..3) makes
    every rank skip that step, leave its weights as they were and halve the scale (hysteresis 1), with and without
    offload alike, bit for bit."""
    for arm in ("ref", "granular"):
        run = result[arm]
        assert run["skipped"] == [0, 0, 1, 1], (arm, run["skipped"])
        assert [s["cur_scale"] for s in run["scales"]] == [2**8, 2**8, 2**7, 2**7], (arm, run["scales"])
        assert result["unchanged_at_overflow"][arm], arm
    assert result["granular"]["losses"] == result["ref"]["losses"]
    assert result["granular"]["scales"] == result["ref"]["scales"]
    assert all(result["weights_equal"]), result["weights_equal"]


def stage_dtype(case):
    body = case.partition("@clip")[0]
    if body.startswith("moe:"):  # the MoE model trains in fp32
        return int(body.split(":")[1]), "fp32"
    stage, dtype = body.split(":")[:2]
    return int(stage), dtype


def outside_deepspeed(case):
    """host_params groups are the optimizer's own (ZeRO 1/2 or bf16); fp32 ZeRO 0 keeps them in DeepSpeed's."""
    if case.startswith("delink:"):
        return False
    stage, dtype = stage_dtype(case)
    return stage >= 1 or dtype != "fp32"


def streams(case):
    return outside_deepspeed(case) and stage_dtype(case)[0] >= 1


# real model at every level; pseudo models (":G" = 4 layers sharing G parameter sets) fully and 2-way shared;
# host_params under every ZeRO stage and dtype, with DeepSpeed's default clipping and without (@clip0)
ONE_RANK = ["0:fp32:dodoo", "1:fp32:dodoo", "2:fp32:oddod", "0:bf16:dodoo", "1:bf16:oddod", "2:bf16:dodoo",
            "0:fp32:dpopd", "0:fp32:po:1", "2:fp32:dod:2",
            "1:fp32:dpopd@clip0", "2:fp32:pdpod@clip0", "1:fp32:dpopd", "2:fp32:pdpod", "0:bf16:pdodd@clip0",
            "0:bf16:pdodd", "1:bf16:pdpod", "2:bf16:dpdpd@clip0", "2:fp32:po:1@clip0", "1:fp32:ppd:2@clip0",
            # fp16 with dynamic loss scaling (the scale changes within the case): every level, own groups included
            "1:fp16:pdpod@clip0", "2:fp16:dpopd@clip0"]


DELINK = ["delink:0:pd:dpopd", "delink:2:od:doodd", "delink:1:pd:dpopd"]  # ZeRO 1: host_params outside DeepSpeed
# MoE model (4 experts in 2 prototypes per layer, ep_size 1): dense letters per layer + other, then experts per layer
MOE_ONE_RANK = ["moe:0:1:ddddd:oddo", "moe:1:1:dodod:dooo", "moe:2:1:ddddo:odod",
                # experts at host_params, fetched with their layer: in DeepSpeed's optimizer (fp32 ZeRO 0), and
                # outside it (ZeRO 1/2; one layer's experts stay inside, as DeepSpeed needs an MoE group)
                "moe:0:1:pdddd:pdpo", "moe:1:1:pdpdd:ppdp@clip0", "moe:2:1:dpddd:ppod@clip0", "moe:2:1:dpddd:ppod"]
# the MoE model's shared set with its experts on the host, delinked into a plan with layers 0 and 3's experts there
# and, under ZeRO 2, into a plan with layer 0's dense part and two layers' experts at host_params
MOE_DELINK = ["delink:1:dd:ddddd:o:oddo", "delink:2:dd:pdddd:o:dppd"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Every 1-rank case in one process (DeepSpeed's import and first initialize dominate a small case)."""
    out = run_one_rank(*ONE_RANK, *DELINK, *MOE_ONE_RANK, *MOE_DELINK, tmp_path=tmp_path_factory.mktemp("checkpoints"))
    assert [r["case"] for r in out] == ONE_RANK + DELINK + MOE_ONE_RANK + MOE_DELINK
    return {r["case"]: r for r in out}


def test_one_rank_exact_accounted_and_resumable(one_rank):
    out = [one_rank[case] for case in ONE_RANK]
    for result in out:
        check(result)
    # 4 layers of 8416 + 4160 other params, fp32 ZeRO 0: moments 8 B per param on the device for device groups,
    # master + grad buffer + moments 16 B per param on the host for the others
    first = out[0]
    assert first["plan"] == {"device": 2 * 8 * 8416, "host": 16 * (2 * 8416 + 4160), "moved": 8 * (2 * 8416 + 4160)}
    # fully shared pseudo model, its one layer set at host_params: fetched for each of the 4 layers' forward and
    # backward (2 * 4 * 4 B per param) plus its gradient (4 B); the rest at host_optimizer (8 B); the device holds
    # two copies of the set at most (the layer running and the next one)
    pseudo = next(r for r in out if r["case"] == "0:fp32:po:1")
    assert pseudo["plan"]["moved"] == (4 + 2 * 4 * 4) * 8416 + 8 * 4160
    assert pseudo["peak_buffer"] == 2 * 4 * 8416
    # bf16 host_params outside DeepSpeed: the host holds bf16 params, an fp32 master, a gradient buffer and moments
    # (2 + 4 + 4 + 8 B per param); per step the gradient comes out in fp32 and the params go in twice (4 + 2 * 2)
    for case, device_grads in (("1:bf16:pdpod", 0), ("0:bf16:pdodd", 2 * 8416)):
        plan = one_rank[case]["plan_by_group"]["layer0"]
        assert (plan["host"], plan["moved"]) == (18 * 8416, 8 * 8416), case
        placed = next(p for p in one_rank[case]["plan_placements"] if p["name"] == "layer0")
        assert placed["device"] == device_grads, case  # ZeRO 0: the engine keeps (and all-reduces) the gradients
    # the 2-way shared pseudo model under ZeRO 1: each set streamed and stepped once per step, fetched 4 times
    shared = one_rank["1:fp32:ppd:2@clip0"]
    assert shared["own_groups"] == ["layer0", "layer2"]
    assert shared["plan_by_group"]["layer0"]["moved"] == (4 + 2 * 2 * 4) * 8416


TWO_RANKS = ["0:fp32:dpopd", "1:fp32:oddod", "2:fp32:dodoo", "2:bf16:oddod", "1:fp32:od:1",
             "moe:1:2:ddddo:dood", "moe:2:2:dodod:oddo",
             "1:fp32:dpopd@clip0", "2:fp32:pdpod", "2:fp32:po:1@clip0", "0:bf16:dpodd@clip0", "2:bf16:pdodd@clip0",
             # experts outside DeepSpeed's optimizer: reduced over their expert-data-parallel group (2 ranks at
             # ep_size 1, none at ep_size 2)
             "moe:1:1:pdddd:ppdo@clip0", "moe:2:2:dpdpd:dppo@clip0", "moe:2:2:dpdpd:dppo",
             # fp16: an inf on rank 1 alone in a device group (ZeRO 2), a host_optimizer group (ZeRO 1) and an own
             # host_params group (ZeRO 2, reduced over both ranks in fp16)
             "overflow:2:dopdd:layers.0.up.weight", "overflow:1:dopdd:layers.1.up.weight",
             "overflow:2:dopdd:layers.2.up.weight"]


def test_two_ranks_exact_accounted_and_resumable(tmp_path):
    proc = run_two_ranks(SCRIPT, *TWO_RANKS, env_extra={"OFFLOAD_TEST_DIR": str(tmp_path), **CPU_FP16})
    out = results(proc.stdout)
    assert sorted((r["case"], r["rank"]) for r in out) == sorted((c, r) for c in TWO_RANKS for r in (0, 1))
    for result in out:
        if result["case"].startswith("overflow:"):
            check_overflow(result)
            if result["case"].endswith("layers.2.up.weight"):
                assert result["granular"]["own_groups"] == ["layer2"]
        else:
            check(result)
    # ZeRO 2 over 2 ranks: each rank steps half of every group (8416 / 2 = 4208, 4160 / 2 = 2080)
    zero2 = next(r for r in out if r["case"] == "2:fp32:dodoo")
    assert zero2["plan"] == {"device": 2 * 8 * 4208, "host": 16 * (2 * 4208 + 2080), "moved": 8 * (2 * 4208 + 2080)}
    # ep_size 2: each rank holds 2 of the 4 experts (8384 params) and, its expert-data-parallel group being that
    # rank alone, steps all of them; the dense part of a layer (192) is still split over both ranks
    for result in (r for r in out if r["case"].startswith("moe:") and r["case"].split(":")[2] == "2"):
        check_experts(result, EXPERTS // 2)
        assert result["plan_by_group"]["layer0"] == {"device": 8 * 96, "host": 0, "moved": 0, "numel": 192}
    # ep_size 1: every rank holds all 4 experts; outside DeepSpeed's optimizer they are not partitioned (and
    # averaged over both ranks), inside it ZeRO splits them over the 2 ranks
    replicated = next(r for r in out if r["case"] == "moe:1:1:pdddd:ppdo@clip0")
    assert replicated["own_groups"] == ["layer0", "layer0.experts", "layer1.experts"]
    assert replicated["held_by_group"]["layer0.experts"] == {"device": 0, "host": 16 * EXPERTS}
    assert replicated["moved_by_group"]["layer0.experts"] == 4 * EXPERTS
    assert replicated["held_by_group"]["layer2.experts"] == {"device": 8 * EXPERTS // 2, "host": 0}


def check_experts(result, numel):
    """Each layer's expert group (``numel`` params on this rank, not partitioned further) holds and moves what its
    level says: host master + grad buffer + moments 16 B per param, gradient out and master back 8 B per step at
    host_optimizer; moments 8 B per param on the device and nothing moved at device."""
    for i, letter in enumerate(result["case"].partition("@clip")[0].split(":")[-1]):
        name = f"layer{i}.experts"
        assert result["plan_by_group"][name]["numel"] == numel
        if letter == "o":
            assert result["held_by_group"][name] == {"device": 0, "host": 16 * numel}
            assert result["moved_by_group"][name] == 8 * numel
        elif letter == "p":  # host params (the fp32 master) + gradient buffer + moments; the gradient comes out
            assert result["held_by_group"][name] == {"device": 0, "host": 16 * numel}
            assert result["moved_by_group"][name] == 4 * numel
        else:
            assert result["held_by_group"][name] == {"device": 8 * numel, "host": 0}
            assert name not in result["moved_by_group"]


def test_moe_experts_placed_per_layer(one_rank):
    """ZeRO 0/1/2, one rank, ep_size 1: expert groups at host_optimizer next to others on the device give the
    all-device losses and weights bit for bit (``check``), and hold and move what the plan predicts."""
    for case in MOE_ONE_RANK:
        check(one_rank[case])
        check_experts(one_rank[case], EXPERTS)


def test_replan_at_the_delink(one_rank):
    """Pseudo model (one shared set) with its plan, then delinked in the same process and re-planned: the real
    model's first loss equals the pseudo model's on the same batch, and the new optimizer holds and moves what the
    new plan says."""
    out = [one_rank[case] for case in DELINK]
    for result in out:
        assert result["real_losses"][0] == result["pseudo_loss"]
        assert result["held"] == {"device": result["plan"]["device"], "host": result["plan"]["host"]}
        assert result["moved"] == result["plan"]["moved"]
        assert list(result["levels"]) == ["layer0", "layer1", "layer2", "layer3", "other"]
    zero0 = out[0]
    assert zero0["pseudo_levels"] == {"layer0": "host_params", "other": "device"}
    # the pseudo model's one shared set on the host (params + grad buffer + moments, 16 B per param) vs the
    # real model's layers 1..3 on the host
    assert zero0["pseudo_plan_host"] == 16 * 8416 and zero0["plan"]["host"] == 3 * 16 * 8416


def test_moe_replan_at_the_delink(one_rank):
    """The MoE model: the pseudo plan's shared experts at host_optimizer, delinked and re-planned with two layers'
    experts there; the loss is continuous and the new optimizer holds and moves what the new plan says."""
    for case in MOE_DELINK:
        result = one_rank[case]
        assert result["real_losses"][0] == result["pseudo_loss"]
        assert result["held"] == {"device": result["plan"]["device"], "host": result["plan"]["host"]}
        assert result["moved"] == result["plan"]["moved"]
    fetched = one_rank[MOE_DELINK[1]]["levels"]
    assert [k for k, v in fetched.items() if v == "host_params"] == ["layer0", "layer1.experts", "layer2.experts"]
    result = one_rank[MOE_DELINK[0]]
    assert result["pseudo_levels"] == {"layer0": "device", "layer0.experts": "host_optimizer", "other": "device"}
    assert result["levels"] == expected_levels("moe:1:1:ddddd:oddo")
    assert result["held"] == {"device": result["plan"]["device"], "host": result["plan"]["host"]}
    assert result["moved"] == result["plan"]["moved"] == 2 * 8 * EXPERTS
    assert result["pseudo_plan_host"] == 16 * EXPERTS and result["plan"]["host"] == 2 * 16 * EXPERTS
