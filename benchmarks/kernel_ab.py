"""The ragged prefill kernels of two installs of tactix, timed against each other on one GPU.

A kernel change is timed against the commit before it: ``--old`` and ``--new`` are two
``PYTHONPATH`` entries (on the device, /tmp/old-site from ``.gpu/old``'s wheels and the checkout's
site; see ``benchmarks/h200_checks.sh``, job ``kernel-ab``). Each side runs
``benchmarks/ragged_tma_probe.py`` in its own process (its own NVRTC cache entries: the source is
part of a variant's key), in the order new, old, new, old, so drift of the card's clocks falls on
both. Every probe checks its outputs against the float64 oracle; the table gives, per case and
tactic, the fastest of each side's medians and new / old.

    python benchmarks/kernel_ab.py --old /tmp/old-site --new "$PYTHONPATH" [--cases R1,R2,R3]
        [--tactics "default,128 s2 pp persist sched2"] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROBE = Path(__file__).with_name("ragged_tma_probe.py")
# the probe alternates an environment variable within its process; here nothing reads this one, so
# its two columns are the same code (a within-process noise floor beside the A/B)
NOTHING = "TACTIX_KERNEL_AB_NOTHING"


def run_side(path: str, args: argparse.Namespace, json_path: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, str(PROBE), "--toggle", NOTHING, "--repeat", str(args.repeat), "--cases", args.cases,
           "--tactics", args.tactics, "--json", str(json_path)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True)
    data: dict[str, Any] = json.loads(json_path.read_text())
    return data


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and tactic: the fastest median of each side, new / old, and the largest error."""
    best: dict[tuple[str, str, str], list[float]] = {}
    errors: dict[tuple[str, str, str], float] = {}
    failed: dict[tuple[str, str, str], str] = {}
    for run in runs:
        for row in run["rows"]:
            key = (row["case"], row["tactic"], run["side"])
            if "us" in row:
                best.setdefault(key, []).append(row["us"])
                errors[key] = max(errors.get(key, 0.0), row["error"])
            else:
                failed[key] = row.get("failed", "?")
    out = []
    for case, tactic in sorted({k[:2] for k in (*best, *failed)}):
        entry: dict[str, Any] = {"case": case, "tactic": tactic}
        for side in ("old", "new"):
            key = (case, tactic, side)
            if key in best:
                entry[f"{side}_us"] = min(best[key])
                entry[f"{side}_error"] = errors[key]
            else:
                entry[f"{side}_failed"] = failed.get(key, "not run")
        if "old_us" in entry and "new_us" in entry:
            entry["new_over_old"] = entry["new_us"] / entry["old_us"]
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="PYTHONPATH of the older install")
    parser.add_argument("--new", required=True, help="PYTHONPATH of the newer install")
    parser.add_argument("--cases", default="R1,R2,R3")
    parser.add_argument("--tactics", default="default,128 s2 pp persist sched2")
    parser.add_argument("--rounds", type=int, default=2, help="new-old pairs")
    parser.add_argument("--repeat", type=int, default=30, help="timed replays per median")
    parser.add_argument("--json", help="write every probe's rows and the summary here")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for side, path in (("new", args.new), ("old", args.old)):
                data = run_side(path, args, Path(tmp) / f"{side}-{rnd}.json")
                runs.append({"side": side, "round": rnd, **data})
    rows = summary(runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "summary": rows}, f, indent=1)
    print(f"{'case':5} {'tactic':26} {'old us':>8} {'new us':>8} {'new/old':>7} {'max error':>9}")
    for r in rows:
        if "new_over_old" not in r:
            print(f"{r['case']:5} {r['tactic']:26} failed: {r.get('old_failed') or r.get('new_failed')}")
            continue
        err = max(r["old_error"], r["new_error"])
        times = f"{r['old_us']:8.1f} {r['new_us']:8.1f} {r['new_over_old']:7.3f}"
        print(f"{r['case']:5} {r['tactic']:26} {times} {err:9.1e}")


if __name__ == "__main__":
    main()
