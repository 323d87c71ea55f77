"""How much host time does the driver-launched page-table kernel save a plan, and is its table the
same as the torch path's?

    python benchmarks/gather_probe.py [--batch 64] [--calls 300] [--json PATH]

trtllm's XQA plan and cudnn's plan lay out the block table ``[rows, width]`` on the device from
CSR page indices (`Staging.gather`). With the kernel of `tactix.staging` (PTX launched through
`tactix.cudadrv`) that is one launch reading the caller's device indices in place; without it
(a driver that cannot load the PTX) it is `Staging.copy_in` of the indices into the slot and a
``torch.index_select`` over windows of it, ~20-25 us of host time a plan on an H200 host
(benchmarks/results/h200-plan-timers-session30.log).

Reports, in one process, for the caller's indices on the device, both paths taken through
`Staging.gather` itself (switched as ``TACTIX_PAGE_TABLE_KERNEL`` switches it): the host time of
the torch path (copy_in + index_select) and of the kernel path, that each row's pages are the
same in both tables (the kernel writes page 0 past them, the torch path the next rows' pages),
and the mean time between CUDA events around 20 kernel-path gathers back to back (the launch
rate bounds it where the host is slower than the kernel). It leaves tactix as it found it.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tactix import staging as staging_module
from tactix.staging import Staging, sections


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median host time of ``fn()`` over blocks of 30 back-to-back calls, a device sync between
    blocks (the launch queue stays short)."""
    samples: list[float] = []
    done = 0
    while done < calls:
        torch.cuda.synchronize()
        for _ in range(min(30, calls - done)):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        done += 30
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gather_probe: needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()  # type: ignore[no-untyped-call]
    rng = random.Random(0)
    lengths = [rng.randint(1024, 8192) for _ in range(args.batch)]
    pages = [-(-n // args.page_size) for n in lengths]
    starts = [0]
    for p in pages:
        starts.append(starts[-1] + p)
    nnz, rows, width = starts[-1], args.batch, max(pages)
    perm = torch.randperm(nnz + 100, generator=torch.Generator().manual_seed(1))[:nnz].to(torch.int32)
    indices = perm.to(device)  # the caller's device indices (vLLM's)

    layout = sections(("row_starts", rows), ("pages", nnz + width))
    staging = Staging(device, layout.total, rows * width)
    slot = staging.slot(False)
    # the metadata transfer (the row starts; the pages section's zeros), sent once
    staging.send(slot, layout.total, lambda dst: layout.write(dst, [starts[:-1], []]))
    pages_at, starts_at = layout.offset("pages"), layout.offset("row_starts")
    launcher = staging_module._CSR_TO_TABLE.launcher(staging.index)

    def gather() -> None:  # what trtllm's and cudnn's plans call
        staging.gather(slot, pages_at, rows, width, starts_at, nnz, indices)

    def table(kernel: bool) -> torch.Tensor:
        staging_module._table_kernel_on = kernel  # (as TACTIX_PAGE_TABLE_KERNEL=1 or 0 sets it)
        gather()
        return staging.gathered(slot, rows, width).cpu()

    expected, got = table(False), table(True)
    same = all(
        torch.equal(got[r, : pages[r]], expected[r, : pages[r]]) and not got[r, pages[r] :].any() for r in range(rows)
    )
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(20):
        gather()
    end.record()
    end.synchronize()
    kernel_us = start.elapsed_time(end) * 1e3 / 20

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "kernel loaded": launcher is not None,
        "batch": rows,
        "width": width,
        "page_entries": nnz,
        "same_table": same,
        "device_us kernel path (20 launches, mean)": round(kernel_us, 2),
    }
    for _ in range(2):  # two rounds, the second kept (the first warms caches and the allocator)
        for name, kernel in (("torch path (copy_in + index_select)", False), ("kernel path", True)):
            staging_module._table_kernel_on = kernel
            results[f"host_us {name}"] = round(host_us(gather, args.calls), 2)
    staging_module._table_kernel_on = True
    width_col = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:{width_col}s}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if not same or launcher is None:
        sys.exit("gather_probe: " + ("the kernel did not load" if launcher is None else "the tables differ"))


if __name__ == "__main__":
    main()
