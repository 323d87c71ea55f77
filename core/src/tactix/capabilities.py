"""What a backend declares it can do: a `BackendSpec` with one capabilities model per op.

Each op defines its capabilities model (`tactix.ops`: ``AttentionCapabilities`` for prefill
and decode, ``RaggedPrefillCapabilities``, ``GemmCapabilities``) on `CapabilitiesBase`;
``reasons(problem)`` turns a declaration into the reasons a problem falls outside it, so every
backend's ``check`` starts from the same wording. The conformance kit generates its cases from these models and the
support matrix is generated from them; ``auto`` selection skips backends whose capabilities
exclude a problem.

A `BackendSpec` takes each op's capabilities as a keyword named after the op
(``BackendSpec(name=..., version=..., decode=AttentionCapabilities(...))``); the names are the
op registry's (`tactix.ops.OPS`), so a new op needs no change here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tactix.devices import compute_capability

if TYPE_CHECKING:
    from tactix.ops import AnyProblem, Capabilities
    from tactix.problems import ProblemBase

__all__ = ["BackendSpec", "CapabilitiesBase", "CudaGraphSupport", "format_set"]

CudaGraphSupport = Literal["none", "fixed_buffers"]
"""``fixed_buffers``: ``run()`` captures in a CUDA graph when planned with ``use_cuda_graph=True``."""


def format_set(values: Iterable[object]) -> str:
    """``{a, b, c}``, sorted, for reasons and headers."""
    return "{" + ", ".join(str(v) for v in sorted(values, key=str)) + "}"


class CapabilitiesBase(BaseModel):
    """What every op's capabilities declare: devices, compute capabilities, CUDA-graph support."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: frozenset[str] = Field(description="torch device types the backend runs on")
    compute_capabilities: frozenset[str] | None = Field(
        default=None, description="CUDA compute capabilities as 'major.minor'; None: any"
    )
    cuda_graph: CudaGraphSupport = "none"
    run_extras: frozenset[str] = Field(
        default=frozenset(),
        description="the op's run extras (`OpDefinition.run_extras`: k_scale, ...) this implementation's "
        "plans take as keyword arguments of run(); the wrapper refuses the others",
    )

    def device_reasons(self, problem: ProblemBase) -> list[str]:
        """The device type, and on a GPU the current device's compute capability, against the
        declaration (the one place compute capabilities are enforced)."""
        device = getattr(problem, "device_type", None)
        if device not in self.devices:
            return [f"device '{device}' not in {format_set(self.devices)}"]
        if device == "cuda" and self.compute_capabilities is not None:
            capability = compute_capability()
            if capability is not None and "{}.{}".format(*capability) not in self.compute_capabilities:
                return [
                    f"compute capability {'{}.{}'.format(*capability)} not in {format_set(self.compute_capabilities)}"
                ]
        return []

    def reasons(self, problem: ProblemBase) -> list[str]:
        """Why ``problem`` falls outside these capabilities (empty list: it does not)."""
        return self.device_reasons(problem)


class BackendSpec(BaseModel):
    """What a plugin registers for one backend through ``tactix_backends``.

    Each op the backend implements is a keyword argument named after the op whose value is that
    op's capabilities model; ``spec.capabilities(op)`` (or ``spec.<op>``) reads it back.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    version: str
    description: str = ""
    implements: dict[str, CapabilitiesBase] = Field(
        default_factory=dict, description="op name -> that op's capabilities (given as keywords named after ops)"
    )
    preference: int = Field(
        default=0,
        description="order among backends for untuned 'auto' selection: higher is tried first",
    )
    op_preference: dict[str, int] = Field(
        default_factory=dict,
        description="per-op overrides of `preference` (a backend may be the best default for one op only)",
    )

    untested: dict[str, str] = Field(
        default_factory=dict,
        description="paths the backend declares but that were not tested on this project's hardware "
        "(label -> why); check() refuses them, and the support matrix lists them as declared, not tested",
    )

    if TYPE_CHECKING:  # op keywords come from the registry, so the signature cannot list them

        def __init__(self, **data: Any) -> None: ...

    @model_validator(mode="before")
    @classmethod
    def _ops_by_keyword(cls, data: Any) -> Any:
        """Move the op-named keywords into ``implements``, each validated as its op's model."""
        if not isinstance(data, dict):
            return data
        from tactix.ops import OPS

        data = dict(data)
        implements = dict(data.get("implements") or {})
        for op in OPS:
            if op in data:
                implements[op] = data.pop(op)
        for op, caps in list(implements.items()):
            if op not in OPS:
                raise ValueError(f"'{op}' is not an op (ops: {', '.join(OPS)})")
            if caps is None:
                del implements[op]
                continue
            caps = implements[op] = OPS[op].capabilities.model_validate(caps)
            unknown = sorted(set(caps.run_extras) - set(OPS[op].extras))
            if unknown:
                known = ", ".join(OPS[op].extras) or "none"
                raise ValueError(
                    f"{op}: run_extras names {', '.join(unknown)}, not a run extra of {op} (its extras: {known})"
                )
        for op in data.get("op_preference") or {}:
            if op not in OPS:
                raise ValueError(f"op_preference names '{op}', which is not an op (ops: {', '.join(OPS)})")
        data["implements"] = implements
        return data

    def __getattr__(self, name: str) -> Any:
        # spec.prefill, spec.gemm, ...: an op's capabilities, None if not implemented
        from tactix.ops import OPS

        if name in OPS:
            return self.implements.get(name)
        return super().__getattr__(name)  # type: ignore[misc]

    def preference_for(self, op: str | None) -> int:
        """The untuned 'auto' order of this backend for ``op`` (None: its general preference)."""
        return self.preference if op is None else self.op_preference.get(op, self.preference)

    @property
    def ops(self) -> list[str]:
        """The ops this backend implements, in the registry's order."""
        from tactix.ops import OPS

        return [op for op in OPS if op in self.implements]

    def capabilities(self, op: str) -> Capabilities | None:
        found = self.implements.get(op)
        return found  # type: ignore[return-value]  # validated as the op's own model

    def reasons(self, problem: AnyProblem) -> list[str]:
        """Static reasons from the declared capabilities (a backend's ``check`` adds its own)."""
        caps = self.implements.get(problem.op)
        if caps is None:
            return [f"backend '{self.name}' does not implement {problem.op}"]
        reasons: list[str] = caps.reasons(problem)
        return reasons


def __getattr__(name: str) -> Any:
    # the op-specific names that lived here before each op got its module (tactix.ops): old
    # imports keep working; new code imports them from tactix or tactix.ops
    from tactix import ops

    if name in ("AttentionCapabilities", "GemmCapabilities", "GemmDTypes", "Capabilities"):
        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
