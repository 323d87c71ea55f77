"""The prefill op: ragged queries over a paged KV cache (prefill, append, chunked prefill).

Its problem model, its plan hookspec and its registry entry; the capabilities and the plan
protocol are those of every paged-attention op (`tactix.ops.attention`).
"""

from __future__ import annotations

import sys
from typing import ClassVar

from pydantic import Field

from tactix.batch import PagedBatch
from tactix.hookspecs import PlanOptions, hookspec
from tactix.ops.attention import (
    ATTENTION_EXTRAS,
    AttentionCapabilities,
    AttentionPlan,
    AttentionProblem,
    attention_class,
    attention_tuner_inputs,
)
from tactix.ops.definition import OpDefinition
from tactix.tactics import Tactic

__all__ = ["DEFINITION", "PrefillProblem", "tactix_plan_prefill"]


class PrefillProblem(AttentionProblem):
    """Ragged queries over a paged KV cache (prefill, append, chunked prefill)."""

    op: ClassVar[str] = "prefill"
    ragged_queries: ClassVar[bool] = True
    dynamic: ClassVar[tuple[str, ...]] = ("batch_size", "num_qo_tokens", "max_qo_len", "max_kv_len")

    implicit: ClassVar[tuple[str, ...]] = ("custom_mask", "keyless_rows", "run_extras")

    causal: bool
    num_qo_tokens: int = Field(ge=0)
    max_qo_len: int = Field(ge=0)
    custom_mask: bool = Field(default=False, description="a custom mask per batch decides which keys each row attends")
    keyless_rows: bool = Field(
        default=False,
        description="causal, and a request of the batch has more query rows than keys: its first rows attend "
        "no key (their output is zeros and their LSE -inf, as FlashInfer gives)",
    )

    def masking_reasons(self, caps: AttentionCapabilities) -> list[str]:
        if self.keyless_rows and not caps.keyless_rows:
            return ["causal rows with no key (a request with more query rows than keys) not supported"]
        if self.custom_mask:
            return [] if caps.custom_mask else ["custom masks not supported"]
        if self.causal and not caps.causal:
            return ["causal masking not supported"]
        if not self.causal and not caps.non_causal:
            return ["non-causal prefill not supported"]
        return []


@hookspec(firstresult=True)
def tactix_plan_prefill(  # type: ignore[empty-body]
    backend: str,
    problem: PrefillProblem,
    batch: PagedBatch,
    tactic: Tactic,
    options: PlanOptions,
) -> AttentionPlan | None:
    """Plan a prefill batch. May allocate, build graphs or compile; ``run`` may not."""


def untuned_class(problem: PrefillProblem) -> str:
    """Prefill's shape class for the untuned order (`OpDefinition.untuned_class`): the cache's
    kind, the head dims where they differ, a custom mask."""
    return ", ".join([*attention_class(problem), *(["custom mask"] if problem.custom_mask else [])])


DEFINITION = OpDefinition(
    name="prefill",
    problem=PrefillProblem,
    capabilities=AttentionCapabilities,
    hookspecs=sys.modules[__name__],
    plan_hook="tactix_plan_prefill",
    wrapper_path="tactix.attention:PagedPrefill",
    run_extras=ATTENTION_EXTRAS,
    kit_family="attention",
    kit_cases_path="tactix.testing.cases:attention_cases",
    tuner_inputs=attention_tuner_inputs,
    untuned_class=untuned_class,
    summary="paged-KV attention of ragged query rows (prefill, append, chunked prefill)",
)
