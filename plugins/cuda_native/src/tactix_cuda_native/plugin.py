"""tactix hooks for the ``cuda_native`` backend: paged prefill and decode attention and skinny GEMM, in the project's
own CUDA.

Tactics are the kernels' compile-time and launch parameters:

* ``Tactic(backend="cuda_native", kernel="prefill", params={"q_tile": 128, "kv_tile": 32, "warps": 4,
  "stages": 3, "pack": 0, "sched": 0})`` (``pack`` 0: the query heads of a GQA group per CTA chosen by
  `geometry.prefill_pack`; ``sched`` 0: requests by work, each one's items longest first, 1: request order,
  2: longest first over the batch; see `geometry.prefill_work`); with ``"mma": "wgmma"`` the Hopper kernel
  (kernels/prefill_sm90.cu: ``q_tile`` 64 or 128 rows, ``warps`` = q_tile / 16 consumer warps, ``kv_tile`` 64 or
  128), the default on sm_90 for head dims 64, 128 and 256; ``mma`` left out (or "sync") is the mma.sync kernel;
  wgmma also takes ``"persist": 1``: persistent CTAs (as many as the GPU holds at once, each looping over the
  work items; left out, 0, one CTA per item) and, with q_tile 128, ``"pingpong": 1``: the two consumer
  warpgroups take turns at the tensor cores (FlashAttention-3's schedule);
* ``Tactic(backend="cuda_native", kernel="decode", params={"tile": 64, "warps": 4, "stages": 2, "kv_chunk": 0})``
  (``kv_chunk`` 0: the split of long requests is chosen per batch by `geometry.decode_chunk`; optional
  ``"bulk"``: segments of that many tokens per bulk copy, HND, sm_90, and ``"tma": 1``: those segments through
  tensor maps of the caches);
* ``Tactic(backend="cuda_native", kernel="gemm", params={"bn": 32, "bk": 128, "wn": 1, "wk": 4, "stages": 4,
  "splits": 0})`` (``splits`` 0: chosen from the shape by `geometry.gemm_splits`);
* ``Tactic(backend="cuda_native", kernel="gemm_wgmma", params={"bw": 64, "bk": 64, "stages": 4, "splits": 0})``
  (kernels/gemm_sm90.cu, the default on sm_90; ``splits``: the CTAs of a thread block cluster; an optional
  ``"tma"``: 1 loads W, 2 W and a, through tensor maps the plan keeps per tensor);
* decode and the mma.sync GEMM take an optional ``"l2"``: 1 (the default, left out of the params) streams the KV cache
  with an L2 evict_first policy, 0 with evict_normal (L2's default, same copy form), 2 adds a
  256-byte L2 prefetch; the GEMM's weight gets no policy (l2 0 and 1 are one kernel, 2 adds the
  prefetch): ptxas miscompiles its cp.async with one for some shapes on sm_90 (kernels/common.cuh).

The default tactic is the heuristic of `geometry` for the problem and the GPU. Plans do all host
work — the work list, the device metadata in one transfer, the workspace — and ``run`` only
launches one kernel: split work (decode's split-KV, GEMM's split-K) is combined by the CTA that
finishes last, in a fixed order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

import tactix
from tactix import (
    DecodeProblem,
    GemmProblem,
    InvalidArgumentError,
    PagedBatch,
    PlanOptions,
    PrefillProblem,
    Problem,
    Tactic,
    UnsupportedProblemError,
)
from tactix.plugin import Piece, Sections, Staging, bucket_size, cache_axes, compute_capability, raw_stream, sections
from tactix_cuda_native import __version__
from tactix_cuda_native.geometry import (
    DECODE_ITEM_INTS,
    GEMM_MAX_M,
    H200,
    HEAD_DIMS,
    MAX_PAGE_SIZE,
    DecodeParams,
    DeviceInfo,
    GemmParams,
    GemmWgmmaParams,
    PrefillParams,
    PrefillWork,
    ctas_per_sm,
    decode_buffer_sizes,
    decode_candidates,
    decode_grid,
    decode_is_small,
    decode_items,
    decode_plan_work,
    decode_smem_bytes,
    decode_units,
    default_decode_params,
    default_gemm_params,
    default_prefill_params,
    effective_lengths,
    gemm_candidates,
    gemm_grid,
    gemm_k_per_split,
    gemm_smem_bytes,
    gemm_splits,
    gemm_wgmma_candidates,
    gemm_wgmma_k_per_split,
    gemm_wgmma_splits,
    log2_exact,
    m_tiles,
    prefill_candidates,
    prefill_capacity,
    prefill_default_persist,
    prefill_grid,
    prefill_pack,
    prefill_persistent_ctas,
    prefill_work,
    q_tiles,
    wgmma_arch,
)
from tactix_cuda_native.runtime import (
    Variant,
    compile_all,
    cuda_core_status,
    launch_config,
    load,
    resident_ctas,
    stream_for,
    tensor_map,
    tensor_maps_status,
)

NAME: Final = "cuda_native"
_DTYPES: Final = frozenset({"float16", "bfloat16"})
_PAGE_SIZES: Final = frozenset(1 << i for i in range(8))  # 1 .. 128
_CCS: Final = frozenset({"8.0", "8.6", "8.9", "9.0"})
_LOG2E: Final = 1.4426950408889634

_DECODE = tactix.AttentionCapabilities(
    devices=frozenset({"cuda"}),
    compute_capabilities=_CCS,
    q_dtypes=_DTYPES,
    kv_dtypes=_DTYPES,
    out_dtypes=_DTYPES,
    head_dims=frozenset(HEAD_DIMS),
    page_sizes=_PAGE_SIZES,
    kv_layouts=frozenset({"NHD", "HND"}),
    max_gqa_ratio=None,
    sliding_window=True,
    logits_soft_cap=True,
    lse=True,
    cuda_graph="fixed_buffers",
)

_PREFILL = tactix.AttentionCapabilities(
    devices=frozenset({"cuda"}),
    compute_capabilities=_CCS,
    q_dtypes=_DTYPES,
    kv_dtypes=_DTYPES,
    out_dtypes=_DTYPES,
    head_dims=frozenset(HEAD_DIMS),
    page_sizes=_PAGE_SIZES,
    kv_layouts=frozenset({"NHD", "HND"}),
    max_gqa_ratio=None,
    causal=True,
    non_causal=True,
    chunked=True,
    sliding_window=True,
    logits_soft_cap=True,
    lse=True,
    cuda_graph="fixed_buffers",
)

_GEMM = tactix.GemmCapabilities(
    devices=frozenset({"cuda"}),
    compute_capabilities=_CCS,
    dtypes=frozenset(tactix.GemmDTypes(a=t, b=t, out=t) for t in _DTYPES),
    a_m_major=False,
    b_n_major=False,
    bias=True,
    batched=True,
    max_m=GEMM_MAX_M,
    cuda_graph="fixed_buffers",
)


@tactix.hookimpl
def tactix_backends() -> list[tactix.BackendSpec]:
    return [
        tactix.BackendSpec(
            name=NAME,
            version=__version__,
            description="the project's CUDA kernels (NVRTC): paged prefill (flash attention: wgmma on Hopper, "
            "mma.sync elsewhere), paged decode with split-KV, skinny GEMM for m <= 64",
            prefill=_PREFILL,
            decode=_DECODE,
            gemm=_GEMM,
            preference=5,
            # decode: ahead of cudnn untuned. Measured on the H200 (benchmarks/results/
            # h200-bench-deterministic.json): deterministic and faster than cuDNN's deterministic
            # decode plan on D1-D3. prefill stays at 5, behind cudnn (10): the wgmma kernel matches
            # it on P2/P4 but not P1/P3 (h200-prefill-sweep.log). gemm: behind torch (cuBLAS, -100)
            # untuned, since the skinny GEMM's default (the Hopper wgmma kernel) is 1.03-1.12x
            # cuBLAS at m <= 16 but 0.91x at m = 64 (h200-bench-gemm.md); tuning picks it where
            # it wins.
            op_preference={"decode": 20, "gemm": -150},
        )
    ]


@tactix.hookimpl
def tactix_environment() -> list[str] | None:
    reasons = []
    _, why = cuda_core_status()
    if why is not None:
        reasons.append(why)
    if not torch.cuda.is_available():
        reasons.append("no CUDA GPU is visible")
    elif (compute_capability() or (99, 0)) < (8, 0):
        major, minor = compute_capability() or (99, 0)
        reasons.append(f"the kernels need compute capability 8.0 or newer (this GPU is {major}.{minor})")
    return reasons


# -- device properties -----------------------------------------------------------------------


@functools.cache
def device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceInfo(
        sms=int(props.multi_processor_count),
        smem_per_block=int(getattr(props, "shared_memory_per_block_optin", 48 * 1024)),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 100 * 1024)),
        arch=f"sm_{major}{minor}",
    )


def _info_for(device: torch.device | None) -> DeviceInfo:
    """This GPU's properties, or the H200's where there is none (tactic spaces, ahead-of-time compiles)."""
    if not torch.cuda.is_available():
        return H200
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return device_info(index)


# -- support rules ---------------------------------------------------------------------------


def _decode_reasons(problem: DecodeProblem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    out = []
    if not (problem.q_dtype == problem.kv_dtype == problem.out_dtype):
        out.append("q, kv and out dtypes must be the same")
    if log2_exact(problem.page_size) is None or problem.page_size > MAX_PAGE_SIZE:
        out.append(f"page size {problem.page_size} must be a power of two up to {MAX_PAGE_SIZE}")
    if tactic.is_default:
        if tactic.params:
            out.append(f"the default tactic takes no params (got {tactic.params})")
        return out
    if tactic.kernel != "decode":
        return [*out, f"unknown decode kernel '{tactic.kernel}' (known: default, decode)"]
    known = {"tile", "warps", "stages", "kv_chunk", "l2", "bulk", "tma"}
    given = set(tactic.params)
    if not {"tile", "warps", "stages"} <= given or given - known:
        return [*out, f"decode params must be {sorted(known)} with kv_chunk, l2, bulk and tma optional "
                      f"(got {sorted(given)})"]  # fmt: skip
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in tactic.params.values()):
        return [*out, f"decode params must be integers (got {tactic.params})"]
    params = DecodeParams.from_tactic(tactic)
    if params.bulk > 0:
        if problem.kv_layout != "HND":
            out.append(f"bulk {params.bulk} copies a head's rows of a page at once: it needs the HND layout")
        if problem.page_size % params.bulk:
            out.append(f"bulk {params.bulk} needs a page size that is a multiple of it (got {problem.page_size})")
    if params.tma and (why := tensor_maps_status()) is not None:
        out.append(f"tma {params.tma} needs tensor maps: {why}")
    return out + params.reasons(problem.head_dim_qk, info)


def _prefill_reasons(problem: PrefillProblem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    out = []
    if not (problem.q_dtype == problem.kv_dtype == problem.out_dtype):
        out.append("q, kv and out dtypes must be the same")
    if log2_exact(problem.page_size) is None or problem.page_size > MAX_PAGE_SIZE:
        out.append(f"page size {problem.page_size} must be a power of two up to {MAX_PAGE_SIZE}")
    if tactic.is_default:
        if tactic.params:
            out.append(f"the default tactic takes no params (got {tactic.params})")
        return out
    if tactic.kernel != "prefill":
        return [*out, f"unknown prefill kernel '{tactic.kernel}' (known: default, prefill)"]
    given = set(tactic.params)
    known = set(PrefillParams.KEYS)
    if not set(PrefillParams.REQUIRED) <= given or given - known:
        return [
            *out,
            f"prefill params must be {sorted(known)} with pack, sched, mma, persist and pingpong optional "
            f"(got {sorted(given)})",
        ]
    numbers = {key: value for key, value in tactic.params.items() if key != "mma"}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers.values()):
        return [*out, f"prefill params must be integers, mma a string (got {tactic.params})"]
    if not isinstance(tactic.params.get("mma", "sync"), str):
        return [*out, f"prefill param mma must be 'sync' or 'wgmma' (got {tactic.params['mma']!r})"]
    return out + PrefillParams.from_tactic(tactic).reasons(problem.head_dim_qk, info, problem.gqa_ratio)


def _gemm_reasons(problem: GemmProblem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    out = []
    if problem.k % 8:
        out.append(f"k must be a multiple of 8 (16-byte rows; got k={problem.k})")
    if tactic.is_default:
        if tactic.params:
            out.append(f"the default tactic takes no params (got {tactic.params})")
        return out
    if tactic.kernel == "gemm_wgmma":
        known = {"bw", "bk", "stages", "splits", "tma"}
        given = set(tactic.params)
        if not known - {"splits", "tma"} <= given or given - known:
            return [*out, f"gemm_wgmma params must be {sorted(known)} with splits and tma optional "
                          f"(got {sorted(given)})"]  # fmt: skip
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in tactic.params.values()):
            return [*out, f"gemm_wgmma params must be integers (got {tactic.params})"]
        params = GemmWgmmaParams.from_tactic(tactic)
        if params.tma and (why := tensor_maps_status()) is not None:
            out.append(f"tma {params.tma} needs tensor maps: {why}")
        return out + params.reasons(problem.m, info)
    if tactic.kernel != "gemm":
        return [*out, f"unknown gemm kernel '{tactic.kernel}' (known: default, gemm, gemm_wgmma)"]
    known = {"bn", "bk", "wn", "wk", "stages", "splits", "l2"}
    given = set(tactic.params)
    if not known - {"splits", "l2"} <= given or given - known:
        return [*out, f"gemm params must be {sorted(known)} with splits and l2 optional (got {sorted(given)})"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in tactic.params.values()):
        return [*out, f"gemm params must be integers (got {tactic.params})"]
    return out + GemmParams.from_tactic(tactic).reasons(problem.m, info)


def _reasons(problem: Problem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    if isinstance(problem, PrefillProblem):
        return _prefill_reasons(problem, tactic, info)
    if isinstance(problem, DecodeProblem):
        return _decode_reasons(problem, tactic, info)
    return _gemm_reasons(problem, tactic, info)


@tactix.hookimpl
def tactix_check(problem: Problem, tactic: Tactic, batch: PagedBatch | None) -> list[str] | None:
    return _reasons(problem, tactic, _info_for(None))


@tactix.hookimpl
def tactix_tactics(problem: Problem) -> list[Tactic] | None:
    info = _info_for(None)
    if isinstance(problem, PrefillProblem):
        return [p.to_tactic() for p in prefill_candidates(problem.head_dim_qk, info, problem.gqa_ratio)]
    if isinstance(problem, DecodeProblem):
        tactics = [p.to_tactic() for p in decode_candidates(problem.head_dim_qk, info)]
        return [t for t in tactics if not _decode_reasons(problem, t, info)]
    if isinstance(problem, GemmProblem):
        return [p.to_tactic() for p in gemm_tactic_params(problem.m, info)]
    return []


def gemm_tactic_params(m: int, info: DeviceInfo) -> list[GemmParams | GemmWgmmaParams]:
    """The GEMM tactics the tuner measures, in order: on Hopper the wgmma kernel's candidates, then
    each mma.sync shape with its split count chosen per shape (its forced split counts and L2
    hints never won there: h200-gemm-wgmma-sweep.log); elsewhere every mma.sync candidate."""
    wgmma = gemm_wgmma_candidates(m, info)
    if not wgmma:
        return list(gemm_candidates(m, info))
    return [*wgmma, *(p for p in gemm_candidates(m, info) if p.splits == 0 and p.l2 == 1)]


# -- kernel variants -------------------------------------------------------------------------


def _bf16(dtype: str) -> int:
    return 1 if dtype == "bfloat16" else 0


def _l2_defines(hint: int) -> dict[str, int]:
    return {"TX_L2": int(hint >= 1), "TX_L2_PREFETCH_256": int(hint == 2)}


def _gemm_l2_defines(hint: int) -> dict[str, int]:
    """The GEMM streams W without an L2 policy (ptxas miscompiles its cp.async with one, see
    kernels/common.cuh): l2 0 and 1 are the same kernel, 2 adds the 256-byte prefetch."""
    return {"TX_L2_PREFETCH_256": int(hint == 2)}


def decode_variant(dtype: str, head_dim: int, params: DecodeParams, arch: str) -> Variant:
    return Variant.make(
        "decode.cu",
        arch,
        TX_BF16=_bf16(dtype),
        TX_D=head_dim,
        TX_TILE=params.tile,
        TX_WARPS=params.warps,
        TX_STAGES=params.stages,
        **_l2_defines(params.l2),
        **({"TX_BULK": params.bulk} if params.bulk else {}),  # absent when 0: the variants keep their keys
        **({"TX_TMA": params.tma} if params.tma else {}),
    )


def prefill_variant(dtype: str, head_dim: int, params: PrefillParams, arch: str) -> Variant:
    """``pack`` and ``sched`` are launch-time choices: every value shares one compiled variant.
    ``mma`` "wgmma" is kernels/prefill_sm90.cu, compiled for the arch-specific target (sm_90a) of
    an sm_90 ``arch``; its warps are implied by the tiles (one consumer warpgroup per 64 rows)."""
    if params.mma == "wgmma":
        return Variant.make(
            "prefill_sm90.cu",
            wgmma_arch(arch),
            TX_BF16=_bf16(dtype),
            TX_D=head_dim,
            TX_QTILE=params.q_tile,
            TX_KVTILE=params.kv_tile,
            TX_STAGES=params.stages,
            TX_SMEM=params.smem_bytes(head_dim),  # the kernel asserts that its layout has this size
            **({"TX_PERSIST": 1} if params.persist else {}),  # absent when 0: default variants keep their keys
            **({"TX_PINGPONG": 1} if params.pingpong else {}),
            **({"TX_SNAKE": 1} if params.persist and params.sched == 2 else {}),  # sorted over the batch
        )
    return Variant.make(
        "prefill.cu",
        arch,
        TX_BF16=_bf16(dtype),
        TX_D=head_dim,
        TX_QTILE=params.q_tile,
        TX_KVTILE=params.kv_tile,
        TX_WARPS=params.warps,
        TX_STAGES=params.stages,
    )


def gemm_variant(dtype: str, m: int, params: GemmParams, arch: str) -> Variant:
    return Variant.make(
        "gemm.cu",
        arch,
        TX_BF16=_bf16(dtype),
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
    ``splits`` CTAs per cluster (`geometry.gemm_wgmma_splits`); one variant serves every m (its
    tile is 64 rows)."""
    return Variant.make(
        "gemm_sm90.cu",
        wgmma_arch(arch),
        TX_BF16=_bf16(dtype),
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


def default_variants(info: DeviceInfo = H200) -> list[Variant]:
    """Every kernel variant the default tactics use on a GPU like ``info`` (what `warmup` compiles):
    prefill for each head dim, with persistent CTAs where the default takes them for batches of
    short work items; decode for each head dim, large and small batches; GEMM for 1, 2 and 4
    m-tiles."""
    out = []
    for dtype in sorted(_DTYPES):
        for d in HEAD_DIMS:
            prefill = default_prefill_params(d, info)
            out.append(prefill_variant(dtype, d, prefill, info.arch))
            persistent = prefill_default_persist(prefill, [1], d, info)  # batches of short work items
            if persistent != prefill:
                out.append(prefill_variant(dtype, d, persistent, info.arch))
            for small in (False, True):
                out.append(decode_variant(dtype, d, default_decode_params(d, info, small), info.arch))
        for m in (1, 32, GEMM_MAX_M):  # one m per m-tile count (1, 2, 4 tiles of 16 rows)
            out.append(gemm_params_variant(dtype, m, default_gemm_params(m, info), info))
    return list(dict.fromkeys(out))


def candidate_variants(info: DeviceInfo) -> list[Variant]:
    """Every variant any enumerated tactic compiles to (both dtypes, every head dim and GEMM
    m-tile count, GQA 1/4/8 for prefill): what tuning or ``python -m tactix_cuda_native --all``
    compiles."""
    out = list(default_variants(info))
    for dtype in sorted(_DTYPES):
        for d in HEAD_DIMS:
            out += [decode_variant(dtype, d, p, info.arch) for p in decode_candidates(d, info)]
            for gqa in (1, 4, 8):
                out += [prefill_variant(dtype, d, p, info.arch) for p in prefill_candidates(d, info, gqa)]
        for m in (1, 32, GEMM_MAX_M):
            out += [gemm_params_variant(dtype, m, p, info) for p in gemm_tactic_params(m, info)]
    return list(dict.fromkeys(out))


@tactix.hookimpl
def tactix_warmup(arch: str | None, progress: Callable[[int, int, str], None] | None) -> int | None:
    if arch is None:
        info = _info_for(None)
    else:
        base = _info_for(None)
        info = DeviceInfo(base.sms, base.smem_per_block, base.smem_per_sm, arch)
    return compile_all(default_variants(info), progress)


# -- plan metadata ---------------------------------------------------------------------------


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=64)
def _cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


def decode_sections(item_cap: int, page_cap: int | None) -> Sections:
    """Where a decode plan's int32 metadata lies in its staging slot: the work records
    (`geometry.decode_items`, ``item_cap`` of them), the item count and, unless the kernel reads
    the caller's device indices in place (``page_cap`` None), the page indices."""
    if page_cap is None:
        return sections(("items", DECODE_ITEM_INTS * item_cap), ("num_items", 1))
    return sections(("items", DECODE_ITEM_INTS * item_cap), ("num_items", 1), ("indices", page_cap))


def prefill_sections(item_cap: int, batch_cap: int, page_cap: int | None) -> Sections:
    """Where a prefill plan's int32 metadata lies in its staging slot: the work items (request,
    first token), the item count, four ints per request (`prefill_lists`) and, unless the kernel
    reads the caller's device indices in place (``page_cap`` None), the page indices."""
    parts = [("items", 2 * item_cap), ("num_items", 1), ("reqs", 4 * batch_cap)]
    if page_cap is not None:
        parts.append(("indices", page_cap))
    return sections(*parts)


class _StagedPlan:
    """What decode and prefill plans share: their int32 metadata in the wrapper's staging."""

    device: torch.device
    _staging: Staging  # the wrapper's metadata slots and pinned buffers (handed from plan to plan)
    _requested: Tactic  # the tactic this plan was made for (the default, or a tuned one)
    _graph: bool  # made for CUDA-graph mode
    problem: DecodeProblem | PrefillProblem
    _seen: tuple[Any, ...] | None  # the q, k and v strides run() last checked (`_accept`)
    _strides: tuple[int, ...]  # the cache stride arguments they gave
    _q_direct: bool  # q is read in place (else through a copy)
    _bulk = 0  # tokens per bulk copy of a decode plan's kernel (0: cp.async): _accept checks more

    def _inherit_accepted(self, previous: object) -> None:
        """Keep what the previous plan of the wrapper (same class, device and cache layout) found
        when it checked the run's strides, so that the first run after a re-plan does not check
        them again when they are the same (``run`` compares them on every call)."""
        if (
            isinstance(previous, _StagedPlan)
            and type(previous) is type(self)
            and previous._seen is not None
            and previous.device == self.device
            and previous.problem.kv_layout == self.problem.kv_layout
            and previous._bulk == self._bulk
        ):
            self._seen, self._strides, self._q_direct = previous._seen, previous._strides, previous._q_direct

    def replan(self, problem: Problem, batch: PagedBatch, options: PlanOptions) -> _StagedPlan | None:
        """The plan of a new batch with this plan's static problem and tactic (the core's fast
        re-plan, `tactix.selection.replan_selection`): made as the plugin's plan hook would make
        it, without the selection, the check and the hook dispatch in front of it. What
        ``tactix_check`` says depends on the static problem, the tactic and the device only, so
        it holds for every batch. None for another device or mode (the full path decides)."""
        if options["device"] != self.device or bool(options["use_cuda_graph"]) != self._graph:
            return None
        return type(self)(problem, batch, self._requested, {**options, "previous": self})  # type: ignore[call-arg]

    def _send(self, problem: Problem, batch: PagedBatch, previous: object, graph: bool,
              layout_for: Callable[[int | None], Sections], pieces: list[Piece],
              page_cap: int) -> tuple[Sections, int, int]:  # fmt: skip
        """Send the metadata: ``pieces`` (and the page indices, where the kernel does not read the
        caller's device indices in place: host indices, or any in CUDA-graph mode) written into a
        pinned buffer of the wrapper's staging (taken over from the previous plan, `tactix.staging`)
        with C-level copies, one transfer into a device slot. ``layout_for(page_cap or None)``:
        the sections. Returns the sections, the slot's device address and the indices' address.

        Eager plans alternate between the two slots, so the slot the previous plan's runs read is
        left alone; CUDA-graph plans keep slot 0, sized by the buckets, whose addresses the
        captured kernel reads (a re-plan of the same buckets rewrites it in place)."""
        host_indices = batch.indices_on_host
        copied = host_indices or graph
        layout = layout_for(page_cap if copied else None)
        if copied:
            pieces = [*pieces, batch.kv_indices if host_indices else []]
        old = previous._staging if isinstance(previous, _StagedPlan) else None
        staging = Staging.reuse(old, self.device, layout.total)
        if graph and previous is not None and staging is not old:
            raise UnsupportedProblemError(NAME, problem, [
                "in CUDA-graph mode a re-plan must keep the metadata buffer of the captured kernel"])  # fmt: skip
        slot = staging.slot(graph)
        base = staging.send(slot, layout.total, lambda dst: layout.write(dst, pieces))
        self._staging = staging
        if not copied:
            self._indices_ref = batch.kv_indices.contiguous()  # keep the caller's device indices alive
            return layout, base, self._indices_ref.data_ptr()
        at = layout.offset("indices")
        if not host_indices and batch.num_page_entries:  # device indices: after the transfer, on its stream
            staging.view(slot, at, batch.num_page_entries).copy_(batch.kv_indices, non_blocking=True)
        return layout, base, base + 4 * at


@dataclass(frozen=True)
class _Kernel:
    """A loaded kernel and what plans derive from its static parameters alone (device, dtype, head
    dim, tactic parameters): memoised, so a plan for a new batch of a seen problem loads nothing,
    hashes no source and asks the driver nothing."""

    kernel: Any
    smem: int
    threads: int
    ctas_per_sm: int
    tactic: Tactic
    persistent: int = 0  # prefill with persistent CTAs: the grid (prefill_persistent_ctas)


_kernels: dict[tuple[Any, ...], _Kernel] = {}


def _decode_kernel(index: int, dtype: str, d: int, params: DecodeParams, info: DeviceInfo) -> tuple[_Kernel, bool]:
    """The decode kernel of ``params`` on device ``index``, and whether NVRTC compiled it now."""
    smem = decode_smem_bytes(d, params.tile, params.warps, params.stages, params.bulk, params.tma)
    key = ("decode", index, dtype, d, params, info.arch)
    return _kernel(key, lambda: decode_variant(dtype, d, params, info.arch), "tactix_decode", smem, 32 * params.warps,
                   params, index, info)  # fmt: skip


def _prefill_kernel(index: int, dtype: str, d: int, params: PrefillParams, info: DeviceInfo) -> tuple[_Kernel, bool]:
    """The prefill kernel of ``params`` on device ``index``, and whether NVRTC compiled it now."""
    key = ("prefill", index, dtype, d, params, info.arch)
    return _kernel(key, lambda: prefill_variant(dtype, d, params, info.arch), "tactix_prefill", params.smem_bytes(d),
                   params.threads, params, index, info)  # fmt: skip


def _kernel(key: tuple[Any, ...], variant: Callable[[], Variant], name: str, smem: int, threads: int,
            params: DecodeParams | PrefillParams, index: int, info: DeviceInfo) -> tuple[_Kernel, bool]:  # fmt: skip
    found = _kernels.get(key)
    if found is not None:
        return found, False
    module, built = load(variant(), index)
    kernel = module.kernel(name, smem)
    ctas = ctas_per_sm(info, smem, threads, resident=resident_ctas(kernel, threads, smem))
    # prefill's persistent CTAs: as many as the GPU holds at once, each looping over the items
    persistent = prefill_persistent_ctas(info, ctas) if isinstance(params, PrefillParams) and params.persist else 0
    found = _kernels[key] = _Kernel(kernel, smem, threads, ctas, params.to_tactic(), persistent)
    return found, built


class _TensorMaps:
    """A plan's tensor maps (TMA descriptors), kept per key (a tensor's address and layout), the
    ``kept`` most recently used: a tensor that does not move (a weight, a KV cache) is encoded once,
    which costs microseconds of host time. A map depends on nothing but its key, so it stays valid
    for whatever tensor later lies at that address with that layout."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._maps: dict[tuple[Any, ...], Any] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def get(self, key: tuple[Any, ...], make: Callable[[], Any], argument: str) -> Any:
        found = self._maps.pop(key, None)
        if found is None:
            try:
                found = make()
            except (ValueError, RuntimeError) as exc:  # cuda.core refuses what the TMA unit cannot describe
                raise InvalidArgumentError(argument, "a tensor the tensor memory accelerator can describe "
                                           "(16-byte aligned, 16-byte strides)", str(exc)) from exc  # fmt: skip
            while len(self._maps) >= self.kept:
                self._maps.pop(next(iter(self._maps)))
        self._maps[key] = found  # the most recently used last
        return found


# -- decode plans ----------------------------------------------------------------------------


class CudaNativeDecodePlan(_StagedPlan):
    """A planned decode batch: work list, metadata and workspace on the device; ``run`` launches.

    The int32 metadata (`decode_sections`) travels in one transfer from a pinned buffer of the
    wrapper's `tactix.plugin.Staging` into one of its two device slots (`_StagedPlan._send`).
    """

    _part_o: torch.Tensor  # workspace: partial outputs of split requests
    _part_lse: torch.Tensor
    _counters: torch.Tensor  # one per request and (KV head, q tile): partials merged so far; zero between runs

    def __init__(self, problem: DecodeProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions) -> None:
        index = _device_index(options["device"])
        self.device = _cuda(index)
        self.problem = problem
        self._requested = tactic
        info = device_info(index)
        graph = options["use_cuda_graph"]
        self._graph = bool(graph)
        previous = options["previous"]
        b, hq, hkv, d = batch.batch_size, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk
        gqa = problem.gqa_ratio
        units = decode_units(hkv, gqa)
        ranges = effective_lengths(batch.kv_lens_list, problem.window_left)
        longest_cap = bucket_size(batch.max_kv_len) if graph else batch.max_kv_len
        attended_cap = longest_cap if problem.window_left < 0 else min(longest_cap, problem.window_left + 1)
        # in CUDA-graph mode sizes come from the bucket, so every batch of the bucket fits the captured grid
        lengths = [attended_cap] * b if graph else [e - s for s, e in ranges]
        if tactic.is_default:
            params = default_decode_params(d, info, small=decode_is_small(lengths, units, info))
        else:
            params = DecodeParams.from_tactic(tactic)
        kernel, self.built = _decode_kernel(index, problem.q_dtype, d, params, info)
        self.tactic = kernel.tactic
        self._kernel = kernel.kernel
        self.ctas_per_sm = kernel.ctas_per_sm
        slots = info.sms * self.ctas_per_sm
        chunk, work = decode_plan_work(ranges, lengths, units, slots, params, bool(graph))
        item_cap, slot_cap, page_cap = decode_buffer_sizes(
            work, batch.num_page_entries, graph=graph, batch=b, attended_cap=attended_cap, longest_cap=longest_cap,
            chunk=chunk, page_size=problem.page_size)  # fmt: skip
        self.work = work
        self.chunk = chunk
        self._geometry = (b, hq, hkv, d, problem.page_size, item_cap, slot_cap, page_cap, params)
        self._bulk = params.bulk
        self._tma = params.tma
        # the caches' tensor maps: a re-plan (every step of a server) shares its predecessor's
        maps = _TensorMaps(8)
        if isinstance(previous, CudaNativeDecodePlan) and previous.device == self.device:
            maps = previous._maps
        self._maps: _TensorMaps = maps
        replaced = previous if graph and previous is not None else None
        if replaced is not None and (
            not isinstance(replaced, CudaNativeDecodePlan) or replaced._geometry != self._geometry
        ):
            raise UnsupportedProblemError(NAME, problem, [
                "in CUDA-graph mode a re-plan must keep the batch size, the heads and the kv-length bucket "
                "(the captured grid and buffers depend on them); use one wrapper per captured shape"])  # fmt: skip

        layout, base, indices_ptr = self._send(problem, batch, previous, graph,
                                               functools.partial(decode_sections, item_cap),
                                               [decode_items(work, batch.kv_indptr_list), [len(work.items)]],
                                               page_cap)  # fmt: skip
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
        shift = log2_exact(problem.page_size)
        assert shift is not None  # check() refused other page sizes
        self._scalars = (hq, gqa, q_tiles(gqa), shift, problem.sm_scale * _LOG2E, float(problem.logits_soft_cap))
        self._cfg = launch_config(decode_grid(item_cap, hkv, gqa), kernel.threads, kernel.smem)
        self._index = index
        self._seen: tuple[Any, ...] | None = None
        self._strides: tuple[int, ...] = ()
        self._q_copy: torch.Tensor | None = None
        self._inherit_accepted(previous)

    def _accept(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Check the cache strides and q's once per new set of strides; keep the stride arguments."""
        self._strides = _cache_strides(self.problem.kv_layout, k, v)
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
            lse: torch.Tensor | None) -> None:  # fmt: skip
        if (q.stride(), k_cache.stride(), v_cache.stride()) != self._seen:
            self._accept(q, k_cache, v_cache)
        if not self._q_direct or q.data_ptr() % 16:
            if self._q_copy is None:
                self._q_copy = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._q_copy.copy_(q)
            q = self._q_copy
        k_ptr, v_ptr, out_ptr = k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
        if (k_ptr | v_ptr | out_ptr) % 16:
            raise InvalidArgumentError("paged_kv_cache", "k, v and out starting at 16-byte aligned addresses",
                                       f"addresses {k_ptr:#x}, {v_ptr:#x}, {out_ptr:#x}")  # fmt: skip
        lse_ptr = 0 if lse is None else lse.data_ptr()
        stream = stream_for(self._index, raw_stream(self._index))
        cc = _cc()
        args: tuple[Any, ...] = (q.data_ptr(), q.stride(0), q.stride(1), k_ptr, v_ptr, *self._strides, out_ptr, lse_ptr,
                                 *self._ptrs, *self._scalars)  # fmt: skip
        if self._tma:
            args = (self._cache_map(k_cache, "k"), self._cache_map(v_cache, "v"), *args)
        cc.launch(stream, self._cfg, self._kernel, *args)

    def _cache_map(self, t: torch.Tensor, name: str) -> Any:
        """The tensor map of a K or V cache ([pages][heads][tokens][D], HND), boxes of 64 of D x
        ``bulk`` tokens."""
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        return self._maps.get(key, lambda: tensor_map(t, (1, 1, self._bulk, 64)), f"paged_kv_cache ({name})")


def _cc() -> Any:
    module, why = cuda_core_status()
    if module is None:
        raise tactix.BackendUnavailableError(f"cuda_native: {why}")
    return module


def _plan_decode(problem: DecodeProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions) -> Any:
    reasons = _decode_reasons(problem, tactic, device_info(_device_index(options["device"])))
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudaNativeDecodePlan(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_decode(problem: DecodeProblem, batch: PagedBatch, tactic: Tactic,
                       options: PlanOptions) -> CudaNativeDecodePlan | None:  # fmt: skip
    plan: CudaNativeDecodePlan = _plan_decode(problem, batch, tactic, options)
    return plan


# -- prefill plans ---------------------------------------------------------------------------


def _cache_strides(layout: str, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """(page, token, head) strides of k then v, in elements; refuses what the kernels cannot read."""
    strides: list[int] = []
    for name, t in (("k", k), ("v", v)):
        s = t.stride()
        page, tok, head, dim = cache_axes(s, layout)
        if dim != 1 or page % 8 or tok % 8 or head % 8:
            raise InvalidArgumentError(
                f"paged_kv_cache ({name})",
                "dense along head_dim with page, token and head strides that are multiples of 8 elements",
                f"strides {tuple(s)}",
            )
        strides += [page, tok, head]
    return tuple(strides)


def prefill_lists(batch: PagedBatch, work: PrefillWork) -> tuple[list[int], list[int]]:
    """The kernel's int32 metadata as flat lists: per item (request, first token); per request
    (first q row, q length, kv length, first entry in the page indices)."""
    qo, kv = batch.qo_indptr_list, batch.kv_indptr_list
    reqs: list[int] = []
    for r in range(batch.batch_size):
        reqs += (qo[r], qo[r + 1] - qo[r], batch.kv_lens_list[r], kv[r])
    return [x for item in work.items for x in item], reqs


def prefill_scalars(problem: PrefillProblem, pack: int) -> tuple[int | float, ...]:
    """The kernel's scalar arguments after the pointers (see kernels/prefill.cu)."""
    shift = log2_exact(problem.page_size)
    assert shift is not None  # check() refused other page sizes
    hq = problem.num_qo_heads
    return (hq, problem.gqa_ratio, pack, hq // pack, shift, int(problem.causal), problem.window_left,
            problem.sm_scale * _LOG2E, float(problem.logits_soft_cap))  # fmt: skip


class CudaNativePrefillPlan(_StagedPlan):
    """A planned prefill batch: work list and metadata on the device; ``run`` launches one kernel.

    Work items are (request, first query token) pairs of ``q_tile // pack`` tokens each, ordered
    by `geometry.prefill_work` (requests by work, longest items first); each becomes one CTA per group of
    ``pack`` query heads. The int32 metadata (`prefill_sections`) travels in one transfer from a
    pinned buffer of the wrapper's `tactix.plugin.Staging` into one of its two device slots
    (`_StagedPlan._send`). In CUDA-graph mode every buffer has the capacity of the plan's buckets (batch size,
    query tokens, kv length: the next power of two), the grid is that capacity and a re-plan
    rewrites the buffers in place (slot 0).
    """

    params: PrefillParams  # the kernel's (the default's choice for this batch, where the tactic was the default)

    def __init__(self, problem: PrefillProblem, batch: PagedBatch, tactic: Tactic, options: PlanOptions) -> None:
        index = _device_index(options["device"])
        self.device = _cuda(index)
        self.problem = problem
        self._requested = tactic
        info = device_info(index)
        d = problem.head_dim_qk
        graph = options["use_cuda_graph"]
        self._graph = bool(graph)
        previous = options["previous"]
        params = default_prefill_params(d, info) if tactic.is_default else PrefillParams.from_tactic(tactic)
        b, hq, hkv, gqa = batch.batch_size, problem.num_qo_heads, problem.num_kv_heads, problem.gqa_ratio
        pack = prefill_pack(gqa, params.q_tile, params.pack)
        work = prefill_work(batch.qo_lens_list, batch.kv_lens_list, q_tile=params.q_tile, kv_tile=params.kv_tile,
                            pack=pack, causal=problem.causal, window_left=problem.window_left,
                            sched=params.sched)  # fmt: skip
        if tactic.is_default:  # persistent CTAs or not, by the batch (the captured kernel stays in graph mode)
            if graph and isinstance(previous, CudaNativePrefillPlan):
                params = previous.params
            else:
                params = prefill_default_persist(params, work.tiles, d, info)
        self.params = params
        kernel, self.built = _prefill_kernel(index, problem.q_dtype, d, params, info)
        self.tactic = kernel.tactic
        self._kernel = kernel.kernel
        self.work = work
        self.pack = pack
        if graph:  # capacities of the buckets, so every batch of them fits the captured grid
            b_cap = bucket_size(b)
            item_cap = prefill_capacity(b_cap, bucket_size(batch.num_qo_tokens), work.tokens)
            page_cap = b_cap * -(-bucket_size(batch.max_kv_len) // problem.page_size)
        else:
            b_cap, item_cap, page_cap = b, len(work.items), batch.num_page_entries
        self._scalars = prefill_scalars(problem, pack)
        self._geometry = (b_cap, hq, hkv, d, problem.page_size, item_cap, page_cap, params, self._scalars)
        replaced = previous if graph and previous is not None else None
        if replaced is not None and (
            not isinstance(replaced, CudaNativePrefillPlan) or replaced._geometry != self._geometry
        ):
            raise UnsupportedProblemError(NAME, problem, [
                "in CUDA-graph mode a re-plan must keep the heads, the scalars (causal, window, scale, "
                "soft-cap) and the buckets of the batch size, query tokens and kv length (the captured grid "
                "and buffers depend on them); use one wrapper per captured shape"])  # fmt: skip

        items, reqs = prefill_lists(batch, work)
        layout, base, indices_ptr = self._send(problem, batch, previous, graph,
                                               functools.partial(prefill_sections, item_cap, b_cap),
                                               [items, [len(work.items)], reqs], page_cap)  # fmt: skip
        self._ptrs = (base + 4 * layout.offset("items"), base + 4 * layout.offset("num_items"),
                      base + 4 * layout.offset("reqs"), indices_ptr)  # fmt: skip
        self._launch = graph or bool(work.items)
        self.grid = prefill_grid(item_cap, hq, pack, kernel.persistent)
        self._cfg = launch_config(self.grid, kernel.threads, kernel.smem)
        self._index = index
        self._seen: tuple[Any, ...] | None = None
        self._strides: tuple[int, ...] = ()
        self._q_copy: torch.Tensor | None = None
        self._inherit_accepted(previous)

    def _accept(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Check the cache strides and q's once per new set of strides; keep the stride arguments."""
        self._strides = _cache_strides(self.problem.kv_layout, k, v)
        self._q_direct = q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
        self._seen = (q.stride(), k.stride(), v.stride())

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None) -> None:  # fmt: skip
        if (q.stride(), k_cache.stride(), v_cache.stride()) != self._seen:
            self._accept(q, k_cache, v_cache)
        if not self._q_direct or q.data_ptr() % 16:
            if self._q_copy is None:
                self._q_copy = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._q_copy.copy_(q)
            q = self._q_copy
        k_ptr, v_ptr, out_ptr = k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
        if (k_ptr | v_ptr | out_ptr) % 16:
            raise InvalidArgumentError("paged_kv_cache", "k, v and out starting at 16-byte aligned addresses",
                                       f"addresses {k_ptr:#x}, {v_ptr:#x}, {out_ptr:#x}")  # fmt: skip
        if not self._launch:  # no query rows at all
            return
        lse_ptr = 0 if lse is None else lse.data_ptr()
        stream = stream_for(self._index, raw_stream(self._index))
        items, num_items, reqs, indices = self._ptrs
        _cc().launch(stream, self._cfg, self._kernel, q.data_ptr(), q.stride(0), q.stride(1), k_ptr, v_ptr,
                     *self._strides, out_ptr, lse_ptr, items, num_items, reqs, indices, *self._scalars)  # fmt: skip


@tactix.hookimpl
def tactix_plan_prefill(problem: PrefillProblem, batch: PagedBatch, tactic: Tactic,
                        options: PlanOptions) -> CudaNativePrefillPlan | None:  # fmt: skip
    reasons = _prefill_reasons(problem, tactic, device_info(_device_index(options["device"])))
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudaNativePrefillPlan(problem, batch, tactic, options)


# -- GEMM plans ------------------------------------------------------------------------------


def gemm_params_of(tactic: Tactic) -> GemmParams | GemmWgmmaParams:
    """The parameters of a checked, non-default GEMM tactic of either kernel."""
    if tactic.kernel == "gemm_wgmma":
        return GemmWgmmaParams.from_tactic(tactic)
    return GemmParams.from_tactic(tactic)


def gemm_tma_view(t: torch.Tensor, problem: GemmProblem, rows: int, ld: int, sb: int) -> torch.Tensor:
    """A k-contiguous GEMM operand (a, or W through b's [k, n] view) as the 3-D [batch][rows][k]
    its tensor map describes: row stride ``ld``, batch stride ``sb`` (unbatched: any multiple of
    16 bytes, the map's one batch never steps)."""
    batch_stride = sb if problem.batched else rows * ld
    return t.as_strided((problem.batch, rows, problem.k), (batch_stride, ld, 1))


class CudaNativeGemmPlan:
    """A planned skinny GEMM: split count and workspace fixed in plan; ``run`` launches one kernel."""

    def __init__(self, problem: GemmProblem, tactic: Tactic, options: PlanOptions) -> None:
        index = _device_index(options["device"])
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
        self._index = index
        self._maps: _TensorMaps = _TensorMaps(16)

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
        cc = _cc()
        ws = 0 if self._ws is None else self._ws.data_ptr()
        counters = 0 if self._counters is None else self._counters.data_ptr()
        args: tuple[Any, ...] = (a_ptr, lda, a_sb, b_ptr, ldb, b_sb, out_ptr, p.m * p.n, bias_ptr, ws, counters, p.m,
                                 p.n, p.k, self.kps)  # fmt: skip
        if self._tma:
            wmap = self._tensor_map(b, "b", p.n, ldb, b_sb, self._tma_bw)
            amap = self._tensor_map(a, "a", p.m, lda, a_sb, 64) if self._tma == 2 else wmap  # (tma 1: not read)
            args = (wmap, amap, *args)
        cc.launch(stream, self._cfg, self._kernel, *args)


@tactix.hookimpl
def tactix_plan_gemm(problem: GemmProblem, tactic: Tactic,
                     options: PlanOptions) -> CudaNativeGemmPlan | None:  # fmt: skip
    reasons = _gemm_reasons(problem, tactic, device_info(_device_index(options["device"])))
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudaNativeGemmPlan(problem, tactic, options)
