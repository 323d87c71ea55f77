"""The decode op: one query row per request over a paged KV cache.

Its problem model, its plan hookspec and its registry entry; the capabilities and the plan
protocol are those of every paged-attention op (`tactix.ops.attention`).
"""

from __future__ import annotations

import sys
from typing import ClassVar

from tactix.batch import PagedBatch
from tactix.hookspecs import PlanOptions, hookspec
from tactix.ops.attention import (
    ATTENTION_EXTRAS,
    AttentionCapabilities,
    AttentionPlan,
    AttentionProblem,
    attention_tuner_inputs,
)
from tactix.ops.definition import OpDefinition
from tactix.tactics import Tactic

__all__ = ["DEFINITION", "DecodeProblem", "tactix_plan_decode"]


class DecodeProblem(AttentionProblem):
    """One query token per request over a paged KV cache."""

    op: ClassVar[str] = "decode"
    ragged_queries: ClassVar[bool] = False
    dynamic: ClassVar[tuple[str, ...]] = ("batch_size", "max_kv_len")

    @property
    def causal(self) -> bool:
        """Never: a decode row attends every key of its request (`PrefillProblem.causal`'s twin,
        so code over both reads it directly; not a field, so keys are unchanged)."""
        return False

    @property
    def max_qo_len(self) -> int:
        """One query row per request (`PrefillProblem.max_qo_len`'s twin; not a field)."""
        return 1


@hookspec(firstresult=True)
def tactix_plan_decode(  # type: ignore[empty-body]
    backend: str,
    problem: DecodeProblem,
    batch: PagedBatch,
    tactic: Tactic,
    options: PlanOptions,
) -> AttentionPlan | None:
    """Plan a decode batch (one query row per request)."""


DEFINITION = OpDefinition(
    name="decode",
    problem=DecodeProblem,
    capabilities=AttentionCapabilities,
    hookspecs=sys.modules[__name__],
    plan_hook="tactix_plan_decode",
    wrapper_path="tactix.attention:PagedDecode",
    run_extras=ATTENTION_EXTRAS,
    kit_family="attention",
    kit_cases_path="tactix.testing.cases:attention_cases",
    tuner_inputs=attention_tuner_inputs,
    summary="paged-KV attention of one query row per request",
)
