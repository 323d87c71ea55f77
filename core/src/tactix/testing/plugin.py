"""The conformance kit's pytest plugin (registered under ``pytest11``; inert unless asked).

Without ``--tactix-backend`` it only adds its options: no test of any other suite changes. With
``--tactix-backend=NAME`` (or ``all``) the kit's tests in `tactix.testing.suite` are
parametrised with cases generated from the backend's capabilities, a header names the backend,
its version, distribution and capabilities, cases the backend lists as known failures run as
strict xfails, and ``--tactix-report=PATH`` writes a JSON report (the input of
``tactix support-matrix``). An unknown backend or a device this machine lacks is one usage error
up front; a run in which no case ran (every one skipped: typically a backend that cannot run on
this machine) exits with pytest's "no tests ran" status, 5, and says why on one line.

    pytest --pyargs tactix.testing.suite --tactix-backend=mybackend [--tactix-report=report.json]
    tactix conformance mybackend --json report.json          # the same, as a command
"""

from __future__ import annotations

import json
import platform
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import torch

import tactix
from tactix.devices import named_device
from tactix.errors import BackendNotFoundError, InvalidArgumentError, TactixError
from tactix.ops import OPS, GemmDTypes
from tactix.registry import Backend, get_registry
from tactix.testing.cases import AttentionCase, GemmCase, RaggedCase

_RESULTS = pytest.StashKey[dict[str, dict[str, Any]]]()
_BACKENDS = pytest.StashKey[list[Backend]]()
_DEVICE = pytest.StashKey[torch.device]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tactix", "tactix conformance kit")
    group.addoption(
        "--tactix-backend",
        default=None,
        metavar="NAME",
        help="run the tactix conformance kit against backend NAME (or 'all' active backends)",
    )
    group.addoption(
        "--tactix-device",
        default=None,
        metavar="DEVICE",
        help="device for the kit's cases (default: cuda if available, else cpu)",
    )
    group.addoption(
        "--tactix-all-tactics",
        action="store_true",
        default=False,
        help="check every enumerated tactic, not a seeded sample of three per case",
    )
    group.addoption("--tactix-report", default=None, metavar="PATH", help="write the kit's JSON report here")


def backends_to_test(name: str, argument: str) -> list[Backend]:
    """The backends ``name`` selects: ``all`` active ones, or the one so named. The error for an
    unknown name lists the valid choices and names ``argument`` (the option the user typed)."""
    registry = get_registry()
    if name == "all":
        return registry.active()
    try:
        return [registry.get(name)]
    except BackendNotFoundError as exc:
        choices = ", ".join(repr(v) for v in ["all", *exc.valid])
        raise InvalidArgumentError(argument, f"one of {choices}", repr(name)) from None


def selected_backends(config: pytest.Config) -> list[Backend]:
    cached = config.stash.get(_BACKENDS, None)
    if cached is not None:
        return cached
    name = config.getoption("--tactix-backend")
    backends = [] if name is None else backends_to_test(name, "--tactix-backend")
    config.stash[_BACKENDS] = backends
    return backends


def kit_device(config: pytest.Config) -> torch.device:
    device = config.stash.get(_DEVICE, None)
    if device is None:
        device = config.stash[_DEVICE] = named_device("--tactix-device", config.getoption("--tactix-device"))
    return device


def _caps_summary(backend: Backend) -> list[str]:
    lines = []
    for op in backend.spec.ops:
        caps = backend.spec.capabilities(op)
        assert caps is not None
        data = caps.model_dump(mode="json")
        flags = [k for k, v in data.items() if v is True]
        values = {k: v for k, v in data.items() if not isinstance(v, bool)}
        shown = "; ".join(f"{k}={_short(v)}" for k, v in values.items())
        lines.append(f"  {op}: {shown}; features: {', '.join(flags) or 'none'}")
    return lines


def _short(value: Any) -> str:
    if value is None:
        return "any"
    if isinstance(value, list):
        if value and isinstance(value[0], dict):  # GEMM dtype combinations
            return "{" + ", ".join(sorted(str(GemmDTypes.model_validate(v)) for v in value)) + "}"
        return "{" + ", ".join(str(v) for v in sorted(value, key=str)) + "}"
    return str(value)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if config.getoption("--tactix-backend") is None:
        return None
    lines = [f"tactix conformance kit {tactix.__version__} on {kit_device(config)} (torch {torch.__version__})"]
    for backend in selected_backends(config):
        rec = backend.record
        lines.append(
            f"backend {backend.name} {backend.spec.version} from distribution "
            f"{rec.distribution or '?'} {rec.distribution_version or ''}".rstrip()
        )
        env = backend.environment()
        if env:
            lines.append(f"  cannot run here: {'; '.join(env)}")
        lines += _caps_summary(backend)
    return lines


def id_pattern(pattern: str) -> re.Pattern[str]:
    """A case-id glob: ``*`` and ``?`` are wildcards; brackets are literal (ids contain them)."""
    return re.compile(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."))


def _known_failure(backend: Backend, case_id: str) -> str | None:
    for pattern, reason in backend.known_failures().items():
        if id_pattern(pattern).fullmatch(case_id):
            return reason
    return None


def _param(backend: Backend, case: AttentionCase | RaggedCase | GemmCase, many: bool) -> Any:
    marks = []
    reason = _known_failure(backend, case.id)
    if reason is not None:
        marks.append(pytest.mark.xfail(strict=True, reason=f"known failure declared by {backend.name}: {reason}"))
    case_id = f"{backend.name}:{case.id}" if many else case.id
    return pytest.param(backend, case, id=case_id, marks=marks)


TACTIC_BATCHES = ("ragged", "chunked", "edge")
"""Batches whose cases also check every (or a sample of every) enumerated tactic."""


def _tactic_cases(cases: list[Any]) -> list[Any]:
    return [c for c in cases if c.batch in TACTIC_BATCHES and c.head_dim_qk == c.head_dim_vo]


def _graph_cases(cases: list[Any]) -> list[Any]:
    ragged = [c for c in cases if c.batch == "ragged"]
    multi_token = [c for c in ragged[4:] if getattr(c, "q_len_per_req", 1) > 1][:1]  # decode's verify step
    return ragged[:4] + multi_token + [c for c in ragged[4:] if getattr(c, "scale_form", "") == "tensor"]


KIT_FIXTURES: Final[dict[str, tuple[str, Callable[[list[Any]], list[Any]] | None]]] = {
    "attention_case": ("attention", None),
    "tactic_case": ("attention", _tactic_cases),
    "graph_case": ("attention", _graph_cases),
    "gemm_case": ("gemm", None),
    "gemm_edge_case": ("gemm", lambda cases: cases[:3]),
    "merge_case": ("merge", None),
}
"""The suite's case fixtures: the kit family (`OpDefinition.kit_family`) whose cases each takes,
and the subset of them (None: all)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    wanted = sorted(set(metafunc.fixturenames) & set(KIT_FIXTURES))
    if not wanted:
        return
    fixture = wanted[0]
    family, subset = KIT_FIXTURES[fixture]
    backends = selected_backends(metafunc.config)
    many = len(backends) > 1
    params = []
    for backend in backends:
        for op, caps in backend.spec.implements.items():
            definition = OPS[op]
            if definition.kit_family != family:
                continue
            cases = definition.kit_cases(caps)
            if subset is not None:
                cases = subset(cases)
            params += [_param(backend, c, many) for c in cases]
    argnames = ["backend", fixture]
    if not params:
        metafunc.parametrize(
            argnames,
            [
                pytest.param(
                    None,
                    None,
                    marks=pytest.mark.skip(
                        reason="no backend under test implements this op (pass --tactix-backend=NAME)"
                    ),
                    id="none",
                )
            ],
        )
        return
    metafunc.parametrize(argnames, params)


# -- the JSON report ------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = {}
    if config.getoption("--tactix-backend") is None:
        return
    try:  # once, before collection: not the same error again from every case
        selected_backends(config)
        kit_device(config)
    except TactixError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: sees the report after xfail handling
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.config.getoption("--tactix-backend") is None:
        return
    backend = callspec.params.get("backend")
    case = next((callspec.params[k] for k in KIT_FIXTURES if k in callspec.params), None)
    if backend is None or case is None:
        return
    results = item.config.stash[_RESULTS]
    entry = results.setdefault(item.nodeid, {
        "backend": backend.name,
        "test": item.originalname if isinstance(item, pytest.Function) else item.name,
        "case": case.id,
        "op": case.op,
        "features": case.features(),
        "outcome": "passed",
        "detail": "",
    })  # fmt: skip
    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "failed"
            entry["detail"] = str(report.wasxfail)
        elif report.skipped:
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            entry["detail"] = longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)
        elif report.failed:
            entry["outcome"] = "failed"
            entry["detail"] = _first_line(report)


def _first_line(report: pytest.TestReport) -> str:
    text = report.longreprtext or ""
    for line in text.splitlines():
        if line.startswith("E "):
            return line[2:].strip()[:500]
    return text.strip().splitlines()[-1][:500] if text.strip() else ""


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: its line comes after pytest's summary
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    yield
    config = session.config
    if config.getoption("--tactix-backend") is None:
        return
    results = list(config.stash[_RESULTS].values())
    path = config.getoption("--tactix-report")
    if path is not None:
        _write_report(config, results, path)
    if session.exitstatus == pytest.ExitCode.OK and all(r["outcome"] == "skipped" for r in results):
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
        sys.stderr.write(f"tactix: error: {_why_nothing_ran(config, results)}\n")


def _why_nothing_ran(config: pytest.Config, results: list[dict[str, Any]]) -> str:
    """One line: the backends' environment reasons (as ``tactix backends`` words them), else the
    commonest skip reason."""
    device = kit_device(config)
    cannot = [f"{b.name}: {'; '.join(b.environment())}" for b in selected_backends(config) if b.environment()]
    if cannot:
        return f"no conformance case ran on {device}: " + " | ".join(cannot)
    reasons = Counter(r["detail"] for r in results)
    if not reasons:
        names = ", ".join(b.name for b in selected_backends(config)) or "no backend"
        return f"no conformance case ran on {device}: none was generated for {names} (it declares no op the kit tests)"
    reason, count = reasons.most_common(1)[0]
    return (
        f"no conformance case ran on {device}: all {len(results)} were skipped, {count} because {reason!r} "
        "(pytest -rs, or tactix conformance --verbose-skips, lists every reason)"
    )


def _write_report(config: pytest.Config, results: list[dict[str, Any]], path: str) -> None:
    backends = selected_backends(config)
    device = kit_device(config)
    report = {
        "kit": tactix.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ops": list(OPS),  # the ops this kit has: a backend's missing one is "not implemented", not "not tested"
        "backends": [
            {
                "name": b.name,
                "version": b.spec.version,
                "distribution": b.record.distribution,
                "distribution_version": b.record.distribution_version,
                "environment": b.environment(),
                "untested": dict(b.spec.untested),
                "capabilities": {op: b.spec.capabilities(op).model_dump(mode="json") for op in b.spec.ops},  # type: ignore[union-attr]
            }
            for b in backends
        ],
        "totals": {o: sum(r["outcome"] == o for r in results) for o in ("passed", "skipped", "xfailed", "failed")},
        "results": results,
    }
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
