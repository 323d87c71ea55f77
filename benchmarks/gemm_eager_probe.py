"""Why does the eager tuner pick a GEMM tactic that the eager bench then times slower? (issue 25)

Session 34's eager suite (benchmarks/results/h200-bench-eager-gemm-session34.json) tuned G2-m16 to
cuda_native's split-K tactic (``splits=2``) and then timed it at 20.1 us against 17.8 for the
default. The tuner times a candidate's plan ``run`` directly; the bench times ``Gemm.run``, the
public call with its argument checks. This probe times each given tactic every way at once, in
rounds that alternate between the tactics (so no tactic gets a state of the card to itself):

* ``wrapper``: ``Gemm.run`` under the eager policy (CUDA events around each call, L2 flushed
  before it), what the bench's eager row times;
* ``plan``: the plan's own ``run`` under the same policy, what the tuner times;
* ``graph``: the plan replayed from a CUDA graph (device time only);
* ``host``: host wall time of one ``Gemm.run`` (no synchronisation inside);
* ``stream``: wall time per call of 200 back-to-back ``Gemm.run`` calls, no flush: what an eager
  server that keeps the GPU queue full pays.

Then it tunes the case twice under the eager policy into fresh stores and prints each tuner
entry's candidates (first-pass and final-round medians) and the winner.

    python benchmarks/gemm_eager_probe.py [--case G2-m16] [--tactic T ...] [--rounds 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tactix
from tactix.autotune.context import autotune
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import host_us, measure_with_policy
from tactix.bench import select_cases

CUDA = torch.device("cuda")
DEFAULT_TACTICS = (
    "cuda_native:gemm_wgmma(bk=64,bw=64,splits=0,stages=4)",
    "cuda_native:gemm_wgmma(bk=64,bw=64,splits=2,stages=8,tma=2)",
)
EAGER = MeasurementPolicy(execution="eager", settle_blocks=1, warmup_ms=20)
GRAPH = MeasurementPolicy(execution="cuda_graph", settle_blocks=1, warmup_ms=20)
STREAM_CALLS = 200


def _stream_us(call: Any) -> float:
    torch.cuda.synchronize(CUDA)
    for _ in range(10):
        call()
    torch.cuda.synchronize(CUDA)
    start = time.perf_counter()
    for _ in range(STREAM_CALLS):
        call()
    torch.cuda.synchronize(CUDA)
    return (time.perf_counter() - start) / STREAM_CALLS * 1e6


def _tuner_entries(case: Any, a: torch.Tensor) -> list[dict[str, Any]]:
    """Tune the case under the eager policy into a fresh store; the entry's candidates."""
    root = tempfile.mkdtemp(prefix="tactix-gemm-probe-")
    g = tactix.Gemm(device=CUDA)
    with autotune(mode="tune", cache_dir=root, policy=EAGER):
        g.plan(case.m, case.n, case.k, a_dtype=a.dtype)
    entries = []
    for path in Path(root).rglob("entries/gemm/*.json"):
        data = json.loads(path.read_text())
        entries.append({"winner": str(g.tactic), "baseline": data.get("baseline"),
                        "candidates": sorted((c for c in data["candidates"] if c.get("median_s")),
                                             key=lambda c: c["median_s"])})  # fmt: skip
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="G2-m16")
    parser.add_argument("--tactic", action="append", default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    (case,) = select_cases("gpu", [args.case])
    gen = torch.Generator(device=CUDA).manual_seed(0)
    a = torch.randn(case.m, case.k, device=CUDA, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(case.n, case.k, device=CUDA, dtype=torch.bfloat16, generator=gen).t()
    out = torch.empty(case.m, case.n, device=CUDA, dtype=torch.bfloat16)
    tactics = args.tactic or list(DEFAULT_TACTICS)
    gemms = {}
    for t in tactics:
        g = tactix.Gemm(device=CUDA)
        g.plan(case.m, case.n, case.k, a_dtype=a.dtype, tactic=t)
        gemms[t] = g
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in tactics}
    for n in range(args.rounds):
        for t in tactics if n % 2 == 0 else list(reversed(tactics)):
            g = gemms[t]
            plan_run = g._run  # the tuner's call: the plan's run, no argument checks

            def wrapper(g: tactix.Gemm = g) -> None:
                g.run(a, b, out=out)

            def plan(plan_run: Any = plan_run) -> None:
                plan_run(a, b, out, None, None, None)

            row = samples[t]
            row.setdefault("wrapper", []).append(measure_with_policy(wrapper, CUDA, EAGER).median * 1e6)
            row.setdefault("plan", []).append(measure_with_policy(plan, CUDA, EAGER).median * 1e6)
            row.setdefault("graph", []).append(measure_with_policy(plan, CUDA, GRAPH).median * 1e6)
            row.setdefault("host", []).append(host_us(wrapper, CUDA))
            row.setdefault("stream", []).append(_stream_us(wrapper))
    kinds = ("wrapper", "plan", "graph", "host", "stream")
    print(f"{case.id} ({case.m}x{case.n}x{case.k}), medians over {args.rounds} alternating rounds, us")
    print(f"{'tactic':64s} " + " ".join(f"{k:>8s}" for k in kinds))
    for t in tactics:
        print(f"{t:64s} " + " ".join(f"{statistics.median(samples[t][k]):8.2f}" for k in kinds))
    tuned = [_tuner_entries(case, a) for _ in range(2)]
    for i, entries in enumerate(tuned):
        for e in entries:
            print(f"tuner run {i + 1}: winner {e['winner']} (baseline {e['baseline']})")
            for c in e["candidates"][:6]:
                print(f"  {c['median_s'] * 1e6:8.2f} us  n={c.get('samples')}  {c['tactic']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"case": case.id, "rounds": args.rounds, "samples_us": samples,
                                               "tuner": tuned}, indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
