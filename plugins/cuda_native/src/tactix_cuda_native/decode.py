"""Paged decode (kernels/decode.cu): its tactic parameters (`DecodeParams`), the work split over the
GPU (chunks, work items, the last wave), the kernel variant, the reasons a tactic cannot run, the
tactic space and the default, and the plan (`CudaNativeDecodePlan`).

Tactics: ``Tactic(backend="cuda_native", kernel="decode", params={"tile": 64, "warps": 4, "stages": 2,
"kv_chunk": 0})`` (``kv_chunk`` 0: the split of long requests is chosen per batch by `decode_chunk`;
optional ``"l2"``: 1, the default, left out of the params, streams the KV cache with an L2
evict_first policy, 0 with evict_normal, 2 adds a 256-byte L2 prefetch; optional ``"bulk"``:
segments of that many tokens per bulk copy, HND, sm_90, and ``"tma": 1``: those segments through
tensor maps of the caches).

FP8 KV caches (``float8_e4m3fn``, ``float8_e5m2``, 16-bit q and out): the same kernel with
``TX_KV_FP8`` (cp.async tactics only; K converted in registers, V per warp into a float16 tile,
P V in float16), and the dequantization scales (run extras ``k_scale``, ``v_scale``) as kernel
arguments; run on the H200 by the conformance kit. The conversion mode is `paged.fp8_cvt`'s
(``TX_FP8_CVT``; ``TACTIX_CUDA_NATIVE_FP8_CVT`` = `FP8_CVT_ENV` forces one, to compare).

The geometry functions are pure (no CUDA), so every rule is tested on a machine without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import torch

from tactix import (
    DecodeProblem,
    InvalidArgumentError,
    PagedBatch,
    PlanOptions,
    Problem,
    Tactic,
    TactixError,
    UnsupportedProblemError,
)
from tactix.plugin import (
    LAUNCH_INT64,
    LAUNCH_POINTER,
    Launcher,
    Piece,
    Sections,
    bucket_size,
    from_static,
    function_launcher,
    keep_static,
    raw_stream,
    sections,
)
from tactix_cuda_native import NAME
from tactix_cuda_native.device import DeviceInfo, arch_at_least, cuda_device, device_index, device_info
from tactix_cuda_native.kernel import FLAG_BYTES, L2_HINTS, Kernel, TensorMaps, bf16, launcher, load_kernel
from tactix_cuda_native.paged import (
    FP8_KV_DTYPES,
    LOG2E,
    UNIT_SCALES,
    StagedPlan,
    attention_reasons,
    cache_strides,
    fp8_cvt,
    log2_exact,
    scale_args,
)
from tactix_cuda_native.runtime import Variant, launch_config, load, stream_for, tensor_map, tensor_maps_status
from tactix_cuda_native.tactics import TacticParams

log = logging.getLogger("tactix")

Q_TILE: Final = 16  # query heads of one GQA group per CTA (the mma's 16 rows)
DECODE_ITEM_INTS: Final = 8  # ints per work item record (kernels/decode.cu)
DECODE_BULK: Final = (0, 8, 16, 32)
DECODE_CTAS: Final = (0, 2, 3, 4)
# -- tactic parameters -----------------------------------------------------------------------


class DecodeParams(TacticParams):
    """A decode tactic's parameters: tile (tokens per stage), warps, stages, the KV chunk policy, L2 hint.

    ``kv_chunk`` is the number of keys one CTA handles before its partial result is merged with
    the others of its request (a multiple of ``tile``), or 0 for the heuristic (`decode_chunk`).
    ``l2``: 1 (default) streams K/V with an L2 evict_first policy, 0 without a hint, 2 adds a
    256-byte L2 prefetch to 1. ``bulk``: 0 (default) gathers K/V rows with 16-byte ``cp.async``;
    8, 16 or 32 copies that many tokens at a time with bulk copies (sm_90 and later; HND caches
    whose pages hold a multiple of ``bulk`` tokens, rows contiguous: kernels/decode.cu). ``tma``
    1 (with ``bulk``) copies those segments through tensor maps of the caches (the 128-byte
    swizzle, any 16-byte strides) instead of linear bulk copies. ``ctas``: 0 (default) leaves the
    registers a thread takes to the compiler; 2, 3 or 4 bounds them so that many CTAs fit an SM
    (``__launch_bounds__``' second argument, TX_MIN_CTAS). ``vreg`` (fp8 caches, head dim 128 or
    256): 1 builds P V's B fragments from the fp8 V rows in registers (32-bit shared loads, a byte
    permutation pairing two tokens' codes, one conversion a pair; the output dims permuted and put
    back in the epilogue: TX_VREG) instead of converting the V tile into a float16 tile in shared
    memory first (0).
    """

    KERNEL: ClassVar[str] = "decode"
    # the default hint, cp.async (bulk 0) and linear bulk copies (tma 0) stay implicit, so tactics
    # stored before they existed still match
    IMPLICIT: ClassVar[tuple[str, ...]] = ("l2", "bulk", "tma", "ctas", "vreg")

    tile: int
    warps: int
    stages: int
    kv_chunk: int = 0
    l2: int = 1
    bulk: int = 0
    tma: int = 0
    ctas: int = 0
    vreg: int = 0

    def reasons(self, head_dim: int, info: DeviceInfo) -> list[str]:
        out = []
        if self.bulk not in DECODE_BULK:
            out.append(f"bulk must be 0 (cp.async) or tokens per bulk copy in {DECODE_BULK[1:]} (got {self.bulk})")
        elif self.bulk:
            if not arch_at_least(info.arch, 90):
                out.append(f"bulk copies need sm_90 or later; this GPU is {info.arch} (use bulk 0)")
            if self.tile % self.bulk or not 4 <= self.tile // self.bulk <= 16:
                out.append(f"bulk {self.bulk} must cut tile {self.tile} into 4 to 16 copies")
        if self.tma not in (0, 1):
            out.append(f"tma must be 0 or 1 (got {self.tma})")
        elif self.tma and not self.bulk:
            out.append("tma 1 copies bulk segments through tensor maps: it needs bulk 8, 16 or 32")
        if self.ctas not in DECODE_CTAS:
            out.append(f"ctas must be 0 (no bound) or CTAs per SM to fit registers for, in {DECODE_CTAS[1:]} "
                       f"(got {self.ctas})")  # fmt: skip
        if self.vreg not in (0, 1):
            out.append(f"vreg must be 0 or 1 (got {self.vreg})")
        elif self.vreg and head_dim not in (128, 256):
            out.append(f"vreg 1 reads V rows in 32-byte blocks for conflict-free banks: head dim 128 or 256 "
                       f"(got {head_dim})")  # fmt: skip
        if self.l2 not in L2_HINTS:
            out.append(
                f"l2 must be 0 (evict_normal), 1 (evict_first) or 2 (evict_first + 256B prefetch) (got {self.l2})"
            )
        if self.warps not in (2, 4, 8):
            out.append(f"warps must be 2, 4 or 8 (got {self.warps})")
        elif self.tile % self.warps or self.tile // self.warps not in (16, 32):
            out.append(f"tile / warps must be 16 or 32 tokens (got tile {self.tile}, warps {self.warps})")
        elif self.tile > 32 * self.warps:
            out.append(f"tile {self.tile} exceeds the {32 * self.warps} threads of {self.warps} warps")
        if not 2 <= self.stages <= 8:
            out.append(f"stages must be in 2..8 (got {self.stages})")
        if self.kv_chunk < 0 or (self.kv_chunk and self.kv_chunk % self.tile):
            out.append(f"kv_chunk must be 0 (auto) or a positive multiple of tile {self.tile} (got {self.kv_chunk})")
        if not out:
            smem = decode_smem_bytes(head_dim, self.tile, self.warps, self.stages, self.bulk, self.tma,
                                     1 if self.vreg else 2, self.vreg)  # fmt: skip
            if smem > info.smem_per_block:
                out.append(f"needs {smem} bytes of shared memory; this GPU allows {info.smem_per_block} per CTA")
        return out


def decode_smem_bytes(head_dim: int, tile: int, warps: int, stages: int, bulk: int = 0, tma: int = 0,
                      kv_bytes: int = 2, vreg: int = 0) -> int:  # fmt: skip
    """Dynamic shared memory of the decode kernel (see the layout in kernels/decode.cu): with
    ``bulk`` (linear copies, not ``tma``), each copy's segment of a tile is 16 bytes longer; with an
    fp8 cache (``kv_bytes`` 1) the ring holds fp8 rows and one converted 16-bit V tile follows (K is
    converted in registers), unless ``vreg`` converts V in registers too."""
    row = head_dim * 2
    tile_bytes = tile * row + (tile // bulk * 16 if bulk and not tma else 0)
    ring = stages * 2 * tile_bytes if kv_bytes == 2 else stages * 2 * tile * head_dim + (0 if vreg else tile * row)
    return ring + 16 * row + stages * 2 * tile * 8 + warps * 32 * 4 + 32 * 4 + FLAG_BYTES


# -- defaults and candidates -----------------------------------------------------------------


def decode_candidates(head_dim: int, info: DeviceInfo, fp8: bool = False) -> list[DecodeParams]:
    """The tactic space the tuner explores (every entry valid for ``head_dim`` on ``info``).

    Shapes by CTAs per SM on an H200 (d128): (64, 4, 2) 3, (64, 4, 3) 2, (32, 2, 2) 5,
    (32, 2, 3) 4, (128, 8, 2) 1; then the default shape with fixed chunks and other L2 hints.
    With ``fp8`` (an fp8 cache) also the fp8 default with and without V's fragments built in
    registers (``vreg``), and with them at 3 stages or registers for 3 CTAs.
    """
    shapes = [(64, 4, 2), (64, 4, 3), (32, 2, 2), (32, 2, 3), (128, 8, 2), (128, 8, 3)]
    out = [DecodeParams(tile=t, warps=w, stages=s) for t, w, s in shapes]
    base = default_decode_params(head_dim, info)
    out += [base.replace(kv_chunk=c) for c in (256, 512, 1024, 2048)]
    # deep pipelines: most of a short work item's bytes in flight at once (latency-bound batches)
    out += [base.replace(stages=s, kv_chunk=c) for s in (4, 6) for c in (0, 256, 512, 1024)]
    out += [base.replace(l2=hint) for hint in L2_HINTS if hint != base.l2]
    # registers bounded for 3 CTAs an SM (__launch_bounds__' second argument; 4 spills the 16-bit
    # kernel at d128, and the fp8 one's default already takes it)
    out += [base.replace(ctas=3), base.replace(stages=3, ctas=3)]
    # bulk copies (sm_90+; `decode_tactics` drops them for NHD caches and page sizes they do not divide)
    if arch_at_least(info.arch, 90):
        out += [DecodeParams(tile=t, warps=w, stages=s, l2=hint, bulk=bulk) for t, w, s, bulk in
                ((64, 4, 2, 16), (64, 4, 2, 8), (64, 4, 3, 16), (64, 4, 3, 8), (128, 8, 2, 16), (32, 2, 2, 8))
                for hint in (0, 1)]  # fmt: skip
        # the same segments through tensor maps (`decode_tactics` drops them where maps cannot be encoded):
        # the two that led on the H200 (h200-decode-tma-sweep.log: D3 without the L2 hint, D2 with 3 stages)
        out += [DecodeParams(tile=64, warps=4, stages=2, l2=0, bulk=16, tma=1),
                DecodeParams(tile=64, warps=4, stages=3, l2=1, bulk=16, tma=1)]  # fmt: skip
    if fp8:
        base8 = default_decode_params(head_dim, info, fp8=True)
        out += [base8.replace(vreg=0), base8.replace(vreg=1), base8.replace(vreg=1, stages=3),
                base8.replace(vreg=1, ctas=3)]  # fmt: skip
    return [p for p in dict.fromkeys(out) if not p.reasons(head_dim, info)]


@functools.lru_cache(maxsize=256)  # plans ask per batch; the parameters are immutable
def default_decode_params(head_dim: int, info: DeviceInfo, small: bool = False, fp8: bool = False) -> DecodeParams:
    """The heuristic tactic.

    Measured on the H200 (d128, 32/8 heads): throughput follows the warps resident per SM, so the
    default is the shape with the most: tiles of 64 keys, 4 warps, 2 stages (72 KB of shared
    memory, 153 registers a thread: 3 CTAs, 12 warps per SM). A ``small`` batch (one wave of
    CTAs: latency, not bandwidth, decides) takes one stage more: two tiles in flight per CTA.
    d64 fits 4 CTAs of (64, 4, 3); d256 keeps 3 CTAs with (32, 2, 2).

    An ``fp8`` cache at d128 bounds the registers for 4 CTAs (``ctas`` 4; its kernel reads Q from
    shared memory there, which leaves 128 registers enough). Measured on the H200
    (fp8_decode_sweep, one run each): with Q in registers the compiler took 191 (2 CTAs), and 3
    CTAs gave D1-fp8 188 us against 223, D3-fp8 298 against 349; with Q in shared memory, 4 CTAs
    gave 183.6 and 294.8 against 191.9 and 303.5 for 3 (D2-fp8 within noise). It also builds V's
    fragments in registers (``vreg`` 1, session 20, one run): D3-fp8 281.2 us against 291.8,
    D1-fp8 180.7 against 181.6, D2-fp8 (3 stages) 19.7 against 20.3.
    """
    preferred = {64: (64, 4, 3), 128: (64, 4, 2), 256: (32, 2, 2)}.get(head_dim, (64, 4, 2))
    tile, warps, stages = preferred
    if small:
        stages += 1
    while stages > 2 and decode_smem_bytes(head_dim, tile, warps, stages) > info.smem_per_block:
        stages -= 1
    while tile > 32 and decode_smem_bytes(head_dim, tile, warps, stages) > info.smem_per_block:
        tile, warps = tile // 2, max(2, warps // 2)
    f128 = fp8 and head_dim == 128
    return DecodeParams(tile=tile, warps=warps, stages=stages, ctas=4 if f128 else 0, vreg=1 if f128 else 0)


# -- work list and grid ----------------------------------------------------------------------


DECODE_MIN_CHUNK: Final = 512
"""Fewest keys per split work item. Measured on the H200 (D2: one request of 8192 keys, 8 KV
heads): 512-key pieces (16 per head, 128 CTAs) 21.0-21.2 us against 22.1-22.3 for 256-key pieces
(32 per head, 256 CTAs) in two runs: half the partial outputs to write and merge outweighs the
idle SMs (benchmarks/results/h200-decode-sweep-deep.json)."""


def decode_is_small(lengths: list[int], units: int, info: DeviceInfo, min_chunk: int = DECODE_MIN_CHUNK) -> bool:
    """Whether a batch is one wave at two CTAs per SM even when cut into ``min_chunk``-key pieces
    (D2: 8192 keys x 8 KV heads = 128 pieces of 512 keys <= 264): latency-bound."""
    limit = 2 * info.sms // units  # most pieces (summed over the requests) that still fit
    # a request gives max(1, ceil(n / m)) pieces: at least 1 and n / m, at most n // m + 1; the
    # bounds from the batch's sum decide most batches without a pass over the lengths
    total, m = sum(lengths), min_chunk
    if max(len(lengths), -(-total // m)) > limit:
        return False
    if total // m + len(lengths) <= limit:
        return True
    return sum(_ceils(lengths, m)) <= limit


def _ceils(lengths: list[int], unit: int) -> list[int]:
    """``max(1, ceil(n / unit))`` per length (plans call this for every batch: a comprehension,
    ~30 ns a length on Python 3.11, where a chain of C-level maps costs half as much again)."""
    up = unit - 1
    out = [(n + up) // unit for n in lengths]
    if lengths and min(lengths) < 1:
        out = [max(1, c) for c in out]
    return out


def q_tiles(gqa: int) -> int:
    """CTAs per KV head: one per 16 query heads of its group."""
    return -(-gqa // Q_TILE)


def attended_lengths(kv_lens: list[int], window_left: int) -> list[int]:
    """Each request's attended keys: its kv length (the list itself, no copy), or at most
    ``window_left + 1`` (C-level map)."""
    if window_left < 0:
        return kv_lens
    return list(map(min, kv_lens, itertools.repeat(window_left + 1)))


def effective_lengths(kv_lens: list[int], window_left: int) -> list[tuple[int, int]]:
    """Each request's attended key range ``[start, end)``: all keys, or the last ``window_left + 1``."""
    if window_left < 0:
        return list(zip(itertools.repeat(0), kv_lens))
    return [(max(0, n - 1 - window_left), n) for n in kv_lens]


DECODE_ITEMS_PER_SLOT: Final = 4
"""Work items per resident CTA that `decode_chunk` aims at. Measured on the H200 (d128, 64 keys
x 4 warps x 2 stages, 3 CTAs an SM): D3 (256 x 2048) unsplit 4.20 TB/s against 4.13 in two
1024-key pieces (the aim of 8 split it: the merge's partial outputs cost more than a shorter
last wave); D1 4.04 at 1024-key chunks, 3.99 at 2048 (benchmarks/results/h200-decode-sweep.json)."""


def decode_chunk(lengths: list[int], units: int, tile: int, slots: int, min_chunk: int = DECODE_MIN_CHUNK) -> int:
    """Keys per work item (a multiple of ``tile``) so that the batch fills the GPU evenly.

    ``units`` = CTAs per request and chunk (KV heads x q tiles); ``slots`` = CTAs resident at
    once on the whole GPU. The aim is about `DECODE_ITEMS_PER_SLOT` work items per slot (the
    last wave is then short), never fewer keys per item than ``min_chunk`` (its start-up latency
    must be amortised) and never more than the longest request (no split where none is needed);
    the longest request is then cut into equal pieces (no short last piece). The batch's tiles
    are counted from its keys, ``max(requests, ceil(keys / tile))`` (rounding each request up
    would add less than one tile a request, and a pass over the lengths in Python: plans call
    this for every batch). D2 (1 x 8192 keys, 8 KV heads) gives 512-key chunks, 128 CTAs; D3
    (256 x 2048, 396 slots) no split: 2048 CTAs.
    """
    longest = max(1, -(-max(lengths) // tile))  # tiles of the longest request
    tiles = max(len(lengths), -(-sum(lengths) // tile))
    chosen = min(max(-(-(tiles * units) // (DECODE_ITEMS_PER_SLOT * slots)), -(-min_chunk // tile), 1), longest)
    pieces = -(-longest // chosen)
    return -(-longest // pieces) * tile


@dataclass(frozen=True)
class DecodeWork:
    """The host-side work list of a decode batch.

    ``items``: (request, first key, end key, partial slot or -1) per work item, longest first;
    ``splits``: (first slot, count) per request (count 1: written directly, no merge);
    ``slots``: partial outputs the workspace must hold.
    """

    items: list[tuple[int, int, int, int]]
    splits: list[tuple[int, int]]
    slots: int

    @property
    def needs_merge(self) -> bool:
        return self.slots > 0


def decode_work(ranges: list[tuple[int, int]], chunk: int) -> DecodeWork:
    """Cut each request's key range into pieces of ``chunk`` keys (one piece: no partial slot).

    Items are ordered longest first, ties in request and key order (in-order block dispatch then
    balances like longest-processing-time). No item is longer than ``chunk``, so that order is
    the items of exactly ``chunk`` keys as made, then the others (at most one per request: a
    last piece or a short request) sorted: only those go through the sort (plan time).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive (got {chunk})")
    full: list[tuple[int, int, int, int]] = []  # items of exactly `chunk` keys, in request and key order
    short: list[tuple[int, int, int, int]] = []
    splits: list[tuple[int, int]] = []
    slots = 0
    for b, (start, end) in enumerate(ranges):
        if end - start <= chunk:
            (full if end - start == chunk else short).append((b, start, end, -1))
            splits.append((0, 1))
            continue
        pieces = -(-(end - start) // chunk)
        splits.append((slots, pieces))
        last = start + (pieces - 1) * chunk
        full += [(b, s, s + chunk, slot) for slot, s in enumerate(range(start, last, chunk), slots)]
        (full if end - last == chunk else short).append((b, last, end, slots + pieces - 1))
        slots += pieces
    short.sort(key=lambda it: it[1] - it[2])  # stable: ties keep request order
    return DecodeWork(full + short, splits, slots)


def decode_balance_tail(work: DecodeWork, units: int, slots: int, tile: int,
                        min_chunk: int = DECODE_MIN_CHUNK) -> DecodeWork:  # fmt: skip
    """Cut the whole requests of a short last wave into pieces, so that they fill the GPU.

    CTAs are dispatched in the work list's order (the ``units`` of an item together), ``slots``
    at a time. When the last wave holds only a few CTAs (at most half the slots) and they are
    whole requests (not pieces) as long as the longest item, they would run with most SMs idle:
    D3 (256 requests of 2048 keys, 8 KV heads, 396 slots) is 5 full waves and 68 CTAs. Those
    requests are cut into ``p`` pieces of at least ``min_chunk`` keys (a multiple of ``tile``), so
    that their pieces fill the last wave, and go to the end of the list (merged as split requests
    are). Measured on the H200 (D3 shapes, ``benchmarks/decode_waves.py``): throughput drops
    1.5-3 % from a whole number of waves to 0.17-0.33 of a wave more
    (``benchmarks/results/h200-decode-tail-waves.log``).
    """
    items = work.items
    ctas = len(items) * units
    tail = ctas % slots
    if ctas <= slots or tail == 0 or 2 * tail > slots:
        return work
    count = -(-tail // units)  # items that reach into the last wave
    longest = items[0][2] - items[0][1]  # (longest first)
    last = items[-count:]
    if any(slot >= 0 or (end - start) * 4 < longest * 3 for _, start, end, slot in last):
        return work
    shortest = min(end - start for _, start, end, _ in last)
    pieces = min(slots // (count * units), shortest // min_chunk)
    if pieces < 2:
        return work
    splits = list(work.splits)
    slot = work.slots
    out = items[:-count]
    added: list[tuple[int, int, int, int]] = []
    for req, start, end, _ in last:
        size = -(-(end - start) // (pieces * tile)) * tile
        starts = range(start, end, size)
        splits[req] = (slot, len(starts))
        added += [(req, s, min(s + size, end), slot + i) for i, s in enumerate(starts)]
        slot += len(starts)
    added.sort(key=lambda it: it[1] - it[2])  # longest first, stable
    return DecodeWork(out + added, splits, slot)


def decode_plan_work(ranges: list[tuple[int, int]], lengths: list[int], units: int, slots: int,
                     params: DecodeParams, graph: bool) -> tuple[int, DecodeWork]:  # fmt: skip
    """A decode plan's chunk and work list: ``params.kv_chunk`` or `decode_chunk` of ``lengths``
    (the bucket's in CUDA-graph mode), the ranges cut by it, and in eager mode with the automatic
    chunk a short last wave cut further (`decode_balance_tail`; a captured grid is sized for its
    bucket, and a forced chunk is kept)."""
    chunk = params.kv_chunk or decode_chunk(lengths, units, params.tile, slots)
    work = decode_work(ranges, chunk)
    if not graph and not params.kv_chunk:
        work = decode_balance_tail(work, units, slots, params.tile)
    return chunk, work


DECODE_PLAN_THREADS: Final = 256
"""Threads of the CTA that makes a work list on the device (kernels/decode_plan.cu)."""
DECODE_PLAN_MAX_BATCH: Final = 2048
"""The most requests a work list is made for on the device (its shared memory: 35 KB at 2048);
larger batches are planned on the host."""
HOST_PLAN_ENV: Final = "TACTIX_CUDA_NATIVE_HOST_PLAN"
"""Set to 1: every decode work list is made on the host (`decode_work`, `decode_items`), as before
the device plan existed (to compare the two, or to rule the device plan out)."""


def host_plan_forced() -> bool:
    """Whether `HOST_PLAN_ENV` asks for every work list to be made on the host (read when a plan is
    made, not at each of its re-plans: an environment lookup costs microseconds on a server host)."""
    return os.environ.get(HOST_PLAN_ENV) == "1"


def decode_plan_on_device(batch: int, host_plan: bool) -> bool:
    """Whether a plan makes its work list on the device (kernels/decode_plan.cu): batches of at most
    `DECODE_PLAN_MAX_BATCH` requests, unless ``host_plan`` (`host_plan_forced`). The kernel writes the
    records `decode_items(decode_plan_work(...))` gives and their count, the short last wave's recut
    (`decode_balance_tail`) included, so a plan's host work does not grow with its batch or its
    items (the kernel runs once per plan, before the layers' runs)."""
    return batch <= DECODE_PLAN_MAX_BATCH and not host_plan


def decode_bounds(lengths: list[int], chunk: int, units: int, slots: int, recut: bool,
                  min_chunk: int = DECODE_MIN_CHUNK) -> tuple[int, int]:  # fmt: skip
    """The most work items and partial slots the device plan can make for requests of ``lengths``
    attended keys cut at ``chunk`` keys, with ``recut`` its recut of a short last wave of ``slots``
    resident CTAs (``units`` a item): what an eager plan sizes its grid and workspace for (idle
    CTAs of the grid exit at once). One C-level max and sum, no pass in Python: a request gives
    ``ceil(n / chunk)`` items, less than ``n / chunk + 1``; a recut replaces c >= 1 whole requests
    (so none where every request is split) by at most ``slots // units`` pieces
    (`decode_balance_tail`), of at least ``2 * min_chunk`` keys a request."""
    b, longest = len(lengths), max(lengths)
    if longest <= chunk:
        items, split = b, 0
    else:
        items = min(b * -(-longest // chunk), (sum(lengths) + b * (chunk - 1)) // chunk)
        split = items
    if recut and items * units > slots and longest >= 2 * min_chunk and min(lengths) <= chunk:
        items += max(slots // units - 1, 0)
        split += slots // units
    return items, split


def decode_plan_smem(batch: int) -> int:
    """Dynamic shared memory of the device plan for ``batch`` requests (kernels/decode_plan.cu):
    its sort keys (8 bytes, the batch rounded up to a power of two), two ints a request, and the
    scan's two ints a thread."""
    return 8 * (1 << max(batch - 1, 0).bit_length()) + 8 * batch + 8 * DECODE_PLAN_THREADS


def decode_plan_variant(arch: str) -> Variant:
    """The device plan's kernel (one per architecture: it has no dtype or tactic)."""
    return Variant.make("decode_plan.cu", arch, TX_PLAN_THREADS=DECODE_PLAN_THREADS,
                        TX_PLAN_MAX_BATCH=DECODE_PLAN_MAX_BATCH)  # fmt: skip


_plan_kernels: dict[tuple[int, str], Any] = {}


def _plan_kernel(index: int, arch: str) -> tuple[Any, bool]:
    """The device plan's kernel on device ``index`` (memoised) and whether NVRTC compiled it now."""
    found = _plan_kernels.get((index, arch))
    if found is not None:
        return found, False
    module, built = load(decode_plan_variant(arch), index)
    kernel = _plan_kernels[(index, arch)] = module.kernel("tactix_decode_plan", decode_plan_smem(DECODE_PLAN_MAX_BATCH))
    return kernel, built


DRIVER_LAUNCH_ENV: Final = "TACTIX_CUDA_NATIVE_DRIVER_LAUNCH"
"""Set to 1: the device plan's kernel is launched through the driver
(`tactix.plugin.function_launcher`), else through ``cuda.core`` like every other kernel; read
once per device, when its first plan launches the kernel. Opt-in: its GPU test passes on the
H200, but the launch measured slower there, 13-17 us a plan against 7.4 through ``cuda.core``
(benchmarks/results/h200-plan-breakdown-driver-launch-session34.txt); with the ``CUkernel``
resolved once to its context's ``CUfunction`` (``library_kernel=True``), an H100 host measured
13.8 and 19.1-20.5 us against 15.0-15.4 (h100-plan-breakdown-driver-launch-session36.txt, runs
1, 0, 1): no gain shown, so still opt-in."""

_plan_launchers: dict[tuple[int, str], Launcher | None] = {}
_PLAN_ARGS: Final = (LAUNCH_POINTER,) * 4 + (LAUNCH_INT64,) * 7  # kernels/decode_plan.cu's parameters


def _plan_launcher(index: int, arch: str, kernel: Any) -> Launcher | None:
    """The device plan's kernel ``kernel`` (`_plan_kernel`) as a driver launch on device
    ``index`` (memoised), or None: launched through ``cuda.core`` (`DRIVER_LAUNCH_ENV` is not 1,
    or the driver cannot be used here)."""
    key = (index, arch)
    if key in _plan_launchers:
        return _plan_launchers[key]
    found = None
    if os.environ.get(DRIVER_LAUNCH_ENV) == "1":
        try:
            handle = int(kernel.handle)
        except (AttributeError, TypeError, ValueError):  # a cuda.core without the handle: its own launch
            handle = 0
        if handle:
            found = function_launcher(handle, index, _PLAN_ARGS, "tactix_decode_plan", library_kernel=True)
    _plan_launchers[key] = found
    return found


@functools.lru_cache(maxsize=64)
def _plan_config(batch: int) -> Any:
    """The device plan's launch configuration for ``batch`` requests (one CTA; memoised: a server
    plans a few batch sizes, and making one costs about a microsecond)."""
    return launch_config((1, 1, 1), DECODE_PLAN_THREADS, decode_plan_smem(batch))


def decode_capacity(batch: int, max_len: int, chunk: int) -> int:
    """Most work items any batch of ``batch`` requests up to ``max_len`` keys can need at ``chunk``."""
    return batch * max(1, -(-max_len // chunk))


def decode_buffer_sizes(items: int, slots: int, num_page_entries: int, *, graph: bool, batch: int,
                        attended_cap: int, longest_cap: int, chunk: int,
                        page_size: int) -> tuple[int, int, int]:  # fmt: skip
    """Work items, partial-output slots and page entries a decode plan's buffers hold: the batch's
    own (``items`` and ``slots`` of its work list), or in CUDA-graph mode the most any batch of its
    buckets needs (the captured grid and buffers must fit every re-plan)."""
    if graph:
        cap = decode_capacity(batch, attended_cap, chunk)
        return cap, cap, batch * -(-longest_cap // page_size)
    return items, slots, num_page_entries


def decode_units(num_kv_heads: int, gqa: int) -> int:
    """CTAs per work item: one per KV head and q tile."""
    return num_kv_heads * q_tiles(gqa)


def decode_grid(items: int, num_kv_heads: int, gqa: int) -> tuple[int, int, int]:
    """One CTA per work item and unit, the units of an item adjacent (kernels/decode.cu)."""
    return (items * decode_units(num_kv_heads, gqa), 1, 1)


def decode_items(work: DecodeWork, page_base: list[int]) -> list[int]:
    """The work list as the kernel reads it: 8 ints per item (kernels/decode.cu): request, first
    key, end key, partial slot, the request's offset in kv_indices, its first slot, its slot count, 0."""
    out: list[int] = []
    extend, splits = out.extend, work.splits
    for req, start, end, slot in work.items:
        first, count = splits[req]
        extend((req, start, end, slot, page_base[req], first, count, 0))
    return out


# -- support rules ---------------------------------------------------------------------------


def decode_reasons(problem: DecodeProblem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    """Why ``tactic`` cannot serve ``problem`` on a GPU like ``info`` (empty: it can)."""
    out = attention_reasons(problem, fp8_kv=True)
    fp8 = problem.kv_dtype in FP8_KV_DTYPES
    if tactic.is_default:
        if tactic.params:
            out.append(f"the default tactic takes no params (got {tactic.params})")
        return out
    if tactic.kernel != DecodeParams.KERNEL:
        return [*out, f"unknown decode kernel '{tactic.kernel}' (known: default, decode)"]
    params = DecodeParams.read(tactic)
    if isinstance(params, str):
        return [*out, params]
    params = DecodeParams.from_tactic(tactic)
    if fp8 and (params.bulk or params.tma):
        out.append(f"an fp8 KV cache ({problem.kv_dtype}) is read with cp.async only: bulk and tma must be 0")
    if params.vreg and not fp8:
        out.append(f"vreg 1 converts fp8 V rows in registers: it needs an fp8 KV cache (got {problem.kv_dtype})")
    if params.bulk > 0:
        if problem.kv_layout != "HND":
            out.append(f"bulk {params.bulk} copies a head's rows of a page at once: it needs the HND layout")
        if problem.page_size % params.bulk:
            out.append(f"bulk {params.bulk} needs a page size that is a multiple of it (got {problem.page_size})")
    if params.tma and (why := tensor_maps_status()) is not None:
        out.append(f"tma {params.tma} needs tensor maps: {why}")
    return out + params.reasons(problem.head_dim_qk, info)


def decode_tactics(problem: DecodeProblem, info: DeviceInfo) -> list[Tactic]:
    """The tactics the tuner measures for ``problem``: the candidates the problem's cache can take."""
    fp8 = problem.kv_dtype in FP8_KV_DTYPES
    tactics = [p.to_tactic() for p in decode_candidates(problem.head_dim_qk, info, fp8)]
    return [t for t in tactics if not decode_reasons(problem, t, info)]


# -- kernel variant --------------------------------------------------------------------------


def _l2_defines(hint: int) -> dict[str, int]:
    return {"TX_L2": int(hint >= 1), "TX_L2_PREFETCH_256": int(hint == 2)}


def decode_variant(dtype: str, head_dim: int, params: DecodeParams, arch: str, kv_dtype: str | None = None) -> Variant:
    """The kernel variant: ``dtype`` of q and out (and of the cache, unless ``kv_dtype`` is an fp8 dtype)."""
    fp8 = FP8_KV_DTYPES.get(kv_dtype or dtype, 0)
    return Variant.make(
        "decode.cu",
        arch,
        TX_BF16=bf16(dtype),
        TX_D=head_dim,
        TX_TILE=params.tile,
        TX_WARPS=params.warps,
        TX_STAGES=params.stages,
        **_l2_defines(params.l2),
        **({"TX_BULK": params.bulk} if params.bulk else {}),  # absent when 0: the variants keep their keys
        **({"TX_TMA": params.tma} if params.tma else {}),
        **({"TX_MIN_CTAS": params.ctas} if params.ctas else {}),  # absent when 0 (the variants keep their keys)
        **({"TX_VREG": 1} if params.vreg else {}),
        **({"TX_KV_FP8": fp8} if fp8 else {}),  # absent for 16-bit caches (their variants keep their keys)
        **({"TX_FP8_CVT": fp8_cvt()} if fp8 else {}),
    )


# -- plan ------------------------------------------------------------------------------------


def decode_sections(item_cap: int, page_cap: int | None, device_plan: int | None = None) -> Sections:
    """Where a decode plan's int32 metadata lies in its staging slot: the work records
    (`decode_items`, ``item_cap`` of them), the item count, for a work list made on the device
    (``device_plan``: the batch size) the requests' page offsets and kv lengths it reads, and,
    unless the kernel reads the caller's device indices in place (``page_cap`` None), the page
    indices."""
    layout: list[tuple[str, int]] = [("items", DECODE_ITEM_INTS * item_cap), ("num_items", 1)]
    if device_plan is not None:
        layout += [("kv_indptr", device_plan + 1), ("kv_lens", device_plan)]
    if page_cap is not None:
        layout.append(("indices", page_cap))
    return sections(*layout)


def _decode_kernel(index: int, dtype: str, d: int, params: DecodeParams, info: DeviceInfo,
                   kv_dtype: str) -> tuple[Kernel, bool]:  # fmt: skip
    """The decode kernel of ``params`` on device ``index``, and whether NVRTC compiled it now."""
    kv_bytes = 1 if kv_dtype in FP8_KV_DTYPES else 2
    smem = decode_smem_bytes(d, params.tile, params.warps, params.stages, params.bulk, params.tma, kv_bytes,
                             params.vreg)  # fmt: skip
    key = ("decode", index, dtype, kv_dtype, d, params, info.arch, fp8_cvt())
    return load_kernel(key, lambda: decode_variant(dtype, d, params, info.arch, kv_dtype), "tactix_decode", smem,
                       32 * params.warps, params, index, info)  # fmt: skip


class CudaNativeDecodePlan(StagedPlan):
    """A planned decode batch: work list, metadata and workspace on the device; ``run`` launches.

    The int32 metadata (`decode_sections`) travels in one transfer from a pinned buffer of the
    wrapper's `tactix.plugin.Staging` into one of its two device slots (`StagedPlan._send`).
    """

    _part_o: torch.Tensor  # workspace: partial outputs of split requests
    _part_lse: torch.Tensor
    _counters: torch.Tensor  # one per request and (KV head, q tile): partials merged so far; zero between runs
    _longest_cap: int  # the kv-length capacity the buffers are sized for (CUDA-graph mode: a bucket)
    _work: DecodeWork | None  # the host-made work list (None: made on the device, `work` recomputes it)
    planned_on_device: bool  # the work records were made by the device plan (kernels/decode_plan.cu)
    _recut: tuple[int, int, int] | None  # (units, slots, tile) where a short last wave is recut, else None
    _host_plan: bool  # TACTIX_CUDA_NATIVE_HOST_PLAN=1 when the plan was made: every work list on the host

    def __init__(self, problem: DecodeProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions) -> None:
        index = device_index(options["device"])
        self.device = cuda_device(index)
        self.problem = problem
        self._requested = tactic
        self._graph = bool(options["use_cuda_graph"])
        self._index = index
        self._info = device_info(index)
        shift = log2_exact(problem.page_size)
        assert shift is not None  # check() refused other page sizes
        gqa = problem.gqa_ratio
        self._scalars = (problem.num_qo_heads, gqa, q_tiles(gqa), shift, problem.sm_scale * LOG2E,
                         float(problem.logits_soft_cap))  # fmt: skip
        self._launch_fn = launcher().launch  # (looked up once: run() is on every layer's path)
        # the kernel of each parameter set this plan's batches chose (the default tactic's depend
        # on the batch: `decode_is_small`), shared by the plans `replan` makes
        self._kernels: dict[bool | None, tuple[DecodeParams, Kernel]] = {}
        # the caches' tensor maps: a re-plan (every step of a server) shares its predecessor's
        previous = options["previous"]
        self._maps: TensorMaps = (
            previous._maps
            if isinstance(previous, CudaNativeDecodePlan) and previous.device == self.device
            else TensorMaps(8)
        )
        self._host_plan = host_plan_forced()
        keep_static(self)  # what `replan` starts from: nothing here depends on the batch
        self._plan_batch(batch, previous)

    def replan(self, problem: Problem, batch: PagedBatch, options: PlanOptions) -> StagedPlan | None:
        """The plan of a new batch with this plan's static problem and tactic: this plan's static
        part (device, scalars, kernels, tensor maps) copied, the batch's part made
        (`_plan_batch`). None for another device or mode (the full path decides)."""
        if options["device"] != self.device or bool(options["use_cuda_graph"]) != self._graph:
            return None
        plan = from_static(self)
        plan.problem = problem  # type: ignore[assignment]
        plan._plan_batch(batch, self)
        return plan

    def _kernel_for(self, lengths: list[int], units: int) -> tuple[DecodeParams, Kernel, bool]:
        """The parameters and kernel for a batch of ``lengths`` attended keys (the default
        tactic's depend on whether the batch is small), and whether NVRTC compiled it now."""
        tactic, info, problem = self._requested, self._info, self.problem
        small = decode_is_small(lengths, units, info) if tactic.is_default else None
        found = self._kernels.get(small)
        if found is not None:
            return found[0], found[1], False
        if small is None:
            params = DecodeParams.from_tactic(tactic)
        else:
            params = default_decode_params(problem.head_dim_qk, info, small=small,
                                           fp8=problem.kv_dtype in FP8_KV_DTYPES)  # fmt: skip
        kernel, built = _decode_kernel(self._index, problem.q_dtype, problem.head_dim_qk, params, info,
                                       problem.kv_dtype)  # fmt: skip
        self._kernels[small] = (params, kernel)
        return params, kernel, built

    def _plan_batch(self, batch: PagedBatch, previous: object) -> None:
        """Everything of the plan that depends on the batch: work list, metadata, workspace, grid."""
        problem, info, index, graph = self.problem, self._info, self._index, self._graph
        b, hq, hkv, d = batch.batch_size, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk
        gqa = problem.gqa_ratio
        units = decode_units(hkv, gqa)
        attended = attended_lengths(batch.kv_lens_list, problem.window_left)
        longest_cap = bucket_size(batch.max_kv_len) if graph else batch.max_kv_len
        if graph and isinstance(previous, CudaNativeDecodePlan) and previous._graph:
            # a batch shorter than the captured one keeps the captured bucket: the same chunk, grid
            # and buffers serve it (as FlashInfer's CUDA-graph wrappers serve any batch they hold)
            longest_cap = max(longest_cap, previous._longest_cap)
        self._longest_cap = longest_cap
        attended_cap = longest_cap if problem.window_left < 0 else min(longest_cap, problem.window_left + 1)
        # in CUDA-graph mode sizes come from the bucket, so every batch of the bucket fits the captured grid
        lengths = [attended_cap] * b if graph else attended
        params, kernel, self.built = self._kernel_for(lengths, units)
        self.tactic = kernel.tactic
        self._kernel = kernel.kernel
        self.ctas_per_sm = kernel.ctas_per_sm
        slots = info.sms * self.ctas_per_sm
        chunk = params.kv_chunk or decode_chunk(lengths, units, params.tile, slots)
        # an eager plan with the automatic chunk recuts a short last wave (`decode_balance_tail`)
        self._recut = (units, slots, params.tile) if not graph and not params.kv_chunk else None
        on_device = decode_plan_on_device(b, self._host_plan)
        work: DecodeWork | None = None
        if not on_device:
            ranges = effective_lengths(batch.kv_lens_list, problem.window_left)
            chunk, work = decode_plan_work(ranges, lengths, units, slots, params, graph)
            items, slot_count = len(work.items), work.slots
        elif graph:  # (the buffers are the bucket's)
            items, slot_count = 0, 0
        else:
            items, slot_count = decode_bounds(attended, chunk, units, slots, self._recut is not None)
        item_cap, slot_cap, page_cap = decode_buffer_sizes(
            items, slot_count, batch.num_page_entries, graph=graph, batch=b, attended_cap=attended_cap,
            longest_cap=longest_cap, chunk=chunk, page_size=problem.page_size)  # fmt: skip
        self._work, self._kv_lens = work, batch.kv_lens_list
        self.chunk = chunk
        self.planned_on_device = on_device
        self._geometry = (b, hq, hkv, d, problem.page_size, item_cap, slot_cap, page_cap, params)
        self._bulk = params.bulk
        self._tma = params.tma
        replaced = previous if graph and previous is not None else None
        if replaced is not None and (
            not isinstance(replaced, CudaNativeDecodePlan) or replaced._geometry != self._geometry
        ):
            raise UnsupportedProblemError(NAME, problem, [
                "in CUDA-graph mode a re-plan must keep the batch size and the heads and fit the captured "
                "kv-length bucket (the captured grid and buffers depend on them); capture with the longest "
                "batch, or use one wrapper per captured shape"])  # fmt: skip

        if work is None:  # the records and their count are made on the device from the requests' offsets and lengths
            requests: list[Piece] = [[], [], batch.kv_indptr_list, batch.kv_lens_list]
            layout, base, indices_ptr = self._send(problem, batch, previous, graph,
                                                   lambda cap: decode_sections(item_cap, cap, b),
                                                   requests, page_cap)  # fmt: skip
            plan_kernel, plan_built = _plan_kernel(index, info.arch)
            self.built = self.built or plan_built
            recut = self._recut or (0, 0, 0)
            args = (base + 4 * layout.offset("kv_indptr"), base + 4 * layout.offset("kv_lens"),
                    base + 4 * layout.offset("items"), base + 4 * layout.offset("num_items"), b, chunk,
                    problem.window_left, *recut, DECODE_MIN_CHUNK)  # fmt: skip
            self._launch_plan(index, info.arch, plan_kernel, b, args)
        else:
            records: list[Piece] = [decode_items(work, batch.kv_indptr_list), [len(work.items)]]
            layout, base, indices_ptr = self._send(problem, batch, previous, graph,
                                                   functools.partial(decode_sections, item_cap),
                                                   records, page_cap)  # fmt: skip
        if isinstance(replaced, CudaNativeDecodePlan):  # CUDA-graph re-plan: the captured workspace
            self._part_o, self._part_lse = replaced._part_o, replaced._part_lse
            self._counters = replaced._counters
        elif (
            isinstance(previous, CudaNativeDecodePlan)
            and previous.device == self.device
            and previous._part_o.numel() >= max(slot_cap, 1) * hq * d
            and previous._part_lse.numel() >= max(slot_cap, 1) * hq
            and previous._counters.numel() >= b * units
        ):
            # an eager re-plan takes over the replaced plan's workspace (stream-ordered after its runs,
            # as the staging slots are); the kernel leaves every counter at zero after a run
            self._part_o, self._part_lse, self._counters = previous._part_o, previous._part_lse, previous._counters
        else:
            self._part_o = torch.empty(max(slot_cap, 1) * hq * d, dtype=torch.float32, device=self.device)
            self._part_lse = torch.empty(max(slot_cap, 1) * hq, dtype=torch.float32, device=self.device)
            self._counters = torch.zeros(b * units, dtype=torch.int32, device=self.device)
        self._ptrs = (
            base + 4 * layout.offset("items"),
            base + 4 * layout.offset("num_items"),
            indices_ptr,
            self._part_o.data_ptr(),
            self._part_lse.data_ptr(),
            self._counters.data_ptr(),
        )
        self._cfg = launch_config(decode_grid(item_cap, hkv, gqa), kernel.threads, kernel.smem)
        self._tail = (*self._ptrs, *self._scalars, *UNIT_SCALES, 0)  # the arguments after lse without extras
        self._seen: tuple[Any, ...] | None = None
        self._strides: tuple[int, ...] = ()
        self._q_copy: torch.Tensor | None = None
        self._inherit_accepted(previous)

    def _launch_plan(self, index: int, arch: str, kernel: Any, batch: int, args: tuple[int, ...]) -> None:
        """Enqueue the device plan's kernel on the current stream: through the driver where it can
        be (`_plan_launcher`), else, and from then on after a launch the driver refused, through
        ``cuda.core``."""
        fast = _plan_launcher(index, arch, kernel)
        if fast is not None:
            try:
                fast((1, 1, 1), (DECODE_PLAN_THREADS, 1, 1), raw_stream(index), *args, smem=decode_plan_smem(batch))
                return
            except TactixError as exc:
                _plan_launchers[(index, arch)] = None
                log.warning("cuda_native: the decode plan's kernel is launched through cuda.core from now on: %s", exc)
        self._launch_fn(stream_for(index, raw_stream(index)), _plan_config(batch), kernel, *args)

    @property
    def work(self) -> DecodeWork:
        """The work list in its host form: the plan's own, or for records made on the device
        (`planned_on_device`) the same list recomputed here (for inspection: plans do not use it)."""
        if self._work is None:
            work = decode_work(effective_lengths(self._kv_lens, self.problem.window_left), self.chunk)
            self._work = work if self._recut is None else decode_balance_tail(work, *self._recut)
        return self._work

    def _accept(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Check the cache strides and q's once per new set of strides; keep the stride arguments."""
        self._strides = cache_strides(self.problem.kv_layout, k, v)
        for name, t in (("k", k), ("v", v)) if self._bulk and not self._tma else ():
            if t.stride(2) != t.shape[3]:  # HND (the tactic's check): [pages, heads, tokens, head_dim]
                raise InvalidArgumentError(
                    f"paged_kv_cache ({name})",
                    f"rows of a page contiguous (token stride = head_dim) for the bulk-copy tactic "
                    f"(bulk={self._bulk}; plan with another tactic for this cache)",
                    f"strides {tuple(t.stride())}",
                )
        self._q_direct = q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
        self._seen = (q.stride(), k.stride(), v.stride())

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None, k_scale: float | torch.Tensor | None = None,
            v_scale: float | torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """Launch the kernel; ``k_scale`` and ``v_scale`` (run extras, `paged.scale_args`): floats,
        or one-element float32 device tensors whose value the kernel reads; ``sinks`` (a run extra,
        checked by the core): a float32 ``[num_qo_heads]`` device tensor the kernel reads."""
        q, k_ptr, v_ptr, out_ptr = self._operands(q, k_cache, v_cache, out)
        lse_ptr = 0 if lse is None else lse.data_ptr()
        stream = stream_for(self._index, raw_stream(self._index))
        tail = self._tail if k_scale is None and v_scale is None and sinks is None else (
            *self._ptrs, *self._scalars, *scale_args(k_scale, v_scale),
            0 if sinks is None else sinks.data_ptr())  # fmt: skip
        args: tuple[Any, ...] = (q.data_ptr(), q.stride(0), q.stride(1), k_ptr, v_ptr, *self._strides, out_ptr, lse_ptr,
                                 *tail)  # fmt: skip
        if self._tma:
            args = (self._cache_map(k_cache, "k"), self._cache_map(v_cache, "v"), *args)
        self._launch_fn(stream, self._cfg, self._kernel, *args)

    def _cache_map(self, t: torch.Tensor, name: str) -> Any:
        """The tensor map of a K or V cache ([pages][heads][tokens][D], HND), boxes of 64 of D x
        ``bulk`` tokens."""
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        return self._maps.get(key, lambda: tensor_map(t, (1, 1, self._bulk, 64)), f"paged_kv_cache ({name})")


def plan_decode(problem: DecodeProblem, batch: PagedBatch, tactic: Tactic,
                options: PlanOptions) -> CudaNativeDecodePlan:  # fmt: skip
    """The plan hook's work: the check's reasons as an `UnsupportedProblemError`, else the plan."""
    reasons = decode_reasons(problem, tactic, device_info(device_index(options["device"])))
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudaNativeDecodePlan(problem, batch, tactic, options)
