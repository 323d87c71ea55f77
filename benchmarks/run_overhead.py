"""Host time that ``run()`` adds over calling the backend's plan directly (target: at most 2 us).

Two measurements, both enqueue-only host time per call (no device sync inside the timed loop):

1. real plan: ``PagedDecode.run(q, cache, out=out)`` against ``plan.run(q, k, v, out, None)`` on a
   tiny decode batch served by the torch backend; the difference is what the wrapper adds
   (noisy: the plan itself costs tens of microseconds of host time).
2. null plan: the same two calls (with a (k, v) tuple and with one 5-D cache tensor) with the
   plan's run swapped for a function that does nothing, which isolates the wrapper's own
   checks and dispatch exactly.

    python benchmarks/run_overhead.py [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

import tactix


def per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


def interleaved(
    a: Callable[[], object], b: Callable[[], object], device: torch.device, rounds: int, calls: int
) -> tuple[float, float]:
    """Medians over ``rounds`` of alternating batches of ``calls`` calls of a and b."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(per_call_us(a, calls, device))
        tb.append(per_call_us(b, calls, device))
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    wrapper = tactix.PagedDecode("HND", device=device)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper.plan(i32(0, 1), i32(0), i32(16), 4, 4, 64, 16, q_data_type=dtype)
    k = torch.randn(1, 4, 16, 64, device=device, dtype=dtype)
    v = torch.randn(1, 4, 16, 64, device=device, dtype=dtype)
    cache = (k, v)
    q = torch.randn(1, 4, 64, device=device, dtype=dtype)
    out = torch.empty(1, 4, 64, device=device, dtype=dtype)
    plan = wrapper.plan_object

    for _ in range(50):  # warm-up: allocator, kernels, the first-run page check
        wrapper.run(q, cache, out=out)
    real_wrapper, real_plan = interleaved(
        lambda: wrapper.run(q, cache, out=out),
        lambda: plan.run(q, k, v, out, None),
        device,
        args.rounds,
        args.calls,
    )

    def nothing(*_: object) -> None:
        return None

    # isolate the wrapper: the backend does no work (the binding's name before contract v2: _fast)
    if hasattr(wrapper, "_bound"):
        wrapper._bound.run = nothing
    else:
        wrapper._fast = (nothing, *wrapper._fast[1:])
    null_wrapper, null_plan = interleaved(
        lambda: wrapper.run(q, cache, out=out),
        lambda: nothing(q, k, v, out, None),
        device,
        args.rounds,
        args.calls * 10,
    )
    cache5 = torch.stack([k, v], dim=1)  # one [pages, 2, heads, page, dim] tensor
    wrapper.run(q, cache5, out=out)
    null_wrapper5, null_plan5 = interleaved(
        lambda: wrapper.run(q, cache5, out=out),
        lambda: nothing(q, k, v, out, None),
        device,
        args.rounds,
        args.calls * 10,
    )
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tactic": str(plan.tactic),
        "real_plan_us": {
            "wrapper_run": real_wrapper,
            "plan_run": real_plan,
            "added": real_wrapper - real_plan,
        },
        "null_plan_us": {
            "wrapper_run": null_wrapper,
            "plan_run": null_plan,
            "added": null_wrapper - null_plan,
        },
        "null_plan_5d_cache_us": {
            "wrapper_run": null_wrapper5,
            "plan_run": null_plan5,
            "added": null_wrapper5 - null_plan5,
        },
        "method": f"median of {args.rounds} interleaved rounds; enqueue-only host time per call",
    }
    print(f"{'':22}{'run()':>10}{'plan.run':>10}{'added':>10}")
    for name in ("real_plan_us", "null_plan_us", "null_plan_5d_cache_us"):
        r = result[name]
        print(f"{name:22}{r['wrapper_run']:10.2f}{r['plan_run']:10.2f}{r['added']:10.2f}")
    print(f"target: run() adds <= 2 us  ({result['device']}, torch {result['torch']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
