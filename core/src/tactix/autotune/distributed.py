"""Rank-consistent tactics: every rank of a process group runs the tactics rank 0 chose.

NCCL collectives deadlock or corrupt data when ranks run different kernels for the same
collective-adjacent op, so a per-rank choice is never acceptable. When a store is attached with
a process group, rank 0's entries replace every rank's view (and are written to each rank's
store), and each problem tuned afterwards is measured on rank 0 only and broadcast. Ranks must
plan the same problems in the same order, as SPMD serving does. Entries travel as JSON text in a
uint8 tensor (no pickle); the tensor lives on the GPU for NCCL groups and on the CPU otherwise.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from tactix.autotune.store import StoreEntry, TacticStore

__all__ = ["broadcast_text", "rank", "sync_store"]


def rank(group: Any) -> int:
    return int(dist.get_rank(group))


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_text(text: str | None, group: Any) -> str:
    """Rank 0's ``text`` on every rank of ``group``."""
    device = _device(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload = (text or "").encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if rank(group) == 0:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=src, group=group)
    return bytes(data.cpu().tolist()).decode()


def sync_store(store: TacticStore, group: Any) -> None:
    """Make every rank's view of ``store`` rank 0's (same entries, byte for byte)."""
    mine = json.dumps([json.loads(e.to_json()) for e in store.entries()]) if rank(group) == 0 else None
    agreed = json.loads(broadcast_text(mine, group))
    store.adopt([StoreEntry.model_validate(e) for e in agreed])
