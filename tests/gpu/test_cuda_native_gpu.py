"""The cuda_native plugin on a GPU: prefill, decode and skinny GEMM against the float64 oracle,
split-KV and split-K paths, every tactic, CUDA-graph capture/replay and re-plan, no host sync in run(),
and re-plans far ahead of the GPU (the wrapper's staging slots and pinned buffers).

Run on the H200:  .venv/bin/python -m pytest tests/gpu/test_cuda_native_gpu.py -v
Each failure message names the case (dims, page size, layout, GQA, lengths, tactic) and the
relative error, so a wrong fragment layout or index shows up as a pattern across cases.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tactix
from tactix.testing import (
    LSE_TOLERANCE,
    attention_reference,
    cases,
    gemm_reference,
    lse_error,
    ragged_reference,
    relative_error,
    tolerance_for,
)
from tactix.testing.oracle import attention_lse_tolerance, attention_tolerance

pytestmark = pytest.mark.gpu

decode = pytest.importorskip("tactix_cuda_native.decode", reason="plugins/cuda_native is not installed")
device = pytest.importorskip("tactix_cuda_native.device")
prefill = pytest.importorskip("tactix_cuda_native.prefill")

CUDA = torch.device("cuda")


def captured(run: Any) -> torch.cuda.CUDAGraph:
    """``run`` once on a side stream (CUDA graphs capture warmed-up work), then captured in a graph."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


OUTSIDE = 1000.0  # written to every cache slot outside the batch: reading one spoils the result


@pytest.fixture(autouse=True)
def _needs_backend() -> None:
    reasons = tactix.get_registry().get("cuda_native").environment()
    if reasons:
        pytest.skip(f"cuda_native backend inactive: {reasons}")


class Case:
    """A decode batch in a paged cache (shuffled pages among spare ones, poisoned outside slots)."""

    def __init__(self, lens: list[int], *, page: int = 16, hq: int = 32, hkv: int = 8, d: int = 128,
                 layout: str = "HND", dtype: torch.dtype = torch.bfloat16, seed: int = 0, five_d: bool = False,
                 q_view: bool = False, poison: float = OUTSIDE) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.page, self.hq, self.hkv, self.d, self.layout, self.dtype = lens, page, hq, hkv, d, layout, dtype
        pages = [-(-n // page) for n in lens]
        total = sum(pages) + 5
        order = torch.randperm(total, generator=gen).tolist()
        indptr, indices = [0], []
        outside = torch.ones(total, page, dtype=torch.bool)
        for n, count in zip(lens, pages, strict=True):
            mine = [order.pop() for _ in range(count)]
            for i, p in enumerate(mine):
                outside[p, : min(page, n - i * page)] = False
            indices += mine
            indptr.append(len(indices))
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        self.indptr, self.indices, self.last = i32(indptr), i32(indices), i32([(n - 1) % page + 1 for n in lens])
        shape = (total, page, hkv, d) if layout == "NHD" else (total, hkv, page, d)
        mask = outside[:, :, None, None] if layout == "NHD" else outside[:, None, :, None]

        def cache() -> torch.Tensor:
            x = torch.randn(shape, generator=gen)
            return torch.where(mask, torch.where(x >= 0, poison, -poison), x).to(CUDA, dtype)

        k, v = cache(), cache()
        if five_d:
            self.cache: Any = torch.stack([k, v], dim=1)
            self.k, self.v = self.cache[:, 0], self.cache[:, 1]
        else:
            self.k, self.v = k, v
            self.cache = (k, v)
        q = torch.randn(len(lens), hq, d, generator=gen).to(CUDA, dtype)
        if q_view:  # q as the first columns of a fused QKV projection output
            fused = torch.zeros(len(lens), (hq + 2 * hkv) * d, device=CUDA, dtype=dtype)
            self.q = fused[:, : hq * d].view(len(lens), hq, d)
            self.q.copy_(q)
        else:
            self.q = q

    def reference(self, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        qo = torch.arange(len(self.lens) + 1, dtype=torch.int32)
        scale = kw.get("sm_scale", 1 / math.sqrt(self.d))
        return attention_reference(self.q, self.k, self.v, qo, self.indptr, self.indices, self.last,
                                   kv_layout=self.layout, causal=False, sm_scale=scale,
                                   window_left=kw.get("window_left", -1),
                                   logits_soft_cap=kw.get("logits_soft_cap") or 0.0)  # fmt: skip

    def wrapper(self, graph: bool = False) -> tactix.PagedDecode:
        return tactix.PagedDecode(self.layout, backend="cuda_native", device=CUDA, use_cuda_graph=graph)  # type: ignore[arg-type]

    def plan(self, w: tactix.PagedDecode, **kw: Any) -> None:
        w.plan(self.indptr, self.indices, self.last, self.hq, self.hkv, self.d, self.page, q_data_type=self.dtype, **kw)

    def check(self, w: tactix.PagedDecode, what: str, **kw: Any) -> None:
        """Run with NaN-poisoned outputs and compare out (and lse) with the oracle."""
        out = torch.full((len(self.lens), self.hq, self.d), float("nan"), device=CUDA, dtype=self.dtype)
        want_lse = kw.get("return_lse", False)
        lse = torch.full((len(self.lens), self.hq), float("nan"), device=CUDA) if want_lse else None
        w.run(self.q, self.cache, out=out, lse=lse)
        torch.cuda.synchronize()
        ref, ref_lse = self.reference(**kw)
        name = (f"{what}: d{self.d} p{self.page} {self.layout} h{self.hq}/{self.hkv} {str(self.dtype)[6:]} "
                f"lens {self.lens[:6]}{'...' if len(self.lens) > 6 else ''} tactic {w.tactic}")  # fmt: skip
        assert not torch.isnan(out).any(), f"{name}: {int(torch.isnan(out).sum())} output elements unwritten"
        err = relative_error(out, ref)
        assert err <= tolerance_for(self.dtype), f"{name}: relative error {err:.3e}"
        if want_lse:
            assert lse is not None
            assert not torch.isnan(lse).any(), f"{name}: {int(torch.isnan(lse).sum())} LSE elements unwritten"
            lerr = lse_error(lse, ref_lse)
            assert lerr <= LSE_TOLERANCE[str(self.dtype)[6:]], f"{name}: LSE error {lerr:.3e} (natural log expected)"


RAGGED = [1, 15, 16, 17, 100, 513, 2048 + 7]  # length 1, around a page, not multiples of the page size


# -- decode correctness ----------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
def test_decode_matches_oracle(d: int, page: int, layout: str, heads: tuple[int, int]) -> None:
    case = Case(RAGGED, page=page, hq=heads[0], hkv=heads[1], d=d, layout=layout, seed=d + page)
    w = case.wrapper()
    case.plan(w, return_lse=True)
    assert w.backend == "cuda_native"
    case.check(w, "decode", return_lse=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "features",
    [
        {"window_left": 0},
        {"window_left": 64},
        {"window_left": 1000},
        {"logits_soft_cap": 30.0},
        {"logits_soft_cap": 5.0, "window_left": 100},
        {"sm_scale": 0.3},
    ],
    ids=["win0", "win64", "win1000", "cap30", "cap5-win100", "scale0.3"],
)
def test_decode_window_softcap_scale_and_lse(dtype: torch.dtype, features: dict[str, Any]) -> None:
    case = Case(RAGGED, dtype=dtype, layout="NHD", seed=3)
    w = case.wrapper()
    case.plan(w, return_lse=True, **features)
    case.check(w, f"decode {features}", return_lse=True, **features)


def test_decode_fp16_every_head_dim_and_page_size_one() -> None:
    for d in (64, 128, 256):
        case = Case(RAGGED, page=1, d=d, dtype=torch.float16, seed=d)
        w = case.wrapper()
        case.plan(w)
        case.check(w, "fp16")


def test_decode_5d_cache_and_strided_q() -> None:
    for layout in ("NHD", "HND"):
        case = Case(RAGGED, layout=layout, five_d=True, q_view=True, seed=5)
        w = case.wrapper()
        case.plan(w, return_lse=True)
        case.check(w, "5-D cache + QKV view of q", return_lse=True)


@pytest.mark.parametrize("heads", [(32, 1), (64, 2), (24, 8), (40, 2)], ids=["gqa32", "gqa32b", "gqa3", "gqa20"])
def test_decode_gqa_ratios_beyond_one_tile(heads: tuple[int, int]) -> None:
    """Groups above 16 query heads take several q tiles per KV head; odd ratios pad the tile."""
    case = Case([1, 77, 300], hq=heads[0], hkv=heads[1], seed=7)
    w = case.wrapper()
    case.plan(w, return_lse=True)
    case.check(w, "large GQA", return_lse=True)


def test_decode_splits_and_merges_long_requests() -> None:
    # D2-like: one request of 8192 keys; the default splits it (and merges) so the GPU is full
    case = Case([8192], seed=11)
    w = case.wrapper()
    case.plan(w, return_lse=True)
    plan = w.plan_object
    assert plan.work.needs_merge and len(plan.work.items) >= 16, plan.work.splits
    case.check(w, "D2 shape (split)", return_lse=True)
    # a batch where some requests split into many pieces and others stay whole
    case = Case([1, 5, 32768, 300, 4097, 16], seed=12)
    for chunk in (64, 256, 0):
        w = case.wrapper()
        tactic = {"backend": "cuda_native", "kernel": "decode", "params": {"tile": 64, "warps": 4, "stages": 3,
                                                                              "kv_chunk": chunk}}  # fmt: skip
        if chunk == 0:
            case.plan(w, return_lse=True)
        else:
            case.plan(w, return_lse=True, tactic=tactic)
            assert w.plan_object.work.slots > 100
        case.check(w, f"many splits (kv_chunk {chunk})", return_lse=True)
        case.check(w, f"many splits (kv_chunk {chunk}), without lse")


def test_decode_large_batch_and_replan_on_one_wrapper() -> None:
    torch.manual_seed(0)
    lens = torch.randint(1024, 8192, (64,)).tolist()  # D1's lengths
    case = Case(lens, seed=13)
    w = case.wrapper()
    case.plan(w)
    case.check(w, "D1 shape")
    other = Case([3, 4000, 17], seed=14)
    other.plan(w)
    other.check(w, "re-planned")


def _device_records(plan: Any) -> tuple[list[int], int]:
    """The work records and their count that the device plan (kernels/decode_plan.cu) wrote into
    the plan's staging slot, read back (the records section starts the slot)."""
    staging = plan._staging
    torch.cuda.synchronize()
    slot = staging._dev_ptr.index(plan._ptrs[0])
    packed = staging._dev[slot]
    count = int(packed[(plan._ptrs[1] - plan._ptrs[0]) // 4])
    return packed[: decode.DECODE_ITEM_INTS * count].tolist(), count


@pytest.mark.parametrize("path", ["driver", "cuda.core", "driver refuses"])
def test_the_device_plans_kernel_writes_the_host_records_through_either_launch_path(
    path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The device plan's kernel is launched through the driver (`tactix.cudadrv`) with
    TACTIX_CUDA_NATIVE_DRIVER_LAUNCH=1, through cuda.core with 0, and through cuda.core from then
    on after a launch the driver refuses: each way it writes the host's records and the batch runs."""
    key = (0, device.device_info(0).arch)
    monkeypatch.setattr(decode, "_plan_launchers", {})
    monkeypatch.setenv(decode.DRIVER_LAUNCH_ENV, "0" if path == "cuda.core" else "1")
    lens = torch.randint(1024, 8192, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    case = Case(lens, seed=21)
    w = case.wrapper()
    if path == "driver refuses":

        def refused(*args: Any, **kwargs: Any) -> None:
            raise tactix.TactixError("tactix: the CUDA driver's cuLaunchKernel failed: refused for the test")

        decode._plan_launchers[key] = refused
    with caplog.at_level("WARNING", logger="tactix"):
        case.plan(w)
    plan = w.plan_object
    assert plan.planned_on_device
    assert (decode._plan_launchers[key] is not None) == (path == "driver")
    assert ("through cuda.core from now on" in caplog.text) == (path == "driver refuses")
    records, count = _device_records(plan)
    assert count == len(plan.work.items) and records == decode.decode_items(plan.work, case.indptr.tolist())
    case.check(w, f"device plan launched through {path}")


def test_decode_cuts_a_short_last_wave_of_whole_requests() -> None:
    """200 requests of 1024 keys x 8 KV heads are 4 waves of 396 CTAs (3 an SM) and 16 more: the
    requests of that last wave are cut into pieces (decode.decode_balance_tail) and merged. The
    device plan makes that list: the records it wrote are the host's (`decode_items`), and the
    grid it launches in holds them (the idle CTAs past the count exit)."""
    case = Case([1024] * 200, seed=19)
    w = case.wrapper()
    case.plan(w, return_lse=True)
    plan = w.plan_object
    slots = plan.ctas_per_sm * device.device_info(0).sms
    assert plan.chunk == 1024 and plan.planned_on_device
    if 0 < 1600 % slots <= slots // 2:  # the H200 and the H100: 1600 % 396 = 16
        assert plan.work.needs_merge and len(plan.work.items) > 200, plan.work.splits[-4:]
    records, count = _device_records(plan)
    assert count == len(plan.work.items) and records == decode.decode_items(plan.work, case.indptr.tolist())
    assert plan._geometry[5] >= count  # the grid's items (decode.decode_bounds)
    case.check(w, "last wave cut", return_lse=True)
    # D1's ragged lengths, some split: the same records on the device as on the host
    lens = torch.randint(1024, 8192, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    ragged = Case(lens, seed=20)
    ragged.plan(w)
    records, count = _device_records(w.plan_object)
    assert records == decode.decode_items(w.plan_object.work, ragged.indptr.tolist())
    ragged.check(w, "D1 lengths, device list")


def test_every_enumerated_decode_tactic() -> None:
    for d in (64, 128, 256):
        case = Case(RAGGED, d=d, seed=17)
        backend = tactix.get_registry().get("cuda_native")
        probe = case.wrapper()
        case.plan(probe)
        tactics = [t for t in backend.tactics(probe.problem) if not t.is_default]
        assert tactics
        for tactic in tactics:
            w = case.wrapper()
            case.plan(w, tactic=tactic, return_lse=True)
            assert w.tactic == tactic
            case.check(w, f"tactic {tactic}", return_lse=True)


def _bulk(tile: int, warps: int, stages: int, bulk: int, l2: int = 0, kv_chunk: int = 0,
          tma: int = 0) -> dict[str, Any]:  # fmt: skip
    params = {"tile": tile, "warps": warps, "stages": stages, "kv_chunk": kv_chunk, "l2": l2, "bulk": bulk}
    if tma:
        params["tma"] = tma
    return {"backend": "cuda_native", "kernel": "decode", "params": params}


@pytest.mark.parametrize("tma", [0, 1], ids=["linear", "tensor-maps"])
@pytest.mark.parametrize("page", [8, 16, 32, 128])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bulk_copy_decode_pages_windows_splits_and_nan_outside(page: int, d: int, tma: int) -> None:
    """The bulk-copy tactics (HND), linear or through tensor maps: whole segments are copied, so
    keys before a window's first key and past a request's last one land in shared memory; NaN
    there (slots outside the batch) must not reach the output. Ragged lengths, unaligned windows,
    forced splits, GQA 1/4/20, soft-cap."""
    if not device.arch_at_least(device.device_info(0).arch, 90):
        pytest.skip("bulk copies need sm_90")
    lens = [1, 7, 8, 9, 15, 16, 17, 100, 513, 2048 + 7]
    for i, (heads, feats, tactic) in enumerate([
        ((32, 8), {}, _bulk(64, 4, 2, 16, tma=tma)),
        ((32, 8), {"window_left": 100}, _bulk(64, 4, 2, 8, l2=1, tma=tma)),
        ((8, 8), {"window_left": 1000, "logits_soft_cap": 20.0}, _bulk(64, 4, 3, 16, kv_chunk=64, tma=tma)),
        ((40, 2), {"window_left": 37}, _bulk(32, 2, 2, 8, kv_chunk=128, tma=tma)),
        ((32, 4), {"sm_scale": 0.2}, _bulk(128, 8, 2, 32 if page >= 32 else 16, kv_chunk=256, tma=tma)),
    ]):  # fmt: skip
        bulk = tactic["params"]["bulk"]
        if page % bulk or (d == 256 and tactic["params"]["tile"] == 128):
            continue
        case = Case(lens, page=page, hq=heads[0], hkv=heads[1], d=d, seed=100 + i, poison=float("nan"))
        w = case.wrapper()
        case.plan(w, tactic=tactic, return_lse=True, **feats)
        assert w.tactic.params["bulk"] == bulk and w.tactic.params.get("tma", 0) == tma
        case.check(w, f"bulk {feats} tma {tma}", return_lse=True, **feats)


def test_bulk_copy_decode_refuses_nhd_odd_pages_and_rows_not_contiguous() -> None:
    backend = tactix.get_registry().get("cuda_native")
    nhd = Case([40, 3], layout="NHD", seed=31)
    w = nhd.wrapper()
    with pytest.raises(tactix.TactixError, match="HND"):
        nhd.plan(w, tactic=_bulk(64, 4, 2, 16))
    small = Case([40, 3], page=4, seed=32)
    w = small.wrapper()
    with pytest.raises(tactix.TactixError, match="multiple"):
        small.plan(w, tactic=_bulk(64, 4, 2, 8))
    # the tuner is never offered a bulk tactic the problem cannot take
    small.plan(w)
    assert not [t for t in backend.tactics(w.problem) if t.params.get("bulk")]
    case = Case([40, 3], seed=33)
    w = case.wrapper()
    case.plan(w, tactic=_bulk(64, 4, 2, 16))
    # rows 16 elements apart in a wider buffer: the cp.async path reads them, bulk copies cannot
    wide = [torch.zeros(*t.shape[:3], t.shape[3] + 16, device=CUDA, dtype=t.dtype) for t in (case.k, case.v)]
    for t, src in zip(wide, (case.k, case.v), strict=True):
        t[..., : case.d].copy_(src)
    with pytest.raises(tactix.InvalidArgumentError, match="token stride"):
        w.run(case.q, (wide[0][..., : case.d], wide[1][..., : case.d]))
    # tensor maps take any 16-byte strides: the same padded cache reads right
    case.plan(w, tactic=_bulk(64, 4, 2, 16, tma=1))
    out = w.run(case.q, (wide[0][..., : case.d], wide[1][..., : case.d]))
    ref, _ = case.reference()
    assert relative_error(out, ref) <= tolerance_for(case.dtype)


def test_tma_decode_replans_share_the_cache_maps_and_replay_in_a_cuda_graph() -> None:
    """A tensor-map decode plan encodes one map per cache tensor on its first run; a re-plan (a
    server's every step) keeps them, and a CUDA graph replays them with new queries."""
    case = Case([40, 300, 7, 2048], seed=41)
    w = case.wrapper()
    case.plan(w, tactic=_bulk(64, 4, 2, 16, tma=1))
    case.check(w, "first plan")
    maps = w.plan_object._maps
    assert len(maps) == 2
    case.plan(w, tactic=_bulk(64, 4, 2, 16, tma=1))
    case.check(w, "re-plan")
    assert w.plan_object._maps is maps and len(maps) == 2
    g = case.wrapper(graph=True)
    case.plan(g, tactic=_bulk(64, 4, 2, 16, tma=1))
    out = torch.empty(len(case.lens), case.hq, case.d, device=CUDA, dtype=case.dtype)
    g.run(case.q, case.cache, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.run(case.q, case.cache, out=out)
    case.q.copy_(torch.randn_like(case.q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, case.reference()[0]) <= tolerance_for(case.dtype)


def test_decode_run_does_not_sync_and_replays_in_a_cuda_graph() -> None:
    case = Case([1, 300, 5000, 17], seed=19)
    w = case.wrapper(graph=True)
    case.plan(w, return_lse=True)
    out = torch.empty(len(case.lens), case.hq, case.d, device=CUDA, dtype=case.dtype)
    lse = torch.empty(len(case.lens), case.hq, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.run(case.q, case.cache, out=out, lse=lse)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = captured(lambda: w.run(case.q, case.cache, out=out, lse=lse))
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        case.q.copy_(torch.randn(case.q.shape, generator=gen).to(CUDA, case.dtype))
        live = case.k.clone()
        case.k.copy_(
            torch.where(case.k.abs() >= OUTSIDE, case.k, torch.randn(case.k.shape, generator=gen).to(CUDA, case.dtype))
        )
        assert not torch.equal(live, case.k)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = case.reference()
        assert relative_error(out, ref) <= tolerance_for(case.dtype), "graph replay with new data"
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"]
    # re-plan the same wrapper for another batch of the same size and length bucket (pages drawn
    # from the same cache): the captured graph must read the new batch
    gen = torch.Generator().manual_seed(3)
    total = case.k.shape[0]
    new_lens = [5000, 1, 2, 300]  # longest 5000: the same bucket (8192) as 5000 before
    pages = [-(-n // case.page) for n in new_lens]
    assert sum(pages) <= total, "the cache must hold the new batch's pages"
    order = torch.randperm(total, generator=gen).tolist()
    indptr, indices = [0], []
    for count in pages:
        indices += [order.pop() for _ in range(count)]
        indptr.append(len(indices))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    indptr_t, indices_t = i32(indptr), i32(indices)
    last_t = i32([(n - 1) % case.page + 1 for n in new_lens])
    case.k.copy_(torch.randn(case.k.shape, generator=gen).to(CUDA, case.dtype))
    case.v.copy_(torch.randn(case.v.shape, generator=gen).to(CUDA, case.dtype))
    w.plan(indptr_t, indices_t, last_t, case.hq, case.hkv, case.d, case.page, q_data_type=case.dtype,
           return_lse=True)  # fmt: skip
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attention_reference(case.q, case.k, case.v, torch.arange(5, dtype=torch.int32), indptr_t, indices_t,
                                 last_t, kv_layout="HND", causal=False, sm_scale=1 / math.sqrt(case.d))  # fmt: skip
    assert relative_error(out, ref) <= tolerance_for(case.dtype), "graph replay after a re-plan"
    # a re-plan outside the bucket is refused (the captured grid could not hold it)
    with pytest.raises(tactix.UnsupportedProblemError, match="CUDA-graph mode"):
        longer = Case([20000, 1, 1, 1], seed=31)
        w.plan(longer.indptr, longer.indices, longer.last, case.hq, case.hkv, case.d, case.page,
               q_data_type=case.dtype, return_lse=True)  # fmt: skip


def test_bad_cache_strides_are_refused_with_the_argument_named() -> None:
    case = Case([40, 3], seed=29)
    w = case.wrapper()
    case.plan(w)
    k = case.k
    # a cache whose rows are not 16-byte aligned: a view that starts one element in
    wide_k = torch.zeros(k.shape[0], k.shape[1], k.shape[2], k.shape[3] + 1, device=CUDA, dtype=k.dtype)
    wide_v = torch.zeros_like(wide_k)
    odd_k, odd_v = wide_k[..., 1:], wide_v[..., 1:]
    with pytest.raises(tactix.InvalidArgumentError, match="paged_kv_cache"):
        w.run(case.q, (odd_k, odd_v))


# -- prefill ---------------------------------------------------------------------------------


class PrefillCase:
    """A ragged prefill batch over a paged cache: request r has q_lens[r] new tokens at the end of
    kv_lens[r] keys (a cached prefix before them); shuffled pages among spare ones, poisoned slots
    outside the batch."""

    def __init__(self, q_lens: list[int], kv_lens: list[int], *, page: int = 16, hq: int = 32, hkv: int = 8,
                 d: int = 128, layout: str = "HND", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 five_d: bool = False, q_view: bool = False) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens = q_lens, kv_lens
        self.page, self.hq, self.hkv, self.d, self.layout, self.dtype = page, hq, hkv, d, layout, dtype
        pages = [-(-n // page) for n in kv_lens]
        total = sum(pages) + 5
        order = torch.randperm(total, generator=gen).tolist()
        indptr, indices = [0], []
        outside = torch.ones(total, page, dtype=torch.bool)
        for n, count in zip(kv_lens, pages, strict=True):
            mine = [order.pop() for _ in range(count)]
            for i, p in enumerate(mine):
                outside[p, : min(page, n - i * page)] = False
            indices += mine
            indptr.append(len(indices))
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        self.qo_indptr = i32([0, *itertools.accumulate(q_lens)])
        self.indptr, self.indices = i32(indptr), i32(indices)
        self.last = i32([(n - 1) % page + 1 for n in kv_lens])
        shape = (total, page, hkv, d) if layout == "NHD" else (total, hkv, page, d)
        mask = outside[:, :, None, None] if layout == "NHD" else outside[:, None, :, None]

        def cache() -> torch.Tensor:
            x = torch.randn(shape, generator=gen)
            return torch.where(mask, torch.where(x >= 0, OUTSIDE, -OUTSIDE), x).to(CUDA, dtype)

        k, v = cache(), cache()
        if five_d:
            self.cache: Any = torch.stack([k, v], dim=1)
            self.k, self.v = self.cache[:, 0], self.cache[:, 1]
        else:
            self.k, self.v = k, v
            self.cache = (k, v)
        rows = sum(q_lens)
        q = torch.randn(rows, hq, d, generator=gen).to(CUDA, dtype)
        if q_view:  # q as the first columns of a fused QKV projection output
            fused = torch.zeros(rows, (hq + 2 * hkv) * d, device=CUDA, dtype=dtype)
            self.q = fused[:, : hq * d].view(rows, hq, d)
            self.q.copy_(q)
        else:
            self.q = q

    def reference(self, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        scale = kw.get("sm_scale") or 1 / math.sqrt(self.d)
        return attention_reference(self.q, self.k, self.v, self.qo_indptr, self.indptr, self.indices, self.last,
                                   kv_layout=self.layout, causal=kw.get("causal", True), sm_scale=scale,
                                   window_left=kw.get("window_left", -1),
                                   logits_soft_cap=kw.get("logits_soft_cap") or 0.0)  # fmt: skip

    def wrapper(self, graph: bool = False) -> tactix.PagedPrefill:
        return tactix.PagedPrefill(self.layout, backend="cuda_native", device=CUDA, use_cuda_graph=graph)  # type: ignore[arg-type]

    def plan(self, w: tactix.PagedPrefill, **kw: Any) -> None:
        kw.setdefault("causal", True)
        w.plan(self.qo_indptr, self.indptr, self.indices, self.last, self.hq, self.hkv, self.d, self.page,
               q_data_type=self.dtype, **kw)  # fmt: skip

    def run(self, w: tactix.PagedPrefill, lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run into NaN-poisoned outputs."""
        out = torch.full((self.q.shape[0], self.hq, self.d), float("nan"), device=CUDA, dtype=self.dtype)
        lse_t = torch.full((self.q.shape[0], self.hq), float("nan"), device=CUDA) if lse else None
        w.run(self.q, self.cache, out=out, lse=lse_t)
        torch.cuda.synchronize()
        return out, lse_t

    def check(self, w: tactix.PagedPrefill, what: str, **kw: Any) -> None:
        want_lse = kw.get("return_lse", False)
        out, lse = self.run(w, want_lse)
        ref, ref_lse = self.reference(**kw)
        name = (f"{what}: d{self.d} p{self.page} {self.layout} h{self.hq}/{self.hkv} {str(self.dtype)[6:]} "
                f"q {self.q_lens[:6]} kv {self.kv_lens[:6]}{'...' if len(self.q_lens) > 6 else ''} "
                f"tactic {w.tactic}")  # fmt: skip
        bad = torch.isnan(out)
        if bad.any():
            rows = sorted({int(r) for r in bad.any(dim=2).any(dim=1).nonzero().flatten()})
            raise AssertionError(f"{name}: {int(bad.sum())} output elements unwritten (rows {rows[:10]})")
        err = relative_error(out, ref)
        # per (row, head) too: one key let in or left out of one row hides in the norm of the batch
        per_row = (out.double() - ref).norm(dim=2) / ref.norm(dim=2).clamp(min=1e-12)
        worst = [divmod(i, self.hq) for i in per_row.flatten().topk(min(5, per_row.numel())).indices.tolist()]
        if err > tolerance_for(self.dtype):
            raise AssertionError(f"{name}: relative error {err:.3e}; worst (row, head) {worst}")
        row_err = float(per_row.max())
        assert row_err <= 3 * tolerance_for(self.dtype), f"{name}: (row, head) {worst[0]} relative error {row_err:.3e}"
        if want_lse:
            assert lse is not None
            assert not torch.isnan(lse).any(), f"{name}: {int(torch.isnan(lse).sum())} LSE elements unwritten"
            lerr = lse_error(lse, ref_lse)
            assert lerr <= LSE_TOLERANCE[str(self.dtype)[6:]], f"{name}: LSE error {lerr:.3e} (natural log expected)"


# q lengths 1, around and off the tile sizes; prefixes 0 (fresh prompt) to 1000 (chunked prefill)
PREFILL_Q = [1, 15, 16, 17, 100, 129, 300, 64]
PREFILL_KV = [1, 18, 16, 57, 100, 329, 1300, 64]
# kernels/prefill.cu (mma.sync), kernels/prefill_sm90.cu (Hopper wgmma), and the latter with
# persistent CTAs (tactic param persist 1), with the consumer warpgroups' ping-pong (pingpong 1)
# and with both; select them with -k persist, -k pingpong
MMAS = ["sync", "wgmma", "wgmma-persist", "wgmma-pingpong", "wgmma-persist-pingpong"]


def prefill_kind(tactic: tactix.Tactic) -> str:
    """The MMAS entry a prefill tactic belongs to."""
    kind = str(tactic.params.get("mma", "sync"))
    for flag in ("persist", "pingpong"):
        if tactic.params.get(flag):
            kind += f"-{flag}"
    return kind


def prefill_tactic(mma: str, d: int = 128) -> tactix.Tactic:
    """The default tactic of one prefill kernel on this GPU (wgmma is the default on Hopper; a
    kind with "-persist" or "-pingpong" is its shape with those flags); skips the test where the
    GPU has no wgmma."""
    info = device.device_info(torch.cuda.current_device())
    kernel, *flags = mma.split("-")
    params = prefill.default_prefill_params(d, info, kernel)
    params = params.replace(persist=int("persist" in flags), pingpong=int("pingpong" in flags))
    reasons = params.reasons(d, info)
    if reasons:
        pytest.skip(f"prefill mma {mma!r} d{d} not on this GPU: {reasons}")
    return params.to_tactic()


@pytest.mark.parametrize("mma", MMAS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
def test_prefill_matches_oracle(d: int, page: int, layout: str, heads: tuple[int, int], mma: str) -> None:
    tactic = prefill_tactic(mma, d)
    case = PrefillCase(PREFILL_Q, PREFILL_KV, page=page, hq=heads[0], hkv=heads[1], d=d, layout=layout, seed=d + page)
    w = case.wrapper()
    case.plan(w, return_lse=True, tactic=tactic)
    assert w.backend == "cuda_native" and w.tactic == tactic
    case.check(w, "prefill causal chunked", return_lse=True)


def test_prefill_default_is_wgmma_on_hopper() -> None:
    case = PrefillCase([17, 5], [17, 40], seed=36)
    w = case.wrapper()
    case.plan(w, return_lse=True)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert (w.tactic.params.get("mma") == "wgmma") == hopper, w.tactic
    case.check(w, "default tactic", return_lse=True)


@pytest.mark.parametrize("mma", MMAS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "features",
    [
        {"causal": False},
        {"causal": True, "window_left": 0},
        {"causal": True, "window_left": 37},
        {"causal": False, "window_left": 64},
        {"causal": True, "logits_soft_cap": 30.0},
        {"causal": False, "logits_soft_cap": 5.0, "window_left": 100},
        {"causal": True, "sm_scale": 0.3},
    ],
    ids=["noncausal", "win0", "win37", "noncausal-win64", "cap30", "noncausal-cap5-win100", "scale0.3"],
)
def test_prefill_masks_softcap_scale_and_lse(dtype: torch.dtype, features: dict[str, Any], mma: str) -> None:
    tactic = prefill_tactic(mma)
    case = PrefillCase(PREFILL_Q, PREFILL_KV, dtype=dtype, layout="NHD", seed=3)
    w = case.wrapper()
    case.plan(w, return_lse=True, tactic=tactic, **features)
    case.check(w, f"prefill {features}", return_lse=True, **features)


@pytest.mark.parametrize("mma", MMAS)
def test_prefill_non_causal_with_q_longer_than_kv_and_empty_requests(mma: str) -> None:
    tactic = prefill_tactic(mma)
    case = PrefillCase([40, 0, 1, 300, 0], [3, 5, 1, 17, 9], seed=4)
    for features in ({"causal": False}, {"causal": False, "window_left": 2}):
        w = case.wrapper()
        case.plan(w, return_lse=True, tactic=tactic, **features)
        case.check(w, f"q longer than kv {features}", return_lse=True, **features)


@pytest.mark.parametrize("mma", MMAS)
def test_prefill_5d_cache_strided_q_and_fp16_every_head_dim(mma: str) -> None:
    for layout in ("NHD", "HND"):
        case = PrefillCase(PREFILL_Q, PREFILL_KV, layout=layout, five_d=True, q_view=True, seed=5)
        w = case.wrapper()
        case.plan(w, return_lse=True, tactic=prefill_tactic(mma))
        case.check(w, "5-D cache + QKV view of q", return_lse=True)
    for d in (64, 128, 256):
        case = PrefillCase(PREFILL_Q, PREFILL_KV, page=1, d=d, dtype=torch.float16, seed=d)
        w = case.wrapper()
        case.plan(w, tactic=prefill_tactic(mma, d))
        case.check(w, "fp16")


@pytest.mark.parametrize("mma", MMAS)
@pytest.mark.parametrize("heads", [(32, 1), (64, 2), (24, 8), (40, 2), (6, 2)],
                         ids=["gqa32", "gqa32b", "gqa3", "gqa20", "gqa3b"])  # fmt: skip
def test_prefill_gqa_ratios_and_head_packing(heads: tuple[int, int], mma: str) -> None:
    """Ratios that do not divide the tile (3, 20) and groups above 16 heads; pack 1 and auto."""
    base = prefill_tactic(mma)
    case = PrefillCase([1, 77, 300, 5], [1, 100, 300, 900], hq=heads[0], hkv=heads[1], seed=7)
    for pack in (0, 1):
        w = case.wrapper()
        tactic = base.model_copy(update={"params": {**base.params, "pack": pack}})
        case.plan(w, return_lse=True, tactic=tactic)
        assert w.plan_object.pack == (prefill.prefill_pack(heads[0] // heads[1], 128) if pack == 0 else 1)
        case.check(w, f"GQA pack {pack}", return_lse=True)


@pytest.mark.parametrize("mma", MMAS)
def test_every_enumerated_prefill_tactic(mma: str) -> None:
    """Every tactic the backend enumerates for this GPU, of one kernel (select the Hopper one
    with ``-k wgmma``)."""
    backend = tactix.get_registry().get("cuda_native")
    prefill_tactic(mma)  # skips where this GPU has no such kernel
    for d in (64, 128, 256):
        case = PrefillCase(PREFILL_Q, PREFILL_KV, d=d, seed=17)
        probe = case.wrapper()
        case.plan(probe)
        tactics = [t for t in backend.tactics(probe.problem) if not t.is_default and prefill_kind(t) == mma]
        assert tactics
        for tactic in tactics:
            for features in ({"causal": True}, {"causal": False, "window_left": 50}):
                w = case.wrapper()
                case.plan(w, tactic=tactic, return_lse=True, **features)
                assert w.tactic == tactic
                case.check(w, f"tactic {tactic} {features}", return_lse=True, **features)


@pytest.mark.parametrize("pingpong", [0, 1], ids=["plain", "pingpong"])
@pytest.mark.parametrize("persist", [0, 1], ids=["one-cta-per-item", "persistent"])
def test_wgmma_prefill_long_keys_both_warpgroups_and_idle_ones(persist: int, pingpong: int) -> None:
    """The Hopper kernel's pipeline over many tiles (every ring slot reused, both mbarrier
    parities), one head per CTA so that the two consumer warpgroups own different tokens (one
    skips tiles the other computes: causal diagonal, window edge), requests short enough to leave
    a warpgroup idle, and a 5-D cache, for every wgmma tile shape enumerated (with persistent
    CTAs, ping-pong, both: every shape enumerated with those flags)."""
    prefill_tactic("wgmma" + ("-persist" if persist else "") + ("-pingpong" if pingpong else ""))
    info = device.device_info(torch.cuda.current_device())
    shapes = {(p.q_tile, p.kv_tile, p.warps, p.stages) for p in prefill.prefill_candidates(128, info, 4)
              if p.mma == "wgmma" and p.persist == persist and p.pingpong == pingpong}  # fmt: skip
    assert shapes
    case = PrefillCase([700, 3, 129, 1], [3000, 900, 129, 2000], hq=8, hkv=2, layout="NHD", five_d=True, seed=41)
    for q_tile, kv_tile, warps, stages in sorted(shapes):
        for pack, features in ((1, {"causal": True}), (1, {"causal": True, "window_left": 90}), (0, {"causal": False})):
            params = prefill.PrefillParams(q_tile=q_tile, kv_tile=kv_tile, warps=warps, stages=stages, pack=pack,
                                           mma="wgmma", persist=persist, pingpong=pingpong)  # fmt: skip
            w = case.wrapper()
            case.plan(w, return_lse=True, tactic=params.to_tactic(), **features)
            case.check(w, f"wgmma pipeline {features}", return_lse=True, **features)


# ragged batches: a request with neither queries nor keys, lengths off the 128-key tile, and a
# last request whose last tile runs past the end of the packed K and V
RAGGED_BATCHES = [([37, 0, 300, 5, 1000, 129], [100, 0, 300, 64, 1000, 400]),
                  ([20, 3, 260, 59, 900, 100], [70, 9, 320, 65, 1100, 300])]  # fmt: skip


@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["d128", "d192-128"])
@pytest.mark.parametrize("flags", [(0, 0), (1, 1)], ids=["wgmma", "wgmma-persist-pingpong"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ragged_prefill_through_tensor_maps_equals_the_gather_bit_for_bit(
    dims: tuple[int, int], flags: tuple[int, int], causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged-KV prefill on the wgmma kernel loads K and V tiles through tensor maps of the packed
    tensors (TX_KV_TMA, the default) or gathers them as one-token pages (TACTIX_CUDA_NATIVE_RAGGED_TMA=0):
    the same output and LSE bit for bit (rows past a request's keys are masked either way), within
    tolerance of the float64 oracle; K and V are strided views of one fused tensor; a re-plan on the
    same wrapper keeps the tensor maps."""
    dqk, dvo = dims
    info = device.device_info(torch.cuda.current_device())
    params = prefill.PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma", persist=flags[0],
                                   pingpong=flags[1])  # fmt: skip
    if reasons := params.reasons(dqk, info, head_dim_vo=dvo):
        pytest.skip(f"wgmma prefill d{dqk}/{dvo} not on this GPU: {reasons}")
    gen = torch.Generator().manual_seed(dqk + 2 * flags[0] + int(causal))
    kv_total = max(sum(kv) for _, kv in RAGGED_BATCHES)
    fused = torch.randn(kv_total, 4, dqk + dvo, generator=gen).to(CUDA, torch.bfloat16)
    k, v = fused[:, :, :dqk], fused[:, :, dqk:]
    for b, (q_lens, kv_lens) in enumerate(RAGGED_BATCHES):
        qo = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        kv = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32)
        rows = sum(q_lens)
        q = torch.randn(rows, 16, dqk, generator=gen).to(CUDA, torch.bfloat16)
        results = {}
        for tma in ("0", "1"):
            monkeypatch.setenv(prefill.RAGGED_TMA_ENV, tma)
            w = tactix.RaggedPrefill(backend="cuda_native", device=CUDA)
            for lens in RAGGED_BATCHES[: b + 1]:  # (the second batch is a re-plan of the first's wrapper)
                w.plan(torch.tensor([0, *itertools.accumulate(lens[0])], dtype=torch.int32),
                       torch.tensor([0, *itertools.accumulate(lens[1])], dtype=torch.int32), 16, 4, dqk, dvo,
                       causal=causal, q_data_type=torch.bfloat16, return_lse=True,
                       tactic=params.to_tactic())  # fmt: skip
            assert w.plan_object.paged._kv_tma == (tma == "1"), f"batch {b}"
            out = torch.full((rows, 16, dvo), float("nan"), device=CUDA, dtype=torch.bfloat16)
            lse = torch.full((rows, 16), float("nan"), device=CUDA)
            w.run(q, k, v, out=out, lse=lse)
            torch.cuda.synchronize()
            results[tma] = (out, lse)
        ref, ref_lse = ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=1 / math.sqrt(dqk))
        out, lse = results["1"]
        assert relative_error(out, ref) < tolerance_for(torch.bfloat16), f"batch {b}"
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"], f"batch {b}"
        assert torch.equal(out, results["0"][0]) and torch.equal(lse, results["0"][1]), f"batch {b}"


def test_ragged_tensor_maps_follow_k_and_v_to_new_addresses() -> None:
    """A server hands every ragged run K and V just projected, at new addresses: the plan swaps
    each new address into its kept maps (`TensorMaps.rebound`) rather than encoding maps again.
    Every run reads its own K and V (the same output as the first run's where the values are the
    same, the oracle's where they differ), on more addresses than the plan keeps maps for; a CUDA
    graph captured before the maps moved replays the K and V it captured."""
    q_lens, kv_lens = RAGGED_BATCHES[0]
    qo = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    kv = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(77)
    rows, tokens = sum(q_lens), sum(kv_lens)
    q = torch.randn(rows, 16, 128, generator=gen).to(CUDA, torch.bfloat16)
    pairs = [(torch.randn(tokens, 4, 128, generator=gen).to(CUDA, torch.bfloat16),
              torch.randn(tokens, 4, 128, generator=gen).to(CUDA, torch.bfloat16)) for _ in range(3)]  # fmt: skip
    w = tactix.RaggedPrefill(backend="cuda_native", device=CUDA, use_cuda_graph=True)
    w.plan(qo, kv, 16, 4, 128, causal=True, q_data_type=torch.bfloat16)
    if not w.plan_object.paged._kv_tma:
        pytest.skip("the ragged tensor-map kernel does not serve this GPU (no wgmma or no tensor maps)")
    expected = []
    for k, v in pairs:
        ref, _ = ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=1 / math.sqrt(128))
        expected.append(ref)
    outs = [torch.full((rows, 16, 128), float("nan"), device=CUDA, dtype=torch.bfloat16) for _ in range(2)]
    w.run(q, *pairs[0], out=outs[0])
    first = outs[0].clone()
    graph = captured(lambda: w.run(q, *pairs[0], out=outs[0]))
    for turn in range(12):  # copies at new addresses, more of them than the plan keeps maps for
        i = turn % 3
        k, v = pairs[i][0].clone(), pairs[i][1].clone()
        outs[1].fill_(float("nan"))
        w.run(q, k, v, out=outs[1])
        torch.cuda.synchronize()
        if i == 0:
            assert torch.equal(outs[1], first), f"turn {turn}"
        assert relative_error(outs[1], expected[i]) < tolerance_for(torch.bfloat16), f"turn {turn}"
    outs[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], first)


@pytest.mark.parametrize(("dims", "heads", "mma"), [((192, 128), (16, 16), "wgmma"), ((128, 128), (32, 8), "wgmma"),
                                                    ((128, 128), (32, 8), "sync")],
                         ids=["d192x128-wgmma", "d128-gqa4-wgmma", "d128-gqa4-sync"])  # fmt: skip
def test_prefill_head_sections_on_a_long_request_keep_the_bits(
    dims: tuple[int, int], heads: tuple[int, int], mma: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request of 8192 keys whose keys and values over every head outgrow half of L2: with
    TACTIX_CUDA_NATIVE_HEAD_SECTIONS=1 the plan runs its head groups in sections
    (`prefill.prefill_head_section`), and the output and LSE are those of one section (=0) bit for
    bit, with no NaN."""
    dqk, dvo = dims
    hq, hkv = heads
    info = device.device_info(torch.cuda.current_device())
    gen = torch.Generator().manual_seed(dqk + hq)
    n = 8192
    qo = kv = torch.tensor([0, n], dtype=torch.int32)
    q = torch.randn(n, hq, dqk, generator=gen).to(CUDA, torch.bfloat16)
    k = torch.randn(n, hkv, dqk, generator=gen).to(CUDA, torch.bfloat16)
    v = torch.randn(n, hkv, dvo, generator=gen).to(CUDA, torch.bfloat16)
    tactic = None if mma == "wgmma" else prefill.PrefillParams(q_tile=64, kv_tile=64, warps=4, stages=2).to_tactic()
    results = {}
    for sections in ("1", "0"):
        monkeypatch.setenv(prefill.HEAD_SECTIONS_ENV, sections)
        w = tactix.RaggedPrefill(backend="cuda_native", device=CUDA)
        w.plan(qo, kv, hq, hkv, dqk, dvo, causal=True, q_data_type=torch.bfloat16, return_lse=True, tactic=tactic)
        paged = w.plan_object.paged
        groups = hq // prefill.prefill_pack(hq // hkv, paged.params.q_tile, paged.params.pack)
        if sections == "1":
            assert paged._section < groups, (paged._section, groups, info.l2_bytes)
        else:
            assert paged._section == groups
        out = torch.full((n, hq, dvo), float("nan"), device=CUDA, dtype=torch.bfloat16)
        lse = torch.full((n, hq), float("nan"), device=CUDA)
        w.run(q, k, v, out=out, lse=lse)
        torch.cuda.synchronize()
        results[sections] = (out, lse)
    out, lse = results["1"]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out, results["0"][0]) and torch.equal(lse, results["0"][1])


@pytest.mark.parametrize("kv_tma", ["1", "0"], ids=["tensor-maps", "gather"])
def test_prefill_turns_from_a_counter_keep_the_bits_run_after_run_and_in_a_graph(
    kv_tma: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sched 3 (persistent CTAs taking turns from a counter, TX_DYN) on DeepSeek's 192/128 over
    R1-like and uneven ragged batches: bitwise the non-persistent kernel's output and LSE, on
    every one of several eager runs and CUDA-graph replays (each launch must leave its counters
    at zero for the next), with K and V through tensor maps and through the gather."""
    monkeypatch.setenv(prefill.RAGGED_TMA_ENV, kv_tma)
    hq = hkv = 16
    dyn = prefill.PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma", pingpong=1, persist=1,
                                sched=3)  # fmt: skip
    plain = dyn.replace(persist=0, sched=2)
    gen = torch.Generator().manual_seed(31)
    for lens in ([1024] * 4, [1500, 3, 700, 129, 2048, 64]):
        n = sum(lens)
        qo = kv = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        q = torch.randn(n, hq, 192, generator=gen).to(CUDA, torch.bfloat16)
        k = torch.randn(n, hkv, 192, generator=gen).to(CUDA, torch.bfloat16)
        v = torch.randn(n, hkv, 128, generator=gen).to(CUDA, torch.bfloat16)
        results = []
        for params, graph in ((plain, False), (dyn, False), (dyn, True)):
            w = tactix.RaggedPrefill(backend="cuda_native", device=CUDA, use_cuda_graph=graph)
            w.plan(qo, kv, hq, hkv, 192, 128, causal=True, q_data_type=torch.bfloat16, return_lse=True,
                   tactic=params.to_tactic())  # fmt: skip
            assert w.plan_object.paged.params == params and bool(w.plan_object.paged._kv_tma) == (kv_tma == "1")
            out = torch.full((n, hq, 128), float("nan"), device=CUDA, dtype=torch.bfloat16)
            lse = torch.full((n, hq), float("nan"), device=CUDA)
            runs = [functools.partial(w.run, q, k, v, out=out, lse=lse)] * 3
            if graph:
                replay = captured(runs[0])
                runs = [replay.replay] * 3
            for run in runs:
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                results.append((out.clone(), lse.clone()))
        ref_out, ref_lse = results[0]
        assert not torch.isnan(ref_out).any() and not torch.isnan(ref_lse).any()
        for at, (out, lse) in enumerate(results[1:]):
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), (lens, at)


@pytest.mark.parametrize("mma", MMAS)
def test_prefill_benchmark_like_shapes_and_determinism(mma: str) -> None:
    """P3-like ragged lengths and a P4-like chunk over a long prefix; bitwise equal on a rerun."""
    tactic = prefill_tactic(mma)
    torch.manual_seed(3)
    q = torch.randint(64, 2048, (16,)).tolist()
    for q_lens, kv_lens in ((q, q), ([512] * 2, [4608] * 2)):
        case = PrefillCase(q_lens, kv_lens, seed=23)
        w = case.wrapper()
        case.plan(w, return_lse=True, tactic=tactic)
        case.check(w, "benchmark-like", return_lse=True)
        first, first_lse = case.run(w, True)
        again, again_lse = case.run(w, True)
        assert torch.equal(first, again) and first_lse is not None and torch.equal(first_lse, again_lse)


@pytest.mark.parametrize("mma", MMAS)
def test_prefill_run_does_not_sync_and_replays_in_a_cuda_graph(mma: str) -> None:
    tactic = prefill_tactic(mma)
    case = PrefillCase([1, 300, 700, 17], [1, 900, 700, 40], seed=19)
    w = case.wrapper(graph=True)
    case.plan(w, return_lse=True, tactic=tactic)
    grid = w.plan_object.grid
    if tactic.params.get("persist"):  # persistent CTAs: at most what the GPU holds at once
        info = device.device_info(torch.cuda.current_device())
        assert grid[0] <= info.sms * 4, grid
    rows = case.q.shape[0]
    out = torch.empty(rows, case.hq, case.d, device=CUDA, dtype=case.dtype)
    lse = torch.empty(rows, case.hq, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.run(case.q, case.cache, out=out, lse=lse)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = captured(lambda: w.run(case.q, case.cache, out=out, lse=lse))
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        case.q.copy_(torch.randn(case.q.shape, generator=gen).to(CUDA, case.dtype))
        case.k.copy_(
            torch.where(case.k.abs() >= OUTSIDE, case.k, torch.randn(case.k.shape, generator=gen).to(CUDA, case.dtype))
        )
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = case.reference()
        assert relative_error(out, ref) <= tolerance_for(case.dtype), "graph replay with new data"
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"]
    # re-plan the same wrapper for another batch in the same buckets (4 requests, 1018 rows ->
    # 1024, kv <= 1024), pages drawn from the same cache: the captured graph must read it
    gen = torch.Generator().manual_seed(3)
    total = case.k.shape[0]
    new_q, new_kv = [600, 1, 400, 17], [900, 1, 400, 300]
    pages = [-(-n // case.page) for n in new_kv]
    assert sum(pages) <= total, "the cache must hold the new batch's pages"
    order = torch.randperm(total, generator=gen).tolist()
    indptr, indices = [0], []
    for count in pages:
        indices += [order.pop() for _ in range(count)]
        indptr.append(len(indices))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    qo_t = i32([0, *itertools.accumulate(new_q)])
    indptr_t, indices_t = i32(indptr), i32(indices)
    last_t = i32([(n - 1) % case.page + 1 for n in new_kv])
    case.k.copy_(torch.randn(case.k.shape, generator=gen).to(CUDA, case.dtype))
    case.v.copy_(torch.randn(case.v.shape, generator=gen).to(CUDA, case.dtype))
    assert sum(new_q) == rows  # the same q and out buffers (their shape is the number of rows)
    w.plan(qo_t, indptr_t, indices_t, last_t, case.hq, case.hkv, case.d, case.page, q_data_type=case.dtype,
           causal=True, return_lse=True, tactic=tactic)  # fmt: skip
    assert w.plan_object.grid == grid  # the captured grid holds every batch of the buckets
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attention_reference(case.q, case.k, case.v, qo_t, indptr_t, indices_t, last_t, kv_layout="HND",
                                 causal=True, sm_scale=1 / math.sqrt(case.d))  # fmt: skip
    assert relative_error(out, ref) <= tolerance_for(case.dtype), "graph replay after a re-plan"
    # a re-plan outside the buckets is refused (the captured grid could not hold it)
    with pytest.raises(tactix.UnsupportedProblemError, match="CUDA-graph mode"):
        longer = PrefillCase([1015, 1, 1, 1], [5000, 1, 1, 1], seed=31)
        w.plan(longer.qo_indptr, longer.indptr, longer.indices, longer.last, case.hq, case.hkv, case.d, case.page,
               q_data_type=case.dtype, causal=True, return_lse=True, tactic=tactic)  # fmt: skip


def _tree_masks(case: PrefillCase, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [cases._mask("tree", q, kv, gen) for q, kv in zip(case.q_lens, case.kv_lens, strict=True)]


def test_prefill_custom_masks_run_eagerly_and_replan_into_a_captured_graph() -> None:
    """Tree masks (speculative decoding's verify step over cached prefixes) on the mma.sync kernel:
    eager, flat and bit-packed; then captured in a CUDA graph and re-planned with new masks that
    the replays read; a mask larger than the captured buffer is refused with the reason."""
    case = PrefillCase([5, 40, 1, 17], [60, 300, 1, 17], hq=32, hkv=8, seed=41)
    scale = 1 / math.sqrt(case.d)

    def check(out: torch.Tensor, lse: torch.Tensor, flat: torch.Tensor, what: str) -> None:
        ref, ref_lse = attention_reference(case.q, case.k, case.v, case.qo_indptr, case.indptr, case.indices,
                                           case.last, kv_layout=case.layout, causal=False, sm_scale=scale,
                                           custom_mask=flat)  # fmt: skip
        assert not torch.isnan(out).any(), f"{what}: unwritten output"
        assert relative_error(out, ref) <= tolerance_for(case.dtype), what
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"], what

    parts = _tree_masks(case, 1)
    flat = torch.cat([m.reshape(-1) for m in parts])
    packed = torch.cat([cases._packbits(m.reshape(-1)) for m in parts])
    w = case.wrapper()
    for given in ({"custom_mask": flat.to(CUDA)}, {"packed_custom_mask": packed}):
        case.plan(w, causal=False, return_lse=True, **given)
        assert w.backend == "cuda_native" and w.tactic.params.get("mma", "sync") == "sync", w.tactic
        out, lse = case.run(w, lse=True)
        assert lse is not None
        check(out, lse, flat, f"eager, {next(iter(given))}")

    g = case.wrapper(graph=True)
    case.plan(g, causal=False, return_lse=True, custom_mask=flat)
    rows = case.q.shape[0]
    out = torch.empty(rows, case.hq, case.d, device=CUDA, dtype=case.dtype)
    lse = torch.empty(rows, case.hq, device=CUDA)
    graph = captured(lambda: g.run(case.q, case.cache, out=out, lse=lse))
    for seed in (2, 3):  # new masks of the same batch, planned into the captured buffers
        new = torch.cat([m.reshape(-1) for m in _tree_masks(case, seed)])
        assert not torch.equal(new, flat)
        case.plan(g, causal=False, return_lse=True, custom_mask=new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, new, f"graph replay after a re-plan with mask {seed}")
    # the same buckets but more mask elements than the captured buffer holds (12,590 -> 16,384)
    bigger = PrefillCase([40, 5, 1, 17], [300, 300, 300, 300], hq=32, hkv=8, seed=43)
    mask = torch.ones(sum(q * kv for q, kv in zip(bigger.q_lens, bigger.kv_lens, strict=True)), dtype=torch.bool)
    with pytest.raises(tactix.UnsupportedProblemError, match="captured buffer"):
        g.plan(bigger.qo_indptr, bigger.indptr, bigger.indices, bigger.last, case.hq, case.hkv, case.d, case.page,
               q_data_type=case.dtype, causal=False, return_lse=True, custom_mask=mask)  # fmt: skip


def test_untuned_auto_prefers_cudnn_for_prefill_when_it_is_there() -> None:
    case = PrefillCase([17, 5], [17, 40], seed=37)
    w = tactix.PagedPrefill("HND", device=CUDA)
    case.plan(w)
    active = {b.name for b in tactix.get_registry().active("prefill") if not b.environment()}
    if "cudnn" in active:
        assert w.backend == "cudnn"


# -- fp8 caches: every code -------------------------------------------------------------------


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_cache_reads_every_code_as_its_value(kv: torch.dtype, dtype: torch.dtype, op: str) -> None:
    """Each of the 256 fp8 codes, read from the cache by the decode and the prefill kernels (in the
    conversion mode the plugin picks for the dtype and format), is the code's value exactly: two
    requests of one key each, whose V rows hold codes 0-127 and 128-255 (K all zero), output those
    values (NaN for NaN codes, e5m2's infinities, subnormals), bit for bit. Not a zero's sign: P V
    sums into +0 (0 + 1 x -0). Prefill not e5m2's infinities: a key slot past a request's end
    re-reads a valid row with weight 0 (0 x inf: NaN)."""
    d, page = 128, 16
    codes = torch.arange(256, dtype=torch.uint8).view(kv)
    k = torch.zeros(4, 1, page, d, dtype=torch.uint8, device=CUDA).view(kv)  # HND, one KV head, pages 1, 3 used
    v = torch.zeros_like(k)
    v[1, 0, 0], v[3, 0, 0] = codes[:128].to(CUDA), codes[128:].to(CUDA)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    indptr, indices, last = i32([0, 1, 2]), i32([1, 3]), i32([1, 1])
    q = torch.randn(2, 1, d, device=CUDA).to(dtype)
    out = torch.full((2, 1, d), float("nan"), device=CUDA, dtype=dtype)
    if op == "decode":
        w: Any = tactix.PagedDecode("HND", backend="cuda_native", device=CUDA)
        w.plan(indptr, indices, last, 1, 1, d, page, q_data_type=dtype, kv_data_type=kv)
    else:
        w = tactix.PagedPrefill("HND", backend="cuda_native", device=CUDA)
        w.plan(i32([0, 1, 2]), indptr, indices, last, 1, 1, d, page, q_data_type=dtype, kv_data_type=kv)
    w.run(q, (k, v), out=out)
    got, ref = out.reshape(256).cpu(), codes.to(dtype)
    if op == "prefill":
        got, ref = got[~torch.isinf(ref)], ref[~torch.isinf(ref)]
    nan = torch.isnan(ref)
    where = torch.isnan(got).nonzero().flatten().tolist()
    assert torch.equal(torch.isnan(got), nan), f"{w.tactic}: NaN at codes {where}"
    wrong = (got != ref) & ~nan
    assert not wrong.any(), f"{w.tactic}: codes {wrong.nonzero().flatten().tolist()} read as {got[wrong].tolist()}"


@pytest.mark.parametrize("qk16", ["1", "0"], ids=["qk-float16", "qk-bfloat16"])
def test_fp8_prefill_under_bf16_q_of_any_magnitude_matches_the_oracle(
    qk16: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wgmma prefill over an e4m3 cache under bf16 q whose rows are randn times 2^-16 to 2^16
    (past float16's range): Q K^T in float16 (TX_QK16, TACTIX_CUDA_NATIVE_FP8_QK16=1: each warp's Q
    rows rescaled by a power of two) and in bfloat16 (the default) both match the float64 oracle,
    with scales, the soft cap (whole rows would be one-hot without it) and the LSE."""
    monkeypatch.setenv("TACTIX_CUDA_NATIVE_FP8_QK16", qk16)
    case = PrefillCase([1, 70, 129, 300], [1, 130, 200, 300], hq=8, hkv=2, seed=53)
    gen = torch.Generator().manual_seed(54)
    exponents = torch.randint(-16, 17, (case.q.shape[0], case.hq, 1), generator=gen).float()
    case.q = (case.q.float() * torch.exp2(exponents).to(CUDA)).to(torch.bfloat16)
    case.k, case.v = (t.float().clamp(-448, 448).to(torch.float8_e4m3fn) for t in (case.k, case.v))
    case.cache = (case.k, case.v)
    w = tactix.PagedPrefill(case.layout, backend="cuda_native", device=CUDA)
    w.plan(case.qo_indptr, case.indptr, case.indices, case.last, case.hq, case.hkv, case.d, case.page,
           q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn, causal=True, logits_soft_cap=30.0,
           return_lse=True)  # fmt: skip
    assert w.tactic.params.get("mma") == "wgmma", w.tactic
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), device=CUDA)
    w.run(case.q, case.cache, out=out, lse=lse, k_scale=0.5, v_scale=2.0)
    ref, ref_lse = attention_reference(case.q, case.k, case.v, case.qo_indptr, case.indptr, case.indices, case.last,
                                       kv_layout=case.layout, causal=True, sm_scale=1 / math.sqrt(case.d),
                                       logits_soft_cap=30.0, k_scale=0.5, v_scale=2.0)  # fmt: skip
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    tol = attention_tolerance(torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16)
    assert relative_error(out, ref) <= tol
    assert lse_error(lse, ref_lse) <= attention_lse_tolerance(torch.bfloat16, torch.float8_e4m3fn)


# -- plans far ahead of the GPU --------------------------------------------------------------


class PoolBatch:
    """One batch of a series over one page pool (the same k and v tensors): pages drawn at random
    from the pool, its indices on the host or on the device."""

    def __init__(self, q_lens: list[int], kv_lens: list[int], pool: int, page: int, gen: torch.Generator,
                 hq: int, d: int, on_device: bool) -> None:  # fmt: skip
        pages = [-(-n // page) for n in kv_lens]
        assert sum(pages) <= pool, "the pool must hold the batch's pages"
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        self.q_lens, self.kv_lens = q_lens, kv_lens
        self.qo_indptr = i32([0, *itertools.accumulate(q_lens)])
        self.indptr = i32([0, *itertools.accumulate(pages)])
        self.host_indices = torch.randperm(pool, generator=gen)[: sum(pages)].to(torch.int32)
        self.indices = self.host_indices.to(CUDA) if on_device else self.host_indices
        self.last = i32([(n - 1) % page + 1 for n in kv_lens])
        self.q = torch.randn(sum(q_lens), hq, d, generator=gen).to(CUDA, torch.bfloat16)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_re_plans_of_one_bucket_skip_the_check_and_the_plan_hook(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-plan with the same static arguments and a batch of a bucket already planned is made by
    the plan's own ``replan`` (the core's fast path): no check and no plan hook (both ask the
    plugin's reasons), one plan counted, and each batch matches the float64 oracle. The cache
    strides are checked by the first run only: re-plans keep what it found (the caches here
    differ in size, not in strides)."""
    module, name = (decode, "decode_reasons") if op == "decode" else (prefill, "prefill_reasons")
    asked: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: asked.append(1) or real(*a))
    plan_class = decode.CudaNativeDecodePlan if op == "decode" else prefill.CudaNativePrefillPlan
    accepted: list[int] = []
    real_accept = plan_class._accept
    monkeypatch.setattr(plan_class, "_accept", lambda self, *a: accepted.append(1) or real_accept(self, *a))
    cases: list[Case] | list[PrefillCase]
    if op == "decode":  # 3-4 requests, longest 513-1024 keys: one bucket
        cases = [Case(lens, seed=s) for s, lens in enumerate(([5, 700, 33], [1000, 17, 1], [600, 513, 100, 1]))]
    else:  # 3 requests, 65-128 new tokens, longest q 33-64, longest kv 257-512
        shapes = (([17, 1, 64], [17, 300, 64]), ([40, 30, 20], [500, 30, 300]), ([60, 3, 50], [60, 400, 512]))
        cases = [PrefillCase(q, kv, seed=s) for s, (q, kv) in enumerate(shapes)]
    w = cases[0].wrapper()
    cases[0].plan(w)  # type: ignore[arg-type]
    assert asked, "the first plan goes through the check and the plan hook"
    cases[0].check(w, "first plan")  # type: ignore[arg-type]
    for i, case in enumerate(cases[1:], 1):
        asked.clear()
        tactix.reset_stats()
        case.plan(w)  # type: ignore[arg-type]
        assert not asked, f"re-plan {i} went through the check or the plan hook"
        assert tactix.stats()["plans"] == 1
        case.check(w, f"re-plan {i}")  # type: ignore[arg-type]
    assert len(accepted) == 1, f"the cache strides were checked {len(accepted)} times, not once"


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """Collect now, and not in the timed section: a collection there runs whatever finalizers
    earlier tests left (a dropped CUDA module's unload, for one, waits for the device), and such
    a stall behind the sleeping GPU is not the plans under test waiting. (Session 7 saw one plan
    of this series take 208 ms once in a full-suite run, never alone: this is the suspected cause.)"""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _far_ahead_series(op: str, graph: bool, on_device: bool) -> tuple[list[PoolBatch], torch.Tensor, torch.Tensor]:
    """Six batches of one shape bucket over one page pool (12 requests, kv 1100..2000 keys with
    one of 2000, so a CUDA-graph wrapper re-plans all of them; prefill: 768 query rows in all in
    graph mode, 1..128 a request otherwise), and the pool's k and v (HND, 32/8 heads, d128)."""
    page, hkv, hq, d, b = 16, 8, 32, 128, 12
    gen = torch.Generator().manual_seed(41 + 2 * graph + on_device)
    pool = b * -(-2000 // page) + 8
    k = torch.randn(pool, hkv, page, d, generator=gen).to(CUDA, torch.bfloat16)
    v = torch.randn(pool, hkv, page, d, generator=gen).to(CUDA, torch.bfloat16)
    batches = []
    for _ in range(6):
        kv_lens = [2000, *torch.randint(1100, 2001, (b - 1,), generator=gen).tolist()]
        if op == "decode":
            q_lens = [1] * b
        elif graph:  # the captured q and out keep their rows: 768 split at random (empty requests too)
            cuts = sorted(torch.randint(0, 769, (b - 1,), generator=gen).tolist())
            q_lens = [hi - lo for lo, hi in itertools.pairwise([0, *cuts, 768])]
        else:
            q_lens = torch.randint(1, 129, (b,), generator=gen).tolist()
        batches.append(PoolBatch(q_lens, kv_lens, pool, page, gen, hq, d, on_device))
    return batches, k, v


def _far_ahead_plan(w: tactix.PagedDecode | tactix.PagedPrefill, op: str, x: PoolBatch) -> None:
    if op == "decode":
        assert isinstance(w, tactix.PagedDecode)
        w.plan(x.indptr, x.indices, x.last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    else:
        assert isinstance(w, tactix.PagedPrefill)
        w.plan(x.qo_indptr, x.indptr, x.indices, x.last, 32, 8, 128, 16, q_data_type=torch.bfloat16, causal=True)


def _far_ahead_check(op: str, batches: list[PoolBatch], outs: list[torch.Tensor], k: torch.Tensor,
                     v: torch.Tensor) -> None:  # fmt: skip
    for i, (x, out) in enumerate(zip(batches, outs, strict=True)):
        ref, _ = attention_reference(x.q, k, v, x.qo_indptr, x.indptr, x.host_indices, x.last, kv_layout="HND",
                                     causal=op == "prefill", sm_scale=1 / math.sqrt(128))  # fmt: skip
        assert not torch.isnan(out).any(), f"{op} batch {i}: output elements unwritten"
        err = relative_error(out, ref)
        assert err <= tolerance_for(torch.bfloat16), (
            f"{op} batch {i} (q {x.q_lens[:4]}..., kv {x.kv_lens[:4]}...): relative error {err:.3e}: a run read "
            "another batch's metadata (a slot or a pinned buffer rewritten too early)"
        )


@pytest.mark.parametrize("indices", ["host", "device"])
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_eager_replans_far_ahead_of_the_gpu_keep_every_batch_metadata(op: str, indices: str) -> None:
    """Plans take over the wrapper's staging (two device slots, a ring of pinned buffers): with the
    GPU held back by a long kernel, each plan's transfer waits while the next plans write theirs.
    Every run must still read its own batch's work list and pages (successive plans alternate
    between the slots), and the ring grows rather than the host waiting."""
    batches, k, v = _far_ahead_series(op, graph=False, on_device=indices == "device")
    w: tactix.PagedDecode | tactix.PagedPrefill = (
        tactix.PagedDecode("HND", backend="cuda_native", device=CUDA)
        if op == "decode"
        else tactix.PagedPrefill("HND", backend="cuda_native", device=CUDA)
    )
    # every batch planned and run once first: its kernel variant compiled and loaded (a module's
    # first launch may wait for the whole device, so it must not happen behind the sleep), and
    # the staging sized for the largest batch
    for x in batches:
        _far_ahead_plan(w, op, x)
        w.run(x.q, (k, v))
    torch.cuda.synchronize()
    staging = w.plan_object._staging
    ring = len(staging._host)
    outs, plans, host_us = [], [], []
    with _no_collection():
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s on the device
        for x in batches:
            t0 = time.perf_counter()
            _far_ahead_plan(w, op, x)
            t1 = time.perf_counter()
            outs.append(w.run(x.q, (k, v)))
            plans.append(w.plan_object)
            host_us.append((round((t1 - t0) * 1e6), round((time.perf_counter() - t1) * 1e6)))
        grew = len(staging._host)
    assert all(p._staging is staging for p in plans), "a batch of a size seen before reallocated the staging"
    assert len({p._ptrs[0] for p in plans}) == 2, "successive eager plans must alternate between two slots"
    if op == "decode":  # split requests: each plan takes over the replaced plan's partials and counters
        assert all(p.work.needs_merge for p in plans)
        assert len({(p._part_o.data_ptr(), p._counters.data_ptr()) for p in plans}) == 1
    torch.cuda.synchronize()
    # every transfer waits behind the sleep at once: one pinned buffer each
    assert grew >= len(batches), (
        f"{grew} pinned buffers ({ring} before): plans waited for the GPU instead of growing the ring "
        f"(host us per (plan, run): {host_us})"
    )
    _far_ahead_check(op, batches, outs, k, v)


@pytest.mark.parametrize("indices", ["host", "device"])
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_graph_replans_far_ahead_of_the_gpu_replay_every_batch(op: str, indices: str) -> None:
    """A CUDA-graph wrapper re-planned for each batch while the GPU is held back: every re-plan
    rewrites slot 0 (the captured kernel's addresses) by a transfer enqueued after the replays
    before it, from a pinned buffer not yet read, so every replay reads its own batch."""
    batches, k, v = _far_ahead_series(op, graph=True, on_device=indices == "device")
    w: tactix.PagedDecode | tactix.PagedPrefill = (
        tactix.PagedDecode("HND", backend="cuda_native", device=CUDA, use_cuda_graph=True)
        if op == "decode"
        else tactix.PagedPrefill("HND", backend="cuda_native", device=CUDA, use_cuda_graph=True)
    )
    first = batches[0]
    _far_ahead_plan(w, op, first)
    q = first.q.clone()
    out = torch.empty(q.shape, device=CUDA, dtype=torch.bfloat16)
    w.run(q, (k, v), out=out)  # loads the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, (k, v), out=out)
    torch.cuda.synchronize()
    staging = w.plan_object._staging
    ring = len(staging._host)
    outs, ptrs = [], set()
    with _no_collection():
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s on the device
        for x in batches:
            _far_ahead_plan(w, op, x)
            ptrs.add(w.plan_object._ptrs)
            assert w.plan_object._staging is staging
            q.copy_(x.q)
            out.fill_(float("nan"))
            graph.replay()
            outs.append(out.clone())
        grew = len(staging._host)
    torch.cuda.synchronize()
    assert len(ptrs) == 1, f"a CUDA-graph re-plan moved the captured kernel's metadata: {ptrs}"
    assert grew >= len(batches), f"{grew} pinned buffers ({ring} before): plans waited for the GPU"
    _far_ahead_check(op, batches, outs, k, v)


# -- GEMM ------------------------------------------------------------------------------------


def _gemm_case(m: int, n: int, k: int, dtype: torch.dtype, batch: int | None = None, bias: bool = False,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    a = torch.randn(*lead, m, k, generator=gen).to(CUDA, dtype)
    w = (torch.randn(*lead, n, k, generator=gen) / math.sqrt(k)).to(CUDA, dtype)
    b = w.transpose(-1, -2)  # k-major: the nn.Linear weight layout
    return a, b, (torch.randn(n, generator=gen).to(CUDA, dtype) if bias else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 64])
@pytest.mark.parametrize("nk", [(4096, 4096), (1000, 136), (40, 8)], ids=["4096", "ragged", "tiny"])
def test_gemm_matches_oracle(dtype: torch.dtype, m: int, nk: tuple[int, int]) -> None:
    n, k = nk
    for bias in (False, True):
        a, b, bias_t = _gemm_case(m, n, k, dtype, bias=bias, seed=m + n)
        out = torch.full((m, n), float("nan"), device=CUDA, dtype=dtype)
        g = tactix.Gemm(backend="cuda_native", device=CUDA)
        g.plan(m, n, k, a_dtype=dtype, bias_dtype=dtype if bias else None)
        g.run(a, b, out=out, bias=bias_t)
        ref = gemm_reference(a, b, bias=bias_t)
        assert not torch.isnan(out).any(), f"m{m} n{n} k{k} bias={bias}: unwritten output"
        err = relative_error(out, ref)
        assert err <= tolerance_for(dtype), f"m{m} n{n} k{k} bias={bias} {g.tactic}: relative error {err:.3e}"


def test_gemm_batched_and_split_k_paths() -> None:
    a, b, bias = _gemm_case(16, 512, 1024, torch.bfloat16, batch=3, bias=True, seed=3)
    ref = gemm_reference(a, b, bias=bias)
    for kernel, params in (("gemm", {"bn": 32, "bk": 128, "wn": 1, "wk": 4, "stages": 4}),
                           ("gemm_wgmma", {"bw": 64, "bk": 64, "stages": 4}),
                           ("gemm_wgmma", {"bw": 64, "bk": 128, "stages": 3, "tma": 2})):  # fmt: skip
        for splits in (0, 1, 2, 4, 8):
            g = tactix.Gemm(backend="cuda_native", device=CUDA)
            tactic = {"backend": "cuda_native", "kernel": kernel, "params": {**params, "splits": splits}}
            g.plan(16, 512, 1024, batch=3, bias_dtype=torch.bfloat16, tactic=tactic)
            if splits > 1:
                assert g.plan_object.splits == splits
            out = g.run(a, b, bias=bias)
            err = relative_error(out, ref)
            assert err <= tolerance_for(torch.bfloat16), f"{kernel} splits={splits}: relative error {err:.3e}"


@pytest.mark.parametrize("tma", [0, 1, 2], ids=["cp.async", "tma-w", "tma-w-a"])
@pytest.mark.parametrize("splits", [1, 4, 8])
@pytest.mark.parametrize("m", [1, 37, 64])
def test_wgmma_gemm_odd_n_and_unaligned_out(m: int, splits: int, tma: int) -> None:
    """The Hopper kernel writes pairs (one split) or quads (a cluster's column slices) of outputs
    where n and out's address allow, single elements elsewhere: with n odd and out one element into
    a NaN buffer, every element matches the oracle and nothing outside out is written. With tensor
    maps (tma 1, 2) the boxes past n, m and k read zeros."""
    n, k = 1001, 136 * 8
    a, b, bias = _gemm_case(m, n, k, torch.float16, bias=True, seed=m + splits)
    buf = torch.full((m * n + 65,), float("nan"), device=CUDA, dtype=torch.float16)
    out = buf[1 : 1 + m * n].view(m, n)
    g = tactix.Gemm(backend="cuda_native", device=CUDA)
    tactic = {"backend": "cuda_native", "kernel": "gemm_wgmma", "params": {"bw": 64, "bk": 64, "stages": 4,
                                                                             "splits": splits, "tma": tma}}  # fmt: skip
    g.plan(m, n, k, a_dtype=torch.float16, bias_dtype=torch.float16, tactic=tactic)
    g.run(a, b, out=out, bias=bias)
    torch.cuda.synchronize()
    assert bool(buf[0].isnan()) and bool(buf[1 + m * n :].isnan().all()), "wrote outside out"
    ref = gemm_reference(a, b, bias=bias)
    err = relative_error(out, ref)
    assert err <= tolerance_for(torch.float16), f"m{m} splits {splits}: relative error {err:.3e}"
    worst = float(((out.double() - ref).abs() / (ref.abs() + ref.pow(2).mean().sqrt() * 0.25)).max())
    assert worst <= 2.0**-7, f"m{m} splits {splits}: worst element off by {worst:.3e} of its scale"


def test_tma_gemm_maps_follow_the_tensors_they_are_given() -> None:
    """Tensor maps hold addresses, so the plan keeps one per tensor it is given: a new `a` (a new
    address) gets its own map, an `a` rewritten in place reuses its map and reads the new values,
    a second weight gets its own map, and the plan keeps a bounded number of maps however many
    tensors pass through. A CUDA graph captured with the maps replays with new values in place."""
    m, n, k = 64, 2048, 1024
    g = tactix.Gemm(backend="cuda_native", device=CUDA)
    tactic = {"backend": "cuda_native", "kernel": "gemm_wgmma", "params": {"bw": 64, "bk": 128, "stages": 4,
                                                                             "tma": 2}}  # fmt: skip
    g.plan(m, n, k, tactic=tactic)
    plan = g.plan_object
    a, b, _ = _gemm_case(m, n, k, torch.bfloat16, seed=11)
    _, b2, _ = _gemm_case(m, n, k, torch.bfloat16, seed=12)

    def check(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
        out = torch.full((m, n), float("nan"), device=CUDA, dtype=torch.bfloat16)
        g.run(x, w, out=out)
        err = relative_error(out, gemm_reference(x, w))
        assert err <= tolerance_for(torch.bfloat16), f"{what}: relative error {err:.3e}"

    check(a, b, "first call")
    a.copy_(torch.randn_like(a))  # same address, new values: the kept map reads them
    check(a, b, "a rewritten in place")
    check(a, b2, "a second weight")
    for i in range(plan._maps.kept + 4):  # fresh activations, each at its own address
        x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16) + i
        check(x, b, f"fresh a {i}")
    assert len(plan._maps) <= plan._maps.kept
    check(a, b, "the first a again, its map long dropped")
    _gemm_graph_replays_new_values(g, a, b, rewritten=(a, b))


def test_every_enumerated_gemm_tactic() -> None:
    backend = tactix.get_registry().get("cuda_native")
    for m in (1, 16, 32, 64):  # 1, 2 and 4 m-tiles (m = 32: (bn 128, bk 64, 4 x 2 warps) met ptxas's miscompile too)
        a, b, bias = _gemm_case(m, 4096, 4096, torch.bfloat16, bias=True, seed=m)
        ref = gemm_reference(a, b, bias=bias)
        probe = tactix.Gemm(backend="cuda_native", device=CUDA)
        probe.plan(m, 4096, 4096, bias_dtype=torch.bfloat16)
        for tactic in backend.tactics(probe.problem):
            if tactic.is_default:
                continue
            g = tactix.Gemm(backend="cuda_native", device=CUDA)
            g.plan(m, 4096, 4096, bias_dtype=torch.bfloat16, tactic=tactic)
            out = g.run(a, b, bias=bias)
            err = relative_error(out, ref)
            assert err <= tolerance_for(torch.bfloat16), f"m{m} {tactic}: relative error {err:.3e}"


def _gemm_graph_replays_new_values(g: tactix.Gemm, a: torch.Tensor, b: torch.Tensor,
                                   rewritten: tuple[torch.Tensor, ...]) -> None:  # fmt: skip
    """Capture one run into a CUDA graph, write new values into ``rewritten`` in place, replay
    into a NaN-filled out: the replay reads the new values."""
    out = torch.empty(a.shape[-2], b.shape[-1], device=CUDA, dtype=a.dtype)
    g.run(a, b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.run(a, b, out=out)
    for t in rewritten:
        t.copy_(torch.randn_like(t))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, gemm_reference(a, b)) <= tolerance_for(a.dtype)


def test_gemm_replays_in_a_cuda_graph_and_auto_routes_large_m_elsewhere() -> None:
    a, b, _ = _gemm_case(16, 4096, 4096, torch.bfloat16, seed=5)
    g = tactix.Gemm(backend="cuda_native", device=CUDA)
    g.plan(16, 4096, 4096)
    _gemm_graph_replays_new_values(g, a, b, rewritten=(a,))
    big = tactix.Gemm(device=CUDA)
    big.plan(256, 4096, 4096)
    assert big.backend != "cuda_native"
