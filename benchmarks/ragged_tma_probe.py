"""cuda_native's ragged-KV prefill with K and V through tensor maps against the one-token-page gather.

On ``tactix bench``'s ragged cases (R1 and R2: DeepSeek 192/128, 16 heads, 4 x 1024 and 1 x 8192;
R3: d128 chunks of 512 over 4096) this times, in one process with ``tactix bench``'s method
(CUDA-graph replay, L2 flush, median), the wgmma prefill kernel on a few tactics with the K and V
tiles loaded through tensor maps of the packed tensors (``TX_KV_TMA``, the default) and gathered
by the producer warpgroup as pages of one token (``TACTIX_CUDA_NATIVE_RAGGED_TMA=0``), the two
alternating twice. Every output is checked against the float64 oracle, and the two loads' outputs
against each other (bit for bit).

    python benchmarks/ragged_tma_probe.py [--json PATH] [--repeat N] [--cases R1,R2,R3]

``--toggle ENV`` alternates another switch the same way instead (set to 1, then 0; the columns
keep their names: "tma" is 1, "gather" 0), e.g. ``--toggle TACTIX_CUDA_NATIVE_HEAD_SECTIONS
--tactics default`` for the grid's head sections against heads fastest over every head.
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
from tactix.testing import ragged_reference, relative_error

CUDA = torch.device("cuda")
ENV = "TACTIX_CUDA_NATIVE_RAGGED_TMA"


def _wg(kv_tile: int, stages: int, persist: int = 0, sched: int = 0) -> dict[str, Any]:
    params: dict[str, Any] = {"q_tile": 128, "kv_tile": kv_tile, "warps": 8, "stages": stages, "mma": "wgmma",
                              "pingpong": 1, "sched": sched}  # fmt: skip
    params.update({"persist": persist} if persist else {})
    return {"backend": "cuda_native", "kernel": "prefill", "params": params}


TACTICS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "128 s2 pp": _wg(128, 2),
    "128 s2 pp persist sched2": _wg(128, 2, persist=1, sched=2),
    "128 s2 pp persist sched3": _wg(128, 2, persist=1, sched=3),
    "64 s3 pp persist": _wg(64, 3, persist=1),
}


def run_tactic(case: Any, x: Any, tactic: dict[str, Any] | None, ref: torch.Tensor, flops: float,
               policy: MeasurementPolicy) -> dict[str, Any]:  # fmt: skip
    """Plan ``tactic`` (None: cuda_native's default) on the case, check it against ``ref``, time it."""
    hq, hkv = case.heads
    try:
        w = tactix.RaggedPrefill(backend="cuda_native", device=CUDA)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tactix.FallbackWarning)
            chosen = None if tactic is None else tactix.Tactic.model_validate(tactic)
            w.plan(x.qo_indptr, x.kv_indptr, hq, hkv, case.head_dim, case.dim_vo, causal=True,
                   q_data_type=x.q.dtype, tactic=chosen)  # fmt: skip
        out = x.out
        out.fill_(float("nan"))
        w.run(x.q, x.k, x.v, out=out)
        result = out.clone()
        error = relative_error(out, ref)
        timing = measure_with_policy(lambda: w.run(x.q, x.k, x.v, out=out), CUDA, policy)
    except Exception as e:  # a probe: the row says what failed
        return {"failed": f"{type(e).__name__}: {e}"[:300]}
    return {"tactic_used": str(w.plan_object.tactic), "tma": bool(w.plan_object.paged._kv_tma),
            "head_section": w.plan_object.paged._section, "error": error,
            "us": timing.median * 1e6, "tflops": flops / timing.median / 1e12, "_out": result}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--cases", default="R1,R2,R3")
    parser.add_argument("--toggle", default=ENV, help="the environment variable set to 1, then 0")
    parser.add_argument("--tactics", help="a comma-separated subset of the tactic names")
    args = parser.parse_args()
    tactics = {n: t for n, t in TACTICS.items() if args.tactics is None or n in args.tactics.split(",")}
    cases = {c.id: c for c in suite("gpu")}
    policy = MeasurementPolicy(warmup=3, repeat=args.repeat)
    rows = []
    for cid in args.cases.split(","):
        case = cases[cid]
        x = _attention_inputs(case, CUDA, torch.bfloat16)
        ref, _ = ragged_reference(x.q, x.k, x.v, x.qo_indptr, x.kv_indptr, causal=True,
                                  sm_scale=1 / math.sqrt(case.head_dim))  # fmt: skip
        flops, _ = _attention_work(case, torch.bfloat16)
        outs: dict[tuple[str, str], torch.Tensor] = {}
        for rnd in range(2):
            for load in ("1", "0"):
                os.environ[args.toggle] = load
                for name, tactic in tactics.items():
                    row: dict[str, Any] = {"case": cid, "round": rnd, "load": "tma" if load == "1" else "gather",
                                           "tactic": name}  # fmt: skip
                    row.update(run_tactic(case, x, tactic, ref, flops, policy))
                    out = row.pop("_out", None)
                    if out is not None:
                        other = outs.get((name, "0" if load == "1" else "1"))
                        if other is not None:
                            row["bitwise_equal_to_other_load"] = bool(torch.equal(out, other))
                        outs[(name, load)] = out
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        os.environ.pop(args.toggle, None)
    if args.json:
        gpu = torch.cuda.get_device_name()
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "toggle": args.toggle, "rows": rows}, f, indent=1)
    print(f"{'case':5} {'tactic':26} {'tma us':>8} {'gather us':>9} {'ratio':>6} {'TFLOP/s':>8} {'error':>8} equal")
    for cid in args.cases.split(","):
        for name in tactics:
            mine = [r for r in rows if r["case"] == cid and r["tactic"] == name]
            tma = [r["us"] for r in mine if r["load"] == "tma" and "us" in r]
            gat = [r["us"] for r in mine if r["load"] == "gather" and "us" in r]
            if not tma or not gat:
                print(f"{cid:5} {name:26} failed: {next((r.get('failed') for r in mine if 'failed' in r), '?')}")
                continue
            t, g = min(tma), min(gat)
            best = next(r for r in mine if r.get("us") == t)
            equal = all(r.get("bitwise_equal_to_other_load", True) for r in mine)
            cols = f"{t:8.1f} {g:9.1f} {g / t:6.3f} {best['tflops']:8.1f} {best['error']:8.1e}"
            print(f"{cid:5} {name:26} {cols} {equal}")


if __name__ == "__main__":
    main()
