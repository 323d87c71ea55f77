"""cuda_native's fp8-KV decode: every decode tactic the plugin enumerates, on the bench's fp8 cases.

For each case (default D1-fp8, D2-fp8, D3-fp8: an e4m3 cache, bf16 q) this plans cuda_native with
each candidate of `tactix_cuda_native.decode.decode_candidates` that the problem takes (the rest are
refused at plan and listed), checks the output against the case's float64 oracle and times it with
`tactix bench`'s method (CUDA-graph replay, a 256 MB L2 flush before each call, the median). The
table shows what the tuner can choose from, and what the ring depth and tile shape are worth.

    python benchmarks/fp8_decode_sweep.py [--cases D1-fp8,D3-fp8] [--repeat 20] [--tactics T1;T2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from typing import Any

import torch
from tactix_cuda_native.decode import decode_candidates
from tactix_cuda_native.device import device_info

import tactix
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import measure_with_policy
from tactix.bench import _attention_inputs, _attention_work, select_cases
from tactix.tactics import parse_tactic
from tactix.testing import attention_reference, relative_error
from tactix.testing.oracle import attention_tolerance

CUDA = torch.device("cuda")


def sweep(case_id: str, policy: MeasurementPolicy, only: list[str] | None = None) -> list[dict[str, Any]]:
    (case,) = select_cases("gpu", [case_id])
    dtype = torch.bfloat16
    x = _attention_inputs(case, CUDA, dtype)
    k_scale, v_scale = x.scale_values()
    ref, _ = attention_reference(x.q, x.k, x.v, x.qo_indptr, x.kv_indptr, x.kv_indices, x.last, kv_layout="HND",
                                 causal=False, sm_scale=1 / math.sqrt(case.head_dim), k_scale=k_scale,
                                 v_scale=v_scale)  # fmt: skip
    amount, _ = _attention_work(case, dtype)
    hq, hkv = case.heads
    kv_dtype = getattr(torch, case.kv_dtype) if case.kv_dtype else dtype
    tolerance = attention_tolerance(dtype, kv_dtype, dtype)
    rows: list[dict[str, Any]] = []
    if only:
        params = [None, *(parse_tactic(t) for t in only)]
    else:
        params = [None, *(p.to_tactic() for p in decode_candidates(case.head_dim, device_info(0), bool(case.kv_dtype)))]
    for tactic in params:
        w = tactix.PagedDecode("HND", backend="cuda_native", device=CUDA, run_extras=tuple(x.extras))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", tactix.FallbackWarning)
                w.plan(x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size,
                       q_data_type=dtype, kv_data_type=kv_dtype, tactic=tactic)  # fmt: skip
        except tactix.TactixError as exc:
            rows.append({"case": case_id, "tactic": str(tactic), "status": f"refused: {str(exc)[:120]}"})
            continue
        x.out.fill_(float("nan"))
        w.run(x.q, (x.k, x.v), out=x.out, **x.extras)
        err = relative_error(x.out, ref)
        if not err <= tolerance:
            rows.append({"case": case_id, "tactic": str(w.tactic), "status": f"wrong: {err:.3e}"})
            continue
        timing = measure_with_policy(lambda w=w: w.run(x.q, (x.k, x.v), out=x.out, **x.extras), CUDA, policy)
        err = max(err, relative_error(x.out, ref))
        rows.append({"case": case_id, "tactic": ("default " if tactic is None else "") + str(w.tactic),
                     "status": "ok", "us": timing.median * 1e6, "tbs": amount / timing.median / 1e12, "err": err,
                     "timed_as": timing.timed_as})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="D1-fp8,D2-fp8,D3-fp8")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--tactics", default=None, help="';'-separated tactics to time beside the default")
    args = parser.parse_args()
    policy = MeasurementPolicy(repeat=args.repeat)
    only = args.tactics.split(";") if args.tactics else None
    rows = [r for c in args.cases.split(",") for r in sweep(c, policy, only)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    for case in args.cases.split(","):
        ok = sorted((r for r in rows if r["case"] == case and r["status"] == "ok"), key=lambda r: r["us"])
        print(f"== {case}: {len(ok)} tactics timed, {sum(r['case'] == case for r in rows) - len(ok)} not")
        for r in ok[:12]:
            print(f"{r['us']:9.1f} us {r['tbs']:6.2f} TB/s  err {r['err']:.1e}  {r['tactic']}")
        for r in rows:
            if r["case"] == case and r["status"] != "ok" and not r["status"].startswith("refused"):
                print(f"  {r['status']}  {r['tactic']}")


if __name__ == "__main__":
    main()
