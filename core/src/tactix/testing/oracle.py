"""A float64 oracle for paged and ragged-KV attention and GEMM, and the tolerances results are held to.

Written plainly on purpose: a loop over requests, pages concatenated one by one, masks built
from explicit positions, float64 throughout. It shares no code with any backend (the built-in
torch backend included), so a bug there cannot hide here. It runs on whatever device the
inputs are on.
"""

from __future__ import annotations

import math
from typing import Any, Final

import torch

from tactix.layouts import cache_axes

__all__ = [
    "FP8_KV_TOLERANCE",
    "LSE_TOLERANCE",
    "TOLERANCE",
    "attention_lse_tolerance",
    "attention_reference",
    "attention_tolerance",
    "gemm_reference",
    "lse_error",
    "merge_reference",
    "ragged_reference",
    "relative_error",
    "tolerance_for",
]

TOLERANCE: Final[dict[str, float]] = {
    "float32": 1e-5,
    "float16": 2e-3,
    "bfloat16": 1e-2,
    "float8_e4m3fn": 1e-3,
    "float8_e5m2": 1e-3,
}
"""Largest relative error ``||out - ref|| / ||ref||`` accepted, by the dtypes involved.

float32: the oracle's float64 against float32 arithmetic (well under 1e-5 for these sizes).
float16 / bfloat16: rounding the output alone costs about 2^-11 / 2^-8 per element; the bound
leaves room for reduced-precision intermediates (P in 16 bits before P @ V, for instance).
fp8 operands are exact in the oracle, but Hopper's fp8 tensor cores accumulate with fewer bits
than float32 (cuBLAS fp8 GEMM into float32 measured 1.0e-4 on an H200 at k=128), so a float32
result from fp8 operands is held to 1e-3.
"""

LSE_TOLERANCE: Final[dict[str, float]] = {
    "float32": 1e-5,
    "float16": 2e-3,
    "bfloat16": 2e-3,
}
"""Largest ``|lse - ref| / max(1, |ref|)`` accepted, by query dtype (LSE is float32 always)."""


FP8_KV_TOLERANCE: Final[dict[str, float]] = {
    "float8_e4m3fn": 0.05,
    "float8_e5m2": 0.1,
}
"""Largest relative error (of the output; of the LSE as for `LSE_TOLERANCE`) of attention over an
fp8 KV cache, by cache dtype.

The oracle reads the fp8 values exactly, so the cache itself costs nothing; what a kernel may
legitimately lose is in the arithmetic it does *at fp8 precision*: fp8 tensor cores (Hopper's
XQA and FA3 fp8 paths) round q to the cache's format for q . k and the probabilities P for
P @ V. Each rounding to a format with m mantissa bits has a relative error uniform in
+-2^-(m+1), RMS 2^-(m+1)/sqrt(3); two independent ones give sqrt(2) times that in the norm of
the output: e4m3 (m = 3) 0.051, e5m2 (m = 2) 0.102. The bounds are those, rounded to 0.05 and
0.1. A kernel that converts the cache to 16 bits and computes as for a 16-bit cache is held to
the same bound (the kit cannot see which arithmetic a kernel does); such kernels measure about
2e-3 (the torch backend, bf16 queries), which the report's numbers show.
"""


def attention_tolerance(q_dtype: torch.dtype | str, kv_dtype: torch.dtype | str, out_dtype: torch.dtype | str) -> float:
    """The output tolerance of attention with these dtypes (an fp8 cache: `FP8_KV_TOLERANCE`)."""
    kv = str(kv_dtype).removeprefix("torch.")
    base = tolerance_for(out_dtype, q_dtype, *(() if kv in FP8_KV_TOLERANCE else (kv,)))
    return max(base, FP8_KV_TOLERANCE.get(kv, 0.0))


def attention_lse_tolerance(q_dtype: torch.dtype | str, kv_dtype: torch.dtype | str) -> float:
    """The LSE tolerance of attention with these dtypes (an fp8 cache: `FP8_KV_TOLERANCE`)."""
    q, kv = str(q_dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch.")
    return max(LSE_TOLERANCE[q], FP8_KV_TOLERANCE.get(kv, 0.0))


def tolerance_for(*dtypes: torch.dtype | str) -> float:
    """The tolerance for a result computed from and into these dtypes: the loosest of them.

    A float32 output computed from bf16 inputs may carry bf16 rounding (a kernel may keep P in
    bf16 for P @ V), so it is held to the bf16 bound; likewise fp8 operands (see `TOLERANCE`).
    """
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return max(TOLERANCE[n] for n in names if n in TOLERANCE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; ``inf`` if ``out`` holds a NaN or an infinity."""
    out64 = out.detach().to(ref.device, torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    denom = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(out64 - ref))
    return diff / denom if denom > 0 else diff


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|lse - ref| / max(1, |ref|)``; ``inf`` if ``lse`` holds a NaN, or an infinity
    where ``ref`` is finite. A row that attends no key (a custom mask's) has ``ref`` -inf, and
    ``lse`` must be -inf there too."""
    lse64 = lse.detach().to(ref.device, torch.float64)
    empty = torch.isneginf(ref)
    if not bool((torch.isneginf(lse64) == empty).all()):
        return math.inf
    lse64, ref = lse64[~empty], ref[~empty]
    if not bool(torch.isfinite(lse64).all()):
        return math.inf
    return float(((lse64 - ref).abs() / ref.abs().clamp(min=1.0)).max()) if ref.numel() else 0.0


def _request_pages(cache: torch.Tensor, pages: list[int], kv_layout: str) -> torch.Tensor:
    """Concatenate a request's pages into ``[tokens, heads, dim]``."""
    parts = []
    for page in pages:
        block = cache[page]
        if kv_layout == "HND":  # [heads, page_size, dim] -> [page_size, heads, dim]
            block = block.permute(1, 0, 2)
        parts.append(block)
    return torch.cat(parts, dim=0).to(torch.float64)


def attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str,
    causal: bool,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    custom_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention in float64: returns ``out [rows, qo_heads, dim_vo]`` and ``lse [rows, qo_heads]``.

    ``custom_mask`` (bool, FlashInfer's flattened layout: each request's ``q_len x kv_len``
    matrix, row-major, one after another) restricts the keys each row attends, with the window;
    a row left no key gives zeros and an LSE of -inf.

    Decode is the case ``qo_indptr = [0, 1, ..., batch]`` with ``causal=False``. The LSE is the
    natural-log log-sum-exp of the scaled, soft-capped logits over the attended keys. ``k_scale``
    and ``v_scale`` dequantize the cache: logits are ``(q . k) * k_scale * sm_scale``, values ``v * v_scale``.
    ``sinks`` (``[qo_heads]``): one more logit per head in every row's softmax, with no value; the
    LSE includes it.
    """
    qo = [int(x) for x in qo_indptr.tolist()]
    kv = [int(x) for x in kv_indptr.tolist()]
    indices = [int(x) for x in kv_indices.tolist()]
    last = [int(x) for x in kv_last_page_len.tolist()]
    sizes = cache_axes(k_cache.shape, kv_layout)
    page_size = sizes.token
    out, lse = _empty_outputs(q, v_cache.shape[-1])
    mask_start = 0
    for r in range(len(last)):
        pages = indices[kv[r] : kv[r + 1]]
        kv_len = (len(pages) - 1) * page_size + last[r]
        k = _request_pages(k_cache, pages, kv_layout)[:kv_len]  # [kv_len, kv_heads, d]
        v = _request_pages(v_cache, pages, kv_layout)[:kv_len]
        q_len = qo[r + 1] - qo[r]
        mask = None
        if custom_mask is not None:
            mask = custom_mask[mask_start : mask_start + q_len * kv_len].to(q.device).view(q_len, kv_len)
            mask_start += q_len * kv_len
        out[qo[r] : qo[r + 1]], lse[qo[r] : qo[r + 1]] = _attend(
            q[qo[r] : qo[r + 1]], k, v, causal=causal, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale, mask=mask, sinks=sinks,
        )  # fmt: skip
    return out, lse


def ragged_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged-KV attention in float64: request ``r``'s query rows ``qo_indptr[r]:qo_indptr[r + 1]``
    attend its rows ``kv_indptr[r]:kv_indptr[r + 1]`` of ``k`` ``[kv_tokens, kv_heads, dim_qk]`` and
    ``v`` ``[kv_tokens, kv_heads, dim_vo]``. Returns ``out [rows, qo_heads, dim_vo]`` and ``lse
    [rows, qo_heads]``, masked and scaled as `attention_reference`."""
    qo = [int(x) for x in qo_indptr.tolist()]
    kv = [int(x) for x in kv_indptr.tolist()]
    out, lse = _empty_outputs(q, v.shape[-1])
    for r in range(len(qo) - 1):
        out[qo[r] : qo[r + 1]], lse[qo[r] : qo[r + 1]] = _attend(
            q[qo[r] : qo[r + 1]], k[kv[r] : kv[r + 1]].to(torch.float64), v[kv[r] : kv[r + 1]].to(torch.float64),
            causal=causal, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
            k_scale=k_scale, v_scale=v_scale, mask=None, sinks=sinks,
        )  # fmt: skip
    return out, lse


def _empty_outputs(q: torch.Tensor, dim_vo: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, qo_heads, _ = q.shape
    out = torch.zeros(rows, qo_heads, dim_vo, dtype=torch.float64, device=q.device)
    lse = torch.zeros(rows, qo_heads, dtype=torch.float64, device=q.device)
    return out, lse


def _attend(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    window_left: int,
    logits_soft_cap: float,
    k_scale: float,
    v_scale: float,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: its query rows ``[q_len, qo_heads, d]`` over its keys and values ``[kv_len,
    kv_heads, d]`` (float64), the query rows being the last ``q_len`` positions (bottom-right)."""
    qo_heads, kv_heads = q_rows.shape[1], k.shape[1]
    head_map = torch.arange(qo_heads, device=q_rows.device) // (qo_heads // kv_heads)
    k, v = k[:, head_map], v[:, head_map]  # one K/V head per query head
    q_rows = q_rows.to(torch.float64)
    q_len, kv_len = q_rows.shape[0], k.shape[0]
    logits = torch.einsum("qhd,khd->hqk", q_rows, k) * (k_scale * sm_scale)
    if logits_soft_cap > 0:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    position = torch.arange(q_len, device=q_rows.device) + (kv_len - q_len)  # bottom-right
    key = torch.arange(kv_len, device=q_rows.device)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=q_rows.device)
    if causal:
        allowed &= key[None, :] <= position[:, None]
    if window_left >= 0:
        allowed &= key[None, :] >= position[:, None] - window_left
    if mask is not None:
        allowed &= mask
    logits = logits.masked_fill(~allowed, -math.inf)
    row_lse = torch.logsumexp(logits, dim=-1)  # [heads, q_len]
    if sinks is not None:  # the sink joins the denominator: log(exp(lse) + exp(sink))
        row_lse = torch.logaddexp(row_lse, sinks.to(device=q_rows.device, dtype=torch.float64)[:, None])
    probs = torch.exp(logits - row_lse[..., None]).masked_fill(~allowed, 0.0)  # a row with no key: zeros
    out = torch.einsum("hqk,khd->qhd", probs, v.to(torch.float64)) * v_scale
    return out, row_lse.transpose(0, 1)


def gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scale_a * scale_b * (a @ b) + bias`` in float64, from the operands as stored."""
    result = torch.matmul(a.to(torch.float64), b.to(torch.float64))
    if scale_a is not None:
        result = result * scale_a.to(torch.float64).reshape(())
    if scale_b is not None:
        result = result * scale_b.to(torch.float64).reshape(())
    if bias is not None:
        result = result + bias.to(torch.float64)
    return result


def merge_reference(vs: Any, ss: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of attention states ``(vs[i], ss[i])`` in float64: ``s = log(sum exp(s_i))``,
    ``v = sum v_i exp(s_i - s)``; rows whose states are all over no key give zeros and -inf."""
    v = torch.stack([x.detach().to("cpu", torch.float64) for x in vs])
    s = torch.stack([x.detach().to("cpu", torch.float64) for x in ss])
    merged_s = torch.logsumexp(s, dim=0)
    finite = torch.isfinite(merged_s)
    weights = torch.where(finite, torch.exp(s - torch.where(finite, merged_s, 0.0)), 0.0)
    return (v * weights.unsqueeze(-1)).sum(dim=0), merged_s
