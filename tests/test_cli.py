"""The `tactix` command: the demo (the main job), doctor, and error reporting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tactix.cli import main


def test_demo_checks_every_op_against_float64_and_names_its_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "demo.json"
    assert main(["demo", "--device", "cpu", "--decode-steps", "2", "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(report.read_text())["rows"]
    ops = {r["op"] for r in rows}
    assert ops == {"prefill attention", "decode attention", "gemm qkv", "gemm o", "gemm gate_up", "gemm down"}
    assert len(rows) == 5 * 3  # prefill + 2 decode steps, 5 ops each
    for row in rows:
        assert row["ok"] and 0 < row["error"] <= row["tolerance"], row
        assert row["backend"] == "torch" and row["tactic"].startswith("torch:")
        assert row["tactic"] in printed
    assert f"{len(rows)}/{len(rows)} ops within tolerance" in printed


def test_doctor_reports_torch_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] and "cuda_available" in info
    assert any(b["name"] == "torch" and b["status"] == "active" for b in info["backends"])


def test_bad_arguments_exit_2_with_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--decode-steps", "x"])
    assert info.value.code == 2
    assert "invalid int value" in capsys.readouterr().err
    assert main(["demo", "--device", "tpu"]) == 2
    assert "'--device' must be" in capsys.readouterr().err
