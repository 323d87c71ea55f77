"""Ranks end up with byte-identical tactics: rank 0's store wins, new problems are tuned on rank 0 only.

Two processes on the CPU with the gloo backend; the same code path serves NCCL on GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

RANK = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist, tactix
    rank, rendezvous, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    policy = tactix.MeasurementPolicy(warmup=1, repeat=3)

    def plan(lens):
        n = len(lens)
        d = tactix.PagedDecode("HND", device="cpu")
        d.plan(i32(*range(0, 2 * n + 1, 2)), i32(*range(2 * n)), i32(*lens), 8, 2, 64, 16, q_data_type=torch.float32)
        return d

    # each rank's own store already disagrees about problem X (as two machines' stores would)
    with tactix.autotune(mode="tune", cache_dir=root, policy=policy) as state:
        plan((5, 16))
        [entry] = state.store.entries()
        mine = {"kernel": "explicit"} if rank == 0 else {"kernel": "sdpa", "params": {"impl": "math"}}
        state.store.put(entry.model_copy(update={"tactic": tactix.Tactic(backend="torch", **mine)}))

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    tactix.reset_stats()
    with tactix.autotune(mode="tune", cache_dir=root, policy=policy, process_group=dist.group.WORLD) as state:
        x = plan((5, 16)).tactic.to_json()
        y = plan((16, 16, 3)).tactic.to_json()  # in nobody's store: rank 0 measures, everyone gets it
        entries = sorted(e.to_json() for e in state.store.entries())
    dist.destroy_process_group()
    print(json.dumps({"x": x, "y": y, "entries": entries, "stats": tactix.stats()}))
    """
)


def test_every_rank_runs_rank_zeros_tactics(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    rendezvous = tmp_path / "rendezvous"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(rendezvous), str(tmp_path / f"store{r}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    zero, one = results
    assert json.loads(zero["x"])["kernel"] == "explicit"  # rank 0's stored choice, not rank 1's
    assert one["x"] == zero["x"] and one["y"] == zero["y"]
    assert one["entries"] == zero["entries"] and len(zero["entries"]) == 2  # byte-identical stores
    assert zero["stats"]["tuned_problems"] == 1 and zero["stats"]["timer_calls"] > 0
    assert one["stats"]["tuned_problems"] == 0 and one["stats"]["timer_calls"] == 0
    # what rank 1 received is also on its disk, so a later single-process replay agrees too
    stored = sorted(p.read_text() for p in (tmp_path / "store1").rglob("entries/decode/*.json"))
    assert stored == zero["entries"]
