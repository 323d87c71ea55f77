"""What the attention ops share: the problem fields, the capabilities a backend declares for them,
and the plan protocol their ``run`` follows.

`AttentionProblemBase` and `AttentionCapabilitiesBase` hold what every attention op has (heads,
head dims, dtypes, masking, window, soft-cap, LSE); `AttentionProblem` and `AttentionCapabilities`
add the paged KV cache of prefill and decode (page size, layout, custom masks, rows per decode
request). Ragged-KV prefill (`tactix.ops.ragged_prefill`) builds on the bases alone.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Final, Protocol, Self, runtime_checkable

import torch
from pydantic import Field, field_validator, model_validator

from tactix.batch import PagedBatch
from tactix.capabilities import CapabilitiesBase, format_set
from tactix.dtypes import SHORT_NAMES, DTypeName, to_torch_dtype
from tactix.errors import InvalidArgumentError
from tactix.layouts import page_shape
from tactix.ops.definition import RunExtra, TunerInputs, random_tensor
from tactix.problems import KVLayout, ProblemBase
from tactix.tactics import Tactic

__all__ = [
    "ATTENTION_EXTRAS",
    "AttentionCapabilities",
    "AttentionCapabilitiesBase",
    "AttentionPlan",
    "AttentionProblem",
    "AttentionProblemBase",
    "attention_tuner_inputs",
    "query_tensors",
    "scale_value",
]


class AttentionProblemBase(ProblemBase):
    """The fields of every attention problem (the paged ops' `AttentionProblem` and ragged-KV
    prefill's `RaggedPrefillProblem` add theirs)."""

    device_type: str = Field(description="torch device type of the tensors: 'cpu', 'cuda', ...")
    num_qo_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim_qk: int = Field(ge=1)
    head_dim_vo: int = Field(ge=1)
    q_dtype: DTypeName
    kv_dtype: DTypeName
    out_dtype: DTypeName
    sm_scale: float = Field(gt=0)
    window_left: int = Field(ge=-1, description="-1: no sliding window")
    logits_soft_cap: float = Field(ge=0, description="0: no soft-cap")
    return_lse: bool
    deterministic: bool = Field(
        default=True,
        description="bitwise identical output for identical inputs (False admits faster tactics that "
        "reduce in a run-dependent order)",
    )
    batch_size: int = Field(ge=1)
    max_kv_len: int = Field(ge=1)
    run_extras: tuple[str, ...] = Field(
        default=(),
        description="the run extras every run() of the caller passes (sorted names, e.g. ('sinks',)): a backend "
        "must take them all; part of the store key when not empty, so a problem tuned with them is its own entry",
    )

    @field_validator("run_extras")
    @classmethod
    def _sorted_extras(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(value)))

    @model_validator(mode="after")
    def _heads_divide(self) -> Self:
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self

    @property
    def gqa_ratio(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def tolerance(self) -> float:
        from tactix.testing.oracle import attention_tolerance

        return attention_tolerance(self.q_dtype, self.kv_dtype, self.out_dtype)

    ragged_queries: ClassVar[bool]
    """Whether requests have any number of query rows (prefill: ``qo_indptr``) or exactly one
    (decode)."""

    def masking_reasons(self, caps: Any) -> list[str]:
        """Why ``caps`` (the op's capabilities model) cannot mask this problem as it asks (prefill:
        causal or not, a custom mask; decode: its rows per request)."""
        del caps
        return []

    def _layout_label(self) -> list[str]:
        """The label parts of where the keys live (paged: page size and layout)."""
        return []

    def _label(self) -> str:
        dims = (
            f"d{self.head_dim_qk}"
            if self.head_dim_qk == self.head_dim_vo
            else f"d{self.head_dim_qk}x{self.head_dim_vo}"
        )
        dtype = SHORT_NAMES[self.q_dtype]
        if self.kv_dtype != self.q_dtype:
            dtype += f"/{SHORT_NAMES[self.kv_dtype]}"
        parts = [dtype, f"h{self.num_qo_heads}/{self.num_kv_heads}", dims, *self._layout_label()]
        if self.ragged_queries and getattr(self, "causal", False):  # decode's rows: its own label part
            parts.append("causal")
        if getattr(self, "custom_mask", False):
            parts.append("mask")
        if getattr(self, "keyless_rows", False):
            parts.append("keyless")
        if self.window_left >= 0:
            parts.append(f"win{self.window_left}")
        if self.logits_soft_cap > 0:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.return_lse:
            parts.append("lse")
        if not self.deterministic:
            parts.append("nondet")
        if self.device_type != "cuda":
            parts.append(self.device_type)
        return "-".join(parts)

    def __str__(self) -> str:
        return f"{self.op}[{self._label()}]"


class AttentionProblem(AttentionProblemBase):
    """The fields of a paged-attention problem (`PrefillProblem` and `DecodeProblem` add theirs)."""

    page_size: int = Field(ge=1)
    kv_layout: KVLayout

    def _layout_label(self) -> list[str]:
        return [f"p{self.page_size}", self.kv_layout]


class AttentionCapabilitiesBase(CapabilitiesBase):
    """Declared support of an attention implementation: what every attention op declares."""

    q_dtypes: frozenset[DTypeName]
    kv_dtypes: frozenset[DTypeName]
    out_dtypes: frozenset[DTypeName]
    head_dims: frozenset[int] | None = Field(description="supported head dims; None: any")
    different_vo_head_dim: bool = Field(default=False, description="head_dim_vo may differ from head_dim_qk")
    max_gqa_ratio: int | None = Field(default=None, description="None: any ratio")
    causal: bool = True
    non_causal: bool = True
    chunked: bool = Field(default=True, description="prefill with kv longer than q (bottom-right causal alignment)")
    sliding_window: bool = False
    logits_soft_cap: bool = False
    lse: bool = False
    keyless_rows: bool = Field(
        default=False,
        description="causal prefill with more query rows than keys in a request: the rows before its first key "
        "give zeros and an LSE of -inf",
    )

    def _layout_reasons(self, problem: Any) -> list[str]:
        """Why the keys' storage falls outside these capabilities (paged: page size and layout)."""
        del problem
        return []

    def reasons(self, problem: AttentionProblemBase) -> list[str]:  # type: ignore[override]
        """Why ``problem`` falls outside these capabilities (empty list: it does not)."""
        out = self.device_reasons(problem)
        if problem.q_dtype not in self.q_dtypes:
            out.append(f"q dtype {problem.q_dtype} not in {format_set(self.q_dtypes)}")
        if problem.kv_dtype not in self.kv_dtypes:
            out.append(f"kv dtype {problem.kv_dtype} not in {format_set(self.kv_dtypes)}")
        if problem.out_dtype not in self.out_dtypes:
            out.append(f"out dtype {problem.out_dtype} not in {format_set(self.out_dtypes)}")
        if self.head_dims is not None:
            for name in ("head_dim_qk", "head_dim_vo"):
                value = getattr(problem, name)
                if value not in self.head_dims:
                    out.append(f"{name} {value} not in {format_set(self.head_dims)}")
        if not self.different_vo_head_dim and problem.head_dim_qk != problem.head_dim_vo:
            out.append("head_dim_vo must equal head_dim_qk")
        out += self._layout_reasons(problem)
        if self.max_gqa_ratio is not None and problem.gqa_ratio > self.max_gqa_ratio:
            out.append(f"GQA ratio {problem.gqa_ratio} above {self.max_gqa_ratio}")
        out += problem.masking_reasons(self)
        if problem.window_left >= 0 and not self.sliding_window:
            out.append("sliding window (window_left >= 0) not supported")
        if problem.logits_soft_cap > 0 and not self.logits_soft_cap:
            out.append("logits soft-cap not supported")
        if problem.return_lse and not self.lse:
            out.append("LSE output not supported")
        out += [f"run extra {name} not declared (run_extras)" for name in problem.run_extras
                if name not in self.run_extras]  # fmt: skip
        return out


class AttentionCapabilities(AttentionCapabilitiesBase):
    """Declared support of a paged prefill or decode implementation."""

    page_sizes: frozenset[int] | None = Field(description="supported page sizes; None: any")
    kv_layouts: frozenset[KVLayout]
    custom_mask: bool = Field(
        default=False, description="prefill: a custom mask per batch (FlashInfer's custom_mask / packed_custom_mask)"
    )

    max_q_len_per_req: int | None = Field(
        default=1,
        ge=1,
        description="decode: the most query rows per request (multi-token decode, causal among them; "
        "None: any). Beyond it the core plans the backend's prefill, if it has one",
    )

    def _layout_reasons(self, problem: AttentionProblem) -> list[str]:
        out = []
        if self.page_sizes is not None and problem.page_size not in self.page_sizes:
            out.append(f"page size {problem.page_size} not in {format_set(self.page_sizes)}")
        if problem.kv_layout not in self.kv_layouts:
            out.append(f"kv layout {problem.kv_layout} not in {format_set(self.kv_layouts)}")
        return out


def attention_class(problem: AttentionProblemBase) -> list[str]:
    """The shape-class words every attention op starts its `OpDefinition.untuned_class` with: the
    cache's element kind and, where they differ, the head dims."""
    kv = (
        "fp8 kv"
        if problem.kv_dtype.startswith("float8")
        else "fp32 kv"
        if problem.kv_dtype == "float32"
        else "16-bit kv"
    )
    words = [kv]
    if problem.head_dim_vo != problem.head_dim_qk:
        words.append(f"head dims {problem.head_dim_qk}/{problem.head_dim_vo}")
    return words


def query_tensors(
    problem: AttentionProblemBase, rows: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random ``q`` of ``rows`` query rows, and the ``out`` (and ``lse``, if the problem returns it)
    they fill: what the autotuner times an attention plan with, besides its keys and values."""
    q = random_tensor((rows, problem.num_qo_heads, problem.head_dim_qk), to_torch_dtype(problem.q_dtype), device, gen)
    out = torch.empty(rows, problem.num_qo_heads, problem.head_dim_vo, dtype=to_torch_dtype(problem.out_dtype),
                      device=device)  # fmt: skip
    lse = torch.empty(rows, problem.num_qo_heads, dtype=torch.float32, device=device) if problem.return_lse else None
    return q, out, lse


def attention_tuner_inputs(
    problem: AttentionProblem, batch: PagedBatch, device: torch.device, gen: torch.Generator
) -> TunerInputs:
    """Random q and a cache holding only the batch's pages (renumbered densely), for timing."""
    indices = batch.kv_indices.cpu().long()
    pages, compact = torch.unique(indices, return_inverse=True)
    small = PagedBatch.build(
        qo_indptr=batch.qo_indptr if problem.ragged_queries else None,
        q_len_per_req=getattr(problem, "q_len_per_req", 1),
        kv_indptr=batch.kv_indptr,
        kv_indices=compact.to(torch.int32),
        kv_last_page_len=batch.kv_last_page_len,
        page_size=problem.page_size,
        device=device,
        causal=getattr(problem, "causal", False),
    )
    n = max(int(pages.numel()), 1)
    hkv, s = problem.num_kv_heads, problem.page_size
    k_shape = (n, *page_shape(problem.kv_layout, s, hkv, problem.head_dim_qk))
    v_shape = (n, *page_shape(problem.kv_layout, s, hkv, problem.head_dim_vo))
    kv_dtype = to_torch_dtype(problem.kv_dtype)
    q, out, lse = query_tensors(problem, batch.num_qo_tokens, device, gen)
    k, v = random_tensor(k_shape, kv_dtype, device, gen), random_tensor(v_shape, kv_dtype, device, gen)
    return TunerInputs(small, (q, k, v, out, lse), out)


def scale_value(value: Any, argument: str, device: torch.device, problem: Any = None) -> float | torch.Tensor:
    """A dequantization scale as a plan receives it: a finite float > 0, or a float32 tensor of one
    element on the plan's device (its value is read by the kernel, so a CUDA graph replays with
    whatever it holds; it is not checked, which would wait for the device)."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32 or value.numel() != 1 or value.dim() > 1 or value.device != device:
            raise InvalidArgumentError(
                argument,
                f"a float > 0 or a float32 tensor of one element (0-d or [1]) on {device}",
                f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}",
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(argument, "a float > 0 or a one-element float32 tensor", type(value).__name__)
    scale = float(value)
    if not (scale > 0 and math.isfinite(scale)):
        raise InvalidArgumentError(argument, "a finite float > 0", value)
    return scale


def _unit(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and value == 1.0


def sinks_value(value: Any, argument: str, device: torch.device, problem: Any = None) -> torch.Tensor:
    """Attention sinks as a plan receives them: a float32 tensor ``[num_qo_heads]`` on the plan's
    device (its values are read by the kernel, never checked on the host: that would wait for the
    device, and a captured graph replays with whatever the tensor then holds)."""
    heads = getattr(problem, "num_qo_heads", None)
    expected = f"a float32 tensor [num_qo_heads{f' = {heads}' if heads is not None else ''}] on {device}"
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(argument, expected, type(value).__name__)
    if (value.dtype != torch.float32 or value.dim() != 1 or (heads is not None and value.shape[0] != heads)
            or value.device != device):  # fmt: skip
        given = f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
        raise InvalidArgumentError(argument, expected, given)
    if value.stride(0) != 1:
        raise InvalidArgumentError(argument, expected + ", contiguous", f"stride {value.stride(0)}")
    return value


def _sample_sinks(problem: Any, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Sinks for timing: a logit per query head of the size of a scaled logit."""
    return random_tensor((problem.num_qo_heads,), torch.float32, device, gen)


ATTENTION_EXTRAS: Final = (
    RunExtra("k_scale", "dequantization scale of the K cache: logits are (q . k) * k_scale * sm_scale",
             scale_value, _unit, "None or 1.0", sample=lambda problem, device, gen: 0.5),
    RunExtra("v_scale", "dequantization scale of the V cache: the output attends v * v_scale", scale_value, _unit,
             "None or 1.0", sample=lambda problem, device, gen: 0.5),
    RunExtra("sinks", "attention sinks: a logit per query head (float32 [num_qo_heads], after sm_scale and the "
             "soft-cap) that joins each row's softmax denominator with no value; the LSE includes it",
             sinks_value, sample=_sample_sinks),
)  # fmt: skip
"""The run extras of the attention ops (paged prefill and decode, ragged prefill)."""


@runtime_checkable
class AttentionPlan(Protocol):
    """A planned prefill or decode batch.

    ``run(q, k_cache, v_cache, out, lse)`` writes ``out`` (and ``lse`` when it is not None) for
    every query row of the batch. ``q`` is ``[num_qo_tokens, num_qo_heads, head_dim_qk]``
    (decode: one row per request); the caches are ``[num_pages, page_size, num_kv_heads, d]``
    (NHD) or ``[num_pages, num_kv_heads, page_size, d]`` (HND), possibly strided views of one
    5-D tensor; ``out`` is ``[rows, num_qo_heads, head_dim_vo]``; ``lse`` is ``[rows,
    num_qo_heads]`` float32 natural-log log-sum-exp of the scaled (and soft-capped) logits.

    Optional fast re-plan: a plan may also define ``replan(problem, batch, options)``, returning
    the plan of a new batch or None. The core calls it instead of the selection, the check and
    the plan hook when a wrapper re-plans with the same static arguments (``problem`` differs
    only in its sizes) and this plan's tactic is still the one the selection would try first
    (see `tactix.selection.replan_selection`). The plan must then vouch for everything its
    ``tactix_check`` would say for the new sizes and return None for any batch it cannot serve
    the same way (the full path then plans it); an exception other than `InvalidArgumentError`
    also sends the batch down the full path.

    Run extras (`ATTENTION_EXTRAS`: ``k_scale``, ``v_scale``) arrive as keyword arguments of
    ``run``, each only if the backend's capabilities list it in ``run_extras`` and the caller
    gave a value that changes the result (a scale of 1.0 is dropped): ``run(q, k_cache, v_cache,
    out, lse, k_scale=...)``. A plan whose backend lists none keeps the five-argument ``run``.
    """

    tactic: Tactic
    """The concrete tactic this plan runs (never the ``default`` placeholder)."""
    built: bool
    """Whether making this plan built something expensive (a graph, a JIT compile)."""

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None: ...
