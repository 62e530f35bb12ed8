"""2-rank helper: resume a 1-rank pseudo-stage checkpoint (argv[1]) on 2 ranks: as it is (refused), then converted
(argv[2]); train on past the configured switch. Prints one JSON line on rank 0: the refusal, and per rank the stage,
step, logits and LR after the load, the stage of each step after it, and where the delink happened."""
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_checkpoints import TOTAL, batch_for, logits, make  # noqa: E402

from ds_pseudo_real.checkpointing import folders as ckpt  # noqa: E402

deepspeed.init_distributed()
engine = make(stage=2, seed=11)
try:
    engine.load_checkpoint(sys.argv[1])
    refusal = None
except ckpt.CheckpointError as error:
    refusal = str(error)
engine.load_checkpoint(sys.argv[2])
loaded = {"stage": engine.stage, "step": engine.global_steps, "logits": logits(engine).tolist(),
          "lr": engine.optimizer.param_groups[0]["lr"]}
stages = []
while engine.global_steps < TOTAL:
    stages.append(engine.stage)
    loss = engine(*batch_for(engine.global_steps))
    engine.backward(loss)
    engine.step()
report = {"loaded": loaded, "stages": stages, "switch_step": engine.state.switch_step,
          "delinked_at": (engine.last_transition or {}).get("step")}
reports = [None] * dist.get_world_size()
dist.all_gather_object(reports, report)
if dist.get_rank() == 0:
    print(json.dumps({"refusal": refusal, "ranks": reports}), flush=True)
engine.engine.destroy()
dist.destroy_process_group()
# the results are out: leave without the interpreter's teardown, where a C++ thread of gloo or DeepSpeed still
# joinable under load can abort a rank (std::terminate) after a run that passed
sys.stdout.flush()
os._exit(0)
