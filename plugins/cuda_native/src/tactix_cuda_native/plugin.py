"""tactix hooks for the ``cuda_native`` backend: paged prefill and decode attention, ragged-KV prefill
and skinny GEMM, in the project's own CUDA.

This module declares the backend (`tactix_backends`: its capabilities and preferences) and implements
the hooks, each handing the work to the op's module: `tactix_cuda_native.decode`,
`tactix_cuda_native.prefill` and `tactix_cuda_native.gemm` own their tactic parameters, geometry,
kernel variants, reasons, tactic spaces, defaults and plans (their docstrings describe the tactics),
and `tactix_cuda_native.ragged` serves ragged-KV prefill through the prefill plans (one-token pages);
`device`, `kernel`, `paged` and `tactics` hold what more than one op uses, `runtime` compiles,
caches and loads the kernels, `variants` lists what `tactix_warmup` compiles.

The default tactic is each op's heuristic for the problem and the GPU. Plans do all host work — the
work list, the device metadata in one transfer, the workspace — and ``run`` only launches one
kernel: split work (decode's split-KV, GEMM's split-K) is combined by the CTA that finishes last,
in a fixed order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch

import tactix
from tactix import (
    DecodeProblem,
    GemmProblem,
    MergeProblem,
    PagedBatch,
    PlanOptions,
    PrefillProblem,
    Problem,
    RaggedBatch,
    RaggedPrefillProblem,
    Tactic,
)
from tactix.plugin import compute_capability
from tactix_cuda_native import NAME, __version__, decode, gemm, merge, prefill, ragged
from tactix_cuda_native.device import DeviceInfo, info_for
from tactix_cuda_native.kernel import DTYPES
from tactix_cuda_native.paged import FP8_KV_DTYPES, HEAD_DIMS
from tactix_cuda_native.runtime import compile_all, cuda_core_status
from tactix_cuda_native.variants import default_variants

_PAGE_SIZES: Final = frozenset(1 << i for i in range(8))  # 1 .. 128
_CCS: Final = frozenset({"8.0", "8.6", "8.9", "9.0"})

_DECODE = tactix.AttentionCapabilities(
    devices=frozenset({"cuda"}),
    compute_capabilities=_CCS,
    q_dtypes=DTYPES,
    kv_dtypes=DTYPES | frozenset(FP8_KV_DTYPES),
    out_dtypes=DTYPES,
    head_dims=frozenset(HEAD_DIMS),
    page_sizes=_PAGE_SIZES,
    kv_layouts=frozenset({"NHD", "HND"}),
    max_gqa_ratio=None,
    sliding_window=True,
    logits_soft_cap=True,
    lse=True,
    cuda_graph="fixed_buffers",
    # an fp8 cache's dequantization scales; attention sinks (folded into each row's softmax)
    run_extras=frozenset({"k_scale", "v_scale", "sinks"}),
)

_PREFILL = tactix.AttentionCapabilities(
    devices=frozenset({"cuda"}),
    compute_capabilities=_CCS,
    q_dtypes=DTYPES,
    kv_dtypes=DTYPES | frozenset(FP8_KV_DTYPES),  # fp8: the mma.sync kernel (tactics with mma 'wgmma' refuse it)
    out_dtypes=DTYPES,
    # and 192 (DeepSeek's q/k dim), any two of them for q/k and v/o: the mma.sync kernel zero-fills
    # the rows to the next kernel dim (prefill.kernel_head_dim; tactics with mma 'wgmma' refuse it)
    head_dims=frozenset(HEAD_DIMS) | {192},
    different_vo_head_dim=True,
    page_sizes=_PAGE_SIZES,
    kv_layouts=frozenset({"NHD", "HND"}),
    max_gqa_ratio=None,
    causal=True,
    non_causal=True,
    chunked=True,
    custom_mask=True,  # the mma.sync kernel (TX_MASK); tactics with mma 'wgmma' refuse it
    keyless_rows=True,  # causal rows before a request's first key: both kernels give zeros, LSE -inf
    sliding_window=True,
    logits_soft_cap=True,
    lse=True,
    cuda_graph="fixed_buffers",
    # dequantization scales and attention sinks (every prefill kernel applies them)
    run_extras=frozenset({"k_scale", "v_scale", "sinks"}),
)

_RAGGED = tactix.RaggedPrefillCapabilities.model_validate(
    {name: value for name, value in _PREFILL.model_dump().items()
     if name in tactix.RaggedPrefillCapabilities.model_fields}
)  # fmt: skip
"""Ragged-KV prefill: what paged prefill declares (no pages, no custom masks), served by the same
kernels over one-token pages (`tactix_cuda_native.ragged`)."""

_GEMM = tactix.GemmCapabilities(
    devices=frozenset({"cuda"}),
    compute_capabilities=_CCS,
    dtypes=frozenset(tactix.GemmDTypes(a=t, b=t, out=t) for t in DTYPES),
    a_m_major=False,
    b_n_major=False,
    bias=True,
    batched=True,
    max_m=gemm.GEMM_MAX_M,
    cuda_graph="fixed_buffers",
)


_MERGE: Final = tactix.MergeCapabilities(
    devices=frozenset({"cuda"}),
    compute_capabilities=_CCS,
    v_dtypes=frozenset(merge.MERGE_TYPES),
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
            ragged_prefill=_RAGGED,
            gemm=_GEMM,
            merge_states=_MERGE,
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


def _reasons(problem: Problem | RaggedPrefillProblem | MergeProblem, tactic: Tactic, info: DeviceInfo) -> list[str]:
    if isinstance(problem, MergeProblem):
        return merge.merge_reasons(problem, tactic)
    if isinstance(problem, RaggedPrefillProblem):
        return prefill.prefill_reasons(problem.as_paged_prefill(), tactic, info)
    if isinstance(problem, PrefillProblem):
        return prefill.prefill_reasons(problem, tactic, info)
    if isinstance(problem, DecodeProblem):
        return decode.decode_reasons(problem, tactic, info)
    return gemm.gemm_reasons(problem, tactic, info)


@tactix.hookimpl
def tactix_check(problem: Problem | RaggedPrefillProblem | MergeProblem, tactic: Tactic,
                 batch: PagedBatch | RaggedBatch | None) -> list[str] | None:  # fmt: skip
    return _reasons(problem, tactic, info_for(None))


@tactix.hookimpl
def tactix_tactics(problem: Problem | RaggedPrefillProblem | MergeProblem) -> list[Tactic] | None:
    info = info_for(None)
    if isinstance(problem, MergeProblem):
        return [merge.MERGE_TACTIC]
    if isinstance(problem, RaggedPrefillProblem):
        return prefill.prefill_tactics(problem.as_paged_prefill(), info)
    if isinstance(problem, PrefillProblem):
        return prefill.prefill_tactics(problem, info)
    if isinstance(problem, DecodeProblem):
        return decode.decode_tactics(problem, info)
    if isinstance(problem, GemmProblem):
        return gemm.gemm_tactics(problem, info)
    return []


@tactix.hookimpl
def tactix_warmup(arch: str | None, progress: Callable[[int, int, str], None] | None) -> int | None:
    info = info_for(None)
    if arch is not None:
        info = DeviceInfo(info.sms, info.smem_per_block, info.smem_per_sm, arch)
    return compile_all(default_variants(info), progress)


@tactix.hookimpl
def tactix_plan_decode(problem: DecodeProblem, batch: PagedBatch, tactic: Tactic,
                       options: PlanOptions) -> decode.CudaNativeDecodePlan | None:  # fmt: skip
    return decode.plan_decode(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_prefill(problem: PrefillProblem, batch: PagedBatch, tactic: Tactic,
                        options: PlanOptions) -> prefill.CudaNativePrefillPlan | None:  # fmt: skip
    return prefill.plan_prefill(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_ragged_prefill(problem: RaggedPrefillProblem, batch: RaggedBatch, tactic: Tactic,
                               options: PlanOptions) -> ragged.CudaNativeRaggedPrefillPlan | None:  # fmt: skip
    return ragged.plan_ragged_prefill(problem, batch, tactic, options)


@tactix.hookimpl
def tactix_plan_gemm(problem: GemmProblem, tactic: Tactic,
                     options: PlanOptions) -> gemm.CudaNativeGemmPlan | None:  # fmt: skip
    return gemm.plan_gemm(problem, tactic, options)


@tactix.hookimpl
def tactix_plan_merge_states(problem: MergeProblem, tactic: Tactic,
                             options: PlanOptions) -> merge.CudaNativeMergePlan | None:  # fmt: skip
    return merge.plan_merge(problem, tactic, options)
