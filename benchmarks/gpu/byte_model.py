"""On CUDA, two figures of the offload planner's byte model measured: the pinned host buffers of the offload
(``ds_pseudo_real.pinned``: registered with the CUDA runtime at their exact size, whole pages, nothing taken
from torch's caching host allocator; one M6-10T layer's experts on one of 512 ranks: bf16 params and an fp32
buffer), torch's pinned cache emptied as the delink does, and the allocator pool a side stream keeps for itself
(``planner.STREAM_POOL_BYTES``). Elsewhere it says so and does nothing.

    python benchmarks/gpu/byte_model.py --out benchmarks/results/byte_model.json      # seconds; pins 2.3 GiB of host
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EXPERT_PARAMS = 20 * 2 * 1024 * 9984  # 10,240 experts of 2 x 1024 x 9984 per layer over 512 ranks


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def host_cache(key: str) -> int:
    import torch

    return torch.cuda.host_memory_stats().get(f"{key}_bytes.current", 0)


def pinned_rows():
    """Host bytes each offload buffer takes (resident memory it adds) and what it takes from torch's pinned cache,
    against ``planner.pinned_bytes``; the buffer must read as pinned and carry a non-blocking copy."""
    import torch

    from ds_pseudo_real.pinned import host_empty
    from ds_pseudo_real.offload.planner import pinned_bytes

    rows = []
    for name, dtype, numel in (("bf16 params", torch.bfloat16, EXPERT_PARAMS),
                               ("fp32 master / gradient / moment", torch.float32, EXPERT_PARAMS)):
        size = numel * torch.empty((), dtype=dtype).element_size()
        rss, cached = rss_bytes(), host_cache("allocated")
        buffer = host_empty(numel, dtype, pin=True)
        taken, from_cache = rss_bytes() - rss, host_cache("allocated") - cached
        device = buffer[: 2**20].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        rows.append({"buffer": name, "requested": size, "resident_added": taken, "planned": pinned_bytes(size),
                     "from_torch_pinned_cache": from_cache, "is_pinned": buffer.is_pinned(),
                     "copied": bool(torch.equal(device.cpu(), buffer[: 2**20]))})
        del buffer, device
    return rows


def host_cache_row():
    """torch's caching host allocator keeps a freed pinned block; ``empty_host_cache`` (called at the delink) gives
    it back."""
    import torch

    from ds_pseudo_real.pinned import empty_host_cache

    block = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    del block
    kept = host_cache("reserved")
    empty_host_cache()
    return {"reserved_after_free": kept, "reserved_after_empty": host_cache("reserved")}


def stream_pool_row():
    """Device bytes a side stream reserves for one small and one large allocation, which the default stream then
    cannot reuse (it reserves its own for the same two), against ``planner.STREAM_POOL_BYTES``."""
    import torch

    from ds_pseudo_real.offload.planner import STREAM_POOL_BYTES

    def reserve(stream) -> int:
        torch.cuda.synchronize()
        start = torch.cuda.memory_reserved()
        with torch.cuda.stream(stream):
            small = torch.empty(1024, dtype=torch.uint8, device="cuda")  # <= 1 MiB: a 2 MiB small-pool segment
            large = torch.empty(3 * 2**20, dtype=torch.uint8, device="cuda")  # 1-10 MiB: a 20 MiB segment
        del small, large  # cached for ``stream`` only
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - start

    torch.cuda.empty_cache()
    side = reserve(torch.cuda.Stream())
    default = reserve(torch.cuda.current_stream())
    return {"side_stream_reserved": side, "default_stream_reserved_after_it": default, "planned": STREAM_POOL_BYTES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "byte_model.json")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: byte model check skipped")
        return 0
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pinned": pinned_rows(),
              "host_cache": host_cache_row(), "stream_pool": stream_pool_row()}
    # resident memory is read in pages and other threads allocate too: within 1 MiB of the plan's whole pages
    report["pinned_as_planned"] = all(
        abs(r["resident_added"] - r["planned"]) <= 2**20 and r["from_torch_pinned_cache"] == 0 and r["is_pinned"]
        and r["copied"] for r in report["pinned"])
    cache = report["host_cache"]
    report["host_cache_emptied"] = cache["reserved_after_free"] > 0 and cache["reserved_after_empty"] == 0
    pool = report["stream_pool"]
    report["stream_pool_as_planned"] = pool["side_stream_reserved"] == pool["default_stream_reserved_after_it"] \
        == pool["planned"]
    for row in report["pinned"]:
        print(f"pinned {row['buffer']}: {row['requested']:,} B requested, {row['resident_added']:,} B resident added, "
              f"{row['from_torch_pinned_cache']:,} B from torch's pinned cache, planned {row['planned']:,}; "
              f"pinned {row['is_pinned']}, copied {row['copied']}")
    print(f"torch's pinned cache: {cache['reserved_after_free']:,} B kept after a free, "
          f"{cache['reserved_after_empty']:,} B after empty_host_cache")
    print(f"side stream pool: {pool['side_stream_reserved']:,} B reserved, then "
          f"{pool['default_stream_reserved_after_it']:,} B by the default stream for the same sizes; planned "
          f"{pool['planned']:,} per stream")
    checks = ("pinned_as_planned", "host_cache_emptied", "stream_pool_as_planned")
    print("; ".join(f"{key}: {report[key]}" for key in checks))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(report[key] for key in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
