"""Merging attention states: two (or more) partial attention outputs over disjoint key sets, each
with its log-sum-exp, into the attention over their union.

This is how a prefill over a cached prefix and its new tokens (or over the parts of a split KV)
combines exactly: with ``(v_a, s_a)`` the output and LSE over keys A and ``(v_b, s_b)`` over
keys B, ``s = log(exp(s_a) + exp(s_b))`` and ``v = v_a exp(s_a - s) + v_b exp(s_b - s)``.
LSEs are natural-log here, as everywhere in tactix (`tactix.compat.flashinfer` has FlashInfer's
base-2 forms). A state over no key (LSE ``-inf``) contributes nothing; merging two of them gives
zeros and ``-inf``. The arithmetic is float32; outputs have ``v``'s dtype.

The merge is an op of the registry (`tactix.ops.merge_states`): the functions here plan it
through ``auto`` (a plan per device, dtype, state count, heads, head dim, mask and bucket of rows,
kept in a small cache, as `tactix.gemm` does) and run it, so on a GPU a backend's fused kernel
serves it (cuda_native: one kernel reading every state once); `MergeStates` is the wrapper for
callers that plan once and run per layer. The torch backend computes it with the torch ops of
`combine_states`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from tactix.arguments import described, flag, positive_int
from tactix.devices import resolve_device
from tactix.dtypes import parse_dtype, to_torch_dtype
from tactix.errors import InvalidArgumentError, TactixError
from tactix.hookspecs import PlanOptions
from tactix.ops import MergeProblem
from tactix.problems import bucket_size, make_problem
from tactix.selection import PlannedOp, select_and_plan
from tactix.tactics import Tactic, parse_tactic

__all__ = ["MergeStates", "combine_states", "merge_state", "merge_state_in_place", "merge_states"]

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


def combine_states(vs: Sequence[torch.Tensor], ss: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge in torch ops (the torch backend's plan): float32 ``v`` ``[rows, heads, dim]`` and
    its LSE ``[rows, heads]`` of the states ``(vs[i], ss[i])``."""
    v = torch.stack([x.float() for x in vs])
    s = torch.stack(list(ss))
    top = s.amax(dim=0, keepdim=True)
    shift = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # every state empty: no shift
    weights = torch.exp(s - shift)  # 0 for an empty state
    total = weights.sum(dim=0, keepdim=True)
    merged_s = (torch.log(total) + shift).squeeze(0)  # -inf when every state is empty
    scale = torch.where(total > 0, weights / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    merged_v = (v * scale.unsqueeze(-1)).sum(dim=0)
    return merged_v, merged_s


class MergeStates(PlannedOp):
    """A planned merge of attention states, reusable across calls (any number of rows).

    Examples
    --------
    >>> import torch, tactix
    >>> m = tactix.MergeStates(device="cpu")
    >>> m.plan(num_states=2, num_heads=4, head_dim=8, v_dtype=torch.float32)
    >>> v, s = m.run([torch.randn(3, 4, 8)] * 2, [torch.zeros(3, 4)] * 2)
    >>> v.shape, s.shape
    (torch.Size([3, 4, 8]), torch.Size([3, 4]))
    """

    def plan(self, *, num_states: int, num_heads: int, head_dim: int, v_dtype: torch.dtype | str,
             rows: int = 1, masked: bool = False, backend: str | None = None,
             tactic: Tactic | dict[str, Any] | str | None = None) -> None:  # fmt: skip
        """Plan merges of ``num_states`` states of ``num_heads`` x ``head_dim`` values in ``v_dtype``
        (float16, bfloat16 or float32); ``rows`` sizes the choice (tuning, the store's bucket), not
        the runs; ``masked``: runs pass a mask of the rows to write."""
        if isinstance(num_states, bool) or not isinstance(num_states, int) or num_states < 2:
            raise InvalidArgumentError("num_states", "an int >= 2 (states to merge)", repr(num_states))
        name = parse_dtype(v_dtype, "v_dtype")
        if to_torch_dtype(name) not in _V_DTYPES:
            raise InvalidArgumentError("v_dtype", "float16, bfloat16 or float32", name)
        flag(masked, "masked")
        device = resolve_device(self._device)
        problem = make_problem(
            "merge_states", device_type=device.type, v_dtype=name, num_states=num_states,
            num_heads=positive_int(num_heads, "num_heads"), head_dim=positive_int(head_dim, "head_dim"),
            rows=positive_int(rows, "rows"), masked=masked)  # fmt: skip
        assert isinstance(problem, MergeProblem)
        self._selection = select_and_plan(
            problem, None, backend=self._backend if backend is None else backend,
            tactic=None if tactic is None else parse_tactic(tactic),
            options=PlanOptions(device=device, use_cuda_graph=False, previous=None))  # fmt: skip
        self._problem = problem
        self._device_now = device
        self._run = self._selection.plan.run

    def run(self, vs: Sequence[torch.Tensor], ss: Sequence[torch.Tensor], *, out_v: torch.Tensor | None = None,
            out_s: torch.Tensor | None = None,
            mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Merge the states ``(vs[i], ss[i])`` (``[rows, heads, head_dim]`` with a contiguous last
        dim, float32 LSEs ``[rows, heads]``, on the planned device); ``out_v``/``out_s``: where to
        write (new tensors by default; the first state's own for the in-place form). Returns them."""
        if self._run is None:
            raise TactixError("MergeStates: call plan() before run()")
        p = self._problem
        if not isinstance(vs, Sequence) or not isinstance(ss, Sequence) or len(vs) != p.num_states \
                or len(ss) != p.num_states:  # fmt: skip
            raise InvalidArgumentError("vs", f"{p.num_states} output tensors and as many LSEs (ss), as planned",
                                       f"{_count(vs)} and {_count(ss)}")  # fmt: skip
        dtype = to_torch_dtype(p.v_dtype)
        first = _check_state(vs[0], ss[0], 0, p, dtype, self._device_now)
        for i in range(1, p.num_states):
            v = _check_state(vs[i], ss[i], i, p, dtype, self._device_now)
            if v.shape[0] != first.shape[0]:
                raise InvalidArgumentError(f"vs[{i}]", f"{first.shape[0]} rows like vs[0]", f"{v.shape[0]} rows")
        rows = first.shape[0]
        shape = (rows, p.num_heads, p.head_dim)
        if out_v is None:
            out_v = torch.empty(shape, dtype=dtype, device=self._device_now)
        elif not isinstance(out_v, torch.Tensor) or tuple(out_v.shape) != shape or out_v.dtype != dtype \
                or out_v.device != self._device_now or out_v.stride(-1) != 1:  # fmt: skip
            raise InvalidArgumentError("out_v", f"a {dtype} tensor of shape {shape} on {self._device_now}, last dim "
                                       "contiguous", described(out_v))  # fmt: skip
        if out_s is None:
            out_s = torch.empty(shape[:2], dtype=torch.float32, device=self._device_now)
        elif not isinstance(out_s, torch.Tensor) or tuple(out_s.shape) != shape[:2] \
                or out_s.dtype != torch.float32 or out_s.device != self._device_now:  # fmt: skip
            raise InvalidArgumentError("out_s", f"a float32 tensor of shape {shape[:2]} on {self._device_now}",
                                       described(out_s))  # fmt: skip
        if p.masked:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (rows,) \
                    or mask.device != self._device_now:  # fmt: skip
                raise InvalidArgumentError("mask", f"a bool tensor of shape ({rows},) on {self._device_now} (planned "
                                           "masked)", described(mask))  # fmt: skip
        elif mask is not None:
            raise InvalidArgumentError("mask", "None (planned without a mask)", described(mask))
        self._run(tuple(vs), tuple(ss), out_v, out_s, mask)
        return out_v, out_s


def _count(x: object) -> str:
    return str(len(x)) if isinstance(x, Sequence) else type(x).__name__


def _check_state(v: object, s: object, i: int, p: MergeProblem, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:  # fmt: skip
    if not isinstance(v, torch.Tensor) or v.dim() != 3 or tuple(v.shape[1:]) != (p.num_heads, p.head_dim) \
            or v.dtype != dtype or v.device != device or v.stride(-1) != 1:  # fmt: skip
        raise InvalidArgumentError(f"vs[{i}]", f"a {dtype} tensor [rows, {p.num_heads}, {p.head_dim}] on {device}, "
                                   "last dim contiguous", described(v))  # fmt: skip
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != tuple(v.shape[:2]) or s.dtype != torch.float32 \
            or s.device != device:  # fmt: skip
        raise InvalidArgumentError(f"ss[{i}]", f"a float32 tensor of shape {tuple(v.shape[:2])} on {device} "
                                   f"(the LSE of vs[{i}])", described(s))  # fmt: skip
    return v


_PLANS: OrderedDict[tuple[Any, ...], MergeStates] = OrderedDict()
_PLAN_CACHE_SIZE = 64


def _merge(vs: Sequence[torch.Tensor], ss: Sequence[torch.Tensor], out_v: torch.Tensor | None,
           out_s: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Plan (cached per device, dtype, state count, heads, dim, mask and bucket of rows) and run."""
    v0 = vs[0]
    key = (v0.device, v0.dtype, len(vs), v0.shape[1], v0.shape[2], mask is not None, bucket_size(v0.shape[0]))
    plan = _PLANS.get(key)
    if plan is None:
        plan = MergeStates(device=v0.device)
        plan.plan(num_states=len(vs), num_heads=v0.shape[1], head_dim=v0.shape[2], v_dtype=v0.dtype,
                  rows=max(v0.shape[0], 1), masked=mask is not None)  # fmt: skip
        _PLANS[key] = plan
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan.run(vs, ss, out_v=out_v, out_s=out_s, mask=mask)


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
    if v_a.shape[0] == 0:
        return torch.empty_like(v_a), torch.empty_like(s_a)
    return _merge(_last_dim_dense((v_a, v_b)), (s_a, s_b), None, None, None)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states: ``v`` ``[seq_len, num_states, num_heads, head_dim]``,
    ``s`` ``[seq_len, num_states, num_heads]`` float32 natural-log LSEs. Returns ``(v, s)`` of shapes
    ``[seq_len, num_heads, head_dim]`` (``v``'s dtype) and ``[seq_len, num_heads]``."""
    v = _check_v(v, "v", 4)
    s = _check_s(s, "s", v, "v")
    rows, n = v.shape[0], v.shape[1]
    if rows == 0 or n == 0:
        out_v = torch.zeros(rows, v.shape[2], v.shape[3], dtype=v.dtype, device=v.device)
        return out_v, torch.full((rows, v.shape[2]), float("-inf"), device=v.device)
    if n == 1:
        return v[:, 0].clone(), s[:, 0].clone()
    return _merge(_last_dim_dense(tuple(v[:, i] for i in range(n))), tuple(s[:, i] for i in range(n)), None, None,
                  None)  # fmt: skip


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
    if v.shape[0] == 0:
        return
    if v.stride(-1) != 1:  # the in-place form writes into v itself: merged apart, then copied in
        merged_v, merged_s = merge_state(v, s, v_other, s_other)
        if mask is not None:
            merged_v = torch.where(mask[:, None, None], merged_v, v)
            merged_s = torch.where(mask[:, None], merged_s, s)
        v.copy_(merged_v)
        s.copy_(merged_s)
        return
    (other,) = _last_dim_dense((v_other,))
    _merge((v, other), (s, s_other), v, s, mask)


def _last_dim_dense(vs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The states with a contiguous last dim (what plans read; a copy only for one that lacks it)."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in vs)
