"""What the tactic store costs a server: a lookup on a hit, and attaching a store of 10,000 entries.

Targets (issue 4): a hit under 20 us; attaching 10,000 entries under 1 s. Attaching lists the
entry files; each entry is read and validated the first time its bucket is looked up.

    python benchmarks/store_overhead.py [--entries 10000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import tactix
from tactix.autotune.environment import environment
from tactix.autotune.store import CandidateResult, StoreEntry, TacticStore
from tactix.ops import GemmProblem
from tactix.tactics import Tactic


def problems(count: int) -> list[GemmProblem]:
    out = []
    for i in range(count):  # distinct buckets: m buckets x n x k
        m, n, k = 2 ** (i % 12), 64 * (1 + (i // 12) % 30), 64 * (1 + i // 360)
        out.append(GemmProblem(device_type="cuda", m=m, n=n, k=k, a_dtype="bfloat16", b_dtype="bfloat16",
                               out_dtype="bfloat16"))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    env = environment(tactix.MeasurementPolicy())
    tactic = Tactic(backend="torch", kernel="matmul")
    candidates = [CandidateResult(tactic=tactic, status="ok", median_s=1e-5, samples=20, timed_as="cuda_graph"),
                  CandidateResult(tactic=Tactic.default("torch"), status="ok", median_s=2e-5, samples=20,
                                  timed_as="cuda_graph")]  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        store = TacticStore(root, env).attach()
        todo = problems(args.entries)
        t0 = time.perf_counter()
        for p in todo:
            entry = StoreEntry(
                op="gemm",
                key=p.key(),
                key_hash=p.key_hash(),
                tactic=tactic,
                baseline=Tactic.default("torch"),
                candidates=candidates,
                env_hash=store.env_hash,
            )
            store.put(entry)
        write_s = time.perf_counter() - t0
        attach = []
        for _ in range(3):
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                fresh = TacticStore(root, env).attach()
            attach.append(time.perf_counter() - t0)
        assert len(fresh) == args.entries
        # a hit as a plan pays it: the problem object is new for every plan
        sample = todo[:: max(1, len(todo) // 1000)]
        hits = []
        for _ in range(5):
            t0 = time.perf_counter()
            for p in sample:
                assert fresh.lookup(p) is not None
            hits.append((time.perf_counter() - t0) / len(sample))
    result = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "entries": args.entries,
        "write_all_s": write_s,
        "attach_s_median": statistics.median(attach),
        "first_lookup_us": hits[0] * 1e6,  # the bucket's file is read and validated once
        "lookup_hit_us_median": statistics.median(hits[1:]) * 1e6,
        "targets": {"attach_s": 1.0, "lookup_hit_us": 20.0},
    }
    print(f"entries {args.entries}: written in {write_s:.2f} s (fsync each)")
    print(f"attach: {result['attach_s_median']:.3f} s (target < 1 s)")
    print(f"first lookup of a bucket (reads its file): {result['first_lookup_us']:.1f} us")
    print(f"lookup on a hit: {result['lookup_hit_us_median']:.2f} us (target < 20 us)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
