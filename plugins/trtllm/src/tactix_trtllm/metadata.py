"""What the TensorRT-LLM kernels read, made from tactix's paged-batch metadata in ``plan()``.

tactix describes a batch with FlashInfer's CSR arrays (``qo_indptr``, ``kv_indptr`` /
``kv_indices``, ``kv_last_page_len``). XQA and FMHAv2 read a block table ``[rows, width]`` (row
``r``: request ``r``'s pages in sequence order, zero past them), per-request kv lengths and, for
FMHAv2, cumulative q and kv lengths. Everything here is host arithmetic, so it is tested without
a GPU: `write_metadata` writes it into the wrapper's pinned staging buffer (`tactix.plugin.Staging`)
with C-level copies, and the plan sends it to the device in one transfer.

The second half maps a KV cache onto what FMHAv2 can address: every K and V page is found from
one base pointer as ``base + offset * page_bytes`` (TMA over a 4-D pool), so a cache is served
without a copy when both tensors are dense within a page and their distance is a whole number of
pages; any other cache is gathered page by page into a staging pool.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import Final, Literal

import torch

from tactix import PagedBatch, bucket_size
from tactix.plugin import Sections, cache_axes, dense_strides, sections, write_table

__all__ = [
    "HOST_TABLE_ROWS",
    "Geometry",
    "PoolMapping",
    "cumulative_kv_lengths",
    "cumulative_q_lengths",
    "expand_offsets",
    "gather_offsets",
    "geometry",
    "metadata_entries",
    "metadata_sections",
    "pages_for",
    "pool_mapping",
    "refit_reasons",
    "row_starts",
    "sequence_lengths",
    "table_on_host",
    "write_metadata",
    "xqa_cache_reasons",
]

INT32_MAX: Final = 2**31 - 1


def pages_for(length: int, page_size: int) -> int:
    """Pages that hold ``length`` tokens."""
    return -(-length // page_size)


@dataclass(frozen=True)
class Geometry:
    """The sizes a plan launches its kernel with; a captured CUDA graph bakes them in."""

    rows: int
    """Block-table rows: the batch size, padded to its bucket for prefill in CUDA-graph mode
    (padding rows have length 0)."""
    width: int
    """Block-table columns: the most pages of any request (in CUDA-graph mode: of the kv bucket)."""
    max_q: int
    """Longest query the kernel is told about (prefill; 1 for decode)."""
    max_kv: int
    """Longest kv sequence the kernel is told about."""
    tokens: int
    """Query rows (``q.shape[0]``)."""


def geometry(batch: PagedBatch, *, decode: bool, graph: bool) -> Geometry:
    """Exact sizes for an eager plan; bucketed ones for a plan that a CUDA graph will capture.

    A decode plan keeps its batch size exact even in graph mode: XQA reads one q row per request,
    and q has exactly ``batch_size`` rows.
    """
    page = batch.page_size
    if not graph:
        return Geometry(batch.batch_size, pages_for(batch.max_kv_len, page), batch.max_qo_len, batch.max_kv_len,
                        batch.num_qo_tokens)  # fmt: skip
    max_kv = bucket_size(batch.max_kv_len)
    rows = batch.batch_size if decode else bucket_size(batch.batch_size)
    max_q = 1 if decode else bucket_size(batch.max_qo_len)
    return Geometry(rows, pages_for(max_kv, page), max_q, max_kv, batch.num_qo_tokens)


def refit_reasons(captured: Geometry, batch: PagedBatch, *, decode: bool) -> list[str]:
    """Why ``batch`` cannot be re-planned into the buffers and launch sizes of ``captured``."""
    out = []
    if decode and batch.batch_size != captured.rows:
        out.append(f"batch size {batch.batch_size} differs from the captured {captured.rows}")
    if not decode:
        if batch.num_qo_tokens != captured.tokens:
            out.append(f"{batch.num_qo_tokens} query tokens differ from the captured {captured.tokens}")
        if batch.batch_size > captured.rows:
            out.append(f"batch size {batch.batch_size} above the captured {captured.rows}")
        if batch.max_qo_len > captured.max_q:
            out.append(f"longest query {batch.max_qo_len} above the captured {captured.max_q}")
    if batch.max_kv_len > captured.max_kv or pages_for(batch.max_kv_len, batch.page_size) > captured.width:
        out.append(f"longest kv sequence {batch.max_kv_len} above the captured {captured.max_kv}")
    return out


# -- the per-request arrays ---------------------------------------------------------------------


def sequence_lengths(batch: PagedBatch, rows: int) -> list[int]:
    """kv length per block-table row (0 for padding rows)."""
    return batch.kv_lens_list + [0] * (rows - batch.batch_size)


def cumulative_q_lengths(batch: PagedBatch, rows: int) -> list[int]:
    """``rows + 1`` query offsets: ``qo_indptr``, repeated at the end for padding rows."""
    qo = batch.qo_indptr_list
    return qo + [qo[-1]] * (rows - batch.batch_size)


def cumulative_kv_lengths(batch: PagedBatch, rows: int) -> list[int]:
    """``rows + 1`` running sums of the kv lengths, repeated at the end for padding rows."""
    sums = [0, *itertools.accumulate(batch.kv_lens_list)]
    return sums + [sums[-1]] * (rows - batch.batch_size)


def row_starts(batch: PagedBatch, rows: int) -> list[int]:
    """Where each row's pages start in the page indices (padding rows: past the last entry)."""
    return batch.kv_indptr_list[:-1] + [batch.num_page_entries] * (rows - batch.batch_size)


def metadata_sections(g: Geometry) -> Sections:
    """Where a plan's int32 metadata lies in its staging slot (`tactix.plugin.sections`): the kv
    lengths, the cumulative q and kv lengths, the row starts, then ``pages``: the block table
    ``[rows, width]`` laid out on the host, or (device page indices) the CSR indices followed by
    ``width`` zeros, from which the table is gathered on the device. Sized by the geometry alone,
    so that a CUDA-graph re-plan keeps every address."""
    return sections(("seq_lens", g.rows), ("cum_q", g.rows + 1), ("cum_kv", g.rows + 1), ("row_starts", g.rows),
                    ("pages", g.rows * g.width + g.width))  # fmt: skip


def metadata_entries(layout: Sections, g: Geometry, batch: PagedBatch, host_table: bool) -> int:
    """The int32 entries of ``layout`` a plan transfers: up to the end of the block table laid out
    on the host, or of the ``width`` zeros after the CSR indices copied on the device."""
    pages = layout.offset("pages")
    return pages + (g.rows * g.width if host_table else batch.num_page_entries + g.width)


HOST_TABLE_ROWS: Final = 16
"""Up to this many block-table rows a plan with host page indices lays the table out on the host
(one C-level copy a row, and the whole table zeroed first); larger batches send the CSR indices
and gather the rows on the device (one kernel, whatever the batch size: at 64 rows of 4-8k keys
the host table is ~200 KB of zeroing and row copies a plan)."""


def table_on_host(batch: PagedBatch, g: Geometry) -> bool:
    """Whether a plan lays out the block table on the host (host indices, few rows: `HOST_TABLE_ROWS`)."""
    return batch.indices_on_host and g.rows <= HOST_TABLE_ROWS


def write_metadata(dst: int, batch: PagedBatch, g: Geometry, layout: Sections, indices_at: int | None,
                   host_table: bool = True, decode: bool = False) -> None:  # fmt: skip
    """Write a plan's metadata at address ``dst`` (a pinned staging buffer) with C-level copies.
    ``indices_at``: the address of the batch's int32 host page indices, laid out here as the
    block table (``host_table``) or copied as they are (CSR, gathered on the device), then the
    ``width`` zeros after them; None for device indices, which the plan copies after the transfer
    (only the ``width`` zeros after them are written here). ``decode`` (XQA, which reads no
    cumulative lengths): the cumulative q and kv sections are left zero."""
    # the four per-row sections, which lie before ``pages`` as the same sections alone would:
    # one packed write of lists (`Sections.write`)
    head = sections(("seq_lens", g.rows), ("cum_q", g.rows + 1), ("cum_kv", g.rows + 1), ("row_starts", g.rows))
    pages = layout.offset("pages")
    if decode:
        head.write(dst, [sequence_lengths(batch, g.rows), [], [], row_starts(batch, g.rows)])
    else:
        head.write(dst, [sequence_lengths(batch, g.rows), cumulative_q_lengths(batch, g.rows),
                         cumulative_kv_lengths(batch, g.rows), row_starts(batch, g.rows)])  # fmt: skip
    if indices_at is not None and host_table:
        write_table(dst + 4 * pages, indices_at, batch.kv_indptr_list, g.rows, g.width)
        return
    if indices_at is not None:
        ctypes.memmove(dst + 4 * pages, indices_at, 4 * batch.num_page_entries)
    ctypes.memset(dst + 4 * (pages + batch.num_page_entries), 0, 4 * g.width)


# -- caches: what the kernels can address ------------------------------------------------------

Layout = Literal["NHD", "HND"]


def xqa_cache_reasons(k_stride: tuple[int, ...], v_stride: tuple[int, ...], layout: str, head_dim: int) -> list[str]:
    """Why XQA cannot read this (k, v) pair in place (empty: it can).

    XQA takes one set of page/token/head strides, read from K and used for V too, counted in
    whole heads (``head_dim`` elements), with each head dense.
    """
    out = []
    k, v = cache_axes(k_stride, layout), cache_axes(v_stride, layout)
    if k != v:
        out.append(f"k and v must have the same strides (XQA reads V with K's strides; got {k_stride} and "
                   f"{v_stride})")  # fmt: skip
    if k[3] != 1:
        out.append(f"head_dim must be dense (stride 1; got {k[3]})")
    if any(s % head_dim for s in k[:3]):
        out.append(f"page, token and head strides must be multiples of head_dim={head_dim} (got {k[:3]})")
    return out


@dataclass(frozen=True)
class PoolMapping:
    """How FMHAv2 finds K and V pages from one base pointer: page ``p`` of K is block
    ``p * k_scale + k_offset`` of the pool, of V block ``p * v_scale + v_offset``.

    ``shared``: K and V pages interleaved ([pages, 2, ...]); the kernel's own mapping (2p, 2p+1)
    from the plain block table. ``offsets``: a zero-copy mapping from a pre-expanded
    ``[rows, 2, width]`` table. ``gather``: no zero-copy mapping exists (``why``); run() copies
    the batch's pages into a staging pool first.
    """

    mode: Literal["shared", "offsets", "gather"]
    base_is_v: bool = False
    k_scale: int = 0
    k_offset: int = 0
    v_scale: int = 0
    v_offset: int = 0
    why: str = ""


def pool_mapping(
    k_ptr: int,
    v_ptr: int,
    k_stride: tuple[int, ...],
    v_stride: tuple[int, ...],
    shape: tuple[int, ...],
    layout: str,
    element_size: int,
) -> PoolMapping:
    """The zero-copy mapping of a (k, v) pair of 4-D caches of ``shape``, or why there is none."""
    sizes = cache_axes(shape, layout)
    pages, page_size, heads, dim = sizes
    block = page_size * heads * dim
    block_bytes = block * element_size
    dense = dense_strides(layout, page_size, heads, dim)

    def gather(why: str) -> PoolMapping:
        return PoolMapping("gather", why=why)

    for name, s in (("k", k_stride), ("v", v_stride)):
        if cache_axes(s, layout)[1:] != dense[1:]:
            return gather(f"{name}'s pages are not dense (strides {s})")
        if pages > 1 and (s[0] <= 0 or s[0] % block):
            return gather(f"{name}'s page stride {s[0]} is not a whole number of pages ({block} elements)")
    delta = v_ptr - k_ptr
    if delta % block_bytes:
        return gather(f"v starts {delta} bytes from k, not a whole number of pages ({block_bytes} bytes)")
    base = min(k_ptr, v_ptr)
    if base % 16:
        return gather("the cache is not 16-byte aligned")
    k_scale = k_stride[0] // block if pages > 1 else 1
    v_scale = v_stride[0] // block if pages > 1 else 1
    k_offset, v_offset = (k_ptr - base) // block_bytes, (v_ptr - base) // block_bytes
    top = max((pages - 1) * k_scale + k_offset, (pages - 1) * v_scale + v_offset)
    if top > INT32_MAX:
        return gather(f"page offsets reach {top}, beyond int32")
    if (k_scale, k_offset, v_scale, v_offset) == (2, 0, 2, 1):  # [pages, 2, ...]: the kernel's own 2p, 2p + 1
        return PoolMapping("shared", False, 2, 0, 2, 1)
    return PoolMapping("offsets", v_ptr < k_ptr, k_scale, k_offset, v_scale, v_offset)


def expand_offsets(table: torch.Tensor, mapping: PoolMapping, out: torch.Tensor) -> None:
    """``out[:, 0] = table * k_scale + k_offset`` and ``out[:, 1] = table * v_scale + v_offset``:
    the pre-expanded ``[rows, 2, width]`` block offsets FMHAv2 reads (device ops, no host sync)."""
    for half, scale, offset in ((0, mapping.k_scale, mapping.k_offset), (1, mapping.v_scale, mapping.v_offset)):
        torch.mul(table, scale, out=out[:, half])
        out[:, half].add_(offset)


def gather_offsets(rows: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """Block offsets into a staging pool ``[2, rows * width, ...]`` filled row by row from the block
    table: K of (r, j) is block ``r * width + j``, V is ``rows * width`` blocks further."""
    k = torch.arange(rows * width, dtype=torch.int32, device=device).view(rows, 1, width)
    return torch.cat([k, k + rows * width], dim=1).contiguous()
