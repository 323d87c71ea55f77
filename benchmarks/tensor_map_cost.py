"""Host time of the Hopper skinny GEMM's tensor maps (tactic param ``tma``) on a GPU.

    python benchmarks/tensor_map_cost.py [--m 64] [--n 4096] [--k 4096] [--calls 200] [--json PATH]

Times, on the host: encoding one tensor map (`runtime.tensor_map`, what a plan pays once per
weight and once per new activation address); and ``Gemm.run`` (enqueue only, CUDA-event-free:
``time.perf_counter`` over ``--calls`` calls, the GPU's queue drained before and after) for
``tma`` 0 (cp.async, no maps), ``tma`` 2 with the same ``a`` every call (its map kept), and
``tma`` 2 with a fresh ``a`` address every call (more addresses than the plan keeps maps: an
encode per call). Medians of five rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    from tactix_cuda_native import runtime

    import tactix

    dev = torch.device("cuda", 0)
    m, n, k = args.m, args.n, args.k
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    b = w.t()
    pool = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(32)]
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    rows = []

    view = w.unsqueeze(0)
    runtime.tensor_map(view, (1, 64, 64))
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        runtime.tensor_map(view, (1, 64, 64))
        times.append((time.perf_counter() - t0) * 1e6)
    rows.append({"what": "encode one tensor map (runtime.tensor_map)", "us": round(statistics.median(times), 2)})

    def run_cost(tma: int, fresh: bool) -> float:
        g = tactix.Gemm(backend="cuda_native", device=dev)
        params = {"bw": 64, "bk": 128 if tma else 64, "stages": 4}
        if tma:
            params["tma"] = tma
        g.plan(m, n, k, tactic={"backend": "cuda_native", "kernel": "gemm_wgmma", "params": params})
        for x in pool:
            g.run(x, b, out=out)
        rounds = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.calls):
                g.run(pool[i % len(pool)] if fresh else pool[0], b, out=out)
            rounds.append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
        return statistics.median(rounds)

    for tma, fresh, what in ((0, False, "Gemm.run, tma 0 (cp.async)"), (2, False, "Gemm.run, tma 2, the same a"),
                             (2, True, "Gemm.run, tma 2, a fresh a address every call")):  # fmt: skip
        rows.append({"what": what, "us": round(run_cost(tma, fresh), 2)})
    for row in rows:
        print(f"{row['what']:55s} {row['us']:8.2f} us (host)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "m": m, "n": n, "k": k, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
