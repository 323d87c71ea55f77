"""The repository's own lint and type gates (ruff, mypy --strict), run with the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (scripts/setup.sh installs it)")
    return path


def test_ruff_finds_nothing() -> None:
    done = subprocess.run(
        [_tool("ruff"), "check", "core", "tests", "benchmarks", "examples"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_code_is_formatted() -> None:
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", "core", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_passes() -> None:
    done = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_users_code_type_checks(tmp_path: Path) -> None:
    """What the docs show a user writing passes mypy --strict (the callable autotune package too)."""
    user = tmp_path / "engine.py"
    user.write_text(
        "import tactix\n"
        "from tactix.autotune.distributed import sync_store\n\n"
        "with tactix.autotune(mode='tune', cache_dir='/tmp/tactix-store') as tuner:\n"
        "    decode = tactix.PagedDecode(backend='auto')\n"
        "print(sync_store, tuner, decode)\n"
    )
    done = subprocess.run([_tool("mypy"), "--strict", str(user)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
