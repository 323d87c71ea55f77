"""FlashInfer's own wrapper tests, run against tactix.compat.flashinfer: the parity report.

    python benchmarks/flashinfer_parity/run.py [TESTS] [--sample N [--seed S]] [--reference]
                                               [--junit PATH] [--summary PATH] [-- PYTEST_ARGS...]

TESTS is FlashInfer's test tree (default ``.gpu/flashinfer-tests`` in the repository), the
folder holding ``tests/attention/test_batch_{decode,prefill}_kernels.py``; nothing is copied
out of it. pytest runs there, in a child process, on those two files with `parity_plugin` (our
conftest: scope, sample, substitution) and FlashInfer's own conftest files, if the tree has any;
the repository's pytest settings are not used. Arguments after ``--`` go to pytest as they are
(``-x``, ``-k decode``). The Markdown report goes to standard output, and to ``--summary``;
the JUnit XML, with the selection embedded, to ``--junit``. The exit status is pytest's.

See README.md beside this file for what is substituted and the scope.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_TESTS = ROOT / ".gpu" / "flashinfer-tests"

if str(HERE) not in sys.path:  # run as a script this is already so; imported (tests) it may not be
    sys.path.insert(0, str(HERE))

import parity_report  # noqa: E402
import parity_scope  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of cases, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of cases, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="run.py", description="Run FlashInfer's wrapper tests against tactix.compat.flashinfer.")
    p.add_argument(
        "tests",
        nargs="?",
        type=Path,
        default=None,
        help="FlashInfer's test tree (default: .gpu/flashinfer-tests in the repository)",
    )
    p.add_argument("--sample", type=_positive, metavar="N", help="run a seeded sample of N in-scope cases")
    p.add_argument("--seed", type=int, metavar="S", help="the sample's seed (default 0; needs --sample)")
    p.add_argument("--reference", action="store_true", help="run FlashInfer's own wrappers on the same selection")
    p.add_argument("--junit", type=Path, metavar="PATH", help="write the JUnit XML here")
    p.add_argument("--summary", type=Path, metavar="PATH", help="write the Markdown report here too")
    p.add_argument("--workers", type=_positive, metavar="N",
                   help="run the cases in N processes (pytest-xdist's -n): FlashInfer compiles the reference "
                        "modules they need side by side")  # fmt: skip
    return p


def _fail(message: str) -> NoReturn:
    print(f"run.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_output(path: Path | None, option: str) -> None:
    if path is None:
        return
    if path.is_dir():
        _fail(f"{option} {path} is a directory; give a file path")
    if path.parent.exists() and not path.parent.is_dir():
        _fail(f"{option} {path}: {path.parent} is not a directory")


def _arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = parser().parse_args(argv)
    if args.seed is not None and args.sample is None:
        _fail("--seed applies to a sample: give --sample N too")
    tests = args.tests if args.tests is not None else DEFAULT_TESTS
    shown = str(args.tests) if args.tests is not None else ".gpu/flashinfer-tests"
    if not tests.is_dir():
        _fail(f"FlashInfer's test tree {shown} is not a directory (prepare.sh --flashinfer puts it in .gpu/)")
    for rel in parity_scope.SUBSTITUTIONS:
        if not (tests / rel).is_file():
            _fail(f"{shown} is not FlashInfer's test tree: it has no {rel}")
    _check_output(args.junit, "--junit")
    _check_output(args.summary, "--summary")
    args.tests = tests.resolve()
    args.shown = shown
    return args, extra


def command(args: argparse.Namespace, junit: Path, record: Path, ini: Path, extra: Sequence[str]) -> list[str]:
    """The pytest command line of the child process (run in the test tree)."""
    # no:tactix: the conformance kit's pytest plugin, inert here (and it would import torch early)
    cmd = [sys.executable, "-m", "pytest", "-p", "parity_plugin", "-p", "no:cacheprovider", "-p", "no:tactix",
           "-c", str(ini), "--rootdir", str(args.tests), "--confcutdir", str(args.tests),
           "--tb=short", "-rfE", f"--junitxml={junit}", "-o", "junit_suite_name=flashinfer_parity",
           "--parity-mode", "reference" if args.reference else "tactix", "--parity-record", str(record)]  # fmt: skip
    if args.sample is not None:
        cmd += ["--parity-sample", str(args.sample), "--parity-seed", str(args.seed or 0)]
    if args.workers is not None:
        cmd += ["-n", str(args.workers)]
    return [*cmd, *parity_scope.SUBSTITUTIONS, *extra]


def _wait(child: subprocess.Popen[bytes]) -> tuple[int, bool]:
    """The child's exit status and whether the run was interrupted. An interrupt (Ctrl-C, or
    `timeout -s INT`, which signals the whole process group) reaches pytest too, which then ends
    the run and still writes its JUnit XML: wait for that (a minute at most), then report what ran."""
    try:
        return child.wait(), False
    except KeyboardInterrupt:
        print("run.py: interrupted; waiting for pytest to write the cases that ran", file=sys.stderr, flush=True)
        try:
            return child.wait(timeout=60), True
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            child.kill()
            return child.wait(), True


def _interruptible() -> None:
    """Take SIGINT as an interrupt even where it was inherited ignored: a script's background job
    (``job &``, as ``benchmarks/h200_checks.sh`` runs its jobs) starts with SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler, so ``timeout -s INT`` would reach nothing.
    In the pytest child, the same is done before it starts (`_default_sigint`). (The tactix CLI
    has the same three lines; this runner imports nothing of tactix, whose import brings torch.)"""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _default_sigint() -> None:
    """The pytest child's SIGINT back to the default action, so that its Python takes it as an
    interrupt (`_interruptible`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    _interruptible()
    args, extra = _arguments(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args, extra)
    except KeyboardInterrupt:
        print("run.py: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # an unwritable --junit/--summary path, a full disk
        _fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))


def _run(args: argparse.Namespace, extra: Sequence[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="flashinfer-parity-") as tmp:
        work = Path(tmp)
        ini = work / "pytest.ini"
        ini.write_text("[pytest]\n")  # FlashInfer's tests under plain pytest defaults, not this repository's
        record = work / "selection.json"
        junit = args.junit.resolve() if args.junit is not None else work / "junit.xml"
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.unlink(missing_ok=True)
        if args.summary is not None:
            args.summary.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
        cmd = command(args, junit, record, ini, extra)
        print(f"run.py: in {args.tests}: {Path(cmd[0]).name} " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
        code, interrupted = _wait(subprocess.Popen(cmd, cwd=args.tests, env=env, preexec_fn=_default_sigint))
        if not junit.is_file():
            _fail(f"pytest wrote no JUnit XML (exit status {code}{', interrupted' if interrupted else ''}); "
                  "its output is above")  # fmt: skip
        selection = json.loads(record.read_text()) if record.is_file() else {}
        if selection:
            selection["tree"] = args.shown
            parity_report.embed_selection(junit, selection)
        markdown = parity_report.summarize(parity_report.parse_junit(junit))
        if interrupted:
            markdown += "\n\n**The run was interrupted**: the cases above are those that ran before it stopped."
    print(markdown)
    if args.summary is not None:
        args.summary.write_text(markdown + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
