"""`tactix cache ls|show|verify|clear|export|import` on a real tuned store, and on defective ones."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tactix
from tactix.autotune.store import TacticStore
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
    assert main(["cache", "--root", str(store), "clear", "--yes"]) == 0
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


def test_options_work_before_and_after_the_action(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "--root", str(store), "ls"]) == 0
    before = capsys.readouterr().out
    assert main(["cache", "ls", "--root", str(store)]) == 0
    assert capsys.readouterr().out == before and "2 entries" in before
    env = before.split()[0]
    assert main(["cache", "--root", str(store), "ls", "--env", env[:6]]) == 0  # one before, one after
    assert env in capsys.readouterr().out
    assert main(["cache", "clear", "--root", str(store), "--env", "abc", "--yes"]) == 2
    assert "'--env' must be the prefix of an environment hash" in capsys.readouterr().err
    assert main(["cache", "--root", str(store), "clear", "--env", env, "--yes"]) == 0
    assert not any(store.rglob("*.json"))


def test_clear_asks_before_deleting(store: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert main(["cache", "--root", str(store), "clear"]) == 2  # no terminal to ask: refuse
    assert "'--yes' must be given to delete 1 environment(s) with 2 entries" in capsys.readouterr().err
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["cache", "--root", str(store), "clear"]) == 1
    assert "nothing deleted" in capsys.readouterr().out and len(list(store.rglob("entries/*/*.json"))) == 2
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(["cache", "--root", str(store), "clear"]) == 0
    assert list(store.rglob("entries/*/*.json")) == []


def test_export_of_an_empty_store_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "--root", str(tmp_path), "export", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "nothing to export: no tactic store under" in err and "--env" not in err


def _garbage(manifest: Path) -> None:
    manifest.write_bytes(b"\xff\xfe garbage")


def _no_env(manifest: Path) -> None:
    manifest.write_text(json.dumps({"schema_version": 1}))


def _other_env(manifest: Path) -> None:
    data = json.loads(manifest.read_text())
    data["env"]["torch"] = "0.0.1"
    manifest.write_text(json.dumps(data))


def _directory(manifest: Path) -> None:
    manifest.unlink()
    manifest.mkdir()


MANIFESTS = {
    "garbage": (_garbage, "manifest.json is not JSON"),
    "no env": (_no_env, "manifest.json: it has no 'env' object"),
    "another environment": (_other_env, "manifest.json: it describes environment"),
    "a directory": (_directory, "manifest.json: it is a directory"),
    "missing": (Path.unlink, "manifest.json is missing"),
}


@pytest.mark.parametrize("command", ["ls", "verify", "verify --delete", "export", "show"])
@pytest.mark.parametrize("defect", sorted(MANIFESTS))
def test_a_defective_manifest_is_reported_in_one_line(
    defect: str, command: str, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    [manifest] = store.rglob("manifest.json")
    spoil, fragment = MANIFESTS[defect]
    spoil(manifest)
    argv = ["cache", "--root", str(store), *command.split()]
    key = next(store.rglob("entries/decode/*.json")).stem
    argv += {"export": [str(tmp_path / "b.json")], "show": [key[:10]]}.get(command, [])
    rc = main(argv)
    out, err = capsys.readouterr()
    if command == "show":  # the entries are still readable without their manifest
        assert rc == 0 and json.loads(out)["key_hash"] == key
        return
    assert rc != 0, out
    assert fragment in out + err
    assert "Traceback" not in err and err.count("\n") <= 2, err
    if command == "ls":
        assert "2 entries  environment unknown" in out
    if command.startswith("verify"):
        assert f"BAD {manifest}" in out


@contextlib.contextmanager
def read_only(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``path`` made read-only: a read-only tmpfs mount where this machine allows one (root in a
    sandbox), else every write under it failing with EROFS as such a mount fails them."""
    copy = path.with_name(path.name + "-copy")
    shutil.copytree(path, copy, symlinks=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)],
                             capture_output=True).returncode == 0  # fmt: skip
    if mounted:
        try:
            shutil.copytree(copy, path, symlinks=True, dirs_exist_ok=True)
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    for name in ("unlink", "rmdir", "replace", "mkdir"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(shutil, "rmtree", refuse)
    monkeypatch.setattr("tempfile.mkstemp", refuse)
    yield


def test_a_read_only_store_fails_loudly_where_writing_was_the_point(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "bundle.json"
    assert main(["cache", "--root", str(store), "export", str(bundle)]) == 0
    [entry_file] = store.rglob("entries/gemm/*.json")
    entry_file.write_text("{")
    empty = tmp_path / "empty"
    TacticStore(empty, json.loads(bundle.read_text())["env"]).attach()
    capsys.readouterr()
    with read_only(store, monkeypatch), read_only(empty, monkeypatch):
        assert main(["cache", "--root", str(store), "verify", "--delete"]) == 2
        err = capsys.readouterr().err
        assert "not deleted: Read-only file system" in err and "could not be deleted" in err, err
        assert main(["cache", "--root", str(store), "clear", "--yes"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tactix: error: cannot remove") and "Read-only file system" in err, err
        assert main(["cache", "--root", str(empty), "import", str(bundle)]) == 2
        err = capsys.readouterr().err
        assert "imported 0 of 2 entries" in err and "cannot be written" in err, err
    assert entry_file.exists() and len(list(store.rglob("entries/*/*.json"))) == 2
