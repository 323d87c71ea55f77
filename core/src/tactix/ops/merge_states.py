"""The state-merge op: attention states over disjoint key sets, each an output and its LSE,
merged into the attention over their union (`tactix.merge_state`, `merge_states`,
`merge_state_in_place`: a ragged chunk's new tokens and its cached prefix, or split-KV parts).

For each row and head, with states ``(v_i, s_i)`` (``s_i`` a natural-log LSE): ``s = log(sum_i
exp(s_i))`` and ``v = sum_i v_i exp(s_i - s)``; a state over no key (``s_i = -inf``) contributes
nothing, and rows whose states are all empty give zeros and ``-inf``. Arithmetic in float32;
``v`` keeps its dtype. With a mask, only the rows it marks are written (the in-place form that one
captured CUDA graph serves for batches that merge some rows).

Its problem model, capabilities, plan protocol, plan hookspec and registry entry.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch
from pydantic import Field

from tactix.capabilities import CapabilitiesBase, format_set
from tactix.dtypes import SHORT_NAMES, DTypeName, to_torch_dtype
from tactix.hookspecs import PlanOptions, hookspec
from tactix.ops.definition import OpDefinition, TunerInputs, random_tensor
from tactix.problems import ProblemBase
from tactix.tactics import Tactic

__all__ = ["DEFINITION", "MergeCapabilities", "MergePlan", "MergeProblem", "tactix_plan_merge_states"]


class MergeProblem(ProblemBase):
    """``num_states`` attention states of ``rows`` x ``num_heads`` rows of ``head_dim`` values
    (``v_dtype``) with float32 LSEs, merged into one; ``masked``: only the rows a bool mask marks."""

    op: ClassVar[str] = "merge_states"
    dynamic: ClassVar[tuple[str, ...]] = ("rows",)

    device_type: str
    v_dtype: DTypeName
    num_states: int = Field(ge=2)
    num_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    rows: int = Field(ge=1)
    masked: bool = False

    def tolerance(self) -> float:
        from tactix.testing.oracle import tolerance_for

        return tolerance_for(self.v_dtype)

    def __str__(self) -> str:
        parts = [SHORT_NAMES[self.v_dtype], f"n{self.num_states}", f"h{self.num_heads}", f"d{self.head_dim}",
                 f"rows{self.rows}"]  # fmt: skip
        if self.masked:
            parts.append("masked")
        if self.device_type != "cuda":
            parts.append(self.device_type)
        return f"{self.op}[{'-'.join(parts)}]"


class MergeCapabilities(CapabilitiesBase):
    """Declared support of a state-merge implementation."""

    v_dtypes: frozenset[DTypeName]
    max_states: int | None = Field(default=None, description="most states merged at once; None: any")
    max_head_dim: int | None = Field(default=None, description="largest head dim; None: any")
    masked: bool = Field(default=True, description="merges only the rows a mask marks (the in-place form)")

    def reasons(self, problem: MergeProblem) -> list[str]:  # type: ignore[override]
        out = self.device_reasons(problem)
        if problem.v_dtype not in self.v_dtypes:
            out.append(f"v dtype {problem.v_dtype} not in {format_set(self.v_dtypes)}")
        if self.max_states is not None and problem.num_states > self.max_states:
            out.append(f"{problem.num_states} states above {self.max_states}")
        if self.max_head_dim is not None and problem.head_dim > self.max_head_dim:
            out.append(f"head dim {problem.head_dim} above {self.max_head_dim}")
        if problem.masked and not self.masked:
            out.append("masked (in-place) merges not supported")
        return out


@runtime_checkable
class MergePlan(Protocol):
    """A planned merge: ``run`` writes the merge of the states ``(vs[i], ss[i])`` (``vs[i]``
    ``[rows, heads, head_dim]`` with a contiguous last dim, ``ss[i]`` float32 ``[rows, heads]``,
    any other strides; ``rows`` any number, not only the planned one) into ``out_v`` and
    ``out_s``, which may be the first state's own tensors (the in-place form). ``mask``, a bool
    ``[rows]`` tensor for a masked problem: rows it does not mark are left as they are."""

    tactic: Tactic
    built: bool

    def run(self, vs: Sequence[torch.Tensor], ss: Sequence[torch.Tensor], out_v: torch.Tensor, out_s: torch.Tensor,
            mask: torch.Tensor | None) -> None: ...  # fmt: skip


@hookspec(firstresult=True)
def tactix_plan_merge_states(  # type: ignore[empty-body]
    backend: str,
    problem: MergeProblem,
    tactic: Tactic,
    options: PlanOptions,
) -> MergePlan | None:
    """Plan a merge of attention states."""


def merge_tuner_inputs(problem: MergeProblem, batch: None, device: torch.device, gen: torch.Generator) -> TunerInputs:
    """Random states (outputs, and LSEs spread over a few units so every state weighs in)."""
    del batch
    dtype = to_torch_dtype(problem.v_dtype)
    shape = (problem.rows, problem.num_heads, problem.head_dim)
    vs = tuple(random_tensor(shape, dtype, device, gen) for _ in range(problem.num_states))
    ss = tuple(random_tensor(shape[:2], torch.float32, device, gen, scale=math.e) for _ in range(problem.num_states))
    out_v = torch.empty(shape, dtype=dtype, device=device)
    out_s = torch.empty(shape[:2], dtype=torch.float32, device=device)
    mask = torch.ones(problem.rows, dtype=torch.bool, device=device) if problem.masked else None
    return TunerInputs(None, (vs, ss, out_v, out_s, mask), out_v)


DEFINITION = OpDefinition(
    name="merge_states",
    problem=MergeProblem,
    capabilities=MergeCapabilities,
    hookspecs=sys.modules[__name__],
    plan_hook="tactix_plan_merge_states",
    wrapper_path="tactix.merge:MergeStates",
    kit_family="merge",
    kit_cases_path="tactix.testing.cases:merge_cases",
    tuner_inputs=merge_tuner_inputs,
    summary="attention states over disjoint key sets merged through their LSEs (a chunk and its prefix)",
)
