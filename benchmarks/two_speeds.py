"""Why does a new fp8 decode plan run slow for its first calls? Kernel time beside the SM clock.

Session 19 found cuda_native's fp8 decode rows switching from slow to fast partway through a row
(+14-16 us on D1-fp8 and D3-fp8, none on the memory-bound 16-bit D3), and the tuned-auto row with
the same tactic staying slow. This times the graph-replayed kernel call by call with the bench's
method (256 MB L2 flush before each call) and, before each call, a fixed spin of the GPU's cycle
counter (`torch.cuda._sleep`) whose event time gives the SM clock at that moment. It also records
the GPU's idle gap between calls (is the host keeping up?). Blocks, in order, per case: a new plan
(A), a second new plan with the same tactic (B), plan A again; then tuned `auto` inside
`autotune(mode="tune")` and the same wrapper after leaving it.

With ``--triggers``, it instead times several decode tactics in blocks after candidate triggers
of the slow state: nothing (steady), a new 2 GB allocation (the allocator's cache emptied first),
a new copy of the KV cache read instead of the old one, and a gather of one byte per 64 KB of
the cache (a TLB-bound probe, timed before each block).

With ``--sources``, it times a plain plan in consecutive blocks after each suspect of the
longer slow state seen after tuning (the torch backend's runs, other tactics' plans, trtllm's
runs, a whole tuning run, an idle pause).

    python benchmarks/two_speeds.py [--cases D3-fp8,D1-fp8,D3] [--calls 60] [--triggers | --sources]
                                    [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from typing import Any

import torch

import tactix
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import _capture, l2_flush
from tactix.bench import _attention_inputs, select_cases

CUDA = torch.device("cuda")
SPIN_CYCLES = 40_000  # about 20 us at 1980 MHz


def _block(call: Any, calls: int) -> dict[str, Any]:
    graph = _capture(call, CUDA)
    assert graph is not None
    flush = l2_flush(CUDA, 256 * 2**20)
    assert flush is not None
    for _ in range(3):
        graph.replay()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(5)] for _ in range(calls)]  # type: ignore[no-untyped-call]
    for e in ev:
        e[0].record()  # before the flush: the gap from the previous call's end is GPU idle time
        flush()
        e[1].record()
        torch.cuda._sleep(SPIN_CYCLES)
        e[2].record()
        graph.replay()
        e[3].record()
    torch.cuda.synchronize()
    kernel = [e[2].elapsed_time(e[3]) * 1e3 for e in ev]
    mhz = [SPIN_CYCLES / (e[1].elapsed_time(e[2]) * 1e3) for e in ev]
    idle = [ev[i - 1][3].elapsed_time(ev[i][0]) * 1e3 for i in range(1, calls)]
    return {"kernel_us": [round(x, 1) for x in kernel], "spin_mhz": [round(x) for x in mhz],
            "idle_us": [round(x, 1) for x in idle]}  # fmt: skip


def _summary(label: str, block: dict[str, Any]) -> str:
    k, m = block["kernel_us"], block["spin_mhz"]
    head, tail = k[:10], k[-20:]
    return (f"{label:28s} first10 {statistics.median(head):7.1f}  last20 {statistics.median(tail):7.1f} us"
            f"  MHz first10 {statistics.median(m[:10]):5.0f} last20 {statistics.median(m[-20:]):5.0f}"
            f"  idle max {max(block['idle_us']):6.1f} us  | {' '.join(f'{x:.0f}' for x in k[:30])}")  # fmt: skip


def _run_case(case: Any, calls: int) -> dict[str, Any]:
    x = _attention_inputs(case, CUDA, torch.bfloat16)
    hq, hkv = case.heads
    kw = {"kv_data_type": getattr(torch, case.kv_dtype)} if case.kv_dtype else {}
    blocks: dict[str, Any] = {}

    def wrapper(backend: str) -> Any:
        w = tactix.PagedDecode("HND", backend=backend, device=CUDA, run_extras=tuple(x.extras))
        w.plan(x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size,
               q_data_type=torch.bfloat16, **kw)  # fmt: skip
        return w

    def caller(w: Any) -> Any:
        return lambda: w.run(x.q, (x.k, x.v), out=x.out, **x.extras)

    a = wrapper("cuda_native")
    blocks["A new plan"] = _block(caller(a), calls)
    b = wrapper("cuda_native")
    blocks["B second plan"] = _block(caller(b), calls)
    blocks["A again"] = _block(caller(a), calls)
    store = tempfile.mkdtemp(prefix="two-speeds-")
    with tactix.autotune(mode="tune", cache_dir=store, policy=MeasurementPolicy(warmup=3, repeat=20)):
        auto = wrapper("auto")
        blocks["auto in tune context"] = _block(caller(auto), calls)
    blocks["auto after the context"] = _block(caller(auto), calls)
    c = wrapper("cuda_native")
    blocks["C plan after tuning"] = _block(caller(c), calls)
    print(f"{case.id}: cuda_native {a.tactic}; auto {auto.tactic}", flush=True)
    for label, block in blocks.items():
        print("  " + _summary(label, block), flush=True)
    return {"tactic": str(a.tactic), "auto": str(auto.tactic), "blocks": blocks}


TRIGGER_TACTICS = (None, (64, 4, 3, 3), (128, 8, 2, 0), (32, 2, 3, 0), (64, 4, 2, 3))


def _probe_us(cache: torch.Tensor) -> float:
    """Median time of gathering one byte per 64 KB of ``cache`` (a TLB-miss-bound read)."""
    flat = cache.view(torch.uint8).view(-1)
    idx = torch.randperm(flat.numel() // 65536, device=CUDA) * 65536
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        e0.record()
        flat[idx].sum()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times)


def _run_triggers(case: Any, calls: int) -> dict[str, Any]:
    from tactix_cuda_native.decode import DecodeParams

    x = _attention_inputs(case, CUDA, torch.bfloat16)
    hq, hkv = case.heads
    kw = {"kv_data_type": getattr(torch, case.kv_dtype)} if case.kv_dtype else {}
    out: dict[str, Any] = {}
    for shape in TRIGGER_TACTICS:
        tactic = None if shape is None else DecodeParams(tile=shape[0], warps=shape[1], stages=shape[2],
                                                         ctas=shape[3]).to_tactic()  # fmt: skip
        w = tactix.PagedDecode("HND", backend="cuda_native", device=CUDA, run_extras=tuple(x.extras))
        try:
            w.plan(x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size,
                   q_data_type=torch.bfloat16, tactic=tactic, **kw)  # fmt: skip
        except tactix.TactixError as exc:
            print(f"  {tactic}: refused ({str(exc)[:80]})")
            continue
        blocks: dict[str, Any] = {}
        kv = [x.k, x.v]  # the cache the calls read (replaced by a copy below)

        def caller(w: Any = w, kv: list[torch.Tensor] = kv) -> None:
            w.run(x.q, (kv[0], kv[1]), out=x.out, **x.extras)

        _block(caller, calls)  # settle
        blocks["steady"] = {"probe_us": _probe_us(kv[0]), **_block(caller, calls)}
        torch.cuda.empty_cache()
        big = torch.empty(2 * 2**30, dtype=torch.uint8, device=CUDA).fill_(1)
        blocks["after a new 2 GB allocation"] = {"probe_us": _probe_us(kv[0]), **_block(caller, calls)}
        del big
        torch.cuda.empty_cache()
        blocks["after freeing it"] = {"probe_us": _probe_us(kv[0]), **_block(caller, calls)}
        kv[:] = [x.k.clone(), x.v.clone()]
        blocks["a new copy of the cache"] = {"probe_us": _probe_us(kv[0]), **_block(caller, calls)}
        blocks["the copy again"] = {"probe_us": _probe_us(kv[0]), **_block(caller, calls)}
        kv.clear()
        label = str(w.tactic)
        print(f"{case.id} {label}", flush=True)
        for name, block in blocks.items():
            print(f"  probe {block['probe_us']:6.1f} us " + _summary(name, block), flush=True)
        out[label] = blocks
        torch.cuda.empty_cache()
    return out


def _after(label: str, call: Any, blocks: int, calls: int) -> dict[str, Any]:
    """``blocks`` blocks of ``calls`` timed calls of ``call`` in a row: how long a slow state lasts."""
    medians = [statistics.median(_block(call, calls)["kernel_us"]) for _ in range(blocks)]
    print(f"  {label:34s} " + " ".join(f"{m:.0f}" for m in medians), flush=True)
    return {"label": label, "block_medians_us": medians}


def _run_sources(case: Any, calls: int) -> list[dict[str, Any]]:
    """What starts the slow state after tuning: time a plain cuda_native plan in consecutive blocks
    after each suspect (a tuning run, the torch backend's runs, other cuda_native tactics' plans,
    trtllm's runs, a 0.2 s idle sleep)."""
    import time

    from tactix_cuda_native.decode import decode_candidates
    from tactix_cuda_native.device import device_info

    x = _attention_inputs(case, CUDA, torch.bfloat16)
    hq, hkv = case.heads
    kw = {"kv_data_type": getattr(torch, case.kv_dtype)} if case.kv_dtype else {}

    def wrapper(backend: str, tactic: Any = None) -> Any:
        w = tactix.PagedDecode("HND", backend=backend, device=CUDA, run_extras=tuple(x.extras))
        w.plan(x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size,
               q_data_type=torch.bfloat16, tactic=tactic, **kw)  # fmt: skip
        return w

    a = wrapper("cuda_native")

    def call_a() -> None:
        a.run(x.q, (x.k, x.v), out=x.out, **x.extras)

    def run_some(w: Any, times: int = 3) -> None:
        for _ in range(times):
            w.run(x.q, (x.k, x.v), out=x.out, **x.extras)
        torch.cuda.synchronize()

    rows = [_after(f"{case.id} steady", call_a, 3, calls)]
    run_some(wrapper("torch"))
    rows.append(_after("after torch runs", call_a, 8, calls))
    for t in decode_candidates(case.head_dim, device_info(0))[:12]:
        with contextlib.suppress(tactix.TactixError):
            run_some(wrapper("cuda_native", t.to_tactic()), 1)
    rows.append(_after("after 12 cuda_native plans", call_a, 8, calls))
    try:
        run_some(wrapper("trtllm"))
        rows.append(_after("after trtllm runs", call_a, 8, calls))
    except tactix.TactixError as exc:
        print(f"  trtllm: {exc}")
    store = tempfile.mkdtemp(prefix="two-speeds-")
    with tactix.autotune(mode="tune", cache_dir=store, policy=MeasurementPolicy(warmup=3, repeat=20)):
        auto = wrapper("auto")
    rows.append(_after(f"after tuning ({auto.tactic})", call_a, 12, calls))
    with tactix.autotune(mode="tune", cache_dir=tempfile.mkdtemp(prefix="two-speeds-")):
        wrapper("auto")
    time.sleep(0.2)
    rows.append(_after("after tuning, then 0.2 s idle", call_a, 8, calls))
    return rows


def _reset_persisting_l2() -> None:
    from cuda.bindings import driver

    driver.cuCtxResetPersistingL2Cache()


def _run_clearers(case: Any, calls: int) -> list[dict[str, Any]]:
    """What ends the slow state: after the torch backend's runs (the trigger), one candidate
    clearer, then consecutive blocks of a plain cuda_native plan."""
    x = _attention_inputs(case, CUDA, torch.bfloat16)
    hq, hkv = case.heads
    kw = {"kv_data_type": getattr(torch, case.kv_dtype)} if case.kv_dtype else {}

    def wrapper(backend: str) -> Any:
        w = tactix.PagedDecode("HND", backend=backend, device=CUDA, run_extras=tuple(x.extras))
        w.plan(x.kv_indptr, x.kv_indices, x.last, hq, hkv, case.head_dim, case.page_size,
               q_data_type=torch.bfloat16, **kw)  # fmt: skip
        return w

    a, t = wrapper("cuda_native"), wrapper("torch")

    def call_a() -> None:
        a.run(x.q, (x.k, x.v), out=x.out, **x.extras)

    src = torch.empty(2**30, dtype=torch.uint8, device=CUDA).fill_(3)
    dst = torch.empty_like(src)
    big = torch.empty(2**30, dtype=torch.uint8, device=CUDA)
    mat = torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16)
    clearers = {
        "nothing": lambda: None,
        "cuCtxResetPersistingL2Cache": _reset_persisting_l2,
        "1 GB copy (read and write)": lambda: dst.copy_(src),
        "1 GB zero_": big.zero_,
        "1 GB fill_(1)": lambda: big.fill_(1),
        "1 GB read (sum)": lambda: src.sum(dtype=torch.int64),
        "60 ms of 1 GB copies": lambda: [dst.copy_(src) for _ in range(60)],
        "60 ms of an SM spin": lambda: torch.cuda._sleep(60 * 1700 * 1000),
        "60 calls of the kernel, L2 warm": lambda: [call_a() for _ in range(60)],
        "60 calls of torch.mm 8192^2 bf16": lambda: [torch.mm(mat, mat) for _ in range(60)],
    }
    rows = [_after(f"{case.id} steady", call_a, 2, calls)]
    for label, clear in clearers.items():
        for _ in range(3):
            t.run(x.q, (x.k, x.v), out=x.out, **x.extras)
        clear()
        torch.cuda.synchronize()
        rows.append(_after(f"torch runs, then {label}", call_a, 5, calls))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="D3-fp8,D1-fp8,D3")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--triggers", action="store_true")
    parser.add_argument("--sources", action="store_true", help="what starts the slow state after tuning")
    parser.add_argument("--clearers", action="store_true", help="what ends the slow state")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "cases": {}}
    for case in select_cases("gpu", args.cases.split(",")):
        run = (_run_clearers if args.clearers else _run_sources if args.sources
               else _run_triggers if args.triggers else _run_case)  # fmt: skip
        report["cases"][case.id] = run(case, args.calls)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
