"""The op registry: every op tactix serves, each defined by one module of this package.

`OPS` maps an op's name to its `OpDefinition` (problem model, capabilities model, plan hookspec);
everything in core that depends on the set of ops iterates it. Adding an op is a module here
(its problem, capabilities, plan protocol and plan hookspec, and its ``DEFINITION``), a line
below, and the op's user-facing wrapper; backends then implement its plan hook.

==========  =====================================  ================================
op          problem                                capabilities
==========  =====================================  ================================
prefill     `PrefillProblem` (ops/prefill.py)      `AttentionCapabilities`
decode      `DecodeProblem` (ops/decode.py)        `AttentionCapabilities`
gemm        `GemmProblem` (ops/gemm.py)            `GemmCapabilities`
==========  =====================================  ================================
"""

from __future__ import annotations

from typing import Final, Literal

from tactix.errors import InvalidArgumentError
from tactix.ops import decode, gemm, prefill
from tactix.ops.attention import AttentionCapabilities, AttentionPlan, AttentionProblem
from tactix.ops.decode import DecodeProblem
from tactix.ops.definition import OpDefinition
from tactix.ops.gemm import GemmCapabilities, GemmDTypes, GemmPlan, GemmProblem
from tactix.ops.prefill import PrefillProblem

__all__ = [
    "OPS",
    "AttentionCapabilities",
    "AttentionPlan",
    "AttentionProblem",
    "Capabilities",
    "DecodeProblem",
    "GemmCapabilities",
    "GemmDTypes",
    "GemmPlan",
    "GemmProblem",
    "Op",
    "OpDefinition",
    "PrefillProblem",
    "Problem",
    "definition",
]

OPS: Final[dict[str, OpDefinition]] = {m.DEFINITION.name: m.DEFINITION for m in (prefill, decode, gemm)}
"""Every op, by name, in the order listings show them."""

Op = Literal["prefill", "decode", "gemm"]
"""An op's name (for type checkers; `OPS` is the registry)."""
Problem = PrefillProblem | DecodeProblem | GemmProblem
Capabilities = AttentionCapabilities | GemmCapabilities

assert tuple(OPS) == Op.__args__, "Op must list the registry's ops"  # type: ignore[attr-defined]


def definition(op: str) -> OpDefinition:
    """The registry entry of ``op``; an error naming the ops otherwise."""
    found = OPS.get(op)
    if found is None:
        raise InvalidArgumentError("op", f"one of {', '.join(repr(o) for o in OPS)}", repr(op))
    return found
