"""On CUDA, two figures of the offload planner's byte model measured: pinned host buffers rounded up to a power of two
(one M6-10T layer's experts on one of 512 ranks: bf16 params and an fp32 buffer), and the allocator pool a side
stream keeps for itself (``planner.STREAM_POOL_BYTES``). Elsewhere it says so and does nothing.

    python benchmarks/gpu/byte_model.py --out benchmarks/results/byte_model.json      # seconds; pins 3 GiB of host
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


def pinned_rows():
    """Host bytes the caching host allocator takes for each buffer, against ``planner.pinned_bytes``."""
    import torch

    from ds_pseudo_real.offload.planner import pinned_bytes

    rows = []
    for name, size in (("bf16 params", 2 * EXPERT_PARAMS), ("fp32 master / gradient / moment", 4 * EXPERT_PARAMS)):
        before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        taken = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
        rows.append({"buffer": name, "requested": size, "allocated": taken, "planned": pinned_bytes(size),
                     "rounding_percent": round(100 * (taken / size - 1), 1)})
        del buffer
    return rows


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
              "stream_pool": stream_pool_row()}
    report["pinned_as_planned"] = all(r["allocated"] == r["planned"] for r in report["pinned"])
    pool = report["stream_pool"]
    report["stream_pool_as_planned"] = pool["side_stream_reserved"] == pool["default_stream_reserved_after_it"] \
        == pool["planned"]
    for row in report["pinned"]:
        print(f"pinned {row['buffer']}: {row['requested']:,} B requested, {row['allocated']:,} B allocated "
              f"(+{row['rounding_percent']} %), planned {row['planned']:,}")
    print(f"side stream pool: {pool['side_stream_reserved']:,} B reserved, then "
          f"{pool['default_stream_reserved_after_it']:,} B by the default stream for the same sizes; planned "
          f"{pool['planned']:,} per stream")
    print(f"pinned_as_planned: {report['pinned_as_planned']}; "
          f"stream_pool_as_planned: {report['stream_pool_as_planned']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if report["pinned_as_planned"] and report["stream_pool_as_planned"] else 1


if __name__ == "__main__":
    sys.exit(main())
