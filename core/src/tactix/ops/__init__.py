"""The op registry: every op tactix serves, each defined by one module of this package.

`OPS` maps an op's name to its `OpDefinition` (problem model, capabilities model, plan hookspec);
everything in core that depends on the set of ops iterates it. Adding an op is a module here
(its problem, capabilities, plan protocol and plan hookspec, and its ``DEFINITION``), a line
below, and the op's user-facing wrapper; backends then implement its plan hook.

==============  ===============================================  ============================
op              problem                                          capabilities
==============  ===============================================  ============================
prefill         `PrefillProblem` (ops/prefill.py)                `AttentionCapabilities`
decode          `DecodeProblem` (ops/decode.py)                  `AttentionCapabilities`
ragged_prefill  `RaggedPrefillProblem` (ops/ragged_prefill.py)   `RaggedPrefillCapabilities`
gemm            `GemmProblem` (ops/gemm.py)                      `GemmCapabilities`
merge_states    `MergeProblem` (ops/merge_states.py)             `MergeCapabilities`
==============  ===============================================  ============================
"""

from __future__ import annotations

from typing import Final, Literal

from tactix.errors import InvalidArgumentError
from tactix.ops import decode, gemm, merge_states, prefill, ragged_prefill
from tactix.ops.attention import (
    AttentionCapabilities,
    AttentionCapabilitiesBase,
    AttentionPlan,
    AttentionProblem,
    AttentionProblemBase,
)
from tactix.ops.decode import DecodeProblem
from tactix.ops.definition import OpDefinition
from tactix.ops.gemm import GemmCapabilities, GemmDTypes, GemmPlan, GemmProblem
from tactix.ops.merge_states import MergeCapabilities, MergePlan, MergeProblem
from tactix.ops.prefill import PrefillProblem
from tactix.ops.ragged_prefill import RaggedPrefillCapabilities, RaggedPrefillPlan, RaggedPrefillProblem

__all__ = [
    "OPS",
    "AnyProblem",
    "AttentionCapabilities",
    "AttentionCapabilitiesBase",
    "AttentionPlan",
    "AttentionProblem",
    "AttentionProblemBase",
    "Capabilities",
    "DecodeProblem",
    "GemmCapabilities",
    "GemmDTypes",
    "GemmPlan",
    "GemmProblem",
    "MergeCapabilities",
    "MergePlan",
    "MergeProblem",
    "Op",
    "OpDefinition",
    "PrefillProblem",
    "Problem",
    "RaggedPrefillCapabilities",
    "RaggedPrefillPlan",
    "RaggedPrefillProblem",
    "definition",
]

OPS: Final[dict[str, OpDefinition]] = {
    m.DEFINITION.name: m.DEFINITION for m in (prefill, decode, ragged_prefill, gemm, merge_states)
}
"""Every op, by name, in the order listings show them."""

Op = Literal["prefill", "decode", "ragged_prefill", "gemm", "merge_states"]
"""An op's name (for type checkers; `OPS` is the registry)."""
Problem = PrefillProblem | DecodeProblem | GemmProblem
"""The problem of a paged-attention or GEMM op: what a backend that implements only those ops
receives in its shared hooks (``tactix_check``, ``tactix_tactics``), and how the shipped plugins
annotate them. It does not grow with the registry: a wider union would fail the type checks of
every plugin that tells its problems apart with ``isinstance`` and none of which serves the new
op, where a new op must cost only the plugins that serve it."""
AnyProblem = Problem | RaggedPrefillProblem | MergeProblem
"""The problem of any op of the registry (what the core's annotations take)."""
Capabilities = AttentionCapabilities | RaggedPrefillCapabilities | GemmCapabilities | MergeCapabilities

assert tuple(OPS) == Op.__args__, "Op must list the registry's ops"  # type: ignore[attr-defined]


def definition(op: str) -> OpDefinition:
    """The registry entry of ``op``; an error naming the ops otherwise."""
    found = OPS.get(op)
    if found is None:
        raise InvalidArgumentError("op", f"one of {', '.join(repr(o) for o in OPS)}", repr(op))
    return found
