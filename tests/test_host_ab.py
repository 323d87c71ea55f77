"""benchmarks/host_ab.py, the same-host A/B of host costs, on the CPU: the harness itself (two
worker processes measured in turn, per-round ratios), not a host-cost result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tactix

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_ab.py"


def _run(old: str, new: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "--old", old, "--new", new, "--device", "cpu", "--rounds", "3",
           "--plans", "4", "--json", str(tmp_path / "ab.json"), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_each_side_imports_its_own_install_and_every_row_gets_a_ratio_per_round(tmp_path: Path) -> None:
    # the "old" side: a directory that shadows tactix with a package re-exporting this one, so
    # its workers report a different origin while measuring the same code
    shadow = tmp_path / "old-site" / "tactix"
    shadow.mkdir(parents=True)
    real = Path(tactix.__file__).parent
    (shadow / "__init__.py").write_text(
        f"__path__.append({str(real)!r})\nexec(open({str(real / '__init__.py')!r}).read())\n"
    )
    done = _run(str(shadow.parent), "", tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["old"] == str(shadow / "__init__.py")
    assert report["new"] == tactix.__file__
    assert report["rounds"] == 3
    rows = report["rows"]
    assert [(r["kind"], r["backend"], r["row"]) for r in rows] == [
        ("plan", "torch", "decode b64"), ("plan", "torch", "decode b8"), ("plan", "torch", "prefill b16")
    ]  # fmt: skip
    for r in rows:
        assert r["old_us"] > 0 and r["new_us"] > 0 and r["ratio_low"] <= r["ratio"] <= r["ratio_high"]
    assert "| plan | torch | decode b64 |" in done.stdout


def test_a_side_that_cannot_import_tactix_stops_the_run_with_a_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken" / "tactix"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken install')\n")
    done = _run(str(broken.parent), "", tmp_path)
    assert done.returncode != 0
    assert "the old worker exited" in done.stderr and "a broken install" in done.stderr


def test_a_control_worker_reports_its_own_ratio_against_the_old_side(tmp_path: Path) -> None:
    done = _run("", "", tmp_path, "--control")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["rounds"] == 3
    for r in report["rows"]:
        assert r["control_ratio_low"] <= r["control_ratio"] <= r["control_ratio_high"]
    assert "control/old (median)" in done.stdout


def test_a_budget_already_spent_starts_no_round_and_still_reports(tmp_path: Path) -> None:
    done = _run("", "", tmp_path, "--budget-s", "0")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["rounds"] == 0
    assert "stopping after 0 rounds" in done.stdout
    assert all("ratio" not in r for r in report["rows"])  # no round measured: no ratio claimed


def test_skipped_rows_are_neither_measured_nor_reported(tmp_path: Path) -> None:
    done = _run("", "", tmp_path, "--skip", "plan/*/prefill*,plan/torch/decode b8")
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [(r["kind"], r["backend"], r["row"]) for r in rows] == [("plan", "torch", "decode b64")]
    assert "prefill" not in done.stdout
