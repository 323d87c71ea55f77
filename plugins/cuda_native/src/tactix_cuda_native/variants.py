"""Every kernel variant the backend compiles ahead of time: the default tactics' (`default_variants`:
``tactix warmup cuda_native``) and every enumerated tactic's (`candidate_variants`: ``python -m
tactix_cuda_native --all``), over the ops' modules.
"""

from __future__ import annotations

from tactix_cuda_native.decode import decode_candidates, decode_plan_variant, decode_variant, default_decode_params
from tactix_cuda_native.device import H200, WGMMA_ARCHS, DeviceInfo
from tactix_cuda_native.gemm import GEMM_MAX_M, default_gemm_params, gemm_params_variant, gemm_tactic_params
from tactix_cuda_native.kernel import DTYPES
from tactix_cuda_native.merge import MERGE_TYPES, merge_variant
from tactix_cuda_native.paged import FP8_KV_DTYPES, HEAD_DIMS
from tactix_cuda_native.prefill import (
    default_prefill_params,
    prefill_candidates,
    prefill_default_persist,
    prefill_variant,
)
from tactix_cuda_native.runtime import Variant

__all__ = ["candidate_variants", "default_variants", "fp8_decode_variants"]


def default_variants(info: DeviceInfo = H200) -> list[Variant]:
    """Every kernel variant the default tactics use on a GPU like ``info`` (what `warmup` compiles):
    prefill for each head dim, with persistent CTAs where the default takes them for batches of
    short work items, and DeepSeek's 192/128 (on Hopper also in the ragged form, K and V through tensor
    maps: `prefill.ragged_tma`); decode for each head dim, large and small batches, over 16-bit and fp8
    caches (`fp8_decode_variants`), and the decode plan's work-list kernel; GEMM for 1, 2 and 4 m-tiles;
    the state merge for each of its dtypes."""
    out = [decode_plan_variant(info.arch), *(merge_variant(t, info.arch) for t in sorted(MERGE_TYPES))]
    for dtype in sorted(DTYPES):
        for d in HEAD_DIMS:
            prefill = default_prefill_params(d, info)
            out.append(prefill_variant(dtype, d, prefill, info.arch))
            persistent = prefill_default_persist(prefill, [1], d, info)  # batches of short work items
            if persistent != prefill:
                out.append(prefill_variant(dtype, d, persistent, info.arch))
            for small in (False, True):
                out.append(decode_variant(dtype, d, default_decode_params(d, info, small), info.arch))
        # DeepSeek's prefill (q/k 192, v/o 128): on Hopper the wgmma kernel with its own dims (TX_DVO), over
        # paged caches and over ragged K and V (TX_KV_TMA, where ragged prefill runs it); elsewhere the
        # mma.sync kernel of 256, zero-filled (prefill.kernel_head_dim)
        if info.arch in WGMMA_ARCHS:
            deepseek = default_prefill_params(192, info, "wgmma", head_dim_vo=128)  # (never persistent)
            for kv_tma in (False, True):
                out.append(prefill_variant(dtype, 192, deepseek, info.arch, dims=(192, 128), kv_tma=kv_tma))
        else:
            out.append(prefill_variant(dtype, 256, default_prefill_params(256, info, "sync"), info.arch,
                                       dims=(192, 128)))  # fmt: skip
        for m in (1, 32, GEMM_MAX_M):  # one m per m-tile count (1, 2, 4 tiles of 16 rows)
            out.append(gemm_params_variant(dtype, m, default_gemm_params(m, info), info))
    return list(dict.fromkeys(out + fp8_decode_variants(info)))


def fp8_decode_variants(info: DeviceInfo = H200) -> list[Variant]:
    """The decode variants of the default tactics for fp8 KV caches (each fp8 dtype under bf16 and
    fp16 q, every head dim, large and small batches); part of `default_variants`."""
    out = []
    for dtype in sorted(DTYPES):
        for kv in sorted(FP8_KV_DTYPES):
            for d in HEAD_DIMS:
                for small in (False, True):
                    out.append(decode_variant(dtype, d, default_decode_params(d, info, small, fp8=True), info.arch, kv))
    return list(dict.fromkeys(out))


def candidate_variants(info: DeviceInfo) -> list[Variant]:
    """Every variant any enumerated tactic compiles to (both dtypes, every head dim and GEMM
    m-tile count, GQA 1/4/8 for prefill): what tuning or ``python -m tactix_cuda_native --all``
    compiles."""
    out = list(default_variants(info))
    for dtype in sorted(DTYPES):
        for d in HEAD_DIMS:
            out += [decode_variant(dtype, d, p, info.arch) for p in decode_candidates(d, info)]
            for gqa in (1, 4, 8):
                out += [prefill_variant(dtype, d, p, info.arch) for p in prefill_candidates(d, info, gqa)]
        for m in (1, 32, GEMM_MAX_M):
            out += [gemm_params_variant(dtype, m, p, info) for p in gemm_tactic_params(m, info)]
    return list(dict.fromkeys(out))
