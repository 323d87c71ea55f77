"""One launch each of cuda_native's ragged prefill and FlashInfer's fa3 ragged wrapper, for Nsight Compute.

Plans every implementation on a ``tactix bench`` ragged case, runs each a few times (compiles,
caches), then runs each once between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python benchmarks/ragged_ncu.py --case R2

profiles exactly those launches (cuda_native's default tactic, the tactics ``--tactics`` names,
then fa3). ``--tactics``: comma-separated names of `TACTICS` (default ``pingpong``; ``persist2`` and
``persist3`` are the persistent ping-pong kernel with sched 2 and sched 3).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

import tactix
from tactix.bench import _attention_inputs, suite

CUDA = torch.device("cuda")
PARAMS = {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma", "pingpong": 1}
TACTICS = {
    name: {"backend": "cuda_native", "kernel": "prefill", "params": {**PARAMS, **extra}}
    for name, extra in (
        ("pingpong", {}),
        ("persist2", {"persist": 1, "sched": 2}),
        ("persist3", {"persist": 1, "sched": 3}),
    )
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="R2")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave out fa3 (its JIT build takes minutes)")
    parser.add_argument("--tactics", default="pingpong", help=f"comma-separated, of {', '.join(TACTICS)}")
    args = parser.parse_args()
    case = {c.id: c for c in suite("gpu")}[args.case]
    x = _attention_inputs(case, CUDA, torch.bfloat16)
    hq, hkv = case.heads
    calls: list[tuple[str, Any]] = []
    named = [(f"cuda_native {n}", TACTICS[n]) for n in args.tactics.split(",") if n]
    for name, tactic in [("cuda_native default", None), *named]:
        w = tactix.RaggedPrefill(backend="cuda_native", device=CUDA)
        chosen = None if tactic is None else tactix.Tactic.model_validate(tactic)
        w.plan(x.qo_indptr, x.kv_indptr, hq, hkv, case.head_dim, case.dim_vo, causal=True, q_data_type=x.q.dtype,
               tactic=chosen)  # fmt: skip
        print(name, w.plan_object.tactic, flush=True)
        calls.append((name, lambda w=w: w.run(x.q, x.k, x.v, out=x.out)))
    try:
        if args.no_flashinfer:
            raise RuntimeError("left out (--no-flashinfer)")
        import flashinfer  # type: ignore[import-not-found]

        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=CUDA)
        fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        fw.plan(x.qo_indptr, x.kv_indptr, hq, hkv, case.head_dim, head_dim_vo=case.dim_vo, causal=True,
                q_data_type=x.q.dtype, kv_data_type=x.k.dtype, sm_scale=1 / math.sqrt(case.head_dim))  # fmt: skip
        calls.append(("flashinfer fa3", lambda: fw.run(x.q, x.k, x.v, out=x.out)))
    except Exception as exc:  # no FlashInfer here: the tactix rows alone
        print(f"flashinfer fa3: {type(exc).__name__}: {exc}")
    for _ in range(3):
        for _, call in calls:
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls:
        call()
        torch.cuda.synchronize()
        print("profiled", name, flush=True)
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
