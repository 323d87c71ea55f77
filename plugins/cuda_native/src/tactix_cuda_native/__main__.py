"""``python -m tactix_cuda_native [--all] [--arch sm_90] [--jobs N]``: compile kernel variants
into the disk cache ahead of time, in parallel processes.

Without ``--all`` it compiles what ``tactix warmup cuda_native`` does (the default tactics'
variants); with it, every variant any enumerated tactic uses (for tuning or a full test run).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from tactix_cuda_native import runtime
from tactix_cuda_native.device import DeviceInfo, info_for
from tactix_cuda_native.variants import candidate_variants, default_variants


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tactix_cuda_native", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every enumerated tactic's variant, not only the defaults")
    parser.add_argument("--arch", help="target architecture such as sm_90 (default: this GPU's, else sm_90)")
    parser.add_argument("--jobs", type=int, help="parallel compile processes (default: CPUs, at most 16)")
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    base = info_for(None)
    info = base if args.arch is None else DeviceInfo(base.sms, base.smem_per_block, base.smem_per_sm, args.arch)
    variants = candidate_variants(info) if args.all else default_variants(info)
    t0 = time.perf_counter()

    def progress(done: int, total: int, label: str) -> None:
        print(f"[{done}/{total}] {label}", flush=True)

    compiled = runtime.compile_all(variants, progress, jobs=args.jobs)
    print(f"{len(set(variants))} variants for {info.arch}: {compiled} compiled, the rest cached, "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
