"""Paged prefill (kernels/prefill.cu: mma.sync, any GPU from sm_80; kernels/prefill_sm90.cu: Hopper wgmma):
its tactic parameters (`PrefillParams`), the work list and grids, the kernel variants, the reasons a
tactic cannot run, the tactic space and the default, and the plan (`CudaNativePrefillPlan`).

Tactics: ``Tactic(backend="cuda_native", kernel="prefill", params={"q_tile": 128, "kv_tile": 32, "warps": 4,
"stages": 3, "pack": 0, "sched": 0})`` (``pack`` 0: the query heads of a GQA group per CTA chosen by
`prefill_pack`; ``sched`` 0: requests by work, each one's items longest first, 1: request order,
2: longest first over the batch; see `prefill_work`; 3, with persistent CTAs: longest first, the
turns after the first round handed out by a counter); with ``"mma": "wgmma"`` the Hopper kernel
(``q_tile`` 64 or 128 rows, ``warps`` = q_tile / 16 consumer warps, ``kv_tile`` 64 or 128), the
default on sm_90 for head dims 64, 128 and 256; ``mma`` left out (or "sync") is the mma.sync kernel;
wgmma also takes ``"persist": 1``: persistent CTAs (as many as the GPU holds at once, each looping
over the work items; left out, 0, one CTA per item) and, with q_tile 128, ``"pingpong": 1``: the
two consumer warpgroups take turns at the tensor cores (FlashAttention-3's schedule).

The geometry functions are pure (no CUDA), so every rule is tested on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import torch

from tactix import (
    PagedBatch,
    PlanOptions,
    PrefillProblem,
    Problem,
    Tactic,
    UnsupportedProblemError,
)
from tactix.plugin import Piece, Sections, bucket_size, raw_stream, sections
from tactix_cuda_native import NAME
from tactix_cuda_native.device import WGMMA_ARCHS, DeviceInfo, cuda_device, device_index, device_info, wgmma_arch
from tactix_cuda_native.kernel import Kernel, TensorMaps, bf16, launcher, load_kernel
from tactix_cuda_native.paged import (
    FP8_KV_DTYPES,
    HEAD_DIMS,
    LOG2E,
    UNIT_SCALES,
    StagedPlan,
    attention_reasons,
    cache_strides,
    fp8_cvt,
    fp8_qk16,
    log2_exact,
    scale_args,
)
from tactix_cuda_native.runtime import Variant, launch_config, stream_for, tensor_map, tensor_maps_status
from tactix_cuda_native.tactics import TacticParams

PREFILL_SCHEDULES: Final = ("requests_by_work", "in_order", "longest_first", "longest_first_dynamic")
DYN_TURNS_SMEM: Final = 48
"""Shared memory of sched 3's turns (kernels/prefill_sm90.cu, TX_DYN): four mbarriers, two slots, padding."""
PREFILL_MMAS: Final = ("sync", "wgmma")
"""The prefill kernels: "sync" kernels/prefill.cu (mma.sync, any GPU from sm_80), "wgmma"
kernels/prefill_sm90.cu (Hopper warpgroup MMA, compiled for sm_90a)."""
WGMMA_HEAD_DIMS: Final = (64, 128, 256)
"""The wgmma kernel's v/o head dims (a wgmma N of P V), and its q/k ones where they are equal."""
WGMMA_QK_HEAD_DIMS: Final = (64, 128, 192, 256)
"""The wgmma kernel's q/k head dims with a v/o head dim of `WGMMA_HEAD_DIMS` no larger (DeepSeek's
192/128: three 64-column blocks of Q K^T, a 128-wide P V; TX_DVO)."""
WGMMA_ACCUMULATORS: Final = 176
"""Registers per consumer thread the wgmma kernel's O, S and P take at most (head_dim / 2 +
kv_tile / 2 + kv_tile / 4): d256 with 128-key tiles (224) spills at the 232 a consumer gets."""


# -- tactic parameters -----------------------------------------------------------------------


class PrefillParams(TacticParams):
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

    KERNEL: ClassVar[str] = "prefill"
    # "sync" and the flags' 0 stay implicit: tactics stored before the wgmma kernel and the flags keep matching
    IMPLICIT: ClassVar[tuple[str, ...]] = ("mma", "persist", "pingpong")
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"mma": PREFILL_MMAS}

    q_tile: int
    kv_tile: int
    warps: int
    stages: int
    pack: int = 0
    sched: int = 0
    mma: str = "sync"
    persist: int = 0
    pingpong: int = 0

    @property
    def m_tiles(self) -> int:
        """m16 tiles per warp (sync)."""
        return self.q_tile // (16 * self.warps)

    @property
    def threads(self) -> int:
        """Threads per CTA: the computing warps, and for wgmma the producer warpgroup."""
        return 32 * self.warps + (128 if self.mma == "wgmma" else 0)

    @property
    def dynamic(self) -> bool:
        """Persistent CTAs whose turns come from a counter (sched 3: ``TX_DYN``)."""
        return self.sched == 3 and self.persist == 1 and self.mma == "wgmma"

    def smem_bytes(self, head_dim: int, kv_bytes: int = 2, head_dim_vo: int | None = None) -> int:
        smem = prefill_smem_bytes(head_dim, self.q_tile, self.kv_tile, self.stages, self.mma, kv_bytes, head_dim_vo)
        return smem + (DYN_TURNS_SMEM if self.dynamic else 0)

    def reasons(self, head_dim: int, info: DeviceInfo, gqa: int | None = None, kv_bytes: int = 2,
                head_dim_vo: int | None = None) -> list[str]:  # fmt: skip
        """Why these parameters cannot run at ``head_dim`` on a GPU like ``info`` (empty: they can);
        ``gqa``: the problem's GQA group size where known, ``kv_bytes``: 1 for an fp8 cache;
        ``head_dim_vo``: v's and out's head dim where it differs (the wgmma kernel: TX_DVO)."""
        if self.mma not in PREFILL_MMAS:
            return [f"mma must be 'sync' or 'wgmma' (got {self.mma!r})"]
        vo = head_dim if head_dim_vo is None else head_dim_vo
        out = self._wgmma_reasons(head_dim, vo, info) if self.mma == "wgmma" else self._sync_reasons()
        if self.pack < 0:
            out.append(f"pack must be 0 (auto) or a divisor of the GQA group size (got {self.pack})")
        elif self.pack and gqa is not None and (gqa % self.pack or self.pack > self.q_tile):
            out.append(f"pack {self.pack} must divide the GQA group size {gqa} and be at most q_tile {self.q_tile}")
        if self.sched not in (0, 1, 2, 3):
            out.append(f"sched must be 0, 1, 2 or 3 ({', '.join(PREFILL_SCHEDULES)}) (got {self.sched})")
        elif self.sched == 3 and (self.persist != 1 or self.mma != "wgmma" or kv_bytes != 2):
            out.append("sched 3 (turns from a counter) needs persist 1 with mma 'wgmma' over a 16-bit cache")
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
                regs = vo // 2 + self.kv_tile // 2 + self.kv_tile // 4
                if regs > WGMMA_ACCUMULATORS:
                    out.append(
                        f"O, S and P need {regs} registers per consumer thread (kv_tile {self.kv_tile}, head dim "
                        f"{vo}); at most {WGMMA_ACCUMULATORS} fit with mma 'wgmma'"
                    )
            smem = self.smem_bytes(head_dim, kv_bytes, vo)
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

    def _wgmma_reasons(self, head_dim: int, head_dim_vo: int, info: DeviceInfo) -> list[str]:
        out = []
        if info.arch not in WGMMA_ARCHS:
            out.append(f"mma 'wgmma' needs a Hopper GPU (sm_90); this one is {info.arch} (use mma 'sync')")
        if head_dim == head_dim_vo and head_dim not in WGMMA_HEAD_DIMS:
            out.append(f"mma 'wgmma' supports head dims {WGMMA_HEAD_DIMS} (got {head_dim}; use mma 'sync')")
        elif not wgmma_head_dims(head_dim, head_dim_vo):
            out.append(WGMMA_DIMS_NEED_SYNC.format(qk=head_dim, vo=head_dim_vo))
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


def prefill_smem_bytes(head_dim: int, q_tile: int, kv_tile: int, stages: int, mma: str = "sync",
                       kv_bytes: int = 2, head_dim_vo: int | None = None) -> int:  # fmt: skip
    """Dynamic shared memory of the prefill kernel (see the layouts in kernels/prefill.cu and
    kernels/prefill_sm90.cu: for wgmma, Q + stages x (K, V) tiles + a K and a V row pointer per
    key of a tile + four mbarriers per stage). ``kv_bytes`` 1 (an fp8 cache): for mma.sync the ring
    holds fp8 rows and one converted 16-bit (K, V) pair follows it; for wgmma the ring holds the
    converted 16-bit tiles and one staged fp8 (K, V) pair follows it. ``head_dim_vo``: V's head dim
    where it differs (wgmma only: the mma.sync kernel runs both at ``head_dim``)."""
    row = head_dim * 2
    if mma == "wgmma":
        staged = fp8_staged_pairs(head_dim, q_tile, kv_tile, stages) * 2 * kv_tile * head_dim if kv_bytes == 1 else 0
        v_row = 2 * (head_dim if head_dim_vo is None else head_dim_vo)
        return q_tile * row + stages * kv_tile * (row + v_row) + staged + kv_tile * 16 + 4 * stages * 8
    ring = stages * 2 * kv_tile * head_dim * kv_bytes + (2 * kv_tile * row if kv_bytes == 1 else 0)
    return q_tile * row + ring + stages * 2 * kv_tile * 8 + q_tile * 8 + 32


def fp8_staged_pairs(head_dim: int, q_tile: int, kv_tile: int, stages: int) -> int:
    """Staged fp8 (K, V) pairs of the wgmma kernel over an fp8 cache (kernels/prefill_sm90.cu,
    TX_STAGED): two where they fit beside Q and the 16-bit ring in a Hopper CTA's shared memory
    (`HOPPER_SMEM_PER_BLOCK`), else one. (With one, the copy of the next tile waits for the
    conversion of the last: P1 on the H200 ran at 0.73x the 16-bit cache's rate.)"""
    fixed = prefill_smem_bytes(head_dim, q_tile, kv_tile, stages, "wgmma")  # (a 16-bit cache's layout)
    return 2 if fixed + 2 * 2 * kv_tile * head_dim <= HOPPER_SMEM_PER_BLOCK else 1


HOPPER_SMEM_PER_BLOCK: Final = 232448
"""The dynamic shared memory an sm_90 CTA may opt into (227 KB): what the wgmma kernel's layout is sized against."""


# -- defaults and candidates -----------------------------------------------------------------


def _shape(shape: tuple[int, int, int, int], **rest: Any) -> PrefillParams:
    """The parameters of a ``(q_tile, kv_tile, warps, stages)`` shape and ``rest``."""
    q_tile, kv_tile, warps, stages = shape
    return PrefillParams(q_tile=q_tile, kv_tile=kv_tile, warps=warps, stages=stages, **rest)


_PREFILL_DEFAULTS: Final = {64: (128, 64, 4, 3), 128: (128, 32, 4, 3), 256: (64, 32, 4, 2)}
"""q_tile, kv_tile, warps, stages per head dim: two or more CTAs of 4 warps per H200 SM, no spills."""


_WGMMA_DEFAULTS: Final = {64: (128, 128, 8, 3), 128: (128, 128, 8, 3), 192: (128, 128, 8, 2), 256: (128, 64, 8, 2)}
"""wgmma (sm_90): two consumer warpgroups of 64 rows (FlashAttention-3's 128 x 128 tile for d128),
one CTA per SM (the 384 threads take every register). The candidates with one consumer
warpgroup (q_tile 64) launch with 128 registers a thread up to d128, so two CTAs share an SM
where their shared memory fits (d128: kv_tile 64, 2 stages)."""


_WGMMA_PINGPONG: Final = frozenset({64, 128, 192})
"""Head dims whose wgmma default runs the warpgroups' ping-pong: on the H200 it was faster than
without on all of P1-P4 at d64 and d128 (3 stages; d128 P2 567 against 547 TFLOP/s, d64 P2 380
against 351: benchmarks/results/h200-prefill-sweep.json, h200-prefill-sweep-d64.json), slower
at d256 (kv_tile 64: P2 510 against 531, h200-prefill-sweep-d256.json). 192 (q/k; v/o 128): the
registers of d128, so d128's choice."""


PERSIST_MAX_MEAN_KEYS: Final = 2048
"""The default goes persistent (`prefill_default_persist`) when the batch's work items walk at
most this many keys on average: there the per-item prologue and epilogue weigh most, and
persistent CTAs hide them (H200, d128, 128-key tiles: P1, 8.5 tiles an item, 471 against 442
TFLOP/s; P3 366 against 347). With long items the static split of persistent CTAs balances
worse than the hardware's dispatch of one CTA per item (P2, 32.5 tiles: 547 against 567)."""


@functools.lru_cache(maxsize=256)  # plans ask per batch; the parameters are immutable
def default_prefill_params(head_dim: int, info: DeviceInfo, mma: str | None = None, kv_bytes: int = 2,
                           head_dim_vo: int | None = None) -> PrefillParams:  # fmt: skip
    """The heuristic tactic: on Hopper the wgmma kernel (`_WGMMA_DEFAULTS`; with an fp8 cache,
    ``kv_bytes`` 1, the ring one stage shallower where the staged fp8 pair does not fit beside
    it); elsewhere, or with ``mma="sync"``, the mma.sync kernel with 4 warps, 32 rows per warp
    where the accumulators fit (d64, d128), the deepest ring that still leaves two CTAs per SM;
    smaller tiles where shared memory is short. ``head_dim_vo``: v/o's head dim where it differs
    (wgmma only; the mma.sync default is asked for at the kernel dim, `kernel_head_dim`)."""
    shape = _WGMMA_DEFAULTS.get(head_dim)
    if shape is not None and (mma == "wgmma" or (mma is None and info.arch in WGMMA_ARCHS)):
        params = _shape(shape, mma="wgmma", pingpong=int(head_dim in _WGMMA_PINGPONG))
        while params.stages > 2 and params.smem_bytes(head_dim, kv_bytes, head_dim_vo) > info.smem_per_block:
            params = params.replace(stages=params.stages - 1)
        if mma == "wgmma" or not params.reasons(head_dim, info, kv_bytes=kv_bytes, head_dim_vo=head_dim_vo):
            return params
    q_tile, kv_tile, warps, stages = _PREFILL_DEFAULTS.get(head_dim, (64, 32, 4, 2))
    while stages > 2 and prefill_smem_bytes(head_dim, q_tile, kv_tile, stages) > info.smem_per_block:
        stages -= 1
    while kv_tile > 32 and prefill_smem_bytes(head_dim, q_tile, kv_tile, stages) > info.smem_per_block:
        kv_tile //= 2
    while q_tile > 16 * warps and prefill_smem_bytes(head_dim, q_tile, kv_tile, stages) > info.smem_per_block:
        q_tile //= 2
    return PrefillParams(q_tile=q_tile, kv_tile=kv_tile, warps=warps, stages=stages)


def default_masked_prefill_params(head_dim: int, info: DeviceInfo) -> PrefillParams:
    """The default with a custom mask: the mma.sync default with one m16 tile of rows per warp. (With
    two, the mask's row pointers push the d64 and d128 variants past 255 registers: ptxas spills
    48 and 28 words; with one they take 174 and 204, d256 255 without spills.)"""
    params = default_prefill_params(head_dim, info, "sync")
    return params.replace(q_tile=16 * params.warps)


_PREFILL_SHAPES: Final = {
    64: [(128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4)],
    128: [(128, 32, 4, 3), (128, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2)],
}


_WGMMA_SHAPES: Final = {
    64: [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 128, 4, 3)],
    128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 2)],
    192: [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 128, 4, 2), (64, 64, 4, 2)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3)],
}


def prefill_candidates(head_dim: int, info: DeviceInfo, gqa: int = 1, kv_bytes: int = 2,
                       head_dim_vo: int | None = None) -> list[PrefillParams]:  # fmt: skip
    """The tactic space the tuner explores: mma.sync tile shapes, wgmma tile shapes (on Hopper),
    then the default's with one head per CTA and with work in request order, then (on Hopper)
    the wgmma shapes with persistent CTAs and with the warpgroups' ping-pong (every entry valid
    for ``head_dim`` on ``info`` with a cache of ``kv_bytes`` per element and v/o head dim
    ``head_dim_vo``, where given)."""
    out = [_shape(shape) for shape in _PREFILL_SHAPES.get(head_dim, [])]
    out += [_shape(shape, mma="wgmma") for shape in _WGMMA_SHAPES.get(head_dim, [])]
    base = default_prefill_params(head_dim, info, kv_bytes=kv_bytes, head_dim_vo=head_dim_vo)
    shape = (base.q_tile, base.kv_tile, base.warps, base.stages)
    if gqa > 1:
        out.append(_shape(shape, pack=1, mma=base.mma))
    out += [_shape(shape, sched=sched, mma=base.mma) for sched in (1, 2)]
    # persistent CTAs (wgmma): every wgmma shape, and the default's with longest-first order; the
    # warpgroups' ping-pong: every shape with two, with and without persistent CTAs
    wgmma_shapes = _WGMMA_SHAPES.get(head_dim, [])
    out += [_shape(shape, mma="wgmma", persist=1) for shape in wgmma_shapes]
    if base.mma == "wgmma":
        out += [_shape(shape, sched=sched, mma="wgmma", persist=1) for sched in (2, 3)]
    out += [_shape(shape, mma="wgmma", persist=persist, pingpong=1) for shape in wgmma_shapes
            for persist in (0, 1) if shape[0] == 128]  # fmt: skip
    if base.pingpong:  # the default's persistent form with the whole batch longest first (rounds back and
        # forth, or turns from a counter)
        out += [_shape(shape, sched=sched, mma="wgmma", persist=1, pingpong=1) for sched in (2, 3)]
    unique = list(dict.fromkeys(out))
    return [p for p in unique if not p.reasons(head_dim, info, gqa, kv_bytes, head_dim_vo)]


def prefill_default_persist(params: PrefillParams, tiles: list[int], head_dim: int, info: DeviceInfo,
                            head_dim_vo: int | None = None) -> PrefillParams:  # fmt: skip
    """The default tactic for one batch: ``params`` (`default_prefill_params`) with persistent
    CTAs where it runs the ping-pong, its work items (``tiles``: the KV tiles each walks,
    `PrefillWork`) are short on average (`PERSIST_MAX_MEAN_KEYS`) and the kernel takes them, else
    ``params`` unchanged. (Without the ping-pong, at d256, persistent CTAs were slower on every
    case: h200-prefill-sweep-d256.json.) Not with a v/o head dim of its own (``head_dim_vo``,
    DeepSeek's 192/128): there the persistent CTAs' static split of causal items was slower than
    one CTA per item on R1 (4 x 1024, 8 tiles an item; one H100, one process: 85.7 against 67.2
    us with K and V through tensor maps, 108.3 against 77.9 gathered;
    benchmarks/results/h100-ragged-tma-probe-session37.json)."""
    if params.mma != "wgmma" or not params.pingpong or params.persist or not tiles:
        return params
    if head_dim_vo is not None and head_dim_vo != head_dim:
        return params
    if sum(tiles) * params.kv_tile > PERSIST_MAX_MEAN_KEYS * len(tiles):
        return params
    return _persistent(params, head_dim, info, head_dim_vo)


@functools.lru_cache(maxsize=256)
def _persistent(params: PrefillParams, head_dim: int, info: DeviceInfo, head_dim_vo: int | None) -> PrefillParams:
    """``params`` with persistent CTAs where the kernel takes them, else ``params``."""
    persistent = params.replace(persist=1)
    return params if persistent.reasons(head_dim, info, head_dim_vo=head_dim_vo) else persistent


# -- work list and grid ----------------------------------------------------------------------


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
    in L2. sched 1: request order, items in token order. sched 2 (and 3, whose persistent CTAs
    take turns from a counter): longest first over the whole batch (the tightest end, but equal
    items of every request run together: with many long requests their K/V do not all fit in L2).
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


# -- support rules ---------------------------------------------------------------------------


def prefill_reasons(problem: PrefillProblem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    """Why ``tactic`` cannot serve ``problem`` on a GPU like ``info`` (empty: it can)."""
    out = attention_reasons(problem, fp8_kv=True)
    if tactic.is_default:
        if tactic.params:
            out.append(f"the default tactic takes no params (got {tactic.params})")
        return out
    if tactic.kernel != PrefillParams.KERNEL:
        return [*out, f"unknown prefill kernel '{tactic.kernel}' (known: default, prefill)"]
    params = PrefillParams.read(tactic)
    if isinstance(params, str):
        return [*out, params]
    if problem.custom_mask and params.mma == "wgmma":
        out.append(MASK_NEEDS_SYNC)
    qk, vo = problem.head_dim_qk, problem.head_dim_vo
    if max(qk, vo) > kernel_head_dim(problem) or qk % 16 or vo % 16:
        out.append(f"head dims {qk}/{vo}: multiples of 16 up to {max(HEAD_DIMS)}")
    if params.mma == "wgmma" and qk != vo and problem.kv_dtype in FP8_KV_DTYPES:
        out.append(f"with an fp8 cache mma 'wgmma' needs equal head dims (here {qk}/{vo}; use mma 'sync')")
    d, _ = kernel_dims(problem, params)  # (the wgmma rules check the dims: PrefillParams._wgmma_reasons)
    return out + params.reasons(d, info, problem.gqa_ratio, kv_bytes(problem), vo if params.mma == "wgmma" else None)


MASK_NEEDS_SYNC: Final = (
    "custom masks are read by the mma.sync kernel only (tactic mma 'sync'); the wgmma kernel takes none"
)


def kv_bytes(problem: PrefillProblem) -> int:
    """Bytes of one cache element: 1 for an fp8 cache, else 2."""
    return 1 if problem.kv_dtype in FP8_KV_DTYPES else 2


def sync_only(problem: PrefillProblem) -> bool:
    """Whether only the mma.sync kernel serves ``problem``: a custom mask, or head dims the wgmma
    kernel does not take (`wgmma_head_dims`; an fp8 cache with different ones), which the mma.sync
    kernel runs zero-filled (`kernel_head_dim`)."""
    qk, vo = problem.head_dim_qk, problem.head_dim_vo
    fp8_unequal = qk != vo and problem.kv_dtype in FP8_KV_DTYPES
    return problem.custom_mask or fp8_unequal or not wgmma_head_dims(qk, vo)


def wgmma_head_dims(head_dim_qk: int, head_dim_vo: int) -> bool:
    """Whether the wgmma kernel takes these q/k and v/o head dims as they are (no zero-fill): equal
    ones of `WGMMA_HEAD_DIMS`, or q/k of `WGMMA_QK_HEAD_DIMS` with a v/o of `WGMMA_HEAD_DIMS` no
    larger (its epilogue stages O through Q's rows)."""
    if head_dim_qk == head_dim_vo:
        return head_dim_qk in WGMMA_HEAD_DIMS
    return head_dim_qk in WGMMA_QK_HEAD_DIMS and head_dim_vo in WGMMA_HEAD_DIMS and head_dim_vo < head_dim_qk


def kernel_dims(problem: PrefillProblem, params: PrefillParams) -> tuple[int, tuple[int, int] | None]:
    """The head dim the kernel of ``params`` is compiled for and the problem's (q/k, v/o) dims
    where they differ from it: the wgmma kernel runs q/k's own dim (v/o's as TX_DVO), the mma.sync
    kernel `kernel_head_dim` (both zero-filled to it: TX_DQK, TX_DVO)."""
    qk, vo = problem.head_dim_qk, problem.head_dim_vo
    if params.mma == "wgmma":
        return qk, None if qk == vo else (qk, vo)
    d = kernel_head_dim(problem)
    return d, (qk, vo) if padded(problem) else None


def kernel_head_dim(problem: PrefillProblem) -> int:
    """The head dim D the kernel runs ``problem`` with: its own where the q/k and v/o head dims are
    equal and a kernel dim (`HEAD_DIMS`), else the smallest kernel dim holding both (DeepSeek's
    192/128: 256), the rows zero-filled past their own dims (kernels/prefill.cu: TX_DQK, TX_DVO;
    the mma.sync kernel only)."""
    qk, vo = problem.head_dim_qk, problem.head_dim_vo
    if qk == vo and qk in HEAD_DIMS:
        return qk
    return min((d for d in HEAD_DIMS if d >= max(qk, vo)), default=max(HEAD_DIMS))


def padded(problem: PrefillProblem) -> bool:
    """Whether the kernel runs ``problem`` zero-filled to a larger head dim (`kernel_head_dim`)."""
    d = kernel_head_dim(problem)
    return problem.head_dim_qk != d or problem.head_dim_vo != d


WGMMA_DIMS_NEED_SYNC: Final = (
    "mma 'wgmma' takes equal head dims of 64, 128 or 256, or a q/k head dim of 128, 192 or 256 with a smaller "
    "v/o one of 64 or 128 (here {qk}/{vo}): the mma.sync kernel (tactic mma 'sync') runs it zero-filled"
)


def default_params_for(problem: PrefillProblem, info: DeviceInfo) -> PrefillParams:
    """The default tactic's parameters for ``problem`` (before `prefill_default_persist` looks at
    the batch): `default_masked_prefill_params` with a custom mask, else `default_prefill_params`
    (on Hopper the wgmma one where it takes the head dims, with an fp8 cache its shared memory;
    else the mma.sync one at `kernel_head_dim`)."""
    d = kernel_head_dim(problem)
    if problem.custom_mask:
        return default_masked_prefill_params(d, info)
    qk, vo = problem.head_dim_qk, problem.head_dim_vo
    if not sync_only(problem) and info.arch in WGMMA_ARCHS:
        params = default_prefill_params(qk, info, "wgmma", kv_bytes(problem), vo)
        if not params.reasons(qk, info, kv_bytes=kv_bytes(problem), head_dim_vo=vo):
            return params
    return default_prefill_params(d, info, "sync")


def prefill_tactics(problem: PrefillProblem, info: DeviceInfo) -> list[Tactic]:
    """The tactics the tuner measures for ``problem``: those whose shared memory holds its cache
    (fp8: `prefill_smem_bytes`); with head dims run zero-filled the mma.sync ones, with a custom
    mask those with one m16 tile a warp (`default_masked_prefill_params`: with two the masked
    variants spill)."""
    d, qk, vo = kernel_head_dim(problem), problem.head_dim_qk, problem.head_dim_vo
    candidates = prefill_candidates(d, info, problem.gqa_ratio, kv_bytes(problem))
    if qk != vo and not sync_only(problem):  # the mma.sync ones at the kernel dim, the wgmma ones at the problem's
        wgmma = prefill_candidates(qk, info, problem.gqa_ratio, kv_bytes(problem), vo)
        candidates = [p for p in candidates if p.mma == "sync"] + [p for p in wgmma if p.mma == "wgmma"]
    if problem.custom_mask:
        masked = [p for p in candidates if p.mma == "sync" and p.m_tiles == 1]
        default = default_masked_prefill_params(d, info)
        candidates = masked if default in masked else [default, *masked]
    elif sync_only(problem):
        candidates = [p for p in candidates if p.mma == "sync"]
    return [p.to_tactic() for p in candidates]


# -- kernel variants -------------------------------------------------------------------------


def prefill_variant(dtype: str, head_dim: int, params: PrefillParams, arch: str, masked: bool = False,
                    kv_dtype: str | None = None, dims: tuple[int, int] | None = None,
                    kv_tma: bool = False) -> Variant:  # fmt: skip
    """``pack`` and ``sched`` are launch-time choices: every value shares one compiled variant.
    ``mma`` "wgmma" is kernels/prefill_sm90.cu, compiled for the arch-specific target (sm_90a) of
    an sm_90 ``arch``; its warps are implied by the tiles (one consumer warpgroup per 64 rows).
    ``dtype``: q's and out's (and the cache's, unless ``kv_dtype`` is an fp8 dtype: ``TX_KV_FP8``);
    ``masked``: the variant that reads a custom mask (``TX_MASK``); ``dims``: the problem's q/k and
    v/o head dims where they are not both ``head_dim`` (zero-filled to it: ``TX_DQK``, ``TX_DVO``).
    Those two mma.sync only. ``kv_tma`` (wgmma, 16-bit caches): ragged K and V tiles through tensor
    maps (``TX_KV_TMA``, `ragged_tma`)."""
    fp8 = FP8_KV_DTYPES.get(kv_dtype or dtype, 0)
    qk, vo = dims if dims is not None else (head_dim, head_dim)
    if params.mma == "wgmma":
        assert not masked and qk == head_dim and wgmma_head_dims(qk, vo), "a custom mask or zero-fill needs 'sync'"
        staged = fp8_staged_pairs(head_dim, params.q_tile, params.kv_tile, params.stages)
        return Variant.make(
            "prefill_sm90.cu",
            wgmma_arch(arch),
            TX_BF16=bf16(dtype),
            TX_D=head_dim,
            TX_QTILE=params.q_tile,
            TX_KVTILE=params.kv_tile,
            TX_STAGES=params.stages,
            **({"TX_DVO": vo} if vo != head_dim else {}),  # (absent for equal dims: the variants keep their keys)
            TX_SMEM=params.smem_bytes(head_dim, 1 if fp8 else 2, vo),  # the kernel asserts its layout's size
            **({"TX_PERSIST": 1} if params.persist else {}),  # absent when 0: default variants keep their keys
            **({"TX_PINGPONG": 1} if params.pingpong else {}),
            **({"TX_SNAKE": 1} if params.persist and params.sched == 2 else {}),  # sorted over the batch
            **({"TX_DYN": 1} if params.dynamic else {}),  # turns from a counter
            **({"TX_KV_FP8": fp8, "TX_FP8_CVT": fp8_cvt()} if fp8 else {}),
            **({"TX_STAGED": 2} if fp8 and staged == 2 else {}),
            **({"TX_QK16": 1} if fp8 and bf16(dtype) and fp8_qk16() else {}),  # Q K^T in float16
            **({"TX_KV_TMA": 1} if kv_tma else {}),  # ragged K/V through tensor maps
        )
    return Variant.make(
        "prefill.cu",
        arch,
        TX_BF16=bf16(dtype),
        TX_D=head_dim,
        TX_QTILE=params.q_tile,
        TX_KVTILE=params.kv_tile,
        TX_WARPS=params.warps,
        TX_STAGES=params.stages,
        **({"TX_MASK": 1} if masked else {}),  # absent without a mask: the variants keep their keys
        **({"TX_KV_FP8": fp8} if fp8 else {}),
        **({"TX_FP8_CVT": fp8_cvt()} if fp8 else {}),
        **({"TX_DQK": qk} if qk != head_dim else {}),  # absent for the kernel's own dims: keys unchanged
        **({"TX_DVO": vo} if vo != head_dim else {}),
    )


# -- plan ------------------------------------------------------------------------------------


RAGGED_TMA_ENV: Final = "TACTIX_CUDA_NATIVE_RAGGED_TMA"


def ragged_tma() -> bool:
    """Whether ragged-KV prefill plans on the wgmma kernel load K and V tiles through tensor maps
    (``TX_KV_TMA``: one thread issues each tile's boxes; keys are rows of the packed tensors, no
    page lookups) rather than the producer warpgroup's cp.async gather of one-token pages. On by
    default; `RAGGED_TMA_ENV` = 0 turns it off, to compare (both give the same output bit for bit:
    the consumers' work and order are the same)."""
    return os.environ.get(RAGGED_TMA_ENV, "1") != "0"


def prefill_sections(item_cap: int, batch_cap: int, page_cap: int | None, masked: bool = False,
                     dynamic: bool = False) -> Sections:  # fmt: skip
    """Where a prefill plan's int32 metadata lies in its staging slot: the work items (request,
    first token), the item count, four ints per request (`prefill_lists`), with a custom mask
    each request's first element in the mask, with sched 3 (``dynamic``) the kernel's two turn
    counters (sent as zeros; each launch leaves them zero) and, unless the kernel reads the
    caller's device indices in place (``page_cap`` None), the page indices."""
    parts = [("items", 2 * item_cap), ("num_items", 1), ("reqs", 4 * batch_cap)]
    if masked:
        parts.append(("mask", batch_cap))
    if dynamic:
        parts.append(("turns", 2))
    if page_cap is not None:
        parts.append(("indices", page_cap))
    return sections(*parts)


def prefill_lists(batch: PagedBatch, work: PrefillWork) -> tuple[list[int], list[int]]:
    """The kernel's int32 metadata as flat lists: per item (request, first token); per request
    (first q row, q length, kv length, first entry in the page indices)."""
    qo, kv = batch.qo_indptr_list, batch.kv_indptr_list
    reqs: list[int] = []
    for r in range(batch.batch_size):
        reqs += (qo[r], qo[r + 1] - qo[r], batch.kv_lens_list[r], kv[r])
    return [x for item in work.items for x in item], reqs


def prefill_scalars(problem: PrefillProblem, pack: int, section: int = 0) -> tuple[int | float, ...]:
    """The kernel's scalar arguments after the pointers (see kernels/prefill.cu); ``section``: head
    groups per section (`prefill_head_section`; 0: one section of every head group)."""
    shift = log2_exact(problem.page_size)
    assert shift is not None  # check() refused other page sizes
    hq = problem.num_qo_heads
    groups = hq // pack
    return (hq, problem.gqa_ratio, pack, groups, section or groups, shift, int(problem.causal), problem.window_left,
            problem.sm_scale * LOG2E, float(problem.logits_soft_cap))  # fmt: skip


HEAD_SECTIONS_ENV: Final = "TACTIX_CUDA_NATIVE_HEAD_SECTIONS"
"""Set to 1: `prefill_head_section` puts the prefill grid's head groups in sections where one
request's keys and values outgrow L2; otherwise one section, heads fastest over every head group,
as before (read at each plan). Opt-in, because timing did not favour it: on one H100 (session 40,
``benchmarks/ragged_tma_probe.py --toggle TACTIX_CUDA_NATIVE_HEAD_SECTIONS``,
results/h100-sections-probe-session40.json) the default tactic took 619 and 625 us on R2 with
sections against 582 and 608 us without, and R3 moved within its noise (496 / 532 against
529 / 528 us). The emulator and the CPU tests hold the sections to the same output bit for bit."""

L2_SHARE: Final = 0.5
"""The share of L2 the keys and values of one head section may take (`prefill_head_section`): the
rest holds the queries, outputs and the other requests' keys in flight."""


def prefill_head_section(head_groups: int, groups_per_kv_head: int, max_kv_len: int, kv_row_bytes: int,
                         l2_bytes: int) -> int:  # fmt: skip
    """Head groups per section of the prefill grid (common.cuh, ``tx_item_head``): every head group
    (one section) where the longest request's keys and values over all KV heads fit in
    `L2_SHARE` of L2, else as many KV heads' worth as fit (at least one). ``kv_row_bytes``: one
    key's K and V row of one KV head. The CTAs in flight then read the keys of few heads, which
    stay in L2 while every query tile of those heads passes over them: on one H100 the ragged
    1 x 8192 DeepSeek case (R2, 16 heads, 84 MB of keys and values) hit L2 on 76.6 % of its reads
    heads fastest, FlashInfer's fa3 91.8 % (ncu, benchmarks/results/h100-ncu-R2-session38.txt).
    Only with `HEAD_SECTIONS_ENV` set to 1 (slower on R2 when timed); otherwise one section."""
    if os.environ.get(HEAD_SECTIONS_ENV) != "1":
        return head_groups
    kv_heads = max(1, head_groups // max(1, groups_per_kv_head))
    per_head = max(1, max_kv_len * kv_row_bytes)
    fit = int(l2_bytes * L2_SHARE) // per_head
    if fit >= kv_heads:
        return head_groups
    return max(1, fit) * max(1, groups_per_kv_head)


def _prefill_kernel(index: int, dtype: str, d: int, params: PrefillParams, info: DeviceInfo, masked: bool,
                    kv_dtype: str, dims: tuple[int, int] | None = None,
                    kv_tma: bool = False) -> tuple[Kernel, bool]:  # fmt: skip
    """The prefill kernel of ``params`` on device ``index``, and whether NVRTC compiled it now."""
    fp8 = kv_dtype in FP8_KV_DTYPES
    key = ("prefill", index, dtype, d, params, info.arch, masked, kv_dtype, fp8 and (fp8_cvt(), fp8_qk16()), dims,
           kv_tma)  # fmt: skip
    return load_kernel(key, lambda: prefill_variant(dtype, d, params, info.arch, masked, kv_dtype, dims, kv_tma),
                       "tactix_prefill",
                       params.smem_bytes(d, 1 if fp8 else 2, dims[1] if dims else None), params.threads, params, index,
                       info)  # fmt: skip


MASK_ELEMENTS_MAX: Final = 2**31 - 1
"""The most mask elements (sum of q_len x kv_len over the batch) the kernel's int32 offsets address."""


def prefill_mask(batch: PagedBatch, device: torch.device, previous: object, graph: bool) -> torch.Tensor:
    """The batch's custom mask as the kernel reads it: one byte per element on ``device``, the
    requests' flat matrices one after another (bit-packed masks unpacked). In CUDA-graph mode the
    buffer of the first plan (its size rounded up to a power of two) is refilled in place, so the
    captured kernel reads the new mask."""
    assert batch.custom_mask is not None
    flat = batch.custom_mask.unpacked(device)
    if flat.numel() > MASK_ELEMENTS_MAX:
        raise ValueError(f"the custom mask has {flat.numel()} elements; the kernel addresses at most "
                         f"{MASK_ELEMENTS_MAX}")  # fmt: skip
    if not graph:
        given = batch.custom_mask.flat
        if given is not None and flat.data_ptr() == given.data_ptr():
            flat = flat.clone()  # the caller's own tensor: the plan keeps the mask it was planned with
        return flat.contiguous()
    old = previous._mask if isinstance(previous, CudaNativePrefillPlan) else None
    if old is None:
        old = torch.zeros(bucket_size(max(flat.numel(), 1)), dtype=torch.bool, device=device)
    elif old.numel() < flat.numel():
        raise ValueError(
            f"in CUDA-graph mode a re-plan's custom mask must fit the captured buffer ({old.numel()} elements; "
            f"this one has {flat.numel()}): capture with the largest mask first, or use a new wrapper"
        )
    old[: flat.numel()].copy_(flat, non_blocking=True)
    return old


class CudaNativePrefillPlan(StagedPlan):
    """A planned prefill batch: work list and metadata on the device; ``run`` launches one kernel.

    Work items are (request, first query token) pairs of ``q_tile // pack`` tokens each, ordered
    by `prefill_work` (requests by work, longest items first); each becomes one CTA per group of
    ``pack`` query heads. The int32 metadata (`prefill_sections`) travels in one transfer from a
    pinned buffer of the wrapper's `tactix.plugin.Staging` into one of its two device slots
    (`StagedPlan._send`). In CUDA-graph mode every buffer has the capacity of the plan's buckets (batch size,
    query tokens, kv length: the next power of two), the grid is that capacity and a re-plan
    rewrites the buffers in place (slot 0).
    """

    params: PrefillParams  # the kernel's (the default's choice for this batch, where the tactic was the default)
    _caps: tuple[int, int, int]  # requests, work items and page entries the buffers hold
    _kv_tma: bool  # K and V tiles through tensor maps of ragged K and V (`ragged_tma`)
    _maps: TensorMaps  # (with _kv_tma) those tensor maps, kept by layout (`TensorMaps.rebound`)
    _section: int  # head groups per section of the grid (`prefill_head_section`)

    def __init__(self, problem: PrefillProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions,
                 kv_tma: bool = False) -> None:  # fmt: skip
        """``kv_tma``: the batch is a ragged one's one-token pages with the identity page table
        (`tactix_cuda_native.ragged`), so a wgmma kernel over a 16-bit cache may load K and V
        tiles through tensor maps of the packed tensors (`ragged_tma`)."""
        index = device_index(options["device"])
        self.device = cuda_device(index)
        self.problem = problem
        self._requested = tactic
        self._kv_tma_asked = kv_tma
        info = device_info(index)
        graph = options["use_cuda_graph"]
        self._graph = bool(graph)
        previous = options["previous"]
        masked = problem.custom_mask
        params = default_params_for(problem, info) if tactic.is_default else PrefillParams.from_tactic(tactic)
        b, hq, hkv, gqa = batch.batch_size, problem.num_qo_heads, problem.num_kv_heads, problem.gqa_ratio
        pack = prefill_pack(gqa, params.q_tile, params.pack)
        d, dims = kernel_dims(problem, params)
        work = prefill_work(batch.qo_lens_list, batch.kv_lens_list, q_tile=params.q_tile, kv_tile=params.kv_tile,
                            pack=pack, causal=problem.causal, window_left=problem.window_left,
                            sched=params.sched)  # fmt: skip
        if tactic.is_default:  # persistent CTAs or not, by the batch (the captured kernel stays in graph mode)
            if graph and isinstance(previous, CudaNativePrefillPlan):
                params = previous.params
            else:
                params = prefill_default_persist(params, work.tiles, d, info, dims[1] if dims else None)
        self.params = params
        self._kv_tma = (kv_tma and params.mma == "wgmma" and kv_bytes(problem) == 2 and problem.page_size == 1
                        and tensor_maps_status() is None)  # fmt: skip
        if self._kv_tma:  # the tensor maps of the packed K and V (a re-plan shares its predecessor's)
            self._maps = (previous._maps if isinstance(previous, CudaNativePrefillPlan) and previous._kv_tma
                          and previous.device == self.device else TensorMaps(8))  # fmt: skip
        kernel, self.built = _prefill_kernel(index, problem.q_dtype, d, params, info, masked, problem.kv_dtype, dims,
                                             self._kv_tma)  # fmt: skip
        self.tactic = kernel.tactic
        self._kernel = kernel.kernel
        self.work = work
        self.pack = pack
        if graph:  # capacities of the buckets, so every batch of them fits the captured grid
            b_cap = bucket_size(b)
            item_cap = prefill_capacity(b_cap, bucket_size(batch.num_qo_tokens), work.tokens)
            page_cap = b_cap * -(-bucket_size(batch.max_kv_len) // problem.page_size)
            if (
                isinstance(previous, CudaNativePrefillPlan)
                and previous._graph
                and all(new <= old for new, old in zip((b_cap, item_cap, page_cap), previous._caps, strict=True))
            ):
                # a batch the captured buffers hold keeps their capacities (and so the captured grid),
                # as FlashInfer's CUDA-graph wrappers serve any batch their buffers hold
                b_cap, item_cap, page_cap = previous._caps
        else:
            b_cap, item_cap, page_cap = b, len(work.items), batch.num_page_entries
        self._caps = (b_cap, item_cap, page_cap)
        groups = hq // pack
        if params.persist:  # (persistent CTAs walk the virtual CTAs heads fastest: kernels/prefill_sm90.cu)
            section = groups
        elif graph and isinstance(previous, CudaNativePrefillPlan) and previous._graph:
            section = previous._section  # (a launch argument of the captured graph: kept)
        else:
            row = (problem.head_dim_qk + problem.head_dim_vo) * kv_bytes(problem)
            section = prefill_head_section(groups, gqa // pack, batch.max_kv_len, row, info.l2_bytes)
        self._section = section
        self._scalars = prefill_scalars(problem, pack, section)
        self._geometry = (b_cap, hq, hkv, d, problem.page_size, item_cap, page_cap, params, self._scalars, masked)
        replaced = previous if graph and previous is not None else None
        if replaced is not None and (
            not isinstance(replaced, CudaNativePrefillPlan) or replaced._geometry != self._geometry
        ):
            raise UnsupportedProblemError(NAME, problem, [
                "in CUDA-graph mode a re-plan must keep the heads and the scalars (causal, window, scale, "
                "soft-cap) and fit the captured buckets of the batch size, query tokens and kv length (the "
                "captured grid and buffers depend on them); capture with the largest batch, or use one "
                "wrapper per captured shape"])  # fmt: skip

        items, reqs = prefill_lists(batch, work)
        pieces: list[Piece] = [items, [len(work.items)], reqs]
        self._mask: torch.Tensor | None = None
        if masked:
            try:
                self._mask = prefill_mask(batch, self.device, replaced, graph)
            except ValueError as exc:
                raise UnsupportedProblemError(NAME, problem, [str(exc)]) from None
            assert batch.custom_mask is not None
            pieces.append(batch.custom_mask.offsets[:-1])
        if params.dynamic:
            pieces.append([0, 0])
        # (the ragged tensor-map kernel reads no page table: its identity indices are not sent)
        sections_of = functools.partial(prefill_sections, item_cap, b_cap, masked=masked, dynamic=params.dynamic)
        layout, base, indices_ptr = self._send(problem, batch, previous, graph, sections_of, pieces, page_cap,
                                               indices=not self._kv_tma)  # fmt: skip
        self._ptrs = (base + 4 * layout.offset("items"), base + 4 * layout.offset("num_items"),
                      base + 4 * layout.offset("reqs"), indices_ptr)  # fmt: skip
        # the kernel's last arguments: a custom mask's, or sched 3's turn counters
        self._tail_args: tuple[int, ...] = ()
        if self._mask is not None:
            self._tail_args = (self._mask.data_ptr(), base + 4 * layout.offset("mask"))
        elif params.dynamic:
            self._tail_args = (base + 4 * layout.offset("turns"),)
        self._launch = graph or bool(work.items)
        # persistent CTAs: as many as the GPU holds at once, each looping over the items
        persistent = prefill_persistent_ctas(info, kernel.ctas_per_sm) if params.persist else 0
        self.grid = prefill_grid(item_cap, hq, pack, persistent)
        self._cfg = launch_config(self.grid, kernel.threads, kernel.smem)
        self._launch_fn = launcher().launch  # (looked up once: run() is on every layer's path)
        self._index = index
        self._seen: tuple[Any, ...] | None = None
        self._strides: tuple[int, ...] = ()
        self._q_copy: torch.Tensor | None = None
        self._inherit_accepted(previous)

    def replan(self, problem: Problem, batch: PagedBatch, options: PlanOptions) -> StagedPlan | None:
        """`StagedPlan.replan`, keeping the plan's ``kv_tma``."""
        if options["device"] != self.device or bool(options["use_cuda_graph"]) != self._graph:
            return None
        assert isinstance(problem, PrefillProblem)
        return CudaNativePrefillPlan(problem, batch, self._requested, {**options, "previous": self},
                                     kv_tma=self._kv_tma_asked)  # fmt: skip

    def _ragged_map(self, t: torch.Tensor, name: str) -> Any:
        """The tensor map of packed K or V as ``run`` gets them (one-token NHD pages,
        ``[tokens, 1, heads, dim]``): ``[tokens, heads, dim]``, boxes of 64 of dim x 1 head x
        ``kv_tile`` tokens. (A planned ragged batch has keys: `RaggedBatch.build` gives every
        request with query rows one at least and refuses an empty batch.) Kept per layout
        (`TensorMaps.rebound`): a server's layers hand every run new K and V, often at a new
        address; the kept map of their shape and strides takes the new address in place, which
        costs less host time than encoding a map (an encode is about 13 us on an H200 host)."""
        layout = (name, t.dtype, tuple(t.shape), tuple(t.stride()))  # (K and V each their own: same layout at d128)
        box = (self.params.kv_tile, 1, 64)
        return self._maps.rebound(layout, t.data_ptr(), lambda: tensor_map(t.select(1, 0), box),
                                  lambda m: m.replace_address(t.select(1, 0)), name)  # fmt: skip

    def _accept(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Check the cache strides and q's once per new set of strides; keep the stride arguments."""
        self._strides = cache_strides(self.problem.kv_layout, k, v)
        self._q_direct = q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
        self._seen = (q.stride(), k.stride(), v.stride())

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None, k_scale: float | torch.Tensor | None = None,
            v_scale: float | torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """Launch the kernel; ``k_scale`` and ``v_scale`` (run extras, `paged.scale_args`): floats,
        or one-element float32 device tensors whose value the kernel reads; ``sinks`` (a run extra,
        checked by the core): a float32 ``[num_qo_heads]`` device tensor the kernel reads."""
        q, k_ptr, v_ptr, out_ptr = self._operands(q, k_cache, v_cache, out)
        if not self._launch:  # no query rows at all
            return
        lse_ptr = 0 if lse is None else lse.data_ptr()
        stream = stream_for(self._index, raw_stream(self._index))
        items, num_items, reqs, indices = self._ptrs
        maps = (self._ragged_map(k_cache, "k"), self._ragged_map(v_cache, "v")) if self._kv_tma else ()
        self._launch_fn(stream, self._cfg, self._kernel, *maps, q.data_ptr(), q.stride(0), q.stride(1), k_ptr, v_ptr,
                  *self._strides, out_ptr, lse_ptr, items, num_items, reqs, indices, *self._scalars,
                  *(UNIT_SCALES if k_scale is None and v_scale is None else scale_args(k_scale, v_scale)),
                  0 if sinks is None else sinks.data_ptr(), *self._tail_args)  # fmt: skip


def plan_prefill(problem: PrefillProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions,
                 kv_tma: bool = False) -> CudaNativePrefillPlan:  # fmt: skip
    """The plan hook's work: the check's reasons as an `UnsupportedProblemError`, else the plan
    (``kv_tma``: see `CudaNativePrefillPlan`)."""
    reasons = prefill_reasons(problem, tactic, device_info(device_index(options["device"])))
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudaNativePrefillPlan(problem, batch, tactic, options, kv_tma=kv_tma)
