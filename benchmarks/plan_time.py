"""Host time of plan() for a new batch of an already-seen shape bucket (a warm graph cache).

    python benchmarks/plan_time.py [--backends cudnn,torch] [--json PATH]

Plans decode batches (64 requests of 4-8k tokens, D1-like, and 8 requests of 1k tokens) and
ragged prefill batches (16 requests of 64 new tokens over 4k cached), kv lengths re-drawn each
time inside one bucket; reports the median host time per plan and how many graph builds the
timed plans caused (target: under 50 us, and no builds). ``plan()`` here includes everything
the engine pays: validating the CSR arrays, the problem, the selection and the backend's plan.

Two medians per case: ``fresh`` plans each batch right after its tensors are made (as an
engine does; CPU caches and torch's thread pool are still busy with making them), ``warm``
cycles through batches made beforehand (what `plan_breakdown.py` reports). Compare runs on one
host only: H200 hosts lent here differ by up to 2x in Python speed.

``--store miss`` plans inside a ``replay`` block over an empty tactic store: what a server whose
store lacks the bucket pays on every plan (the store asked again each time); ``auto`` beside a
named backend shows what selection adds to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tactix
from tactix.autotune import autotune


def batch(seed: int, count: int, low: int, high: int, page: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high, (count,), generator=gen)
    pages = (lens + page - 1) // page
    indptr = torch.zeros(count + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = torch.randperm(int(indptr[-1]), generator=gen).to(torch.int32)
    last = ((lens - 1) % page + 1).to(torch.int32)
    return indptr, indices, last, lens.to(torch.int32)


_QO = torch.arange(0, 17 * 64, 64, dtype=torch.int32)  # 16 requests of 64 new tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="cudnn,torch")
    parser.add_argument("--plans", type=int, default=50)
    parser.add_argument("--json")
    parser.add_argument("--store", choices=("none", "miss"), default="none",
                        help="miss: plan inside a replay block over an empty store")  # fmt: skip
    args = parser.parse_args()
    results = {}
    for name in args.backends.split(","):
        for op, count, low, high in (("decode", 64, 4100, 8000), ("decode", 8, 900, 1000),
                                     ("prefill", 16, 4100, 4200)):  # fmt: skip
            if name != "auto" and tactix.get_registry().get(name).spec.capabilities(op) is None:  # type: ignore[arg-type]
                print(f"{name:8} {op:8} b{count:<3} not implemented")
                continue
            with contextlib.ExitStack() as scope:
                if args.store == "miss":
                    scope.enter_context(autotune(mode="replay", cache_dir=tempfile.mkdtemp(prefix="tactix-plan-time-")))
                results[f"{name}/{op}/b{count}"] = _time_plans(name, op, count, low, high, args.plans)
    if args.json:
        Path(args.json).write_text(json.dumps({"store": args.store, "results": results}, indent=2) + "\n")


def _time_plans(name: str, op: str, count: int, low: int, high: int, plans: int) -> dict[str, object]:
    wrapper = tactix.PagedDecode("HND", backend=name) if op == "decode" else tactix.PagedPrefill("HND", backend=name)
    times = []
    tactix.reset_stats()
    made = [batch(i, count, low, high) for i in range(plans)]
    warm = []
    for round_ in range(2):
        for b in made:
            t0 = time.perf_counter()
            if op == "prefill":
                wrapper.plan(_QO, b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16, causal=True)
            else:
                wrapper.plan(b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)
            if round_:
                warm.append(time.perf_counter() - t0)
    for i in range(plans + 5):
        indptr, indices, last, _ = batch(i, count, low, high)
        extra = {}
        if op == "prefill":
            qo = torch.zeros(17, dtype=torch.int32)
            qo[1:] = torch.cumsum(torch.full((16,), 64), 0)
            extra = {"causal": True}
            t0 = time.perf_counter()
            wrapper.plan(qo, indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, **extra)
        else:
            t0 = time.perf_counter()
            wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        elapsed = time.perf_counter() - t0
        if i == 4:
            tactix.reset_stats()  # the first plans may build; the timed ones must not
        if i >= 5:
            times.append(elapsed)
    counts = tactix.stats()
    r: dict[str, object] = {
        "plan_us_median": statistics.median(times) * 1e6,
        "warm_plan_us_median": statistics.median(warm) * 1e6,
        "plans": counts["plans"],
        "builds": counts["builds"],
        "tactic": str(wrapper.tactic),
    }
    print(
        f"{name:8} {op:8} b{count:<3} plan {r['plan_us_median']:8.1f} us fresh, "
        f"{r['warm_plan_us_median']:8.1f} us warm  "
        f"builds {r['builds']}/{r['plans']}  {r['tactic']}"
    )
    return r


if __name__ == "__main__":
    main()
