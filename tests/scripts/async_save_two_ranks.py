"""2-rank helper for ``checkpoint.async_save``: rank 1 writes step 2's checkpoint slowly, and rank 0 counts the steps
it trains while its own files are written and nothing is published; then rank 1's write of the next checkpoint fails
with ENOSPC in the background, which both ranks must raise at the same step; then a save that works, and a resume
from it. Prints one JSON line on rank 0."""
import json
import os
import sys
import time

import deepspeed
import torch.distributed as dist

import ds_pseudo_real
from ds_pseudo_real import checksums
from ds_pseudo_real.checkpointing import folders as ckpt
from ds_pseudo_real.checkpointing.verify import verify
from delink_matrix import config, tiny_gpt, train_until

folder = sys.argv[1]
deepspeed.init_distributed()
rank = dist.get_rank()
ASYNC = dict(config(2, "fp32", "copy", switch=100), checkpoint={"async_save": True})


def train(engine, until):
    return train_until(engine, until, lambda step: 10 + rank + 2 * step)  # each rank its own batches


real_save = checksums.save_with_checksum


def slow_on_rank1(save, path):
    if rank == 1:
        time.sleep(1.0)
    return real_save(save, path)


def full_disk_on_rank1(save, path):
    if rank == 1 and "optim_states" in path:
        raise OSError(28, "No space left on device", path)
    return real_save(save, path)


engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=ASYNC)
train(engine, 2)
checksums.save_with_checksum = slow_on_rank1
engine.save_checkpoint(folder)
unpublished = 0
for _ in range(3):  # rank 0's files are durable well before rank 1's
    time.sleep(0.2)
    train(engine, engine.global_steps + 1)
    unpublished += int(rank == 0 and engine.checkpoint_in_flight is not None and ckpt.latest_tag(folder) is None)
engine.wait_for_checkpoints()
checksums.save_with_checksum = real_save
published = ckpt.latest_tag(folder)
verified = verify(folder, "global_step2").ok  # collective

failing = engine.global_steps
checksums.save_with_checksum = full_disk_on_rank1
engine.save_checkpoint(folder)
error = None
while error is None:
    try:
        train(engine, engine.global_steps + 1)
        time.sleep(0.05)
    except ckpt.CheckpointError as raised:
        error = {"message": str(raised), "step": engine.global_steps}
checksums.save_with_checksum = real_save
dist.barrier()
partial_left = [name for name in os.listdir(folder) if name.endswith(ckpt.PARTIAL_SUFFIX)]
saved = engine.global_steps
engine.save_checkpoint(folder)
tail = train(engine, saved + 2)
engine.wait_for_checkpoints()
engine.engine.destroy()

resumed, *_ = ds_pseudo_real.initialize(model=tiny_gpt(seed=7), config=ASYNC)
resumed.load_checkpoint(folder)
resumed_step = resumed.global_steps
resumed_tail = train(resumed, saved + 2)
errors = [None] * 2
dist.all_gather_object(errors, error)
if rank == 0:
    print(json.dumps({"unpublished_steps_while_rank1_wrote": unpublished, "published": published,
                      "failing": f"global_step{failing}", "saved": f"global_step{saved}",
                      "verified": verified, "errors": errors, "partial_left": partial_left,
                      "latest": ckpt.latest_tag(folder), "resumed_step": resumed_step,
                      "same_tail": tail == resumed_tail}), flush=True)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as save_failure.py: no interpreter teardown with gloo's threads still joinable
