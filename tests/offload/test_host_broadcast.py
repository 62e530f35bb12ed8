"""DeepSpeed broadcasts the model from rank 0 at initialize; host_params parameters are host tensors, which NCCL
refuses. With the backend reported as NCCL (faked on 2 gloo ranks), no parameter's storage is handed to a
collective: the broadcast goes through device staging buffers in bounded chunks, and the replicas, initialized
differently, are equal afterwards (issue 13, defect 3)."""
import json
from pathlib import Path

from conftest import run_two_ranks

SCRIPT = Path(__file__).with_name("run_broadcast.py")
CHUNK = 4096  # run_broadcast.CHUNK


def test_no_host_parameter_reaches_an_nccl_collective():
    proc = run_two_ranks(SCRIPT, "0", "2")
    out = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted((r["stage"], r["rank"]) for r in out) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    for result in out:
        assert result["host_params"] == 2  # layers 0 and 2, each one host allocation of its 6 parameters
        assert result["param_storage_in_collective"] == [], result
        assert 0 < result["largest_broadcast"] <= CHUNK, result
        # every parameter is a host tensor here: 27 of them, each 128 x 32 fp32 weight (16 KiB) in 4 chunks and
        # the embedding's and the head's (8 KiB) in 2
        assert result["broadcasts"] == 27 + 8 * 3 + 2 * 1, result
        assert result["replicas_equal"], result
    assert {r["loss"] for r in out if r["rank"] == 0} != {r["loss"] for r in out if r["rank"] == 1}  # own batches
