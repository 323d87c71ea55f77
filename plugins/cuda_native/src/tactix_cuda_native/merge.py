"""Merging attention states (`tactix.ops.merge_states`) in one kernel (kernels/merge.cu): one
warp per row and head reads every state's value once, so a ragged chunk and its paged prefix (or
split-KV parts) combine in one pass over the data instead of torch's dozen element-wise ops.

The kernel finds state ``i`` at a byte offset ``i * stride`` from state 0. Separate tensors with
the same row and head strides (`tactix.merge_state`'s two, the in-place form) are passed by their
address difference, views of one stacked tensor by its state stride; states that share no such
stride (rare: different layouts) are copied into one stacked tensor first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Final

import torch

from tactix import MergeProblem, PlanOptions, Tactic, UnsupportedProblemError
from tactix.plugin import raw_stream
from tactix_cuda_native import NAME
from tactix_cuda_native.device import cuda_device, device_index, device_info
from tactix_cuda_native.kernel import launcher
from tactix_cuda_native.runtime import Variant, launch_config, load, stream_for

__all__ = ["MERGE_WARPS", "CudaNativeMergePlan", "merge_args", "merge_reasons", "merge_variant", "plan_merge"]

MERGE_WARPS: Final = 8
"""Warps a CTA (each merges one row and head)."""
MERGE_TYPES: Final = {"float16": 0, "bfloat16": 1, "float32": 2}
MERGE_TACTIC: Final = Tactic(backend=NAME, kernel="merge")


def merge_variant(v_dtype: str, arch: str) -> Variant:
    return Variant.make("merge.cu", arch, TX_MERGE_T=MERGE_TYPES[v_dtype], TX_BF16=int(v_dtype == "bfloat16"),
                        TX_MERGE_WARPS=MERGE_WARPS)  # fmt: skip


def merge_reasons(problem: MergeProblem, tactic: Tactic) -> list[str]:
    out = []
    if not (tactic.is_default or (tactic.kernel == "merge" and not tactic.params)):
        out.append(f"merges take the kernel 'merge' without params (got {tactic})")
    if problem.v_dtype not in MERGE_TYPES:
        out.append(f"v dtype {problem.v_dtype} not in {sorted(MERGE_TYPES)}")
    return out


def _uniform(ts: Sequence[torch.Tensor]) -> int | None:
    """The byte distance between consecutive tensors when it is one number, else None."""
    if len(ts) < 2:
        return 0
    step = ts[1].data_ptr() - ts[0].data_ptr()
    for a, b in itertools.pairwise(ts[1:]):
        if b.data_ptr() - a.data_ptr() != step:
            return None
    return step


def merge_args(vs: Sequence[torch.Tensor], ss: Sequence[torch.Tensor], out_v: torch.Tensor, out_s: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[Any, ...] | None:  # fmt: skip
    """The kernel's arguments after the launch configuration, or None where the states do not
    lie at one stride from each other (the plan stacks them first)."""
    v_strides, s_strides = vs[0].stride(), ss[0].stride()
    if any(v.stride() != v_strides for v in vs) or any(s.stride() != s_strides for s in ss):
        return None
    v_step, s_step = _uniform(vs), _uniform(ss)
    if v_step is None or s_step is None:
        return None
    rows, heads, dim = vs[0].shape
    ve, oe = vs[0].element_size(), out_v.element_size()
    return (vs[0].data_ptr(), v_step, v_strides[0] * ve, v_strides[1] * ve, ss[0].data_ptr(), s_step,
            s_strides[0] * 4, s_strides[1] * 4, out_v.data_ptr(), out_v.stride(0) * oe, out_v.stride(1) * oe,
            out_s.data_ptr(), out_s.stride(0) * 4, out_s.stride(1) * 4, 0 if mask is None else mask.data_ptr(),
            rows, heads, dim, len(vs))  # fmt: skip


class CudaNativeMergePlan:
    """A planned merge: ``run`` launches kernels/merge.cu over the call's tensors (any rows)."""

    def __init__(self, problem: MergeProblem, tactic: Tactic, options: PlanOptions) -> None:
        index = device_index(options["device"])
        self.device = cuda_device(index)
        self.problem = problem
        self.tactic = MERGE_TACTIC
        module, self.built = load(merge_variant(problem.v_dtype, device_info(index).arch), index)
        self._kernel = module.kernel("tactix_merge_states")
        self._index = index
        self._launch = launcher().launch

    def run(self, vs: Sequence[torch.Tensor], ss: Sequence[torch.Tensor], out_v: torch.Tensor, out_s: torch.Tensor,
            mask: torch.Tensor | None) -> None:  # fmt: skip
        args = merge_args(vs, ss, out_v, out_s, mask)
        if args is None:  # states at no common stride: one stacked copy, then the kernel
            stacked_v, stacked_s = torch.stack(list(vs), dim=1), torch.stack(list(ss), dim=1)
            n = len(vs)
            args = merge_args([stacked_v[:, i] for i in range(n)], [stacked_s[:, i] for i in range(n)], out_v, out_s,
                              mask)  # fmt: skip
            assert args is not None
        rows, heads = vs[0].shape[0], vs[0].shape[1]
        if rows == 0:
            return
        grid = (-(-rows * heads // MERGE_WARPS), 1, 1)
        stream = stream_for(self._index, raw_stream(self._index))
        self._launch(stream, launch_config(grid, 32 * MERGE_WARPS, 0), self._kernel, *args)


def plan_merge(problem: MergeProblem, tactic: Tactic, options: PlanOptions) -> CudaNativeMergePlan:
    reasons = merge_reasons(problem, tactic)
    if reasons:
        raise UnsupportedProblemError(NAME, problem, reasons)
    return CudaNativeMergePlan(problem, tactic, options)
