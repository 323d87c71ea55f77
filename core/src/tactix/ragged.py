"""Ragged-KV prefill: `RaggedPrefill`, attention over keys and values packed per request (no pages).

Engines run the new tokens of a chunked prefill this way, before or instead of writing them to
the paged cache, and MLA's prefill over its expanded keys (``head_dim_qk`` 192, ``head_dim_vo``
128), then merge the result with the paged part through the LSE (`tactix.merge_state`). Planned
once per batch and run per layer, like `tactix.PagedPrefill`, with which it shares its plan and
run machinery (`tactix.attention`).

Tensor layouts (FlashInfer's ``NHD`` ragged tensors):

* ``q``: ``[num_qo_tokens, num_qo_heads, head_dim_qk]``, request ``b``'s rows
  ``qo_indptr[b]:qo_indptr[b + 1]``
* ``k``: ``[num_kv_tokens, num_kv_heads, head_dim_qk]``, ``v``: ``[num_kv_tokens, num_kv_heads,
  head_dim_vo]``, request ``b``'s rows ``kv_indptr[b]:kv_indptr[b + 1]``
* ``out``: ``[num_qo_tokens, num_qo_heads, head_dim_vo]`` of ``o_data_type``, contiguous
* ``lse``: ``[num_qo_tokens, num_qo_heads]`` float32, natural log (as `tactix.PagedPrefill`'s)

``q``, ``k`` and ``v`` may be strided views (of one fused QKV projection, say). Query head ``h``
attends KV head ``h // (num_qo_heads // num_kv_heads)``. With ``causal``, query row ``i`` of a
request with ``q_len`` rows and ``kv_len`` keys sits at key position ``kv_len - q_len + i``
(bottom-right alignment: the queries are the last of the keys) and attends keys ``j <= kv_len -
q_len + i``; ``window_left = w >= 0`` further limits it to ``j >= kv_len - q_len + i - w``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from tactix.arguments import flag
from tactix.attention import _Attention, _sized, _Static, attention_fields
from tactix.batch import RaggedBatch
from tactix.errors import InvalidArgumentError, TactixError
from tactix.ops import RaggedPrefillProblem
from tactix.problems import make_problem
from tactix.tactics import Tactic

__all__ = ["RaggedPrefill", "ragged_problem"]


def ragged_problem(
    *,
    device: torch.device,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_vo: int | None,
    causal: bool,
    sm_scale: float | None,
    window_left: int,
    logits_soft_cap: float | None,
    q_data_type: torch.dtype | str,
    kv_data_type: torch.dtype | str | None,
    o_data_type: torch.dtype | str | None,
    return_lse: bool,
    deterministic: bool = True,
    run_extras: Iterable[str] = (),
) -> tuple[RaggedPrefillProblem, RaggedBatch]:
    """Validate plan arguments and batch metadata; the problem and batch that ``plan()`` hands a
    backend (the conformance kit asks a backend's ``check`` about a case with them too);
    ``run_extras`` as for `tactix.attention.attention_problem`."""
    fields = attention_fields(device, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, sm_scale,
                              window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, return_lse,
                              deterministic)  # fmt: skip
    causal = flag(causal, "causal")
    batch = RaggedBatch.build(qo_indptr=qo_indptr, kv_indptr=kv_indptr, device=device, causal=causal)
    if run_extras:
        fields.update(run_extras=tuple(run_extras))
    if batch.keyless_rows:
        fields.update(keyless_rows=True)
    problem = make_problem(RaggedPrefillProblem.op, **fields, causal=causal,
                           **{name: getattr(batch, name) for name in RaggedPrefillProblem.dynamic})  # fmt: skip
    assert isinstance(problem, RaggedPrefillProblem)
    return problem, batch


class RaggedPrefill(_Attention):
    """Batch prefill attention over keys and values packed per request (FlashInfer's
    ``BatchPrefillWithRaggedKVCacheWrapper``; `tactix.compat.flashinfer` has that name).

    Examples
    --------
    >>> import torch, tactix
    >>> wrapper = tactix.RaggedPrefill(device="cpu")
    >>> qo_indptr = torch.tensor([0, 3, 5], dtype=torch.int32)    # 2 requests: 3 and 2 new tokens
    >>> kv_indptr = torch.tensor([0, 3, 7], dtype=torch.int32)    # their keys: 3, and 4 (2 earlier + 2 new)
    >>> wrapper.plan(qo_indptr, kv_indptr, num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, causal=True,
    ...              q_data_type=torch.float32, return_lse=True)
    >>> for layer in range(2):                                    # plan once, run per layer
    ...     out, lse = wrapper.run(torch.randn(5, 8, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64))
    >>> out.shape, lse.shape, wrapper.backend
    (torch.Size([5, 8, 64]), torch.Size([5, 8]), 'torch')
    """

    _op: ClassVar[str] = "ragged_prefill"

    def __init__(
        self,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        use_cuda_graph: bool = False,
        run_extras: Iterable[str] = (),
    ) -> None:
        """``run_extras`` as for `tactix.PagedPrefill`: the run extras every ``run()`` will pass."""
        super().__init__(backend=backend, device=device, use_cuda_graph=use_cuda_graph, run_extras=run_extras)
        self._batch: RaggedBatch | None = None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        *,
        causal: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: torch.dtype | str = torch.bfloat16,
        kv_data_type: torch.dtype | str | None = None,
        o_data_type: torch.dtype | str | None = None,
        return_lse: bool = False,
        deterministic: bool = True,
        backend: str | None = None,
        tactic: Tactic | dict[str, Any] | str | None = None,
    ) -> None:
        """Plan a batch: validate its metadata, choose backend and tactic, build the plan.

        Parameters
        ----------
        qo_indptr : int32/int64 ``[batch_size + 1]``, CPU or device
            Query rows of request ``b`` are ``q[qo_indptr[b]:qo_indptr[b + 1]]``. A request may
            have none, the batch may not (an empty batch is refused: skip the call instead).
        kv_indptr : int32/int64 ``[batch_size + 1]``, CPU or device
            Keys and values of request ``b`` are rows ``kv_indptr[b]:kv_indptr[b + 1]`` of ``k``
            and ``v``. A request with query rows needs at least one key. With ``causal`` the
            rows sit at the end of the keys; a request with more rows than keys has rows before
            its first key, which give zeros and an LSE of -inf (on backends that declare
            ``keyless_rows``; the others refuse the batch). Every offset must fit int32.
        num_qo_heads, num_kv_heads, head_dim_qk : int
            ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA).
        head_dim_vo : int, optional
            Head dim of V and the output (default ``head_dim_qk``; MLA's prefill: 192 and 128).
        causal, sm_scale, window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type,
        return_lse, deterministic, backend, tactic
            As for `tactix.PagedPrefill.plan` (causal alignment: see the module docstring).
        """
        arguments = (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal, sm_scale, window_left,
                     logits_soft_cap, q_data_type, kv_data_type, o_data_type, return_lse, deterministic)  # fmt: skip
        device, chosen_backend, chosen_tactic = self._choices(backend, tactic, qo_indptr, kv_indptr)
        # a re-plan with the static arguments of an earlier plan validates only the batch
        key, state = self._remembered(device, "ragged", arguments)
        if state is not None:
            batch = RaggedBatch.build(qo_indptr=qo_indptr, kv_indptr=kv_indptr, device=device,
                                      causal=state.problem.causal)  # fmt: skip
            problem = _sized(state.problem, batch)
        else:
            problem, batch = ragged_problem(
                device=device, qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, causal=causal,
                sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, return_lse=return_lse,
                deterministic=deterministic, run_extras=self._run_extras,
            )  # fmt: skip
            heads = problem.num_kv_heads
            state = _Static(problem, torch.Size((heads, problem.head_dim_qk)), torch.Size((heads, problem.head_dim_vo)))
            self._remember(key, state)
        self._select(problem, batch, device, arguments, key, state, chosen_backend, chosen_tactic,
                     batch.num_kv_tokens)  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned batch. Returns ``out``, or ``(out, lse)`` with the LSE.

        Every tensor must be on the plan's device; ``q``, ``k`` and ``v`` have the shapes of the
        module docstring (any strides), ``out`` and ``lse`` are contiguous. ``return_lse``,
        ``k_scale``, ``v_scale`` and ``sinks`` mean what they mean for `tactix.PagedPrefill.run`
        (the scales dequantize ``k`` and ``v``).
        """
        b = self._bound_or_raise()
        device = b.device
        try:  # attribute comparisons only; a mismatch goes to the slow path that names it
            if q.shape != b.q_shape or q.dtype != b.q_dtype or q.device != device:
                self._reject("q", q, b.q_shape, b.q_dtype)
            if k.shape != b.k_shape or k.dtype != b.kv_dtype or k.device != device:
                self._reject_kv("k", k, b)
            if v.shape != b.v_shape or v.dtype != b.kv_dtype or v.device != device:
                self._reject_kv("v", v, b)
            out = self._out(b, out)
        except TactixError:
            raise
        except (AttributeError, TypeError, ValueError):  # not a tensor: name it, saying what was expected
            if not isinstance(q, torch.Tensor):
                self._reject("q", q, b.q_shape, b.q_dtype)
            for name, t in (("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor):
                    self._reject_kv(name, t, b)
            if out is not None and not isinstance(out, torch.Tensor):
                self._reject("out", out, b.out_shape, b.out_dtype, contiguous=True)
            raise
        return self._call(b, q, k, v, out, lse, return_lse, k_scale, v_scale, sinks)

    def _reject_kv(self, name: str, t: object, b: Any) -> None:
        """Refuse ``k`` or ``v``, naming the dimension that is off."""
        shape = b.k_shape if name == "k" else b.v_shape
        dims = ("num_kv_tokens = kv_indptr[-1]", "num_kv_heads", "head_dim_qk" if name == "k" else "head_dim_vo")
        if isinstance(t, torch.Tensor) and t.dim() == 3 and t.dtype == b.kv_dtype and t.device == b.device:
            off = [f"{dim} is {want}, not {got}" for dim, want, got in zip(dims, shape, t.shape, strict=True)
                   if want != got]  # fmt: skip
            raise InvalidArgumentError(name, f"a {b.kv_dtype} tensor of shape {tuple(shape)} [{', '.join(dims)}] on "
                                       f"{b.device}", f"shape {tuple(t.shape)}: {'; '.join(off)}")  # fmt: skip
        self._reject(name, t, shape, b.kv_dtype)
