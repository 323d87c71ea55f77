"""`OpDefinition`: what the core needs to know about one op, declared by that op's module."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from types import ModuleType

from tactix.capabilities import CapabilitiesBase
from tactix.problems import ProblemBase

__all__ = ["OpDefinition"]


@dataclass(frozen=True)
class OpDefinition:
    """One op of the registry (`tactix.ops.OPS`).

    Everything in core that depends on the set of ops (problem keys, `BackendSpec` keywords,
    plan dispatch, the tactic store's folders, the conformance kit, the support matrix) reads
    it from here, so a new op is its module plus one line in `tactix.ops`.
    """

    name: str
    """The op's name: its `BackendSpec` keyword, store folder, problem ``op`` and case-id prefix."""
    problem: type[ProblemBase]
    """Its problem model (frozen pydantic; ``problem.op == name``)."""
    capabilities: type[CapabilitiesBase]
    """The model a backend declares its support of the op with."""
    hookspecs: ModuleType
    """The module whose pluggy hookspecs plan the op (registered with every backend's manager)."""
    plan_hook: str
    """The name of the plan hookspec in `hookspecs`."""
    sized_capabilities: bool = False
    """Whether the capabilities read a dynamic size (GEMM's ``max_m``), so that what they say
    cannot be remembered per static problem."""
    summary: str = ""
    """One line for listings (``tactix backends``, the support matrix)."""

    @functools.cached_property
    def plan_arguments(self) -> frozenset[str]:
        """The arguments of the plan hookspec (``batch`` among them for the attention ops)."""
        return frozenset(inspect.signature(getattr(self.hookspecs, self.plan_hook)).parameters)

    def __post_init__(self) -> None:
        if self.problem.op != self.name:
            raise TypeError(f"op '{self.name}': its problem class says op '{self.problem.op}'")
        if not hasattr(self.hookspecs, self.plan_hook):
            raise TypeError(f"op '{self.name}': {self.hookspecs.__name__} has no hookspec {self.plan_hook}")
