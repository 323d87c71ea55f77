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
