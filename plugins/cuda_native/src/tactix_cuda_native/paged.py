"""What the paged-attention ops (decode, prefill) share: head dims and page sizes, the problem's own
reasons, the cache strides their kernels read, and their plans' metadata staging (`StagedPlan`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Final

import torch

from tactix import (
    DecodeProblem,
    InvalidArgumentError,
    PagedBatch,
    PlanOptions,
    PrefillProblem,
    Problem,
    Tactic,
    UnsupportedProblemError,
)
from tactix.plugin import Piece, Sections, Staging, cache_axes
from tactix_cuda_native import NAME

__all__ = [
    "FP8_CVT_ENV",
    "FP8_KV_DTYPES",
    "HEAD_DIMS",
    "LOG2E",
    "MAX_PAGE_SIZE",
    "UNIT_SCALES",
    "StagedPlan",
    "attention_reasons",
    "cache_strides",
    "fp8_cvt",
    "log2_exact",
    "scale_args",
]

HEAD_DIMS: Final = (64, 128, 256)
MAX_PAGE_SIZE: Final = 128
LOG2E: Final = 1.4426950408889634  # the kernels' softmax is base 2: the scale is folded with log2(e)
FP8_KV_DTYPES: Final = {"float8_e4m3fn": 1, "float8_e5m2": 2}
"""The fp8 KV-cache dtypes the decode and mma.sync prefill kernels read (under 16-bit q and out), by
their ``TX_KV_FP8`` value."""
FP8_CVT_ENV: Final = "TACTIX_CUDA_NATIVE_FP8_CVT"


def fp8_cvt() -> int:
    """The ``TX_FP8_CVT`` mode of every fp8 variant (decode and prefill): how K and V tiles are
    converted to 16 bits (kernels/fp8.cuh; every mode gives the same values bit for bit). Mode 1,
    the hardware conversion (below sm_89 the kernel keeps the bit arithmetic): on the H200 the
    integer placement (mode 2) made D1-fp8 slower with both session-16 kernels (311 vs 260 us, then
    245 vs 201 us: benchmarks/results/h200-bench-fp8-cvt{1,2}-session16-run{1,4}.json).
    `FP8_CVT_ENV` (0, 1 or 2) sets the mode, to compare."""
    forced = os.environ.get(FP8_CVT_ENV)
    return int(forced) if forced in ("0", "1", "2") else 1


FP8_QK16_ENV: Final = "TACTIX_CUDA_NATIVE_FP8_QK16"


def fp8_qk16() -> int:
    """``TX_QK16`` of the wgmma prefill's fp8 variants under bfloat16 q: 0 (the default) computes
    Q K^T in bfloat16 (the producer converts K in four instructions a pair); `FP8_QK16_ENV` = 1
    computes it in float16 (Q rescaled per warp by a power of two, kernels/prefill_sm90.cu), so K
    converts in one instruction a pair. Not the default because it measured no faster: on the
    H200 P1 over an e4m3 cache took 779 us with it against 774 without, same tactic, one process
    (benchmarks/results/h200-fp8-prefill-probe-session34.json): the producer's conversion it
    saves was not what bounds the kernel, and each warp's rescale of its Q rows sits on the
    consumers' path at every item."""
    return 1 if os.environ.get(FP8_QK16_ENV) == "1" else 0


UNIT_SCALES: Final = (1.0, 1.0, 0, 0)
"""The kernel's scale arguments without scales: k and v values 1.0, no device pointers."""


def scale_args(k_scale: float | torch.Tensor | None,
               v_scale: float | torch.Tensor | None) -> tuple[float, float, int, int]:  # fmt: skip
    """The attention kernels' scale arguments (kernels/decode.cu, prefill.cu, prefill_sm90.cu): the
    k and v values, then the k and v device addresses (0: use the value). A tensor's address is
    passed, never its value (no host sync; a CUDA graph replays with whatever it holds)."""
    kf, kp = (1.0, k_scale.data_ptr()) if isinstance(k_scale, torch.Tensor) else (float(k_scale or 1.0), 0)
    vf, vp = (1.0, v_scale.data_ptr()) if isinstance(v_scale, torch.Tensor) else (float(v_scale or 1.0), 0)
    return kf, vf, kp, vp


def log2_exact(n: int) -> int | None:
    """log2 of a power of two, else None."""
    if n < 1 or n & (n - 1):
        return None
    return int(math.log2(n))


def attention_reasons(problem: DecodeProblem | PrefillProblem, fp8_kv: bool = False) -> list[str]:
    """Why neither kernel of the op serves ``problem``, whatever the tactic (``fp8_kv``: the op's
    kernel also reads fp8 caches, `FP8_KV_DTYPES`, under 16-bit q and out of one dtype)."""
    out = []
    if fp8_kv and problem.kv_dtype in FP8_KV_DTYPES:
        if problem.q_dtype != problem.out_dtype or problem.q_dtype not in ("float16", "bfloat16"):
            out.append(f"an fp8 KV cache ({problem.kv_dtype}) takes float16 or bfloat16 q and out of the same dtype")
    elif not (problem.q_dtype == problem.kv_dtype == problem.out_dtype):
        out.append("q, kv and out dtypes must be the same")
    if log2_exact(problem.page_size) is None or problem.page_size > MAX_PAGE_SIZE:
        out.append(f"page size {problem.page_size} must be a power of two up to {MAX_PAGE_SIZE}")
    return out


def cache_strides(layout: str, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """(page, token, head) strides of k then v, in elements; refuses what the kernels cannot read
    (rows 16-byte aligned: strides in multiples of 8 16-bit or 16 one-byte elements)."""
    strides: list[int] = []
    for name, t in (("k", k), ("v", v)):
        s = t.stride()
        page, tok, head, dim = cache_axes(s, layout)
        align = 16 if t.element_size() == 1 else 8  # 16-byte rows: 16 fp8 or 8 16-bit elements
        if dim != 1 or page % align or tok % align or head % align:
            raise InvalidArgumentError(
                f"paged_kv_cache ({name})",
                f"dense along head_dim with page, token and head strides that are multiples of {align} elements",
                f"strides {tuple(s)}",
            )
        strides += [page, tok, head]
    return tuple(strides)


class StagedPlan:
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

    _q_copy: torch.Tensor | None  # the packed q of a q the kernel cannot read in place (made once)

    def _accept(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _operands(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:  # fmt: skip
        """What ``run`` launches with: q (or its packed copy when the kernel cannot read it in
        place) and the k, v and out addresses, checked 16-byte aligned; the strides are checked
        once per new set (`_accept`)."""
        if (q.stride(), k.stride(), v.stride()) != self._seen:
            self._accept(q, k, v)
        if not self._q_direct or q.data_ptr() % 16:
            if self._q_copy is None:
                self._q_copy = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._q_copy.copy_(q)
            q = self._q_copy
        k_ptr, v_ptr, out_ptr = k.data_ptr(), v.data_ptr(), out.data_ptr()
        if (k_ptr | v_ptr | out_ptr) % 16:
            raise InvalidArgumentError("paged_kv_cache", "k, v and out starting at 16-byte aligned addresses",
                                       f"addresses {k_ptr:#x}, {v_ptr:#x}, {out_ptr:#x}")  # fmt: skip
        return q, k_ptr, v_ptr, out_ptr

    def _inherit_accepted(self, previous: object) -> None:
        """Keep what the previous plan of the wrapper (same class, device and cache layout) found
        when it checked the run's strides, so that the first run after a re-plan does not check
        them again when they are the same (``run`` compares them on every call)."""
        if (
            isinstance(previous, StagedPlan)
            and type(previous) is type(self)
            and previous._seen is not None
            and previous.device == self.device
            and previous.problem.kv_layout == self.problem.kv_layout
            and previous._bulk == self._bulk
        ):
            self._seen, self._strides, self._q_direct = previous._seen, previous._strides, previous._q_direct

    def replan(self, problem: Problem, batch: PagedBatch, options: PlanOptions) -> StagedPlan | None:
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
              page_cap: int, indices: bool = True) -> tuple[Sections, int, int]:  # fmt: skip
        """Send the metadata: ``pieces`` (and the page indices, where the kernel does not read the
        caller's device indices in place: host indices, or any in CUDA-graph mode) written into a
        pinned buffer of the wrapper's staging (taken over from the previous plan, `tactix.staging`)
        with C-level copies, one transfer into a device slot. ``layout_for(page_cap or None)``:
        the sections. Returns the sections, the slot's device address and the indices' address
        (0 with ``indices`` False: a kernel that reads no page table, the ragged prefill's tensor maps).

        Eager plans alternate between the two slots, so the slot the previous plan's runs read is
        left alone; CUDA-graph plans keep slot 0, sized by the buckets, whose addresses the
        captured kernel reads (a re-plan of the same buckets rewrites it in place)."""
        host_indices = batch.indices_on_host
        copied = (host_indices or graph) and indices
        layout = layout_for(page_cap if copied else None)
        if copied:
            pieces = [*pieces, batch.kv_indices if host_indices else []]
        old = previous._staging if isinstance(previous, StagedPlan) else None
        staging = Staging.reuse(old, self.device, layout.total)
        if graph and previous is not None and staging is not old:
            raise UnsupportedProblemError(NAME, problem, [
                "in CUDA-graph mode a re-plan must keep the metadata buffer of the captured kernel"])  # fmt: skip
        slot = staging.slot(graph)
        base = staging.send(slot, layout.total, lambda dst: layout.write(dst, pieces))
        self._staging = staging
        if not indices:
            return layout, base, 0
        if not copied:
            self._indices_ref = batch.kv_indices.contiguous()  # keep the caller's device indices alive
            return layout, base, self._indices_ref.data_ptr()
        at = layout.offset("indices")
        if not host_indices and batch.num_page_entries:  # device indices: after the transfer, on its stream
            staging.copy_in(slot, at, batch.kv_indices)  # (nnz entries: PagedBatch.build narrowed it)
        return layout, base, base + 4 * at
