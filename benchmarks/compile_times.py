"""First-use compile time per cuda_native variant and the warm-cache hit time (issue 6).

    python benchmarks/compile_times.py [--json PATH]

Compiles the default variants one by one into an empty cache directory (NVRTC, one process,
what a first plan costs), then, in a fresh process that finds them on disk, times each step of
a warm hit: reading and checking the cubin, loading it as a module and getting the kernel, and
a whole first ``plan`` of a decode wrapper (on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _cold(root: str) -> list[dict[str, Any]]:
    from pathlib import Path

    from tactix_cuda_native import runtime
    from tactix_cuda_native.device import info_for
    from tactix_cuda_native.variants import default_variants

    rows = []
    for v in dict.fromkeys(default_variants(info_for(None))):
        t0 = time.perf_counter()
        _, built = runtime.compile_variant(v, root=Path(root))
        rows.append({"variant": v.label(), "compile_s": time.perf_counter() - t0, "built": built})
    return rows


def _warm(root: str) -> dict[str, Any]:
    import torch
    from tactix_cuda_native import runtime
    from tactix_cuda_native.device import info_for
    from tactix_cuda_native.variants import default_variants

    import tactix

    os.environ["TACTIX_CACHE_DIR"] = root
    rows = []
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.init()
    for v in dict.fromkeys(default_variants(info_for(None))):
        t0 = time.perf_counter()
        _, built = runtime.compile_variant(v)
        t1 = time.perf_counter()
        row = {"variant": v.label(), "read_s": t1 - t0, "built": built}
        if gpu:
            module, _ = runtime.load(v, 0)
            module.kernel("tactix_" + v.source.split(".")[0].removesuffix("_sm90"))  # tactix_decode, ...
            row["load_s"] = time.perf_counter() - t1
        rows.append(row)
    out: dict[str, Any] = {"rows": rows}
    if gpu:  # a whole first plan on a fresh wrapper, kernels found in the disk cache
        dev = torch.device("cuda")
        lens = [300, 4000, 17, 1200]
        pages = [-(-n // 16) for n in lens]
        indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        w = tactix.PagedDecode("NHD", backend="cuda_native", device=dev)
        t0 = time.perf_counter()
        w.plan(indptr, torch.arange(int(indptr[-1]), dtype=torch.int32),
               torch.tensor([(n - 1) % 16 + 1 for n in lens], dtype=torch.int32),
               32, 8, 128, 16, q_data_type=torch.bfloat16)  # fmt: skip
        torch.cuda.synchronize()
        out["first_decode_plan_s"] = time.perf_counter() - t0
        out["build_stats"] = dict(runtime.stats)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--_warm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._warm:
        print(json.dumps(_warm(args._warm)))
        return 0
    with tempfile.TemporaryDirectory() as root:
        cold = _cold(root)
        done = subprocess.run([sys.executable, __file__, "--_warm", root], capture_output=True, text=True, check=True)
        warm = json.loads(done.stdout.strip().splitlines()[-1])
    report = {"cold": cold, "warm": warm}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    comp = [r["compile_s"] for r in cold if r["built"]]
    print(f"first use: {len(comp)} variants compiled, median {statistics.median(comp):.2f} s, "
          f"min {min(comp):.2f}, max {max(comp):.2f}")  # fmt: skip
    reads = [r["read_s"] * 1e3 for r in warm["rows"]]
    print(f"warm hit, read+verify cubin: median {statistics.median(reads):.2f} ms, max {max(reads):.2f}")
    loads = [r["load_s"] * 1e3 for r in warm["rows"] if "load_s" in r]
    if loads:
        print(f"warm hit, module load + kernel: median {statistics.median(loads):.2f} ms, max {max(loads):.2f}")
        print(f"first decode plan with a warm disk cache: {warm['first_decode_plan_s'] * 1e3:.1f} ms "
              f"(stats {warm['build_stats']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
