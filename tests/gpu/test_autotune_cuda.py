"""Tuning on a GPU: candidates timed from CUDA-graph replays, the winner correct, replay without timing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tactix
from tactix.autotune.store import TacticStore
from tactix.testing import attention_reference, relative_error, tolerance_for

pytestmark = pytest.mark.gpu


def test_tune_on_the_gpu_times_graph_replays_and_serves_a_correct_winner(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    lens = [700, 1500, 64, 2048]
    pages = [-(-n // 16) for n in lens]
    order = torch.randperm(sum(pages), generator=gen).tolist()
    indptr, indices = [0], []
    for n in pages:
        indices += [order.pop() for _ in range(n)]
        indptr.append(len(indices))
    last = [(n - 1) % 16 + 1 for n in lens]
    k = torch.randn(sum(pages), 8, 16, 128, generator=gen).cuda().bfloat16()
    v = torch.randn(sum(pages), 8, 16, 128, generator=gen).cuda().bfloat16()
    q = torch.randn(4, 32, 128, generator=gen).cuda().bfloat16()
    policy = tactix.MeasurementPolicy(warmup=1, repeat=5)
    tactix.reset_stats()
    with tactix.autotune(mode="tune", cache_dir=tmp_path, policy=policy):
        wrapper = tactix.PagedDecode("HND", device="cuda")
        wrapper.plan(i32(*indptr), i32(*indices), i32(*last), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    [env_dir] = TacticStore.environments(tmp_path)
    [entry] = TacticStore.open(env_dir).attach().entries()
    timed = [c for c in entry.candidates if c.status == "ok"]
    assert len(timed) >= 2 and all(c.timed_as == "cuda_graph" for c in timed)
    ref, _ = attention_reference(q, k, v, i32(0, 1, 2, 3, 4), i32(*indptr), i32(*indices), i32(*last),
                                 kv_layout="HND", causal=False, sm_scale=1 / math.sqrt(128))  # fmt: skip
    assert relative_error(wrapper.run(q, (k, v)), ref) < tolerance_for(torch.bfloat16)
    tactix.reset_stats()
    with tactix.autotune(mode="replay", cache_dir=tmp_path, policy=policy):
        again = tactix.PagedDecode("HND", device="cuda")
        again.plan(i32(*indptr), i32(*indices), i32(*last), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    assert again.tactic == wrapper.tactic and tactix.stats()["timer_calls"] == 0
    # the final round: the fastest candidates and the untuned choice were timed again against each
    # other, six rounds of max(3, ceil(5 / 6)) = 3 calls each, their pooled samples in the entry
    baseline = next(c for c in timed if c.tactic == entry.baseline)
    finalists = sum(c.samples == 6 * 3 for c in timed)
    assert baseline.samples == 6 * 3
    assert finalists == len(timed) if len(timed) <= 3 else finalists in (3, 4)  # (the baseline may be a top 3)


def test_interleaved_timing_on_the_gpu_replays_graphs_and_reports_a_failing_call() -> None:
    """`timing.interleaved` times graph replays of each call in alternating blocks (each call's
    samples, in seconds, from every round) and gives None for a call that raises."""
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.autotune.timing import interleaved

    cuda = torch.device("cuda")
    a, b = torch.randn(2048, 2048, device=cuda), torch.randn(4096, 4096, device=cuda)
    out_a, out_b = torch.empty_like(a), torch.empty_like(b)
    ran: list[str] = []

    def small() -> None:
        torch.mm(a, a, out=out_a)

    def large() -> None:
        torch.mm(b, b, out=out_b)

    def broken() -> None:
        ran.append("broken")
        raise RuntimeError("gone")

    policy = MeasurementPolicy(warmup=1, repeat=12)
    got = interleaved([small, large, broken], cuda, policy, rounds=4)
    small_s, large_s = got[0], got[1]
    assert got[2] is None and ran  # (it raised while being captured or timed)
    assert small_s is not None and large_s is not None and len(small_s) == len(large_s) == 4 * 3
    # 8x the work: the larger product takes longer in every round
    assert min(large_s) > max(small_s)
    torch.testing.assert_close(out_b, b @ b, rtol=1e-3, atol=1e-2)  # (the replays computed the product)


def test_gpu_timing_repeats_blocks_until_the_times_settle() -> None:
    """On a GPU the timer takes at least two blocks (a single block cannot tell a slow phase after
    freed memory from steady times) and at most ``settle_blocks``, keeping the last block's
    samples."""
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.autotune.timing import measure_with_policy

    cuda = torch.device("cuda")
    a = torch.randn(4096, 4096, device=cuda)
    big = torch.empty(2 * 2**30, dtype=torch.uint8, device=cuda).fill_(1)
    del big
    torch.cuda.empty_cache()  # memory back to the driver: kernels run slower for a while
    policy = MeasurementPolicy(repeat=15, settle_blocks=4)
    timing = measure_with_policy(lambda: torch.mm(a, a), cuda, policy)
    assert 2 <= timing.blocks <= 4 and len(timing.samples) == 15
    assert timing.timed_as == "cuda_graph"


def test_gpu_warmup_keeps_the_device_busy_for_warmup_ms() -> None:
    """The time-based warm-up makes about ``warmup_ms`` of calls (judged by the first call's time)
    before the counted warm-up and the timed blocks."""
    from tactix.autotune.policy import MeasurementPolicy
    from tactix.autotune.timing import measure_with_policy

    cuda = torch.device("cuda")
    a = torch.randn(4096, 4096, device=cuda)
    torch.mm(a, a)  # the library's first-call set-up, outside what is counted
    torch.cuda.synchronize()
    calls = []

    def fn() -> None:
        calls.append(1)
        torch.mm(a, a)

    policy = MeasurementPolicy(warmup=0, repeat=5, settle_blocks=1, warmup_ms=20, execution="eager", cold_l2=False)
    timing = measure_with_policy(fn, cuda, policy)
    warm = len(calls) - 5
    assert warm >= 2 and abs(warm * timing.median - 0.020) < 0.010, (warm, timing.median)
