"""GranularOffloadOptimizer under DeepSpeed ZeRO 0/1/2 on 1 and 2 gloo ranks: the same losses as training without
offload with the same Adam kernel, the bytes held and moved equal to the plan's, and exact checkpoint resumes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, free_port, run_two_ranks

SCRIPT = Path(__file__).with_name("run_training.py")
LEVELS = {"d": "device", "o": "host_optimizer", "p": "host_params"}


def results(stdout):
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def run_one_rank(*cases, tmp_path):
    # A port of its own: the pytest process may already hold MASTER_PORT for its own process group.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OFFLOAD_TEST_DIR": str(tmp_path), "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(SCRIPT), *cases], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return results(proc.stdout)


def check(result):
    stage, dtype, letters, *groups = result["case"].split(":")
    size = 4 // int(groups[0]) if groups else 1
    names = [f"layer{i * size}" for i in range(len(letters) - 1)] + ["other"]
    assert result["levels"] == {n: LEVELS[c] for n, c in zip(names, letters)}
    assert result["losses"][0] != result["losses"][-1]  # it trained
    assert result["losses"] == result["ref_losses"], "offloaded losses differ from no offload"
    assert result["params_equal"], "offloaded weights differ from no offload"
    assert result["held"] == {"device": result["plan"]["device"], "host": result["plan"]["host"]}
    assert result["moved"] == result["plan"]["moved"]
    assert result["peak_buffer"] == result["plan_buffer"]
    assert result["after_reload"] == result["after_save"], "resume in the same engine left the trajectory"
    assert result["after_load"] == result["after_save"], "resume in a fresh engine left the trajectory"


# real model at every level; pseudo models (":G" = 4 layers sharing G parameter sets) fully and 2-way shared
ONE_RANK = ["0:fp32:dodoo", "1:fp32:dodoo", "2:fp32:oddod", "0:bf16:dodoo", "1:bf16:oddod", "2:bf16:dodoo",
            "0:fp32:dpopd", "0:fp32:po:1", "2:fp32:dod:2"]


DELINK = ["delink:0:pd:dpopd", "delink:2:od:doodd"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Every 1-rank case in one process (DeepSpeed's import and first initialize dominate a small case)."""
    out = run_one_rank(*ONE_RANK, *DELINK, tmp_path=tmp_path_factory.mktemp("checkpoints"))
    assert [r["case"] for r in out] == ONE_RANK + DELINK
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


TWO_RANKS = ["0:fp32:dpopd", "1:fp32:oddod", "2:fp32:dodoo", "2:bf16:oddod", "1:fp32:od:1"]


def test_two_ranks_exact_accounted_and_resumable(tmp_path):
    proc = run_two_ranks(SCRIPT, *TWO_RANKS, env_extra={"OFFLOAD_TEST_DIR": str(tmp_path)})
    out = results(proc.stdout)
    assert sorted((r["case"], r["rank"]) for r in out) == sorted((c, r) for c in TWO_RANKS for r in (0, 1))
    for result in out:
        check(result)
    # ZeRO 2 over 2 ranks: each rank steps half of every group (8416 / 2 = 4208, 4160 / 2 = 2080)
    zero2 = next(r for r in out if r["case"] == "2:fp32:dodoo")
    assert zero2["plan"] == {"device": 2 * 8 * 4208, "host": 16 * (2 * 4208 + 2080), "moved": 8 * (2 * 4208 + 2080)}


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
