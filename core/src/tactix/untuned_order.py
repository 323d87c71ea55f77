"""The untuned order: which backend ``auto`` tries first where the tactic store has no tactic.

Without a stored tactic, ``auto`` plans the first backend whose check passes, in an order. That
order comes from measurements: the table shipped beside this module (``untuned_order.json``)
holds, per GPU architecture, op and coarse shape class (`OpDefinition.untuned_class`: a few words
such as ``"16-bit, m <= 64"``), the backends ordered by what one call costs an eager caller on
the benchmark cases of that class. Where it has no entry (another architecture, a class no case
measured, a backend it did not measure), the backends' declared preferences decide
(`BackendSpec.preference`), as they did before the table. Tuned ``auto`` does not read it: a
stored tactic comes first.

**The cost** of a backend on a case is ``max(device time, run() host time)``, both from the same
``tactix bench`` run: a caller that enqueues its calls back to back (an eager serving step, layer
after layer) waits for the longer of the two, so a backend whose ``run()`` spends 60 µs of host
time on a 20 µs GEMM costs 60 µs there, however fast its kernel. (A report without host times
gives device times.) Within a class, backends are ranked by the geometric mean, over the class's
cases each of them ran, of their cost relative to the case's cheapest backend.

**Versioned**: ``format`` is the table's schema (`FORMAT`); a table of another format is not
read (a warning says so and the preferences decide). ``sources`` records the reports, device and
versions it was derived from. ``tactix untuned-order build REPORT.json ...`` derives a table from
``tactix bench`` reports (`build_table`); ``TACTIX_UNTUNED_ORDER=PATH`` makes a process use that
table instead of the shipped one (a machine's own measurements), ``TACTIX_UNTUNED_ORDER=off`` the
preferences alone.
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from tactix.devices import compute_capability
from tactix.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tactix.registry import Backend

__all__ = [
    "FORMAT",
    "OrderEntry",
    "OrderTable",
    "arch_of",
    "build_table",
    "current_table",
    "describe",
    "ordered",
    "read",
    "reload",
    "shape_class",
]

FORMAT: Final = 1
"""The schema of the table files this version reads and writes."""

ENV_VAR: Final = "TACTIX_UNTUNED_ORDER"
SHIPPED: Final = Path(__file__).with_name("untuned_order.json")
METRIC: Final = "max(device time, run() host time) per call, geometric mean of ratios to the case's cheapest"


class OrderEntry(BaseModel):
    """The measured order of one (architecture, op, shape class)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: str = Field(description="'sm90' for compute capability 9.0; 'cpu' for the CPU")
    op: str
    shape_class: str = Field(description="`OpDefinition.untuned_class` of the problems it applies to")
    order: tuple[str, ...] = Field(description="backends, cheapest first")
    score: dict[str, float] = Field(description="per backend: geometric mean of its cost over the cheapest's")
    cost_us: dict[str, dict[str, float]] = Field(description="per bench case: each backend's cost (µs)")


class OrderTable(BaseModel):
    """An untuned order table (the file `build_table` writes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: int
    metric: str = METRIC
    sources: list[dict[str, Any]] = Field(default_factory=list, description="the reports it was derived from")
    entries: list[OrderEntry] = Field(default_factory=list)

    _by_key: dict[tuple[str, str, str], tuple[str, ...]] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        self._by_key = {(e.arch, e.op, e.shape_class): e.order for e in self.entries}

    def lookup(self, arch: str, op: str, shape_class: str) -> tuple[str, ...] | None:
        """The measured order for a problem of ``op`` and ``shape_class`` on ``arch``, or None."""
        return self._by_key.get((arch, op, shape_class))


EMPTY: Final = OrderTable(format=FORMAT)

_lock = threading.Lock()
_loaded: OrderTable | None = None


def _read(path: Path, origin: str) -> OrderTable:
    """The table in ``path``: a file of another format gives `EMPTY` (with a warning); a file that
    cannot be read or parsed is an `InvalidArgumentError` naming ``origin``."""
    expected = f"an untuned order table (a JSON file of format {FORMAT}, as tactix untuned-order build writes)"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(origin, expected, f"{path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        warnings.warn(f"{origin}: the untuned order table {path} has format {found!r}, this tactix reads "
                      f"format {FORMAT}: backend preferences decide the untuned order", stacklevel=3)  # fmt: skip
        return EMPTY
    try:
        return OrderTable.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise InvalidArgumentError(origin, expected, f"{path}, at {where}: {first['msg']}") from None


def read(path: Path) -> OrderTable:
    """The table in the file ``path`` (`EMPTY`, with a warning, for another format)."""
    return _read(path, str(path))


def current_table() -> OrderTable:
    """The table in force: ``$TACTIX_UNTUNED_ORDER`` (a path, or ``off``) when set, else the shipped
    one; read once per process (`reload` reads it again)."""
    global _loaded
    table = _loaded
    if table is None:
        with _lock:
            if _loaded is None:
                chosen = os.environ.get(ENV_VAR, "")
                if chosen.lower() == "off":
                    _loaded = EMPTY
                elif chosen:
                    _loaded = _read(Path(chosen), ENV_VAR)
                elif SHIPPED.exists():
                    _loaded = _read(SHIPPED, "tactix/untuned_order.json")
                else:
                    _loaded = EMPTY
            table = _loaded
    return table


def reload() -> OrderTable:
    """Forget the table read so far and read it again (after ``$TACTIX_UNTUNED_ORDER`` changed)."""
    from tactix.autotune.stats import stored_tactics_changed

    global _loaded
    with _lock:
        _loaded = None
    stored_tactics_changed()  # `auto`'s remembered candidates were ordered by the old table
    return current_table()


def arch_of(device: torch.device) -> str:
    """The table's architecture name of ``device``: ``sm90`` for compute capability 9.0, ``cpu``."""
    if device.type == "cuda":
        cap = compute_capability(device.index)
        if cap is not None:
            return f"sm{cap[0]}{cap[1]}"
    return device.type


def shape_class(problem: Any) -> str:
    """``problem``'s shape class (`OpDefinition.untuned_class`; ``"any"`` for an op without one)."""
    from tactix.ops import OPS

    classify = OPS[problem.op].untuned_class
    return "any" if classify is None else classify(problem)


def ordered(backends: Sequence[Backend], problem: Any, device: torch.device) -> list[Backend]:
    """``backends`` (active, most preferred first) in the untuned order for ``problem`` on
    ``device``: those the table orders first, in its order, then the rest as they came."""
    table = current_table()
    if not table.entries:
        return list(backends)
    order = table.lookup(arch_of(device), problem.op, shape_class(problem))
    if not order:
        return list(backends)
    rank = {name: i for i, name in enumerate(order)}
    last = len(order)
    return sorted(backends, key=lambda b: rank.get(b.name, last))  # stable: the rest keep their order


# -- deriving a table from bench reports -------------------------------------------------------


def _cost(row: dict[str, Any]) -> float | None:
    time_us, host_us = row.get("time_us"), row.get("run_host_us")
    if row.get("status") != "ok" or not time_us:
        return None
    return float(max(time_us, host_us or 0.0))


def _case_class(report: dict[str, Any], row: dict[str, Any]) -> tuple[str, str]:
    """The op and shape class of a report row's case, as this version classifies it: derived
    from the suite's case of that id (so a table rebuilt after the classes changed files old
    reports under the new ones), or, for a case the suite no longer has, as the bench recorded it."""
    from tactix.bench import case_problem, select_cases
    from tactix.errors import TactixError

    try:
        case = select_cases(report["environment"].get("suite", "gpu"), [row["case"]])[0]
    except TactixError:
        if row.get("op") and row.get("shape_class"):
            return row["op"], row["shape_class"]
        raise
    problem = case_problem(case)
    return problem.op, shape_class(problem)


def build_table(reports: Iterable[tuple[str, dict[str, Any]]], arch: str | None = None) -> OrderTable:
    """The table of ``tactix bench`` reports ``(name, report)``, oldest first: a case measured by
    several keeps the last one's rows (a case's backends are always compared within one run).
    ``arch`` names the architecture for reports that do not record it (before tactix 0.1's
    ``environment.arch``). Rows count when their implementation is a backend the report lists
    (not tuned ``auto``, a direct call or an anchor) and they passed the oracle."""
    cases: dict[tuple[str, str, str], dict[str, dict[str, float]]] = defaultdict(dict)
    sources: list[dict[str, Any]] = []
    for name, report in reports:
        env = report.get("environment") if isinstance(report, dict) else None
        if not isinstance(env, dict) or not isinstance(report.get("rows"), list):
            raise InvalidArgumentError("reports", "tactix bench JSON reports (environment and rows)", name)
        where = env.get("arch") or arch
        if not where:
            raise InvalidArgumentError("arch", f"given for {name}, which does not record its architecture "
                                       "(for example sm90 for an H100/H200)", "nothing")  # fmt: skip
        backends = set(env.get("backends") or {})
        by_case: dict[str, dict[str, float]] = defaultdict(dict)
        classes: dict[str, tuple[str, str]] = {}
        for row in report["rows"]:
            cost = _cost(row)
            if cost is None or row.get("implementation") not in backends:
                continue
            by_case[row["case"]][row["implementation"]] = cost
            if row["case"] not in classes:
                classes[row["case"]] = _case_class(report, row)
        for case, costs in by_case.items():
            op, cls = classes[case]
            cases[(where, op, cls)][case] = costs
        sources.append({"report": name, "arch": where, "device": env.get("device"), "tactix": env.get("tactix"),
                        "backends": env.get("backends"), "execution": (env.get("policy") or {}).get("execution"),
                        "cases": sorted(by_case)})  # fmt: skip
    entries = [_entry(key, per_case) for key, per_case in sorted(cases.items())]
    return OrderTable(format=FORMAT, sources=sources, entries=[e for e in entries if e.order])


def _entry(key: tuple[str, str, str], per_case: dict[str, dict[str, float]]) -> OrderEntry:
    ratios: dict[str, list[float]] = defaultdict(list)
    for costs in per_case.values():
        cheapest = min(costs.values())
        for backend, cost in costs.items():
            ratios[backend].append(cost / cheapest)
    score = {b: math.exp(sum(map(math.log, r)) / len(r)) for b, r in ratios.items()}
    order = tuple(sorted(score, key=lambda b: (score[b], b)))
    arch, op, cls = key
    cost_us = {c: {b: round(v, 2) for b, v in sorted(costs.items())} for c, costs in sorted(per_case.items())}
    return OrderEntry(arch=arch, op=op, shape_class=cls, order=order, score={b: round(score[b], 4) for b in order},
                      cost_us=cost_us)  # fmt: skip


def describe(table: OrderTable) -> list[str]:
    """One line per entry, for ``tactix untuned-order show``."""
    if not table.entries:
        return ["no entries: backend preferences decide every untuned order"]
    return [f"{e.arch} {e.op} [{e.shape_class}]: " + " > ".join(f"{b} ({e.score[b]:.2f})" for b in e.order)
            + f"  cases {', '.join(e.cost_us)}" for e in table.entries]  # fmt: skip
