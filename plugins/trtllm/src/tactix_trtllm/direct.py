"""flashinfer's public TensorRT-LLM entry points called by hand, without tactix: the reference
``tactix bench`` times the plugin against, and the GPU tests compare the plugin with bit for bit.

Written the way a flashinfer user would call them for one batch (sharing no code with the
plugin's metadata conversion): the block table and lengths built with torch ops, XQA through
``flashinfer.decode.trtllm_batch_decode_with_kv_cache(..., backend="xqa")``, FMHAv2 through
``flashinfer.prefill.trtllm_fmha_v2_prefill`` over a stacked ``[pages, 2, heads, page, dim]``
copy of the cache (the form whose page table it takes as is), made once, outside the timed call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tactix_trtllm.library import flashinfer

__all__ = ["attention_references"]

WORKSPACE_BYTES = 128 << 20  # what flashinfer's own examples allocate


def attention_references(op: str, inputs: dict[str, Any]) -> list[tuple[str, Callable[[], object]]]:
    """One call for ``op`` over the HND cache in ``inputs`` (see the ``tactix_references`` hookspec)."""
    q, k, v, out = inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["out"]
    device = q.device
    indptr = inputs["kv_indptr"].long()
    indices = inputs["kv_indices"].long()
    last = inputs["kv_last_page_len"].long()
    page = k.shape[2]
    counts = indptr[1:] - indptr[:-1]
    lens = (counts - 1) * page + last
    batch = len(counts)
    width = int(counts.max())
    table = torch.zeros(batch, width, dtype=torch.int32)
    for r in range(batch):
        table[r, : int(counts[r])] = indices[int(indptr[r]) : int(indptr[r + 1])].int()
    table = table.to(device)
    seq_lens = lens.to(device, torch.int32)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    scale = float(inputs["sm_scale"])
    # an fp8 cache's scales, as flashinfer takes them: bmm1 = sm_scale * k_scale, bmm2 = v_scale
    k_scale, v_scale = (float(inputs[n]) if n in inputs else 1.0 for n in ("k_scale", "v_scale"))
    if op == "decode":
        if q.shape[0] != batch:
            return []  # a multi-token decode step: XQA is called here for one row per request
        decode = flashinfer("decode")

        window, sinks = int(inputs.get("window_left", -1)), inputs.get("sinks")  # (gpt-oss: both)

        def call_xqa() -> object:
            return decode.trtllm_batch_decode_with_kv_cache(
                q, (k, v), workspace, table, seq_lens, int(lens.max()), bmm1_scale=scale * k_scale,
                bmm2_scale=v_scale, out=out, kv_layout="HND", backend="xqa", window_left=window, sinks=sinks,
            )  # fmt: skip

        return [("XQA (flashinfer.decode.trtllm_batch_decode_with_kv_cache, backend='xqa')", call_xqa)]
    if k.dtype != q.dtype:
        return []  # FMHAv2 takes q, k and v of one dtype (see the plugin's README)
    if int(inputs.get("window_left", -1)) >= 0 or inputs.get("sinks") is not None:
        return []  # this call passes neither a window nor sinks: no reference for such a case
    prefill = flashinfer("prefill")
    stacked = torch.stack([k, v], dim=1)
    qo = inputs["qo_indptr"].long()
    cum_q = qo.to(device, torch.int32)
    cum_kv = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(device, torch.int32)
    max_q = int((qo[1:] - qo[:-1]).max())
    mask = "causal" if inputs["causal"] else "padding"

    def call_fmha() -> object:
        return prefill.trtllm_fmha_v2_prefill(
            (q, stacked), "Q_PAGED_KV_HND", workspace, seq_lens, max_q, int(lens.max()), scale, 1.0, batch,
            cum_q, cum_kv, block_tables=table, out=out, mask_mode=mask,
        )  # fmt: skip

    return [("FMHAv2 (flashinfer.prefill.trtllm_fmha_v2_prefill, Q_PAGED_KV_HND)", call_fmha)]
