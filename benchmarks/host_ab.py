"""Interleaved same-host A/B of plan() and run() host times: two tactix installs, measured in turn.

    python benchmarks/host_ab.py --old /tmp/old-site --new "$PYTHONPATH" [--rounds 20] [--json PATH]

Why not two whole runs one after the other (what this repository did before session 13): the lent H200 hosts
drift by up to 2x within minutes, so a whole old run and a whole new run a few minutes apart
compare two hosts. Here two worker processes stay up side by side, one importing tactix from
``--old`` and one from ``--new`` (each ``PYTHONPATH``), both running this file's measurements (so
the harness is the same on both sides: only the package differs). The driver asks them in turn
for one measurement at a time, a few hundred milliseconds each, old first in even rounds and new
first in odd ones (ABBA: a linear drift cancels). Only one worker measures at any moment; the
other waits on its pipe. Each worker runs on a core of its own (where the OS lets it pin; the
cores rotate between the sides every round, since one core of a host can be slower than another)
with the garbage collector off while it measures. ``--control`` adds a third worker of the old
install: its control/old ratio is what the harness reads when nothing changed (an A/A), so a
new/old ratio is judged against it.

Session 13's H200 run (6 rounds, results/h200-host-ab-session13.json) still spread the per-round
ratios of a plan row over 0.7-1.8: use 20 rounds or more before judging a 3 % difference.

Measurements (the shapes of ``plan_time.py`` and ``run_time.py``; bf16, 32/8 heads, d128, page 16):
``plan`` of a decode batch of 64 requests of 4-8k tokens and of 8 of 1k, and of a ragged prefill
of 16 x 64 new tokens over 4k (new kv lengths each plan, in one shape bucket: no graph build),
the 20th percentile of ``--plans`` plans; eager ``run()`` host time (enqueue only) of decode b8 /
b64, prefill 4 x 64 and a GEMM m4 4096^2, the fastest of 5 blocks of ``--calls``/5 calls (low
estimators: the other tenants of a lent host only ever add time, and session 14's medians
spread an A/A, control against old, by up to 8 % over 41 rounds). The report: per
row, both sides' medians over the rounds and the median of the per-round new/old ratios (with
their spread), which is what "within 3 %" is judged on.

Each decode plan row is measured again with the page indices on the device (`DEVICE_INDEX_ROWS`,
"dev-idx"). ``--backends`` picks the plan rows' backends (default cudnn,cuda_native,trtllm; with
``flashinfer``, FlashInfer's own wrappers, host and device page indices like every row, as a
reference that both sides measure alike), ``--run-backends``
the run rows' (default cudnn,cuda_native,trtllm,torch); a row a side cannot measure says why.
On a machine without CUDA the run rows are left out and ``--device cpu`` plans with the torch
backend (a check of the harness, not a host-cost result).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "@@ab "  # a worker's replies (anything else it prints, a library's log line, is passed over)
PLAN_ROWS = (("decode", 64, 4100, 8000), ("decode", 8, 900, 1000), ("prefill", 16, 4100, 4200))
DEVICE_INDEX_ROWS = ("decode b64", "decode b8")
"""Plan rows measured a second time with the page indices on the device (row name + " dev-idx"),
the CSR offsets and last-page lengths on the host: what an engine that keeps its page table on the
GPU passes (vLLM). FlashInfer's wrappers get both too: with host indices their plan copies them
to the device from pageable memory, as it does for any caller that passes them so."""
RUN_ROWS = ("decode b8", "decode b64", "prefill b4x64", "gemm m4 4096^2")


# -- worker: one tactix install, measurements on request ---------------------------------------


class Worker:
    """Measurements of one install, each set up once (wrappers planned, batches made) on first use."""

    def __init__(self, device: str) -> None:
        import torch

        import tactix

        self.torch, self.tactix = torch, tactix
        self.device = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
        self.made: dict[str, Any] = {}

    def measure(self, kind: str, backend: str, row: str, count: int) -> float:
        key = f"{kind}/{backend}/{row}"
        if key not in self.made:
            if backend == "trtllm" and "prefill" in row and not _fmha_compiled():
                raise RuntimeError("trtllm's FMHAv2 prefill module is not compiled here (minutes of nvcc, which a "
                                   "host-time A/B must not spend): run 'tactix warmup trtllm' first")  # fmt: skip
            self.made[key] = self._plan_setup(backend, row) if kind == "plan" else self._run_setup(backend, row)
        fn = self.made[key]
        return fn(count)

    def _plan_setup(self, backend: str, row: str) -> Callable[[int], float]:
        torch, tactix = self.torch, self.tactix
        on_device = row.endswith(" dev-idx")
        op, count, low, high = next(r for r in PLAN_ROWS if row.startswith(f"{r[0]} b{r[1]}"))
        from plan_time import batch  # the same batches as plan_time.py

        batches = [batch(i, count, low, high) for i in range(64)]
        if on_device:
            batches = [(b[0], b[1].to(self.device), *b[2:]) for b in batches]
        qo = torch.arange(0, 17 * 64, 64, dtype=torch.int32)
        if backend == "flashinfer":  # FlashInfer's own wrappers, as the reference (the same on both sides)
            wrapper = _flashinfer_wrapper(op, self.device)
        else:
            spec = tactix.get_registry().get(backend).spec
            if spec.capabilities(op) is None:
                raise LookupError(f"{backend} does not implement {op}")
            cls = tactix.PagedDecode if op == "decode" else tactix.PagedPrefill
            wrapper = cls("HND", backend=backend, device=self.device)

        def plan(b: tuple[Any, ...]) -> float:
            t0 = time.perf_counter()
            if op == "prefill":
                wrapper.plan(qo, b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16, causal=True)
            else:
                wrapper.plan(b[0], b[1], b[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)
            return time.perf_counter() - t0

        for b in batches[:8]:  # the bucket's first plans may build a graph or compile
            plan(b)

        def timed(n: int) -> float:
            times = sorted(plan(batches[i % len(batches)]) for i in range(n))
            return times[len(times) // 5] * 1e6  # the 20th percentile: what a call costs undisturbed

        return timed

    def _run_setup(self, backend: str, row: str) -> Callable[[int], float]:
        from run_time import attention_call, gemm_call, per_call_us

        if row == "gemm m4 4096^2":
            call = gemm_call(backend, self.device)
        else:
            op, size = row.split()[0], row.split()[1]
            call = attention_call(backend, op, int(size[1:].split("x")[0]), self.device)
        for _ in range(3):
            per_call_us(call, 100)  # warm-up

        def timed(n: int) -> float:
            return min(per_call_us(call, max(n // 5, 1)) for _ in range(5))  # the least disturbed block

        return timed


def _fmha_compiled() -> bool:
    """Whether the FMHAv2 module the trtllm prefill rows load (bf16, HND) is in flashinfer's cache."""
    from tactix_trtllm.library import FmhaKey

    return bool(FmhaKey("HND", "bfloat16").spec().is_compiled)


def _flashinfer_wrapper(op: str, device: Any) -> Any:
    """FlashInfer's decode (fa2, CUDA cores: its default) or prefill (fa2) wrapper with its
    recommended 128 MiB workspace."""
    import flashinfer
    import torch

    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    if op == "decode":
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend="fa2")


def worker_main(device: str) -> None:
    worker = Worker(device)
    print(PREFIX + json.dumps({"ready": worker.tactix.__file__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        gc.disable()
        try:
            reply: dict[str, Any] = {"us": worker.measure(cmd["kind"], cmd["backend"], cmd["row"], cmd["count"])}
        except Exception as exc:  # a row this install cannot measure: the report says why
            reply = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"}
        gc.enable()
        print(PREFIX + json.dumps(reply), flush=True)


# -- driver ---------------------------------------------------------------------------------------


class Side:
    def __init__(self, name: str, path: str, device: str) -> None:
        env = {**os.environ, "PYTHONPATH": path}
        here = str(Path(__file__).resolve().parent)
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=here,
        )  # fmt: skip
        self.origin = self._reply()["ready"]

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return dict(json.loads(line[len(PREFIX) :]))
            sys.stderr.write(f"[{self.name}] {line}")
        raise SystemExit(f"host_ab.py: the {self.name} worker exited (rc {self.proc.wait()})")

    def pin(self, core: int) -> None:
        """Move every thread of the worker (the CUDA driver's too) to ``core``; where the OS does
        not allow it, the worker stays where it is."""
        tasks = Path(f"/proc/{self.proc.pid}/task")
        for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [self.proc.pid]:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, {core})

    def ask(self, kind: str, backend: str, row: str, count: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"kind": kind, "backend": backend, "row": row, "count": count}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a worker an interrupt already ended
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--old", help="PYTHONPATH of the old install")
    parser.add_argument("--new", help="PYTHONPATH of the new install")
    parser.add_argument("--backends", default="cudnn,cuda_native,trtllm")
    parser.add_argument("--run-backends", default="cudnn,cuda_native,trtllm,torch")
    parser.add_argument("--skip", default="", help="comma-separated fnmatch patterns of 'kind/backend/row' to leave "
                        "out (e.g. 'plan/*/prefill*,run/trtllm/*')")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--plans", type=int, default=60)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--device", default=None, help="cuda (default where CUDA is) or cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no round that would end after this many seconds (the report keeps the rounds done)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="a third worker of the old install: its ratio to old is the harness's own bias and noise",
    )
    args = parser.parse_args()
    if args.worker:
        worker_main(args.device or "cuda")
        return
    if args.old is None or args.new is None:
        parser.error("--old and --new are required")
    import torch  # the driver only asks: it measures nothing itself

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan_backends = args.backends.split(",") if device == "cuda" else ["torch"]
    plan_rows = [f"{op} b{n}" for op, n, _, _ in PLAN_ROWS]
    if device == "cuda":
        plan_rows += [f"{row} dev-idx" for row in DEVICE_INDEX_ROWS]
    jobs = [("plan", b, row, args.plans) for b in plan_backends for row in plan_rows]
    if device == "cuda":
        jobs += [("run", b, row, args.calls) for b in args.run_backends.split(",") for row in RUN_ROWS]
    skip = [p for p in args.skip.split(",") if p]
    jobs = [j for j in jobs if not any(fnmatch.fnmatch("/".join(j[:3]), p) for p in skip)]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    names = ["old", "new"] + (["control"] if args.control else [])
    pins = cores[-len(names) :] if len(cores) > len(names) else []  # the driver keeps the others
    paths = {"old": args.old, "new": args.new, "control": args.old}
    sides = {name: Side(name, paths[name], device) for name in names}
    print("\n".join(f"{n}: {s.origin}" for n, s in sides.items()) + f"\n{args.rounds} rounds, {device}", flush=True)
    times: dict[tuple[str, ...], dict[str, list[float]]] = {j[:3]: {n: [] for n in names} for j in jobs}
    errors: dict[tuple[str, ...], dict[str, str]] = {}
    began, rounds_done, last = time.perf_counter(), 0, 0.0
    try:
        for r in range(args.rounds):
            if args.budget_s is not None and time.perf_counter() - began + last > args.budget_s:
                print(f"stopping after {rounds_done} rounds: the next would pass --budget-s", flush=True)
                break
            start = time.perf_counter()
            # each round rotates both the order of asking and the cores: a side that always went
            # first, or always ran on one core (one that takes the interrupts, say), would bias it
            order = names[r % len(names) :] + names[: r % len(names)]
            if (r // len(names)) % 2:  # and every other cycle backwards (ABBA for two sides)
                order.reverse()
            if pins:
                for i, name in enumerate(names):
                    sides[name].pin(pins[(i + r) % len(pins)])
            done: dict[tuple[str, ...], dict[str, float]] = {}
            for job in jobs:
                for name in order:
                    reply = sides[name].ask(*job)
                    if "error" in reply:
                        errors.setdefault(job[:3], {})[name] = reply["error"]
                    else:
                        done.setdefault(job[:3], {})[name] = reply["us"]
            for key, measured in done.items():  # a round counts whole or not at all (an interrupt drops it)
                for name, us in measured.items():
                    times[key][name].append(us)
            rounds_done += 1
            last = time.perf_counter() - start  # round 1 carries the set-up (a JIT build): judge by the latest
            print(f"round {r + 1}/{args.rounds}: {last:.1f} s", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted after {rounds_done} rounds: reporting those", flush=True)
    for side in sides.values():
        side.close()
    report = _report(times, errors)
    print(_table(report))
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rounds": rounds_done,
                "old": sides["old"].origin, "new": sides["new"].origin}  # fmt: skip
        args.json.write_text(json.dumps({**meta, "rows": report}, indent=1) + "\n")


def _report(times: dict[tuple[str, ...], dict[str, list[float]]],
            errors: dict[tuple[str, ...], dict[str, str]]) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for key, sides in times.items():
        row: dict[str, Any] = {"kind": key[0], "backend": key[1], "row": key[2]}
        if key in errors:
            row["error"] = "; ".join(f"{side}: {why}" for side, why in sorted(errors[key].items()))
        for name, prefix in (("new", ""), ("control", "control_")):
            if name not in sides or not sides["old"] or len(sides["old"]) != len(sides[name]):
                continue
            ratios = sorted(n / o for o, n in zip(sides["old"], sides[name], strict=True))
            row.update({f"{name}_us": statistics.median(sides[name]), f"{prefix}ratio": statistics.median(ratios),
                        f"{prefix}ratio_low": ratios[len(ratios) // 4],
                        f"{prefix}ratio_high": ratios[(3 * len(ratios)) // 4]})  # fmt: skip
            row["old_us"] = statistics.median(sides["old"])
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    control = any("control_ratio" in r for r in rows)
    extra = (" control/old (median) | control quartiles |", "---|---|") if control else ("", "")
    lines = [f"| kind | backend | row | old (us) | new (us) | new/old (median) | quartiles |{extra[0]}",
             f"|---|---|---|---|---|---|---|{extra[1]}"]  # fmt: skip
    for r in rows:
        if "ratio" in r:
            line = (f"| {r['kind']} | {r['backend']} | {r['row']} | {r['old_us']:.1f} | {r['new_us']:.1f} | "
                    f"{r['ratio']:.3f} | {r['ratio_low']:.3f}-{r['ratio_high']:.3f} |")  # fmt: skip
            if "control_ratio" in r:
                line += f" {r['control_ratio']:.3f} | {r['control_ratio_low']:.3f}-{r['control_ratio_high']:.3f} |"
            lines.append(line)
        else:
            lines.append(f"| {r['kind']} | {r['backend']} | {r['row']} | - | - | - | {r.get('error', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
