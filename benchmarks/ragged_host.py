"""Host cost of a ragged-KV prefill ``run()`` when K and V are new tensors at every call.

A server hands `tactix.RaggedPrefill.run` the keys and values its layer just projected: new
tensors each layer, often at new addresses. cuda_native's tensor-map kernel keeps one map per
layout and swaps a new address into it (`TensorMaps.rebound`), so this times (host wall clock,
`tactix.autotune.timing.host_us`, one process) ``run()`` over the same K and V at every call and
over ``--layers`` pairs in turn (a new address at every call: two swaps), for cuda_native with
tensor maps and with the gather (``TACTIX_CUDA_NATIVE_RAGGED_TMA=0``), cudnn, and FlashInfer's own
ragged wrapper (fa3) where it is installed. It also times one map's encoding alone.

    python benchmarks/ragged_host.py [--cases R1,R3] [--layers 24] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import tactix
from tactix.autotune.timing import host_us
from tactix.bench import _attention_inputs, suite

CUDA = torch.device("cuda")
ENV = "TACTIX_CUDA_NATIVE_RAGGED_TMA"


class _Address:
    """A device address as a one-byte CUDA array interface."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _pairs(k: torch.Tensor, v: torch.Tensor, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for _ in range(layers)]


def _tactix(case: Any, x: Any, backend: str) -> Callable[[torch.Tensor, torch.Tensor], object]:
    hq, hkv = case.heads
    w = tactix.RaggedPrefill(backend=backend, device=CUDA)
    w.plan(x.qo_indptr, x.kv_indptr, hq, hkv, case.head_dim, case.dim_vo, causal=True, q_data_type=x.q.dtype)
    return lambda k, v: w.run(x.q, k, v, out=x.out)


def _flashinfer(case: Any, x: Any, backend: str) -> Callable[[torch.Tensor, torch.Tensor], object]:
    import flashinfer  # type: ignore[import-not-found]

    hq, hkv = case.heads
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=CUDA)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(x.qo_indptr, x.kv_indptr, hq, hkv, case.head_dim, head_dim_vo=case.dim_vo, causal=True,
           q_data_type=x.q.dtype, kv_data_type=x.k.dtype, sm_scale=1 / math.sqrt(case.head_dim))  # fmt: skip
    return lambda k, v: w.run(x.q, k, v, out=x.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="R1,R3")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--json")
    args = parser.parse_args()
    cases = {c.id: c for c in suite("gpu")}
    rows: list[dict[str, Any]] = []
    for cid in args.cases.split(","):
        case = cases[cid]
        x = _attention_inputs(case, CUDA, torch.bfloat16)
        pairs = _pairs(x.k, x.v, args.layers)
        impls = [("cuda_native tma", "cuda_native"), ("cuda_native gather", "cuda_native"), ("cudnn", "cudnn"),
                 ("flashinfer fa3", "fa3")]  # fmt: skip
        for rnd in range(2):
            for name, backend in impls:
                os.environ[ENV] = "0" if name.endswith("gather") else "1"
                row: dict[str, Any] = {"case": cid, "round": rnd, "impl": name}
                try:
                    make = _flashinfer if name.startswith("flashinfer") else _tactix
                    call = make(case, x, backend)
                    k, v = x.k, x.v
                    call(k, v)
                    torch.cuda.synchronize()
                    row["same_kv_us"] = host_us(lambda c=call, k=k, v=v: c(k, v), CUDA)
                    turn = itertools.cycle(pairs)
                    row["new_kv_us"] = host_us(lambda c=call, t=turn: c(*next(t)), CUDA)
                except Exception as exc:  # a probe: the row says what failed
                    row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
        os.environ.pop(ENV, None)
        # one map's encoding alone (what a new K or V costs cuda_native's run)
        from tactix_cuda_native.runtime import tensor_map

        t = pairs[0][0]
        samples = []
        for _ in range(200):
            start = time.perf_counter()
            tensor_map(t, (128, 1, 64))
            samples.append(time.perf_counter() - start)
        samples.sort()
        rows.append({"case": cid, "impl": "tensor_map encode", "us": samples[len(samples) // 2] * 1e6})
        print(json.dumps(rows[-1]), flush=True)
        # cuda.core's in-place address swap on a kept map (what a cache by layout would pay instead)
        desc = tensor_map(t, (128, 1, 64))
        other = pairs[1][0]
        samples = []
        for i in range(200):
            start = time.perf_counter()
            desc.replace_address(other if i % 2 else t)
            samples.append(time.perf_counter() - start)
        samples.sort()
        rows.append({"case": cid, "impl": "tensor_map replace_address", "us": samples[len(samples) // 2] * 1e6})
        print(json.dumps(rows[-1]), flush=True)
        # the same swap handed only the address (a CUDA array interface of one byte: no DLPack export)
        shims = [_Address(t.data_ptr()), _Address(other.data_ptr())]
        samples = []
        for i in range(200):
            start = time.perf_counter()
            desc.replace_address(shims[i % 2])
            samples.append(time.perf_counter() - start)
        samples.sort()
        rows.append({"case": cid, "impl": "replace_address (CAI)", "us": samples[len(samples) // 2] * 1e6})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "layers": args.layers, "rows": rows}, f, indent=1)
    print(f"{'case':5} {'impl':20} {'same K/V us':>12} {'new K/V us':>11}")
    for row in rows:
        if "us" in row:
            print(f"{row['case']:5} {row['impl']:20} {row['us']:12.1f}")
        elif row.get("round") == 1:
            if "failed" in row:
                print(f"{row['case']:5} {row['impl']:20} failed: {row['failed'][:80]}")
            else:
                print(f"{row['case']:5} {row['impl']:20} {row['same_kv_us']:12.1f} {row['new_kv_us']:11.1f}")


if __name__ == "__main__":
    main()
