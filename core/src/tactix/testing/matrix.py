"""The support matrix: conformance reports (JSON from ``--tactix-report``) rendered as Markdown.

tactix support-matrix benchmarks/results/conformance-*.json -o docs/support-matrix.md
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from tactix.errors import InvalidArgumentError
from tactix.ops import OPS

__all__ = ["load_reports", "render"]

OUTCOMES = ("passed", "skipped", "xfailed", "failed")
REGENERATE = "tactix support-matrix benchmarks/results/conformance-*.json -o docs/support-matrix.md"


_REPORT_KEYS = frozenset({"kit", "device", "torch", "python", "backends", "results"})

OPS_OF_UNLISTED_REPORTS: Final = ("prefill", "decode", "gemm")
"""The ops of a report that does not list its kit's (``"ops"``): reports written before the kit
listed them, when it had these three. A row of an op the report's kit did not have would say
"not implemented" of a backend that was never asked."""


def load_reports(paths: Iterable[str | Path], argument: str = "reports") -> list[dict[str, Any]]:
    """The conformance reports at ``paths``, sorted by path; a file that cannot be read or is not
    such a report is an `InvalidArgumentError` naming ``argument`` and the file."""
    reports = []
    for path in sorted(str(p) for p in paths):
        try:
            report = json.loads(Path(path).read_text())
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
            why = f"not JSON ({exc})"
        else:
            if isinstance(report, dict) and report.keys() >= _REPORT_KEYS:
                reports.append(report)
                continue
            why = f"JSON without the keys {', '.join(sorted(_REPORT_KEYS))}"
        raise InvalidArgumentError(argument, "reports written by 'tactix conformance --json'", f"{path!r}: {why}")
    return reports


def _cell(counts: Counter[str], outcome: str) -> str:
    return str(counts[outcome]) if counts[outcome] else "·"


def _reason_summary(reasons: Counter[str]) -> str:
    if not reasons:
        return ""
    text, _ = reasons.most_common(1)[0]
    text = text.removeprefix("not claimed: ").replace("|", "/")
    more = len(reasons) - 1
    return (text[:90] + ("…" if len(text) > 90 else "")) + (f" (+{more} more)" if more else "")


def render(reports: list[dict[str, Any]]) -> str:
    lines = [
        "# Support matrix",
        "",
        "Generated from conformance-kit reports; do not edit by hand. Regenerate with",
        "",
        f"    {REGENERATE}",
        "",
        "Counts are conformance tests (numerics, tactics, re-plan, bad input, CUDA graph) per",
        "feature; a skip means the backend does not claim the case (its reason is shown), an",
        "xfail is a known failure the backend declares. `·` is zero.",
        "",
        "| backend | version | device | op | passed | skipped | xfailed | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sections: list[str] = []
    for report in reports:
        device = report.get("device_name") or report["device"]
        for backend in report["backends"]:
            name = backend["name"]
            results = [r for r in report["results"] if r["backend"] == name]
            by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in results:
                by_op[r["op"]].append(r)
            known = report.get("ops", OPS_OF_UNLISTED_REPORTS)
            for op in (op for op in OPS if op in known):
                counts = Counter(r["outcome"] for r in by_op.get(op, []))
                if not by_op.get(op):
                    lines.append(f"| {name} | {backend['version']} | {device} | {op} | not implemented | | | |")
                    continue
                lines.append(
                    f"| {name} | {backend['version']} | {device} | {op} | "
                    + " | ".join(_cell(counts, o) for o in OUTCOMES)
                    + " |"
                )
            sections += _backend_section(report, backend, by_op, device)
    return "\n".join([*lines, "", *sections]).rstrip() + "\n"


def _backend_section(
    report: dict[str, Any], backend: dict[str, Any], by_op: dict[str, list[dict[str, Any]]], device: str
) -> list[str]:
    dist = backend.get("distribution") or "?"
    out = [
        f"## {backend['name']} {backend['version']} on {device}",
        "",
        f"Distribution `{dist}` {backend.get('distribution_version') or ''}; torch {report['torch']}, "
        f"Python {report['python']}, kit {report['kit']}.",
        "",
    ]
    if backend.get("environment"):
        out += [f"Cannot run on this machine: {'; '.join(backend['environment'])}.", ""]
    if backend.get("untested"):
        out += ["Declared, not tested on this project's hardware (refused by `check` until it is):", ""]
        out += [f"* {label}: {why}" for label, why in sorted(backend["untested"].items())] + [""]
    for op, results in by_op.items():
        features: dict[str, Counter[str]] = defaultdict(Counter)
        reasons: dict[str, Counter[str]] = defaultdict(Counter)
        for r in results:
            for tag in r["features"]:
                features[tag][r["outcome"]] += 1
                if r["outcome"] in ("skipped", "xfailed", "failed") and r["detail"]:
                    reasons[tag][r["detail"]] += 1
        out += [f"### {op}", "", "| feature | passed | skipped | xfailed | failed | why not passed |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for tag in sorted(features, key=_feature_order):
            counts = features[tag]
            out.append(f"| {tag} | " + " | ".join(_cell(counts, o) for o in OUTCOMES)
                       + f" | {_reason_summary(reasons[tag])} |")  # fmt: skip
        out.append("")
    return out


def _feature_order(tag: str) -> tuple[str, int, str]:
    head, _, rest = tag.rpartition(" ")
    if rest.isdigit():
        return (head, int(rest), "")
    return (tag, 0, "")
