"""The parity report: FlashInfer's test results, read from pytest's JUnit XML, as Markdown.

Pure Python (``xml.etree``, ``re``, ``json``): no torch, no flashinfer, so it is tested anywhere
and a committed JUnit file can be re-read on any machine:

    python benchmarks/flashinfer_parity/parity_report.py JUNIT.xml [--summary PATH]

Per test function: passed / failed / skipped (an error counts as failed, an xfail as skipped).
Failures are grouped by cause with `CAUSES`, an ordered table of regexes over each failure's
message (and, where a rule says so, its traceback); the first rule that matches names the cause,
and a failure no rule matches is "other: <first line of the error>". To name a new cause, add a
`Rule` above the more general ones.

The run's selection (scope, sample, what was substituted, versions) travels inside the JUnit file
as the testsuite property `SELECTION_PROPERTY` (a JSON object the runner writes there).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SELECTION_PROPERTY = "tactix_parity_selection"


@dataclass(frozen=True)
class Rule:
    """One cause: ``message`` is searched in the failure message, ``text`` in its whole traceback.

    Every pattern given must match. ``cause`` may hold ``{0}``, ``{1}``, ... for the groups of the
    ``message`` pattern (``"missing attribute `{0}`"``).
    """

    cause: str
    message: str | None = None
    text: str | None = None

    def match(self, message: str, text: str) -> str | None:
        groups: tuple[str | Any, ...] = ()
        if self.message is not None:
            found = re.search(self.message, message)
            if found is None:
                return None
            groups = found.groups()
        if self.text is not None and re.search(self.text, text) is None:
            return None
        return self.cause.format(*groups)


# First match wins: features before dtypes (a refusal of uint8 lists the dtypes tactix takes,
# float8 among them), specific before general.
CAUSES: tuple[Rule, ...] = (
    Rule("NVFP4 KV cache", message=r"(?i)nvfp4|\bfp4\b|kv_cache_sf|\buint8\b"),
    Rule("multi-token decode (q_len_per_req)", message=r"q_len_per_req"),
    Rule("fast_decode_plan internals", message=r"AttributeError|has no attribute", text=r":\d+: in fast_decode_plan\b"),
    Rule("custom masks (custom_mask / packed_custom_mask)", message=r"custom_mask|mask_indptr"),
    Rule("backend names fa2/fa3", message=r"\bbackend\b.*\(got '(?:fa2|fa3)'\)"),
    Rule("backend name `{0}`", message=r"'backend' must be .*\(got '([^']*)'\)"),
    Rule("fp8 KV cache", message=r"(?i)float8|\bfp8\b|e4m3|e5m2"),
    Rule("rotary embedding (pos_encoding_mode)", message=r"pos_encoding_mode|ROPE_LLAMA"),
    Rule("CUDA out of memory", message=r"(?i)CUDA out of memory|OutOfMemoryError"),
    # raised while handling one (torch.testing's "Comparing" wraps it; cuBLAS cannot get its handle)
    Rule(
        "CUDA out of memory",
        message=r"CUBLAS_STATUS_ALLOC_FAILED|^RuntimeError: Comparing|^Comparing",
        text=r"OutOfMemoryError|CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED",
    ),
    Rule("missing attribute `{0}`", message=r"has no attribute '(\w+)'"),
    Rule("unexpected keyword argument `{0}`", message=r"unexpected keyword argument '(\w+)'"),
    Rule(
        "wrong result (differs from FlashInfer's reference)",
        message=r"Tensor-likes are not close|mismatches reference|Not equal to tolerance|Mismatched elements",
    ),
    Rule(
        "tactix serves K and V pools of different strides (FlashInfer's CUDA-core decode refuses them)",
        message=r"DID NOT RAISE",
        text=r"must have identical strides",
    ),
    Rule(
        "tactix serves multi-token decode with backend='fa3' (its auto), which FlashInfer's fa3 refuses",
        message=r"DID NOT RAISE NotImplementedError",
        text=r"match=\"fa2\"",
    ),
    Rule(
        "causal prefill with more query rows than keys: refused at plan (rows with no key)",
        message=r"at least as many kv tokens as query tokens",
    ),
    Rule("expected error not raised", message=r"DID NOT RAISE"),
    Rule("error message differs from FlashInfer's (pytest.raises match)", message=r"Regex pattern did not match"),
)

_OUTCOMES = ("passed", "failed", "skipped")


@dataclass(frozen=True)
class Case:
    """One testcase of the JUnit file."""

    function: str  # "test_batch_decode_kernels::test_batch_decode_with_paged_kv_cache"
    name: str  # the test's name with its parameter id
    outcome: str  # passed, failed (error included) or skipped (xfail included)
    detail: str = ""  # "error", "xfailed" or ""
    message: str = ""  # the failure's (or skip's) message
    text: str = ""  # the failure's traceback


@dataclass
class Results:
    cases: list[Case]
    selection: dict[str, Any] = field(default_factory=dict)


def first_line(message: str, limit: int = 160) -> str:
    line = next((part.strip() for part in message.splitlines() if part.strip()), "") or "(no message)"
    return line if len(line) <= limit else line[: limit - 1] + "…"


def cause_of(case: Case, rules: Sequence[Rule] = CAUSES) -> str:
    for rule in rules:
        cause = rule.match(case.message, case.text)
        if cause is not None:
            return cause
    return "other: " + first_line(case.message)


def _function(classname: str, name: str) -> str:
    if not classname:  # a collection error: pytest names the module
        return name.rsplit(".", 1)[-1].removesuffix(".py") + "::(collection)"
    return classname.rsplit(".", 1)[-1] + "::" + name.split("[", 1)[0]


def _case(element: ET.Element) -> Case:
    function = _function(element.get("classname", ""), element.get("name", ""))
    name = element.get("name", "")
    for tag, outcome, detail in (("failure", "failed", ""), ("error", "failed", "error")):
        found = element.find(tag)
        if found is not None:
            return Case(function, name, outcome, detail, found.get("message", ""), found.text or "")
    skipped = element.find("skipped")
    if skipped is not None:
        detail = "xfailed" if skipped.get("type") == "pytest.xfail" else ""
        return Case(function, name, "skipped", detail, skipped.get("message", ""))
    return Case(function, name, "passed")


def parse_junit(source: str | Path) -> Results:
    """Read a JUnit XML file (a path, or the XML itself when it starts with ``<``)."""
    text = source if isinstance(source, str) and source.lstrip().startswith("<") else Path(source).read_text()
    root = ET.fromstring(text)
    selection: dict[str, Any] = {}
    for prop in root.iter("property"):
        if prop.get("name") == SELECTION_PROPERTY:
            selection = json.loads(prop.get("value") or "{}")
    # (an interrupted run ends with a nameless testcase: the case that was running, unreported)
    cases = [_case(element) for element in root.iter("testcase") if element.get("name")]
    return Results(cases, selection)


def embed_selection(path: Path, selection: Mapping[str, Any]) -> None:
    """Write ``selection`` into the JUnit file at ``path`` as the testsuite property."""
    tree = ET.parse(path)
    root = tree.getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        suite = ET.SubElement(root, "testsuite")
    props = suite.find("properties")
    if props is None:
        props = ET.Element("properties")
        suite.insert(0, props)
    for old in [p for p in props.findall("property") if p.get("name") == SELECTION_PROPERTY]:
        props.remove(old)
    ET.SubElement(props, "property", name=SELECTION_PROPERTY, value=json.dumps(selection, sort_keys=True))
    tree.write(path, encoding="utf-8", xml_declaration=True)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return lines


def _module(function: str) -> str:
    return function.split("::", 1)[0]


def _short(function: str) -> str:
    return function.split("::", 1)[-1]


def summarize(results: Results, rules: Sequence[Rule] = CAUSES) -> str:
    """The Markdown report of one parity run."""
    sel = results.selection
    functions: dict[str, Counter[str]] = defaultdict(Counter)
    for case in results.cases:
        functions[case.function][case.outcome] += 1
    planned: Mapping[str, Mapping[str, Any]] = sel.get("functions", {})
    for function, counts in planned.items():
        if counts.get("selected"):
            functions.setdefault(function, Counter())
    total = Counter(case.outcome for case in results.cases)
    run = sum(total.values())

    reference = sel.get("mode") == "reference"
    lines = [
        "# FlashInfer's wrapper tests, "
        + ("FlashInfer's own wrappers (reference run)" if reference else "with tactix.compat.flashinfer's wrappers"),
        "",
    ]
    if sel:
        substituted = sel.get("substituted", [])
        if reference:
            lines.append("- wrappers: FlashInfer's own (`--reference`: the same selection, nothing substituted)")
        else:
            names = ", ".join(f"`{name}`" for name in substituted) or "nothing"
            lines.append(f"- served by `tactix.compat.flashinfer` (its object of the same name): {names}")
        lines.append(
            "- references: FlashInfer's own kernels, unchanged (`single_decode_with_kv_cache`, "
            "`single_prefill_with_kv_cache`, and FlashInfer's prefill wrapper where a decode test uses it)"
        )
        lines.append(
            f'- scope: `pos_encoding_mode="NONE"`, head_dim ≤ 256, tests that reach a substituted wrapper: '
            f"{sel.get('in_scope', '?')} of {sel.get('collected', '?')} collected cases"
        )
        if sel.get("sample") is not None:
            lines.append(
                f"- sample: {sel.get('selected', '?')} of the {sel.get('in_scope', '?')} in-scope cases "
                f"(`--sample {sel['sample']} --seed {sel.get('seed', 0)}`, spread over the test functions)"
            )
        environment = sel.get("environment", {})
        if environment:
            lines.append("- environment: " + ", ".join(f"{k} {v}" for k, v in sorted(environment.items())))
        lines.append("")
    lines.append(
        f"**{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped** of {run} cases run."
    )
    lines.append("")

    lines += ["## Per test function", ""]
    for module in sorted({_module(f) for f in functions}):
        lines += [f"### {module}", ""]
        rows = []
        for function in sorted(f for f in functions if _module(f) == module):
            counts = functions[function]
            plan = planned.get(function, {})
            rows.append(
                [f"`{_short(function)}`", plan.get("in_scope", "—"), *(counts[outcome] for outcome in _OUTCOMES)]
            )
        lines += _table(["test function", "in scope", *_OUTCOMES], rows)
        lines.append("")

    failures = [case for case in results.cases if case.outcome == "failed"]
    lines += ["## Failures by cause", ""]
    if not failures:
        lines += ["None.", ""]
    else:
        by_cause: dict[str, list[Case]] = defaultdict(list)
        for case in failures:
            by_cause[cause_of(case, rules)].append(case)
        rows = []
        for cause, cases in sorted(by_cause.items(), key=lambda item: (-len(item[1]), item[0])):
            where = Counter(_short(case.function) for case in cases)
            spread = ", ".join(f"`{name}` ({count})" for name, count in sorted(where.items()))
            example = cases[0]
            rows.append([cause, len(cases), spread, f"`{example.name}`: {first_line(example.message, 200)}"])
        lines += _table(["cause", "failed cases", "test functions", "first case"], rows)
        lines.append("")

    skips: Counter[str] = Counter(
        ("xfail: " if case.detail == "xfailed" else "") + first_line(case.message, 200)
        for case in results.cases
        if case.outcome == "skipped"
    )
    if skips:
        lines += ["## Skips and xfails", ""]
        lines += _table(["reason", "cases"], [[reason, count] for reason, count in skips.most_common()])
        lines.append("")

    deselected: Mapping[str, int] = sel.get("deselected", {})
    if deselected:
        lines += ["## Not run", ""]
        rows = []
        for function, plan in sorted(planned.items()):
            for reason, count in sorted(plan.get("out_of_scope", {}).items()):
                rows.append([f"`{function}`", reason, count])
            unsampled = int(plan.get("in_scope", 0)) - int(plan.get("selected", 0))
            if unsampled:
                rows.append([f"`{function}`", "not in the seeded sample", unsampled])
        lines += _table(["test function", "why", "cases"], rows)
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parity_report.py", description="Markdown report of a parity JUnit file.")
    parser.add_argument("junit", type=Path)
    parser.add_argument("--summary", type=Path, help="write the Markdown here (default: standard output)")
    args = parser.parse_args(argv)
    try:
        markdown = summarize(parse_junit(args.junit))
    except (OSError, ET.ParseError, json.JSONDecodeError) as exc:
        print(f"parity_report.py: error: cannot read {args.junit}: {exc}", file=sys.stderr)
        return 2
    if args.summary is None:
        print(markdown)
    else:
        args.summary.write_text(markdown + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
