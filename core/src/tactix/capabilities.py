"""What a backend declares it can do: a `BackendSpec` with one capabilities model per op.

Capabilities are the static part of a backend's support; ``reasons(problem)`` turns them into
the reasons a problem falls outside them, so every backend's ``check`` starts from the same
wording. The conformance kit generates its cases from these models and the support matrix is
generated from them; ``auto`` selection skips backends whose capabilities exclude a problem.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tactix.dtypes import DTypeName
from tactix.problems import (
    DecodeProblem,
    GemmProblem,
    KVLayout,
    Op,
    PrefillProblem,
    Problem,
)

__all__ = [
    "AttentionCapabilities",
    "BackendSpec",
    "Capabilities",
    "CudaGraphSupport",
    "GemmCapabilities",
    "GemmDTypes",
]

CudaGraphSupport = Literal["none", "fixed_buffers"]
"""``fixed_buffers``: ``run()`` captures in a CUDA graph when planned with ``use_cuda_graph=True``."""


def _fmt(values: frozenset[object] | set[object]) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values, key=str)) + "}"


class _CapabilitiesBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: frozenset[str] = Field(description="torch device types the backend runs on")
    compute_capabilities: frozenset[str] | None = Field(
        default=None, description="CUDA compute capabilities as 'major.minor'; None: any"
    )
    cuda_graph: CudaGraphSupport = "none"

    def _device_reasons(self, problem: Problem) -> list[str]:
        if problem.device_type not in self.devices:
            return [f"device '{problem.device_type}' not in {_fmt(set(self.devices))}"]
        return []


class AttentionCapabilities(_CapabilitiesBase):
    """Declared support of a paged prefill or decode implementation."""

    q_dtypes: frozenset[DTypeName]
    kv_dtypes: frozenset[DTypeName]
    out_dtypes: frozenset[DTypeName]
    head_dims: frozenset[int] | None = Field(description="supported head dims; None: any")
    different_vo_head_dim: bool = Field(default=False, description="head_dim_vo may differ from head_dim_qk")
    page_sizes: frozenset[int] | None = Field(description="supported page sizes; None: any")
    kv_layouts: frozenset[KVLayout]
    max_gqa_ratio: int | None = Field(default=None, description="None: any ratio")
    causal: bool = True
    non_causal: bool = True
    chunked: bool = Field(default=True, description="prefill with kv longer than q (bottom-right causal alignment)")
    sliding_window: bool = False
    logits_soft_cap: bool = False
    lse: bool = False

    def reasons(self, problem: PrefillProblem | DecodeProblem) -> list[str]:
        """Why ``problem`` falls outside these capabilities (empty list: it does not)."""
        out = self._device_reasons(problem)
        if problem.q_dtype not in self.q_dtypes:
            out.append(f"q dtype {problem.q_dtype} not in {_fmt(set(self.q_dtypes))}")
        if problem.kv_dtype not in self.kv_dtypes:
            out.append(f"kv dtype {problem.kv_dtype} not in {_fmt(set(self.kv_dtypes))}")
        if problem.out_dtype not in self.out_dtypes:
            out.append(f"out dtype {problem.out_dtype} not in {_fmt(set(self.out_dtypes))}")
        if self.head_dims is not None:
            for name in ("head_dim_qk", "head_dim_vo"):
                value = getattr(problem, name)
                if value not in self.head_dims:
                    out.append(f"{name} {value} not in {_fmt(set(self.head_dims))}")
        if not self.different_vo_head_dim and problem.head_dim_qk != problem.head_dim_vo:
            out.append("head_dim_vo must equal head_dim_qk")
        if self.page_sizes is not None and problem.page_size not in self.page_sizes:
            out.append(f"page size {problem.page_size} not in {_fmt(set(self.page_sizes))}")
        if problem.kv_layout not in self.kv_layouts:
            out.append(f"kv layout {problem.kv_layout} not in {_fmt(set(self.kv_layouts))}")
        if self.max_gqa_ratio is not None and problem.gqa_ratio > self.max_gqa_ratio:
            out.append(f"GQA ratio {problem.gqa_ratio} above {self.max_gqa_ratio}")
        if isinstance(problem, PrefillProblem):
            if problem.causal and not self.causal:
                out.append("causal masking not supported")
            if not problem.causal and not self.non_causal:
                out.append("non-causal prefill not supported")
        if problem.window_left >= 0 and not self.sliding_window:
            out.append("sliding window (window_left >= 0) not supported")
        if problem.logits_soft_cap > 0 and not self.logits_soft_cap:
            out.append("logits soft-cap not supported")
        if problem.return_lse and not self.lse:
            out.append("LSE output not supported")
        return out


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


class GemmCapabilities(_CapabilitiesBase):
    """Declared support of a GEMM implementation."""

    dtypes: frozenset[GemmDTypes]
    a_m_major: bool = Field(default=True, description="accepts an m-major (transposed) a")
    b_n_major: bool = Field(default=True, description="accepts an n-major b")
    bias: bool = True
    batched: bool = True
    max_m: int | None = Field(default=None, description="largest m served; None: any")

    def reasons(self, problem: GemmProblem) -> list[str]:
        out = self._device_reasons(problem)
        combo = GemmDTypes(a=problem.a_dtype, b=problem.b_dtype, out=problem.out_dtype, scale_mode=problem.scale_mode)
        if combo not in self.dtypes:
            out.append(f"dtype combination {combo} not among {_fmt(set(self.dtypes))}")
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


Capabilities = AttentionCapabilities | GemmCapabilities


class BackendSpec(BaseModel):
    """What a plugin registers for one backend through ``tactix_backends``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    version: str
    description: str = ""
    prefill: AttentionCapabilities | None = None
    decode: AttentionCapabilities | None = None
    gemm: GemmCapabilities | None = None
    preference: int = Field(
        default=0,
        description="order among backends for untuned 'auto' selection: higher is tried first",
    )
    op_preference: dict[Op, int] = Field(
        default_factory=dict,
        description="per-op overrides of `preference` (a backend may be the best default for one op only)",
    )

    untested: dict[str, str] = Field(
        default_factory=dict,
        description="paths the backend declares but that were not tested on this project's hardware "
        "(label -> why); check() refuses them, and the support matrix lists them as declared, not tested",
    )

    def preference_for(self, op: Op | None) -> int:
        """The untuned 'auto' order of this backend for ``op`` (None: its general preference)."""
        return self.preference if op is None else self.op_preference.get(op, self.preference)

    @property
    def ops(self) -> list[Op]:
        return [op for op in ("prefill", "decode", "gemm") if getattr(self, op) is not None]

    def capabilities(self, op: Op) -> Capabilities | None:
        caps: Capabilities | None = getattr(self, op)
        return caps

    def reasons(self, problem: Problem) -> list[str]:
        """Static reasons from the declared capabilities (a backend's ``check`` adds its own)."""
        caps = self.capabilities(problem.op)
        if caps is None:
            return [f"backend '{self.name}' does not implement {problem.op}"]
        if isinstance(caps, GemmCapabilities):
            assert isinstance(problem, GemmProblem)
            return caps.reasons(problem)
        assert isinstance(problem, (PrefillProblem, DecodeProblem))
        return caps.reasons(problem)
