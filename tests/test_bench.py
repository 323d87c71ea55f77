"""`tactix bench` on the quick CPU suite: every row checked against float64, rates and ratios reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tactix.cli import main


def test_cpu_suite_reports_checked_rows_for_every_backend_and_tuned_auto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    assert main(["bench", "--suite", "cpu", "--device", "cpu", "--repeat", "3", "--json", str(out),
                 "--markdown", str(md)]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    rows = report["rows"]
    cases = {r["case"] for r in rows}
    assert cases == {"d1", "d2", "p1", "p4", "g1", "g2"}
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        assert {"torch", "auto (tuned)"} <= {r["implementation"] for r in mine}
        ok = [r for r in mine if r["status"] == "ok"]
        assert ok and max(r["ratio_to_best"] for r in ok) == 1.0
        for r in ok:
            assert r["error"] is not None and r["error"] < 1e-5  # float32 on the CPU, checked against float64
            assert r["time_us"] > 0 and r["rate"] > 0 and r["unit"] in ("TB/s", "TFLOP/s")
    decode = [r for r in rows if r["case"] == "d1"]
    assert {r["implementation"] for r in decode} >= {"naive"}  # a third-party backend is benchmarked too
    text = md.read_text()
    assert "| d1 | decode b8, kv 64-512 |" in text and "auto (tuned)" in text
    assert "auto (tuned)" in capsys.readouterr().out


def test_direct_library_calls_get_checked_rows_of_their_own(tmp_path: Path) -> None:
    from tactix.bench import run_bench
    from tests.plugin_fixtures import plugins_on_path, referencing_plugin, write_distribution

    root = tmp_path / "site"
    write_distribution(root, "tactix-refs", "1.0", {"refs": "refs_plugin"}, {"refs_plugin": referencing_plugin("refs")})
    with plugins_on_path(root):
        import torch

        report = run_bench("cpu", torch.device("cpu"), cases=["d2"], backends=["refs", "torch"], tune=False)
    rows = {r["implementation"]: r for r in report["rows"]}
    assert set(rows) == {"refs", "torch", "refs (direct)"}
    direct = rows["refs (direct)"]
    assert direct["status"] == "ok" and direct["tactic"] == "right" and direct["error"] < 1e-6
    assert "fastest of 1 variants" in direct["detail"]
    assert "wrong: wrong result" in direct["detail"] and "boom: RuntimeError: no such plan" in direct["detail"]
    assert direct["rate"] > 0 and direct["ratio_to_best"] is not None
