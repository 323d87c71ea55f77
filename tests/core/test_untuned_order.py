"""The untuned order (`tactix.untuned_order`): the measured table that decides which backend
``auto`` plans first without a stored tactic, how a table is derived from bench reports, and the
shipped table's provenance."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tactix
from tactix import untuned_order
from tactix.autotune.store import TacticStore
from tactix.bench import case_problem, select_cases, suite
from tactix.cli import main
from tactix.problems import bucket_size
from tactix.selection import set_tactic_source
from tests.plugin_fixtures import delegating_plugin, plugins_on_path, write_distribution

REPO = Path(__file__).resolve().parents[2]
CPU_DECODE_CLASS = "fp32 kv, 1 row, batch <= 8"  # the class of `_plan_decode`'s problem


@pytest.fixture(autouse=True)
def _fresh_table(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test reads the table its own environment names; the next one starts over."""
    monkeypatch.delenv(untuned_order.ENV_VAR, raising=False)
    untuned_order.reload()
    yield
    monkeypatch.delenv(untuned_order.ENV_VAR, raising=False)
    untuned_order.reload()


def _use_table(monkeypatch: pytest.MonkeyPatch, path: Path, entries: list[dict[str, Any]], fmt: int = 1) -> None:
    path.write_text(json.dumps({"format": fmt, "entries": entries}))
    monkeypatch.setenv(untuned_order.ENV_VAR, str(path))
    untuned_order.reload()


def _entry(order: list[str], arch: str = "cpu", shape_class: str = CPU_DECODE_CLASS) -> dict[str, Any]:
    return {"arch": arch, "op": "decode", "shape_class": shape_class, "order": order,
            "score": dict.fromkeys(order, 1.0), "cost_us": {}}  # fmt: skip


def _plan_decode(backend: str = "auto") -> tactix.PagedDecode:
    wrapper = tactix.PagedDecode("NHD", device="cpu", backend=backend)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper.plan(i32(0, 1), i32(0), i32(3), 4, 2, 16, 4, q_data_type=torch.float32)
    return wrapper


@pytest.fixture
def second_backend(tmp_path: Path) -> Iterator[None]:
    """A second CPU decode backend ('twin', less preferred than torch) installed beside torch."""
    root = tmp_path / "site"
    write_distribution(root, "tactix-twin", "1.0", {"twin": "tx_twin"},
                       {"tx_twin": delegating_plugin("twin", preference=-300)})  # fmt: skip
    with plugins_on_path(root):
        yield


def test_auto_plans_the_backend_the_table_orders_first(
    second_backend: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert _plan_decode().backend == "torch"  # preferences: torch (-100) before twin (-300)
    _use_table(monkeypatch, tmp_path / "order.json", [_entry(["twin", "torch"])])
    w = _plan_decode()
    assert (w.backend, w.selection_source) == ("twin", "default")
    assert _plan_decode("torch").backend == "torch"  # a named backend is planned as named
    previous = set_tactic_source(lambda problem: tactix.Tactic.default("torch"))  # a stored tactic (tuned auto)
    try:
        w = _plan_decode()
        assert (w.backend, w.selection_source) == ("torch", "store")
    finally:
        set_tactic_source(previous)


def test_tuning_auto_measures_winners_against_the_untuned_choice_the_table_gives(
    second_backend: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A tuned winner must beat what untuned auto would plan, which the table decides, not the
    preferences (on the H100 of session 40, R3's tuned tactic beat cudnn's default, the preferred
    backend, but was 4 % slower than cuda_native's, which the table orders first)."""

    def tuned_baseline(store: Path) -> tactix.Tactic:
        with tactix.autotune(mode="tune", cache_dir=store, policy=tactix.MeasurementPolicy(warmup=1, repeat=3)):
            _plan_decode()
        [env_dir] = TacticStore.environments(store)
        [entry] = TacticStore.open(env_dir).attach().entries()
        assert entry.baseline in {c.tactic for c in entry.candidates if c.status == "ok"}  # measured
        return entry.baseline

    assert tuned_baseline(tmp_path / "by-preference") == tactix.Tactic.default("torch")
    _use_table(monkeypatch, tmp_path / "order.json", [_entry(["twin", "torch"])])
    assert tuned_baseline(tmp_path / "by-table") == tactix.Tactic.default("twin")


def test_the_table_applies_only_to_its_architecture_and_class(
    second_backend: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    elsewhere = [
        _entry(["twin", "torch"], arch="sm90"),
        _entry(["twin", "torch"], shape_class="fp8 kv, 1 row, batch <= 8"),
    ]
    _use_table(monkeypatch, tmp_path / "order.json", elsewhere)
    assert _plan_decode().backend == "torch"  # no entry for this machine's class: preferences decide


def test_a_new_table_reorders_auto_at_once_despite_remembered_candidates(
    second_backend: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    w = _plan_decode()
    assert w.backend == "torch"
    _use_table(monkeypatch, tmp_path / "order.json", [_entry(["twin"])])  # (the rest follow in preference order)
    assert _plan_decode().backend == "twin"
    monkeypatch.setenv(untuned_order.ENV_VAR, "off")
    untuned_order.reload()
    assert _plan_decode().backend == "torch"


def test_a_table_of_another_format_is_ignored_with_a_warning(
    second_backend: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "order.json"
    path.write_text(json.dumps({"format": 99, "entries": [_entry(["twin"])]}))
    monkeypatch.setenv(untuned_order.ENV_VAR, str(path))
    with pytest.warns(UserWarning, match="format 99, this tactix reads format 1"):
        untuned_order.reload()
    assert _plan_decode().backend == "torch"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("{not json", "Expecting property name"), ('{"format": 1, "entries": [{"arch": "cpu"}]}', "at entries.0.op")],
    ids=["not-json", "malformed-entry"],
)
def test_a_bad_table_named_by_the_environment_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, fragment: str
) -> None:
    path = tmp_path / "order.json"
    path.write_text(text)
    monkeypatch.setenv(untuned_order.ENV_VAR, str(path))
    with pytest.raises(
        tactix.InvalidArgumentError, match=f"'TACTIX_UNTUNED_ORDER' must be an untuned order table.*{fragment}"
    ):
        untuned_order.reload()


def test_shape_classes_separate_what_the_suite_measures_and_hold_across_a_bucket() -> None:
    classes = {c.id: untuned_order.shape_class(case_problem(c)) for c in suite("gpu")}
    assert classes["D2"] == "16-bit kv, 1 row, batch <= 8" and classes["D1"] == "16-bit kv, 1 row, batch 9-128"
    assert classes["D3"] == "16-bit kv, 1 row, batch > 128" and classes["D3-fp8"] == "fp8 kv, 1 row, batch > 128"
    assert classes["D1-fp8"] == "fp8 kv, 1 row, batch 9-128" and classes["V1"] == "16-bit kv, rows > 1, batch 9-128"
    assert classes["R1"] == "16-bit kv, head dims 192/128" and classes["R3"] == "16-bit kv"
    assert classes["G2-m1"] == classes["G2-m16"] == "16-bit, m <= 16"
    assert classes["G2-m64"] == "16-bit, m <= 64" and classes["G2-m256"] == "16-bit, m <= 1024"
    assert classes["G1"] == "16-bit, m > 1024" and classes["G4"] == "fp8, m > 1024"
    # the tuner and selection remember per bucket: a class must not change within one
    gemm = case_problem(select_cases("gpu", ["G2-m1"])[0])
    for m in range(1, 2100, 7):
        exact = gemm.model_copy(update={"m": m})
        assert untuned_order.shape_class(exact) == untuned_order.shape_class(
            exact.model_copy(update={"m": bucket_size(m)})
        )
    decode = case_problem(select_cases("gpu", ["D2"])[0])
    for b in range(1, 40):
        exact = decode.model_copy(update={"batch_size": b})
        same_bucket = exact.model_copy(update={"batch_size": bucket_size(b)})
        assert untuned_order.shape_class(exact) == untuned_order.shape_class(same_bucket)


def _row(
    case: str, impl: str, time_us: float | None, host_us: float | None = None, status: str = "ok"
) -> dict[str, Any]:
    return {"case": case, "implementation": impl, "status": status, "time_us": time_us, "run_host_us": host_us}


def _report(rows: list[dict[str, Any]], arch: str | None = "sm90") -> dict[str, Any]:
    env = {"suite": "gpu", "device": "a GPU", "backends": {"fast_kernel": "1", "lean_host": "1", "other": "1"}}
    if arch:
        env["arch"] = arch
    return {"environment": env, "rows": rows}


def test_a_table_ranks_backends_by_the_longer_of_device_and_host_time() -> None:
    rows = [
        _row("G2-m1", "fast_kernel", 10.0, 60.0),  # a quick kernel behind a slow run(): 60 us an eager call
        _row("G2-m1", "lean_host", 30.0, 5.0),
        _row("G2-m16", "fast_kernel", 12.0, 58.0),
        _row("G2-m16", "lean_host", 31.0, 6.0),
        _row("G2-m16", "auto (tuned)", 1.0, 1.0),  # not a backend: left out
        _row("G2-m16", "lean_host (direct)", 1.0, 1.0),
        _row("G2-m16", "other", None, status="unsupported"),
        _row("G1", "fast_kernel", 900.0, 60.0),  # another class, where the kernel decides
        _row("G1", "lean_host", 1500.0, 5.0),
    ]
    table = untuned_order.build_table([("r.json", _report(rows))])
    entries = {e.shape_class: e for e in table.entries}
    small = entries["16-bit, m <= 16"]
    assert small.order == ("lean_host", "fast_kernel") and small.arch == "sm90" and small.op == "gemm"
    assert small.cost_us == {
        "G2-m1": {"fast_kernel": 60.0, "lean_host": 30.0},
        "G2-m16": {"fast_kernel": 58.0, "lean_host": 31.0},
    }
    assert small.score["lean_host"] == 1.0 and small.score["fast_kernel"] == pytest.approx(
        (2.0 * 58 / 31) ** 0.5, rel=1e-3
    )
    assert entries["16-bit, m > 1024"].order == ("fast_kernel", "lean_host")
    assert table.sources[0]["report"] == "r.json" and table.sources[0]["cases"] == ["G1", "G2-m1", "G2-m16"]


def test_a_case_measured_again_keeps_the_later_reports_rows() -> None:
    old = _report([_row("D2", "fast_kernel", 10.0), _row("D2", "lean_host", 20.0)])
    new = _report([_row("D2", "fast_kernel", 30.0), _row("D2", "lean_host", 20.0)])
    (entry,) = untuned_order.build_table([("old", old), ("new", new)]).entries
    assert entry.order == ("lean_host", "fast_kernel") and entry.cost_us == {
        "D2": {"fast_kernel": 30.0, "lean_host": 20.0}
    }


def test_a_report_without_its_architecture_needs_one_named() -> None:
    report = _report([_row("D2", "lean_host", 20.0)], arch=None)
    with pytest.raises(tactix.InvalidArgumentError, match=r"'arch' must be given for old\.json"):
        untuned_order.build_table([("old.json", report)])
    (entry,) = untuned_order.build_table([("old.json", report)], arch="sm90").entries
    assert entry.arch == "sm90"


def test_the_shipped_table_is_what_its_committed_reports_give() -> None:
    """Derived from measurements committed under benchmarks/results: rebuilding it from the
    reports it names gives the same entries, so no order in it was set by hand."""
    shipped = untuned_order.read(untuned_order.SHIPPED)
    assert shipped.format == untuned_order.FORMAT and shipped.entries
    reports = [s["report"] for s in shipped.sources]
    assert all((REPO / r).is_file() for r in reports), reports
    rebuilt = untuned_order.build_table([(r, json.loads((REPO / r).read_text())) for r in reports], arch="sm90")
    assert rebuilt.entries == shipped.entries


def test_cli_builds_a_table_atomically_and_shows_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "bench.json"
    report.write_text(json.dumps(_report([_row("D2", "fast_kernel", 10.0, 40.0), _row("D2", "lean_host", 20.0)])))
    out = tmp_path / "order.json"
    assert main(["untuned-order", "build", str(report), "-o", str(out)]) == 0
    assert (
        capsys.readouterr().out
        == "sm90 decode [16-bit kv, 1 row, batch <= 8]: lean_host (1.00) > fast_kernel (2.00)  cases D2\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "order.json"]  # no temporary file left
    assert main(["untuned-order", "show", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"][0]["order"] == ["lean_host", "fast_kernel"]
    assert main(["untuned-order", "build", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tactix: error: 'reports' must be readable") and err.count("\n") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["untuned-order", "show"]) == 0  # the shipped table reads cleanly
    assert "sm90 decode [" in capsys.readouterr().out
