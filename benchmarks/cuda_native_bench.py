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
    python benchmarks/cuda_native_bench.py --quick [--json PATH]

``--quick`` (about a minute on the H200): the default tactic and a few chosen candidates per case
(L2 hint on and off, pipeline depth, chunk and split counts), cudnn with deterministic=True and
False, torch, and a bandwidth floor (``torch.sum`` over the same number of bytes, same method),
then one compact table. Kernel variants are compiled first, in parallel processes.

Prefill tactics are timed with ``deterministic=False`` planning for the other backends (their
fastest plans), as ``tactix bench`` does; cuda_native's prefill is deterministic either way.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import time
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
                policy: MeasurementPolicy, deterministic: bool = True) -> dict[str, Any]:  # fmt: skip
    hq, hkv = case.heads
    w = tactix.PagedDecode("HND", backend=backend, device=CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tactix.FallbackWarning)
        w.plan(*x["meta"], hq, hkv, case.head_dim, case.page_size, q_data_type=torch.bfloat16, tactic=tactic,
               deterministic=deterministic)  # fmt: skip
    out = torch.full_like(x["q"], float("nan"))
    w.run(x["q"], (x["k"], x["v"]), out=out)
    err = relative_error(out, ref.double())
    timing = measure_with_policy(lambda: w.run(x["q"], (x["k"], x["v"]), out=out), CUDA, policy)
    # the replays ran on the same buffers: the result must still be right (split-KV counters reset)
    err = max(err, relative_error(out, ref.double()))
    extra = ""
    plan = w.plan_object
    if hasattr(plan, "work"):
        extra = (f"chunk {plan.chunk}, {len(plan.work.items)} items, merge {plan.work.needs_merge}, "
                 f"{getattr(plan, 'ctas_per_sm', '?')} CTAs/SM")  # fmt: skip
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
    out = torch.full((case.m, case.n), float("nan"), device=CUDA, dtype=torch.bfloat16)
    g.run(x["a"], x["b"], out=out)
    err = relative_error(out, ref.double())
    timing = measure_with_policy(lambda: g.run(x["a"], x["b"], out=out), CUDA, policy)
    err = max(err, relative_error(out, ref.double()))  # still right after the replays (split-K counters reset)
    plan = g.plan_object
    note = f"splits {plan.splits}, {getattr(plan, 'ctas_per_sm', '?')} CTAs/SM" if hasattr(plan, "splits") else ""
    return {"tactic": str(g.tactic), "us": timing.median * 1e6, "tbs": case.n * case.k * 2 / timing.median / 1e12,
            "err": err, "timed_as": timing.timed_as, "note": note}  # fmt: skip


# -- --quick ---------------------------------------------------------------------------------

_D = "cuda_native:decode"
_G = "cuda_native:gemm"


def _dec(tile: int, warps: int, stages: int, kv_chunk: int = 0, l2: int = 1) -> dict[str, Any]:
    params = {"tile": tile, "warps": warps, "stages": stages, "kv_chunk": kv_chunk}
    if l2 != 1:
        params["l2"] = l2
    return {"backend": "cuda_native", "kernel": "decode", "params": params}


def _gem(bn: int, bk: int, wn: int, wk: int, stages: int, splits: int = 0, l2: int = 1) -> dict[str, Any]:
    params = {"bn": bn, "bk": bk, "wn": wn, "wk": wk, "stages": stages, "splits": splits}
    if l2 != 1:
        params["l2"] = l2
    return {"backend": "cuda_native", "kernel": "gemm", "params": params}


def _wg(bw: int, bk: int, stages: int, splits: int = 0) -> dict[str, Any]:
    return {"backend": "cuda_native", "kernel": "gemm_wgmma",
            "params": {"bw": bw, "bk": bk, "stages": stages, "splits": splits}}  # fmt: skip


# The candidates beside each default: the L2 hint off (0) and with a 256-byte prefetch (2), the
# pipeline depth (CTAs per SM), fixed chunk / split counts. The GEMM's default on Hopper is the
# wgmma kernel: beside it, its deeper and shallower rings, other split counts and 128-column
# tiles, and the mma.sync kernel's former defaults (no L2 policy there, see kernels/common.cuh).
QUICK: dict[str, list[dict[str, Any]]] = {
    "D1": [_dec(64, 4, 2, l2=0), _dec(64, 4, 2, l2=2), _dec(64, 4, 3), _dec(32, 2, 2), _dec(64, 4, 2, 1024)],
    "D2": [
        _dec(64, 4, 3, l2=0),
        _dec(64, 4, 3, l2=2),
        _dec(64, 4, 2),
        _dec(64, 4, 3, 512),
        _dec(32, 2, 3),
        _dec(32, 2, 3, 128),
    ],
    "D3": [_dec(64, 4, 2, l2=0), _dec(64, 4, 2, l2=2), _dec(64, 4, 3), _dec(32, 2, 2), _dec(64, 4, 2, 2048)],
    "G2-m1": [
        _wg(64, 64, 3),
        _wg(64, 64, 4, 8),
        _wg(128, 64, 3),
        _gem(32, 128, 1, 4, 4),
        _gem(64, 64, 2, 2, 4),
        _gem(32, 128, 1, 4, 4, l2=2),
        _gem(32, 128, 1, 4, 6, 4),
        _gem(32, 128, 1, 4, 4, 8),
        _gem(64, 128, 2, 2, 4, 4),
        _gem(32, 128, 1, 4, 4, 2),
    ],
    "G2-m16": [
        _wg(64, 64, 3),
        _wg(64, 64, 4, 8),
        _wg(128, 64, 3),
        _gem(32, 128, 1, 4, 4),
        _gem(64, 64, 2, 2, 4),
        _gem(32, 128, 1, 4, 4, l2=2),
        _gem(32, 128, 1, 4, 6, 4),
        _gem(32, 128, 1, 4, 4, 8),
        _gem(64, 128, 2, 2, 4, 4),
    ],
    "G2-m64": [
        _wg(64, 64, 3),
        _wg(64, 64, 6, 2),
        _wg(128, 64, 3),
        _wg(128, 64, 3, 4),
        _gem(64, 64, 2, 2, 6),
        _gem(64, 64, 2, 2, 6, l2=2),
        _gem(64, 64, 2, 2, 6, 8),
        _gem(128, 64, 4, 2, 4),
        _gem(128, 64, 4, 2, 4, 8),
        _gem(64, 128, 2, 2, 4, 4),
        _gem(128, 64, 4, 1, 6, 8),
    ],
}
TARGETS = {"D1": "3.95 TB/s", "D2": "2.0 TB/s", "D3": "4.45 TB/s", "G2-m1": "1.3x torch", "G2-m16": "1.3x torch",
           "G2-m64": "1.3x torch"}  # fmt: skip


def _compile_one(variant: Any) -> str:
    from tactix_cuda_native.runtime import compile_variant

    compile_variant(variant)
    return variant.label()


def precompile(cases: list[BenchCase]) -> None:
    """Every variant the quick run needs, compiled into the disk cache by parallel processes."""
    from tactix_cuda_native import decode, gemm
    from tactix_cuda_native.device import device_info
    from tactix_cuda_native.variants import default_variants

    info = device_info(torch.cuda.current_device())
    variants = [v for v in default_variants(info) if ("TX_BF16", "1") in v.defines]
    for case in cases:
        for t in QUICK.get(case.id, []):
            tactic = tactix.Tactic(**t)
            if t["kernel"] == "decode":
                p = decode.DecodeParams.from_tactic(tactic)
                variants.append(decode.decode_variant("bfloat16", case.head_dim, p, info.arch))
            else:
                params = gemm.gemm_params_of(tactic)
                variants.append(gemm.gemm_params_variant("bfloat16", case.m, params, info, case.n, case.k))
    variants = list(dict.fromkeys(variants))
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # fresh processes: NVRTC only, no CUDA context
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(16, len(variants)), mp_context=ctx) as pool:
            list(pool.map(_compile_one, variants))
    except Exception as exc:  # the plans compile what is missing, one by one
        print(f"parallel compile failed ({type(exc).__name__}: {exc}); compiling on demand", flush=True)
        return
    print(f"compiled or found {len(variants)} variants in {time.perf_counter() - t0:.1f} s", flush=True)


def floor_row(case: BenchCase, nbytes: int, policy: MeasurementPolicy) -> dict[str, Any]:
    """torch.sum over ``nbytes`` of bf16, timed the same way: what reading that many bytes costs here."""
    x = torch.randn(nbytes // 2, device=CUDA).to(torch.bfloat16)
    out = torch.empty((), device=CUDA, dtype=torch.bfloat16)
    timing = measure_with_policy(lambda: torch.sum(x, dim=0, out=out), CUDA, policy)
    return {"case": case.id, "backend": "floor", "tactic": f"torch.sum over {nbytes / 2**20:.1f} MiB",
            "us": timing.median * 1e6, "tbs": nbytes / timing.median / 1e12, "err": 0.0,
            "timed_as": timing.timed_as, "note": "read-only bandwidth floor"}  # fmt: skip


def parser_default_cases() -> str:
    return ",".join(CASES)


def quick(args: argparse.Namespace) -> int:
    policy = MeasurementPolicy(warmup=3, repeat=args.repeat)
    registry = tactix.get_registry()
    active = {b.name for b in registry.active() if not b.environment()}
    cases = {c.id: c for c in suite("gpu")}
    ids = list(QUICK) if args.cases == parser_default_cases() else args.cases.split(",")
    unknown = [cid for cid in ids if cid not in QUICK]
    if unknown:
        raise SystemExit(f"--quick times {', '.join(QUICK)}; it has no candidates for {', '.join(unknown)}")
    chosen = [cases[cid] for cid in ids]
    t0 = time.perf_counter()
    precompile(chosen)
    rows: list[dict[str, Any]] = []
    for case in chosen:
        if case.op == "decode":
            x = decode_inputs(case)
            ref = decode_reference(case, x)
            runs: list[tuple[str, Any, bool]] = [("cuda_native", None, True)]
            runs += [("cuda_native", tactix.Tactic(**t), True) for t in QUICK[case.id]]
            runs += [(b, None, det) for b in ("cudnn",) if b in active for det in (True, False)]
            runs += [("torch", None, True)] if case.id == "D2" and "torch" in active else []
            nbytes = x["bytes"]
        else:
            a = torch.randn(case.m, case.k, device=CUDA, dtype=torch.bfloat16)
            w = (torch.randn(case.n, case.k, device=CUDA) / math.sqrt(case.k)).to(torch.bfloat16)
            x = {"a": a, "b": w.t()}
            ref = a.float() @ w.float().t()
            runs = [("cuda_native", None, True)] + [("cuda_native", tactix.Tactic(**t), True) for t in QUICK[case.id]]
            runs += [(b, None, True) for b in ("cudnn", "torch") if b in active]
            nbytes = case.n * case.k * 2
        for backend, tactic, det in runs:
            try:
                if case.op == "decode":
                    row = time_decode(case, x, backend, tactic, ref, policy, deterministic=det)
                else:
                    row = time_gemm(case, x, backend, tactic, ref, policy)
                if tactic is None and backend == "cuda_native":
                    row["tactic"] = "default = " + row["tactic"]
                if backend == "cudnn" and case.op == "decode":
                    row["tactic"] = f"deterministic={det} " + row["tactic"]
            except Exception as exc:  # a refused plan, or a kernel fault (later rows then fail too)
                row = {"tactic": str(tactic), "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            row.update(case=case.id, backend=backend)
            rows.append(row)
        rows.append(floor_row(case, nbytes, policy))
    tol = tolerance_for(torch.bfloat16)
    print()
    print(f"{'case':7} {'backend':11} {'tactic':76} {'us':>8} {'TB/s':>6} {'err':>8}  note")
    for cid in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == cid]
        for r in mine:
            tactic = r["tactic"].replace(_D, "").replace(_G, "")
            if "us" in r:
                bad = "  WRONG" if not r["err"] <= tol else ""
                print(f"{cid:7} {r['backend']:11} {tactic[:76]:76} {r['us']:8.1f} {r['tbs']:6.2f} {r['err']:8.1e}  "
                      f"{r['note']}{bad}")  # fmt: skip
            else:
                print(f"{cid:7} {r['backend']:11} {tactic[:76]:76} FAILED {r['error']}")
        ok = [r for r in mine if "us" in r and r["err"] <= tol and r["backend"] != "floor"]
        native = [r for r in ok if r["backend"] == "cuda_native"]
        other = [r for r in ok if r["backend"] != "cuda_native"]
        torch_row = next((r for r in ok if r["backend"] == "torch"), None)
        default = next((r for r in native if r["tactic"].startswith("default")), None)
        if native and default is not None:
            best = min(native, key=lambda r: r["us"])
            line = f"== {cid}: default {default['us']:.1f} us {default['tbs']:.2f} TB/s; best {best['us']:.1f} us"
            line += f" {best['tbs']:.2f} TB/s ({best['tactic'].replace(_D, '').replace(_G, '')[:60]})"
            if other:
                bo = min(other, key=lambda r: r["us"])
                line += f"; best other {bo['backend']} {bo['us']:.1f} us"
            if torch_row is not None and cid.startswith("G"):
                line += (
                    f"; default {torch_row['us'] / default['us']:.2f}x, best {torch_row['us'] / best['us']:.2f}x torch"
                )
            print(line + f"; target {TARGETS.get(cid, '-')}")
    print(f"quick run: {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--prefill", action="store_true", help="P1-P4 only (same as --cases P1,P2,P3,P4)")
    parser.add_argument("--default-only", action="store_true", help="cuda_native's default tactic only")
    parser.add_argument("--others", help="other backends to time beside it, e.g. cudnn,torch (default: all active)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--quick", action="store_true", help="default + chosen candidates + cudnn/torch, one table")
    parser.add_argument("--head-dim", type=int, help="prefill and decode cases with this head dim instead of theirs")
    parser.add_argument("--only", help="cuda_native tactics whose name contains this text (the default is always kept)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    if args.quick:
        return quick(args)
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
        if args.head_dim and case.op != "gemm":
            case = dataclasses.replace(case, head_dim=args.head_dim)
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
        elif args.only:
            tactics = tactics[:1] + [t for t in tactics[1:] if args.only in str(t)]
        candidates = [("cuda_native", t) for t in tactics] + [(name, None) for name in others]
        for backend, tactic in candidates:
            try:
                row = timer(case, x, backend, tactic, ref, policy)
            except tactix.TactixError as exc:
                row = {"tactic": str(tactic), "error": str(exc)[:200]}
            row.update(case=cid, backend=backend, **({"head_dim": case.head_dim} if case.op != "gemm" else {}))
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
            label = f"{cid} d{case.head_dim}" if args.head_dim else cid
            summary = f"== {label}: cuda_native best {best_native['tbs']:.2f} {unit} ({best_native['tactic']})"
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
