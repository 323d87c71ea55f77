"""FlashInfer's attention wrappers on top of tactix: switch by changing an import.

    # from flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper
    from tactix.compat.flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper
    # from flashinfer import BatchPrefillWithRaggedKVCacheWrapper
    from tactix.compat.flashinfer import BatchPrefillWithRaggedKVCacheWrapper   # tactix.RaggedPrefill

Constructor, ``plan`` and ``run`` take FlashInfer's signatures, and the wrappers have the rest of
FlashInfer's documented members: ``begin_forward`` (another name of ``plan``), ``run_return_lse``
(``run`` with ``return_lse=True``), ``reset_workspace_buffer``, the ``is_cuda_graph_enabled``
property, the decode wrapper's ``use_tensor_cores`` property (what the constructor was given;
``True`` for ``backend="trtllm-gen"``, as in FlashInfer), and the deprecated ``forward`` /
``forward_return_lse`` and ``end_forward``. As in FlashInfer, the attention arguments of
``forward`` (``causal``, ``sm_scale``, ``window_left``, ``logits_soft_cap``) replace the planned
ones: the wrapper re-plans when they differ from the last plan's. ``end_forward`` has no effect.

``backend`` takes FlashInfer's names: ``"auto"``, ``"fa2"`` and ``"fa3"`` select tactix's
``"auto"`` (tactix's choice among the installed backends, tuned where a tactic store has an
entry), ``"cudnn"`` selects tactix's ``cudnn`` backend and ``"trtllm-gen"`` its ``trtllm`` backend
(TensorRT-LLM's kernels, through FlashInfer). Since ``"fa2"``/``"fa3"`` name a FlashInfer kernel
family tactix does not have, the first wrapper made with each logs a note (INFO, logger
``tactix.compat``) saying that ``auto`` serves it. A tactix backend name (``"torch"``,
``"cuda_native"``, ...) is taken as it is; any other name raises `InvalidArgumentError`.

``fast_decode_plan`` (this module's) re-plans a decode wrapper: it has the signature of FlashInfer's
``flashinfer.fast_decode_plan``, which serving engines (vLLM, SGLang) call every step in place of
``plan``, and is used the same way::

    from functools import partial
    from tactix.compat.flashinfer import fast_decode_plan

    wrapper.plan = partial(fast_decode_plan, wrapper)

FlashInfer's own ``fast_decode_plan`` cannot drive these wrappers: it reads and writes FlashInfer's
private wrapper state (the JIT module whose planner it calls with FlashInfer's own argument list,
the ``_plan_info`` its ``run`` reads, its workspace and CUDA-graph buffers, which backend its
``auto`` resolved to), none of which a tactix wrapper has: tactix plans own their buffers and are
re-planned through tactix. Reading a missing attribute of these wrappers raises an
``AttributeError`` that says so.

Differences, all explicit:

* The workspace buffers only tell the device (tactix backends own their scratch memory), and
  the ``*_buf`` arguments for CUDA-graph mode are accepted and not needed: plans keep their own
  buffers at fixed addresses. With ``use_cuda_graph=True`` a re-plan (``plan`` or
  ``fast_decode_plan``) of the same batch size and length bucket rewrites those buffers in place,
  so a captured ``run`` replays the new batch. ``run`` with the LSE uses a second plan, made at
  the first such run: run once with the LSE before capturing (the usual warm-up run); later
  re-plans rewrite both.
* The LSE is returned in base 2, as FlashInfer returns it (tactix's own API uses natural log).
* Scheduling hints (``fixed_split_size``, ``disable_split_kv``, ``non_blocking``,
  ``enable_pdl``) are accepted: each tactix backend schedules for itself.
* ``custom_mask`` / ``packed_custom_mask`` are served (tactix's `PagedPrefill.plan`), replacing
  ``causal`` as in FlashInfer, by the backends that declare custom masks.
* ``run(..., sinks=...)`` (a float32 ``[num_qo_heads]`` of sink logits) is tactix's run extra of
  that name, served by the backends that declare it; the base-2 LSE then includes the sinks.
* Features tactix does not implement raise `InvalidArgumentError` naming the argument: rotary
  embedding inside the kernel, fp16 QK reduction, a q scale,
  NVFP4 KV caches (``kv_data_type=torch.uint8`` at plan, ``kv_cache_sf`` at run), FlashInfer's
  own page-table arguments (``block_tables``, ``seq_lens``).
* Decode's ``q_len_per_req`` (multi-token decode) is tactix's: ``q`` holds that many rows per
  request, causal among them (`tactix.PagedDecode.plan`). As in FlashInfer, the decode wrapper
  takes it only when made with ``use_tensor_cores=True``.
* With ``use_cuda_graph=True``, as in FlashInfer, a re-plan may be a shorter batch than the
  captured one (shorter sequences, fewer pages): capture with the longest batch a graph serves.
  One longer than the captured plan holds is refused with the reason.
* The ragged wrapper (keys and values packed per request, `tactix.RaggedPrefill`) refuses custom
  masks, multi-item scoring, cuDNN's own ``v_indptr`` / ``o_indptr``, ``o_scale`` and
  ``lse_layout="HN"``; its ``run`` takes ``lse_base="ln"`` for a natural-log LSE.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Final, get_args

import torch

from tactix import merge as _merge
from tactix.arguments import flag
from tactix.attention import PagedDecode, PagedPrefill
from tactix.dtypes import DTypeName
from tactix.errors import InvalidArgumentError, TactixError
from tactix.problems import KVLayout
from tactix.ragged import RaggedPrefill
from tactix.registry import get_registry

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "fast_decode_plan",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]

log = logging.getLogger("tactix.compat")

_LOG2E = 1.0 / math.log(2.0)

_AUTO_NAMES: Final = ("auto", "fa2", "fa3")
"""FlashInfer backend names that tactix serves with its ``auto``."""
_RENAMED: Final = {"cudnn": "cudnn", "trtllm-gen": "trtllm"}
"""FlashInfer backend names of a tactix backend: the tactix name of each."""
_noted: set[str] = set()
"""The FlashInfer names whose note (served by ``auto``) this process has logged."""

_HINTS: Final = frozenset({"fixed_split_size", "disable_split_kv"})
"""FlashInfer plan arguments that only steer its scheduler: accepted, each tactix backend schedules for itself."""
_NEUTRAL: Final[dict[str, object]] = {"token_pos_in_items_len": 0, "window_right": 0}
"""FlashInfer's defaults, where they are not None, of plan arguments tactix does not implement."""
_NVFP4_NAMES: Final = frozenset({"uint8", "torch.uint8", "float4_e2m1fn_x2", "torch.float4_e2m1fn_x2"})


def _tactix_backend(backend: object) -> str:
    """The tactix backend argument that serves FlashInfer's ``backend`` name."""
    if isinstance(backend, str) and backend in _AUTO_NAMES:
        if backend != "auto" and backend not in _noted:
            _noted.add(backend)
            log.info("FlashInfer backend %r is served by tactix's 'auto' (its choice among the installed backends; "
                     "pass a tactix backend name to choose one)", backend)  # fmt: skip
        return "auto"
    if isinstance(backend, str) and backend in _RENAMED:
        return _RENAMED[backend]
    known = sorted({record.name for record in get_registry().records()})
    if isinstance(backend, str) and backend in known:
        return backend
    raise InvalidArgumentError(
        "backend",
        "one of FlashInfer's 'auto', 'fa2', 'fa3' (tactix's auto), 'cudnn', 'trtllm-gen' (tactix's trtllm) or a tactix "
        f"backend name ({', '.join(known) or 'none installed'})",
        repr(backend),
    )


def _unsupported(argument: str, value: object, default: object = None) -> None:
    if value is not default and value != default:
        raise InvalidArgumentError(argument, f"{default!r} (tactix does not implement it)", repr(value))


def _refuse_jit(jit_args: object, jit_kwargs: object, variant_owns_mask: object) -> None:
    """Refuse FlashInfer's custom attention variants (JIT modules of the caller's own kernels)."""
    _unsupported("jit_args", jit_args)
    _unsupported("jit_kwargs", jit_kwargs)
    _unsupported("variant_owns_mask", variant_owns_mask, False)


def _unsupported_extras(extras: dict[str, Any]) -> None:
    """Refuse the FlashInfer plan arguments this signature does not name, unless neutral or a hint."""
    for name, value in extras.items():
        if name not in _HINTS:
            _unsupported(name, value, _NEUTRAL.get(name))


def _refuse_nvfp4(argument: str, dtype: object) -> None:
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if (
        (isinstance(dtype, torch.dtype) and (dtype == torch.uint8 or (fp4 is not None and dtype == fp4)))
        or (isinstance(dtype, str) and dtype.lower() in _NVFP4_NAMES)
    ):  # fmt: skip
        raise InvalidArgumentError(
            argument,
            f"a KV dtype tactix serves (one of {', '.join(get_args(DTypeName))}): NVFP4 KV caches (packed uint8 "
            "pages with kv_cache_sf scale factors) are not supported by tactix",
            repr(dtype),
        )


def _workspace_device(buffer: object, argument: str = "float_workspace_buffer") -> torch.device:
    if not isinstance(buffer, torch.Tensor):
        raise InvalidArgumentError(argument, "a torch.Tensor", type(buffer).__name__)
    return buffer.device


def _effective(name: str, value: object, planned: dict[str, Any]) -> object:
    """What an attention argument means (None stands for FlashInfer's default), to compare two of them."""
    if value is None:
        if name == "sm_scale":
            return 1.0 / math.sqrt(planned["head_dim_qk"])
        if name == "logits_soft_cap":
            return 0.0
    return value


class _Wrapper:
    """Plans without LSE; a run that asks for the LSE plans a second wrapper with it, at the first
    such run (then again at each re-plan: eagerly in CUDA-graph mode, else at the next such run)."""

    _impl_type: type[PagedPrefill] | type[PagedDecode]

    def __init__(self, float_workspace_buffer: object, kv_layout: str, use_cuda_graph: bool, backend: object) -> None:
        device = _workspace_device(float_workspace_buffer)
        self._args: dict[str, Any] = {}
        if kv_layout not in ("NHD", "HND"):
            raise InvalidArgumentError("kv_layout", "'NHD' or 'HND'", repr(kv_layout))
        self._kv_layout: KVLayout = kv_layout  # type: ignore[assignment]
        self._device = device
        self._use_cuda_graph = flag(use_cuda_graph, "use_cuda_graph")
        self._backend = _tactix_backend(backend)
        self._plain = self._make()
        self._with_lse: PagedPrefill | PagedDecode | RaggedPrefill | None = None
        self._lse_planned = False  # whether _with_lse holds the last plan's batch

    def _make(self) -> PagedPrefill | PagedDecode | RaggedPrefill:
        return self._impl_type(self._kv_layout, backend=self._backend, device=self._device,
                               use_cuda_graph=self._use_cuda_graph)  # fmt: skip

    @property
    def is_cuda_graph_enabled(self) -> bool:
        """Whether the wrapper was made with ``use_cuda_graph=True`` (its ``run`` can be captured)."""
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """FlashInfer's workspace swap. tactix plans own their scratch memory, so this only checks
        that both buffers are tensors on the wrapper's device."""
        for name, buffer in (("float_workspace_buffer", float_workspace_buffer),
                             ("int_workspace_buffer", int_workspace_buffer)):  # fmt: skip
            if _workspace_device(buffer, name) != self._device:
                raise InvalidArgumentError(name, f"a torch.Tensor on the wrapper's device {self._device}",
                                           f"a tensor on {buffer.device}")  # fmt: skip

    def end_forward(self) -> None:
        """Deprecated in FlashInfer, where it has no effect; here too (plans keep their buffers)."""

    def _plan(self, **args: Any) -> None:
        self._plain.plan(**args, return_lse=False)
        self._args = args
        self._lse_planned = False
        if self._with_lse is not None and self._use_cuda_graph:
            # a captured graph may read the LSE plan's buffers too: rewrite them with this batch now
            self._with_lse.plan(**args, return_lse=True)
            self._lse_planned = True

    def _lse_wrapper(self) -> PagedPrefill | PagedDecode | RaggedPrefill:
        if not self._args:
            raise TactixError(f"{type(self).__name__}: call plan() before run()")
        if self._with_lse is None:
            self._with_lse = self._make()
        if not self._lse_planned:
            self._with_lse.plan(**self._args, return_lse=True)  # the same wrapper: a fast re-plan
            self._lse_planned = True
        return self._with_lse

    def _replan_for(self, **attention: Any) -> None:
        """Re-plan with the attention arguments of a ``forward`` call where they differ from the plan's."""
        if not self._args:
            raise TactixError(f"{type(self).__name__}: call plan() before forward()")
        planned = self._args
        changed = {name: value for name, value in attention.items()
                   if _effective(name, value, planned) != _effective(name, planned[name], planned)}  # fmt: skip
        if changed:
            self._plan(**{**planned, **changed})

    def _run(
        self,
        q: torch.Tensor,
        kv: tuple[Any, ...],
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
        kv_cache_sf: Any,
        lse_base: str = "log2",
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``kv``: what the tactix wrapper's ``run`` takes after ``q`` (the paged cache, or k and v)."""
        flag(return_lse, "return_lse")
        if enable_pdl is not None:
            flag(enable_pdl, "enable_pdl")  # a launch hint each tactix backend decides for itself
        if args:
            raise InvalidArgumentError(
                "*args", "empty (pass k_scale/v_scale by keyword)", f"{len(args)} extra arguments"
            )
        if kv_cache_sf is not None:
            raise InvalidArgumentError("kv_cache_sf", "None: NVFP4 KV caches are not supported by tactix",
                                       f"a {type(kv_cache_sf).__name__}")  # fmt: skip
        _unsupported("q_scale", q_scale)
        planned_window = self._args.get("window_left", -1)
        if window_left is not None and window_left != planned_window:
            raise InvalidArgumentError("window_left", f"None or the planned {planned_window}", window_left)
        if lse_base not in ("log2", "ln"):
            raise InvalidArgumentError("lse_base", "'log2' (FlashInfer's default) or 'ln'", repr(lse_base))
        if not (return_lse or lse is not None):
            return self._plain.run(q, *kv, out=out, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        result = self._lse_wrapper().run(q, *kv, out=out, lse=lse, return_lse=True, k_scale=k_scale,
                                         v_scale=v_scale, sinks=sinks)  # fmt: skip
        assert isinstance(result, tuple)
        o, natural = result
        if lse_base == "log2":
            natural.mul_(_LOG2E)  # FlashInfer's LSE is base 2 unless asked for in natural log
        return o, natural

    def run_return_lse(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``run(..., return_lse=True)``: the output and its base-2 LSE."""
        result = self.run(q, *args, return_lse=True, **kwargs)  # type: ignore[attr-defined]
        assert isinstance(result, tuple)
        return result

    if not TYPE_CHECKING:  # (mypy would then accept any attribute name on a wrapper)

        def __getattr__(self, name: str) -> Any:
            # called only for attributes the wrapper lacks, FlashInfer's private state mostly
            if name.startswith("__"):
                raise AttributeError(name, name=name, obj=self)
            raise AttributeError(
                f"{type(self).__name__!r} of tactix.compat.flashinfer has no attribute {name!r}: it serves "
                "FlashInfer's documented wrapper API, not FlashInfer's internals (for FlashInfer's fast_decode_plan, "
                "which drives those, use tactix.compat.flashinfer.fast_decode_plan)",
                name=name,
                obj=self,
            )


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
        jit_kwargs: dict[str, Any] | None = None,
        variant_owns_mask: bool = False,
    ) -> None:
        del custom_mask_buf, mask_indptr_buf  # CUDA-graph buffers: tactix plans keep their own
        _refuse_jit(jit_args, jit_kwargs, variant_owns_mask)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)

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
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        _unsupported("use_fp16_qk_reduction", use_fp16_qk_reduction, False)
        flag(non_blocking, "non_blocking")  # a copy hint: tactix plans make their own metadata copies
        _unsupported_extras(unsupported)
        _refuse_nvfp4("kv_data_type", kv_data_type)
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
            # as in FlashInfer, a custom mask replaces causal (tactix refuses causal=True beside one)
            causal=False if custom_mask is not None or packed_custom_mask is not None else causal,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
            **({"custom_mask": custom_mask} if custom_mask is not None else {}),
            **({"packed_custom_mask": packed_custom_mask} if packed_custom_mask is not None else {}),
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
        kv_cache_sf: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._run(q, (paged_kv_cache,), args, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                         window_left, sinks, kv_cache_sf)  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: float | None = None,
        v_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> torch.Tensor:
        """Deprecated in FlashInfer (use `run`): attention with these arguments replacing the planned ones."""
        result = self._forward(q, paged_kv_cache, causal, pos_encoding_mode, use_fp16_qk_reduction, k_scale, v_scale,
                               window_left, logits_soft_cap, sm_scale, return_lse=False)  # fmt: skip
        assert isinstance(result, torch.Tensor)
        return result

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: float | None = None,
        v_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Deprecated in FlashInfer (use `run_return_lse`): `forward` with the base-2 LSE."""
        result = self._forward(q, paged_kv_cache, causal, pos_encoding_mode, use_fp16_qk_reduction, k_scale, v_scale,
                               window_left, logits_soft_cap, sm_scale, return_lse=True)  # fmt: skip
        assert isinstance(result, tuple)
        return result

    def _forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        causal: bool,
        pos_encoding_mode: str,
        use_fp16_qk_reduction: bool,
        k_scale: float | None,
        v_scale: float | None,
        window_left: int,
        logits_soft_cap: float | None,
        sm_scale: float | None,
        *,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        _unsupported("use_fp16_qk_reduction", use_fp16_qk_reduction, False)
        self._replan_for(causal=flag(causal, "causal"), sm_scale=sm_scale, window_left=window_left,
                         logits_soft_cap=logits_soft_cap)  # fmt: skip
        return self._run(q, (paged_kv_cache,), (), None, k_scale, v_scale, None, None, return_lse, None, None, None,
                         None)  # fmt: skip


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    """FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` served by tactix's `RaggedPrefill` (see
    the module docs). ``k`` and ``v`` are ``[kv_indptr[-1], num_kv_heads, head_dim]`` (``NHD``) or
    ``[num_kv_heads, kv_indptr[-1], head_dim]`` (``HND``, handed to tactix as a transposed view)."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
        variant_owns_mask: bool = False,
    ) -> None:
        del qo_indptr_buf, kv_indptr_buf, custom_mask_buf, mask_indptr_buf  # CUDA-graph buffers: plans keep their own
        _refuse_jit(jit_args, jit_kwargs, variant_owns_mask)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)

    def _make(self) -> RaggedPrefill:
        return RaggedPrefill(backend=self._backend, device=self._device, use_cuda_graph=self._use_cuda_graph)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: torch.dtype | str = "float16",
        kv_data_type: torch.dtype | str | None = None,
        o_data_type: torch.dtype | str | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        v_indptr: torch.Tensor | None = None,
        o_indptr: torch.Tensor | None = None,
        uniform_q_len: int | None = None,
        **unsupported: Any,
    ) -> None:
        """FlashInfer's ``plan``. Refused by name: custom masks (tactix's ragged prefill has none:
        `tactix.PagedPrefill` serves them), rotary embedding and fp16 QK reduction inside the kernel,
        multi-item scoring (``prefix_len_ptr``, ``token_pos_in_items_ptr``, ``max_item_len_ptr``),
        and cuDNN's separate ``v_indptr`` / ``o_indptr``. Accepted and not needed: the scheduling
        hints (``fixed_split_size``, ``disable_split_kv``, ``uniform_q_len``, ``non_blocking``) and
        the lengths FlashInfer's cuDNN path takes besides the indptrs (``seq_lens``, ``seq_lens_q``,
        ``max_token_per_sequence``, ``max_sequence_kv``), which tactix derives from the indptrs.
        ``rope_scale`` and ``rope_theta``, which only rotary embedding reads, are unused."""
        for name, mask in (("custom_mask", custom_mask), ("packed_custom_mask", packed_custom_mask)):
            if mask is not None:
                raise InvalidArgumentError(name, "None: tactix's ragged-KV prefill takes no custom mask (its paged "
                                           "prefill does: BatchPrefillWithPagedKVCacheWrapper)", "a mask")  # fmt: skip
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        _unsupported("use_fp16_qk_reduction", use_fp16_qk_reduction, False)
        for name, value in (
            ("prefix_len_ptr", prefix_len_ptr),
            ("token_pos_in_items_ptr", token_pos_in_items_ptr),
            ("max_item_len_ptr", max_item_len_ptr),
            ("v_indptr", v_indptr),
            ("o_indptr", o_indptr),
        ):
            _unsupported(name, value)  # fmt: skip
        _unsupported("token_pos_in_items_len", token_pos_in_items_len, 0)
        flag(non_blocking, "non_blocking")  # a copy hint: tactix plans make their own metadata copies
        flag(disable_split_kv, "disable_split_kv")  # a scheduling hint, as fixed_split_size is
        _unsupported_extras(unsupported)
        _refuse_nvfp4("kv_data_type", kv_data_type)
        self._plan(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
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

    def _kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, ...]:
        """``k`` and ``v`` as tactix reads them: ``[tokens, heads, dim]`` (an HND pair transposed)."""
        if self._kv_layout == "NHD":
            return k, v
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                given = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidArgumentError(name, "a 3-D tensor [num_kv_heads, kv_indptr[-1], head_dim] (HND)", given)
        return k.transpose(0, 1), v.transpose(0, 1)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        o_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: bool | None = None,
        kv_cache_sf: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's ``run``: the output, or ``(out, lse)`` with the LSE in base 2 (``lse_base="ln"``:
        natural log) as ``[qo_indptr[-1], num_qo_heads]`` (``lse_layout="NH"``; ``"HN"`` is refused:
        transpose the result). ``k_scale`` and ``v_scale`` as in FlashInfer: logits ``(q . k) * k_scale *
        sm_scale``, the output from ``v * v_scale``; ``q_scale`` and ``o_scale`` are refused."""
        _unsupported("o_scale", o_scale)
        _unsupported("lse_layout", lse_layout, "NH")
        return self._run(q, self._kv(k, v), args, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                         None, None, kv_cache_sf, lse_base)  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Deprecated in FlashInfer (use `run`): attention with these arguments replacing the planned
        ones (``forward_return_lse``: with the base-2 LSE)."""
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        _unsupported("use_fp16_qk_reduction", use_fp16_qk_reduction, False)
        self._replan_for(causal=flag(causal, "causal"), sm_scale=sm_scale, window_left=window_left,
                         logits_soft_cap=logits_soft_cap)  # fmt: skip
        return self._run(q, self._kv(k, v), (), None, None, None, None, None, return_lse, None, None, None, None)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)


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
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self._use_tensor_cores = use_tensor_cores or backend == "trtllm-gen"

    @property
    def use_tensor_cores(self) -> bool:
        """What the constructor was given (``True`` for ``backend="trtllm-gen"``, as in FlashInfer).
        Informational: each tactix backend chooses its own kernels."""
        return self._use_tensor_cores

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
        q_data_type: torch.dtype | str | None = "float16",
        kv_data_type: torch.dtype | str | None = None,
        o_data_type: torch.dtype | str | None = None,
        data_type: torch.dtype | str | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        **unsupported: Any,
    ) -> None:
        _unsupported("block_tables", block_tables)
        _unsupported("seq_lens", seq_lens)
        _unsupported_extras(unsupported)
        self._plan_decode(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                          pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type,
                          data_type, sm_scale, non_blocking, disable_split_kv, q_len_per_req)  # fmt: skip

    begin_forward = plan

    def _plan_decode(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str,
        window_left: int,
        logits_soft_cap: float | None,
        q_data_type: torch.dtype | str | None,
        kv_data_type: torch.dtype | str | None,
        o_data_type: torch.dtype | str | None,
        data_type: torch.dtype | str | None,
        sm_scale: float | None,
        non_blocking: bool,
        disable_split_kv: bool,
        q_len_per_req: int | None,
    ) -> None:
        """What `plan` and `fast_decode_plan` share (neither calls the other: serving code replaces
        ``wrapper.plan`` with ``partial(fast_decode_plan, wrapper)``)."""
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        if isinstance(q_len_per_req, int) and q_len_per_req > 1 and not self._use_tensor_cores:
            # FlashInfer's rule, kept so code that runs here runs on FlashInfer too (tactix's own
            # PagedDecode takes q_len_per_req whatever kernels serve it)
            raise InvalidArgumentError("use_tensor_cores", "True for multi-token decode (q_len_per_req "
                                       f"{q_len_per_req} > 1), as FlashInfer requires", False)  # fmt: skip
        flag(non_blocking, "non_blocking")  # a copy hint: tactix plans make their own metadata copies
        flag(disable_split_kv, "disable_split_kv")  # a scheduling hint, as fixed_split_size is
        # FlashInfer's dtype rules: data_type stands for whichever of q and kv is not given
        if q_data_type is None:
            q_data_type = data_type if data_type is not None else "float16"
        if kv_data_type is None:
            _refuse_nvfp4("data_type", data_type)
            kv_data_type = data_type
        else:
            _refuse_nvfp4("kv_data_type", kv_data_type)
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
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
            sm_scale=sm_scale,
            q_len_per_req=1 if q_len_per_req is None else q_len_per_req,
        )

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
        q_len_per_req: int | None = None,
        kv_cache_sf: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        planned = self._args.get("q_len_per_req", 1)
        if q_len_per_req is not None and q_len_per_req != planned:
            raise InvalidArgumentError("q_len_per_req", f"None or the planned {planned} (rows per request are "
                                       "fixed at plan)", repr(q_len_per_req))  # fmt: skip
        return self._run(q, (paged_kv_cache,), args, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                         window_left, sinks, kv_cache_sf)  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        pos_encoding_mode: str = "NONE",
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> torch.Tensor:
        """Deprecated in FlashInfer (use `run`): attention with these arguments replacing the planned ones."""
        result = self._forward(q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale, window_left,
                               logits_soft_cap, sm_scale, return_lse=False)  # fmt: skip
        assert isinstance(result, torch.Tensor)
        return result

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        pos_encoding_mode: str = "NONE",
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Deprecated in FlashInfer (use `run_return_lse`): `forward` with the base-2 LSE."""
        result = self._forward(q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale, window_left,
                               logits_soft_cap, sm_scale, return_lse=True)  # fmt: skip
        assert isinstance(result, tuple)
        return result

    def _forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        pos_encoding_mode: str,
        q_scale: float | None,
        k_scale: float | None,
        v_scale: float | None,
        window_left: int,
        logits_soft_cap: float | None,
        sm_scale: float | None,
        *,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _unsupported("pos_encoding_mode", pos_encoding_mode, "NONE")
        self._replan_for(sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap)
        return self._run(q, (paged_kv_cache,), (), q_scale, k_scale, v_scale, None, None, return_lse, None, None, None,
                         None)  # fmt: skip


def fast_decode_plan(
    self: BatchDecodeWithPagedKVCacheWrapper,
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
    q_data_type: torch.dtype | str | None = None,
    kv_data_type: torch.dtype | str | None = None,
    data_type: torch.dtype | str | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    non_blocking: bool = True,
    fixed_split_size: int | None = None,
    disable_split_kv: bool = False,
    q_len_per_req: int = 1,
    global_override_indptr_cpu: torch.Tensor | None = None,
) -> None:
    """Re-plan a tactix decode wrapper for a new batch: FlashInfer's ``fast_decode_plan``, for
    `BatchDecodeWithPagedKVCacheWrapper` (FlashInfer's own function cannot drive it: see the
    module docs). Install it as serving engines do: ``wrapper.plan = partial(fast_decode_plan, wrapper)``.

    The arguments are FlashInfer's ``plan`` arguments and mean the same, with FlashInfer's
    defaults for this function: ``q_data_type=None`` stands for ``data_type``, else float16. The
    output dtype is the last plan's (``o_data_type`` of ``plan``; the q dtype without one).

    * ``global_override_indptr_cpu``: a host copy of ``indptr`` (its first ``batch_size + 1``
      entries are read; a longer buffer is fine). When given, the batch is planned from it and
      ``indptr`` is not read, so planning reads no indptr from the device.
    * ``fixed_split_size``, ``disable_split_kv``, ``non_blocking``: scheduling hints, accepted
      (each tactix backend schedules for itself).
    * ``q_len_per_req``: query rows per request, as in ``plan``; ``pos_encoding_mode`` must be
      ``"NONE"`` (``rope_scale`` and ``rope_theta``, which only rotary embedding reads, are
      accepted and unused).

    A tactix plan does what FlashInfer's function skips (it copies the batch metadata into the
    plan's own buffers); what makes it fast is tactix's re-plan path: with the same static
    arguments as the last plan only the batch is validated and laid out again. Unlike FlashInfer's,
    it needs no earlier ``plan()`` (the first call plans in full). With ``use_cuda_graph=True`` it
    keeps the plans' buffers at their addresses as ``plan`` does (same batch size and length bucket:
    a captured ``run`` replays the new batch; the LSE plan, if a run made one, is rewritten too).
    """
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper):
        raise InvalidArgumentError(
            "self",
            "a tactix.compat.flashinfer.BatchDecodeWithPagedKVCacheWrapper (FlashInfer's own wrappers take "
            "flashinfer.fast_decode_plan)",
            type(self).__name__,
        )
    if global_override_indptr_cpu is not None:
        override: object = global_override_indptr_cpu
        if not isinstance(override, torch.Tensor) or not override.is_cpu:
            given = f"a tensor on {override.device}" if isinstance(override, torch.Tensor) else type(override).__name__
            raise InvalidArgumentError("global_override_indptr_cpu", "None or a CPU tensor (a host copy of indptr)",
                                       given)  # fmt: skip
        indptr = override
        if isinstance(last_page_len, torch.Tensor) and last_page_len.dim() == 1 and indptr.dim() == 1:
            indptr = indptr[: last_page_len.shape[0] + 1]
    self._plan_decode(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                      pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type,
                      self._args.get("o_data_type"), data_type, sm_scale, non_blocking, disable_split_kv,
                      q_len_per_req)  # fmt: skip


# -- cascade: merging attention states, with FlashInfer's base-2 LSE -------------------------------


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """FlashInfer's ``merge_state``: `tactix.merge_state` with base-2 LSEs in and out."""
    v, s = _merge.merge_state(v_a, _natural(s_a, "s_a"), v_b, _natural(s_b, "s_b"))
    return v, s * _LOG2E


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``merge_states``: `tactix.merge_states` with base-2 LSEs in and out."""
    merged_v, merged_s = _merge.merge_states(v, _natural(s, "s"))
    return merged_v, merged_s * _LOG2E


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:  # fmt: skip
    """FlashInfer's ``merge_state_in_place``: ``s`` and ``s_other`` are base-2 LSEs (``s`` is
    updated in base 2)."""
    natural = _natural(s, "s")
    _merge.merge_state_in_place(v, natural, v_other, _natural(s_other, "s_other"), mask)
    s.copy_(natural * _LOG2E)


def _natural(s: object, argument: str) -> torch.Tensor:
    """A base-2 LSE as float32 natural log (FlashInfer converts the LSE to float32 too)."""
    if not isinstance(s, torch.Tensor):
        raise InvalidArgumentError(argument, "a torch.Tensor", type(s).__name__)
    return s.to(torch.float32) / _LOG2E
