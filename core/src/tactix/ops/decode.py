"""The decode op: one query row per request over a paged KV cache, or a few (multi-token decode:
speculative decoding's verify step), causal among them.

Its problem model, its plan hookspec and its registry entry; the capabilities and the plan
protocol are those of every paged-attention op (`tactix.ops.attention`). A backend whose decode
capabilities do not take a problem's rows per request (``max_q_len_per_req``) but which serves
prefill is handed the equivalent prefill problem instead (`as_prefill`, the registry's
``served_through``): every prefill backend serves multi-token decode.
"""

from __future__ import annotations

import functools
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
from tactix.ops.prefill import PrefillProblem
from tactix.tactics import Tactic

__all__ = ["DEFINITION", "DecodeProblem", "as_prefill", "tactix_plan_decode"]


class DecodeProblem(AttentionProblem):
    """``q_len_per_req`` query rows per request (usually one) over a paged KV cache: the last
    ``q_len_per_req`` tokens of each request, row ``i`` attending the keys up to position
    ``kv_len - q_len_per_req + i`` (causal among the new rows, as a chunked prefill aligns them)."""

    op: ClassVar[str] = "decode"
    ragged_queries: ClassVar[bool] = False
    dynamic: ClassVar[tuple[str, ...]] = ("batch_size", "max_kv_len")
    implicit: ClassVar[tuple[str, ...]] = ("q_len_per_req", "run_extras")

    q_len_per_req: int = Field(default=1, ge=1, description="query rows per request (multi-token decode: > 1)")

    @property
    def causal(self) -> bool:
        """Whether rows are masked causally: only among several rows per request (one row attends
        every key of its request). `PrefillProblem.causal`'s twin, so code over both reads it."""
        return self.q_len_per_req > 1

    @property
    def max_qo_len(self) -> int:
        """Query rows per request (`PrefillProblem.max_qo_len`'s twin)."""
        return self.q_len_per_req

    @property
    def num_qo_tokens(self) -> int:
        """Query rows of the batch (`PrefillProblem.num_qo_tokens`'s twin)."""
        return self.batch_size * self.q_len_per_req

    def masking_reasons(self, caps: AttentionCapabilities) -> list[str]:
        most = caps.max_q_len_per_req
        if most is not None and self.q_len_per_req > most:
            return [f"{self.q_len_per_req} query rows per request (multi-token decode) above {most}"]
        return []

    def _label(self) -> str:
        label = super()._label()
        return label + f"-q{self.q_len_per_req}" if self.q_len_per_req > 1 else label


def as_prefill(problem: DecodeProblem, caps: AttentionCapabilities | None) -> PrefillProblem | None:
    """The prefill problem a multi-token decode ``problem`` is, for a backend whose decode
    capabilities (``caps``; None: it has none) do not take its rows per request; None when its
    decode plans serve it. The batch is the same (its ``qo_indptr`` steps by ``q_len_per_req``)."""
    if problem.q_len_per_req == 1 or (caps is not None and not problem.masking_reasons(caps)):
        return None
    return _prefill_of(problem)


@functools.lru_cache(maxsize=256)
def _prefill_of(problem: DecodeProblem) -> PrefillProblem:
    """`as_prefill`'s problem (remembered: a re-plan of the same sizes asks again)."""
    n = problem.q_len_per_req
    fields = dict(problem.__dict__)
    del fields["q_len_per_req"]
    return PrefillProblem(**fields, causal=True, num_qo_tokens=problem.batch_size * n, max_qo_len=n)


@hookspec(firstresult=True)
def tactix_plan_decode(  # type: ignore[empty-body]
    backend: str,
    problem: DecodeProblem,
    batch: PagedBatch,
    tactic: Tactic,
    options: PlanOptions,
) -> AttentionPlan | None:
    """Plan a decode batch (``problem.q_len_per_req`` query rows per request; more than one only
    where the backend's decode capabilities declare ``max_q_len_per_req``)."""


SMALL_BATCH = 8
"""Decode batches of at most this many requests are latency-bound (one short wave): a shape
class of their own in the untuned order (a power of two, so that a class is a class of buckets)."""
LARGE_BATCH = 128
"""Decode batches of more than this many requests fill the GPU many times over, with short
caches per request at a serving engine's memory: a class of their own (D3, b256 kv 2048, is
the suite's case; cuDNN leads it eagerly on H100 and H200 by 3-5 % where cuda_native leads the
batches below)."""


def untuned_class(problem: DecodeProblem) -> str:
    """Decode's shape class for the untuned order (`OpDefinition.untuned_class`): the cache's
    kind, one row or several per request, and the batch: small, large, or between."""
    words = attention_class(problem)
    words.append("1 row" if problem.q_len_per_req == 1 else "rows > 1")
    b = problem.batch_size
    if b <= SMALL_BATCH:
        words.append(f"batch <= {SMALL_BATCH}")
    elif b <= LARGE_BATCH:
        words.append(f"batch {SMALL_BATCH + 1}-{LARGE_BATCH}")
    else:
        words.append(f"batch > {LARGE_BATCH}")
    return ", ".join(words)


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
    served_through=("prefill", as_prefill),
    untuned_class=untuned_class,
    summary="paged-KV attention of one query row per request (or a few: multi-token decode)",
)
