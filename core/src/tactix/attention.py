"""Paged-KV attention: `PagedPrefill` and `PagedDecode`, planned once per batch, run per layer.

``plan()`` validates the batch metadata, builds the problem, chooses the backend and tactic,
and asks that backend for a plan (which may build a graph or compile a kernel). ``run()``
checks the tensors against the plan with a few attribute comparisons and calls the plan
directly: no hook dispatch, and no allocation or host sync when ``out`` (and ``lse``) are
given, so it can be captured in a CUDA graph when the wrapper was made with
``use_cuda_graph=True``.

Tensor layouts (FlashInfer's):

* ``q``: ``[num_qo_tokens, num_qo_heads, head_dim_qk]`` (decode: ``[batch_size, ...]``)
* cache, ``kv_layout="NHD"``: ``(k, v)`` each ``[num_pages, page_size, num_kv_heads, head_dim]``
  or one tensor ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
* cache, ``kv_layout="HND"``: ``(k, v)`` each ``[num_pages, num_kv_heads, page_size, head_dim]``
  or one tensor ``[num_pages, 2, num_kv_heads, page_size, head_dim]``
* ``out``: ``[num_qo_tokens, num_qo_heads, head_dim_vo]`` of ``o_data_type``
* ``lse``: ``[num_qo_tokens, num_qo_heads]`` float32, the **natural-log** log-sum-exp of each
  row's scaled (and soft-capped) logits over the keys it attends to. (FlashInfer returns it in
  base 2; `tactix.compat.flashinfer` converts.)

Query head ``h`` attends KV head ``h // (num_qo_heads // num_kv_heads)``. With ``causal``,
query row ``i`` of a request with ``q_len`` rows and ``kv_len`` keys sits at position
``kv_len - q_len + i`` (bottom-right alignment: the new tokens are the end of the sequence) and
attends keys ``j <= kv_len - q_len + i``; ``window_left = w >= 0`` further limits it to
``j >= kv_len - q_len + i - w``.

What every attention wrapper shares (the memo of static arguments, selection, the binding
``run()`` checks against, output, run extras and LSE) is `_Attention`, which `tactix.ragged`'s
`RaggedPrefill` (keys and values packed per request, no pages) builds on too.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar, Final, Generic, TypeVar

import torch

from tactix.arguments import flag, number, positive_int
from tactix.batch import Batch, PagedBatch
from tactix.devices import checked_device, resolve_device
from tactix.dtypes import parse_dtype, to_torch_dtype
from tactix.errors import InvalidArgumentError, TactixError
from tactix.hookspecs import PlanOptions
from tactix.layouts import KVLayout, page_shape
from tactix.ops import AttentionProblemBase, DecodeProblem, PrefillProblem, definition
from tactix.problems import make_problem
from tactix.registry import get_registry
from tactix.selection import Planned, Selection, replan_selection, select_and_plan
from tactix.tactics import Tactic, parse_tactic

__all__ = ["PagedDecode", "PagedPrefill", "attention_fields", "attention_problem"]

_LAYOUTS = ("NHD", "HND")

MAX_PAGE_SIZE: Final = 65536
"""The largest ``page_size`` a plan accepts. Plans size their buffers by whole pages (the torch
backend's masks, a backend's page tables), so a page far larger than any sequence only costs
memory (3 GiB for one 3-token request at 2**28), and beyond this bound no engine uses one."""


def _sized(template: AttentionProblemBase, batch: Batch) -> Any:
    """The problem of ``batch``: ``template`` (validated, same static arguments) with its sizes
    (the problem's dynamic fields, which the batch has under the same names, validated by the
    batch's ``build``); ``template.model_copy(update=sizes)`` at a third of the cost, since
    nothing else is derived from them."""
    cls = type(template)
    new = cls.__new__(cls)
    fields = dict(template.__dict__)
    for name in template.dynamic:
        fields[name] = getattr(batch, name)
    if "keyless_rows" in fields:  # per batch, like the sizes (causal paged prefill only)
        fields["keyless_rows"] = getattr(batch, "keyless_rows", False)
    object.__setattr__(new, "__dict__", fields)
    object.__setattr__(new, "__pydantic_fields_set__", template.__pydantic_fields_set__)
    object.__setattr__(new, "__pydantic_extra__", None)
    object.__setattr__(new, "__pydantic_private__", None)
    return new


def _build_batch(
    qo_indptr: torch.Tensor | None,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    page_size: int,
    device: torch.device,
    causal: bool,
    q_len_per_req: int = 1,
) -> PagedBatch:
    return PagedBatch.build(
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=last_page_len,
        page_size=page_size,
        device=device,
        causal=causal,
        q_len_per_req=q_len_per_req,
    )


_ARGUMENT_NAMES: Final = ("num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo", "page_size", "causal",
                          "sm_scale", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "o_data_type",
                          "return_lse", "deterministic", "q_len_per_req", "masked")  # fmt: skip
"""The static arguments of `attention_problem` after ``op``, in the order the wrappers pass them
(``masked``: whether a custom mask was given, its tensors being per batch)."""


def _static_arguments(arguments: tuple[Any, ...]) -> dict[str, Any]:
    """`attention_problem`'s keyword arguments from a wrapper's ``arguments`` (``masked`` aside:
    the mask tensors are passed with the batch)."""
    named = dict(zip(_ARGUMENT_NAMES, arguments[1:], strict=True))
    del named["masked"]
    return named


def _static_key(device_type: str, form: str, arguments: tuple[Any, ...]) -> tuple[Any, ...]:
    """The memo key of a set of static plan arguments: their values and their types too (1 == 1.0
    == True, but each validates, or fails, differently)."""
    return (device_type, form, arguments, tuple(map(type, arguments)))


def attention_fields(
    device: torch.device,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_vo: int | None,
    sm_scale: float | None,
    window_left: int,
    logits_soft_cap: float | None,
    q_data_type: torch.dtype | str,
    kv_data_type: torch.dtype | str | None,
    o_data_type: torch.dtype | str | None,
    return_lse: bool,
    deterministic: bool,
) -> dict[str, Any]:
    """The problem fields every attention op shares (`tactix.ops.AttentionProblemBase`), from plan
    arguments validated one by one (each failure an `InvalidArgumentError` naming the argument),
    with the defaults filled in: ``head_dim_vo`` and the dtypes from the q side, ``sm_scale``
    ``1 / sqrt(head_dim_qk)``, no soft-cap for None."""
    head_dim_qk = positive_int(head_dim_qk, "head_dim_qk")
    head_dim_vo = head_dim_qk if head_dim_vo is None else positive_int(head_dim_vo, "head_dim_vo")
    num_qo_heads = positive_int(num_qo_heads, "num_qo_heads")
    num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
    return_lse = flag(return_lse, "return_lse")
    deterministic = flag(deterministic, "deterministic")
    if num_qo_heads % num_kv_heads:
        raise InvalidArgumentError("num_qo_heads", f"a multiple of num_kv_heads = {num_kv_heads}", num_qo_heads)
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise InvalidArgumentError("window_left", "-1 (no window) or an int >= 0", repr(window_left))
    q_dtype = parse_dtype(q_data_type, "q_data_type")
    kv_dtype = q_dtype if kv_data_type is None else parse_dtype(kv_data_type, "kv_data_type")
    out_dtype = q_dtype if o_data_type is None else parse_dtype(o_data_type, "o_data_type")
    scale_expected, cap_expected = "a finite float > 0", "None, 0 or a finite float > 0"
    scale = 1.0 / math.sqrt(head_dim_qk) if sm_scale is None else number(sm_scale, "sm_scale", scale_expected)
    if not scale > 0 or not math.isfinite(scale):
        raise InvalidArgumentError("sm_scale", scale_expected, sm_scale)
    cap = 0.0 if logits_soft_cap is None else number(logits_soft_cap, "logits_soft_cap", cap_expected)
    if not cap >= 0 or not math.isfinite(cap):
        raise InvalidArgumentError("logits_soft_cap", cap_expected, logits_soft_cap)
    return {
        "device_type": device.type,
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim_qk": head_dim_qk,
        "head_dim_vo": head_dim_vo,
        "q_dtype": q_dtype,
        "kv_dtype": kv_dtype,
        "out_dtype": out_dtype,
        "sm_scale": scale,
        "window_left": window_left,
        "logits_soft_cap": cap,
        "return_lse": return_lse,
        "deterministic": deterministic,
    }


def attention_problem(
    op: str,
    *,
    device: torch.device,
    kv_layout: KVLayout,
    qo_indptr: torch.Tensor | None,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    paged_kv_last_page_len: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_vo: int | None,
    page_size: int,
    causal: bool,
    sm_scale: float | None,
    window_left: int,
    logits_soft_cap: float | None,
    q_data_type: torch.dtype | str,
    kv_data_type: torch.dtype | str | None,
    o_data_type: torch.dtype | str | None,
    return_lse: bool,
    deterministic: bool = True,
    q_len_per_req: int = 1,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    run_extras: Iterable[str] = (),
) -> tuple[PrefillProblem | DecodeProblem, PagedBatch]:
    """Validate plan arguments and batch metadata; the problem and batch that ``plan()`` hands a backend.

    ``qo_indptr=None`` means decode, ``q_len_per_req`` rows per request; ``run_extras``: the run
    extras the caller's runs pass (names the wrapper checked), which the problem carries. Used by the wrappers
    (which keep the problem of each set of static arguments, so a re-plan validates only its
    batch), and by the conformance kit to ask a backend's ``check`` about a case before planning it.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidArgumentError(
            "page_size",
            f"an int between 1 and {MAX_PAGE_SIZE} (tokens per KV-cache page; plans size buffers by whole pages)",
            repr(page_size),
        )
    fields = attention_fields(device, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, sm_scale,
                              window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, return_lse,
                              deterministic)  # fmt: skip
    causal = flag(causal, "causal")
    ragged = definition(op).problem.ragged_queries  # type: ignore[attr-defined]
    q_len_per_req = positive_int(q_len_per_req, "q_len_per_req")
    if ragged and q_len_per_req != 1:
        raise InvalidArgumentError("q_len_per_req", "1 for prefill (its rows per request are in qo_indptr)",
                                   q_len_per_req)  # fmt: skip
    masked = custom_mask is not None or packed_custom_mask is not None
    if masked and not ragged:
        raise InvalidArgumentError("custom_mask", "None for decode (custom masks are a prefill argument)", "a mask")
    if masked and causal:
        raise InvalidArgumentError("causal", "False with a custom mask (the mask decides which keys each row "
                                   "attends)", True)  # fmt: skip
    batch = _build_batch(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, device,
                         causal, q_len_per_req)  # fmt: skip
    if masked:
        batch = batch.with_custom_mask(custom_mask, packed_custom_mask, device)
    fields.update(page_size=page_size, kv_layout=kv_layout, batch_size=batch.batch_size, max_kv_len=batch.max_kv_len)
    if ragged:
        fields.update(causal=causal, num_qo_tokens=batch.num_qo_tokens, max_qo_len=batch.max_qo_len)
        if masked:
            fields.update(custom_mask=True)
        if batch.keyless_rows:
            fields.update(keyless_rows=True)
    elif q_len_per_req > 1:
        fields.update(q_len_per_req=q_len_per_req)
    if run_extras:
        fields.update(run_extras=tuple(run_extras))
    problem = make_problem(op, **fields)
    assert isinstance(problem, (PrefillProblem, DecodeProblem))
    return problem, batch


_P = TypeVar("_P", bound=AttentionProblemBase)


class _Static(Generic[_P]):
    """What a wrapper derives from one set of static plan arguments (the problem of their first
    batch, the dtypes and the key and value shapes run() checks), kept for re-plans with the same
    ones. ``k_tail`` / ``v_tail``: the shapes of k and v past their first axis (pages, or rows)."""

    __slots__ = ("k_tail", "kv_dtype", "out_dtype", "problem", "q_dtype", "return_lse", "shapes", "v_tail")

    def __init__(self, problem: _P, k_tail: torch.Size, v_tail: torch.Size) -> None:
        self.problem = problem
        self.q_dtype = to_torch_dtype(problem.q_dtype)
        self.kv_dtype = to_torch_dtype(problem.kv_dtype)
        self.out_dtype = to_torch_dtype(problem.out_dtype)
        self.return_lse = problem.return_lse
        self.k_tail = k_tail
        self.v_tail = v_tail
        self.shapes: dict[int, tuple[torch.Size, torch.Size, torch.Size]] = {}

    def shapes_for(self, rows: int) -> tuple[torch.Size, torch.Size, torch.Size]:
        """The q, out and lse shapes of a batch of ``rows`` query rows."""
        found = self.shapes.get(rows)
        if found is None:
            p = self.problem
            if len(self.shapes) >= 64:
                self.shapes.clear()
            found = self.shapes[rows] = (torch.Size((rows, p.num_qo_heads, p.head_dim_qk)),
                                         torch.Size((rows, p.num_qo_heads, p.head_dim_vo)),
                                         torch.Size((rows, p.num_qo_heads)))  # fmt: skip
        return found


class _LastStatic:
    """The static arguments of a wrapper's last plan, as given (a re-plan passing the very same
    objects skips even the memo key), with their key and state."""

    __slots__ = ("arguments", "device", "key", "state")

    def __init__(
        self, device: torch.device, arguments: tuple[Any, ...], key: tuple[Any, ...], state: _Static[Any]
    ) -> None:
        self.device = device
        self.arguments = arguments
        self.key = key
        self.state = state


class _Bound:
    """What ``run()`` checks a call against and what it calls: bound by ``plan()`` to one plan
    object and one batch shape (a fast re-plan that keeps both keeps it too). ``kv_rows``: the rows
    of packed k and v (ragged-KV prefill; None for a paged cache, whose page count is free)."""

    __slots__ = ("device", "extras", "extras_by", "k_shape", "k_tail", "kv_dtype", "kv_rows", "lse_shape",
                 "out_dtype", "out_shape", "plan", "q_dtype", "q_shape", "return_lse", "rows", "run", "state",
                 "v_shape", "v_tail")  # fmt: skip

    def __init__(self, selection: Selection, state: _Static[Any], device: torch.device, rows: int,
                 kv_rows: int | None = None) -> None:  # fmt: skip
        plan = selection.plan
        self.plan = plan
        self.run = plan.run
        self.state = state
        self.device = device
        self.rows = rows
        self.q_shape, self.out_shape, self.lse_shape = state.shapes_for(rows)
        self.q_dtype = state.q_dtype
        self.kv_dtype = state.kv_dtype
        self.out_dtype = state.out_dtype
        self.k_tail = state.k_tail
        self.v_tail = state.v_tail
        self.kv_rows = kv_rows
        self.k_shape = None if kv_rows is None else torch.Size((kv_rows, *state.k_tail))
        self.v_shape = None if kv_rows is None else torch.Size((kv_rows, *state.v_tail))
        self.return_lse = state.return_lse
        # (of the op whose plan this is: multi-token decode may be a prefill plan, `Backend.served`)
        self.extras: frozenset[str] = selection.backend.run_extras(state.problem)
        """The run extras the plan's backend takes."""
        self.extras_by = selection.backend.name


class _Attention(Planned):
    """What every attention wrapper shares: the backend, device and CUDA-graph arguments, the memo
    of static plan arguments, the selection and the binding ``run()`` checks against, and the
    end of ``run()`` (output, run extras, LSE). Subclasses add their batch metadata and keys."""

    _op: ClassVar[str]

    def __init__(self, *, backend: str, device: torch.device | str | None, use_cuda_graph: bool,
                 run_extras: Iterable[str] = ()) -> None:  # fmt: skip
        if not isinstance(backend, str):
            raise InvalidArgumentError("backend", "'auto' or a backend name", repr(backend))
        known = definition(self._op).extras
        if isinstance(run_extras, str) or not all(isinstance(x, str) and x in known for x in run_extras):
            raise InvalidArgumentError("run_extras", f"names of {self._op}'s run extras ({', '.join(known)})",
                                       repr(run_extras))  # fmt: skip
        self._run_extras = frozenset(run_extras)  # what every run() will pass: plan only backends that take it
        if backend != "auto":
            get_registry().get(backend)  # unknown or unavailable names fail here, listing choices
        self._backend = backend
        self._device = checked_device("device", device)
        self._use_cuda_graph = flag(use_cuda_graph, "use_cuda_graph")
        self._selection: Selection | None = None
        self._batch: Any = None
        self._bound: _Bound | None = None  # what run() compares against and calls, bound at plan
        self._statics: dict[tuple[Any, ...], _Static[Any]] = {}  # by the static plan arguments (see _remembered)
        self._replan_key: tuple[Any, ...] | None = None  # the last plan's static key and backend argument
        self._last_static: _LastStatic | None = None  # the static arguments of the last plan

    # -- plan -----------------------------------------------------------------------------

    def _choices(self, backend: str | None, tactic: Tactic | dict[str, Any] | str | None,
                 *tensors: object) -> tuple[torch.device, str, Tactic | None]:  # fmt: skip
        """The plan's device (the wrapper's, else the first GPU tensor's among ``tensors``, else the
        current GPU, else the CPU), its backend argument and its explicit tactic."""
        explicit = self._device
        if explicit is not None and (explicit.index is not None or explicit.type == "cpu"):
            device = explicit  # what resolve_device gives back for a concrete device
        else:
            device = resolve_device(explicit, *tensors)
        chosen_backend = self._backend if backend is None else backend
        if not isinstance(chosen_backend, str):
            raise InvalidArgumentError("backend", "'auto' or a backend name", repr(chosen_backend))
        return device, chosen_backend, None if tactic is None else parse_tactic(tactic)

    def _remembered(
        self, device: torch.device, form: str, arguments: tuple[Any, ...]
    ) -> tuple[tuple[Any, ...] | None, _Static[Any] | None]:
        """The memo key of the static ``arguments`` (None: one is unhashable) and what an earlier plan
        derived from them (None: nothing yet). ``form``: what else the problem depends on (the
        paged wrappers' layout)."""
        last = self._last_static
        if last is not None and last.device is device and all(map(operator.is_, arguments, last.arguments)):
            return last.key, last.state  # the very same argument objects as the last plan's
        key = _static_key(device.type, form, arguments)
        try:
            return key, self._statics.get(key)
        except TypeError:  # an unhashable argument: validating the arguments names it
            return None, None

    def _remember(self, key: tuple[Any, ...] | None, state: _Static[Any]) -> None:
        if key is not None:
            if len(self._statics) >= 16:
                self._statics.clear()
            self._statics[key] = state

    def _select(self, problem: Any, batch: Batch, device: torch.device, arguments: tuple[Any, ...],
                key: tuple[Any, ...] | None, state: _Static[Any], backend: str, tactic: Tactic | None,
                kv_rows: int | None = None) -> None:  # fmt: skip
        """Choose and plan the backend and tactic of ``problem`` on ``batch``, by the fast re-plan
        where it applies, and bind ``run()`` to the plan."""
        last = self._last_static
        if key is None:
            self._last_static = None
        elif last is not None and last.key is key and last.device is device:
            last.arguments = arguments  # (the same static plan as the last: no new record)
        else:
            self._last_static = _LastStatic(device, arguments, key, state)
        previous = self._selection
        options: PlanOptions = {"device": device, "use_cuda_graph": self._use_cuda_graph,
                                 "previous": None if previous is None else previous.plan}  # fmt: skip
        selection = None
        if previous is not None and tactic is None and self._replan_key == (key, backend):
            selection = replan_selection(previous, problem, batch, backend, options)
        if selection is None:
            selection = select_and_plan(
                problem,
                batch,
                backend=backend,
                tactic=tactic,
                options=options,
                previous=previous,  # eager plans may reuse its buffers too (same backend only)
            )
        # a later plan with the same static arguments, backend and no explicit tactic may take
        # this plan's fast re-plan (`replan_selection`)
        self._replan_key = None if key is None or tactic is not None else (key, backend)

        self._selection = selection
        self._batch = batch
        bound = self._bound
        if (bound is not None and bound.state is state and bound.device is device
                and bound.rows == batch.num_qo_tokens and bound.kv_rows == kv_rows
                and bound.extras_by == selection.backend.name):  # fmt: skip
            # what run() checks is unchanged (the same static problem, device, row counts and
            # backend, whose run extras the binding holds); a new plan object is all there is
            plan = selection.plan
            if bound.plan is not plan:
                bound.plan, bound.run = plan, plan.run
            return
        self._bound = _Bound(selection, state, device, batch.num_qo_tokens, kv_rows)

    # -- run ------------------------------------------------------------------------------

    def _bound_or_raise(self) -> _Bound:
        b = self._bound
        if b is None:
            raise TactixError(f"{type(self).__name__}: call plan() before run()")
        return b

    def _out(self, b: _Bound, out: torch.Tensor | None) -> torch.Tensor:
        """``out`` if it is what the plan writes, a new one if None; an error naming it otherwise."""
        if out is None:
            return torch.empty(b.out_shape, dtype=b.out_dtype, device=b.device)
        if (out.shape != b.out_shape or out.dtype != b.out_dtype or out.device != b.device
                or not out.is_contiguous()):  # fmt: skip
            self._reject("out", out, b.out_shape, b.out_dtype, contiguous=True)
        return out

    def _call(self, b: _Bound, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor | None, return_lse: bool | None, k_scale: float | torch.Tensor | None,
              v_scale: float | torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Run the plan on checked tensors: with the run extras given and the LSE as asked."""
        if k_scale is not None or v_scale is not None or sinks is not None:
            return self._run_with_extras(b, q, k, v, out, lse, return_lse,
                                         {"k_scale": k_scale, "v_scale": v_scale, "sinks": sinks})  # fmt: skip
        if return_lse is not None or b.return_lse or lse is not None:  # (return_lse checked there)
            return self._run_with_lse(b, q, k, v, out, lse, return_lse, {})
        b.run(q, k, v, out, None)
        return out

    def _run_with_extras(
        self,
        b: _Bound,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        return_lse: bool | None,
        given: dict[str, Any],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Validate the run extras given (not None), drop the neutral ones, refuse those the
        plan's backend does not take, and run with the rest by keyword."""
        extras: dict[str, Any] = {}
        known = definition(self._op).extras
        for name, value in given.items():
            if value is None:
                continue
            extra = known[name]
            value = extra.validate(value, name, b.device, b.state.problem)
            if extra.neutral(value):
                continue
            if name not in b.extras:
                problem = b.state.problem  # the static problem: what the advice depends on
                takes = [x.name for x in get_registry().active(self._op)
                         if name in x.run_extras(problem) and not x.static_reasons(problem)]  # fmt: skip
                raise InvalidArgumentError(
                    name,
                    f"{extra.without}: backend '{b.extras_by}' does not take {name} ({extra.summary}); backends that "
                    f"take it and can serve this problem: {', '.join(takes) or 'none here'} (make the wrapper "
                    f"with run_extras=('{name}',), or backend=..., to plan with one)",
                    value if not isinstance(value, torch.Tensor) else "a tensor",
                )
            extras[name] = value
        return self._run_with_lse(b, q, k, v, out, lse, return_lse, extras)

    def _run_with_lse(
        self,
        b: _Bound,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        return_lse: bool | None,
        extras: dict[str, Any],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if return_lse is not None:
            flag(return_lse, "return_lse")
        want = (b.return_lse if return_lse is None else return_lse) or lse is not None
        if want and not b.return_lse:
            raise InvalidArgumentError(
                "return_lse", "False as planned (pass return_lse=True to plan() for the LSE)", True
            )
        if not want and not b.return_lse:
            b.run(q, k, v, out, None, **extras)
            return out
        if lse is None:
            lse = torch.empty(b.lse_shape, dtype=torch.float32, device=b.device)
        elif (
            not isinstance(lse, torch.Tensor)
            or lse.shape != b.lse_shape
            or lse.dtype != torch.float32
            or lse.device != b.device
            or not lse.is_contiguous()
        ):
            self._reject("lse", lse, b.lse_shape, torch.float32, contiguous=True)
        b.run(q, k, v, out, lse, **extras)
        return (out, lse) if want else out

    def _q_rows(self, rows: int) -> str:
        """What ``q``'s ``rows`` are, for its error in ``run()`` ("" where the shape says it all)."""
        return ""

    def _bound_device(self) -> torch.device | None:
        return None if self._bound is None else self._bound.device

    def _reject(self, name: str, t: object, shape: torch.Size, dtype: torch.dtype, contiguous: bool = False) -> None:
        expected = f"a contiguous {dtype} tensor" if contiguous else f"a {dtype} tensor"
        expected += f" of shape {tuple(shape)}{self._q_rows(shape[0]) if name == 'q' else ''} on {self._bound_device()}"
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(name, expected, type(t).__name__)
        got = f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
        if contiguous and not t.is_contiguous():
            got = "non-contiguous " + got
        raise InvalidArgumentError(name, expected, got)


class _PagedAttention(_Attention):
    _rows_name: ClassVar[str]

    def __init__(
        self,
        kv_layout: KVLayout = "NHD",
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        use_cuda_graph: bool = False,
        run_extras: Iterable[str] = (),
    ) -> None:
        """``run_extras``: the run extras every ``run()`` of this wrapper will pass (``("sinks",)``
        for a gpt-oss layer): plans then go only to backends that take them, so ``auto`` never
        picks one whose ``run()`` would refuse them (an extra not named here is still passed to
        a backend that takes it, and refused by one that does not)."""
        if kv_layout not in _LAYOUTS:
            raise InvalidArgumentError("kv_layout", "'NHD' or 'HND'", repr(kv_layout))
        super().__init__(backend=backend, device=device, use_cuda_graph=use_cuda_graph, run_extras=run_extras)
        self.kv_layout: KVLayout = kv_layout
        self._batch: PagedBatch | None = None
        # caches run() has validated for the current plan, by id(k): (weakref k, weakref v)
        self._accepted: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}
        self._splits: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, torch.Tensor]] = {}

    # -- plan -----------------------------------------------------------------------------

    def _plan(
        self,
        qo_indptr: torch.Tensor | None,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        arguments: tuple[Any, ...],
        backend: str | None,
        tactic: Tactic | dict[str, Any] | str | None,
        mask: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    ) -> None:
        """``arguments``: ``op`` and the static plan arguments, in `_ARGUMENT_NAMES` order;
        ``mask``: ``(custom_mask, packed_custom_mask)`` when ``arguments`` say ``masked``."""
        explicit, last = self._device, self._last_static
        key: tuple[Any, ...] | None
        state: _Static[Any] | None
        if (tactic is None and backend is None and last is not None and last.device is explicit
                and all(map(operator.is_, arguments, last.arguments))):  # fmt: skip
            # the common re-plan, inline (two calls cost about 0.4 us): the wrapper's concrete
            # device and backend argument (as the last plan, which `_choices` checked), no tactic,
            # the very same static argument objects as the last plan
            device, chosen_backend, chosen_tactic, key, state = explicit, self._backend, None, last.key, last.state
        else:
            device, chosen_backend, chosen_tactic = self._choices(backend, tactic, qo_indptr, paged_kv_indptr,
                                                                  paged_kv_indices, paged_kv_last_page_len)  # fmt: skip
            # a re-plan with the static arguments of an earlier plan validates only the batch
            key, state = self._remembered(device, self.kv_layout, arguments)
        if state is not None:
            batch = _build_batch(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                 state.problem.page_size, device, state.problem.causal,
                                 1 if qo_indptr is not None else state.problem.max_qo_len)  # fmt: skip
            if mask is not None:
                batch = batch.with_custom_mask(*mask, device)
            problem = _sized(state.problem, batch)
        else:
            problem, batch = attention_problem(
                arguments[0],
                device=device,
                kv_layout=self.kv_layout,
                qo_indptr=qo_indptr,
                paged_kv_indptr=paged_kv_indptr,
                paged_kv_indices=paged_kv_indices,
                paged_kv_last_page_len=paged_kv_last_page_len,
                **_static_arguments(arguments),
                custom_mask=None if mask is None else mask[0],
                packed_custom_mask=None if mask is None else mask[1],
                run_extras=self._run_extras,
            )
            layout, heads, page = problem.kv_layout, problem.num_kv_heads, problem.page_size
            state = _Static(problem, torch.Size(page_shape(layout, page, heads, problem.head_dim_qk)),
                            torch.Size(page_shape(layout, page, heads, problem.head_dim_vo)))  # fmt: skip
            self._remember(key, state)
        self._select(problem, batch, device, arguments, key, state, chosen_backend, chosen_tactic)
        self._accepted.clear()  # page bounds are per batch: caches are checked again

    # -- run ------------------------------------------------------------------------------

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned batch. Returns ``out``, or ``(out, lse)`` with the LSE.

        Every tensor must be on the plan's device (``q``, the cache, ``out``, ``lse``);
        ``return_lse`` is None (as planned) or a bool.

        ``sinks`` (gpt-oss, StreamingLLM): a float32 tensor ``[num_qo_heads]`` of logits, one per
        query head, in the units of the scaled (and soft-capped) logits; each joins its head's
        softmax denominator as a key with no value: ``out = sum_j exp(s_j) v_j / (sum_j exp(s_j) +
        exp(sink))``. The LSE then includes it, ``log(sum_j exp(s_j) + exp(sink))``, so a part
        computed with the sinks merges exactly (`tactix.merge_state`) with parts computed
        without. A backend takes it only if it declares it (``run_extras``).

        ``k_scale`` and ``v_scale`` dequantize the cache: logits are ``(q . k) * k_scale *
        sm_scale`` and the output attends ``v * v_scale``. Each is None (1.0), a finite float
        > 0, or a float32 tensor of one element on the plan's device (read by the kernel, so a
        captured graph replays with the value it holds then). A backend takes them only if it
        declares them (``run_extras``); a scale other than 1.0 for one that does not is refused.
        """
        b = self._bound
        if b is None:
            raise TactixError(f"{type(self).__name__}: call plan() before run()")
        device = b.device
        # Plain attribute comparisons only (about 1 us in all), inline (a method call costs about
        # 0.05 us); whatever fails them goes to a slow path that raises an error saying what was
        # expected. Devices are compared whole: get_device() is -1 for the CPU and for meta
        # tensors alike, which would pass a meta q.
        try:
            if q.shape != b.q_shape or q.dtype != b.q_dtype or q.device != device:
                self._reject("q", q, b.q_shape, b.q_dtype)
            if type(paged_kv_cache) is tuple:
                k, v = paged_kv_cache
            else:
                split = self._splits.get(id(paged_kv_cache))
                if split is not None and split[0]() is paged_kv_cache:
                    k, v = split[1], split[2]
                else:
                    k, v = self._split(paged_kv_cache)
            seen = self._accepted.get(id(k))
            if seen is None or seen[0]() is not k or seen[1]() is not v:
                self._accept_cache(k, v)
            if out is None or out.shape != b.out_shape or out.dtype != b.out_dtype or out.device != device:
                out = self._out(b, out)  # a new one, or the error naming it
            elif not out.is_contiguous():
                self._reject("out", out, b.out_shape, b.out_dtype, contiguous=True)
        except TactixError:
            raise
        except (AttributeError, TypeError, ValueError):
            self._diagnose(q, paged_kv_cache, out)
            raise
        if (k_scale is None and v_scale is None and sinks is None and lse is None and return_lse is None
                and not b.return_lse):  # fmt: skip
            b.run(q, k, v, out, None)  # the common call, without a frame more (`_call` does the rest)
            return out
        return self._call(b, q, k, v, out, lse, return_lse, k_scale, v_scale, sinks)

    def _diagnose(self, q: object, cache: object, out: object) -> None:
        """Name the argument that is not a tensor (or a well-formed cache); called on a type error."""
        b = self._bound
        assert b is not None
        if not isinstance(q, torch.Tensor):
            self._reject("q", q, b.q_shape, b.q_dtype)
        k, v = self._split(cache)
        self._accept_cache(k, v)
        if out is not None and not isinstance(out, torch.Tensor):
            self._reject("out", out, b.out_shape, b.out_dtype, contiguous=True)

    def _split(self, cache: object) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(cache, (tuple, list)):
            if len(cache) != 2 or not all(isinstance(t, torch.Tensor) for t in cache):
                raise InvalidArgumentError(
                    "paged_kv_cache",
                    "a (k, v) tuple of tensors or one 5-D tensor",
                    f"a {type(cache).__name__} of {len(cache)}",
                )
            return cache[0], cache[1]
        if not isinstance(cache, torch.Tensor):
            raise InvalidArgumentError(
                "paged_kv_cache", "a (k, v) tuple of tensors or one 5-D tensor", type(cache).__name__
            )
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise InvalidArgumentError(
                "paged_kv_cache",
                f"a 5-D tensor [num_pages, 2, {', '.join(self._layout_names())}]",
                f"shape {tuple(cache.shape)}",
            )
        k, v = cache.unbind(1)
        # remember the views (a 5-D split costs about 1.5 us) until the cache object dies
        splits = self._splits
        if len(splits) >= 256:
            splits.clear()
        key = id(cache)

        def forget(_: object, key: int = key) -> None:
            splits.pop(key, None)

        splits[key] = (weakref.ref(cache, forget), k, v)
        return k, v

    def _layout_names(self) -> tuple[str, str, str]:
        return page_shape(self.kv_layout, "page_size", "num_kv_heads", "head_dim")  # type: ignore[arg-type, return-value]

    def _reject_cache(self, name: str, t: object, tail: torch.Size) -> None:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"paged_kv_cache ({name})", "a torch.Tensor", type(t).__name__)
        names = self._layout_names()
        layout = ", ".join(f"{n}={s}" for n, s in zip(names, tail, strict=True))
        b = self._bound
        assert b is not None
        expected = f"a {b.kv_dtype} tensor [num_pages, {layout}] ({self.kv_layout}) on {b.device}"
        got = f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
        page_axis = 1 if self.kv_layout == "NHD" else 2
        if t.dim() == 4 and t.shape[page_axis] != tail[page_axis - 1]:
            other = "HND" if self.kv_layout == "NHD" else "NHD"
            swapped = torch.Size((tail[1], tail[0], tail[2]))  # page size and kv heads trade places
            if t.shape[1:] == swapped:
                raise InvalidArgumentError(
                    f"paged_kv_cache ({name})",
                    f"in the wrapper's kv_layout='{self.kv_layout}': {expected}",
                    f"shape {tuple(t.shape)}, the {other} layout of that cache; make the wrapper with "
                    f"kv_layout='{other}' for an {other} cache",
                )
            raise InvalidArgumentError(
                "page_size",
                f"the cache's page size ({t.shape[page_axis]} in {name}, read in the wrapper's "
                f"kv_layout='{self.kv_layout}' [num_pages, {', '.join(names)}]; if the cache is {other}, "
                f"make the wrapper with kv_layout='{other}')",
                tail[page_axis - 1],
            )
        raise InvalidArgumentError(f"paged_kv_cache ({name})", expected, got)

    def _accept_cache(self, k: object, v: object) -> None:
        """Validate a (k, v) pair run() has not seen under this plan, then remember it."""
        b = self._bound
        assert b is not None
        for name, t, tail in (("k", k, b.k_tail), ("v", v, b.v_tail)):
            if (
                not isinstance(t, torch.Tensor)
                or t.dim() != 4
                or t.shape[1:] != tail
                or t.dtype != b.kv_dtype
                or t.device != b.device
            ):
                self._reject_cache(name, t, tail)
        assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        pages = k.shape[0]
        if v.shape[0] != pages:
            raise InvalidArgumentError("paged_kv_cache", f"k and v with the same number of pages ({pages})", v.shape[0])
        assert self._batch is not None
        self._batch.check_page_bounds(pages)
        # Remember the pair until either tensor dies, so later runs skip these checks: a cache
        # is allocated once and reused, and its shape, dtype and device cannot change without
        # it becoming a new tensor object (in-place resize_/set_ of a live cache is not supported).
        accepted = self._accepted
        if len(accepted) >= 1024:
            accepted.clear()
        key = id(k)

        def forget(_: object, key: int = key) -> None:
            accepted.pop(key, None)

        accepted[key] = (weakref.ref(k, forget), weakref.ref(v, forget))


class PagedPrefill(_PagedAttention):
    """Batch prefill/append attention over a paged KV cache.

    Examples
    --------
    >>> import torch, tactix
    >>> wrapper = tactix.PagedPrefill(kv_layout="NHD", device="cpu")
    >>> qo_indptr = torch.tensor([0, 3, 5], dtype=torch.int32)          # 2 requests: 3 and 2 new tokens
    >>> kv_indptr = torch.tensor([0, 2, 3], dtype=torch.int32)          # pages per request: 2 and 1
    >>> kv_indices = torch.tensor([4, 1, 7], dtype=torch.int32)         # any pages of the cache
    >>> last_len = torch.tensor([3, 2], dtype=torch.int32)              # kv lengths 16+3=19 and 2
    >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_len, num_qo_heads=8, num_kv_heads=2,
    ...              head_dim_qk=64, page_size=16, causal=True, q_data_type=torch.float32)
    >>> cache = torch.randn(8, 2, 16, 2, 64)                            # [pages, 2, page, heads, dim]
    >>> for layer in range(2):                                          # plan once, run per layer
    ...     out = wrapper.run(torch.randn(5, 8, 64), cache)
    >>> out.shape, wrapper.backend
    (torch.Size([5, 8, 64]), 'torch')
    """

    _op: ClassVar[str] = "prefill"

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
        *,
        head_dim_vo: int | None = None,
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
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
    ) -> None:
        """Plan a batch: validate its metadata, choose backend and tactic, build the plan.

        Parameters
        ----------
        qo_indptr : int32/int64 ``[batch_size + 1]``, CPU or device
            Query rows of request ``b`` are ``q[qo_indptr[b]:qo_indptr[b + 1]]``. A request may
            have none, the batch may not (an empty batch is refused: skip the call instead).
            Every indptr, index and length must fit int32.
        paged_kv_indptr : int32/int64 ``[batch_size + 1]``
            Request ``b`` owns pages ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b + 1]]``.
        paged_kv_indices : int32/int64 ``[>= paged_kv_indptr[-1]]``
            Page numbers in the cache, in sequence order.
        paged_kv_last_page_len : int32/int64 ``[batch_size]``
            Valid tokens in each request's last page, in ``[1, page_size]``.
        num_qo_heads, num_kv_heads, head_dim_qk, page_size : int
            ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA); ``page_size`` is at
            most `MAX_PAGE_SIZE` (65536) tokens.
        head_dim_vo : int, optional
            Head dim of V and the output (default ``head_dim_qk``).
        causal : bool
            Bottom-right aligned causal mask (see the module docstring). Every flag argument
            (``causal``, ``return_lse``, ``deterministic``) must be a bool, never 0/1 or a string.
        sm_scale : float, optional
            Logit scale (default ``1 / sqrt(head_dim_qk)``).
        window_left : int
            Sliding window: keys at most this far left of the query's position (-1: none).
        logits_soft_cap : float, optional
            ``cap * tanh(logit / cap)`` applied to scaled logits (None or 0: none).
        q_data_type, kv_data_type, o_data_type : torch.dtype or str
            kv and out default to the q dtype.
        return_lse : bool
            Plan for an LSE output as well.
        deterministic : bool
            True (the default): identical inputs give bitwise identical outputs, run after run.
            False also admits tactics whose reductions run in a varying order (cuDNN's fastest
            split-KV decode, for one), which can differ in the last bit of a few elements.
        backend : str, optional
            Overrides the wrapper's backend for this plan (``"auto"`` or a name).
        tactic : Tactic, str or dict, optional
            Run exactly this tactic (its backend must be able to serve the problem): a `Tactic`,
            the form it prints (``"torch:explicit"``, ``"torch:sdpa(impl=math)"``: what
            ``print(wrapper.tactic)`` shows), or its JSON object.
        custom_mask : bool tensor, optional
            A custom attention mask (tree attention for speculative decoding, ...), FlashInfer's
            layout: request ``b``'s ``q_len x kv_len`` matrix, row-major (True: the row attends the
            key), requests one after another, ``sum(q_len * kv_len)`` elements, on the CPU or the
            plan's device. It replaces ``causal`` (which must then be False); a sliding window and
            the soft cap still apply. A row that attends no key gives zeros (and an LSE of -inf).
        packed_custom_mask : uint8 tensor, optional
            The same mask bit-packed: each request's bits little-endian from a byte of its own
            (``sum(ceil(q_len * kv_len / 8))`` bytes, what ``numpy.packbits(..., bitorder="little")``
            gives per request). Used instead of ``custom_mask`` when both are given.
        """
        if not isinstance(qo_indptr, torch.Tensor):
            raise InvalidArgumentError("qo_indptr", "a 1-D int32 or int64 torch.Tensor", type(qo_indptr).__name__)
        arguments = ("prefill", num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, sm_scale,
                     window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, return_lse,
                     deterministic, 1, custom_mask is not None or packed_custom_mask is not None)  # fmt: skip
        mask = None if not arguments[-1] else (custom_mask, packed_custom_mask)
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, arguments, backend, tactic,
                   mask)  # fmt: skip


class PagedDecode(_PagedAttention):
    """Batch decode attention (one query row per request, or ``q_len_per_req`` rows of a
    multi-token decode step) over a paged KV cache.

    ``q`` is ``[batch_size, num_qo_heads, head_dim_qk]``; each request attends all its keys (with
    ``q_len_per_req`` N: ``[batch_size * N, ...]``, causal among each request's N rows).

    Examples
    --------
    >>> import torch, tactix
    >>> wrapper = tactix.PagedDecode(kv_layout="HND", device="cpu")
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> wrapper.plan(i32(0, 1, 3), i32(5, 0, 2), i32(5, 8), num_qo_heads=4, num_kv_heads=4,
    ...              head_dim_qk=32, page_size=8, q_data_type=torch.float32)
    >>> k, v = torch.randn(6, 4, 8, 32), torch.randn(6, 4, 8, 32)      # HND pages
    >>> wrapper.run(torch.randn(2, 4, 32), (k, v)).shape
    torch.Size([2, 4, 32])
    """

    _rows_per_request: int = 1  # the last plan's q_len_per_req (for run()'s error on q's rows)

    _op: ClassVar[str] = "decode"

    def plan(
        self,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        *,
        head_dim_vo: int | None = None,
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
        q_len_per_req: int = 1,
    ) -> None:
        """Plan a decode batch; the arguments mean what they mean for `PagedPrefill.plan`.

        ``q_len_per_req`` > 1 plans a multi-token decode step (speculative decoding's verify
        step): ``q`` holds that many rows per request (``[batch_size * q_len_per_req, ...]``,
        request by request), the request's last ``q_len_per_req`` tokens, causal among them: row
        ``i`` attends the keys up to position ``kv_len - q_len_per_req + i``. A backend whose
        decode kernels do not take that many rows serves it through its prefill plans.
        """
        arguments = ("decode", num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, False, sm_scale,
                     window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, return_lse,
                     deterministic, q_len_per_req, False)  # fmt: skip
        self._plan(None, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, arguments, backend, tactic)
        self._rows_per_request = q_len_per_req

    def _q_rows(self, rows: int) -> str:
        n = self._rows_per_request
        return f" ({rows // n} requests x q_len_per_req {n} rows, as planned)" if n > 1 else ""
