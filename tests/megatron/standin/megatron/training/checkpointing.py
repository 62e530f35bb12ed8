"""STAND-IN (tests only) for Megatron-LM's checkpointing: the directory layout and tracker file a resumed run sees.

Same conventions as Megatron-LM: ``<save>/iter_0000010/`` per saved iteration and
``<save>/latest_checkpointed_iteration.txt`` holding the latest iteration (``--ckpt-step`` picks another one);
saved: model, optimizer (DistributedOptimizer shards included), LR scheduler and iteration; loading sets
``args.iteration``. NOT Megatron's format: one plain ``torch.save`` file per rank, so a checkpoint only loads on
the same parallel layout (Megatron's dist checkpoints reshard; the tests resume on the layout they saved with).
"""
import os

import torch
import torch.distributed as dist

from .global_vars import get_args

TRACKER = "latest_checkpointed_iteration.txt"


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER)


def _rank_file(directory, iteration):
    return os.path.join(directory, f"iter_{iteration:07d}", f"rank_{dist.get_rank():03d}.pt")


def _inner_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _sharded_state(model, inner):
    """A DistributedOptimizer keeps this rank's fp32 main shards and Adam moments outside its state_dict()."""
    held = getattr(inner, "model_param_group_index_map", None)
    if held is None:
        return None
    return {f"{i}.{name}": param for i, chunk in enumerate(model) for name, param in chunk.module.named_parameters()
            if param in held}


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0,
                    checkpointing_context=None):
    args = get_args()
    shards = []
    for inner in _inner_optimizers(optimizer):
        params = _sharded_state(model, inner)
        shards.append(None if params is None else
                      {k: {n: t.detach().clone() for n, t in inner._get_main_param_and_optimizer_states(p).items()}
                       for k, p in params.items()})
    state = {"iteration": iteration, "model": [chunk.state_dict() for chunk in model],
             "optimizer": optimizer.state_dict(), "optimizer_shards": shards,
             "opt_param_scheduler": opt_param_scheduler.state_dict()}
    path = _rank_file(args.save, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)
    dist.barrier()  # the tracker names a checkpoint only once every rank has written its part
    if dist.get_rank() == 0:
        with open(get_checkpoint_tracker_filename(args.save), "w") as handle:
            handle.write(str(iteration))
    dist.barrier()


@torch.no_grad()
def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, checkpointing_context=None):
    """Returns (iteration, floating point operations so far), (0, 0) when there is no checkpoint, like Megatron."""
    args = get_args()
    directory = getattr(args, load_arg)
    tracker = get_checkpoint_tracker_filename(directory)
    if args.ckpt_step:
        iteration = args.ckpt_step
    elif os.path.isfile(tracker):
        with open(tracker) as handle:
            iteration = int(handle.read().strip())
    else:
        return 0, 0
    state = torch.load(_rank_file(directory, iteration), map_location="cpu", weights_only=False)
    for chunk, chunk_state in zip(model, state["model"]):
        chunk.load_state_dict(chunk_state, strict=strict)
    optimizer.load_state_dict(state["optimizer"])  # a DistributedOptimizer allocates its shards here
    for inner, shards in zip(_inner_optimizers(optimizer), state["optimizer_shards"]):
        if shards is not None:
            # Without Apex/TE, DistributedOptimizer.load_state_dict hands every parameter the same "step" tensor, and
            # torch's Adam would then add 1 to it once per parameter each step: give each its own.
            for param_state in inner.optimizer.state.values():
                param_state["step"] = param_state["step"].clone()
            for key, param in _sharded_state(model, inner).items():
                inner._set_main_param_and_optimizer_states(param, shards[key])
    opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    return state["iteration"], 0
