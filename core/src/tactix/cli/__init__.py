"""The ``tactix`` command: backends, doctor, demo, bench, cache, conformance, warmup, support-matrix."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch

import tactix
from tactix.cli.cache import add_cache_parser
from tactix.registry import get_registry

__all__ = ["main"]


def _backend_rows() -> list[dict[str, Any]]:
    registry = get_registry()
    active = {b.name: b for b in registry.active()}
    rows = []
    for record in registry.records():
        row = record.as_dict()
        backend = active.get(record.name)
        if backend is not None:
            reasons = backend.environment()
            row["runs_here"] = not reasons
            row["not_here_because"] = reasons
        else:
            row["runs_here"] = False
            row["not_here_because"] = [record.error or record.status]
        rows.append(row)
    return rows


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_backends(args: argparse.Namespace) -> int:
    rows = _backend_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no tactix backends are installed (the 'tactix.backends' entry-point group is empty)")
        return 1
    table = [
        (
            r["name"],
            r["version"] or r["distribution_version"] or "?",
            r["distribution"] or "?",
            r["status"],
            ",".join(r["ops"]) or "-",
            "yes" if r["runs_here"] else "no",
        )
        for r in rows
    ]
    print(_table(("backend", "version", "distribution", "status", "ops", "runs here"), table))
    notes = [
        (r["name"], r["error"] or "; ".join(r["not_here_because"]))
        for r in rows
        if r["status"] != "active" or not r["runs_here"]
    ]
    if notes:
        print()
        for name, why in notes:
            print(f"{name}: {why}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    info: dict[str, Any] = {
        "tactix": tactix.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("TACTIX_")},
    }
    if torch.cuda.is_available():
        info["cudnn"] = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
        info["gpus"] = [
            {
                "index": i,
                "name": torch.cuda.get_device_name(i),
                "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(i)),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
                "multiprocessors": torch.cuda.get_device_properties(i).multi_processor_count,
            }
            for i in range(torch.cuda.device_count())
        ]
    info["backends"] = _backend_rows()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"tactix {info['tactix']}  python {info['python']}  torch {info['torch']}  ({info['platform']})")
    if info["cuda_available"]:
        print(f"CUDA {info['torch_cuda']}  cuDNN {info['cudnn']}")
        for g in info["gpus"]:
            print(
                f"  GPU {g['index']}: {g['name']}  sm_{g['compute_capability'].replace('.', '')}  "
                f"{g['memory_gib']} GiB  {g['multiprocessors']} SMs"
            )
    else:
        print(f"no CUDA GPU visible (torch built with CUDA {info['torch_cuda']}); GPU backends cannot run here")
    for k, v in info["env"].items():
        print(f"  {k}={v}")
    print()
    return cmd_backends(argparse.Namespace(json=False))


def cmd_demo(args: argparse.Namespace) -> int:
    from tactix.demo import format_rows, rows_json, run_demo

    if args.device:
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            raise tactix.InvalidArgumentError("--device", "'cpu' or 'cuda[:N]'", repr(args.device)) from exc
        if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
            available = "'cpu' or 'cuda[:N]'" if torch.cuda.is_available() else "'cpu' (no CUDA GPU is visible)"
            raise tactix.InvalidArgumentError("--device", available, repr(args.device))
    else:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rows = run_demo(device, decode_steps=args.decode_steps, seed=args.seed)
    print(format_rows(rows, device))
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_json(rows, device))
    return 0 if all(r.ok for r in rows) else 1


def cmd_conformance(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        import pytest
    except ImportError:
        print("tactix conformance needs pytest: pip install 'tactix[testing]'", file=sys.stderr)
        return 2
    get_registry().get(args.backend) if args.backend != "all" else None  # unknown names fail here
    argv = [
        "--pyargs",
        "tactix.testing.suite",
        f"--tactix-backend={args.backend}",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "-rfEsx" if args.verbose_skips else "-rfE",
    ]
    if args.json:
        argv.append(f"--tactix-report={args.json}")
    if args.device:
        argv.append(f"--tactix-device={args.device}")
    if args.all_tactics:
        argv.append("--tactix-all-tactics")
    return int(pytest.main(argv + extra))


def cmd_warmup(args: argparse.Namespace) -> int:
    """Pre-compile what a backend's default tactics need, with one progress line per item."""
    import time

    backend = get_registry().get(args.backend)
    if args.arch is not None and not args.arch.startswith("sm_"):
        raise tactix.InvalidArgumentError("--arch", "a target like 'sm_90'", repr(args.arch))
    start = time.perf_counter()

    def progress(done: int, total: int, label: str) -> None:
        print(f"  [{done}/{total}] {label}", file=sys.stderr, flush=True)

    compiled = backend._call("tactix_warmup", arch=args.arch, progress=progress)
    if compiled is None:
        print(f"{backend.name}: nothing to compile ahead of time")
        return 0
    print(f"{backend.name}: {compiled} compiled now, in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_support_matrix(args: argparse.Namespace) -> int:
    from tactix.testing.matrix import load_reports, render

    text = render(load_reports(args.reports))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.bench import markdown, run_bench, write_outputs

    device = (
        torch.device(args.device)
        if args.device
        else (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    )
    suite = args.suite or ("gpu" if device.type == "cuda" else "cpu")
    policy = MeasurementPolicy(warmup=args.warmup, repeat=args.repeat, execution=args.execution)
    report = run_bench(
        suite,
        device,
        cases=args.cases.split(",") if args.cases else None,
        backends=args.backends.split(",") if args.backends else None,
        tune=not args.no_tune,
        deterministic=args.deterministic,
        policy=policy,
        progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True),
    )
    write_outputs(report, args.json, args.markdown, args.png)
    print(markdown(report), end="")
    wrong = [r for r in report["rows"] if r["status"] == "wrong"]
    return 1 if wrong else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tactix", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tactix {tactix.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends and their status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("doctor", help="describe this machine (torch, CUDA, cuDNN, GPUs) and every backend")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("demo", help="run a Llama-like serving step through 'auto', checked against float64")
    p.add_argument("--device", help="'cpu' or 'cuda[:N]' (default: cuda if available)")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "conformance",
        help="run the conformance kit against a backend (extra arguments go to pytest)",
        description="Run the conformance kit (tactix.testing.suite) against a backend; "
        "arguments after the known options are passed to pytest (e.g. -k decode, -x).",
    )
    p.add_argument("backend", help="backend name, or 'all' for every active backend")
    p.add_argument("--json", metavar="PATH", help="write the JSON report (input of 'tactix support-matrix')")
    p.add_argument("--device", help="device for the cases (default: cuda if available, else cpu)")
    p.add_argument("--all-tactics", action="store_true", help="check every tactic, not a sample of three")
    p.add_argument("--verbose-skips", action="store_true", help="list every skipped case with its reason")
    p.set_defaults(func=cmd_conformance, passthrough=True)

    p = sub.add_parser("bench", help="time the benchmark suite for every backend and tuned 'auto'")
    p.add_argument("--suite", choices=["gpu", "cpu"], help="default: gpu on a GPU, cpu otherwise")
    p.add_argument("--device")
    p.add_argument("--cases", help="comma-separated case ids (default: all of the suite)")
    p.add_argument("--backends", help="comma-separated backends (default: every active one)")
    p.add_argument("--no-tune", action="store_true", help="leave out the tuned 'auto' rows")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="plan attention with deterministic=True (default: the fastest tactics, deterministic or not)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--execution", choices=["cuda_graph", "eager"], default="cuda_graph")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--png", metavar="PATH", help="bar chart of ratios to the best (needs matplotlib)")
    p.set_defaults(func=cmd_bench)

    add_cache_parser(sub)

    p = sub.add_parser("warmup", help="compile a backend's kernels ahead of time (its default tactics)")
    p.add_argument("backend", help="backend name, e.g. cuda_native")
    p.add_argument("--arch", help="target architecture such as sm_90 (default: the current GPU's)")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("support-matrix", help="render conformance reports as docs/support-matrix.md")
    p.add_argument("reports", nargs="+", help="JSON reports written by 'tactix conformance --json'")
    p.add_argument("-o", "--output", help="write here instead of standard output")
    p.set_defaults(func=cmd_support_matrix)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        build_parser().parse_args(argv)  # reports the unknown arguments and exits 2
    try:
        code: int = args.func(args, extra) if getattr(args, "passthrough", False) else args.func(args)
    except tactix.TactixError as exc:
        print(f"tactix: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
