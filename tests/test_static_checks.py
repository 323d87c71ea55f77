"""The repository's own lint and type gates (ruff, mypy --strict), run with the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["core", "plugins", "tests", "benchmarks", "examples"]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (scripts/setup.sh installs it)")
    return path


def test_ruff_finds_nothing() -> None:
    done = subprocess.run([_tool("ruff"), "check", *SOURCES], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_code_is_formatted() -> None:
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", *SOURCES],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_passes() -> None:
    """The packages and, as a user's code, the examples (pyproject.toml's [tool.mypy] files)."""
    done = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
