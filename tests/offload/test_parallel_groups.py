"""Groups the offload optimizer steps itself (host_params outside DeepSpeed's optimizer, ZeRO 1/2) are reduced as
DeepSpeed reduces its own (issue 13, defect 6): dense gradients averaged over DeepSpeed's data-parallel group, not
over the world (2 ranks whose data-parallel groups are one rank each), and experts summed over their
expert-data-parallel group and divided by the data-parallel size (an M6 model with ep_size 2 on 2 ranks). Either way
the losses and weights equal DeepSpeed's without offload, bit for bit."""
import json
from pathlib import Path

from conftest import run_two_ranks

SCRIPT = Path(__file__).with_name("run_groups.py")
CASES = ["m6:2", "dp1:1", "dp1:2"]


def test_own_groups_reduced_over_deepspeeds_groups():
    proc = run_two_ranks(SCRIPT, *CASES)
    out = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted((r["case"], r["rank"]) for r in out) == sorted((c, r) for c in CASES for r in (0, 1))
    for result in out:
        assert result["losses"] == result["ref_losses"], result
        assert result["params_max_diff"] == 0.0, result
        assert result["losses"][0] != result["losses"][-1]  # it trained
    m6 = [r for r in out if r["case"] == "m6:2"]
    assert m6[0]["own_groups"] == ["layer1", "layer1.experts", "layer2.experts"]
    # each rank trained its own replica on its own batches, and rank 1's experts are other experts than rank 0's
    for case in CASES:
        first, second = (r for r in out if r["case"] == case)
        assert first["ref_losses"] != second["ref_losses"]
