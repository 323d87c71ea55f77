"""Rank-consistent tactics: every rank of a process group runs the tactics rank 0 chose.

NCCL collectives deadlock or corrupt data when ranks run different kernels for the same
collective-adjacent op, so a per-rank choice is never acceptable. When a store is attached with
a process group, the ranks first compare their environments (tactix and plugin versions, torch,
CUDA, cuDNN, GPU, policy): ranks that differ would tune different candidate sets and could not
share one store, so every rank raises a `DistributedError` naming the differing parts. Then rank
0's entries replace every rank's view (and are written to each rank's store), and each problem
tuned afterwards is measured on rank 0 only and broadcast. Ranks must plan the same problems in
the same order, as SPMD serving does.

Entries travel as JSON text in a uint8 tensor (no pickle); the tensor lives on the GPU for NCCL
groups and on the CPU otherwise. Every collective waits at most ``timeout``: a rank that died or
stopped answering makes the others raise a `DistributedError` that names the rank and what was
being exchanged, instead of hanging; a rank 0 whose tuning raised tells the others before it
raises itself.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import torch
import torch.distributed as dist

from tactix.autotune.store import StoreEntry, TacticStore
from tactix.errors import DistributedError

__all__ = ["all_gather_text", "broadcast_text", "check_environments", "rank", "sync_store"]


def rank(group: Any) -> int:
    return int(dist.get_rank(group))


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work: Any, group: Any, timeout: dt.timedelta | None, what: str, waiting_for: str) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses that name no rank
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        limit = f" within {timeout.total_seconds():g} s" if timeout is not None else ""
        raise DistributedError(
            f"rank {rank(group)}: {waiting_for} did not answer{limit} while exchanging {what} "
            f"(it may have died or be stuck): {type(exc).__name__}: {cause}"
        ) from exc


def broadcast_text(text: str | None, group: Any, timeout: dt.timedelta | None = None, what: str = "text") -> str:
    """Rank 0's ``text`` on every rank of ``group``; a `DistributedError` if rank 0 does not
    send it within ``timeout`` (None: the group's own timeout)."""
    device = _device(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload = (text or "").encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    peer = "rank 0" if rank(group) != 0 else "another rank"
    _wait(dist.broadcast(size, src=src, group=group, async_op=True), group, timeout, what, peer)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if rank(group) == 0:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    _wait(dist.broadcast(data, src=src, group=group, async_op=True), group, timeout, what, peer)
    return bytes(data.cpu().tolist()).decode()


def all_gather_text(text: str, group: Any, timeout: dt.timedelta | None = None, what: str = "text") -> list[str]:
    """Every rank's ``text``, in rank order, on every rank of ``group``."""
    device = _device(group)
    world = dist.get_world_size(group)
    payload = text.encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    _wait(dist.all_gather(sizes, size, group=group, async_op=True), group, timeout, what, "a rank")
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        mine[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    _wait(dist.all_gather(gathered, mine, group=group, async_op=True), group, timeout, what, "a rank")
    return [bytes(t[: int(n.item())].cpu().tolist()).decode() for t, n in zip(gathered, sizes, strict=True)]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _differences(first: dict[str, Any], other: dict[str, Any]) -> list[str]:
    a, b = _flatten(first), _flatten(other)
    missing = object()
    parts = []
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key, missing), b.get(key, missing)
        if x != y:
            shown = ["absent" if v is missing else json.dumps(v) for v in (x, y)]
            parts.append(f"{key} ({shown[0]} on rank 0, {shown[1]} here)")
    return parts


def check_environments(env: dict[str, Any], group: Any, timeout: dt.timedelta | None = None) -> None:
    """Raise a `DistributedError` on every rank if any rank's environment differs from rank 0's."""
    texts = all_gather_text(json.dumps(env, sort_keys=True), group, timeout, "environments")
    envs = [json.loads(t) for t in texts]
    lines = []
    for r, other in enumerate(envs[1:], start=1):
        diff = _differences(envs[0], other)
        if diff:
            lines.append(f"rank {r} differs from rank 0 in " + "; ".join(diff).replace(" here)", f" on rank {r})"))
    if lines:
        raise DistributedError(
            f"rank {rank(group)}: the ranks' tuning environments differ, so they cannot share tactics "
            f"(give every rank the same plugins, versions, GPU model and policy): {' | '.join(lines)}"
        )


def sync_store(store: TacticStore, group: Any, timeout: dt.timedelta | None = None) -> None:
    """Make every rank's view of ``store`` rank 0's (same entries, byte for byte)."""
    check_environments(store.env, group, timeout)
    mine = json.dumps([json.loads(e.to_json()) for e in store.entries()]) if rank(group) == 0 else None
    agreed = json.loads(broadcast_text(mine, group, timeout, "rank 0's stored entries"))
    store.adopt([StoreEntry.model_validate(e) for e in agreed])
