"""2-rank helper: rank 1's optimizer-state file fails to write (ENOSPC) during the second save. Every rank must raise
the same CheckpointError (no hang), the partial folder must be gone, and the next save and a resume must work.
Prints one JSON line on rank 0."""
import json
import os
import sys

import deepspeed
import torch.distributed as dist

import ds_pseudo_real
from ds_pseudo_real.checkpointing import folders as ckpt
from ds_pseudo_real import checksums
from delink_matrix import config, tiny_gpt, train_until

folder = sys.argv[1]
deepspeed.init_distributed()
rank = dist.get_rank()


def train(engine, until):
    return train_until(engine, until, lambda step: 10 + rank + 2 * step)  # each rank its own batches


engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(2, "fp32", "copy", switch=100))
train(engine, 2)
engine.save_checkpoint(folder)
train(engine, 3)
real_save = checksums.save_with_checksum


def full_disk_on_rank1(save, path):
    if rank == 1 and "optim_states" in path:
        raise OSError(28, "No space left on device", path)
    return real_save(save, path)


checksums.save_with_checksum = full_disk_on_rank1
try:
    engine.save_checkpoint(folder)
    error = None
except ckpt.CheckpointError as raised:
    error = str(raised)
checksums.save_with_checksum = real_save
dist.barrier()
partial_left = [name for name in os.listdir(folder) if name.endswith(ckpt.PARTIAL_SUFFIX)]
engine.save_checkpoint(folder)
tail = train(engine, 5)
engine.engine.destroy()

resumed, *_ = ds_pseudo_real.initialize(model=tiny_gpt(seed=7), config=config(2, "fp32", "copy", switch=100))
resumed.load_checkpoint(folder)
resumed_step = resumed.global_steps
resumed_tail = train(resumed, 5)
errors = [None] * 2
dist.all_gather_object(errors, error)
if rank == 0:
    print(json.dumps({"errors": errors, "partial_left": partial_left, "latest": ckpt.latest_tag(folder),
                      "resumed_step": resumed_step, "same_tail": tail == resumed_tail}), flush=True)
dist.destroy_process_group()
# the results are out: leave without the interpreter's teardown, where a C++ thread of gloo or DeepSpeed still
# joinable under load can abort a rank (std::terminate) after a run that passed
sys.stdout.flush()
os._exit(0)
