"""The trtllm plugin's CPU-side contract: metadata conversion, cache mappings, check reasons,
tactics, warm-up bookkeeping, and a clean import without flashinfer or a GPU."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("tactix_trtllm", reason="plugins/trtllm is not installed (scripts/setup.sh installs it)")

from tactix_trtllm import library, metadata, plugin
from tactix_trtllm.metadata import Geometry, PoolMapping

import tactix
from tactix.ops import DecodeProblem, GemmProblem, PrefillProblem

PAGE = 16
# kv lengths 1, page - 1, page, page + 1 and several pages; q lengths within them
KV_LENS = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5]
Q_LENS = [1, 7, PAGE, 2, 3 * PAGE + 5]

BASE = dict(
    device_type="cuda", num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=PAGE,
    kv_layout="HND", q_dtype="bfloat16", kv_dtype="bfloat16", out_dtype="bfloat16", sm_scale=0.088,
    window_left=-1, logits_soft_cap=0.0, return_lse=False, batch_size=5, max_kv_len=3 * PAGE + 5,
)  # fmt: skip


def decode(**changes: Any) -> DecodeProblem:
    return DecodeProblem(**{**BASE, **changes})


def prefill(**changes: Any) -> PrefillProblem:
    fields = {**BASE, "causal": True, "num_qo_tokens": sum(Q_LENS), "max_qo_len": max(Q_LENS)}
    return PrefillProblem(**{**fields, **changes})


def make_batch(kv_lens: list[int], q_lens: list[int] | None, seed: int = 0) -> tuple[tactix.PagedBatch, list[int]]:
    """A batch whose pages are a shuffled selection of a larger cache; returns it and the indices."""
    pages = [-(-n // PAGE) for n in kv_lens]
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randperm(sum(pages) + 9, generator=gen)[: sum(pages)].to(torch.int32)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    batch = tactix.PagedBatch.build(
        qo_indptr=None if q_lens is None else i32([0, *itertools.accumulate(q_lens)]),
        kv_indptr=i32([0, *itertools.accumulate(pages)]), kv_indices=indices,
        kv_last_page_len=i32([(n - 1) % PAGE + 1 for n in kv_lens]), page_size=PAGE, device=torch.device("cpu"),
        causal=q_lens is not None,
    )  # fmt: skip
    return batch, indices.tolist()


def _written(batch: tactix.PagedBatch, g: Geometry, host_table: bool,
             host_csr: bool = False) -> tuple[list[int], Any, int]:  # fmt: skip
    """What a plan sends: `metadata.write_metadata` into a CPU buffer as into the pinned staging
    buffer (filled with -7 first, so entries it leaves alone show), its layout and the count a
    plan transfers. ``host_table``: host indices laid out as the table; ``host_csr``: host indices
    sent as they are (gathered on the device); neither: device indices."""
    layout = metadata.metadata_sections(g)
    buf = torch.full((layout.total,), -7, dtype=torch.int32)
    indices = batch.kv_indices.contiguous()
    at = indices.data_ptr() if host_table or host_csr else None
    metadata.write_metadata(buf.data_ptr(), batch, g, layout, at, host_table)
    return buf.tolist(), layout, metadata.metadata_entries(layout, g, batch, host_table)


def _table(written: list[int], layout: Any, g: Geometry) -> list[list[int]]:
    at = layout.offset("pages")
    return [written[at + r * g.width : at + (r + 1) * g.width] for r in range(g.rows)]


# -- metadata conversion -------------------------------------------------------------------------


def test_exact_geometry_block_table_and_lengths_of_a_ragged_prefill() -> None:
    batch, indices = make_batch(KV_LENS, Q_LENS)
    g = metadata.geometry(batch, decode=False, graph=False)
    assert g == Geometry(rows=5, width=4, max_q=53, max_kv=53, tokens=sum(Q_LENS))
    written, layout, _ = _written(batch, g, host_table=True)
    # by hand: pages 1, 1, 1, 2, 4 -> rows of the indices in order, zero-padded to 4 columns
    expected = [
        [*indices[0:1], 0, 0, 0],
        [*indices[1:2], 0, 0, 0],
        [*indices[2:3], 0, 0, 0],
        [*indices[3:5], 0, 0],
        indices[5:9],
    ]
    assert _table(written, layout, g) == expected
    assert metadata.sequence_lengths(batch, g.rows) == [1, 15, 16, 17, 53]
    assert metadata.cumulative_q_lengths(batch, g.rows) == [0, 1, 8, 24, 26, 79]
    assert metadata.cumulative_kv_lengths(batch, g.rows) == [0, 1, 16, 32, 49, 102]
    assert metadata.row_starts(batch, g.rows) == [0, 1, 2, 3, 5]


def test_cuda_graph_geometry_pads_prefill_rows_and_keeps_decode_rows_exact() -> None:
    batch, indices = make_batch(KV_LENS, Q_LENS)
    g = metadata.geometry(batch, decode=False, graph=True)
    # rows 5 -> 8, longest kv 53 -> 64 (4 pages), longest q 53 -> 64; q rows stay exact
    assert g == Geometry(rows=8, width=4, max_q=64, max_kv=64, tokens=79)
    assert metadata.sequence_lengths(batch, 8) == [1, 15, 16, 17, 53, 0, 0, 0]
    assert metadata.cumulative_q_lengths(batch, 8) == [0, 1, 8, 24, 26, 79, 79, 79, 79]
    assert metadata.cumulative_kv_lengths(batch, 8) == [0, 1, 16, 32, 49, 102, 102, 102, 102]
    assert metadata.row_starts(batch, 8) == [0, 1, 2, 3, 5, 9, 9, 9]
    written, layout, _ = _written(batch, g, host_table=True)
    table = _table(written, layout, g)
    assert table[4] == indices[5:9] and not any(any(row) for row in table[5:])  # padding rows are empty

    dec, _ = make_batch([PAGE + 1, 100], None)
    assert metadata.geometry(dec, decode=True, graph=True) == Geometry(rows=2, width=8, max_q=1, max_kv=128, tokens=2)
    assert metadata.geometry(dec, decode=True, graph=False) == Geometry(rows=2, width=7, max_q=1, max_kv=100, tokens=2)


def test_a_graph_replan_must_fit_the_captured_sizes() -> None:
    batch, _ = make_batch(KV_LENS, Q_LENS)
    captured = metadata.geometry(batch, decode=False, graph=True)
    assert metadata.refit_reasons(captured, batch, decode=False) == []
    same_tokens, _ = make_batch([60, 30, 17, 40], [40, 20, 9, 10])  # 79 tokens, 4 requests, longest kv 60
    assert metadata.refit_reasons(captured, same_tokens, decode=False) == []
    longer, _ = make_batch([65, 30], [60, 19])
    reasons = metadata.refit_reasons(captured, longer, decode=False)
    assert any("longest kv sequence 65 above the captured 64" in r for r in reasons)
    fewer, _ = make_batch([20], [10])
    reasons = metadata.refit_reasons(captured, fewer, decode=False)
    assert any("10 query tokens differ from the captured 79" in r for r in reasons)
    dec, _ = make_batch([5, 6, 7], None)
    g = metadata.geometry(dec, decode=True, graph=True)
    other, _ = make_batch([5, 6], None)
    assert any("batch size 2 differs from the captured 3" in r for r in metadata.refit_reasons(g, other, decode=True))


def test_packed_metadata_sections_are_aligned_and_hold_each_array() -> None:
    batch, _ = make_batch(KV_LENS, Q_LENS)
    g = metadata.geometry(batch, decode=False, graph=True)
    written, layout, count = _written(batch, g, host_table=True)
    names = ("seq_lens", "cum_q", "cum_kv", "row_starts", "pages")
    offsets = [layout.offset(n) for n in names]
    assert all(o % 32 == 0 for o in offsets) and offsets == sorted(offsets)  # 128-byte aligned, in order
    at = dict(zip(names, offsets, strict=True))
    assert written[at["seq_lens"] : at["seq_lens"] + 8] == metadata.sequence_lengths(batch, 8)
    assert written[at["cum_q"] : at["cum_q"] + 9] == metadata.cumulative_q_lengths(batch, 8)
    assert written[at["cum_kv"] : at["cum_kv"] + 9] == metadata.cumulative_kv_lengths(batch, 8)
    assert written[at["row_starts"] : at["row_starts"] + 8] == metadata.row_starts(batch, 8)
    assert count == at["pages"] + 8 * 4  # the transfer ends with the table
    # sized by the geometry alone (a CUDA-graph re-plan keeps the captured one, and every address)
    assert layout.total == at["pages"] + 8 * 4 + 4 + (-(8 * 4 + 4) % 32)


def test_device_indices_leave_the_table_to_the_gather_and_end_with_width_zeros() -> None:
    """With page indices on the device the plan copies them after the transfer: the host writes
    the small arrays and the ``width`` zeros after where the indices go, and sends no more."""
    batch, indices = make_batch(KV_LENS, Q_LENS)
    g = metadata.geometry(batch, decode=False, graph=False)
    written, layout, count = _written(batch, g, host_table=False)
    pages, nnz = layout.offset("pages"), len(indices)
    assert count == pages + nnz + g.width
    assert written[pages : pages + nnz] == [-7] * nnz  # left to the device copy
    assert written[pages + nnz : pages + nnz + g.width] == [0] * g.width


def test_host_indices_of_many_rows_go_as_csr_for_the_device_gather() -> None:
    """A batch of more than `HOST_TABLE_ROWS` requests with host indices sends them as they are
    (CSR) in the same transfer, then ``width`` zeros, and gathers the table on the device: no
    host-side table to zero and fill row by row. Up to that many rows the table is laid out on
    the host; device indices never are."""
    rows = metadata.HOST_TABLE_ROWS
    few, _ = make_batch([40] * rows, None)
    many, indices = make_batch([40 + r for r in range(rows + 1)], None, seed=2)
    assert metadata.table_on_host(few, metadata.geometry(few, decode=True, graph=False))
    g = metadata.geometry(many, decode=True, graph=False)
    assert not metadata.table_on_host(many, g)
    written, layout, count = _written(many, g, host_table=False, host_csr=True)
    pages, nnz = layout.offset("pages"), len(indices)
    assert count == pages + nnz + g.width
    assert written[pages : pages + nnz] == indices
    assert written[pages + nnz : pages + nnz + g.width] == [0] * g.width
    on_device = dataclasses.replace(many, kv_indices=many.kv_indices.to("meta"))
    assert not metadata.table_on_host(on_device, metadata.geometry(few, decode=True, graph=False))


def test_the_device_gather_lays_out_the_same_rows_as_the_host_table() -> None:
    """`Staging.gather`'s rule (`tactix.plugin.gather_table`) over what the plan's slot holds
    (the indices, then `width` zeros) gives each request's pages as the host table does."""
    from tactix.plugin import gather_table
    from tactix.staging import csr_table

    batch, indices = make_batch(KV_LENS, Q_LENS, seed=3)
    g = Geometry(rows=8, width=4, max_q=64, max_kv=64, tokens=sum(Q_LENS))
    written, layout, _ = _written(batch, g, host_table=True)
    host = _table(written, layout, g)
    ext = torch.cat([batch.kv_indices, torch.zeros(g.width, dtype=torch.int32)])
    out = torch.full((g.rows, g.width), -1, dtype=torch.int32)
    gather_table(ext, torch.tensor(metadata.row_starts(batch, g.rows), dtype=torch.int32), out)
    pages = [-(-n // PAGE) for n in KV_LENS]
    for r, n in enumerate(pages):  # a request's own pages agree; entries past them are valid page numbers
        assert out[r, :n].tolist() == host[r][:n]
    assert int(out.min()) >= 0 and set(out.flatten().tolist()) <= {*indices, 0}
    assert not out[len(pages) :].any()  # padding rows start past the last entry: all zero
    # the device kernel's rule (`csr_table`: a row ends at the next row's start) gives the same rows
    kernel = csr_table(batch.kv_indices, metadata.row_starts(batch, g.rows), batch.num_page_entries, g.width)
    for r, n in enumerate(pages):
        assert kernel[r, :n].tolist() == host[r][:n], f"request {r}"


# -- caches: what the kernels can address ------------------------------------------------------


def _pages(layout: str, pages: int = 10, heads: int = 4, dim: int = 64) -> tuple[int, ...]:
    return (pages, PAGE, heads, dim) if layout == "NHD" else (pages, heads, PAGE, dim)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_pool_mapping_of_the_cache_forms(layout: str) -> None:
    shape = _pages(layout)
    block = PAGE * 4 * 64
    stacked = torch.empty(shape[0], 2, *shape[1:], dtype=torch.bfloat16)  # [pages, 2, ...]: interleaved
    k, v = stacked[:, 0], stacked[:, 1]
    m = metadata.pool_mapping(k.data_ptr(), v.data_ptr(), k.stride(), v.stride(), shape, layout, 2)
    assert m == PoolMapping("shared", False, 2, 0, 2, 1)

    vllm = torch.empty(2, *shape, dtype=torch.bfloat16)  # [2, pages, ...]: K pool then V pool
    k, v = vllm[0], vllm[1]
    m = metadata.pool_mapping(k.data_ptr(), v.data_ptr(), k.stride(), v.stride(), shape, layout, 2)
    assert m == PoolMapping("offsets", False, 1, 0, 1, 10)
    m = metadata.pool_mapping(v.data_ptr(), k.data_ptr(), v.stride(), k.stride(), shape, layout, 2)  # v below k
    assert m == PoolMapping("offsets", True, 1, 10, 1, 0)

    base = 1 << 20
    m = metadata.pool_mapping(base, base + 10 * block * 2 + 512, k.stride(), k.stride(), shape, layout, 2)
    assert m.mode == "gather" and "not a whole number of pages" in m.why
    strided = torch.empty(shape[0], shape[1], shape[2], 128, dtype=torch.bfloat16)[..., :64]  # padded heads
    m = metadata.pool_mapping(base, base + 40 * block * 2, strided.stride(), strided.stride(), shape, layout, 2)
    assert m.mode == "gather" and "not dense" in m.why


def test_expanded_and_gather_offsets() -> None:
    table = torch.tensor([[3, 7, 0], [5, 0, 0]], dtype=torch.int32)
    out = torch.empty(2, 2, 3, dtype=torch.int32)
    metadata.expand_offsets(table, PoolMapping("offsets", True, 1, 10, 1, 0), out=out)
    assert out[:, 0].tolist() == [[13, 17, 10], [15, 10, 10]] and out[:, 1].tolist() == table.tolist()
    metadata.expand_offsets(table, PoolMapping("shared", False, 2, 0, 2, 1), out=out)
    assert out[0].tolist() == [[6, 14, 0], [7, 15, 1]]
    g = metadata.gather_offsets(2, 3)
    assert g.tolist() == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]] and g.is_contiguous()


def test_xqa_reads_one_set_of_strides() -> None:
    stacked = torch.empty(10, 2, 4, PAGE, 128)
    k, v = stacked[:, 0], stacked[:, 1]
    assert metadata.xqa_cache_reasons(k.stride(), v.stride(), "HND", 128) == []
    other = torch.empty(10, 4, PAGE, 128)
    reasons = metadata.xqa_cache_reasons(k.stride(), other.stride(), "HND", 128)
    assert reasons and "same strides" in reasons[0]
    padded = torch.empty(10, 4, PAGE, 136)[..., :128]
    assert any("multiples of head_dim" in r for r in metadata.xqa_cache_reasons(padded.stride(), padded.stride(),
                                                                               "HND", 128))  # fmt: skip


# -- check reasons -------------------------------------------------------------------------------

H200 = (9, 0)


def test_what_xqa_refuses() -> None:
    assert plugin.attention_reasons(decode(), H200) == []
    cases = {
        "page size 8: XQA is compiled for page sizes 16, 32, 64 and 128 only": decode(page_size=8),
        "XQA returns no LSE": decode(return_lse=True),
        "XQA has no logits soft-cap": decode(logits_soft_cap=30.0),
        "head dim 72: XQA needs a multiple of 16": decode(head_dim_qk=72, head_dim_vo=72),
        "head dim 96: not tested with XQA": decode(head_dim_qk=96, head_dim_vo=96),
        "head_dim_vo must equal head_dim_qk": decode(head_dim_vo=64),
        "GQA ratio 16 above 8": decode(num_qo_heads=64, num_kv_heads=4),
        "or float8_e4m3fn (got q bfloat16, kv float8_e5m2": decode(kv_dtype="float8_e5m2"),
        "(got q float16, kv float16, out float32)": decode(q_dtype="float16", kv_dtype="float16", out_dtype="float32"),
    }
    for text, problem in cases.items():
        reasons = plugin.attention_reasons(problem, H200)
        assert any(text in r for r in reasons), (text, reasons)
    assert plugin.attention_reasons(decode(window_left=64), H200) == []  # compiled with SLIDING_WINDOW
    assert plugin.attention_reasons(decode(kv_dtype="float8_e4m3fn"), H200) == []  # an e4m3 cache
    assert plugin.FP8_PREFILL_UNSUPPORTED in plugin.attention_reasons(prefill(kv_dtype="float8_e4m3fn"), H200)


def test_xqa_fp8_tactics_and_the_fp8_mma_switch() -> None:
    assert plugin.params_reasons(plugin.xqa_tactic("auto", True, True), "decode") == []
    assert (
        "fp8_mma must be true or false"
        in plugin.params_reasons(
            tactix.Tactic(backend="trtllm", kernel="xqa", params={"multi_block": "auto", "pdl": True, "fp8_mma": 1}),
            "decode",
        )[0]
    )
    # a 16-bit tactic prints as before (tactics stored by earlier versions read back the same)
    assert str(plugin.xqa_tactic("auto", True)) == "trtllm:xqa(multi_block=auto,pdl=true)"


def _scale_plan(fp8: bool) -> Any:
    """An XqaDecodePlan's scale state without a GPU (what _scaled reads)."""
    p = plugin.XqaDecodePlan.__new__(plugin.XqaDecodePlan)
    p._q_scale, p._fp8, p.device = 0.7, fp8, torch.device("cpu")
    p._q_buf = torch.empty(1)  # (made at plan on the device)
    p._head = (fp8, 132, 8, 0, 0.7, None)
    p._tail = (None, None, "table", 1024, "lens", 4, 1.0, None, 1, None, None, "sem", "scratch", True)
    return p


@pytest.mark.parametrize("form", ["float", "tensor", "mixed"])
@pytest.mark.parametrize("fp8", [True, False])
def test_xqa_scale_arguments_give_the_dequantization_semantics(form: str, fp8: bool) -> None:
    """logits (q . k) k_scale sm_scale and output from v v_scale, through XQA's q_scale and its
    one kv_scale (which it applies to Q.K and to the output of a quantized cache only)."""
    k, v = 0.5, 4.0
    k_arg: Any = torch.tensor(k) if form in ("tensor", "mixed") else k
    v_arg: Any = torch.tensor([v]) if form == "tensor" else v
    head, tail, after = _scale_plan(fp8)._scaled(k_arg, v_arg)
    q_scale = float(head[5]) if head[5] is not None else head[4]
    if head[5] is not None:
        assert head[4] == 1.0  # a device q scale replaces the host one
    kv = float(tail[7]) if tail[7] is not None else tail[6]
    if fp8:
        assert q_scale * kv == pytest.approx(0.7 * k) and kv == pytest.approx(v) and after is None
    else:
        assert q_scale == pytest.approx(0.7 * k) and tail[6] == 1.0 and tail[7] is None
        assert float(after) == pytest.approx(v)  # type: ignore[arg-type]
    # the Hopper fp8 kernel reads device scales before its programmatic-dependent-launch wait
    assert tail[13] is (not (fp8 and head[5] is not None))


def test_what_fmha_v2_refuses() -> None:
    assert plugin.attention_reasons(prefill(), H200) == []
    assert plugin.attention_reasons(prefill(logits_soft_cap=30.0, window_left=100), H200) == []
    cases = {
        "FMHAv2 returns softmax statistics only for contiguous K/V": prefill(return_lse=True),
        "sliding window is causal only": prefill(causal=False, window_left=64),
        "page size 24: FMHAv2 needs a power of two": prefill(page_size=24),
        "page size 8: not tested with FMHAv2": prefill(page_size=8),
        "head dim 72: flashinfer builds SM90 FMHAv2 kernels": prefill(head_dim_qk=72, head_dim_vo=72),
        "kv length >= its query length": prefill(causal=False, max_qo_len=64, max_kv_len=40),
    }
    for text, problem in cases.items():
        reasons = plugin.attention_reasons(problem, H200)
        assert any(text in r for r in reasons), (text, reasons)
    # with the real batch at hand the check looks at each request, not just the maxima
    batch, _ = make_batch([40, 8], None)
    q_longer = tactix.PagedBatch.build(
        qo_indptr=torch.tensor([0, 30, 46], dtype=torch.int32), kv_indptr=torch.tensor(batch.kv_indptr_list),
        kv_indices=batch.kv_indices, kv_last_page_len=torch.tensor(batch.kv_last_page_len_list), page_size=PAGE,
        device=torch.device("cpu"), causal=False,
    )  # fmt: skip
    problem = prefill(causal=False, batch_size=2, max_kv_len=40, num_qo_tokens=46, max_qo_len=30)
    assert plugin.attention_reasons(problem, H200) == []
    assert any("kv length >= its query length" in r for r in plugin.attention_reasons(problem, H200, q_longer))


def test_compute_capabilities_outside_sm90_are_refused_with_what_is_untested() -> None:
    sm100 = plugin.attention_reasons(decode(), (10, 0))
    assert sm100 == ["compute capability 10.0: SM100 trtllm-gen path: not tested on this project's hardware "
                     "(flashinfer serves compute capability 10.x through trtllm-gen cubins; this plugin claims SM90 "
                     "XQA/FMHAv2 only)"]  # fmt: skip
    assert "SM120 XQA/FMHAv2 builds: not tested" in plugin.attention_reasons(prefill(), (12, 0))[0]
    assert "need SM90 (Hopper)" in plugin.attention_reasons(prefill(), (8, 0))[0]
    assert plugin.capability_reasons(None) == []  # no GPU: the environment says why already
    caps = plugin.tactix_backends()[0]
    assert caps.decode is not None and caps.decode.compute_capabilities == frozenset({"9.0"})


def test_gemm_is_not_implemented_and_says_why() -> None:
    spec = plugin.tactix_backends()[0]
    assert spec.gemm is None and spec.preference == 0
    gemm = GemmProblem(device_type="cuda", m=64, n=256, k=128, a_dtype="bfloat16", b_dtype="bfloat16",
                       out_dtype="bfloat16")  # fmt: skip
    reasons = plugin.tactix_check(gemm, tactix.Tactic.default("trtllm"), None)
    assert reasons and "fp8_blockscale_gemm_sm90" in reasons[0] and "SM100" in reasons[0]


# -- tactics ---------------------------------------------------------------------------------------


def test_tactics_round_trip_and_are_validated() -> None:
    for tactic in (plugin.xqa_tactic("x2", False), plugin.FMHA_TACTIC):
        again = tactix.tactics.parse_tactic(tactic.to_json())
        assert again == tactic and again.digest() == tactic.digest()
    assert plugin.xqa_tactic().to_json() == (
        '{"backend":"trtllm","kernel":"xqa","params":{"multi_block":"auto","pdl":true},"schema_version":1}'
    )
    assert plugin.params_reasons(plugin.xqa_tactic("off", True), "decode") == []
    assert plugin.params_reasons(plugin.FMHA_TACTIC, "prefill") == []
    assert plugin.params_reasons(tactix.Tactic.default("trtllm"), "prefill") == []
    bad = {
        "params.multi_block must be one of": {"multi_block": "x4", "pdl": True},
        "params.pdl must be true or false": {"multi_block": "auto", "pdl": 1},
        "unknown params ['split']": {"multi_block": "auto", "pdl": True, "split": 2},
    }
    for text, params in bad.items():
        reasons = plugin.params_reasons(tactix.Tactic(backend="trtllm", kernel="xqa", params=params), "decode")
        assert any(text in r for r in reasons), (text, reasons)
    assert "not this op's" in plugin.params_reasons(plugin.FMHA_TACTIC, "decode")[0]
    assert "unknown kernel" in plugin.params_reasons(tactix.Tactic(backend="trtllm", kernel="gen"), "decode")[0]
    with pytest.raises(tactix.TacticError, match="bare plan indices"):
        tactix.tactics.parse_tactic(2)
    assert plugin.tactix_tactics(decode()) == []  # nothing to enumerate where it cannot run


# -- warm-up, compiles, import -------------------------------------------------------------------


def test_warmup_keys_defaults_and_overrides() -> None:
    keys = plugin.warmup_keys(None)
    assert library.FmhaKey("HND", "bfloat16") in keys and library.FmhaKey("NHD", "float16") in keys
    assert library.XqaKey("bfloat16", 16, 128, 8, False) in keys and len(keys) == 10
    few = plugin.warmup_keys("ops=decode; dtypes=float16; page_sizes=32,64; group_sizes=4; windows=yes")
    assert few == [library.XqaKey("float16", 32, 128, 4, True), library.XqaKey("float16", 64, 128, 4, True)]
    with pytest.raises(tactix.InvalidArgumentError, match="TACTIX_TRTLLM_WARMUP"):
        plugin.warmup_keys("page_sizes=24")
    with pytest.raises(tactix.InvalidArgumentError, match="TACTIX_TRTLLM_WARMUP"):
        plugin.warmup_keys("heads=8")


class FakeSpec:
    def __init__(self, compiled: bool) -> None:
        self.is_compiled = compiled
        self.built = 0

    def build(self, need_lock: bool = False) -> None:
        self.built += 1
        self.is_compiled = True

    def build_and_load(self) -> object:
        self.build()
        return object()


class FakeKey:
    def __init__(self, name: str, spec: FakeSpec) -> None:
        self.label, self._spec = name, spec

    def spec(self) -> FakeSpec:
        return self._spec


def test_compile_ahead_builds_what_the_cache_lacks_with_progress(caplog: pytest.LogCaptureFixture) -> None:
    fresh, cached = FakeSpec(False), FakeSpec(True)
    seen: list[tuple[int, int, str]] = []
    with caplog.at_level(logging.INFO, logger="tactix_trtllm"):
        n = library.compile_ahead([FakeKey("A", fresh), FakeKey("B", cached)], None,  # type: ignore[list-item]
                                  lambda *a: seen.append(a))  # fmt: skip
    assert n == 1 and fresh.built == 1 and cached.built == 0
    assert seen == [(1, 2, "A: compiled"), (2, 2, "B: found in the cache")]
    messages = [r.getMessage() for r in caplog.records]
    assert any("compiling A" in m for m in messages) and any("compiled A in" in m for m in messages)


def test_load_logs_a_compile_and_loads_once(caplog: pytest.LogCaptureFixture) -> None:
    spec = FakeSpec(False)
    key = FakeKey("XQA test variant", spec)
    try:
        with caplog.at_level(logging.INFO, logger="tactix_trtllm"):
            first, built = library.load(key)  # type: ignore[arg-type]
            again, built_again = library.load(key)  # type: ignore[arg-type]
    finally:
        library._modules.pop(key, None)  # type: ignore[call-overload]
    assert built and not built_again and first is again and spec.built == 1
    messages = [r.getMessage() for r in caplog.records]
    assert (
        messages[0].startswith("trtllm: compiling XQA test variant") and "compiled XQA test variant in" in messages[1]
    )


def test_warmup_without_flashinfer_or_with_a_bad_arch_raises() -> None:
    with pytest.raises(tactix.InvalidArgumentError, match="--arch"):
        plugin.tactix_warmup("sm_80", None)
    if not library.status().usable:
        with pytest.raises(tactix.BackendUnavailableError, match="flashinfer"):
            plugin.tactix_warmup("sm_90", None)


def _run(code: str, env_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = f"{env_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)


def test_imports_cleanly_and_says_why_it_cannot_run_here() -> None:
    done = _run(
        """
        import sys, torch, tactix
        import tactix_trtllm.plugin
        assert "flashinfer" not in sys.modules, "importing the plugin imported flashinfer"
        b = tactix.get_registry().get("trtllm")
        print(b.spec.ops, b.environment())
        assert not torch.cuda.is_initialized()
        """
    )
    assert done.returncode == 0, done.stderr
    if not torch.cuda.is_available():
        assert "no CUDA GPU is visible" in done.stdout
    if not library.status().usable:
        assert "flashinfer" in done.stdout


def test_an_unexpected_flashinfer_release_is_reported(tmp_path: Path) -> None:
    pkg = tmp_path / "flashinfer"
    (pkg / "jit" / "attention").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.1.0'\n")
    for part in ("jit/__init__.py", "jit/xqa.py", "jit/attention/__init__.py", "jit/attention/modules.py"):
        (pkg / part).write_text("")
    done = _run("from tactix_trtllm.library import status; print(status().error)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "flashinfer-python 0.1.0 is not a release this plugin was written against (0.7.2.post1)" in done.stdout
    broken = tmp_path / "broken"
    (broken / "flashinfer").mkdir(parents=True)
    (broken / "flashinfer" / "__init__.py").write_text("raise ImportError('libcuda.so.1: cannot open')\n")
    done = _run("from tactix_trtllm.library import status; print(status().error)", broken)
    assert "flashinfer cannot be imported (ImportError: libcuda.so.1: cannot open)" in done.stdout


def test_what_run_remembers_about_a_cache_does_not_keep_it_alive() -> None:
    import gc
    import weakref

    k, v = torch.randn(10, 4, PAGE, 8), torch.randn(10, 4, PAGE, 8)
    transposed = plugin._alias(k, (10, PAGE, 4, 8), (k.stride(0), k.stride(2), k.stride(1), 1))
    assert torch.equal(transposed, k.transpose(1, 2)) and transposed.data_ptr() == k.data_ptr()
    memo: dict[int, Any] = {}
    plugin._remember(memo, k, v, transposed)
    del transposed
    assert len(memo) == 1
    alive = weakref.ref(k)
    del k
    gc.collect()
    assert alive() is None and memo == {}  # the cache was freed and forgotten
