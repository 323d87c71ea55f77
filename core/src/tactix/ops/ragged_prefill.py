"""The ragged-KV prefill op: ragged queries over keys and values packed per request, no pages.

Engines run the new tokens of a chunked prefill this way (their keys and values straight from
the projection, before or instead of the paged cache), and MLA's prefill over its expanded
keys; the result is merged with the paged part through the LSE (`tactix.merge_state`).

Its problem model, capabilities model, plan protocol, plan hookspec, tuner inputs and registry
entry. The fields and capabilities are those every attention op shares
(`tactix.ops.attention`), without page size or layout.
"""

from __future__ import annotations

import sys
from typing import ClassVar, Protocol, runtime_checkable

import torch
from pydantic import Field

from tactix.batch import RaggedBatch
from tactix.dtypes import to_torch_dtype
from tactix.hookspecs import PlanOptions, hookspec
from tactix.ops.attention import (
    ATTENTION_EXTRAS,
    AttentionCapabilitiesBase,
    AttentionPlan,
    AttentionProblemBase,
    attention_class,
    query_tensors,
)
from tactix.ops.definition import OpDefinition, TunerInputs, random_tensor
from tactix.ops.prefill import PrefillProblem
from tactix.tactics import Tactic

__all__ = [
    "DEFINITION",
    "RaggedPrefillCapabilities",
    "RaggedPrefillPlan",
    "RaggedPrefillProblem",
    "ragged_tuner_inputs",
    "tactix_plan_ragged_prefill",
]


class RaggedPrefillProblem(AttentionProblemBase):
    """Ragged queries over ragged keys and values: request ``b``'s query rows attend its rows
    ``kv_indptr[b]:kv_indptr[b + 1]`` of packed ``k`` and ``v`` (bottom-right causal alignment:
    query row ``i`` of a request with ``q_len`` rows and ``kv_len`` keys sits at key position
    ``kv_len - q_len + i``)."""

    op: ClassVar[str] = "ragged_prefill"
    ragged_queries: ClassVar[bool] = True
    dynamic: ClassVar[tuple[str, ...]] = ("batch_size", "num_qo_tokens", "num_kv_tokens", "max_qo_len", "max_kv_len")
    implicit: ClassVar[tuple[str, ...]] = ("keyless_rows", "run_extras")

    causal: bool
    num_qo_tokens: int = Field(ge=0)
    num_kv_tokens: int = Field(ge=1, description="rows of the packed k and v")
    max_qo_len: int = Field(ge=0)
    keyless_rows: bool = Field(
        default=False,
        description="causal, and a request of the batch has more query rows than keys: its first rows attend "
        "no key (zeros, LSE -inf)",
    )

    def masking_reasons(self, caps: AttentionCapabilitiesBase) -> list[str]:
        if self.keyless_rows and not caps.keyless_rows:
            return ["causal rows with no key (a request with more query rows than keys) not supported"]
        if self.causal and not caps.causal:
            return ["causal masking not supported"]
        if not self.causal and not caps.non_causal:
            return ["non-causal prefill not supported"]
        return []

    def as_paged_prefill(self) -> PrefillProblem:
        """The paged prefill that computes this problem: its keys and values read as an NHD cache
        of one-token pages, page ``i`` = row ``i`` of the packed k and v (`RaggedBatch.paged` is
        the batch). A backend whose paged prefill takes page size 1 can serve ragged prefill
        with it; the static part is validated once per static problem."""
        d = self.__dict__
        key = self.static_key()
        template = _PAGED.get(key)
        if template is None:
            fields = {name: d[name] for name in PrefillProblem.model_fields if name in d}
            template = PrefillProblem.model_validate({**fields, "page_size": 1, "kv_layout": "NHD"})
            if len(_PAGED) >= 64:
                _PAGED.clear()
            _PAGED[key] = template
        return template.model_copy(update={name: d[name] for name in PrefillProblem.dynamic})


_PAGED: dict[tuple[object, ...], PrefillProblem] = {}
"""`RaggedPrefillProblem.as_paged_prefill`'s static templates, by static key (cleared at 64)."""


class RaggedPrefillCapabilities(AttentionCapabilitiesBase):
    """Declared support of a ragged-KV prefill implementation: what every attention op declares
    (dtypes, head dims, masking, window, soft-cap, LSE); there are no pages to declare."""


@runtime_checkable
class RaggedPrefillPlan(AttentionPlan, Protocol):
    """A planned ragged-KV prefill batch.

    ``run(q, k, v, out, lse)`` writes ``out`` (and ``lse`` when it is not None) for every query
    row of the batch. ``q`` is ``[num_qo_tokens, num_qo_heads, head_dim_qk]``, ``k`` is
    ``[num_kv_tokens, num_kv_heads, head_dim_qk]`` and ``v`` ``[num_kv_tokens, num_kv_heads,
    head_dim_vo]``, each possibly a strided view (of a fused QKV projection, say; the last dim is
    the one a backend may ask to be dense, through its ``check``); ``out`` is ``[num_qo_tokens,
    num_qo_heads, head_dim_vo]``, contiguous; ``lse`` is ``[num_qo_tokens, num_qo_heads]`` float32
    natural-log log-sum-exp of the scaled (and soft-capped) logits. Run extras (``k_scale``,
    ``v_scale``), the optional ``replan`` and the rules on ``run`` are those of `AttentionPlan`.
    """


def ragged_tuner_inputs(
    problem: RaggedPrefillProblem, batch: RaggedBatch, device: torch.device, gen: torch.Generator
) -> TunerInputs:
    """Random q, k and v of the batch's sizes, for timing."""
    q, out, lse = query_tensors(problem, batch.num_qo_tokens, device, gen)
    kv_dtype, rows, heads = to_torch_dtype(problem.kv_dtype), batch.num_kv_tokens, problem.num_kv_heads
    k = random_tensor((rows, heads, problem.head_dim_qk), kv_dtype, device, gen)
    v = random_tensor((rows, heads, problem.head_dim_vo), kv_dtype, device, gen)
    return TunerInputs(batch, (q, k, v, out, lse), out)


@hookspec(firstresult=True)
def tactix_plan_ragged_prefill(  # type: ignore[empty-body]
    backend: str,
    problem: RaggedPrefillProblem,
    batch: RaggedBatch,
    tactic: Tactic,
    options: PlanOptions,
) -> RaggedPrefillPlan | None:
    """Plan a ragged-KV prefill batch. May allocate, build graphs or compile; ``run`` may not."""


DEFINITION = OpDefinition(
    name="ragged_prefill",
    problem=RaggedPrefillProblem,
    capabilities=RaggedPrefillCapabilities,
    hookspecs=sys.modules[__name__],
    plan_hook="tactix_plan_ragged_prefill",
    wrapper_path="tactix.ragged:RaggedPrefill",
    run_extras=ATTENTION_EXTRAS,
    kit_family="attention",
    kit_cases_path="tactix.testing.cases:ragged_cases",
    tuner_inputs=ragged_tuner_inputs,
    untuned_class=lambda problem: ", ".join(attention_class(problem)),
    summary="attention of ragged query rows over keys and values packed per request (no pages: a chunk's "
    "new tokens, MLA's expanded prefill), merged with the paged part through the LSE",
)
