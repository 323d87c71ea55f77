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
