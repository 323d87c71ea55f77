"""Ranks that differ, die, hang or fail while tuning: every rank ends with a clear error in bounded time.

Two processes on the CPU with the gloo backend (the code path NCCL groups take too; the same
scenarios run over NCCL on two GPUs in tests/gpu/test_distributed_nccl.py). A rank that dies is
killed with SIGKILL in the middle of tuning: no cleanup of any kind runs in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

RANK = textwrap.dedent(
    """
    import json, os, signal, sys, time, warnings, torch, torch.distributed as dist, tactix
    from tactix.autotune import context
    rank, (rendezvous, root, scenario, group_backend) = int(sys.argv[1]), sys.argv[2:6]
    device, dtype = ("cuda", torch.bfloat16) if group_backend == "nccl" else ("cpu", torch.float32)
    if group_backend == "nccl":
        torch.cuda.set_device(rank)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    policy = tactix.MeasurementPolicy(warmup=1, repeat=3)
    real_tune = context.tune

    def tune(*args, **kwargs):  # rank 0's measurement of a new problem, with the scenario's failure
        if scenario == "rank0-killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "rank0-raises":
            raise RuntimeError("the candidate benchmark crashed")
        if scenario == "rank0-stuck":
            time.sleep(120)
        if scenario == "rank1-killed":
            time.sleep(3)  # rank 1 is gone by the time rank 0 answers
        return real_tune(*args, **kwargs)

    context.tune = tune
    def plan():
        d = tactix.PagedDecode("HND", device=device)
        d.plan(i32(0, 2, 4), i32(0, 1, 2, 3), i32(5, 16), 8, 2, 64, 16, q_data_type=dtype)
        return d

    if scenario == "corrupt-entry" and rank == 0:  # rank 0's entry for the problem, hand-edited
        with tactix.autotune(mode="tune", cache_dir=root, policy=policy) as state:
            plan()
            [path] = (state.store.path / "entries" / "decode").iterdir()
        entry = json.loads(path.read_text())
        entry["key"]["op"] = ["gemm"]
        path.write_text(json.dumps(entry))
    dist.init_process_group(group_backend, init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    start = time.monotonic()
    outcome = {"rank": rank}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tactix.autotune(mode="tune", cache_dir=root, policy=policy, process_group=dist.group.WORLD,
                                 timeout=8) as state:
                if scenario == "rank1-killed" and rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                outcome["tactic"] = plan().tactic.to_json()
        outcome["warnings"] = [str(w.message) for w in caught]
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    outcome["seconds"] = time.monotonic() - start
    print(json.dumps(outcome), flush=True)
    os._exit(0)  # a broken group's teardown can itself wait for the dead peer
    """
)


def run_ranks(
    tmp_path: Path, scenario: str, env1: dict[str, str] | None = None, first: int | None = None,
    group_backend: str = "gloo",
) -> list[dict[str, Any] | None]:  # fmt: skip
    """Each rank's outcome (None for a rank that printed none); with ``first``, the other rank is
    killed once rank ``first`` has finished. ``group_backend`` "nccl": rank r on GPU r."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    base = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                str(tmp_path / "rendezvous"),
                str(tmp_path / "store"),
                scenario,
                group_backend,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(base, **(env1 or {})) if r else base,
        )
        for r in range(2)
    ]
    results: dict[int, dict[str, Any] | None] = {}
    for r in [first, 1 - first] if first is not None else [0, 1]:
        p = procs[r]
        if first is not None and r != first:
            p.kill()
        out, err = p.communicate(timeout=120)  # a hang fails here, never blocks the suite
        lines = [line for line in out.strip().splitlines() if line.startswith("{")]
        results[r] = json.loads(lines[-1]) if lines else None
        if lines:
            assert p.returncode == 0, err[-3000:]
    return [results[0], results[1]]


def stored_decode_entries(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "store").rglob("entries/decode/*"))


def test_ranks_with_different_plugins_are_refused_on_every_rank_naming_the_difference(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "ok", env1={"TACTIX_DISABLE_BACKENDS": "naive"})
    assert zero is not None and one is not None
    for outcome in (zero, one):
        assert outcome["error"].startswith("DistributedError: rank "), outcome
        assert "environments differ" in outcome["error"] and "backends.naive" in outcome["error"], outcome
        assert "absent on rank 1" in outcome["error"]
    assert stored_decode_entries(tmp_path) == []


def test_rank_zero_killed_while_tuning_fails_rank_one_within_the_timeout(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "rank0-killed")
    assert zero is None  # SIGKILLed: it printed nothing
    assert one is not None and one["error"].startswith("DistributedError: rank 1: rank 0 did not answer"), one
    assert "the tuning result of decode[" in one["error"]
    assert one["seconds"] < 30
    assert stored_decode_entries(tmp_path) == [], "no rank may keep an entry for the problem being tuned"
    assert list((tmp_path / "store").rglob(".tmp-*")) == []


def test_rank_one_killed_while_rank_zero_tunes_fails_rank_zero_and_stores_nothing(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "rank1-killed")
    assert one is None
    assert zero is not None and zero["error"].startswith("DistributedError: rank 0: another rank did not answer"), zero
    assert zero["seconds"] < 30
    assert stored_decode_entries(tmp_path) == []


def test_rank_zero_stuck_in_tuning_fails_rank_one_after_the_timeout(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "rank0-stuck", first=1)
    assert zero is None  # still sleeping when killed
    assert one is not None and one["error"].startswith("DistributedError: rank 1: rank 0 did not answer within 8 s")
    assert 7 < one["seconds"] < 30, one
    assert stored_decode_entries(tmp_path) == []


def test_rank_zero_whose_tuning_raises_tells_rank_one(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "rank0-raises")
    assert zero is not None and zero["error"] == "RuntimeError: the candidate benchmark crashed", zero
    assert one is not None and one["error"].startswith("DistributedError: rank 1: rank 0 failed to tune decode["), one
    assert "the candidate benchmark crashed" in one["error"]
    assert one["seconds"] < 30 and zero["seconds"] < 30
    assert stored_decode_entries(tmp_path) == []


def test_a_corrupt_entry_on_rank_zero_is_a_warning_not_a_dead_group(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "corrupt-entry")
    assert zero is not None and one is not None
    assert "error" not in zero and "error" not in one, (zero, one)
    assert zero["tactic"] == one["tactic"]
    [warning] = [w for w in zero["warnings"] if "tactic store" in w]
    assert "entries/decode/" in warning and "malformed key" in warning and "'op'" in warning, warning
