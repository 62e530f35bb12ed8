"""How fast this machine backs new host memory: the floor under every host-side time of the delink.

Allocates ``--gib`` GiB in 1 GiB blocks, each filled with zeros on allocation (first touch: the operating system
must back every page), then frees them and does it again in the same process (the allocator's pages may be reused,
or given back and backed again). Prints seconds per block for both passes side by side, and GB/s.

    python benchmarks/host_memory.py --gib 12 --out benchmarks/results/host_memory.json
"""
import argparse
import json
import os
import time

import torch

GIB = 2**30


def fill_blocks(count: int):
    """Seconds to allocate and zero each of ``count`` 1 GiB blocks, all kept alive until the end."""
    blocks, seconds = [], []
    for _ in range(count):
        start = time.perf_counter()
        blocks.append(torch.zeros(GIB // 4, dtype=torch.float32))
        seconds.append(round(time.perf_counter() - start, 3))
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=12, help="GiB per pass (needs that much free memory)")
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args()
    torch.set_num_threads(1)
    first = fill_blocks(args.gib)
    again = fill_blocks(args.gib)
    print("| block (GiB from the start) | first touch s | second pass s |")
    print("|---|---|---|")
    for index, (a, b) in enumerate(zip(first, again)):
        print(f"| {index}-{index + 1} | {a:.2f} | {b:.2f} |")
    summary = {
        "gib": args.gib,
        "first_touch_s": first,
        "second_pass_s": again,
        "first_touch_gb_per_s": round(args.gib * GIB / 1e9 / sum(first), 3),
        "second_pass_gb_per_s": round(args.gib * GIB / 1e9 / sum(again), 3),
        "load_average": os.getloadavg(),
    }
    print(f"first touch {summary['first_touch_gb_per_s']} GB/s, second pass {summary['second_pass_gb_per_s']} GB/s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
