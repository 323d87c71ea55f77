"""Rank-consistent tuning over NCCL on two GPUs: the scenarios of
tests/autotune/test_distributed_failures.py (run there over gloo on the CPU) with an NCCL group,
rank r on GPU r, bf16 plans on the GPU. Needs a machine with two GPUs (the `device` tool's
``nvidia-h200-x2``); skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.autotune.test_distributed_failures import run_ranks, stored_decode_entries

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason=f"needs two CUDA GPUs: {torch.cuda.device_count() if torch.cuda.is_available() else 0} visible here",
    ),
]


def test_both_ranks_plan_rank_zeros_tactic_and_store_the_same_entry(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "ok", group_backend="nccl")
    assert zero is not None and one is not None
    assert "error" not in zero and "error" not in one, (zero, one)
    assert zero["tactic"] == one["tactic"]
    assert len(stored_decode_entries(tmp_path)) == 1  # one shared store, one entry


def test_rank_zero_killed_while_tuning_fails_rank_one_within_the_timeout(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "rank0-killed", group_backend="nccl")
    assert zero is None
    assert one is not None and one["error"].startswith("DistributedError: rank 1: rank 0 did not answer"), one
    assert one["seconds"] < 60
    assert stored_decode_entries(tmp_path) == []
    assert list((tmp_path / "store").rglob(".tmp-*")) == []


def test_rank_one_killed_while_rank_zero_tunes_fails_rank_zero_and_stores_nothing(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "rank1-killed", group_backend="nccl")
    assert one is None
    assert zero is not None and zero["error"].startswith("DistributedError: rank 0: another rank did not answer"), zero
    assert zero["seconds"] < 60
    assert stored_decode_entries(tmp_path) == []


def test_rank_zero_whose_tuning_raises_tells_rank_one(tmp_path: Path) -> None:
    zero, one = run_ranks(tmp_path, "rank0-raises", group_backend="nccl")
    assert zero is not None and zero["error"] == "RuntimeError: the candidate benchmark crashed", zero
    assert one is not None and one["error"].startswith("DistributedError: rank 1: rank 0 failed to tune decode["), one
    assert stored_decode_entries(tmp_path) == []
