"""A resume under ZeRO-3 with the optimizer state on NVMe in a new process, as a job is resumed: ``--phase run``
trains 5 steps (the delink after the second) and saves a checkpoint after the third; ``--phase resume``, in new
processes, builds the model with other initial weights, loads that checkpoint and trains steps 4 and 5. Both in
fp32 and bf16. Run under torchrun (``--out DIR``: each rank writes DIR/<phase>_rank<N>.json with its losses). With
``--with-delink-cases``, the processes first run nvme_delink.py's two-rank cases (DIR/rank<N>.json), so that one
launch serves both."""
import json
import os
import sys

import torch

import ds_pseudo_real
from ds_pseudo_real import ds_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from delink_matrix import fixed_batch  # noqa: E402
from nvme_delink import gpt_with_idle_parameters, offload_config, two_rank_case, width  # noqa: E402

STEPS, SAVED_AFTER = 5, 3


def case(out: str, phase: str, dtype: str) -> dict:
    rank = torch.distributed.get_rank()
    cfg = offload_config("nvme", os.path.join(out, f"swap_{dtype}_{phase}"), dtype=dtype)
    checkpoints = os.path.join(out, f"checkpoints_{dtype}")
    engine = ds_pseudo_real.initialize(model=gpt_with_idle_parameters(width(torch.distributed.get_world_size())),
                                       config=cfg)[0]
    first = 0
    if phase == "resume":
        with torch.no_grad():
            for param in engine.module.parameters():
                param.ds_tensor.add_(1.0)  # other weights than the checkpoint's
        engine.load_checkpoint(checkpoints)
        first = SAVED_AFTER
    losses = []
    for step in range(first, STEPS):
        loss = engine(*fixed_batch(step + 10 * rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if phase == "run" and step + 1 == SAVED_AFTER:
            engine.save_checkpoint(checkpoints)
    sub_groups = len(engine.engine.optimizer.fp32_partitioned_groups_flat)
    result = {"rank": rank, "dtype": dtype, "losses": losses, "stage": engine.stage,
              "swapped": len(ds_state.swapped_sub_groups(engine.engine)), "sub_groups": sub_groups}
    engine.engine.destroy()
    return result


if __name__ == "__main__":
    import deepspeed

    deepspeed.init_distributed()
    out = sys.argv[sys.argv.index("--out") + 1]
    phase = sys.argv[sys.argv.index("--phase") + 1]
    if "--with-delink-cases" in sys.argv[1:]:
        delinks = [two_rank_case(os.path.join(out, f"swap_{dtype}"), dtype) for dtype in ("fp32", "bf16")]
        with open(os.path.join(out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
            json.dump(delinks, f)
    results = [case(out, phase, dtype) for dtype in ("fp32", "bf16")]
    with open(os.path.join(out, f"{phase}_rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
