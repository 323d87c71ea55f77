"""cuda_native's wgmma prefill over an fp8 KV cache against the same kernel over a 16-bit cache.

On P1 (8 x 2048, causal, 32/8 heads, d128; ``tactix bench``'s case) this times, in one process
with ``tactix bench``'s method (CUDA-graph replay, L2 flush, median), the wgmma kernel over a
bf16 cache and over an e4m3 cache for a few tactics each, in bf16 and in fp16 q (an fp8 code
converts to float16 in one instruction a pair, to bfloat16 in four: the difference between the
two rows is the conversion's cost), and for the fp8 cache each of kernels/fp8.cuh's conversion
modes, and under bf16 q Q K^T in float16 (``qk f16``: TX_QK16, TACTIX_CUDA_NATIVE_FP8_QK16=1) and
in bfloat16 (``qk bf16``, the default). Every output is checked against the float64 oracle
first.

    python benchmarks/fp8_prefill_probe.py [--json PATH] [--repeat N] [--tactic NAME ...]

``--once TACTIC`` (a key of `TACTICS`) runs that tactic once over each cache in bf16 q (over
the fp8 one with Q K^T in float16, then in bfloat16), after the check, and times nothing: a
run to put under a profiler, e.g. the shared-memory traffic and instructions of the kernels
(issue 22's question what bounds P1-fp8)::

    ncu --clock-control none -k tactix_prefill --metrics \
        l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_pipe_lsu.sum,gpu__time_duration.sum \
        python benchmarks/fp8_prefill_probe.py --once "128/128 s2 pp persist"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from typing import Any

import torch

import tactix
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import measure_with_policy
from tactix.bench import _attention_inputs, _attention_work, suite
from tactix.testing import attention_reference, relative_error

CUDA = torch.device("cuda")


def _wg(q_tile: int, kv_tile: int, stages: int, persist: int = 0, pingpong: int = 1) -> dict[str, Any]:
    params = {"q_tile": q_tile, "kv_tile": kv_tile, "warps": q_tile // 16, "stages": stages, "mma": "wgmma"}
    params.update({"persist": persist} if persist else {})
    params.update({"pingpong": pingpong} if pingpong else {})
    return {"backend": "cuda_native", "kernel": "prefill", "params": params}


TACTICS = {
    "128/128 s2 pp persist": _wg(128, 128, 2, persist=1),
    "128/128 s3 pp persist": _wg(128, 128, 3, persist=1),
    "128/64 s3 pp persist": _wg(128, 64, 3, persist=1),
    "128/64 s4 pp persist": _wg(128, 64, 4, persist=1),
}


def time_tactic(case: Any, x: Any, q_dtype: torch.dtype, tactic: dict[str, Any], ref: torch.Tensor, flops: float,
                policy: MeasurementPolicy | None) -> dict[str, Any]:  # fmt: skip
    """Plan ``tactic`` on ``x``, check the output against ``ref``, time it (``policy`` None: run
    once more, untimed, for a profiler)."""
    hq, hkv = case.heads
    extras = x.extras
    try:
        w = tactix.PagedPrefill("HND", backend="cuda_native", device=CUDA)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tactix.FallbackWarning)
            w.plan(x.qo_indptr, x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size,
                   q_data_type=q_dtype, kv_data_type=x.k.dtype, causal=True,
                   tactic=tactix.Tactic.model_validate(tactic))  # fmt: skip
        out = x.out
        out.fill_(float("nan"))
        w.run(x.q, (x.k, x.v), out=out, **extras)
        error = relative_error(out, ref)
        if policy is None:
            w.run(x.q, (x.k, x.v), out=out, **extras)
            torch.cuda.synchronize()
            return {"error": error}
        timing = measure_with_policy(lambda: w.run(x.q, (x.k, x.v), out=out, **extras), CUDA, policy)
    except Exception as e:  # a probe: the row says what failed
        return {"failed": f"{type(e).__name__}: {e}"[:300]}
    return {"error": error, "us": timing.median * 1e6, "tflops": flops / timing.median / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--once", choices=sorted(TACTICS), help="run this tactic once per cache, untimed")
    parser.add_argument("--tactic", action="append", choices=sorted(TACTICS), help="time only these (repeatable)")
    args = parser.parse_args()
    cases = {c.id: c for c in suite("gpu")}
    case = cases["P1"]
    fp8_case = cases["P1-fp8"]
    policy = None if args.once else MeasurementPolicy(warmup=3, repeat=args.repeat)
    chosen = [args.once] if args.once else args.tactic or list(TACTICS)
    tactics = {name: TACTICS[name] for name in chosen}
    rows = []
    for q_dtype in (torch.bfloat16,) if args.once else (torch.bfloat16, torch.float16):
        for kv in ("16-bit", "e4m3"):
            x = _attention_inputs(fp8_case if kv == "e4m3" else case, CUDA, q_dtype)
            ks, vs = (float(x.extras[n]) for n in ("k_scale", "v_scale")) if x.extras else (1.0, 1.0)
            ref, _ = attention_reference(x.q, x.k, x.v, x.qo_indptr, x.kv_indptr, x.kv_indices, x.last,
                                         kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(case.head_dim),
                                         k_scale=ks, v_scale=vs)  # fmt: skip
            flops, _ = _attention_work(case, q_dtype)
            # (conversion mode, Q K^T type): fp16 q computes Q K^T in float16 in any case
            modes = [("-", "-")] if kv == "16-bit" else [("1", "f16")] if q_dtype == torch.float16 else (
                [("1", "f16"), ("1", "bf16")] + ([] if args.once else [("2", "bf16")]))  # fmt: skip
            for mode, qk in modes:
                if mode != "-":
                    os.environ["TACTIX_CUDA_NATIVE_FP8_CVT"] = mode
                    os.environ["TACTIX_CUDA_NATIVE_FP8_QK16"] = "0" if qk == "bf16" else "1"
                for name, tactic in tactics.items():
                    if q_dtype == torch.float16 and kv == "16-bit" and "64" in name:
                        continue
                    row: dict[str, Any] = {"q": str(q_dtype).removeprefix("torch."), "kv": kv, "cvt": mode,
                                           "qk": qk, "tactic": name}  # fmt: skip
                    row.update(time_tactic(case, x, q_dtype, tactic, ref, flops, policy))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            os.environ.pop("TACTIX_CUDA_NATIVE_FP8_CVT", None)
            os.environ.pop("TACTIX_CUDA_NATIVE_FP8_QK16", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": "P1", "rows": rows}, f, indent=1)
    print(f"{'q':9} {'kv':7} {'cvt':3} {'qk':4} {'tactic':24} {'us':>8} {'TFLOP/s':>8} {'error':>8}")
    for r in rows:
        head = f"{r['q']:9} {r['kv']:7} {r['cvt']:3} {r['qk']:4} {r['tactic']:24}"
        if "us" not in r and "error" in r:
            print(f"{head} {'-':>8} {'-':>8} {r['error']:8.1e}")
        elif "us" in r:
            print(f"{head} {r['us']:8.1f} {r['tflops']:8.1f} {r['error']:8.1e}")
        else:
            print(f"{head} {r.get('failed')}")


if __name__ == "__main__":
    main()
