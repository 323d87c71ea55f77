"""Host time of an eager ``run()`` per backend: what a caller that does not capture CUDA graphs pays.

    python benchmarks/run_time.py [--backends cudnn,cuda_native,trtllm,torch] [--calls 300] [--json PATH]

For each backend: a decode wrapper planned for 8 and for 64 requests of 1k tokens (D-like shapes:
32/8 heads, d128, page 16, bf16), a prefill wrapper for 4 requests of 64 new tokens over 1k, and a
GEMM of m=4, n=k=4096; each ``run(..., out=...)`` is timed on the host only (enqueue, no sync in the
loop), the median of ``--rounds`` blocks of ``--calls`` calls. Uses only the public API, so the
same code measures an older checkout's wheels (``host_ab.py``). Compare numbers of one run
on one host only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import tactix


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def paged(batch: int, kv_len: int, q_len: int, page: int = 16) -> tuple[torch.Tensor, ...]:
    pages = -(-kv_len // page)
    indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32)
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    last = torch.full((batch,), (kv_len - 1) % page + 1, dtype=torch.int32)
    qo = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    return qo, indptr, indices, last


def attention_call(backend: str, op: str, batch: int, dev: torch.device) -> Callable[[], object]:
    q_len = 64 if op == "prefill" else 1
    qo, indptr, indices, last = paged(batch, 1024, q_len)
    pages = int(indptr[-1])
    k = torch.randn(pages, 8, 16, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch * q_len, 32, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    if op == "prefill":
        wrapper: tactix.PagedPrefill | tactix.PagedDecode = tactix.PagedPrefill("HND", backend=backend, device=dev)
        wrapper.plan(qo, indptr, indices, last, 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16)
    else:
        wrapper = tactix.PagedDecode("HND", backend=backend, device=dev)
        wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    wrapper.run(q, (k, v), out=out)
    return lambda: wrapper.run(q, (k, v), out=out)


def gemm_call(backend: str, dev: torch.device) -> Callable[[], object]:
    g = tactix.Gemm(backend=backend, device=dev)
    g.plan(4, 4096, 4096, a_dtype=torch.bfloat16)
    a = torch.randn(4, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16).t()
    out = torch.empty(4, 4096, device=dev, dtype=torch.bfloat16)
    g.run(a, b, out=out)
    return lambda: g.run(a, b, out=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cudnn,cuda_native,trtllm,torch")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("run_time.py needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    cases: list[tuple[str, Callable[[str], Callable[[], object]]]] = [
        ("decode b8", lambda b: attention_call(b, "decode", 8, dev)),
        ("decode b64", lambda b: attention_call(b, "decode", 64, dev)),
        ("prefill b4x64", lambda b: attention_call(b, "prefill", 4, dev)),
        ("gemm m4 4096^2", lambda b: gemm_call(b, dev)),
    ]
    rows: dict[str, dict[str, float | str]] = {}
    for backend in args.backends.split(","):
        row: dict[str, float | str] = {}
        for name, make in cases:
            try:
                call = make(backend)
            except tactix.TactixError as exc:
                row[name] = f"n/a ({type(exc).__name__})"
                continue
            for _ in range(3):
                per_call_us(call, args.calls)  # warm-up
            row[name] = statistics.median(per_call_us(call, args.calls) for _ in range(args.rounds))
        rows[backend] = row
    names = [name for name, _ in cases]
    print(f"{'run() host us':<14}" + "".join(f"{n:>17}" for n in names))
    for backend, row in rows.items():
        cells = [f"{v:>17.1f}" if isinstance(v, float) else f"{v:>17}" for v in (row[n] for n in names)]
        print(f"{backend:<14}" + "".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "run_host_us": rows}, indent=1))


if __name__ == "__main__":
    main()
