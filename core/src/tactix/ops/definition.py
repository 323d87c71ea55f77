"""`OpDefinition`: what the core needs to know about one op, declared by that op's module."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tactix.capabilities import CapabilitiesBase
from tactix.problems import ProblemBase

if TYPE_CHECKING:
    import torch

    from tactix.batch import Batch

__all__ = ["OpDefinition", "RunExtra", "TunerInputs", "random_tensor"]


@dataclass
class TunerInputs:
    """What the autotuner times a candidate plan on: random data of the problem's shapes."""

    batch: Batch | None
    """The batch the plan is made for (None: an op without batch metadata, like GEMM)."""
    args: tuple[Any, ...]
    """What the plan's ``run`` takes, outputs included."""
    out: torch.Tensor
    """The output ``run`` writes (compared across candidates)."""


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                  scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Normal random values (drawn on the CPU from ``gen``, so the same on every device)."""
    import torch

    data = torch.randn(shape, generator=gen, device="cpu") * scale
    return data.to(device).to(dtype)


@dataclass(frozen=True)
class RunExtra:
    """A per-call argument of an op's ``run()`` besides its tensors (a scale, a mask, sinks).

    The op declares it (`OpDefinition.run_extras`); a backend's plans receive it only when that
    backend's capabilities list it in ``run_extras``, by keyword, and only when the caller gave a
    value that changes the result. A backend that does not list it never sees it: the wrapper
    refuses the call, naming the extra and the backends that take it.
    """

    name: str
    """The keyword of the wrapper's ``run()`` and of a plan's ``run``."""
    summary: str
    """What it means, for listings and errors."""
    validate: Callable[[Any, str, Any, Any], Any]
    """``validate(value, argument, device, problem)``: the value a plan receives, or an
    `InvalidArgumentError` naming ``argument`` (``problem``: the plan's static problem, for the
    shapes an extra must have)."""
    neutral: Callable[[Any], bool] = lambda value: False
    """Whether a validated value changes nothing (``k_scale=1.0``): dropped, so a backend that
    does not take the extra serves the call anyway."""
    without: str = "None"
    """What a backend that does not take the extra accepts, for errors (``"None or 1.0"``)."""
    sample: Callable[[Any, Any, Any], Any] | None = None
    """``sample(problem, device, gen)``: a value the autotuner times a candidate's run with when
    the problem says its runs pass the extra (``problem.run_extras``); None: passed as nothing."""


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
    run_extras: tuple[RunExtra, ...] = ()
    """The per-call extras the op's ``run()`` takes (a backend opts in to each by name)."""
    wrapper_path: str = ""
    """``"module:Class"`` of the op's user-facing wrapper (`wrapper`), imported when first asked
    for (the wrappers import the registry, which imports the ops)."""
    kit_family: str = ""
    """The conformance kit's case family of the op (``"attention"``, ``"gemm"``): which suite
    tests and fixtures its cases go to (`tactix.testing.plugin.KIT_FIXTURES`)."""
    kit_cases_path: str = ""
    """``"module:function"`` giving the kit's cases of the op from a backend's declaration:
    ``cases(op, capabilities)`` (imported when the kit first asks)."""
    tuner_inputs: Callable[[Any, Any, Any, Any], TunerInputs] | None = None
    """``tuner_inputs(problem, batch, device, generator)``: the inputs the autotuner times and
    compares candidate plans on (None: the op cannot be tuned)."""
    served_through: tuple[str, Callable[[Any, Any], Any]] | None = None
    """``(other op, convert)``: ``convert(problem, capabilities)`` gives the problem of the other
    op that is the same computation on the same batch, for a backend whose capabilities of this
    op (None: it declares none) do not take ``problem`` (None: they do, or there is no such
    problem). The registry then asks the backend's hooks of the other op (check, tactics, plan)
    about it: decode's multi-token problems through prefill (`tactix.ops.decode.as_prefill`)."""

    untuned_class: Callable[[Any], str] | None = None
    """``untuned_class(problem)``: the coarse shape class of a problem (a few words, such as
    ``"16-bit kv, 1 row, batch 9-128"``) under which the untuned order table (`tactix.untuned_order`)
    keeps the measured order of backends that ``auto`` tries first; None: one class for the op."""

    def wrapper(self) -> type:
        """The op's user-facing wrapper class (`tactix.PagedPrefill`, ...)."""
        import importlib

        module, _, name = self.wrapper_path.partition(":")
        found: type = getattr(importlib.import_module(module), name)
        return found

    def kit_cases(self, capabilities: CapabilitiesBase) -> list[Any]:
        """The conformance cases of this op for ``capabilities`` (empty: the kit has none)."""
        if not self.kit_cases_path:
            return []
        import importlib

        module, _, name = self.kit_cases_path.partition(":")
        cases: list[Any] = getattr(importlib.import_module(module), name)(self.name, capabilities)
        return cases

    @functools.cached_property
    def extras(self) -> dict[str, RunExtra]:
        """`run_extras` by name."""
        return {extra.name: extra for extra in self.run_extras}

    @functools.cached_property
    def plan_arguments(self) -> frozenset[str]:
        """The arguments of the plan hookspec (``batch`` among them for the attention ops)."""
        return frozenset(inspect.signature(getattr(self.hookspecs, self.plan_hook)).parameters)

    def __post_init__(self) -> None:
        if self.problem.op != self.name:
            raise TypeError(f"op '{self.name}': its problem class says op '{self.problem.op}'")
        if not hasattr(self.hookspecs, self.plan_hook):
            raise TypeError(f"op '{self.name}': {self.hookspecs.__name__} has no hookspec {self.plan_hook}")
