"""The ``tactix`` command: backends, doctor, demo, bench, cache, conformance, warmup, support-matrix.

Anything a user can get wrong (an option's value, a name, a path) is one ``tactix: error: ...``
line on standard error and a non-zero exit, never a traceback. The ``--json`` convention every
subcommand follows is in `tactix.cli._output`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, cast

import torch

import tactix
from tactix.cli._output import add_json_option, check_output_path, json_to_stdout, write_json
from tactix.cli.cache import add_cache_parser
from tactix.cli.untuned_order import add_untuned_order_parser
from tactix.devices import named_device
from tactix.registry import Backend, get_registry

__all__ = ["main"]

DESCRIPTION: Final = (
    "One API for paged attention and GEMM whose kernels come from backend plugins. "
    "Every subcommand that writes JSON takes --json PATH (a file; the usual text is printed too) "
    "or --json / --json - (only the JSON, on standard output)."
)

EXIT_BROKEN_PIPE: Final = 141  # what a shell reports for a writer killed by SIGPIPE (128 + 13)
EXIT_INTERRUPTED: Final = 130  # 128 + SIGINT, as for a shell's Ctrl-C

_OUTPUT_OPTIONS: Final = {"json": "--json", "markdown": "--markdown", "png": "--png", "output": "--output"}
"""Options that name a file to write, by their argparse destination: checked before the command runs."""


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


def _backend(argument: str, name: str) -> Backend:
    """The active backend ``name``; for an unknown name, an error under ``argument`` listing the valid ones."""
    try:
        return get_registry().get(name)
    except tactix.BackendNotFoundError as exc:
        choices = ", ".join(repr(v) for v in exc.valid) or "none (no backend is installed)"
        raise tactix.InvalidArgumentError(argument, f"one of {choices}", repr(name)) from None


def cmd_backends(args: argparse.Namespace) -> int:
    rows = _backend_rows()
    if args.json is not None:
        write_json(args.json, rows)
        if json_to_stdout(args):
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
    if args.json is not None:
        write_json(args.json, info)
        if json_to_stdout(args):
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
        built = f"built with CUDA {info['torch_cuda']}" if info["torch_cuda"] else "a CPU-only build"
        print(f"no CUDA GPU visible (torch {info['torch']} is {built}); GPU backends cannot run here")
    for k, v in info["env"].items():
        print(f"  {k}={v}")
    print()
    return cmd_backends(argparse.Namespace(json=None))


def cmd_demo(args: argparse.Namespace) -> int:
    from tactix.demo import format_rows, rows_report, run_demo

    device = named_device("--device", args.device)
    rows = run_demo(device, decode_steps=args.decode_steps, seed=args.seed)
    if args.json is not None:
        write_json(args.json, rows_report(rows, device))
    if not json_to_stdout(args):
        print(format_rows(rows, device))
    return 0 if all(r.ok for r in rows) else 1


def cmd_conformance(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        import pytest
    except ImportError:
        print("tactix: error: tactix conformance needs pytest: pip install 'tactix[testing]'", file=sys.stderr)
        return 2
    from tactix.testing.plugin import backends_to_test

    backends_to_test(args.backend, "backend")  # an unknown name or a missing device: one error, before pytest
    named_device("--device", args.device)
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
    if args.device:
        argv.append(f"--tactix-device={args.device}")
    if args.all_tactics:
        argv.append("--tactix-all-tactics")
    to_stdout = json_to_stdout(args)
    with tempfile.TemporaryDirectory(prefix="tactix-conformance-") as scratch:
        report = str(Path(scratch) / "report.json") if to_stdout else args.json
        if report is not None:
            argv.append(f"--tactix-report={report}")
        # with the report on stdout, pytest's own output must not be mixed into it
        output: contextlib.AbstractContextManager[Any] = (
            contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext()
        )
        with output:
            code = int(pytest.main(argv + extra))
        if to_stdout and Path(report).exists():
            sys.stdout.write(Path(report).read_text())
    return code


def cmd_warmup(args: argparse.Namespace) -> int:
    """Pre-compile what a backend's default tactics need, with one progress line per item."""
    backend = _backend("backend", args.backend)
    if args.arch is not None and not args.arch.startswith("sm_"):
        raise tactix.InvalidArgumentError("--arch", "a target like 'sm_90'", repr(args.arch))
    start = time.perf_counter()

    def progress(done: int, total: int, label: str) -> None:
        print(f"  [{done}/{total}] {label}", file=sys.stderr, flush=True)

    compiled = backend.warmup(args.arch, progress)
    seconds = time.perf_counter() - start
    if args.json is not None:
        write_json(args.json, {"backend": backend.name, "arch": args.arch, "compiled": compiled,
                               "seconds": round(seconds, 3)})  # fmt: skip
        if json_to_stdout(args):
            return 0
    if compiled is None:
        print(f"{backend.name}: nothing to compile ahead of time")
        return 0
    print(f"{backend.name}: {compiled} compiled now, in {seconds:.1f} s")
    return 0


def cmd_support_matrix(args: argparse.Namespace) -> int:
    from tactix.testing.matrix import load_reports, render

    text = render(load_reports(args.reports))
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.bench import markdown, run_bench, select_cases, write_outputs

    device = named_device("--device", args.device)
    suite = args.suite or ("gpu" if device.type == "cuda" else "cpu")
    cases = [c.strip() for c in args.cases.split(",")] if args.cases else None
    select_cases(suite, cases, "--cases")  # an unknown id is refused before anything is measured
    backends = [_backend("--backends", n.strip()).name for n in args.backends.split(",")] if args.backends else None
    policy = MeasurementPolicy(
        warmup=args.warmup,
        warmup_ms=args.warmup_ms,
        repeat=args.repeat,
        execution=args.execution,
        settle_blocks=args.settle_blocks,
    )
    report = run_bench(
        suite,
        device,
        cases=cases,
        backends=backends,
        tune=not args.no_tune,
        untuned=not args.no_untuned,
        flashinfer=not args.no_flashinfer,
        deterministic=args.deterministic,
        policy=policy,
        progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True),
    )
    if args.json is not None:
        write_json(args.json, report, indent=1)
    write_outputs(report, None, args.markdown, args.png)
    if not json_to_stdout(args):
        print(markdown(report), end="")
    if report["environment"].get("interrupted"):
        print(f"tactix: interrupted during case {report['environment']['interrupted']}; the report holds the cases"
              " finished before it", file=sys.stderr)  # fmt: skip
        return 130
    wrong = [r for r in report["rows"] if r["status"] == "wrong"]
    return 1 if wrong else 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other tactix error (the usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"tactix: error: {message} (see '{self.prog} --help')\n")


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum} (got {text!r})")
        return value

    return parse


def _non_negative(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (got {text!r})")
    return value


def build_parser() -> argparse.ArgumentParser:
    from tactix.bench import SUITES
    from tactix.bench import suite as bench_suite

    parser = _Parser(prog="tactix", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tactix {tactix.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    device_help = "'cpu' or 'cuda[:N]' (default: cuda if a GPU is visible, else cpu)"

    p = sub.add_parser("backends", help="list installed backends and their status")
    add_json_option(p, "the backends")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("doctor", help="describe this machine (torch, CUDA, cuDNN, GPUs) and every backend")
    add_json_option(p, "the description")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("demo", help="run a Llama-like serving step through 'auto', checked against float64")
    p.add_argument("--device", help=device_help)
    p.add_argument("--decode-steps", type=_at_least(0), default=3, metavar="N",
                   help="decode steps after the prefill, each adding one token per request (default: 3)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, activations and cache (default: 0)")
    add_json_option(p, "the rows")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "conformance",
        help="run the conformance kit against a backend (extra arguments go to pytest)",
        description="Run the conformance kit (tactix.testing.suite) against a backend; "
        "arguments after the known options are passed to pytest (e.g. -k decode, -x). "
        "Exits 0 when every case that ran passed, 1 when one failed, 5 when no case ran "
        "(e.g. a backend that cannot run on this machine: the reasons are printed on one line).",
    )
    p.add_argument("backend", help="backend name, or 'all' for every active backend")
    add_json_option(p, "the report (the input of 'tactix support-matrix')")
    p.add_argument("--device", help=device_help)
    p.add_argument("--all-tactics", action="store_true", help="check every tactic, not a sample of three")
    p.add_argument("--verbose-skips", action="store_true", help="list every skipped case with its reason")
    p.set_defaults(func=cmd_conformance, passthrough=True)

    ids = "; ".join(f"{name} suite: {', '.join(c.id for c in bench_suite(name))}" for name in SUITES)
    p = sub.add_parser("bench", help="time the benchmark suite for every backend and tuned 'auto'")
    p.add_argument("--suite", choices=SUITES, help="default: gpu on a GPU, cpu otherwise")
    p.add_argument("--device", help=device_help)
    p.add_argument("--cases", metavar="IDS", help=f"comma-separated case ids (default: all of the suite); {ids}")
    p.add_argument("--backends", metavar="NAMES", help="comma-separated backends (default: every active one)")
    p.add_argument("--no-tune", action="store_true", help="leave out the tuned 'auto' rows")
    p.add_argument("--no-untuned", action="store_true",
                   help="leave out the untuned 'auto' rows (auto from an empty store: the untuned order)")  # fmt: skip
    p.add_argument("--no-flashinfer", action="store_true",
                   help="leave out the FlashInfer anchor rows (added where flashinfer is installed)")  # fmt: skip
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="plan attention with deterministic=True (default: the fastest tactics, deterministic or not)",
    )
    p.add_argument("--warmup", type=_at_least(0), default=3, metavar="N", help="untimed calls first (default: 3)")
    p.add_argument("--repeat", type=_at_least(1), default=20, metavar="N",
                   help="timed calls; the median is reported (default: 20)")  # fmt: skip
    p.add_argument("--warmup-ms", type=_non_negative, default=50.0, metavar="MS",
                   help="on a GPU, untimed calls go on for at least MS of device time (default: 50)")  # fmt: skip
    p.add_argument("--settle-blocks", type=_at_least(1), default=3, metavar="N",
                   help="on a GPU, time up to N blocks of --repeat calls until the times stop falling "
                   "(after other work kernels run slower for a while); 1: one block (default: 3)")  # fmt: skip
    p.add_argument("--execution", choices=["cuda_graph", "eager"], default="cuda_graph",
                   help="cuda_graph: replay a captured graph where the plan allows (kernel time); "
                   "eager: plain calls (host cost included) (default: cuda_graph)")  # fmt: skip
    add_json_option(p, "the report")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown to PATH")
    p.add_argument("--png", metavar="PATH", help="bar chart of ratios to the best (needs matplotlib)")
    p.set_defaults(func=cmd_bench)

    add_cache_parser(cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub))  # it makes _Parser ones

    add_untuned_order_parser(cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub))

    p = sub.add_parser("warmup", help="compile a backend's kernels ahead of time (its default tactics)")
    p.add_argument("backend", help="backend name, e.g. cuda_native")
    p.add_argument("--arch", help="target architecture such as sm_90 (default: the current GPU's)")
    add_json_option(p, "what was compiled")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("support-matrix", help="render conformance reports as docs/support-matrix.md")
    p.add_argument("reports", nargs="+", help="JSON reports written by 'tactix conformance --json'")
    p.add_argument("-o", "--output", metavar="PATH", help="write here instead of standard output")
    p.set_defaults(func=cmd_support_matrix)
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null: Python flushes it once more at exit, which would fail again."""
    with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor (a test's capture) has none
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _interruptible() -> None:
    """Take SIGINT as an interrupt even where it was inherited ignored: a script's background job
    (``job &``; benchmarks/h200_checks.sh runs its jobs so) starts with SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler, so ``timeout -s INT`` would not stop a run that
    still writes what it finished (the kit's JSON, the bench's finished cases)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    _interruptible()
    args, extra = build_parser().parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        build_parser().parse_args(argv)  # reports the unknown arguments and exits 2
    try:
        for dest, option in _OUTPUT_OPTIONS.items():
            check_output_path(option, getattr(args, dest, None))  # before a long run, not after it
        code: int = args.func(args, extra) if getattr(args, "passthrough", False) else args.func(args)
        sys.stdout.flush()  # a reader that has gone (`| head -1`) shows up here, not at interpreter exit
    except tactix.TactixError as exc:
        print(f"tactix: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader has what it wanted: nothing to report
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("tactix: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:  # the machine refused (disk full, permissions): its words, on one line
        print(f"tactix: error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
