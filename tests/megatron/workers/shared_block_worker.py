"""Shared-parameter block on 2 gloo ranks: parameter count, gradients, delink, dist checkpoint pseudo -> real."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_setup as ms
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from megatron.core import dist_checkpointing

from ds_pseudo_real import sharing
from megatron_patches.delink import load_pseudo_dist_checkpoint
from megatron_patches.shared_block import delink_block, shared_groups_of

W = "self_attention.linear_qkv.weight"


class CountAllocations(TorchFunctionMode):
    """Elements allocated by torch.empty off the meta device (how Megatron and torch allocate weights)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.empty and not out.is_meta:
            self.numel += out.numel()
        return out


def main():
    out_path, tp, groups, ckpt_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ms.init(tp=tp)

    cfg = ms.config(num_layers=4, tp=tp)
    tokens, pos, mask, labels = ms.batch()

    with CountAllocations() as real_alloc:
        real = ms.gpt(cfg)
    with CountAllocations() as pseudo_alloc:
        pseudo = ms.gpt(cfg, shared_groups=groups)
    layer_size = sum(p.numel() for p in real.decoder.layers[0].parameters())
    outside = sharing.parameter_count(real) - 4 * layer_size
    result = {
        "real_params": sharing.parameter_count(real),
        "pseudo_params": sharing.parameter_count(pseudo),
        "expected_pseudo_params": outside + groups * layer_size,
        "layer_numbers": [layer.layer_number for layer in pseudo.decoder.layers],
        "groups_found": shared_groups_of(pseudo.decoder),
        "meta_params": sum(p.is_meta for p in pseudo.parameters()),
        "allocation_saved": real_alloc.numel - pseudo_alloc.numel,
        "member_layers_size": (4 - groups) * layer_size,
        "tp_attr_kept": all(hasattr(l.get_parameter(W), "tensor_model_parallel") for l in pseudo.decoder.layers),
    }

    # The shared gradient is the sum of what each layer's own copy would get.
    untied = ms.gpt(cfg, shared_groups=groups)
    delink_block(untied.decoder)
    pseudo(tokens, pos, mask, labels=labels).mean().backward()
    untied(tokens, pos, mask, labels=labels).mean().backward()
    size = 4 // groups
    result["grad_is_sum"] = all(
        torch.allclose(pseudo.decoder.layers[g * size].get_parameter(W).grad,
                       sum(untied.decoder.layers[i].get_parameter(W).grad for i in range(g * size, (g + 1) * size)),
                       rtol=1e-5, atol=1e-7)
        for g in range(groups))

    with torch.no_grad():
        pseudo.decoder.layers[0].get_parameter(W).add_(0.5)  # distinguishable from a fresh init
        pseudo_logits = pseudo(tokens, pos, mask)

    # Dist checkpoint of the pseudo model loads into the real model.
    os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(pseudo.sharded_state_dict(), ckpt_dir)
    target = ms.gpt(cfg, seed=1)
    load_pseudo_dist_checkpoint(target, ckpt_dir, groups)
    with torch.no_grad():
        result["ckpt_real_logits_equal"] = torch.equal(target(tokens, pos, mask), pseudo_logits)
    result["ckpt_real_groups"] = shared_groups_of(target.decoder)

    # In-place delink: same logits bit for bit, independent parameters afterwards.
    delink_block(pseudo.decoder)
    with torch.no_grad():
        result["delink_logits_equal"] = torch.equal(pseudo(tokens, pos, mask), pseudo_logits)
    result["delinked_params"] = sharing.parameter_count(pseudo)
    result["delinked_groups"] = shared_groups_of(pseudo.decoder)
    result["delinked_tp_attr_kept"] = all(getattr(l.get_parameter(W), "partition_dim", None) == 0 for l in pseudo.decoder.layers)
    ms.report(out_path, result)
    dist.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing spawns a helper process that re-imports this file
    main()
