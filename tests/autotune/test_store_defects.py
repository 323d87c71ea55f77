"""A defective file where an entry should be never takes a process down, in any mode or command.

Each defect is planted at the real name of the entry a plan looks up (what a hand edit, a stray
``mkfifo`` or a bad ``ln -s`` leaves), then the plan is made in replay and tune mode and every
``tactix cache`` command is run on the store. Every defect must be a miss with exactly one
`StoreWarning` that names the file and the defect, and a command's report of it; never a
traceback, a hang or an unbounded read. The FIFO and device cases run in a subprocess with a
timeout and a memory cap, so a regression fails instead of hanging or exhausting the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tactix
from tactix.autotune.environment import environment
from tactix.autotune.store import MAX_ENTRY_BYTES, CandidateResult, StoreEntry, StoreWarning, TacticStore
from tactix.cli import main
from tactix.ops import GemmProblem
from tactix.tactics import Tactic

REPO = Path(__file__).resolve().parents[2]
POLICY = tactix.MeasurementPolicy(warmup=1, repeat=3)
ENV = environment(POLICY)


def plan(root: Path, mode: str) -> tactix.Gemm:
    with tactix.autotune(mode=mode, cache_dir=root, policy=POLICY):  # type: ignore[arg-type]
        g = tactix.Gemm(device="cpu")
        g.plan(4, 32, 16, a_dtype=torch.float32)
    return g


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The entry path of the plan above (relative to the store root) and a valid entry's JSON."""
    root = tmp_path_factory.mktemp("tuned")
    plan(root, "tune")
    [path] = root.rglob("entries/gemm/*.json")
    return path.relative_to(root), json.loads(path.read_text())


def _with_key(entry: dict[str, Any], **changes: Any) -> bytes:
    return json.dumps(dict(entry, key=dict(entry["key"], **changes))).encode()


def _without_op(entry: dict[str, Any]) -> bytes:
    return json.dumps(dict(entry, key={k: v for k, v in entry["key"].items() if k != "op"})).encode()


def _outside_root(entry: dict[str, Any], path: Path) -> None:
    elsewhere = path.parents[5] / "elsewhere.json"  # a valid entry, outside the store's root
    elsewhere.write_text(json.dumps(entry))
    path.symlink_to(elsewhere)


Plant = Callable[[dict[str, Any], Path], None]
# name -> (how to plant it at the entry's path, a fragment of the warning that must name the defect)
DEFECTS: dict[str, tuple[Plant, str]] = {
    "key without op": (lambda e, p: p.write_bytes(_without_op(e)), "'op' must be one of"),
    "op is a list": (lambda e, p: p.write_bytes(_with_key(e, op=["gemm"])), "'op' must be one of"),
    "op is unknown": (lambda e, p: p.write_bytes(_with_key(e, op="evil")), "'op' must be one of"),
    "deep JSON": (lambda e, p: p.write_bytes(b"[" * 300_000 + b"]" * 300_000), "nested too deeply"),
    "5000-digit integer": (
        lambda e, p: p.write_bytes(_with_key(e, m="BIG").replace(b'"BIG"', b"9" * 5000)),
        "5000 digits",
    ),
    "directory": (lambda e, p: p.mkdir(), "a directory, not a regular file"),
    "symlink outside": (_outside_root, "symbolic link"),
    "symlink loop": (lambda e, p: p.symlink_to(p.name), "symbolic link"),
    # these hang or exhaust memory on a reader that does not guard against them: run in a child
    "FIFO": (lambda e, p: os.mkfifo(p), "a FIFO, not a regular file"),
    "link to /dev/zero": (lambda e, p: p.symlink_to("/dev/zero"), "symbolic link"),
    "link to /dev/urandom": (lambda e, p: p.symlink_to("/dev/urandom"), "symbolic link"),
}
DANGEROUS = ("FIFO", "link to /dev/zero", "link to /dev/urandom")
MODES = ["replay", "tune", "ls", "ls --entries", "show", "verify", "export", "verify --delete"]


def exercise(workdir: Path, defect: str, mode: str, relative: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Plant ``defect`` in a fresh store under ``workdir``, then run one mode or ``tactix cache`` command."""
    root = workdir / "a" / "b" / "store"
    TacticStore(root, ENV).attach()
    path = root / relative
    DEFECTS[defect][0](entry, path)
    tactix.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome: dict[str, Any] = {"path": str(path)}
        if mode in ("replay", "tune"):
            g = plan(root, mode)
            outcome["tactic"] = str(g.tactic)
            outcome["tuned"] = tactix.stats().get("tuned_problems", 0)
        else:
            action, *flags = mode.split()
            argv = ["cache", action, "--root", str(root), *flags]
            if action == "show":
                argv.append(path.stem[:8])
            if action == "export":
                argv.append(str(workdir / "bundle.json"))
            outcome["rc"] = main(argv)
    outcome["store_warnings"] = [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]
    outcome["still_there"] = os.path.lexists(path)
    return outcome


def check(outcome: dict[str, Any], mode: str, fragment: str, out: str, err: str) -> None:
    path = outcome["path"]
    if mode in ("replay", "tune"):
        [warning] = outcome["store_warnings"]  # exactly one, naming the file and the defect
        assert path in warning and fragment in warning, warning
        assert outcome["tactic"].startswith("torch:")
        assert outcome["tuned"] == (1 if mode == "tune" else 0)  # a miss: tune mode measures it again
        return
    assert "Traceback" not in err
    if mode == "ls --entries":
        assert outcome["rc"] == 0 and f"BAD  {Path(path).name}" in out and fragment in out, out
    elif mode == "verify":
        assert outcome["rc"] == 1 and f"BAD {path}" in out and fragment in out, out
    elif mode == "verify --delete":
        assert outcome["rc"] == 0 and not outcome["still_there"], (out, err)
    elif mode == "show":
        assert outcome["rc"] == 2 and "'key' must be the prefix of a stored entry" in err, err
    else:
        assert outcome["rc"] == 0, (out, err)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("defect", sorted(set(DEFECTS) - set(DANGEROUS)))
def test_a_defective_entry_is_a_miss_with_one_warning(
    defect: str, mode: str, tuned: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    relative, entry = tuned
    outcome = exercise(tmp_path, defect, mode, str(relative), entry)
    captured = capsys.readouterr()
    check(outcome, mode, DEFECTS[defect][1], captured.out, captured.err)


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    sys.path.insert(0, sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # far below what an unbounded read reaches
    from pathlib import Path
    from tests.autotune.test_store_defects import exercise
    workdir, defect, relative, entry = Path(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
    results = []
    for i, mode in enumerate(sys.argv[6:]):
        results.append(exercise(workdir / str(i), defect, mode, relative, entry))
        print("@@", flush=True)  # where one mode's command output ends
        print("@@", file=sys.stderr, flush=True)
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize("defect", DANGEROUS)
def test_a_fifo_or_device_at_an_entry_never_hangs_or_exhausts_memory(
    defect: str, tuned: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    relative, entry = tuned
    argv = [sys.executable, "-c", CHILD, str(REPO), str(tmp_path), defect, str(relative), json.dumps(entry), *MODES]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)  # a hang fails here
    assert done.returncode == 0, done.stderr[-3000:]
    *outs, last = done.stdout.split("@@\n")
    errs = done.stderr.split("@@\n")
    for mode, outcome, out, err in zip(MODES, json.loads(last), outs, errs, strict=False):
        check(outcome, mode, DEFECTS[defect][1], out, err)


def test_a_symlinked_op_folder_is_neither_read_nor_written(tmp_path: Path) -> None:
    root = tmp_path / "store"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = TacticStore(root, ENV).attach()
    folder = store.path / "entries" / "gemm"
    folder.rmdir()
    folder.symlink_to(elsewhere)
    with pytest.warns(StoreWarning, match="symbolic link to .*elsewhere.*never reads or writes outside its root"):
        g = plan(root, "tune")
    assert g.tactic.backend == "torch"
    assert list(elsewhere.iterdir()) == [], "tune mode wrote outside the store's root"
    assert main(["cache", "verify", "--root", str(root)]) == 1


def test_one_directory_at_an_entry_leaves_the_rest_of_the_store_writable(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = TacticStore(root, ENV).attach()
    problems = [GemmProblem(device_type="cpu", m=m, n=64, k=32, a_dtype="float32", b_dtype="float32",
                            out_dtype="float32") for m in (1, 2, 4)]  # fmt: skip
    (store.path / "entries" / "gemm" / f"{problems[1].key_hash()}.json").mkdir()
    tactic = Tactic(backend="torch", kernel="matmul")
    with pytest.warns(StoreWarning, match="a directory") as caught:
        written = [store.put(StoreEntry(op="gemm", key=p.key(), key_hash=p.key_hash(), tactic=tactic,
                                        baseline=tactic, env_hash=store.env_hash)) for p in problems]  # fmt: skip
    assert written == [True, False, True] and store.writable
    assert len([w for w in caught if issubclass(w.category, StoreWarning)]) == 1
    assert all(store.lookup(p) is not None for p in problems)  # the blocked one is served from memory


def test_put_keeps_entries_readable_by_the_next_process(tmp_path: Path) -> None:
    store = TacticStore(tmp_path, ENV).attach()
    p = GemmProblem(device_type="cpu", m=8, n=64, k=32, a_dtype="float32", b_dtype="float32", out_dtype="float32")
    winner = Tactic(backend="torch", kernel="matmul")
    trace = "Traceback (most recent call last):\n" + "x" * 100_000
    losers = [CandidateResult(tactic=Tactic(backend="torch", kernel="matmul", params={"i": i}), status="failed",
                              reason=trace) for i in range(40)]  # fmt: skip
    assert all(len(c.reason or "") < 2100 for c in losers)  # reasons are capped when recorded
    many = losers * 20  # still over the reader's limit with capped reasons
    entry = StoreEntry(op="gemm", key=p.key(), key_hash=p.key_hash(), tactic=winner, baseline=winner,
                       candidates=[CandidateResult(tactic=winner, status="ok", median_s=1e-5), *many],
                       env_hash=store.env_hash)  # fmt: skip
    assert len(entry.to_json()) > MAX_ENTRY_BYTES
    assert store.put(entry)
    [path] = store.path.rglob("entries/gemm/*.json")
    assert path.stat().st_size <= MAX_ENTRY_BYTES
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        again = TacticStore(tmp_path, store.env).attach().lookup(p)
    assert again is not None and again.tactic == winner and again.candidates[0].median_s == 1e-5
