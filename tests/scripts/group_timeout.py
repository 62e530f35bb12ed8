"""Two gloo ranks started as the main job starts them (``use_collective_timeout``, then DeepSpeed's
``init_distributed``), with a group made as DeepSpeed makes its own (``new_group`` without a timeout, as ZeRO's
data-parallel group): rank 1 never joins the group's all-reduce (it exits after argv[1] seconds); rank 0 prints how
its all-reduce ended. The timeout under test is argv[2] seconds."""
import os
import sys
import time
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist

from ds_pseudo_real.device import use_collective_timeout

peer_exits_after, timeout = float(sys.argv[1]), float(sys.argv[2])
use_collective_timeout(timedelta(seconds=timeout))
deepspeed.init_distributed()
group = dist.new_group(ranks=[0, 1])
if dist.get_rank() == 1:
    time.sleep(peer_exits_after)
    os._exit(0)
try:
    dist.all_reduce(torch.ones(1), group=group)
    print("rank 0: the all-reduce completed", flush=True)
except RuntimeError as error:
    print(f"rank 0: the all-reduce failed: {str(error).splitlines()[0]}", flush=True)
os._exit(0)  # a group with a failed collective cannot be torn down cleanly
