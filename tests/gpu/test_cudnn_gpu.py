"""The cudnn plugin on a GPU: GEMM, graph reuse across batches, failure policy, determinism."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import pytest
import torch

import tactix
from tactix.selection import set_tactic_source
from tactix.testing import (
    LSE_TOLERANCE,
    attention_reference,
    gemm_reference,
    lse_error,
    ragged_reference,
    relative_error,
    tolerance_for,
)

pytestmark = pytest.mark.gpu

cudnn_plugin = pytest.importorskip("tactix_cudnn.plugin", reason="plugins/cudnn is not installed")
graph_cache = pytest.importorskip("tactix_cudnn.graphs").graph_cache


@pytest.fixture(autouse=True)
def _needs_cudnn() -> None:
    reasons = tactix.get_registry().get("cudnn").environment()
    if reasons:
        pytest.skip(f"cudnn backend inactive: {reasons}")


def _batch(lens: list[int], page: int = 16, seed: int = 0, pool: int = 0) -> tuple[torch.Tensor, ...]:
    """A batch's CSR arrays over a cache of ``pool`` pages (default: its own pages + 3), in random
    order; with ``pool`` given, the last page of the pool is always one of the batch's (so every
    batch over the pool has the same container size)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    pool = pool or sum(pages) + 3
    order = torch.randperm(pool, generator=gen).tolist()
    indptr, indices = [0], []
    for n in pages:
        indices += [order.pop() for _ in range(n)]
        indptr.append(len(indices))
    if pool - 1 not in indices:
        indices[0] = pool - 1
    last = [(n - 1) % page + 1 for n in lens]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return i32(indptr), i32(indices), i32(last), torch.tensor(pool)


def test_gemm_layouts_bias_batch_and_fp8_match_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 48, 256, generator=gen).cuda()
    w = (torch.randn(3, 512, 256, generator=gen) / 16).cuda()
    bias = torch.randn(512, generator=gen).cuda().bfloat16()
    cases = {
        "bf16 A-k B-k": (x[0].bfloat16(), w[0].bfloat16().t(), {}),
        "f16 A-m B-n": (x[0].half().t().contiguous().t(), w[0].half().t().contiguous(), {}),
        "bf16 bias": (x[0].bfloat16(), w[0].bfloat16().t(), {"bias": bias}),
        "bf16 batched": (x.bfloat16(), w.bfloat16().transpose(1, 2), {}),
        "bf16 m=1": (x[0, :1].bfloat16(), w[0].bfloat16().t(), {}),
    }
    for name, (a, b, kw) in cases.items():
        out = tactix.gemm(a, b, backend="cudnn", **kw)
        ref = gemm_reference(a, b, bias=kw.get("bias"))
        assert relative_error(out, ref) < tolerance_for(out.dtype), name
    a8, b8 = x[0].to(torch.float8_e4m3fn), (w[0] * 8).to(torch.float8_e4m3fn).t()
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.125, device="cuda")
    out = tactix.gemm(a8, b8, scale_a=sa, scale_b=sb, backend="cudnn", out_dtype=torch.bfloat16)
    ref = gemm_reference(a8, b8, scale_a=sa, scale_b=sb)
    assert relative_error(out, ref) < tolerance_for(torch.bfloat16, torch.float8_e4m3fn)


def test_gemm_every_enumerated_tactic_is_correct_and_run_captures() -> None:
    g = tactix.Gemm(backend="cudnn", device="cuda")
    g.plan(64, 1024, 512, a_dtype=torch.bfloat16)
    a = torch.randn(64, 512, device="cuda").bfloat16()
    b = (torch.randn(1024, 512, device="cuda") / 20).bfloat16().t()
    ref = gemm_reference(a, b)
    problem = g._problem
    tactics = tactix.get_registry().get("cudnn").tactics(problem)
    assert len(tactics) >= 3, tactics  # default plus several engines
    for t in tactics:
        gt = tactix.Gemm(backend="cudnn", device="cuda")
        gt.plan(64, 1024, 512, a_dtype=torch.bfloat16, tactic=t)
        assert relative_error(gt.run(a, b), ref) < tolerance_for(torch.bfloat16), t
        assert t.is_default or gt.tactic == t  # the plan runs the tactic it was asked for
    out = torch.full((64, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
    g.run(a, b, out=out)
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        g.run(a, b, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, ref) < tolerance_for(torch.bfloat16)


def test_a_new_batch_of_the_same_bucket_builds_no_graph() -> None:
    wrapper = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
    indptr, indices, last, _ = _batch([900, 1000, 33, 512])
    wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    before = graph_cache.builds
    tactix.reset_stats()
    for seed, lens in enumerate(([700, 1010, 1, 600], [1024, 2, 3, 999], [513, 640, 800, 1000])):
        indptr, indices, last, _ = _batch(lens, seed=seed + 1)
        wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    assert graph_cache.builds == before and tactix.stats()["builds"] == 0
    assert tactix.stats()["plans"] == 3


def test_a_stored_tactic_that_fails_warns_once_and_serves_the_default() -> None:
    bogus = tactix.Tactic(backend="cudnn", kernel="sdpa", params={"engine": 4242, "knobs": {}})
    previous = set_tactic_source(lambda problem: bogus)
    try:
        wrapper = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
        indptr, indices, last, pages = _batch([300, 17])
        with pytest.warns(tactix.FallbackWarning, match="engine=4242"):
            wrapper.plan(indptr, indices, last, 8, 8, 64, 16, q_data_type=torch.bfloat16)
        assert wrapper.selection_source == "fallback" and wrapper.tactic.params["engine"] != 4242
        with warnings.catch_warnings():
            warnings.simplefilter("error", tactix.FallbackWarning)
            wrapper.plan(indptr, indices, last, 8, 8, 64, 16, q_data_type=torch.bfloat16)  # announced once
        k = torch.randn(int(pages), 8, 16, 64, device="cuda").bfloat16()
        v = torch.randn_like(k)
        q = torch.randn(2, 8, 64, device="cuda").bfloat16()
        ref, _ = attention_reference(q, k, v, torch.tensor([0, 1, 2], dtype=torch.int32), indptr, indices, last,
                                     kv_layout="HND", causal=False, sm_scale=1 / 8)  # fmt: skip
        assert relative_error(wrapper.run(q, (k, v)), ref) < tolerance_for(torch.bfloat16)
    finally:
        set_tactic_source(previous)
    # asked for explicitly, the failing tactic is an error: no silent substitute
    explicit = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
    with pytest.raises(tactix.BackendError, match="4242"):
        explicit.plan(indptr, indices, last, 8, 8, 64, 16, q_data_type=torch.bfloat16, tactic=bogus)


def test_decode_is_deterministic_across_identical_runs() -> None:
    lens = [int(x) for x in torch.randint(1024, 8192, (64,), generator=torch.Generator().manual_seed(5))]
    indptr, indices, last, pages = _batch(lens)
    k = torch.randn(int(pages), 8, 16, 128, device="cuda").bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(64, 32, 128, device="cuda").bfloat16()
    wrapper = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
    wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    first = wrapper.run(q, (k, v)).clone()
    for _ in range(10):
        again = wrapper.run(q, (k, v))
        assert torch.equal(again, first), f"{int((again != first).sum())} elements differ ({wrapper.tactic})"
    ref, _ = attention_reference(q, k, v, torch.arange(65, dtype=torch.int32), indptr, indices, last,
                                 kv_layout="HND", causal=False, sm_scale=1 / math.sqrt(128))  # fmt: skip
    assert relative_error(first, ref) < tolerance_for(torch.bfloat16)


def test_deterministic_false_admits_the_split_kv_decode_plan() -> None:
    indptr, indices, last, _ = _batch([8192])
    fast = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
    fast.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, deterministic=False)
    strict = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
    strict.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    assert fast.tactic.params["knobs"] == {"KERNEL_CFG": 35}  # cuDNN's first choice, split-KV
    assert strict.tactic.params["knobs"] != {"KERNEL_CFG": 35}
    split_kv = tactix.Tactic(backend="cudnn", kernel="sdpa", params={"engine": 8, "knobs": {"KERNEL_CFG": 35}})
    with pytest.raises(tactix.UnsupportedProblemError, match="not run-to-run deterministic"):
        strict.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, tactic=split_kv)


@pytest.mark.parametrize("batch_size", [4, 40], ids=["table-on-host", "table-gathered-on-device"])
def test_replans_far_ahead_of_the_gpu_keep_every_batch_metadata(batch_size: int) -> None:
    """Plans reuse the wrapper's staging (two device slots, a ring of pinned buffers): with the GPU
    held back by a long kernel, each plan's transfer waits while the next plans write theirs. Every
    run must still read its own batch's metadata, and the ring grows rather than the host waiting."""
    wrapper = tactix.PagedDecode("HND", backend="cudnn", device="cuda")
    gen = torch.Generator().manual_seed(batch_size)
    cases = []
    pool = batch_size * 2000 // 16 + 8  # one page pool: every batch has the same container size
    for seed in range(6):
        lens = torch.randint(1100, 2000, (batch_size,), generator=gen).tolist()  # one bucket: one staging
        indptr, indices, last, pages = _batch(lens, seed=seed, pool=pool)
        k = torch.randn(int(pages), 8, 16, 128, generator=gen).cuda().bfloat16()
        v = torch.randn(int(pages), 8, 16, 128, generator=gen).cuda().bfloat16()
        q = torch.randn(batch_size, 32, 128, generator=gen).cuda().bfloat16()
        cases.append((indptr, indices, last, q, k, v))
    # builds the graph and runs it once: the first launch of a kernel loads its module (CUDA's lazy
    # loading), which may wait for the whole device, so it must not happen behind the sleep
    wrapper.plan(*cases[0][:3], 32, 8, 128, 16, q_data_type=torch.bfloat16)
    wrapper.run(cases[0][3], cases[0][4:])
    torch.cuda.synchronize()
    builds = graph_cache.builds
    outs, host_us = [], []
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s on the device
    for indptr, indices, last, q, k, v in cases:
        t0 = time.perf_counter()
        wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        t1 = time.perf_counter()
        assert graph_cache.builds == builds, "a batch of the same buckets built a graph"
        outs.append(wrapper.run(q, (k, v)))
        host_us.append((round((t1 - t0) * 1e6), round((time.perf_counter() - t1) * 1e6)))
    staging = wrapper.plan_object._staging
    grew = len(staging._host)
    assert all(c[0].numel() == batch_size + 1 for c in cases)
    torch.cuda.synchronize()
    assert grew >= 3, (f"{grew} pinned buffers: plans waited for the GPU instead of growing the ring "
                       f"(host us per (plan, run): {host_us})")  # fmt: skip
    for (indptr, indices, last, q, k, v), out in zip(cases, outs, strict=True):
        qo = torch.arange(batch_size + 1, dtype=torch.int32)
        ref, _ = attention_reference(q, k, v, qo, indptr, indices, last, kv_layout="HND", causal=False,
                                     sm_scale=1 / math.sqrt(128))  # fmt: skip
        assert relative_error(out, ref) < tolerance_for(torch.bfloat16)


def _serve(wrapper: Any, captured: torch.cuda.CUDAGraph | None, q: torch.Tensor, q_static: torch.Tensor,
           out_static: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """The output for ``q``: replayed from ``captured`` (q copied into the captured buffer), or run eagerly."""
    if captured is None:
        return wrapper.run(q, cache)
    q_static.copy_(q)
    captured.replay()
    return out_static.clone()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_fast_re_plans_serve_each_batch_and_leave_the_full_path_for_a_new_bucket(op: str, graph: bool) -> None:
    """Re-plans with the same static arguments go through `CudnnAttentionPlan.replan` (the plan
    object is kept, no graph is built); each batch's output matches the float64 oracle, replayed
    from one captured CUDA graph in graph mode. A batch of another bucket is planned the full way."""
    decode = op == "decode"
    wrapper: tactix.PagedDecode | tactix.PagedPrefill = (
        tactix.PagedDecode("HND", backend="cudnn", device="cuda", use_cuda_graph=graph)
        if decode
        else tactix.PagedPrefill("HND", backend="cudnn", device="cuda", use_cuda_graph=graph)
    )
    gen = torch.Generator().manual_seed(7)
    pool = 4 * 3000 // 16 + 8  # one pool (one container size) for every batch, the longer one too
    k = torch.randn(pool, 8, 16, 128, generator=gen).cuda().bfloat16()
    v = torch.randn(pool, 8, 16, 128, generator=gen).cuda().bfloat16()
    q_rows = [1, 1, 1, 1] if decode else [5, 1, 17, 3]  # prefill: the q lengths stay in one bucket
    qo = torch.tensor([0, *torch.tensor(q_rows).cumsum(0).tolist()], dtype=torch.int32)
    rows = int(qo[-1])
    q_static = torch.zeros(rows, 32, 128, device="cuda", dtype=torch.bfloat16)
    out_static = torch.zeros(rows, 32, 128, device="cuda", dtype=torch.bfloat16)

    def plan(lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
        indptr, indices, last, _ = _batch(lens, seed=seed, pool=pool)
        if decode:
            wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)  # type: ignore[call-arg]
        else:
            wrapper.plan(qo, indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16,  # type: ignore[call-arg]
                         causal=True)  # fmt: skip
        return indptr, indices, last

    plan([900, 1000, 600, 700], 0)
    q0 = torch.randn(rows, 32, 128, generator=gen).cuda().bfloat16()
    q_static.copy_(q0)
    captured = None
    if graph:
        wrapper.run(q_static, (k, v), out=out_static)  # warm the kernels outside the capture
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            wrapper.run(q_static, (k, v), out=out_static)
    plan_object, builds = wrapper.plan_object, graph_cache.builds
    tactix.reset_stats()
    for seed, lens in enumerate(([520, 1010, 800, 640], [1024, 990, 513, 700], [900, 1000, 600, 700]), 1):
        metadata = plan(lens, seed)
        assert wrapper.plan_object is plan_object, "a re-plan of the same buckets took the full path"
        q = torch.randn(rows, 32, 128, generator=gen).cuda().bfloat16()
        out = _serve(wrapper, captured, q, q_static, out_static, (k, v))
        ref, _ = attention_reference(q, k, v, qo if not decode else torch.arange(5, dtype=torch.int32), *metadata,
                                     kv_layout="HND", causal=not decode, sm_scale=1 / math.sqrt(128))  # fmt: skip
        assert relative_error(out, ref) < tolerance_for(torch.bfloat16), f"batch {seed}"
    assert graph_cache.builds == builds and tactix.stats()["plans"] == 3 and tactix.stats()["builds"] == 0
    if not graph:  # a longer batch: another kv bucket, the full path (and another graph)
        plan([3000, 1000, 600, 700], 9)
        assert wrapper.plan_object is not plan_object


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("batch_size", [4, 40])
def test_device_page_indices_are_planned_without_a_host_read(batch_size: int, graph: bool) -> None:
    """Page indices on the device (as vLLM passes them): eager re-plans read nothing back (no host
    sync: CUDA's sync debug mode raises on one) and keep the plan object; the first batch names
    only low pages, later ones pages up to the end of a large cache, so run() must widen the
    graph's container to the cache. In CUDA-graph mode each plan reads the largest index (the
    captured graph's container cannot grow) and the replays serve every batch."""
    wrapper = tactix.PagedDecode("HND", backend="cudnn", device="cuda", use_cuda_graph=graph)
    gen = torch.Generator().manual_seed(batch_size)
    pool = batch_size * 1100 // 16 + 4000  # a cache far larger than any one batch's pages
    k = torch.randn(pool, 8, 16, 128, generator=gen).cuda().bfloat16()
    v = torch.randn(pool, 8, 16, 128, generator=gen).cuda().bfloat16()
    q_static = torch.zeros(batch_size, 32, 128, device="cuda", dtype=torch.bfloat16)
    out_static = torch.zeros_like(q_static)

    def batch(seed: int, low: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lens = torch.randint(600, 1000, (batch_size,), generator=gen).tolist()  # one kv bucket
        pages = [-(-n // 16) for n in lens]
        space = 64 * batch_size + 8 if low else pool  # low: one container bucket for every batch
        chosen = torch.randperm(space, generator=torch.Generator().manual_seed(seed))[: sum(pages)]
        chosen[0] = space - 1  # (high: the cache's last page)
        indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        last = torch.tensor([(n - 1) % 16 + 1 for n in lens], dtype=torch.int32)
        return indptr, chosen.to(torch.int32), last

    first = batch(0, low=True)
    wrapper.plan(first[0], first[1].cuda(), first[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)
    q_static.copy_(torch.randn(batch_size, 32, 128, generator=gen).bfloat16())
    captured = None
    wrapper.run(q_static, (k, v), out=out_static)  # warm-up (and in graph mode: before the capture)
    torch.cuda.synchronize()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            wrapper.run(q_static, (k, v), out=out_static)
    plan_object = wrapper.plan_object
    for seed in range(1, 4):
        indptr, indices, last = batch(seed, low=graph)  # graph mode: within the captured container
        device_indices = indices.cuda()
        q = torch.randn(batch_size, 32, 128, generator=gen).cuda().bfloat16()
        torch.cuda.synchronize()
        if not graph:
            torch.cuda.set_sync_debug_mode("error")
        try:
            wrapper.plan(indptr, device_indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
            out = _serve(wrapper, captured, q, q_static, out_static, (k, v))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if not graph:
            assert wrapper.plan_object is plan_object, "an eager re-plan with device indices took the full path"
        ref, _ = attention_reference(q, k, v, torch.arange(batch_size + 1, dtype=torch.int32), indptr, indices, last,
                                     kv_layout="HND", causal=False, sm_scale=1 / math.sqrt(128))  # fmt: skip
        assert relative_error(out, ref) < tolerance_for(torch.bfloat16), f"batch {seed}"


@pytest.mark.parametrize("planned", [True, False], ids=["run_extras", "first_run"])
def test_prefill_sinks_match_the_oracle_for_one_row_requests_and_replay_new_sinks(planned: bool) -> None:
    """cuDNN's sink_token serves prefill sinks, also for a batch of one query row per request
    (cuDNN has no engine for one row with sinks: the graph takes two, the padding mask leaves the
    second untouched). Planned with ``run_extras=("sinks",)`` the graph is built in plan and a
    captured CUDA graph replays with the sink values of the moment; otherwise the first run with
    sinks builds it."""
    gen = torch.Generator().manual_seed(11)
    lens = [300, 47, 129]
    indptr, indices, last, pool = _batch(lens, seed=3)
    k = torch.randn(int(pool), 8, 16, 128, generator=gen).cuda().bfloat16()
    v = torch.randn(int(pool), 8, 16, 128, generator=gen).cuda().bfloat16()
    for q_rows, window in (([1, 1, 1], -1), ([7, 1, 33], 63)):
        qo = torch.tensor([0, *torch.tensor(q_rows).cumsum(0).tolist()], dtype=torch.int32)
        wrapper = tactix.PagedPrefill("HND", backend="cudnn", device="cuda", use_cuda_graph=planned,
                                      run_extras=("sinks",) if planned else ())  # fmt: skip
        wrapper.plan(qo, indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, causal=True,
                     window_left=window)  # fmt: skip
        q = torch.randn(int(qo[-1]), 32, 128, generator=gen).cuda().bfloat16()
        out = torch.full_like(q, float("nan"))
        sinks = (torch.rand(32, generator=gen) * 7 - 1).cuda()  # as the kit's: negligible to most of a row
        if planned:
            wrapper.run(q, (k, v), out=out, sinks=sinks)  # warm outside the capture
            torch.cuda.synchronize()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                wrapper.run(q, (k, v), out=out, sinks=sinks)
            sinks.copy_((torch.rand(32, generator=gen) * 7 - 1).cuda())
            out.fill_(float("nan"))
            captured.replay()
        else:
            wrapper.run(q, (k, v), out=out, sinks=sinks)
        torch.cuda.synchronize()
        assert wrapper.plan_object.tactic.backend == "cudnn"
        ref, _ = attention_reference(q, k, v, qo, indptr, indices, last, kv_layout="HND", causal=True,
                                     sm_scale=1 / math.sqrt(128), window_left=window, sinks=sinks)  # fmt: skip
        plain, _ = attention_reference(q, k, v, qo, indptr, indices, last, kv_layout="HND", causal=True,
                                       sm_scale=1 / math.sqrt(128), window_left=window)  # fmt: skip
        assert relative_error(out, ref) < tolerance_for(torch.bfloat16), (q_rows, window)
        assert relative_error(plain, ref) > 5 * tolerance_for(torch.bfloat16)  # the sinks changed the result


def _csr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_ragged_prefill_deepseek_dims_from_fused_views_with_lse_and_same_bucket_re_plans(graph: bool) -> None:
    """Ragged-KV prefill through cuDNN's packed K/V (no page table): DeepSeek's 192/128 head dims,
    keys and values as strided views of one fused tensor, a request with neither queries nor keys,
    the LSE; a re-plan of a batch of the same buckets keeps the plan and its graph (and, in
    CUDA-graph mode, the captured graph's addresses: a replay serves the new batch)."""
    gen = torch.Generator().manual_seed(5)
    wrapper = tactix.RaggedPrefill(backend="cudnn", device="cuda", use_cuda_graph=graph)
    # the same totals (342 query rows, 464 keys) and buckets, other lengths
    batches = [([37, 0, 300, 5], [100, 0, 300, 64]), ([20, 3, 260, 59], [70, 9, 320, 65])]
    fused = torch.randn(464, 4, 192 + 128, generator=gen).cuda().bfloat16()
    k, v = fused[:, :, :192], fused[:, :, 192:]
    assert not k.is_contiguous() and not v.is_contiguous()
    q = torch.empty(342, 16, 192, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(342, 16, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(342, 16, device="cuda")
    plans, captured = [], None
    for i, (q_lens, kv_lens) in enumerate(batches):
        qo, kv = _csr(q_lens), _csr(kv_lens)
        wrapper.plan(qo, kv, 16, 4, 192, 128, causal=True, q_data_type=torch.bfloat16, return_lse=True)
        plans.append(wrapper.plan_object)
        q.copy_(torch.randn(342, 16, 192, generator=gen))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if not graph:
            wrapper.run(q, k, v, out=out, lse=lse)
        elif captured is None:  # warm, then capture the first batch; the second batch replays it
            wrapper.run(q, k, v, out=out, lse=lse)
            torch.cuda.synchronize()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                wrapper.run(q, k, v, out=out, lse=lse)
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            captured.replay()
        else:
            captured.replay()
        torch.cuda.synchronize()
        ref, ref_lse = ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=1 / math.sqrt(192))
        assert wrapper.plan_object.tactic.backend == "cudnn"
        assert relative_error(out, ref) < tolerance_for(torch.bfloat16), f"batch {i}"
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"], f"batch {i}"
    assert plans[0] is plans[1]  # the same buckets: the fast re-plan kept the plan (and its graph)
