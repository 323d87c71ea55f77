"""The trtllm plugin on an SM90 GPU: XQA decode and FMHAv2 prefill against the float64 oracle
(both layouts, GQA 1/4/8, page sizes 16/32/64, causal, chunked, windows, soft-cap), every cache
form FMHAv2 can be handed, bit-for-bit agreement with flashinfer's public entry points, CUDA-graph
capture and re-plan, no host sync in run(), and the warm-up.

Run on the H200 (after ``tactix warmup trtllm``, or the first tests compile for minutes):
    python -m pytest tests/gpu/test_trtllm_gpu.py -v
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import pytest
import torch

import tactix
from tactix.testing import attention_reference, relative_error, tolerance_for

pytestmark = pytest.mark.gpu

plugin = pytest.importorskip("tactix_trtllm.plugin", reason="plugins/trtllm is not installed")
direct = pytest.importorskip("tactix_trtllm.direct")
metadata = pytest.importorskip("tactix_trtllm.metadata")

CUDA = torch.device("cuda")
OUTSIDE = 1000.0  # written to every cache slot outside the batch: reading one spoils the result
RAGGED = [1, 15, 16, 17, 100, 513, 2048 + 7]  # length 1, around a page, several pages


@pytest.fixture(autouse=True)
def _needs_backend() -> None:
    reasons = tactix.get_registry().get("trtllm").environment()
    if reasons:
        pytest.skip(f"trtllm backend inactive: {reasons}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the trtllm plugin serves SM90 only")


class Case:
    """A paged batch in a cache of shuffled pages (among spare ones), outside slots poisoned.

    ``form``: ``tuple`` (k and v allocated apart), ``five_d`` (one [pages, 2, ...] tensor),
    ``two_pools`` (one [2, pages, ...] tensor, vLLM's), ``v_first`` (v's pool below k's),
    ``unaligned`` (k and v in one buffer, not a whole number of pages apart).
    """

    def __init__(self, kv_lens: list[int], q_lens: list[int] | None = None, *, page: int = 16, hq: int = 32,
                 hkv: int = 8, d: int = 128, layout: str = "HND", dtype: torch.dtype = torch.bfloat16,
                 form: str = "tuple", q_view: bool = False, seed: int = 0) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.kv_lens, self.q_lens = kv_lens, q_lens or [1] * len(kv_lens)
        self.decode = q_lens is None
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
        self.qo = i32([0, *itertools.accumulate(self.q_lens)])
        self.indptr, self.indices = i32(indptr), i32(indices)
        self.last = i32([(n - 1) % page + 1 for n in kv_lens])
        shape = (total, page, hkv, d) if layout == "NHD" else (total, hkv, page, d)
        mask = outside[:, :, None, None] if layout == "NHD" else outside[:, None, :, None]

        def fill() -> torch.Tensor:
            x = torch.randn(shape, generator=gen)
            return torch.where(mask, torch.where(x >= 0, OUTSIDE, -OUTSIDE), x).to(CUDA, dtype)

        k, v = fill(), fill()
        if form == "tuple":
            self.cache: Any = (k, v)
        elif form == "five_d":
            self.cache = torch.stack([k, v], dim=1)
            k, v = self.cache[:, 0], self.cache[:, 1]
        elif form in ("two_pools", "v_first"):
            pools = torch.stack([v, k] if form == "v_first" else [k, v])
            k, v = (pools[1], pools[0]) if form == "v_first" else (pools[0], pools[1])
            self.cache = (k, v)
        elif form == "unaligned":  # one buffer, v 64 elements past a whole number of pages after k
            n = k.numel()
            flat = torch.empty(2 * n + 64, device=CUDA, dtype=dtype)
            k2, v2 = flat[:n].view(shape), flat[n + 64 :].view(shape)
            k2.copy_(k)
            v2.copy_(v)
            k, v = k2, v2
            self.cache = (k, v)
        else:
            raise ValueError(form)
        self.k, self.v = k, v
        rows = int(self.qo[-1])
        q = torch.randn(rows, hq, d, generator=gen).to(CUDA, dtype)
        if q_view:  # q as the first columns of a fused QKV projection output
            fused = torch.zeros(rows, (hq + 2 * hkv) * d, device=CUDA, dtype=dtype)
            self.q = fused[:, : hq * d].view(rows, hq, d)
            self.q.copy_(q)
        else:
            self.q = q

    def wrapper(self, graph: bool = False) -> Any:
        cls = tactix.PagedDecode if self.decode else tactix.PagedPrefill
        return cls(self.layout, backend="trtllm", device=CUDA, use_cuda_graph=graph)  # type: ignore[arg-type]

    def plan(self, w: Any, **kw: Any) -> None:
        meta = (self.indptr, self.indices, self.last)
        args = meta if self.decode else (self.qo, *meta)
        w.plan(*args, self.hq, self.hkv, self.d, self.page, q_data_type=self.dtype, **kw)

    def reference(self, **kw: Any) -> torch.Tensor:
        ref, _ = attention_reference(
            self.q, self.k, self.v, self.qo, self.indptr, self.indices, self.last, kv_layout=self.layout,
            causal=kw.get("causal", False), sm_scale=kw.get("sm_scale", 1 / math.sqrt(self.d)),
            window_left=kw.get("window_left", -1), logits_soft_cap=kw.get("logits_soft_cap") or 0.0,
        )  # fmt: skip
        return ref

    def out(self) -> torch.Tensor:
        return torch.full((int(self.qo[-1]), self.hq, self.d), float("nan"), device=CUDA, dtype=self.dtype)

    def check(self, w: Any, what: str, out: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        """Run with a NaN-poisoned output (unless given one already run) and compare with the oracle."""
        if out is None:
            out = self.out()
            w.run(self.q, self.cache, out=out)
        torch.cuda.synchronize()
        name = (f"{what}: {'decode' if self.decode else 'prefill'} d{self.d} p{self.page} {self.layout} "
                f"h{self.hq}/{self.hkv} {str(self.dtype)[6:]} kv {self.kv_lens[:5]} q {self.q_lens[:5]} "
                f"tactic {w.tactic} {kw}")  # fmt: skip
        assert not torch.isnan(out).any(), f"{name}: {int(torch.isnan(out).sum())} output elements unwritten"
        err = relative_error(out, self.reference(**kw))
        assert err <= tolerance_for(self.dtype), f"{name}: relative error {err:.3e}"
        return out


# -- decode (XQA) -----------------------------------------------------------------------------


@pytest.mark.parametrize("page", [16, 32, 64])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
def test_decode_matches_oracle(page: int, layout: str, heads: tuple[int, int]) -> None:
    case = Case(RAGGED, page=page, hq=heads[0], hkv=heads[1], layout=layout, seed=page)
    w = case.wrapper()
    case.plan(w)
    assert w.backend == "trtllm" and w.tactic == plugin.xqa_tactic("auto", True)
    case.check(w, "decode")


@pytest.mark.parametrize(
    "config",
    [{"dtype": torch.float16}, {"d": 64}, {"d": 256, "hkv": 4}, {"form": "five_d", "layout": "NHD"},
     {"q_view": True}, {"kv_lens": [32768, 5]}, {"kv_lens": [16 + 9 * i for i in range(64)]}],
    ids=["f16", "d64", "d256", "five_d", "q_view", "long", "b64"],
)  # fmt: skip
def test_decode_dtypes_dims_forms_and_batches(config: dict[str, Any]) -> None:
    config = dict(config)
    case = Case(config.pop("kv_lens", RAGGED), **config)
    w = case.wrapper()
    case.plan(w)
    case.check(w, "decode")


@pytest.mark.parametrize("window", [0, 64, 1000])
def test_decode_sliding_window(window: int) -> None:
    case = Case(RAGGED, seed=5)
    w = case.wrapper()
    case.plan(w, window_left=window)
    case.check(w, "decode", window_left=window)


def test_every_xqa_tactic_is_correct_and_deterministic() -> None:
    for lens in (RAGGED, [8192], [300] * 256):  # mixed, one long request (splits), a full GPU (no split)
        case = Case(lens, seed=len(lens))
        tactics = plugin.tactix_tactics(_problem(case))
        assert len(tactics) == 6
        for tactic in [tactix.Tactic.default("trtllm"), *tactics]:
            w = case.wrapper()
            case.plan(w, tactic=tactic)
            first = case.check(w, f"tactic {tactic}")
            again = case.out()
            w.run(case.q, case.cache, out=again)
            assert torch.equal(first, again), f"{tactic} on {lens[:3]}: run-to-run difference"


def _problem(case: Case) -> Any:
    w = case.wrapper()
    case.plan(w)
    return w.problem


def test_decode_agrees_bitwise_with_flashinfer_public_xqa() -> None:
    case = Case(RAGGED, seed=11)
    w = case.wrapper()
    case.plan(w)
    ours = case.check(w, "decode")
    theirs = case.out()
    inputs = {"q": case.q, "k_cache": case.k, "v_cache": case.v, "kv_indptr": case.indptr,
              "kv_indices": case.indices, "kv_last_page_len": case.last, "qo_indptr": case.qo,
              "causal": False, "sm_scale": 1 / math.sqrt(case.d), "out": theirs}  # fmt: skip
    [(label, call)] = direct.attention_references("decode", inputs)
    call()
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs), f"{label}: {int((ours != theirs).sum())} elements differ"


# -- prefill (FMHAv2) -------------------------------------------------------------------------

Q_RAGGED = [1, 15, 16, 2, 100, 513, 700]  # within RAGGED's kv lengths: chunked for most requests


@pytest.mark.parametrize("page", [16, 32, 64])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
def test_prefill_matches_oracle(page: int, layout: str, heads: tuple[int, int]) -> None:
    fresh = Case(RAGGED, RAGGED, page=page, hq=heads[0], hkv=heads[1], layout=layout, seed=page)
    chunked = Case(RAGGED, Q_RAGGED, page=page, hq=heads[0], hkv=heads[1], layout=layout, seed=page + 1)
    for case in (fresh, chunked):
        w = case.wrapper()
        case.plan(w, causal=True)
        assert w.backend == "trtllm" and w.tactic == plugin.FMHA_TACTIC
        case.check(w, "causal prefill", causal=True)


@pytest.mark.parametrize(
    "features",
    [{"causal": False}, {"causal": True, "window_left": 64}, {"causal": True, "window_left": 0},
     {"causal": True, "logits_soft_cap": 30.0}, {"causal": True, "sm_scale": 0.3}],
    ids=["non-causal", "win64", "win0", "cap30", "scale0.3"],
)  # fmt: skip
def test_prefill_masks_window_softcap_scale(features: dict[str, Any]) -> None:
    case = Case(RAGGED, Q_RAGGED, seed=7)
    w = case.wrapper()
    case.plan(w, **features)
    case.check(w, f"prefill {features}", **features)


@pytest.mark.parametrize("form", ["tuple", "five_d", "two_pools", "v_first", "unaligned"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_prefill_serves_every_cache_form(
    form: str, layout: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = Case(RAGGED, Q_RAGGED, form=form, layout=layout, seed=13, q_view=form == "five_d")
    w = case.wrapper()
    case.plan(w, causal=True)
    monkeypatch.setattr(plugin, "_gather_warned", False)  # the staging-pool warning comes once per process
    with caplog.at_level(logging.WARNING, logger="tactix_trtllm"):
        case.check(w, f"prefill, {form} cache", causal=True)
    [entry] = w.plan_object._caches.values()  # the (k, v) pair run() was handed
    mode = entry[2].mapping.mode
    expected = {"five_d": "shared", "two_pools": "offsets", "v_first": "offsets", "unaligned": "gather"}
    assert form == "tuple" or mode == expected[form], (form, mode)
    assert (mode == "gather") == any("staging pool" in r.getMessage() for r in caplog.records)


def test_prefill_agrees_bitwise_with_flashinfer_public_fmha_v2() -> None:
    case = Case(RAGGED, Q_RAGGED, form="five_d", seed=17)
    w = case.wrapper()
    case.plan(w, causal=True)
    ours = case.check(w, "prefill", causal=True)
    theirs = case.out()
    inputs = {"q": case.q, "k_cache": case.k, "v_cache": case.v, "kv_indptr": case.indptr,
              "kv_indices": case.indices, "kv_last_page_len": case.last, "qo_indptr": case.qo,
              "causal": True, "sm_scale": 1 / math.sqrt(case.d), "out": theirs}  # fmt: skip
    [(label, call)] = direct.attention_references("prefill", inputs)
    call()
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs), f"{label}: {int((ours != theirs).sum())} elements differ"


# -- CUDA graphs, host syncs, warm-up ------------------------------------------------------------


def _capture(w: Any, case: Case, out: torch.Tensor) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w.run(case.q, case.cache, out=out)  # the first run with a cache prepares it outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(case.q, case.cache, out=out)
    return graph


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("form", ["tuple", "five_d", "unaligned"])
def test_run_captures_replays_and_replans_in_a_cuda_graph(op: str, form: str) -> None:
    first = Case([5, 300, 17, 1000], None if op == "decode" else [5, 40, 17, 38], form=form, seed=19)
    w = first.wrapper(graph=True)
    kw: dict[str, Any] = {} if op == "decode" else {"causal": True}
    first.plan(w, **kw)
    out = first.out()
    graph = _capture(w, first, out)
    for round_ in range(2):  # fresh q and cache contents, same buffers
        first.q.copy_(torch.randn_like(first.q))
        first.k.copy_(torch.where(first.k.abs() >= OUTSIDE, first.k, torch.randn_like(first.k)))
        out.fill_(float("nan"))
        graph.replay()
        first.check(w, f"replay {round_}", out=out, **kw)
    # a new batch of the same shape class is planned into the captured buffers and replayed
    # (its pages drawn from the first cache, which is refilled without poison; q is the captured buffer)
    second = Case([900, 2, 64, 18], None if op == "decode" else [50, 2, 30, 18], form="tuple", seed=23)
    second.cache, second.k, second.v, second.q = first.cache, first.k, first.v, first.q
    for t in (second.k, second.v, second.q):
        t.copy_(torch.randn_like(t))
    second.plan(w, **kw)
    out.fill_(float("nan"))
    graph.replay()
    second.check(w, "replay after a re-plan", out=out, **kw)
    too_long = Case([5, 300, 17, 5000], None if op == "decode" else [5, 40, 17, 38], form="tuple", seed=29)
    with pytest.raises(tactix.UnsupportedProblemError, match="captured"):
        too_long.plan(w, **kw)


def test_decode_of_many_rows_gathers_host_indices_on_the_device_eagerly_and_in_a_cuda_graph() -> None:
    """More requests than `metadata.HOST_TABLE_ROWS` with host page indices: the plan sends them as
    CSR and gathers the block table on the device. Eager runs and replays of a captured graph
    (re-planned with new lengths into the captured buffers) match the oracle; slots outside the
    batch hold poison, so a row that read past its own pages would show."""
    rows = 24
    lens = [40 + 37 * i for i in range(rows)]  # up to 891 keys: one kv bucket
    first = Case(lens, None, form="tuple", seed=41)
    assert rows > metadata.HOST_TABLE_ROWS
    eager = first.wrapper()
    first.plan(eager)
    first.check(eager, "eager, CSR gathered on the device")
    w = first.wrapper(graph=True)
    first.plan(w)
    out = first.out()
    graph = _capture(w, first, out)
    graph.replay()
    first.check(w, "replay", out=out)
    second = Case(lens[::-1], None, form="tuple", seed=43)  # other pages of the same cache, other lengths a row
    second.cache, second.k, second.v, second.q = first.cache, first.k, first.v, first.q
    for t in (second.k, second.v, second.q):
        t.copy_(torch.randn_like(t))
    second.plan(w)
    out.fill_(float("nan"))
    graph.replay()
    second.check(w, "replay after a re-plan", out=out)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_run_makes_no_host_sync(op: str) -> None:
    case = Case(RAGGED, None if op == "decode" else Q_RAGGED, form="tuple", seed=31, q_view=True)
    w = case.wrapper()
    kw = {} if op == "decode" else {"causal": True}
    case.plan(w, **kw)
    out = case.out()
    w.run(case.q, case.cache, out=out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.run(case.q, case.cache, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    case.check(w, "no sync", out=out, **kw)


def test_warmup_compiles_with_progress_and_then_finds_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.WARMUP_ENV, "ops=decode;dtypes=bfloat16;group_sizes=2")
    seen: list[tuple[int, int, str]] = []
    plugin.tactix_warmup(None, lambda *a: seen.append(a))
    assert (
        len(seen) == 1 and seen[0][:2] == (1, 1) and "XQA decode (bfloat16, page 16, head dim 128, GQA 2)" in seen[0][2]
    )
    again: list[tuple[int, int, str]] = []
    assert plugin.tactix_warmup(None, lambda *a: again.append(a)) == 0
    assert again[0][2].endswith("found in the cache")
    case = Case(RAGGED, hq=16, hkv=8, seed=37)  # GQA 2: the module just compiled, already loaded
    w = case.wrapper()
    case.plan(w)
    assert not w.plan_object.built
    case.check(w, "decode after warm-up")
