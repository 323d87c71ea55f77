"""The tactic store under a storm of writers and under SIGKILL: nothing lost, nothing corrupted.

Two properties a serving fleet relies on, checked with real processes on this machine:

* **Storm**: ``--writers`` processes tune into one store at once, each a mix of buckets of its
  own and buckets every writer tunes at the same moment, twice over (the second round finds
  every entry and tunes nothing). Afterwards every expected entry is there, ``verify`` finds no
  defect, and no temporary file is left.
* **SIGKILL**: a writer that rewrites large entries in a loop is killed with SIGKILL at random
  moments, ``--kills`` times. After each kill the store verifies clean and a fresh process reads
  every entry without a warning.

    python benchmarks/store_storm.py [--writers 16] [--buckets 92] [--kills 60] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import tactix
from tactix.autotune.store import StoreWarning, TacticStore

WRITER = textwrap.dedent(
    """
    import sys, torch, tactix
    root, worker, buckets, writers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    policy = tactix.MeasurementPolicy(warmup=0, repeat=1)
    with tactix.autotune(mode="tune", cache_dir=root, policy=policy):
        for i in range(buckets):
            # three in four buckets are this writer's own, one in four every writer tunes at once
            n = 8 * (1 + i % 23) if i % 4 == 3 else 8 * (24 + worker * buckets + i)
            tactix.Gemm(device="cpu").plan(2 ** (i % 7), n, 16, a_dtype=torch.float32)
    print(tactix.stats().get("tuned_problems", 0))
    """
)

KILLED = textwrap.dedent(
    """
    import sys
    from tactix.autotune.environment import environment
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.autotune.store import CandidateResult, StoreEntry, TacticStore
    from tactix import GemmProblem
    from tactix.tactics import Tactic
    store = TacticStore(sys.argv[1], environment(MeasurementPolicy())).attach()
    tactic = Tactic(backend="torch", kernel="matmul")
    results = [CandidateResult(tactic=tactic, status="ok", median_s=1e-5, samples=1, reason="x" * 200)] * 1500
    print("writing", flush=True)
    i = 0
    while True:
        p = GemmProblem(device_type="cpu", m=i % 32 + 1, n=64, k=32, a_dtype="bfloat16", b_dtype="bfloat16",
                        out_dtype="bfloat16")
        store.put(StoreEntry(op="gemm", key=p.key(), key_hash=p.key_hash(), tactic=tactic, baseline=tactic,
                             candidates=results, env_hash=store.env_hash))
        i += 1
    """
)


def check_store(root: Path) -> dict[str, Any]:
    """Entries, defects and leftovers of the one environment under ``root``; warnings are errors."""
    [env_dir] = TacticStore.environments(root)
    store = TacticStore.open(env_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        store.attach()
        entries = store.entries()
    return {
        "entries": len(entries),
        "keys": sorted(e.key_hash for e in entries),
        "defects": [f"{p}: {why}" for p, why in store.verify()],
        "temporaries": [str(p) for p in store.path.rglob(".tmp-*")],
    }


def storm(work: Path, writers: int, buckets: int) -> dict[str, Any]:
    root = work / "storm"
    script = work / "writer.py"
    script.write_text(WRITER)
    rounds = []
    for _ in range(2):
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, str(script), str(root), str(w), str(buckets), str(writers)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for w in range(writers)]  # fmt: skip
        tuned = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            if p.returncode:
                raise SystemExit(f"a writer failed:\n{err[-3000:]}")
            tuned.append(int(out.strip().splitlines()[-1]))
        rounds.append({"seconds": round(time.perf_counter() - start, 1), "tuned": sum(tuned)})
    found = check_store(root)
    shared = len({(2 ** (i % 7), 8 * (1 + i % 23)) for i in range(buckets) if i % 4 == 3})  # the same for all
    expected = writers * sum(1 for i in range(buckets) if i % 4 != 3) + shared
    return {
        "writers": writers,
        "buckets_per_writer": buckets,
        "rounds": rounds,
        "expected_entries": expected,
        "entries": found["entries"],
        "defects": found["defects"],
        "temporaries": found["temporaries"],
        "ok": found["entries"] == expected
        and not found["defects"]
        and not found["temporaries"]
        and rounds[1]["tuned"] == 0,
    }


def kills(work: Path, count: int, seed: int) -> dict[str, Any]:
    root = work / "killed"
    script = work / "killed.py"
    script.write_text(KILLED)
    rng = random.Random(seed)
    failures = []
    for i in range(count):
        proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        try:
            found = check_store(root)
        except (StoreWarning, ValueError) as exc:
            failures.append(f"kill {i}: {exc}")
            continue
        if found["defects"] or found["temporaries"] or found["entries"] < 1:
            failures.append(f"kill {i}: {found['defects'][:3]} {found['temporaries'][:3]} {found['entries']} entries")
    return {"kills": count, "seed": seed, "failures": failures, "ok": not failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--buckets", type=int, default=92)
    parser.add_argument("--kills", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "tactix": tactix.__version__},
            "storm": storm(work, args.writers, args.buckets),
            "sigkill": kills(work, args.kills, args.seed),
        }
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    s, k = result["storm"], result["sigkill"]
    print(f"storm: {s['writers']} writers x {s['buckets_per_writer']} buckets, twice: {s['entries']} of "
          f"{s['expected_entries']} entries, {len(s['defects'])} defects, {len(s['temporaries'])} temporaries, "
          f"rounds {s['rounds']} -> {'ok' if s['ok'] else 'FAILED'}")  # fmt: skip
    print(f"sigkill: {k['kills']} kills, {len(k['failures'])} failures -> {'ok' if k['ok'] else 'FAILED'}")
    sys.exit(0 if s["ok"] and k["ok"] else 1)


if __name__ == "__main__":
    main()
