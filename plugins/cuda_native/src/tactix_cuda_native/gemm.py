"""Skinny GEMM for m <= 64 (kernels/gemm_sm90.cu: Hopper wgmma, split-K in a thread block cluster;
kernels/gemm.cu: mma.sync, any GPU from sm_80): the tactic parameters of both kernels (`GemmParams`,
`GemmWgmmaParams`), split counts and grids, the kernel variants, the reasons a tactic cannot run, the
tactic space and the default, and the plan (`CudaNativeGemmPlan`).

Tactics: ``Tactic(backend="cuda_native", kernel="gemm_wgmma", params={"bw": 64, "bk": 64, "stages": 4,
"splits": 0})`` (the default on sm_90; ``splits``: the CTAs of a thread block cluster, 0 chosen per
shape by `gemm_wgmma_splits`; an optional ``"tma"``: 1 loads W, 2 W and a, through tensor maps the
plan keeps per tensor); ``Tactic(backend="cuda_native", kernel="gemm", params={"bn": 32, "bk": 128,
"wn": 1, "wk": 4, "stages": 4, "splits": 0})`` (``splits`` 0: chosen from the shape by `gemm_splits`;
an optional ``"l2"``: 0 and 1, the default, left out of the params, stream the weight without an L2
policy, 2 adds a 256-byte L2 prefetch: ptxas miscompiles the kernel's cp.async with a policy for
some shapes on sm_90, kernels/common.cuh).

The geometry functions are pure (no CUDA), so every rule is tested on a machine without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Final

import torch

from tactix import GemmProblem, InvalidArgumentError, PlanOptions, Tactic, UnsupportedProblemError
from tactix.plugin import raw_stream
from tactix_cuda_native import NAME
from tactix_cuda_native.device import WGMMA_ARCHS, DeviceInfo, ctas_per_sm, device_index, device_info, wgmma_arch
from tactix_cuda_native.kernel import FLAG_BYTES, L2_HINTS, TensorMaps, bf16, launcher
from tactix_cuda_native.runtime import (
    Variant,
    launch_config,
    load,
    resident_ctas,
    stream_for,
    tensor_map,
    tensor_maps_status,
)
from tactix_cuda_native.tactics import TacticParams

GEMM_MAX_M: Final = 64


# -- tactic parameters -----------------------------------------------------------------------


class GemmParams(TacticParams):
    """A GEMM tactic's parameters: columns per CTA, k per stage, warp layout, stages, k splits (0: auto)
    and the L2 hint for W: 0 and 1 (the default) none, 2 a 256-byte L2 prefetch. (There is no
    evict_first policy for W: ptxas miscompiles the GEMM's cp.async with one for some shapes,
    see kernels/common.cuh; 1 stays the default so that stored tactics keep matching.)"""

    KERNEL: ClassVar[str] = "gemm"
    IMPLICIT: ClassVar[tuple[str, ...]] = ("l2",)  # the default hint stays implicit

    bn: int
    bk: int
    wn: int
    wk: int
    stages: int
    splits: int = 0
    l2: int = 1

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


class GemmWgmmaParams(TacticParams):
    """A tactic of the Hopper skinny GEMM (kernels/gemm_sm90.cu, ``kernel="gemm_wgmma"``): ``bw``
    columns of W per CTA (the wgmma's N: 64, 128 or 256), ``bk`` of k per stage (64 or 128),
    ``stages`` of the cp.async ring and the k ``splits`` (0: chosen per shape,
    `gemm_wgmma_splits`; else 1, 2, 4 or 8: the CTAs of a thread block cluster, which add their
    partial sums up in distributed shared memory). One warpgroup per CTA; the m rows are padded to
    the wgmma's 64. ``tma``: 0 (default) loads W and a with ``cp.async``; 1 loads W and 2 both
    through the tensor memory accelerator (tensor maps the plan encodes and keeps per tensor)."""

    KERNEL: ClassVar[str] = "gemm_wgmma"
    IMPLICIT: ClassVar[tuple[str, ...]] = ("tma",)  # 0 stays implicit: tactics stored before it existed still match
    THREADS: ClassVar[int] = 128

    bw: int
    bk: int
    stages: int
    splits: int = 0
    tma: int = 0

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


# -- split counts, defaults and candidates ---------------------------------------------------


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
    out = [GEMM_WGMMA_DEFAULT]
    out += [GemmWgmmaParams(bw=64, bk=64, stages=s, splits=sp) for s in (4, 3, 6) for sp in (0, 2, 4, 8)]
    out += [GemmWgmmaParams(bw=128, bk=64, stages=s, splits=sp) for s in (3, 4) for sp in (0, 4, 8)]
    out += [GemmWgmmaParams(bw=64, bk=128, stages=s, splits=sp) for s in (3, 4) for sp in (0, 2)]
    # operands through tensor maps (h200-gemm-tma-sweep.log, h200-gemm-tma2-m64-sweep.log): W alone
    # (tma 1) matches cp.async at m = 1 and 16; W and a (tma 2) lead at m = 64 with one CTA per SM
    # (128 of k per stage, 4-5 stages, 2 splits: 18.1 us against 19.4 for the default)
    out += [GemmWgmmaParams(bw=64, bk=bk, stages=4, tma=1) for bk in (64, 128)]
    out += [GemmWgmmaParams(bw=64, bk=bk, stages=s, splits=sp, tma=2) for bk, s, sp in
            ((64, 4, 0), (128, 4, 0), (128, 5, 2), (64, 8, 2))]  # fmt: skip
    return [p for p in dict.fromkeys(out) if not p.reasons(m, info)]


def m_tiles(m: int) -> int:
    """16-row MMA tiles for ``m`` rows (1, 2 or 4)."""
    tiles = -(-m // 16)
    return 4 if tiles > 2 else tiles


def gemm_smem_bytes(mt: int, bn: int, bk: int, stages: int) -> int:
    return stages * (mt * 16 + bn) * bk * 2 + FLAG_BYTES


GEMM_WGMMA_DEFAULT: Final = GemmWgmmaParams(bw=64, bk=64, stages=4)
"""The Hopper GEMM's default: 64 columns x 64 of k per stage, 4 stages (64 KB: 3
CTAs per SM), splits chosen per shape. On the H200 (n = k = 4096, the suite's method,
benchmarks/results/h200-gemm-wgmma-sweep.log) it took 17.3 / 17.9 / 19.4 us at m = 1 / 16 / 64,
against 17.8 / 18.6 / 25.2 for the mma.sync kernel's best tactic and 18.8 / 19.3 / 17.9 for
cuBLAS; 256-column W tiles and 128 x 128 tiles were never within 30 % of the best
(h200-gemm-wgmma-sweep-all-shapes.log)."""


@functools.lru_cache(maxsize=256)  # plans ask per batch; the parameters are immutable
def default_gemm_params(m: int, info: DeviceInfo) -> GemmParams | GemmWgmmaParams:
    """The heuristic tactic: on Hopper the wgmma kernel (`GEMM_WGMMA_DEFAULT`), elsewhere the
    mma.sync kernel's (`default_sync_gemm_params`)."""
    if info.arch in WGMMA_ARCHS and not GEMM_WGMMA_DEFAULT.reasons(m, info):
        return GEMM_WGMMA_DEFAULT
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
    return params.replace(stages=stages)


def gemm_candidates(m: int, info: DeviceInfo) -> list[GemmParams]:
    shapes = [(32, 128, 1, 4), (64, 64, 2, 2), (64, 128, 2, 2), (128, 64, 4, 1), (128, 64, 4, 2)]
    out = [GemmParams(bn=bn, bk=bk, wn=wn, wk=wk, stages=s, splits=sp) for bn, bk, wn, wk in shapes for s in (4, 6)
           for sp in (0, 1, 2, 4, 8)]  # fmt: skip
    base = default_sync_gemm_params(m, info)
    out.append(base.replace(l2=2))  # l2 0 is the same kernel as 1
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


# -- support rules ---------------------------------------------------------------------------


def gemm_reasons(problem: GemmProblem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    """Why ``tactic`` cannot serve ``problem`` on a GPU like ``info`` (empty: it can)."""
    out = []
    if problem.k % 8:
        out.append(f"k must be a multiple of 8 (16-byte rows; got k={problem.k})")
    if tactic.is_default:
        if tactic.params:
            out.append(f"the default tactic takes no params (got {tactic.params})")
        return out
    kinds: dict[str, type[GemmParams | GemmWgmmaParams]] = {"gemm_wgmma": GemmWgmmaParams, "gemm": GemmParams}
    kind = kinds.get(tactic.kernel)
    if kind is None:
        return [*out, f"unknown gemm kernel '{tactic.kernel}' (known: default, gemm, gemm_wgmma)"]
    params = kind.read(tactic)
    if isinstance(params, str):
        return [*out, params]
    if isinstance(params, GemmWgmmaParams) and params.tma and (why := tensor_maps_status()) is not None:
        out.append(f"tma {params.tma} needs tensor maps: {why}")
    return out + params.reasons(problem.m, info)


def gemm_tactic_params(m: int, info: DeviceInfo) -> list[GemmParams | GemmWgmmaParams]:
    """The GEMM tactics the tuner measures, in order: on Hopper the wgmma kernel's candidates, then
    each mma.sync shape with its split count chosen per shape (its forced split counts and L2
    hints never won there: h200-gemm-wgmma-sweep.log); elsewhere every mma.sync candidate."""
    wgmma = gemm_wgmma_candidates(m, info)
    if not wgmma:
        return list(gemm_candidates(m, info))
    return [*wgmma, *(p for p in gemm_candidates(m, info) if p.splits == 0 and p.l2 == 1)]


def gemm_tactics(problem: GemmProblem, info: DeviceInfo) -> list[Tactic]:
    """The tactics the tuner measures for ``problem`` (`gemm_tactic_params`)."""
    return [p.to_tactic() for p in gemm_tactic_params(problem.m, info)]


def gemm_params_of(tactic: Tactic) -> GemmParams | GemmWgmmaParams:
    """The parameters of a checked, non-default GEMM tactic of either kernel."""
    if tactic.kernel == "gemm_wgmma":
        return GemmWgmmaParams.from_tactic(tactic)
    return GemmParams.from_tactic(tactic)


# -- kernel variants -------------------------------------------------------------------------


def _gemm_l2_defines(hint: int) -> dict[str, int]:
    """The GEMM streams W without an L2 policy (ptxas miscompiles its cp.async with one, see
    kernels/common.cuh): l2 0 and 1 are the same kernel, 2 adds the 256-byte prefetch."""
    return {"TX_L2_PREFETCH_256": int(hint == 2)}


def gemm_variant(dtype: str, m: int, params: GemmParams, arch: str) -> Variant:
    return Variant.make(
        "gemm.cu",
        arch,
        TX_BF16=bf16(dtype),
        TX_MT=m_tiles(m),
        TX_BN=params.bn,
        TX_BK=params.bk,
        TX_WN=params.wn,
        TX_WK=params.wk,
        TX_STAGES=params.stages,
        **_gemm_l2_defines(params.l2),
    )


def gemm_wgmma_variant(dtype: str, params: GemmWgmmaParams, splits: int, arch: str) -> Variant:
    """kernels/gemm_sm90.cu for the arch-specific target (sm_90a) of an sm_90 ``arch``, with
    ``splits`` CTAs per cluster (`gemm_wgmma_splits`); one variant serves every m (its
    tile is 64 rows)."""
    return Variant.make(
        "gemm_sm90.cu",
        wgmma_arch(arch),
        TX_BF16=bf16(dtype),
        TX_BW=params.bw,
        TX_BK=params.bk,
        TX_STAGES=params.stages,
        TX_CLUSTER=splits,
        TX_SMEM=params.smem_bytes,  # the kernel asserts that its layout has this size
        **({"TX_TMA": params.tma} if params.tma else {}),  # absent when 0: the variants keep their keys
    )


def gemm_params_variant(dtype: str, m: int, params: GemmParams | GemmWgmmaParams, info: DeviceInfo,
                        n: int = 4096, k: int = 4096) -> Variant:  # fmt: skip
    """The variant a GEMM tactic compiles to for ``m`` rows (the Hopper kernel's also depends on
    its split count, hence on ``n`` and ``k``: by default the suite's decode-sized n = k = 4096)."""
    if isinstance(params, GemmWgmmaParams):
        return gemm_wgmma_variant(dtype, params, gemm_wgmma_splits(m, n, k, params, info), info.arch)
    return gemm_variant(dtype, m, params, info.arch)


# -- plan ------------------------------------------------------------------------------------


def gemm_tma_view(t: torch.Tensor, problem: GemmProblem, rows: int, ld: int, sb: int) -> torch.Tensor:
    """A k-contiguous GEMM operand (a, or W through b's [k, n] view) as the 3-D [batch][rows][k]
    its tensor map describes: row stride ``ld``, batch stride ``sb`` (unbatched: any multiple of
    16 bytes, the map's one batch never steps)."""
    batch_stride = sb if problem.batched else rows * ld
    return t.as_strided((problem.batch, rows, problem.k), (batch_stride, ld, 1))


class CudaNativeGemmPlan:
    """A planned skinny GEMM: split count and workspace fixed in plan; ``run`` launches one kernel."""

    def __init__(self, problem: GemmProblem, tactic: Tactic, options: PlanOptions) -> None:
        index = device_index(options["device"])
        self.device = torch.device("cuda", index)
        self.problem = problem
        info = device_info(index)
        params = default_gemm_params(problem.m, info) if tactic.is_default else gemm_params_of(tactic)
        self.tactic = params.to_tactic()
        m, n, k, batch = problem.m, problem.n, problem.k, problem.batch
        if isinstance(params, GemmWgmmaParams):  # splits: the CTAs of a cluster, all launched
            self.splits = gemm_wgmma_splits(m, n, k, params, info)
            self.kps = gemm_wgmma_k_per_split(k, params.bk, self.splits)
            smem, threads = params.smem_bytes, params.THREADS
            module, self.built = load(gemm_wgmma_variant(problem.a_dtype, params, self.splits, info.arch), index)
            self._kernel = module.kernel("tactix_gemm", smem)
            self.ctas_per_sm = ctas_per_sm(info, smem, threads)
            grid = gemm_grid(n, params.bw, self.splits, batch)
            self._tma = params.tma
            self._tma_bw = params.bw
        else:
            smem = gemm_smem_bytes(m_tiles(problem.m), params.bn, params.bk, params.stages)
            threads = 32 * params.wn * params.wk
            module, self.built = load(gemm_variant(problem.a_dtype, problem.m, params, info.arch), index)
            self._kernel = module.kernel("tactix_gemm", smem)
            self.ctas_per_sm = ctas_per_sm(info, smem, threads, resident=resident_ctas(self._kernel, threads, smem))
            wanted = gemm_splits(m, n, k, params.bn, params.bk, info, self.ctas_per_sm, params.splits)
            self.kps, self.splits = gemm_k_per_split(k, params.bk, wanted)
            grid = gemm_grid(n, params.bn, self.splits, batch)
        if self.splits > 1 and not isinstance(params, GemmWgmmaParams):
            # fp32 partial tiles, and a ticket counter per column block (zero between runs)
            self._ws: torch.Tensor | None = torch.empty(self.splits * batch * m * n, dtype=torch.float32,
                                                        device=self.device)  # fmt: skip
            self._counters: torch.Tensor | None = torch.zeros(grid[0] * batch, dtype=torch.int32, device=self.device)
        else:
            self._ws = self._counters = None
        self._cfg = launch_config(grid, threads, smem)
        self._launch_fn = launcher().launch  # (looked up once: run() is on every layer's path)
        self._index = index
        self._maps: TensorMaps = TensorMaps(16)

    _tma = 0  # the Hopper kernel's operands through tensor maps: 1 W, 2 W and a (GemmWgmmaParams.tma)
    _tma_bw = 64

    def _tensor_map(self, t: torch.Tensor, name: str, rows: int, ld: int, sb: int, box_rows: int) -> Any:
        """The tensor map of operand ``t`` (`gemm_tma_view`), boxes of ``box_rows`` x 64 of k; a CUDA
        graph replays the maps it captured."""
        return self._maps.get((t.data_ptr(), t.dtype, rows, ld, sb, box_rows),
                              lambda: tensor_map(gemm_tma_view(t, self.problem, rows, ld, sb), (1, box_rows, 64)),
                              name)  # fmt: skip

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
            scale_a: torch.Tensor | None, scale_b: torch.Tensor | None) -> None:  # fmt: skip
        p = self.problem
        lda = a.stride(-2) if p.m > 1 else p.k
        ldb = b.stride(-1) if p.n > 1 else p.k
        a_sb = a.stride(0) if p.batched else 0
        b_sb = b.stride(0) if p.batched else 0
        a_ptr, b_ptr, out_ptr = a.data_ptr(), b.data_ptr(), out.data_ptr()
        bias_ptr = 0 if bias is None else bias.data_ptr()
        if (a_ptr | b_ptr) % 16 or (lda | ldb | a_sb | b_sb) % 8:
            raise InvalidArgumentError("a", "a and b 16-byte aligned with row and batch strides that are multiples "
                                       "of 8 elements", f"a at {a_ptr:#x} strides {a.stride()}, b at {b_ptr:#x} "
                                       f"strides {b.stride()}")  # fmt: skip
        stream = stream_for(self._index, raw_stream(self._index))
        ws = 0 if self._ws is None else self._ws.data_ptr()
        counters = 0 if self._counters is None else self._counters.data_ptr()
        args: tuple[Any, ...] = (a_ptr, lda, a_sb, b_ptr, ldb, b_sb, out_ptr, p.m * p.n, bias_ptr, ws, counters, p.m,
                                 p.n, p.k, self.kps)  # fmt: skip
        if self._tma:
            wmap = self._tensor_map(b, "b", p.n, ldb, b_sb, self._tma_bw)
            amap = self._tensor_map(a, "a", p.m, lda, a_sb, 64) if self._tma == 2 else wmap  # (tma 1: not read)
            args = (wmap, amap, *args)
        self._launch_fn(stream, self._cfg, self._kernel, *args)


def plan_gemm(problem: GemmProblem, tactic: Tactic, options: PlanOptions) -> CudaNativeGemmPlan:
    """The plan hook's work: the check's reasons as an `UnsupportedProblemError`, else the plan."""
    reasons = gemm_reasons(problem, tactic, device_info(device_index(options["device"])))
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudaNativeGemmPlan(problem, tactic, options)
