"""Does a kernel's time depend on what the GPU did just before? Blocks of timed calls, in order.

`tactix bench` rows of cuda_native's fp8 decode start slow and switch to fast partway through a
row (benchmarks/results/h200-bench-fp8-decode-modes-session19.md). This times one case's
cuda_native default in blocks of --repeat calls with the bench's method (a captured graph, a 256 MB
L2 flush before each call), separated by: nothing, a 1 s idle host sleep, and a block without the
flush, and prints every sample in order, so the switch can be tied to idleness, to the flush or to
the count of calls.

    python benchmarks/timing_modes.py [--case D3-fp8] [--repeat 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import tactix
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import measure_with_policy
from tactix.bench import _attention_inputs, select_cases

CUDA = torch.device("cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="D3-fp8")
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    (case,) = select_cases("gpu", [args.case])
    x = _attention_inputs(case, CUDA, torch.bfloat16)
    hq, hkv = case.heads
    kw = {"kv_data_type": getattr(torch, case.kv_dtype)} if case.kv_dtype else {}
    w = tactix.PagedDecode("HND", backend="cuda_native", device=CUDA, run_extras=tuple(x.extras))
    w.plan(x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size, q_data_type=torch.bfloat16, **kw)

    def call() -> None:
        w.run(x.q, (x.k, x.v), out=x.out, **x.extras)

    cold = MeasurementPolicy(repeat=args.repeat)
    warm = MeasurementPolicy(repeat=args.repeat, cold_l2=False)
    blocks = []
    for label, policy, pause in (("first", cold, 0.0), ("again", cold, 0.0), ("after 1 s idle", cold, 1.0),
                                 ("no L2 flush", warm, 0.0), ("flush again", cold, 0.0)):  # fmt: skip
        time.sleep(pause)
        timing = measure_with_policy(call, CUDA, policy)
        samples = [round(s * 1e6, 1) for s in timing.samples]
        blocks.append({"block": label, "median_us": round(timing.median * 1e6, 1), "samples_us": samples})
        print(f"{label:16s} median {timing.median * 1e6:7.1f} us  {' '.join(f'{s:.0f}' for s in samples)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": args.case, "tactic": str(w.tactic), "gpu": torch.cuda.get_device_name(),
                       "blocks": blocks}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
