"""FlashInfer's paged-attention wrappers on top of tactix: switch by changing an import.

    # from flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper
    from tactix.compat.flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper

Constructor, ``plan`` and ``run`` take FlashInfer's signatures. Differences, all explicit:

* The workspace buffer only tells the device (tactix backends own their scratch memory), and
  the ``*_buf`` arguments for CUDA-graph mode are accepted and not needed: plans keep their own
  buffers at fixed addresses.
* ``backend`` is ``"auto"`` or a tactix backend name (FlashInfer's ``"fa2"``/``"fa3"`` are not
  tactix backends).
* The LSE is returned in base 2, as FlashInfer returns it (tactix's own API uses natural log).
* Features tactix does not implement raise `InvalidArgumentError` naming the argument: custom
  masks, rotary embedding inside the kernel, fp16 QK reduction, q/k/v scales, attention sinks,
  more than one query per request in decode.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tactix.arguments import flag
from tactix.attention import PagedDecode, PagedPrefill
from tactix.errors import InvalidArgumentError, TactixError
from tactix.problems import KVLayout

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"]

_LOG2E = 1.0 / math.log(2.0)


def _unsupported(argument: str, value: object, default: object = None) -> None:
    if value is not default and value != default:
        raise InvalidArgumentError(argument, f"{default!r} (tactix does not implement it)", repr(value))


def _workspace_device(buffer: object) -> torch.device:
    if not isinstance(buffer, torch.Tensor):
        raise InvalidArgumentError("float_workspace_buffer", "a torch.Tensor", type(buffer).__name__)
    return buffer.device


class _Wrapper:
    """Plans without LSE; a run that asks for the LSE re-plans once with it (cached until the next plan)."""

    _impl_type: type[PagedPrefill] | type[PagedDecode]

    def __init__(self, device: torch.device, kv_layout: str, use_cuda_graph: bool, backend: str) -> None:
        self._args: dict[str, Any] = {}
        if kv_layout not in ("NHD", "HND"):
            raise InvalidArgumentError("kv_layout", "'NHD' or 'HND'", repr(kv_layout))
        self._kv_layout: KVLayout = kv_layout  # type: ignore[assignment]
        self._device = device
        self._use_cuda_graph = use_cuda_graph
        self._backend = backend
        self._plain = self._impl_type(self._kv_layout, backend=backend, device=device, use_cuda_graph=use_cuda_graph)
        self._with_lse: PagedPrefill | PagedDecode | None = None

    def _plan(self, **args: Any) -> None:
        self._plain.plan(**args, return_lse=False)
        self._args = args
        self._with_lse = None

    def _lse_wrapper(self) -> PagedPrefill | PagedDecode:
        if self._with_lse is None:
            if not self._args:
                raise TactixError(f"{type(self).__name__}: call plan() before run()")
            wrapper = self._impl_type(
                self._kv_layout,
                backend=self._backend,
                device=self._device,
                use_cuda_graph=self._use_cuda_graph,
            )
            wrapper.plan(**self._args, return_lse=True)
            self._with_lse = wrapper
        return self._with_lse

    def _run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        args: tuple[Any, ...],
        q_scale: Any,
        k_scale: Any,
        v_scale: Any,
        out: torch.Tensor | None,
        lse: torch.Tensor | None,
        return_lse: bool,
        enable_pdl: bool | None,
        window_left: int | None,
        sinks: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        flag(return_lse, "return_lse")
        if enable_pdl is not None:
            flag(enable_pdl, "enable_pdl")  # a launch hint each tactix backend decides for itself
        if args:
            raise InvalidArgumentError(
                "*args", "empty (pass k_scale/v_scale by keyword)", f"{len(args)} extra arguments"
            )
        _unsupported("q_scale", q_scale)
        _unsupported("sinks", sinks)
        planned_window = self._args.get("window_left", -1)
        if window_left is not None and window_left != planned_window:
            raise InvalidArgumentError("window_left", f"None or the planned {planned_window}", window_left)
        if not (return_lse or lse is not None):
            return self._plain.run(q, paged_kv_cache, out=out, k_scale=k_scale, v_scale=v_scale)
        result = self._lse_wrapper().run(q, paged_kv_cache, out=out, lse=lse, return_lse=True, k_scale=k_scale,
                                         v_scale=v_scale)  # fmt: skip
        assert isinstance(result, tuple)
        o, natural = result
        natural.mul_(_LOG2E)  # FlashInfer's LSE is base 2
        return o, natural


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` served by tactix (see module docs)."""

    _impl_type = PagedPrefill

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
    ) -> None:
        _unsupported("custom_mask_buf", custom_mask_buf)
        _unsupported("jit_args", jit_args)
        super().__init__(_workspace_device(float_workspace_buffer), kv_layout, use_cuda_graph, backend)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: torch.dtype | str = "float16",
        kv_data_type: torch.dtype | str | None = None,
        o_data_type: torch.dtype | str | None = None,
        non_blocking: bool = True,
        **unsupported: Any,
    ) -> None:
        _unsupported("custom_mask", custom_mask)
        _unsupported("packed_custom_mask", packed_custom_mask)
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        _unsupported("use_fp16_qk_reduction", use_fp16_qk_reduction, False)
        flag(non_blocking, "non_blocking")  # a copy hint: tactix plans make their own metadata copies
        for name, value in unsupported.items():
            _unsupported(name, value)
        self._plan(
            qo_indptr=qo_indptr,
            paged_kv_indptr=paged_kv_indptr,
            paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            page_size=page_size,
            head_dim_vo=head_dim_vo,
            causal=causal,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
        )

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._run(q, paged_kv_cache, args, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                         window_left, sinks)  # fmt: skip


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` served by tactix (see module docs)."""

    _impl_type = PagedDecode

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
    ) -> None:
        _unsupported("jit_args", jit_args)
        flag(use_tensor_cores, "use_tensor_cores")  # each tactix backend picks its own kernels
        super().__init__(_workspace_device(float_workspace_buffer), kv_layout, use_cuda_graph, backend)

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: torch.dtype | str = "float16",
        kv_data_type: torch.dtype | str | None = None,
        data_type: torch.dtype | str | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        **unsupported: Any,
    ) -> None:
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        flag(non_blocking, "non_blocking")  # a copy hint: tactix plans make their own metadata copies
        for name, value in unsupported.items():
            if name in ("fixed_split_size", "disable_split_kv"):
                continue  # scheduling hints; each tactix backend schedules for itself
            _unsupported(name, value)
        self._plan(
            paged_kv_indptr=indptr,
            paged_kv_indices=indices,
            paged_kv_last_page_len=last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim,
            page_size=page_size,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type if kv_data_type is not None else data_type,
            sm_scale=sm_scale,
        )

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        q_len_per_req: int | None = 1,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _unsupported("q_len_per_req", q_len_per_req, 1)
        return self._run(q, paged_kv_cache, args, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                         window_left, sinks)  # fmt: skip
