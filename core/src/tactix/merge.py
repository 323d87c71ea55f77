"""Merging attention states: two (or more) partial attention outputs over disjoint key sets, each
with its log-sum-exp, into the attention over their union.

This is how a prefill over a cached prefix and its new tokens (or over the parts of a split KV)
combines exactly: with ``(v_a, s_a)`` the output and LSE over keys A and ``(v_b, s_b)`` over
keys B, ``s = log(exp(s_a) + exp(s_b))`` and ``v = v_a exp(s_a - s) + v_b exp(s_b - s)``.
LSEs are natural-log here, as everywhere in tactix (`tactix.compat.flashinfer` has FlashInfer's
base-2 forms). A state over no key (LSE ``-inf``) contributes nothing; merging two of them gives
zeros and ``-inf``. The arithmetic is float32; outputs have ``v``'s dtype.
"""

from __future__ import annotations

import torch

from tactix.errors import InvalidArgumentError

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]

_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_v(v: object, argument: str, dims: int) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise InvalidArgumentError(argument, "a torch.Tensor", type(v).__name__)
    if v.dim() != dims or v.dtype not in _V_DTYPES:
        shape = "[seq_len, num_heads, head_dim]" if dims == 3 else "[seq_len, num_states, num_heads, head_dim]"
        raise InvalidArgumentError(argument, f"a float16, bfloat16 or float32 tensor of shape {shape}",
                                   f"{v.dtype} of shape {tuple(v.shape)}")  # fmt: skip
    return v


def _check_s(s: object, argument: str, v: torch.Tensor, v_argument: str) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise InvalidArgumentError(argument, "a torch.Tensor", type(s).__name__)
    if s.dtype != torch.float32 or tuple(s.shape) != tuple(v.shape[:-1]) or s.device != v.device:
        raise InvalidArgumentError(
            argument,
            f"a float32 tensor of shape {tuple(v.shape[:-1])} on {v.device} (the LSE of {v_argument})",
            f"{s.dtype} of shape {tuple(s.shape)} on {s.device}",
        )
    return s


def _same(a: torch.Tensor, b: torch.Tensor, a_argument: str, b_argument: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise InvalidArgumentError(b_argument, f"{a.dtype} of shape {tuple(a.shape)} on {a.device}, like {a_argument}",
                                   f"{b.dtype} of shape {tuple(b.shape)} on {b.device}")  # fmt: skip


def _combine(v: torch.Tensor, s: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the states stacked along ``dim`` (``v`` float32 with the head dim last, ``s`` its LSE)."""
    top = s.amax(dim=dim, keepdim=True)
    shift = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # every state empty: no shift
    weights = torch.exp(s - shift)  # 0 for an empty state
    total = weights.sum(dim=dim, keepdim=True)
    merged_s = (torch.log(total) + shift).squeeze(dim)  # -inf when every state is empty
    scale = torch.where(total > 0, weights / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    merged_v = (v * scale.unsqueeze(-1)).sum(dim=dim)
    return merged_v, merged_s


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Merge two attention states: ``v_a``, ``v_b`` ``[seq_len, num_heads, head_dim]`` (float16,
    bfloat16 or float32, one dtype), ``s_a``, ``s_b`` ``[seq_len, num_heads]`` float32 natural-log
    LSEs. Returns ``(v, s)``: the output over both key sets (``v_a``'s dtype) and its LSE."""
    v_a = _check_v(v_a, "v_a", 3)
    v_b = _check_v(v_b, "v_b", 3)
    _same(v_a, v_b, "v_a", "v_b")
    s_a = _check_s(s_a, "s_a", v_a, "v_a")
    s_b = _check_s(s_b, "s_b", v_b, "v_b")
    v, s = _combine(torch.stack([v_a.float(), v_b.float()]), torch.stack([s_a, s_b]), 0)
    return v.to(v_a.dtype), s


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states: ``v`` ``[seq_len, num_states, num_heads, head_dim]``,
    ``s`` ``[seq_len, num_states, num_heads]`` float32 natural-log LSEs. Returns ``(v, s)`` of shapes
    ``[seq_len, num_heads, head_dim]`` (``v``'s dtype) and ``[seq_len, num_heads]``."""
    v = _check_v(v, "v", 4)
    s = _check_s(s, "s", v, "v")
    merged_v, merged_s = _combine(v.float(), s, 1)
    return merged_v.to(v.dtype), merged_s


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:  # fmt: skip
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place (shapes as `merge_state`); ``mask``, a
    bool ``[seq_len]`` tensor on their device, merges only the rows it marks (the others keep
    their state), so one captured CUDA graph serves batches that merge some rows."""
    v = _check_v(v, "v", 3)
    v_other = _check_v(v_other, "v_other", 3)
    _same(v, v_other, "v", "v_other")
    s = _check_s(s, "s", v, "v")
    s_other = _check_s(s_other, "s_other", v_other, "v_other")
    if mask is not None and (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or tuple(mask.shape) != (v.shape[0],)
        or mask.device != v.device
    ):
        given = f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InvalidArgumentError("mask", f"None or a bool tensor of shape ({v.shape[0]},) on {v.device}", given)
    merged_v, merged_s = _combine(torch.stack([v.float(), v_other.float()]), torch.stack([s, s_other]), 0)
    if mask is not None:
        merged_v = torch.where(mask[:, None, None], merged_v, v.float())
        merged_s = torch.where(mask[:, None], merged_s, s)
    v.copy_(merged_v)
    s.copy_(merged_s)
