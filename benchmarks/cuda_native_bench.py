"""cuda_native on the standard prefill, decode and skinny-GEMM shapes: every tactic, beside the other backends.

For P1-P4 (prefill, causal, Llama-3-8B-like heads, HND, page 16, bf16), D1, D2, D3 (decode)
and G2 (m in 1, 16, 64; n = k = 4096) this times cuda_native's default and every tactic it
enumerates, and the default of every other active backend (cudnn, torch, trtllm where
installed), all in one run with the same method as ``tactix bench`` (CUDA-graph replay, a
256 MB L2 flush before each call, median of --repeat). Outputs are checked first (prefill:
against the float64 oracle; decode and GEMM: a float32 reference). Prefill reports TFLOP/s
(4 h d per unmasked (q, k) pair), decode TB/s (K and V bytes read plus q and out), GEMM TB/s of
weight bytes and the ratio to torch (cuBLAS). Targets (../shared/BENCHMARKS.md): P1 >= 500,
P2 >= 600, P3 >= 420, P4 >= 600 TFLOP/s; D1 >= 3.95, D2 >= 2.0, D3 >= 4.45 TB/s; G2 m <= 64
>= 1.3x cuBLAS.

    python benchmarks/cuda_native_bench.py [--prefill] [--cases D2,G2-m1] [--default-only] [--json PATH]

Prefill tactics are timed with ``deterministic=False`` planning for the other backends (their
fastest plans), as ``tactix bench`` does; cuda_native's prefill is deterministic either way.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from typing import Any

import torch

import tactix
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import measure_with_policy
from tactix.bench import BenchCase, _attention_inputs, _attention_work, suite
from tactix.testing import attention_reference, relative_error, tolerance_for

PREFILL_CASES = ("P1", "P2", "P3", "P4")
CASES = (*PREFILL_CASES, "D1", "D2", "D3", "G2-m1", "G2-m16", "G2-m64")
CUDA = torch.device("cuda")


def decode_inputs(case: BenchCase) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    page = case.page_size
    pages = [-(-n // page) for n in case.kv_lens]
    order = torch.randperm(sum(pages), generator=gen).tolist()
    indptr, indices = [0], []
    for n in pages:
        indices += [order.pop() for _ in range(n)]
        indptr.append(len(indices))
    hq, hkv = case.heads
    shape = (sum(pages), hkv, page, case.head_dim)
    i32 = torch.int32
    return {
        "meta": (
            torch.tensor(indptr, dtype=i32),
            torch.tensor(indices, dtype=i32),
            torch.tensor([(n - 1) % page + 1 for n in case.kv_lens], dtype=i32),
        ),
        "k": torch.randn(shape, device=CUDA, dtype=torch.bfloat16),
        "v": torch.randn(shape, device=CUDA, dtype=torch.bfloat16),
        "q": torch.randn(len(case.kv_lens), hq, case.head_dim, device=CUDA, dtype=torch.bfloat16),
        "bytes": 2 * sum(case.kv_lens) * hkv * case.head_dim * 2 + 2 * len(case.kv_lens) * hq * case.head_dim * 2,
    }


def decode_reference(case: BenchCase, x: dict[str, Any]) -> torch.Tensor:
    """float32 reference with torch ops, one request at a time."""
    indptr, indices, _ = x["meta"]
    hq, hkv = case.heads
    out = torch.empty(x["q"].shape, device=CUDA, dtype=torch.float32)
    for b, n in enumerate(case.kv_lens):
        pages = indices[indptr[b] : indptr[b + 1]].to(CUDA).long()
        k = x["k"][pages].permute(1, 0, 2, 3).reshape(hkv, -1, case.head_dim)[:, :n].float()
        v = x["v"][pages].permute(1, 0, 2, 3).reshape(hkv, -1, case.head_dim)[:, :n].float()
        q = x["q"][b].float().view(hkv, hq // hkv, case.head_dim)
        p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(case.head_dim), dim=-1)
        out[b] = (p @ v).reshape(hq, case.head_dim)
    return out


def time_decode(case: BenchCase, x: dict[str, Any], backend: str, tactic: Any, ref: torch.Tensor,
                policy: MeasurementPolicy) -> dict[str, Any]:  # fmt: skip
    hq, hkv = case.heads
    w = tactix.PagedDecode("HND", backend=backend, device=CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tactix.FallbackWarning)
        w.plan(*x["meta"], hq, hkv, case.head_dim, case.page_size, q_data_type=torch.bfloat16, tactic=tactic)
    out = torch.empty_like(x["q"])
    w.run(x["q"], (x["k"], x["v"]), out=out)
    err = relative_error(out, ref.double())
    timing = measure_with_policy(lambda: w.run(x["q"], (x["k"], x["v"]), out=out), CUDA, policy)
    extra = ""
    plan = w.plan_object
    if hasattr(plan, "work"):
        extra = f"chunk {plan.chunk}, {len(plan.work.items)} items, merge {plan.work.needs_merge}"
    return {"tactic": str(w.tactic), "us": timing.median * 1e6, "tbs": x["bytes"] / timing.median / 1e12,
            "err": err, "timed_as": timing.timed_as, "note": extra}  # fmt: skip


def prefill_inputs(case: BenchCase) -> dict[str, Any]:
    x = _attention_inputs(case, CUDA, torch.bfloat16)
    ref, _ = attention_reference(x.q, x.k, x.v, x.qo_indptr, x.kv_indptr, x.kv_indices, x.last, kv_layout="HND",
                                 causal=True, sm_scale=1 / math.sqrt(case.head_dim))  # fmt: skip
    flops, _ = _attention_work(case, torch.bfloat16)
    return {"x": x, "ref": ref, "flops": flops}


def time_prefill(case: BenchCase, inputs: dict[str, Any], backend: str, tactic: Any, ref: torch.Tensor,
                 policy: MeasurementPolicy) -> dict[str, Any]:  # fmt: skip
    x = inputs["x"]
    hq, hkv = case.heads
    w = tactix.PagedPrefill("HND", backend=backend, device=CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tactix.FallbackWarning)
        w.plan(x.qo_indptr, x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size,
               q_data_type=torch.bfloat16, causal=True, deterministic=False, tactic=tactic)  # fmt: skip
    out = x.out
    out.fill_(float("nan"))
    w.run(x.q, (x.k, x.v), out=out)
    err = relative_error(out, ref)
    if not err <= tolerance_for(torch.bfloat16):
        return {"tactic": str(w.tactic), "error": f"wrong result: relative error {err:.3e}"}
    timing = measure_with_policy(lambda: w.run(x.q, (x.k, x.v), out=out), CUDA, policy)
    note = ""
    plan = w.plan_object
    if hasattr(plan, "work"):
        work = plan.work
        note = (f"{len(work.items)} items x {hq // work.pack} head groups, pack {work.pack}, "
                f"kv tiles {work.tiles[0]}..{work.tiles[-1]}")  # fmt: skip
    return {"tactic": str(w.tactic), "us": timing.median * 1e6, "tbs": inputs["flops"] / timing.median / 1e12,
            "err": err, "timed_as": timing.timed_as, "note": note}  # fmt: skip


def time_gemm(case: BenchCase, x: dict[str, Any], backend: str, tactic: Any, ref: torch.Tensor,
              policy: MeasurementPolicy) -> dict[str, Any]:  # fmt: skip
    g = tactix.Gemm(backend=backend, device=CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tactix.FallbackWarning)
        g.plan(case.m, case.n, case.k, tactic=tactic)
    out = torch.empty(case.m, case.n, device=CUDA, dtype=torch.bfloat16)
    g.run(x["a"], x["b"], out=out)
    err = relative_error(out, ref.double())
    timing = measure_with_policy(lambda: g.run(x["a"], x["b"], out=out), CUDA, policy)
    note = f"splits {g.plan_object.splits}" if hasattr(g.plan_object, "splits") else ""
    return {"tactic": str(g.tactic), "us": timing.median * 1e6, "tbs": case.n * case.k * 2 / timing.median / 1e12,
            "err": err, "timed_as": timing.timed_as, "note": note}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--prefill", action="store_true", help="P1-P4 only (same as --cases P1,P2,P3,P4)")
    parser.add_argument("--default-only", action="store_true", help="cuda_native's default tactic only")
    parser.add_argument("--others", help="other backends to time beside it, e.g. cudnn,torch (default: all active)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    policy = MeasurementPolicy(warmup=3, repeat=args.repeat)
    registry = tactix.get_registry()
    others = [b.name for b in registry.active() if b.name != "cuda_native" and not b.environment()]
    if args.others is not None:
        others = [name for name in args.others.split(",") if name in others]
    native = registry.get("cuda_native")
    cases = {c.id: c for c in suite("gpu")}
    rows = []
    chosen = PREFILL_CASES if args.prefill else tuple(args.cases.split(","))
    for cid in chosen:
        case = cases[cid]
        unit = {"prefill": "TFLOP/s", "decode": "TB/s", "gemm": "TB/s"}[case.op]
        if case.op == "prefill":
            x = prefill_inputs(case)
            ref = x["ref"]
            timer = time_prefill
            probe = tactix.PagedPrefill("HND", backend="cuda_native", device=CUDA)
            hq, hkv = case.heads
            a = x["x"]
            probe.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.last, hq, hkv, case.head_dim, case.page_size,
                       q_data_type=torch.bfloat16, causal=True)  # fmt: skip
        elif case.op == "decode":
            x = decode_inputs(case)
            ref = decode_reference(case, x)
            timer = time_decode
            probe = tactix.PagedDecode("HND", backend="cuda_native", device=CUDA)
            hq, hkv = case.heads
            probe.plan(*x["meta"], hq, hkv, case.head_dim, case.page_size, q_data_type=torch.bfloat16)
        else:
            a = torch.randn(case.m, case.k, device=CUDA, dtype=torch.bfloat16)
            w = (torch.randn(case.n, case.k, device=CUDA) / math.sqrt(case.k)).to(torch.bfloat16)
            x = {"a": a, "b": w.t()}
            ref = a.float() @ w.float().t()
            timer = time_gemm
            probe = tactix.Gemm(backend="cuda_native", device=CUDA)
            probe.plan(case.m, case.n, case.k)
        tactics = native.tactics(probe.problem)
        if args.default_only:
            tactics = tactics[:1]
        candidates = [("cuda_native", t) for t in tactics] + [(name, None) for name in others]
        for backend, tactic in candidates:
            try:
                row = timer(case, x, backend, tactic, ref, policy)
            except tactix.TactixError as exc:
                row = {"tactic": str(tactic), "error": str(exc)[:200]}
            row.update(case=cid, backend=backend)
            rows.append(row)
            if "us" in row:
                print(f"{cid:7} {backend:12} {row['tactic'][:70]:70} {row['us']:9.1f} us {row['tbs']:7.2f} {unit} "
                      f"err {row['err']:.1e} {row['timed_as']} {row['note']}", flush=True)  # fmt: skip
            else:
                print(f"{cid:7} {backend:12} {row['tactic'][:70]:70} FAILED {row['error']}", flush=True)
        ok = [r for r in rows if r["case"] == cid and "us" in r]
        best_native = min((r for r in ok if r["backend"] == "cuda_native"), key=lambda r: r["us"], default=None)
        best_other = min((r for r in ok if r["backend"] != "cuda_native"), key=lambda r: r["us"], default=None)
        torch_row = next((r for r in ok if r["backend"] == "torch"), None)
        if best_native is not None:
            summary = f"== {cid}: cuda_native best {best_native['tbs']:.2f} {unit} ({best_native['tactic']})"
            if best_other is not None:
                summary += f"; best other {best_other['backend']} {best_other['tbs']:.2f} {unit}"
            if case.op == "prefill":
                target = {"P1": 500, "P2": 600, "P3": 420, "P4": 600}[cid]
                summary += f"; target {target}"
            if case.op == "gemm" and torch_row is not None:
                summary += f"; {torch_row['us'] / best_native['us']:.2f}x cuBLAS (torch)"
            print(summary, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
