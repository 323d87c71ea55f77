"""The tactic store: atomic, crash-safe, shared by processes, and never crashed by a bad file."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import tactix
from tactix.autotune import store as store_module
from tactix.autotune.environment import environment
from tactix.autotune.store import CandidateResult, StoreEntry, StoreWarning, TacticStore
from tactix.ops import GemmProblem
from tactix.tactics import Tactic

ENV = environment(tactix.MeasurementPolicy())


def gemm(m: int, n: int = 64, k: int = 32) -> GemmProblem:
    return GemmProblem(device_type="cpu", m=m, n=n, k=k, a_dtype="bfloat16", b_dtype="bfloat16", out_dtype="bfloat16")


def entry_for(problem: GemmProblem, store: TacticStore, candidates: int = 1) -> StoreEntry:
    tactic = Tactic(backend="torch", kernel="matmul")
    results = [CandidateResult(tactic=tactic, status="ok", median_s=1e-5 * (i + 1), samples=20, timed_as="eager")
               for i in range(candidates)]  # fmt: skip
    return StoreEntry(op="gemm", key=problem.key(), key_hash=problem.key_hash(), tactic=tactic,
                      baseline=Tactic.default("torch"), candidates=results, env_hash=store.env_hash)  # fmt: skip


def test_entries_survive_a_new_process_view_and_bucket_their_key(tmp_path: Path) -> None:
    store = TacticStore(tmp_path, ENV).attach()
    store.put(entry_for(gemm(100), store))
    again = TacticStore(tmp_path, ENV).attach()
    assert len(again) == 1
    hit = again.lookup(gemm(70))  # 70 and 100 share the bucket m <= 128
    assert hit is not None and hit.tactic == Tactic(backend="torch", kernel="matmul")
    assert again.lookup(gemm(200)) is None
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert manifest["env_hash"] == store.env_hash and manifest["env"] == ENV
    assert store.path == tmp_path / "v1" / store.env_hash


def test_environment_hash_covers_the_policy() -> None:
    a = TacticStore("/x", environment(tactix.MeasurementPolicy()))
    b = TacticStore("/x", environment(tactix.MeasurementPolicy(execution="eager")))
    c = TacticStore("/x", environment(tactix.MeasurementPolicy(repeat=21)))
    assert len({a.env_hash, b.env_hash, c.env_hash}) == 3


def test_bad_files_are_misses_with_a_warning_never_a_crash(tmp_path: Path) -> None:
    store = TacticStore(tmp_path, ENV).attach()
    good = entry_for(gemm(8), store)
    store.put(good)
    folder = store.path / "entries" / "gemm"
    valid = json.loads(good.to_json())
    bad: dict[str, bytes] = {}
    for m, name in [(16, "garbage"), (32, "truncated"), (64, "oversized"), (128, "schema"), (256, "integer"),
                    (512, "renamed"), (1024, "list")]:  # fmt: skip
        problem = gemm(m)
        data = dict(valid, key=problem.key(), key_hash=problem.key_hash())
        if name == "garbage":
            text = b"\x00\xff not json at all"
        elif name == "truncated":
            text = json.dumps(data).encode()[:40]
        elif name == "oversized":
            text = json.dumps(dict(data, pad="x" * (2 << 20))).encode()
        elif name == "schema":
            text = json.dumps(dict(data, schema_version=99)).encode()
        elif name == "integer":
            text = json.dumps(dict(data, tactic=3)).encode()
        elif name == "renamed":
            text = json.dumps(valid).encode()  # gemm(8)'s entry under gemm(512)'s name
        else:
            text = b"[]"
        (folder / f"{problem.key_hash()}.json").write_bytes(text)
        bad[name] = text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reopened = TacticStore(tmp_path, ENV).attach()
        for m in (16, 32, 64, 128, 256, 512, 1024):
            assert reopened.lookup(gemm(m)) is None
        assert reopened.lookup(gemm(8)) == good
    messages = [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]
    assert len(messages) == 7, messages  # one each, not one per lookup
    joined = "\n".join(messages)
    for fragment in ("not JSON", "larger than an entry", "schema version 99", "malformed", "does not match its name",
                     "schema version 'list'"):  # fmt: skip
        assert fragment in joined, fragment


def test_unwritable_store_keeps_entries_in_memory_with_one_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the store root should be")
    with pytest.warns(StoreWarning, match="cannot be written"):
        store = TacticStore(blocker, ENV).attach()
    assert not store.writable
    store.put(entry_for(gemm(4), store))
    assert store.lookup(gemm(4)) is not None


def test_full_disk_degrades_to_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = TacticStore(tmp_path, ENV).attach()

    def disk_full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "write_atomically", disk_full)
    with pytest.warns(StoreWarning, match="No space left"):
        store.put(entry_for(gemm(4), store))
    store.put(entry_for(gemm(40), store))  # no second warning, still served from memory
    assert store.lookup(gemm(4)) is not None and store.lookup(gemm(40)) is not None


def test_dead_writers_temporaries_are_removed_live_ones_kept(tmp_path: Path) -> None:
    store = TacticStore(tmp_path, ENV).attach()
    folder = store.path / "entries" / "gemm"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = folder / f".tmp-{dead.stdout.strip()}-abc.json"
    live = folder / f".tmp-{os.getpid()}-def.json"
    stale.write_text("{")
    live.write_text("{")
    TacticStore(tmp_path, ENV).attach()
    assert not stale.exists() and live.exists()


WRITER = textwrap.dedent(
    """
    import sys, torch, tactix
    from tactix.autotune.policy import MeasurementPolicy
    root, worker = sys.argv[1], int(sys.argv[2])
    policy = MeasurementPolicy(warmup=0, repeat=1)
    with tactix.autotune(mode="tune", cache_dir=root, policy=policy):
        for i in range(40):
            # 30 problems of this worker's own, 10 that every worker tunes at once
            m, n = (i + 1, 16 * (worker + 1)) if i < 30 else (1000 + i, 8)
            g = tactix.Gemm(device="cpu")
            g.plan(m, n, 16, a_dtype=torch.float32)
    print("done", worker)
    """
)


@pytest.mark.slow
def test_eight_processes_tuning_into_one_store(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "store"), str(w)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(8)]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    [env_dir] = TacticStore.environments(tmp_path / "store")
    store = TacticStore.open(env_dir)
    assert store.verify() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        store.attach()
    expected = {gemm(i + 1, 16 * (w + 1), 16).model_copy(update={"a_dtype": "float32", "b_dtype": "float32",
                "out_dtype": "float32"}).key_hash() for w in range(8) for i in range(30)}  # fmt: skip
    shared = {gemm(1000 + i, 8, 16).model_copy(update={"a_dtype": "float32", "b_dtype": "float32",
              "out_dtype": "float32"}).key_hash() for i in range(30, 40)}  # fmt: skip
    found = {e.key_hash for e in store.entries()}
    assert expected | shared <= found, f"{len((expected | shared) - found)} entries lost"
    leftovers = [p for p in store.path.rglob(".tmp-*")]
    assert leftovers == []


KILLED = textwrap.dedent(
    """
    import sys
    from tactix.autotune.environment import environment
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.autotune.store import CandidateResult, StoreEntry, TacticStore
    from tactix import GemmProblem
    from tactix.tactics import Tactic
    store = TacticStore(sys.argv[1], environment(MeasurementPolicy())).attach()
    tactic = Tactic(backend="torch", kernel="matmul")
    # big entries make each write long enough to be interrupted part-way
    results = [CandidateResult(tactic=tactic, status="ok", median_s=1e-5, samples=1, reason="x" * 200)] * 2000
    i = 0
    print("writing", flush=True)
    while True:
        p = GemmProblem(device_type="cpu", m=i % 64 + 1, n=64, k=32, a_dtype="bfloat16", b_dtype="bfloat16",
                        out_dtype="bfloat16")
        store.put(StoreEntry(op="gemm", key=p.key(), key_hash=p.key_hash(), tactic=tactic,
                             baseline=tactic, candidates=results, env_hash=store.env_hash))
        i += 1
    """
)


@pytest.mark.parametrize("delay", [0.3, 0.55, 0.8])
def test_a_writer_killed_mid_write_leaves_no_corrupt_entry(tmp_path: Path, delay: float) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    [env_dir] = TacticStore.environments(tmp_path)
    store = TacticStore.open(env_dir)
    assert store.verify() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        store.attach()  # also removes the killed writer's temporary file
    assert len(store) >= 1
    assert list(store.path.rglob(".tmp-*")) == []
