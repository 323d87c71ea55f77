"""docs/support-matrix.md is generated from the committed conformance reports, and stays so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tactix.testing.matrix import REGENERATE, load_reports, render

ROOT = Path(__file__).resolve().parents[2]


def test_committed_matrix_is_what_the_committed_reports_render_to() -> None:
    reports = sorted((ROOT / "benchmarks" / "results").glob("conformance-*.json"))
    assert reports, "no conformance reports under benchmarks/results"
    expected = render(load_reports(reports))
    assert (ROOT / "docs" / "support-matrix.md").read_text() == expected, f"regenerate with: {REGENERATE}"
    backends = {b["name"] for r in load_reports(reports) for b in r["backends"]}
    assert {"torch", "naive"} <= backends


def test_kit_is_inert_without_a_backend(tmp_path: Path) -> None:
    """Installed as a pytest plugin everywhere, the kit changes nothing unless asked."""
    (tmp_path / "test_other.py").write_text('def test_other():\n    assert len("other") == 5\n')
    other = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                           capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert other.returncode == 0 and "1 passed" in other.stdout, other.stdout
    assert "tactix" not in other.stdout
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--pyargs",
                            "tactix.testing.suite"], capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert suite.returncode == 0, suite.stdout
    assert "passed" not in suite.stdout and "pass --tactix-backend=NAME" in suite.stdout


def test_declared_but_untested_paths_are_listed_as_such() -> None:
    """A backend's `BackendSpec.untested` reaches its report and the matrix says it is not tested."""
    report = {
        "kit": "0", "device": "cpu", "device_name": "cpu (x86_64)", "torch": "2", "python": "3",
        "backends": [{"name": "demo", "version": "1", "distribution": "demo-dist", "distribution_version": "1",
                      "environment": [], "untested": {"compute capability 10.x": "no such GPU here"},
                      "capabilities": {}}],
        "totals": {}, "results": [],
    }  # fmt: skip
    text = render([report])
    assert "Declared, not tested on this project's hardware" in text
    assert "* compute capability 10.x: no such GPU here" in text
    report["backends"][0]["untested"] = {}  # type: ignore[index]
    assert "Declared, not tested" not in render([report])
    import tactix

    spec = tactix.get_registry().get("trtllm").spec if "trtllm" in {
        b.name for b in tactix.get_registry().active()} else None  # fmt: skip
    if spec is not None:
        assert any(label.startswith("compute capability 10") for label in spec.untested)


def test_an_op_is_listed_for_the_reports_whose_kit_had_it() -> None:
    """A report lists its kit's ops; one written before reports listed them (before ragged-KV
    prefill) gets no row for an op its kit never asked about, rather than "not implemented"."""
    result = {"backend": "demo", "test": "test_attention", "case": "ragged_prefill[x]", "op": "ragged_prefill",
              "features": ["causal"], "outcome": "passed", "detail": ""}  # fmt: skip
    report: dict[str, object] = {
        "kit": "0", "device": "cpu", "device_name": "cpu (x86_64)", "torch": "2", "python": "3",
        "ops": ["prefill", "decode", "ragged_prefill", "gemm"],
        "backends": [{"name": "demo", "version": "1", "environment": [], "untested": {}, "capabilities": {}}],
        "totals": {}, "results": [result],
    }  # fmt: skip
    rows = [line for line in render([report]).splitlines() if line.startswith("| demo |")]
    assert [row.split(" | ")[3] for row in rows] == ["prefill", "decode", "ragged_prefill", "gemm"]
    assert "| ragged_prefill | 1 |" in rows[2] and "not implemented" in rows[0]
    del report["ops"]
    report["results"] = []
    rows = [line for line in render([report]).splitlines() if line.startswith("| demo |")]
    assert [row.split(" | ")[3] for row in rows] == ["prefill", "decode", "gemm"]
