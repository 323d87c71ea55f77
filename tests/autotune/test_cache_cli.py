"""`tactix cache ls|show|verify|clear|export|import` on a real tuned store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tactix
from tactix.cli import main

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with tactix.autotune(mode="tune", cache_dir=root, policy=tactix.MeasurementPolicy(warmup=1, repeat=3)):
        tactix.PagedDecode("HND", device="cpu").plan(i32(0, 1), i32(0), i32(3), 4, 2, 32, 8, q_data_type="float32")
        tactix.Gemm(device="cpu").plan(4, 32, 16, a_dtype="float32")
    return root


def test_ls_show_export_import_clear(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "--root", str(store), "ls", "--entries"]) == 0
    listing = capsys.readouterr().out
    assert "2 entries" in listing and "decode[f32-h4/2-d32-p8-HND-cpu]" in listing and "gemm[" in listing
    key = next(line.split()[0] for line in listing.splitlines() if "decode[" in line)
    assert main(["cache", "--root", str(store), "show", key]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["op"] == "decode" and shown["key"]["num_qo_heads"] == 4
    bundle = tmp_path / "bundle.json"
    assert main(["cache", "--root", str(store), "export", str(bundle)]) == 0
    other = tmp_path / "other"
    assert main(["cache", "--root", str(other), "import", str(bundle)]) == 0
    capsys.readouterr()
    assert main(["cache", "--root", str(other), "ls", "--entries"]) == 0
    assert "2 entries" in capsys.readouterr().out
    assert main(["cache", "--root", str(store), "clear"]) == 0
    capsys.readouterr()
    assert main(["cache", "--root", str(store), "ls"]) == 0
    assert "no tactic store" in capsys.readouterr().out


def test_verify_reports_and_deletes_bad_entries(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    [entry_file] = store.rglob("entries/gemm/*.json")
    entry_file.write_text(entry_file.read_text()[:50])  # truncated
    assert main(["cache", "--root", str(store), "verify"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {entry_file}" in out and "1 valid entries, 1 bad" in out
    assert main(["cache", "--root", str(store), "verify", "--delete"]) == 0
    assert not entry_file.exists()


def test_import_refuses_a_malformed_bundle(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "bundle.json"
    main(["cache", "--root", str(store), "export", str(bundle)])
    data = json.loads(bundle.read_text())
    data["entries"][0]["tactic"] = 7  # a bare plan index
    bundle.write_text(json.dumps(data))
    assert main(["cache", "--root", str(tmp_path / "other"), "import", str(bundle)]) == 2
    assert "'path' must be a bundle written by 'tactix cache export'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # nothing was written
