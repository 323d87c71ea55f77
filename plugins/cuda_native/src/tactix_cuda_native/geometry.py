"""Launch geometry as pure functions: tactic parameters, shared memory, work lists, split counts, grids.

Nothing here touches CUDA, so every rule is tested on a machine without a GPU. `DeviceInfo`
carries the few device properties the heuristics need; `H200` is the default for compiling
ahead of time (and for the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from dataclasses import dataclass
from typing import ClassVar, Final

from tactix import Tactic

__all__ = [
    "DECODE_BULK",
    "GEMM_TMA",
    "H200",
    "DecodeParams",
    "DecodeWork",
    "DeviceInfo",
    "GemmParams",
    "GemmWgmmaParams",
    "PrefillParams",
    "PrefillWork",
    "arch_at_least",
    "ctas_per_sm",
    "decode_balance_tail",
    "decode_buffer_sizes",
    "decode_chunk",
    "decode_plan_work",
    "decode_smem_bytes",
    "decode_units",
    "decode_work",
    "default_decode_params",
    "default_gemm_params",
    "default_prefill_params",
    "default_sync_gemm_params",
    "gemm_smem_bytes",
    "gemm_splits",
    "gemm_wgmma_candidates",
    "gemm_wgmma_k_per_split",
    "gemm_wgmma_splits",
    "prefill_candidates",
    "prefill_capacity",
    "prefill_default_persist",
    "prefill_grid",
    "prefill_pack",
    "prefill_persistent_ctas",
    "prefill_range",
    "prefill_smem_bytes",
    "prefill_work",
    "wgmma_arch",
]

NAME: Final = "cuda_native"
HEAD_DIMS: Final = (64, 128, 256)
MAX_PAGE_SIZE: Final = 128
Q_TILE: Final = 16  # query heads of one GQA group per CTA (the mma's 16 rows)
GEMM_MAX_M: Final = 64
SMEM_RESERVED_PER_CTA: Final = 1024  # the driver keeps 1 KB of each CTA's shared memory
FLAG_BYTES: Final = 16  # the "last CTA" flag at the end of both kernels' dynamic shared memory
L2_HINTS: Final = (0, 1, 2)  # 0: none, 1: evict_first on the KV cache (GEMM: none), 2: 1 + 256-byte L2 prefetch
DECODE_ITEM_INTS: Final = 8  # ints per work item record (kernels/decode.cu)


@dataclass(frozen=True)
class DeviceInfo:
    """What the heuristics need to know about a GPU."""

    sms: int
    smem_per_block: int  # largest dynamic shared memory a CTA may opt into
    smem_per_sm: int
    arch: str  # "sm_90"


H200: Final = DeviceInfo(sms=132, smem_per_block=232448, smem_per_sm=233472, arch="sm_90")


def _int_param(tactic: Tactic, key: str, default: int | None = None) -> int:
    """An integer parameter of a tactic (the plugin's check has validated it before a plan is made)."""
    value = tactic.params.get(key, default)
    assert isinstance(value, int)
    return value


def ctas_per_sm(info: DeviceInfo, smem: int, threads: int, max_threads: int = 2048, resident: int | None = None) -> int:
    """How many CTAs of this shared-memory size and width fit on one SM (at least 1): ``resident``
    where the driver's occupancy calculator answered (it knows the registers), else an estimate
    from shared memory and threads, at most 4."""
    if resident is not None:
        return max(1, resident)
    by_smem = info.smem_per_sm // (smem + SMEM_RESERVED_PER_CTA)
    return max(1, min(4, by_smem, max_threads // threads))


# -- decode ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeParams:
    """A decode tactic's parameters: tile (tokens per stage), warps, stages, the KV chunk policy, L2 hint.

    ``kv_chunk`` is the number of keys one CTA handles before its partial result is merged with
    the others of its request (a multiple of ``tile``), or 0 for the heuristic (`decode_chunk`).
    ``l2``: 1 (default) streams K/V with an L2 evict_first policy, 0 without a hint, 2 adds a
    256-byte L2 prefetch to 1. ``bulk``: 0 (default) gathers K/V rows with 16-byte ``cp.async``;
    8, 16 or 32 copies that many tokens at a time with bulk copies (sm_90 and later; HND caches
    whose pages hold a multiple of ``bulk`` tokens, rows contiguous: kernels/decode.cu). ``tma``
    1 (with ``bulk``) copies those segments through tensor maps of the caches (the 128-byte
    swizzle, any 16-byte strides) instead of linear bulk copies.
    """

    tile: int
    warps: int
    stages: int
    kv_chunk: int = 0
    l2: int = 1
    bulk: int = 0
    tma: int = 0

    def to_tactic(self) -> Tactic:
        params = {"tile": self.tile, "warps": self.warps, "stages": self.stages, "kv_chunk": self.kv_chunk}
        if self.l2 != 1:  # the default hint stays implicit, so tactics stored before it existed still match
            params["l2"] = self.l2
        if self.bulk:  # as does cp.async (0)
            params["bulk"] = self.bulk
        if self.tma:  # and linear bulk copies
            params["tma"] = self.tma
        return Tactic(backend=NAME, kernel="decode", params=params)

    @classmethod
    def from_tactic(cls, tactic: Tactic) -> DecodeParams:
        get = functools.partial(_int_param, tactic)
        return cls(get("tile"), get("warps"), get("stages"), get("kv_chunk", 0), get("l2", 1), get("bulk", 0),
                   get("tma", 0))  # fmt: skip

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
            smem = decode_smem_bytes(head_dim, self.tile, self.warps, self.stages, self.bulk, self.tma)
            if smem > info.smem_per_block:
                out.append(f"needs {smem} bytes of shared memory; this GPU allows {info.smem_per_block} per CTA")
        return out


def decode_smem_bytes(head_dim: int, tile: int, warps: int, stages: int, bulk: int = 0, tma: int = 0) -> int:
    """Dynamic shared memory of the decode kernel (see the layout in kernels/decode.cu): with
    ``bulk`` (linear copies, not ``tma``), each copy's segment of a tile is 16 bytes longer."""
    row = head_dim * 2
    tile_bytes = tile * row + (tile // bulk * 16 if bulk and not tma else 0)
    return stages * 2 * tile_bytes + 16 * row + stages * 2 * tile * 8 + warps * 32 * 4 + 32 * 4 + FLAG_BYTES


DECODE_BULK: Final = (0, 8, 16, 32)


def arch_at_least(arch: str, cc: int) -> bool:
    """Whether ``arch`` ("sm_90", "sm_90a", "sm_100") is compute capability ``cc`` or later."""
    digits = arch.removeprefix("sm_").rstrip("abf")
    return digits.isdigit() and int(digits) >= cc


def decode_candidates(head_dim: int, info: DeviceInfo) -> list[DecodeParams]:
    """The tactic space the tuner explores (every entry valid for ``head_dim`` on ``info``).

    Shapes by CTAs per SM on an H200 (d128): (64, 4, 2) 3, (64, 4, 3) 2, (32, 2, 2) 5,
    (32, 2, 3) 4, (128, 8, 2) 1; then the default shape with fixed chunks and other L2 hints.
    """
    shapes = [(64, 4, 2), (64, 4, 3), (32, 2, 2), (32, 2, 3), (128, 8, 2), (128, 8, 3)]
    out = [DecodeParams(t, w, s) for t, w, s in shapes]
    base = default_decode_params(head_dim, info)
    out += [DecodeParams(base.tile, base.warps, base.stages, c) for c in (256, 512, 1024, 2048)]
    # deep pipelines: most of a short work item's bytes in flight at once (latency-bound batches)
    out += [DecodeParams(base.tile, base.warps, s, c) for s in (4, 6) for c in (0, 256, 512, 1024)]
    out += [DecodeParams(base.tile, base.warps, base.stages, 0, hint) for hint in L2_HINTS if hint != base.l2]
    # bulk copies (sm_90+; the plugin drops them for NHD caches and page sizes they do not divide)
    if arch_at_least(info.arch, 90):
        out += [DecodeParams(t, w, s, 0, hint, bulk) for t, w, s, bulk in
                ((64, 4, 2, 16), (64, 4, 2, 8), (64, 4, 3, 16), (64, 4, 3, 8), (128, 8, 2, 16), (32, 2, 2, 8))
                for hint in (0, 1)]  # fmt: skip
        # the same segments through tensor maps (the plugin drops them where maps cannot be encoded):
        # the two that led on the H200 (h200-decode-tma-sweep.log: D3 without the L2 hint, D2 with 3 stages)
        out += [DecodeParams(64, 4, 2, 0, 0, 16, 1), DecodeParams(64, 4, 3, 0, 1, 16, 1)]
    return [p for p in dict.fromkeys(out) if not p.reasons(head_dim, info)]


def default_decode_params(head_dim: int, info: DeviceInfo, small: bool = False) -> DecodeParams:
    """The heuristic tactic.

    Measured on the H200 (d128, 32/8 heads): throughput follows the warps resident per SM, so the
    default is the shape with the most: tiles of 64 keys, 4 warps, 2 stages (72 KB of shared
    memory, 153 registers a thread: 3 CTAs, 12 warps per SM). A ``small`` batch (one wave of
    CTAs: latency, not bandwidth, decides) takes one stage more: two tiles in flight per CTA.
    d64 fits 4 CTAs of (64, 4, 3); d256 keeps 3 CTAs with (32, 2, 2).
    """
    preferred = {64: (64, 4, 3), 128: (64, 4, 2), 256: (32, 2, 2)}.get(head_dim, (64, 4, 2))
    tile, warps, stages = preferred
    if small:
        stages += 1
    while stages > 2 and decode_smem_bytes(head_dim, tile, warps, stages) > info.smem_per_block:
        stages -= 1
    while tile > 32 and decode_smem_bytes(head_dim, tile, warps, stages) > info.smem_per_block:
        tile, warps = tile // 2, max(2, warps // 2)
    return DecodeParams(tile, warps, stages)


DECODE_MIN_CHUNK: Final = 512
"""Fewest keys per split work item. Measured on the H200 (D2: one request of 8192 keys, 8 KV
heads): 512-key pieces (16 per head, 128 CTAs) 21.0-21.2 us against 22.1-22.3 for 256-key pieces
(32 per head, 256 CTAs) in two runs: half the partial outputs to write and merge outweighs the
idle SMs (benchmarks/results/h200-decode-sweep-deep.json)."""


def decode_is_small(lengths: list[int], units: int, info: DeviceInfo, min_chunk: int = DECODE_MIN_CHUNK) -> bool:
    """Whether a batch is one wave at two CTAs per SM even when cut into ``min_chunk``-key pieces
    (D2: 8192 keys x 8 KV heads = 128 pieces of 512 keys <= 264): latency-bound."""
    pieces = sum(_ceils(lengths, min_chunk)) * units
    return pieces <= 2 * info.sms


def _ceils(lengths: list[int], unit: int) -> list[int]:
    """``max(1, ceil(n / unit))`` per length, in C-level maps (plans call this for every batch)."""
    out = list(map(operator.floordiv, map(operator.add, lengths, itertools.repeat(unit - 1)), itertools.repeat(unit)))
    if lengths and min(lengths) < 1:
        out = [max(1, c) for c in out]
    return out


def q_tiles(gqa: int) -> int:
    """CTAs per KV head: one per 16 query heads of its group."""
    return -(-gqa // Q_TILE)


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
    the longest request is then cut into equal pieces (no short last piece). D2 (1 x 8192 keys,
    8 KV heads) gives 512-key chunks, 128 CTAs; D3 (256 x 2048, 396 slots) no split: 2048 CTAs.
    """
    tiles = _ceils(lengths, tile)
    longest = max(tiles)
    total = sum(tiles) * units
    chunk_tiles = -(-total // (DECODE_ITEMS_PER_SLOT * slots))
    chunk_tiles = min(max(chunk_tiles, -(-min_chunk // tile), 1), longest)
    pieces = -(-longest // chunk_tiles)
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


def decode_capacity(batch: int, max_len: int, chunk: int) -> int:
    """Most work items any batch of ``batch`` requests up to ``max_len`` keys can need at ``chunk``."""
    return batch * max(1, -(-max_len // chunk))


def decode_buffer_sizes(work: DecodeWork, num_page_entries: int, *, graph: bool, batch: int, attended_cap: int,
                        longest_cap: int, chunk: int, page_size: int) -> tuple[int, int, int]:  # fmt: skip
    """Work items, partial-output slots and page entries a decode plan's buffers hold: the batch's
    own, or in CUDA-graph mode the most any batch of its buckets needs (the captured grid and
    buffers must fit every re-plan)."""
    if graph:
        items = decode_capacity(batch, attended_cap, chunk)
        return items, items, batch * -(-longest_cap // page_size)
    return len(work.items), work.slots, num_page_entries


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


# -- prefill ---------------------------------------------------------------------------------

PREFILL_SCHEDULES: Final = ("requests_by_work", "in_order", "longest_first")
PREFILL_MMAS: Final = ("sync", "wgmma")
"""The prefill kernels: "sync" kernels/prefill.cu (mma.sync, any GPU from sm_80), "wgmma"
kernels/prefill_sm90.cu (Hopper warpgroup MMA, compiled for sm_90a)."""
WGMMA_ARCHS: Final = ("sm_90", "sm_90a")
WGMMA_HEAD_DIMS: Final = (64, 128, 256)
WGMMA_ACCUMULATORS: Final = 176
"""Registers per consumer thread the wgmma kernel's O, S and P take at most (head_dim / 2 +
kv_tile / 2 + kv_tile / 4): d256 with 128-key tiles (224) spills at the 232 a consumer gets."""


def wgmma_arch(arch: str) -> str:
    """The NVRTC target of the wgmma kernel for a GPU of ``arch``: wgmma needs the arch-specific
    ``sm_90a`` (its cubins run only on sm_90 GPUs)."""
    return "sm_90a" if arch in WGMMA_ARCHS else arch


@dataclass(frozen=True)
class PrefillParams:
    """A prefill tactic's parameters (see kernels/prefill.cu and kernels/prefill_sm90.cu).

    ``mma``: "sync" (mma.sync, the default: left out of the tactic's params so tactics stored
    before the wgmma kernel existed keep matching) or "wgmma" (Hopper only). ``q_tile``: query
    rows per CTA (sync: 16 or 32 per warp; wgmma: 64 or 128, one consumer warpgroup per 64);
    ``kv_tile``: keys per pipeline stage; ``warps``: the warps computing (wgmma: q_tile / 16, the
    consumer warpgroups; a producer warpgroup of 4 more gathers K/V); ``stages``: depth of the K/V
    ring; ``pack``: query heads of one GQA group per CTA (0: the heuristic `prefill_pack`, else a
    divisor of the group size up to ``q_tile``); ``sched``: order of the work items (see
    `prefill_work`: 0 requests by work, each longest first; 1 in request order; 2 longest first
    over the whole batch). ``persist`` (wgmma only; 0, the default, is left out of the tactic's
    params): 1 launches persistent CTAs, as many as the GPU holds at once (`prefill_persistent_ctas`),
    each looping over the work items (item x head group) in turn with the K/V ring running on
    across them, so the producer prefetches the next item's keys during the current epilogue.
    ``pingpong`` (wgmma with two consumer warpgroups, q_tile 128; 0, the default, left out): 1
    makes the warpgroups take turns at the tensor cores (FlashAttention-3's schedule: named
    barriers; each issues S of a tile and P V of the previous one in its turn, then computes its
    softmax while the other's GEMMs run).
    """

    q_tile: int
    kv_tile: int
    warps: int
    stages: int
    pack: int = 0
    sched: int = 0
    mma: str = "sync"
    persist: int = 0
    pingpong: int = 0

    KEYS: ClassVar[tuple[str, ...]] = (
        "q_tile", "kv_tile", "warps", "stages", "pack", "sched", "mma", "persist", "pingpong"
    )  # fmt: skip
    OPTIONAL_FLAGS: ClassVar[tuple[str, ...]] = ("persist", "pingpong")  # left out of the params when 0
    REQUIRED: ClassVar[tuple[str, ...]] = ("q_tile", "kv_tile", "warps", "stages")

    @property
    def m_tiles(self) -> int:
        """m16 tiles per warp (sync)."""
        return self.q_tile // (16 * self.warps)

    @property
    def threads(self) -> int:
        """Threads per CTA: the computing warps, and for wgmma the producer warpgroup."""
        return 32 * self.warps + (128 if self.mma == "wgmma" else 0)

    def smem_bytes(self, head_dim: int) -> int:
        return prefill_smem_bytes(head_dim, self.q_tile, self.kv_tile, self.stages, self.mma)

    def to_tactic(self) -> Tactic:
        params: dict[str, int | str] = {
            k: getattr(self, k) for k in self.KEYS if k != "mma" and k not in self.OPTIONAL_FLAGS
        }
        if self.mma != "sync":  # the default stays implicit
            params["mma"] = self.mma
        for flag in self.OPTIONAL_FLAGS:  # so do their defaults (0): tactics stored before them keep matching
            if getattr(self, flag):
                params[flag] = getattr(self, flag)
        return Tactic(backend=NAME, kernel="prefill", params=params)  # type: ignore[arg-type]

    @classmethod
    def from_tactic(cls, tactic: Tactic) -> PrefillParams:
        get = functools.partial(_int_param, tactic)
        mma = tactic.params.get("mma", "sync")
        assert isinstance(mma, str)
        return cls(get("q_tile"), get("kv_tile"), get("warps"), get("stages"), get("pack", 0), get("sched", 0), mma,
                   get("persist", 0), get("pingpong", 0))  # fmt: skip

    def reasons(self, head_dim: int, info: DeviceInfo, gqa: int | None = None) -> list[str]:
        if self.mma not in PREFILL_MMAS:
            return [f"mma must be 'sync' or 'wgmma' (got {self.mma!r})"]
        out = self._wgmma_reasons(head_dim, info) if self.mma == "wgmma" else self._sync_reasons()
        if self.pack < 0:
            out.append(f"pack must be 0 (auto) or a divisor of the GQA group size (got {self.pack})")
        elif self.pack and gqa is not None and (gqa % self.pack or self.pack > self.q_tile):
            out.append(f"pack {self.pack} must divide the GQA group size {gqa} and be at most q_tile {self.q_tile}")
        if self.sched not in (0, 1, 2):
            out.append(f"sched must be 0, 1 or 2 ({', '.join(PREFILL_SCHEDULES)}) (got {self.sched})")
        if self.persist not in (0, 1):
            out.append(f"persist must be 0 (one CTA per work item) or 1 (persistent CTAs) (got {self.persist})")
        elif self.persist and self.mma != "wgmma":
            out.append("persist 1 needs mma 'wgmma' (kernels/prefill_sm90.cu)")
        elif self.persist and (self.q_tile, self.kv_tile, head_dim) == (64, 128, 128):
            out.append(
                "persist 1 with q_tile 64, kv_tile 128 at head dim 128 spills registers (the producer's loop "
                "over items needs more than one consumer warpgroup can give); use kv_tile 64 or q_tile 128"
            )
        if self.pingpong not in (0, 1):
            out.append(f"pingpong must be 0 or 1 (the consumer warpgroups take turns) (got {self.pingpong})")
        elif self.pingpong and (self.mma != "wgmma" or self.q_tile != 128):
            out.append("pingpong 1 needs mma 'wgmma' with two consumer warpgroups (q_tile 128)")
        if not out:
            if self.mma == "sync":
                regs = self.m_tiles * (head_dim + self.kv_tile) // 2
                if regs > 192:
                    out.append(
                        f"O and S accumulators need {regs} registers per thread (q_tile {self.q_tile}, "
                        f"{self.warps} warps, kv_tile {self.kv_tile}, head dim {head_dim}); at most 192 fit"
                    )
            else:
                regs = head_dim // 2 + self.kv_tile // 2 + self.kv_tile // 4
                if regs > WGMMA_ACCUMULATORS:
                    out.append(
                        f"O, S and P need {regs} registers per consumer thread (kv_tile {self.kv_tile}, head dim "
                        f"{head_dim}); at most {WGMMA_ACCUMULATORS} fit with mma 'wgmma'"
                    )
            smem = self.smem_bytes(head_dim)
            if smem > info.smem_per_block:
                out.append(f"needs {smem} bytes of shared memory; this GPU allows {info.smem_per_block} per CTA")
        return out

    def _sync_reasons(self) -> list[str]:
        out = []
        if self.warps not in (2, 4, 8):
            out.append(f"warps must be 2, 4 or 8 (got {self.warps})")
        elif self.q_tile % (16 * self.warps) or self.m_tiles not in (1, 2):
            out.append(f"q_tile must be 16 or 32 rows per warp (got q_tile {self.q_tile}, warps {self.warps})")
        if self.kv_tile not in (32, 64, 128):
            out.append(f"kv_tile must be 32, 64 or 128 (got {self.kv_tile})")
        elif self.warps in (2, 4, 8) and self.kv_tile > 32 * self.warps:
            out.append(f"kv_tile {self.kv_tile} exceeds the {32 * self.warps} threads of {self.warps} warps")
        if not 2 <= self.stages <= 4:
            out.append(f"stages must be in 2..4 (got {self.stages})")
        return out

    def _wgmma_reasons(self, head_dim: int, info: DeviceInfo) -> list[str]:
        out = []
        if info.arch not in WGMMA_ARCHS:
            out.append(f"mma 'wgmma' needs a Hopper GPU (sm_90); this one is {info.arch} (use mma 'sync')")
        if head_dim not in WGMMA_HEAD_DIMS:
            out.append(f"mma 'wgmma' supports head dims {WGMMA_HEAD_DIMS} (got {head_dim}; use mma 'sync')")
        if self.q_tile not in (64, 128) or self.warps != self.q_tile // 16:
            out.append(
                f"with mma 'wgmma' q_tile must be 64 or 128 and warps q_tile / 16, the consumer warps of 64 rows "
                f"per warpgroup (got q_tile {self.q_tile}, warps {self.warps})"
            )
        if self.kv_tile not in (64, 128):
            out.append(f"with mma 'wgmma' kv_tile must be 64 or 128 (got {self.kv_tile})")
        if not 2 <= self.stages <= 4:
            out.append(f"stages must be in 2..4 (got {self.stages})")
        return out


def prefill_smem_bytes(head_dim: int, q_tile: int, kv_tile: int, stages: int, mma: str = "sync") -> int:
    """Dynamic shared memory of the prefill kernel (see the layouts in kernels/prefill.cu and
    kernels/prefill_sm90.cu: for wgmma, Q + stages x (K, V) tiles + a K and a V row pointer per
    key of a tile + four mbarriers per stage)."""
    row = head_dim * 2
    if mma == "wgmma":
        return q_tile * row + stages * 2 * kv_tile * row + kv_tile * 16 + 4 * stages * 8
    return q_tile * row + stages * 2 * kv_tile * row + stages * 2 * kv_tile * 8 + q_tile * 8 + 16


_PREFILL_DEFAULTS: Final = {64: (128, 64, 4, 3), 128: (128, 32, 4, 3), 256: (64, 32, 4, 2)}
"""q_tile, kv_tile, warps, stages per head dim: two or more CTAs of 4 warps per H200 SM, no spills."""

_WGMMA_DEFAULTS: Final = {64: (128, 128, 8, 3), 128: (128, 128, 8, 3), 256: (128, 64, 8, 2)}
"""wgmma (sm_90): two consumer warpgroups of 64 rows (FlashAttention-3's 128 x 128 tile for d128),
one CTA per SM (the 384 threads take every register). The candidates with one consumer
warpgroup (q_tile 64) launch with 128 registers a thread up to d128, so two CTAs share an SM
where their shared memory fits (d128: kv_tile 64, 2 stages)."""

_WGMMA_PINGPONG: Final = frozenset({64, 128})
"""Head dims whose wgmma default runs the warpgroups' ping-pong: on the H200 it was faster than
without on all of P1-P4 at d64 and d128 (3 stages; d128 P2 567 against 547 TFLOP/s, d64 P2 380
against 351: benchmarks/results/h200-prefill-sweep.json, h200-prefill-sweep-d64.json), slower
at d256 (kv_tile 64: P2 510 against 531, h200-prefill-sweep-d256.json)."""

PERSIST_MAX_MEAN_KEYS: Final = 2048
"""The default goes persistent (`prefill_default_persist`) when the batch's work items walk at
most this many keys on average: there the per-item prologue and epilogue weigh most, and
persistent CTAs hide them (H200, d128, 128-key tiles: P1, 8.5 tiles an item, 471 against 442
TFLOP/s; P3 366 against 347). With long items the static split of persistent CTAs balances
worse than the hardware's dispatch of one CTA per item (P2, 32.5 tiles: 547 against 567)."""


def default_prefill_params(head_dim: int, info: DeviceInfo, mma: str | None = None) -> PrefillParams:
    """The heuristic tactic: on Hopper the wgmma kernel (`_WGMMA_DEFAULTS`); elsewhere, or with
    ``mma="sync"``, the mma.sync kernel with 4 warps, 32 rows per warp where the accumulators fit
    (d64, d128), the deepest ring that still leaves two CTAs per SM; smaller tiles where shared
    memory is short."""
    shape = _WGMMA_DEFAULTS.get(head_dim)
    if shape is not None and (mma == "wgmma" or (mma is None and info.arch in WGMMA_ARCHS)):
        params = PrefillParams(*shape, mma="wgmma", pingpong=int(head_dim in _WGMMA_PINGPONG))
        if mma == "wgmma" or not params.reasons(head_dim, info):
            return params
    q_tile, kv_tile, warps, stages = _PREFILL_DEFAULTS.get(head_dim, (64, 32, 4, 2))
    while stages > 2 and prefill_smem_bytes(head_dim, q_tile, kv_tile, stages) > info.smem_per_block:
        stages -= 1
    while kv_tile > 32 and prefill_smem_bytes(head_dim, q_tile, kv_tile, stages) > info.smem_per_block:
        kv_tile //= 2
    while q_tile > 16 * warps and prefill_smem_bytes(head_dim, q_tile, kv_tile, stages) > info.smem_per_block:
        q_tile //= 2
    return PrefillParams(q_tile, kv_tile, warps, stages)


_PREFILL_SHAPES: Final = {
    64: [(128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4)],
    128: [(128, 32, 4, 3), (128, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2)],
}

_WGMMA_SHAPES: Final = {
    64: [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 128, 4, 3)],
    128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 2)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3)],
}


def prefill_candidates(head_dim: int, info: DeviceInfo, gqa: int = 1) -> list[PrefillParams]:
    """The tactic space the tuner explores: mma.sync tile shapes, wgmma tile shapes (on Hopper),
    then the default's with one head per CTA and with work in request order, then (on Hopper)
    the wgmma shapes with persistent CTAs and with the warpgroups' ping-pong (every entry valid
    for ``head_dim`` on ``info``)."""
    out = [PrefillParams(*shape) for shape in _PREFILL_SHAPES.get(head_dim, [])]
    out += [PrefillParams(*shape, mma="wgmma") for shape in _WGMMA_SHAPES.get(head_dim, [])]
    base = default_prefill_params(head_dim, info)
    shape = (base.q_tile, base.kv_tile, base.warps, base.stages)
    if gqa > 1:
        out.append(PrefillParams(*shape, pack=1, mma=base.mma))
    out += [PrefillParams(*shape, sched=sched, mma=base.mma) for sched in (1, 2)]
    # persistent CTAs (wgmma): every wgmma shape, and the default's with longest-first order; the
    # warpgroups' ping-pong: every shape with two, with and without persistent CTAs
    wgmma_shapes = _WGMMA_SHAPES.get(head_dim, [])
    out += [PrefillParams(*shape, mma="wgmma", persist=1) for shape in wgmma_shapes]
    if base.mma == "wgmma":
        out.append(PrefillParams(*shape, sched=2, mma="wgmma", persist=1))
    out += [PrefillParams(*shape, mma="wgmma", persist=persist, pingpong=1) for shape in wgmma_shapes
            for persist in (0, 1) if shape[0] == 128]  # fmt: skip
    if base.pingpong:  # the default's persistent form with the whole batch longest first (rounds back and forth)
        out.append(PrefillParams(*shape, sched=2, mma="wgmma", persist=1, pingpong=1))
    unique = list(dict.fromkeys(out))
    return [p for p in unique if not p.reasons(head_dim, info, gqa)]


def prefill_default_persist(params: PrefillParams, tiles: list[int], head_dim: int, info: DeviceInfo) -> PrefillParams:
    """The default tactic for one batch: ``params`` (`default_prefill_params`) with persistent
    CTAs where it runs the ping-pong, its work items (``tiles``: the KV tiles each walks,
    `PrefillWork`) are short on average (`PERSIST_MAX_MEAN_KEYS`) and the kernel takes them, else
    ``params`` unchanged. (Without the ping-pong, at d256, persistent CTAs were slower on every
    case: h200-prefill-sweep-d256.json.)"""
    if params.mma != "wgmma" or not params.pingpong or params.persist or not tiles:
        return params
    if sum(tiles) * params.kv_tile > PERSIST_MAX_MEAN_KEYS * len(tiles):
        return params
    persistent = dataclasses.replace(params, persist=1)
    return params if persistent.reasons(head_dim, info) else persistent


def prefill_pack(gqa: int, q_tile: int, requested: int = 0) -> int:
    """Query heads per CTA: the requested count, else the largest divisor of the GQA group size
    up to ``q_tile``. Packing a group's heads fills a tile's rows with heads where a request has
    few tokens, and reads each K/V tile once for all of them; for long requests it changes
    nothing (as many CTAs, each over as many keys)."""
    if requested:
        return requested
    return max(p for p in range(1, min(gqa, q_tile) + 1) if gqa % p == 0)


def prefill_range(q_len: int, kv_len: int, t0: int, t1: int, causal: bool, window_left: int) -> tuple[int, int]:
    """The keys ``[lo, hi)`` attended by query tokens ``[t0, t1)`` of a request (what a CTA walks).

    Token ``t`` sits at position ``kv_len - q_len + t`` (bottom-right alignment); it attends keys
    up to its position when causal (all keys otherwise) and from ``position - window_left`` on
    with a window. Must match ``kv_lo``/``kv_hi`` in kernels/prefill.cu.
    """
    delta = kv_len - q_len
    lo = max(0, delta + t0 - window_left) if window_left >= 0 else 0
    hi = min(kv_len, delta + t1) if causal else kv_len
    return lo, hi


@dataclass(frozen=True)
class PrefillWork:
    """The host-side work list of a prefill batch.

    ``items``: (request, first query token) per work item, in launch order; ``tiles``: the KV
    tiles each item walks (its cost); ``tokens``: query tokens per item (``q_tile // pack``);
    ``pack``: query heads per CTA. Each item becomes ``num_qo_heads // pack`` CTAs.
    """

    items: list[tuple[int, int]]
    tiles: list[int]
    tokens: int
    pack: int


def prefill_work(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    q_tile: int,
    kv_tile: int,
    pack: int,
    causal: bool,
    window_left: int,
    sched: int = 0,
) -> PrefillWork:
    """Cut each request's query tokens into items of ``q_tile // pack`` tokens and order them.

    The GPU dispatches CTAs in grid order, so the order is the schedule. sched 0 (default):
    requests by their total work, largest first, and each request's items longest first: the
    batch ends on the smallest request's shortest items (as longest-processing-time scheduling
    would), while the CTAs in flight at any time read the K/V of one or two requests, which stay
    in L2. sched 1: request order, items in token order. sched 2: longest first over the whole
    batch (the tightest end, but equal items of every request run together: with many long
    requests their K/V do not all fit in L2).
    """
    tokens = q_tile // pack
    items: list[tuple[int, int]] = []
    tiles: list[int] = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        # prefill_range for every item of the request, written out (plan time: ~0.3 us an item)
        delta = kv_len - q_len
        starts = range(0, q_len, tokens)
        items += [(b, t0) for t0 in starts]
        his = [min(kv_len, delta + min(q_len, t0 + tokens)) for t0 in starts] if causal else [kv_len] * len(starts)
        if window_left >= 0:
            los = [max(0, delta + t0 - window_left) for t0 in starts]
            tiles += [-(-(hi - lo) // kv_tile) for lo, hi in zip(los, his, strict=True)]
        else:
            tiles += [-(-hi // kv_tile) for hi in his]
    if sched != 1 and items:
        if sched == 0:
            work: dict[int, int] = {}
            for (b, _), n in zip(items, tiles, strict=True):
                work[b] = work.get(b, 0) + n
            key = lambda i: (-work[items[i][0]], items[i][0], -tiles[i])  # noqa: E731
        else:
            key = lambda i: -tiles[i]  # noqa: E731
        order = sorted(range(len(items)), key=key)  # stable: ties keep request and token order
        items = [items[i] for i in order]
        tiles = [tiles[i] for i in order]
    return PrefillWork(items, tiles, tokens, pack)


def prefill_capacity(batch: int, num_tokens: int, tokens_per_item: int) -> int:
    """Most work items a batch of up to ``batch`` requests and ``num_tokens`` query tokens can need."""
    return -(-num_tokens // tokens_per_item) + batch


def prefill_grid(items: int, num_qo_heads: int, pack: int, persistent: int = 0) -> tuple[int, int, int]:
    """One CTA per work item and group of ``pack`` query heads, heads fastest; with
    ``persistent`` > 0 (the CTAs the GPU holds at once, `prefill_persistent_ctas`) at most that
    many, each looping over every ``grid``-th of them (kernels/prefill_sm90.cu, TX_PERSIST).
    ``items`` is the capacity in CUDA-graph mode: the grid stays fixed for every batch of the
    plan's buckets, and CTAs or loop turns past the real item count do nothing."""
    ctas = max(1, items) * (num_qo_heads // pack)
    return (min(ctas, persistent) if persistent > 0 else ctas, 1, 1)


def prefill_persistent_ctas(info: DeviceInfo, ctas_sm: int) -> int:
    """The persistent grid's size: every SM times the CTAs one SM holds (``ctas_sm``, from the
    driver's occupancy calculator where it answers: `ctas_per_sm`)."""
    return info.sms * max(1, ctas_sm)


# -- GEMM ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmParams:
    """A GEMM tactic's parameters: columns per CTA, k per stage, warp layout, stages, k splits (0: auto)
    and the L2 hint for W: 0 and 1 (the default) none, 2 a 256-byte L2 prefetch. (There is no
    evict_first policy for W: ptxas miscompiles the GEMM's cp.async with one for some shapes,
    see kernels/common.cuh; 1 stays the default so that stored tactics keep matching.)"""

    bn: int
    bk: int
    wn: int
    wk: int
    stages: int
    splits: int = 0
    l2: int = 1

    def to_tactic(self) -> Tactic:
        params = {"bn": self.bn, "bk": self.bk, "wn": self.wn, "wk": self.wk, "stages": self.stages,
                  "splits": self.splits}  # fmt: skip
        if self.l2 != 1:  # the default hint stays implicit
            params["l2"] = self.l2
        return Tactic(backend=NAME, kernel="gemm", params=params)

    @classmethod
    def from_tactic(cls, tactic: Tactic) -> GemmParams:
        get = functools.partial(_int_param, tactic)
        return cls(get("bn"), get("bk"), get("wn"), get("wk"), get("stages"), get("splits", 0), get("l2", 1))

    def reasons(self, m: int, info: DeviceInfo) -> list[str]:
        out = []
        if self.l2 not in L2_HINTS:
            out.append(f"l2 must be 0 or 1 (no hint) or 2 (256B prefetch) (got {self.l2})")
        if self.bk not in (64, 128):
            out.append(f"bk must be 64 or 128 (got {self.bk})")
        if self.wn < 1 or self.wk < 1 or self.wn * self.wk not in (1, 2, 4, 8):
            out.append(f"wn * wk must be 1, 2, 4 or 8 warps (got {self.wn} x {self.wk})")
        elif self.bn % (16 * self.wn) or self.bn > 256:
            out.append(f"bn must be a multiple of 16 * wn up to 256 (got bn {self.bn}, wn {self.wn})")
        elif self.bk in (64, 128) and (self.bk // 16) % self.wk:
            out.append(f"bk / 16 = {self.bk // 16} k-steps must divide among wk = {self.wk} warps")
        if not 2 <= self.stages <= 8:
            out.append(f"stages must be in 2..8 (got {self.stages})")
        if not 0 <= self.splits <= 64:
            out.append(f"splits must be 0 (auto) or 1..64 (got {self.splits})")
        if not out:
            mt = m_tiles(m)
            smem = gemm_smem_bytes(mt, self.bn, self.bk, self.stages)
            reduction = self.wk * mt * 16 * self.bn * 4  # the k warps' partial tiles meet in the stage area
            stage_area = smem - FLAG_BYTES
            if reduction > stage_area:
                out.append(f"the {self.wk} k-warps' partial sums ({reduction} bytes) must fit in the "
                           f"{self.stages} stages' {stage_area} bytes: use more stages or fewer k-warps")  # fmt: skip
            elif smem > info.smem_per_block:
                out.append(f"needs {smem} bytes of shared memory; this GPU allows {info.smem_per_block} per CTA")
        return out


@dataclass(frozen=True)
class GemmWgmmaParams:
    """A tactic of the Hopper skinny GEMM (kernels/gemm_sm90.cu, ``kernel="gemm_wgmma"``): ``bw``
    columns of W per CTA (the wgmma's N: 64, 128 or 256), ``bk`` of k per stage (64 or 128),
    ``stages`` of the cp.async ring and the k ``splits`` (0: chosen per shape,
    `gemm_wgmma_splits`; else 1, 2, 4 or 8: the CTAs of a thread block cluster, which add their
    partial sums up in distributed shared memory). One warpgroup per CTA; the m rows are padded to
    the wgmma's 64. ``tma``: 0 (default) loads W and a with ``cp.async``; 1 loads W and 2 both
    through the tensor memory accelerator (tensor maps the plan encodes and keeps per tensor)."""

    bw: int
    bk: int
    stages: int
    splits: int = 0
    tma: int = 0

    THREADS: ClassVar[int] = 128

    def to_tactic(self) -> Tactic:
        params = {"bw": self.bw, "bk": self.bk, "stages": self.stages, "splits": self.splits}
        if self.tma:  # 0 stays implicit: tactics stored before it existed still match
            params["tma"] = self.tma
        return Tactic(backend=NAME, kernel="gemm_wgmma", params=params)

    @classmethod
    def from_tactic(cls, tactic: Tactic) -> GemmWgmmaParams:
        get = functools.partial(_int_param, tactic)
        return cls(get("bw"), get("bk"), get("stages"), get("splits", 0), get("tma", 0))

    @property
    def smem_bytes(self) -> int:
        """The ring: an a tile of 64 rows and a W tile of ``bw`` rows per stage (with ``tma``, an
        mbarrier per stage after it)."""
        return self.stages * (64 + self.bw) * self.bk * 2 + (8 * self.stages if self.tma else 0)

    def reasons(self, m: int, info: DeviceInfo) -> list[str]:
        out = []
        if info.arch not in WGMMA_ARCHS:
            out.append(f"kernel 'gemm_wgmma' needs a Hopper GPU (sm_90); this one is {info.arch} (use kernel 'gemm')")
        if m > GEMM_MAX_M:
            out.append(f"kernel 'gemm_wgmma' takes m <= {GEMM_MAX_M} (got m={m})")
        if self.bw not in (64, 128, 256):
            out.append(f"bw must be 64, 128 or 256 (got {self.bw})")
        if self.bk not in (64, 128):
            out.append(f"bk must be 64 or 128 (got {self.bk})")
        if not 2 <= self.stages <= 8:
            out.append(f"stages must be in 2..8 (got {self.stages})")
        if self.splits not in (0, *GEMM_WGMMA_SPLITS):
            out.append(f"splits must be 0 (auto) or 1, 2, 4 or 8 (the CTAs of a cluster; got {self.splits})")
        if self.tma not in GEMM_TMA:
            out.append(f"tma must be 0 (cp.async), 1 (W through tensor maps) or 2 (W and a; got {self.tma})")
        if not out and self.smem_bytes > info.smem_per_block:
            out.append(f"needs {self.smem_bytes} bytes of shared memory; this GPU allows {info.smem_per_block} per CTA")
        return out


GEMM_TMA: Final = (0, 1, 2)
"""How the Hopper GEMM loads its operands: 0 cp.async, 1 W through the tensor memory accelerator
(TMA), 2 W and a through it."""
GEMM_WGMMA_SPLITS: Final = (1, 2, 4, 8)
"""k splits of the Hopper GEMM: the CTAs of one thread block cluster (8 is the portable maximum)."""


def gemm_wgmma_splits(m: int, n: int, k: int, params: GemmWgmmaParams, info: DeviceInfo) -> int:
    """The Hopper GEMM's k splits: the requested count, else `gemm_splits`' count for one wave
    of CTAs (shared memory decides how many an SM holds) rounded down to a power of two, at most 8.
    The grid has exactly this many CTAs along y (a cluster); where k is too short for all of
    them, the last ones get no k and add zeros."""
    if params.splits:
        return params.splits
    ctas = ctas_per_sm(info, params.smem_bytes, params.THREADS)
    want = gemm_splits(m, n, k, params.bw, params.bk, info, ctas)
    return max(s for s in GEMM_WGMMA_SPLITS if s <= want)


def gemm_wgmma_k_per_split(k: int, bk: int, splits: int) -> int:
    """k per CTA of the Hopper GEMM's cluster of ``splits`` (rounded up to ``bk``; unlike
    `gemm_k_per_split`, no split is dropped: the cluster keeps its size, and trailing CTAs may get
    no k)."""
    return -(-k // splits // bk) * bk if splits > 1 else k


def gemm_wgmma_candidates(m: int, info: DeviceInfo) -> list[GemmWgmmaParams]:
    """The Hopper kernel's tactic space (empty elsewhere), the default first: 64-column W tiles
    with 64 of k per stage at 3, 4 and 6 stages, then 128-column tiles and 128 of k per stage, each
    with the split count chosen per shape or forced. (256-column tiles, and 128 x 128, were never
    within 30 % of the best at m = 1, 16 or 64 on the H200: h200-gemm-wgmma-sweep-all-shapes.log.)"""
    if info.arch not in WGMMA_ARCHS or m > GEMM_MAX_M:
        return []
    out = [GemmWgmmaParams(*GEMM_WGMMA_DEFAULT)]
    out += [GemmWgmmaParams(64, 64, s, sp) for s in (4, 3, 6) for sp in (0, 2, 4, 8)]
    out += [GemmWgmmaParams(128, 64, s, sp) for s in (3, 4) for sp in (0, 4, 8)]
    out += [GemmWgmmaParams(64, 128, s, sp) for s in (3, 4) for sp in (0, 2)]
    # operands through tensor maps (h200-gemm-tma-sweep.log, h200-gemm-tma2-m64-sweep.log): W alone
    # (tma 1) matches cp.async at m = 1 and 16; W and a (tma 2) lead at m = 64 with one CTA per SM
    # (128 of k per stage, 4-5 stages, 2 splits: 18.1 us against 19.4 for the default)
    out += [GemmWgmmaParams(64, bk, 4, 0, 1) for bk in (64, 128)]
    out += [GemmWgmmaParams(64, 64, 4, 0, 2), GemmWgmmaParams(64, 128, 4, 0, 2), GemmWgmmaParams(64, 128, 5, 2, 2),
            GemmWgmmaParams(64, 64, 8, 2, 2)]  # fmt: skip
    return [p for p in dict.fromkeys(out) if not p.reasons(m, info)]


def m_tiles(m: int) -> int:
    """16-row MMA tiles for ``m`` rows (1, 2 or 4)."""
    tiles = -(-m // 16)
    return 4 if tiles > 2 else tiles


def gemm_smem_bytes(mt: int, bn: int, bk: int, stages: int) -> int:
    return stages * (mt * 16 + bn) * bk * 2 + FLAG_BYTES


GEMM_WGMMA_DEFAULT: Final = (64, 64, 4)
"""The Hopper GEMM's default (bw, bk, stages): 64 columns x 64 of k per stage, 4 stages (64 KB: 3
CTAs per SM), splits chosen per shape. On the H200 (n = k = 4096, the suite's method,
benchmarks/results/h200-gemm-wgmma-sweep.log) it took 17.3 / 17.9 / 19.4 us at m = 1 / 16 / 64,
against 17.8 / 18.6 / 25.2 for the mma.sync kernel's best tactic and 18.8 / 19.3 / 17.9 for
cuBLAS; 256-column W tiles and 128 x 128 tiles were never within 30 % of the best
(h200-gemm-wgmma-sweep-all-shapes.log)."""


def default_gemm_params(m: int, info: DeviceInfo) -> GemmParams | GemmWgmmaParams:
    """The heuristic tactic: on Hopper the wgmma kernel (`GEMM_WGMMA_DEFAULT`), elsewhere the
    mma.sync kernel's (`default_sync_gemm_params`)."""
    if info.arch in WGMMA_ARCHS:
        params = GemmWgmmaParams(*GEMM_WGMMA_DEFAULT)
        if not params.reasons(m, info):
            return params
    return default_sync_gemm_params(m, info)


def default_sync_gemm_params(m: int, info: DeviceInfo) -> GemmParams:
    """The mma.sync kernel's heuristic tactic (the H200 sweep's best shapes): m <= 16: 32 columns
    x 128 of k per stage, 4 stages, one warp per 32 of k (48 KB: 4 CTAs per SM); m > 16: 64 x 64,
    warps 2 x 2, 6 stages (m <= 32: 72 KB, 3 CTAs; m <= 64: 96 KB, 2 CTAs). Splits are chosen per
    shape."""
    if m <= 16:
        params = GemmParams(bn=32, bk=128, wn=1, wk=4, stages=4)
    else:
        params = GemmParams(bn=64, bk=64, wn=2, wk=2, stages=6)
    stages = params.stages
    while stages > 2 and gemm_smem_bytes(m_tiles(m), params.bn, params.bk, stages) > info.smem_per_block:
        stages -= 1
    return GemmParams(params.bn, params.bk, params.wn, params.wk, stages)


def gemm_candidates(m: int, info: DeviceInfo) -> list[GemmParams]:
    shapes = [(32, 128, 1, 4), (64, 64, 2, 2), (64, 128, 2, 2), (128, 64, 4, 1), (128, 64, 4, 2)]
    out = [GemmParams(bn, bk, wn, wk, s, sp) for bn, bk, wn, wk in shapes for s in (4, 6) for sp in (0, 1, 2, 4, 8)]
    base = default_sync_gemm_params(m, info)
    out.append(GemmParams(base.bn, base.bk, base.wn, base.wk, base.stages, 0, 2))  # l2 0 is the same kernel as 1
    return [p for p in out if not p.reasons(m, info)]


def gemm_splits(m: int, n: int, k: int, bn: int, bk: int, info: DeviceInfo, ctas_sm: int, requested: int = 0) -> int:
    """How many ways to split k: as many CTAs as fit in one wave (more would leave a short second
    wave: on the H200, 5 splits x 128 column blocks at 4 CTAs per SM took 21.3 us, 4 splits
    17.9 us), but each split keeps at least 4 stages of k, and the fp32 partial sums (splits x m
    x n x 4 bytes, written and read back through L2) stay under a quarter of the weight bytes
    (n x k x 2). An explicit count wins.

    Pass the result to `gemm_k_per_split`, which rounds the k per split to ``bk``.
    """
    k_steps = -(-k // bk)
    if requested:
        return max(1, min(requested, k_steps))
    blocks = -(-n // bn)
    want = max(1, info.sms * ctas_sm // blocks)
    traffic_cap = max(1, k // (8 * m))
    return max(1, min(want, k_steps // 4 or 1, traffic_cap, 16))


def gemm_k_per_split(k: int, bk: int, splits: int) -> tuple[int, int]:
    """``(k per split, actual splits)``: k per split rounded up to ``bk``, empty splits dropped."""
    kps = -(-k // splits)
    kps = -(-kps // bk) * bk
    return kps, -(-k // kps)


def gemm_grid(n: int, bn: int, splits: int, batch: int) -> tuple[int, int, int]:
    return (-(-n // bn), splits, batch)


def log2_exact(n: int) -> int | None:
    """log2 of a power of two, else None."""
    if n < 1 or n & (n - 1):
        return None
    return int(math.log2(n))
