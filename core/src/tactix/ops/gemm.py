"""The GEMM op: ``out[b, m, n] = scale_a * scale_b * (a[b, m, k] @ b[b, k, n]) + bias[n]``.

Its problem model, the capabilities a backend declares for it, its plan protocol, its plan
hookspec and its registry entry.
"""

from __future__ import annotations

import sys
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field

from tactix.capabilities import CapabilitiesBase, format_set
from tactix.dtypes import SHORT_NAMES, DTypeName, to_torch_dtype
from tactix.hookspecs import PlanOptions, hookspec
from tactix.ops.definition import OpDefinition, TunerInputs, random_tensor
from tactix.problems import ProblemBase
from tactix.tactics import Tactic

__all__ = ["DEFINITION", "GemmCapabilities", "GemmDTypes", "GemmPlan", "GemmProblem", "tactix_plan_gemm"]


class GemmProblem(ProblemBase):
    """``out[b, m, n] = scale_a * scale_b * (a[b, m, k] @ b[b, k, n]) + bias[n]``.

    ``a_k_major``: ``a`` is contiguous along k (row-major ``[m, k]``).
    ``b_k_major``: ``b`` is contiguous along k (the ``[n, k]`` weight layout of ``nn.Linear``,
    passed as its transpose).
    """

    op: ClassVar[str] = "gemm"
    dynamic: ClassVar[tuple[str, ...]] = ("m",)

    device_type: str
    m: int = Field(ge=1)
    n: int = Field(ge=1)
    k: int = Field(ge=1)
    batch: int = Field(ge=1, default=1)
    batched: bool = False
    a_dtype: DTypeName
    b_dtype: DTypeName
    out_dtype: DTypeName
    a_k_major: bool = True
    b_k_major: bool = True
    scale_mode: Literal["none", "per_tensor"] = "none"
    bias_dtype: DTypeName | None = None

    def tolerance(self) -> float:
        from tactix.testing.oracle import tolerance_for

        return tolerance_for(self.out_dtype, self.a_dtype, self.b_dtype)

    def __str__(self) -> str:
        dtype = SHORT_NAMES[self.a_dtype]
        if self.b_dtype != self.a_dtype:
            dtype += f"x{SHORT_NAMES[self.b_dtype]}"
        parts = [
            f"{dtype}->{SHORT_NAMES[self.out_dtype]}",
            f"m{self.m}n{self.n}k{self.k}",
            ("A-k" if self.a_k_major else "A-m") + ("B-k" if self.b_k_major else "B-n"),
        ]
        if self.batched:
            parts.append(f"batch{self.batch}")
        if self.scale_mode != "none":
            parts.append(self.scale_mode)
        if self.bias_dtype is not None:
            parts.append("bias")
        if self.device_type != "cuda":
            parts.append(self.device_type)
        return f"{self.op}[{'-'.join(parts)}]"


class GemmDTypes(BaseModel):
    """One supported combination of operand, output and scaling types."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    a: DTypeName
    b: DTypeName
    out: DTypeName
    scale_mode: Literal["none", "per_tensor"] = "none"

    def __str__(self) -> str:
        scaled = "" if self.scale_mode == "none" else f" ({self.scale_mode} scales)"
        return f"{self.a}x{self.b}->{self.out}{scaled}"


class GemmCapabilities(CapabilitiesBase):
    """Declared support of a GEMM implementation."""

    dtypes: frozenset[GemmDTypes]
    a_m_major: bool = Field(default=True, description="accepts an m-major (transposed) a")
    b_n_major: bool = Field(default=True, description="accepts an n-major b")
    bias: bool = True
    batched: bool = True
    max_m: int | None = Field(default=None, description="largest m served; None: any")

    def reasons(self, problem: GemmProblem) -> list[str]:  # type: ignore[override]
        out = self.device_reasons(problem)
        combo = GemmDTypes(a=problem.a_dtype, b=problem.b_dtype, out=problem.out_dtype, scale_mode=problem.scale_mode)
        if combo not in self.dtypes:
            out.append(f"dtype combination {combo} not among {format_set(self.dtypes)}")
        if not problem.a_k_major and not self.a_m_major:
            out.append("a must be k-major (row-major [m, k])")
        if not problem.b_k_major and not self.b_n_major:
            out.append("b must be k-major (a transposed [n, k] weight)")
        if problem.bias_dtype is not None and not self.bias:
            out.append("bias not supported")
        if problem.batched and not self.batched:
            out.append("batched GEMM not supported")
        if self.max_m is not None and problem.m > self.max_m:
            out.append(f"m {problem.m} above {self.max_m}")
        return out


def gemm_tuner_inputs(problem: GemmProblem, batch: None, device: torch.device, gen: torch.Generator) -> TunerInputs:
    """Random operands in the problem's layouts (``b`` scaled by ``k ** -0.5``), for timing."""
    del batch
    lead = (problem.batch,) if problem.batched else ()
    a_dtype, b_dtype = to_torch_dtype(problem.a_dtype), to_torch_dtype(problem.b_dtype)
    if problem.a_k_major:
        a = random_tensor((*lead, problem.m, problem.k), a_dtype, device, gen)
    else:
        a = random_tensor((*lead, problem.k, problem.m), a_dtype, device, gen).transpose(-1, -2)
    scale = problem.k**-0.5
    if problem.b_k_major:
        b = random_tensor((*lead, problem.n, problem.k), b_dtype, device, gen, scale).transpose(-1, -2)
    else:
        b = random_tensor((*lead, problem.k, problem.n), b_dtype, device, gen, scale)
    out_dtype = to_torch_dtype(problem.out_dtype)
    bias = random_tensor((problem.n,), out_dtype, device, gen) if problem.bias_dtype is not None else None
    fp8 = problem.scale_mode == "per_tensor"
    scale_a = torch.tensor(1.0, device=device) if fp8 else None
    scale_b = torch.tensor(1.0, device=device) if fp8 else None
    out = torch.empty(*lead, problem.m, problem.n, dtype=out_dtype, device=device)
    return TunerInputs(None, (a, b, out, bias, scale_a, scale_b), out)


@runtime_checkable
class GemmPlan(Protocol):
    """A planned GEMM: ``run`` writes ``out = scale_a * scale_b * (a @ b) + bias``."""

    tactic: Tactic
    built: bool

    def run(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None,
        scale_a: torch.Tensor | None,
        scale_b: torch.Tensor | None,
    ) -> None: ...


@hookspec(firstresult=True)
def tactix_plan_gemm(  # type: ignore[empty-body]
    backend: str,
    problem: GemmProblem,
    tactic: Tactic,
    options: PlanOptions,
) -> GemmPlan | None:
    """Plan a GEMM."""


def untuned_class(problem: GemmProblem) -> str:
    """GEMM's shape class for the untuned order (`OpDefinition.untuned_class`): the operands' kind
    and the rows (``m <= 16`` and ``m <= 64``, meaning 16 < m <= 64: a decode step's skinny
    products, where host cost decides; apart, because on an H100 the Hopper kernel of cuda_native
    leads up to m = 16 and trails cuDNN and torch by ~13 % at m = 64 in two eager runs, sessions
    23 and 26; the bounds are powers of two, so that a class is a class of buckets)."""
    kind = "fp8" if problem.a_dtype.startswith("float8") else "fp32" if problem.a_dtype == "float32" else "16-bit"
    m = problem.m
    rows = "m <= 16" if m <= 16 else "m <= 64" if m <= 64 else "m <= 1024" if m <= 1024 else "m > 1024"
    return f"{kind}, {rows}"


DEFINITION = OpDefinition(
    name="gemm",
    problem=GemmProblem,
    capabilities=GemmCapabilities,
    hookspecs=sys.modules[__name__],
    plan_hook="tactix_plan_gemm",
    wrapper_path="tactix.gemm:Gemm",
    sized_capabilities=True,
    kit_family="gemm",
    kit_cases_path="tactix.testing.cases:gemm_cases",
    tuner_inputs=gemm_tuner_inputs,
    untuned_class=untuned_class,
    summary="dense matrix products (bf16/fp16/fp32, fp8 with per-tensor scales)",
)
