"""The plugin contract: the pluggy hook specifications (``tactix_`` prefix) every op shares.

A backend plugin is a module or object, named by an entry point in the ``tactix.backends``
group, that implements some of these hooks with ``@tactix.hookimpl``, and the plan hook of
each op it serves (each op's module in `tactix.ops` holds that hookspec and the op's plan
protocol: ``tactix_plan_prefill``, ``tactix_plan_decode``, ``tactix_plan_ragged_prefill``,
``tactix_plan_gemm``). A backend's hooks are only ever called for that backend (the registry
resolves them per plugin), so an implementation need not compare the ``backend`` argument with
its own name, and is only asked about problems of the ops it implements. Specs only ever grow by
adding arguments, and an implementation may accept fewer arguments than its spec (``backend``
included), so plugins written against an older spec keep working.

Plan hooks return plan objects whose ``run`` is the per-layer call. ``run`` is never reached
through a hook: the unified API calls the plan directly, after allocating any missing output,
so ``run`` must not allocate, sync with the host, or call back into tactix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

import pluggy
import torch

if TYPE_CHECKING:
    from tactix.batch import Batch
    from tactix.capabilities import BackendSpec
    from tactix.ops import AnyProblem
    from tactix.tactics import Tactic

__all__ = ["PlanOptions", "ReferenceCall", "hookimpl", "hookspec"]

PROJECT = "tactix"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PlanOptions(TypedDict):
    """How a plan is to be made (the same bag for every op)."""

    device: torch.device
    use_cuda_graph: bool
    """Keep every buffer ``run`` reads at a fixed address so that ``run`` replays in a CUDA graph."""
    previous: object | None
    """The plan this one replaces on the same wrapper (its buffers may be reused), or None."""


@hookspec
def tactix_backends() -> list[BackendSpec]:  # type: ignore[empty-body]
    """Register backends: return one `BackendSpec` per backend this plugin provides.

    The entry point's name must equal the spec's name. Must not initialise CUDA.
    """


@hookspec(firstresult=True)
def tactix_environment(backend: str) -> list[str] | None:  # type: ignore[empty-body]
    """Reasons ``backend`` cannot run on this machine at all (empty list: it can)."""


@hookspec(firstresult=True)
def tactix_known_failures(backend: str) -> dict[str, str] | None:  # type: ignore[empty-body]
    """Conformance cases this backend is known to fail: case-id glob -> reason.

    In a glob ``*`` and ``?`` are wildcards and brackets are literal: ``"decode[*-p1-*]"``.

    The conformance kit runs them as strict expected failures, so a fix is noticed.
    """


@hookspec(firstresult=True)
def tactix_tactics(backend: str, problem: AnyProblem) -> list[Tactic] | None:  # type: ignore[empty-body]
    """The tactic space of ``backend`` for ``problem`` (the default tactic need not be listed)."""


@hookspec(firstresult=True)
def tactix_check(  # type: ignore[empty-body]
    backend: str, problem: AnyProblem, tactic: Tactic, batch: Batch | None
) -> list[str] | None:
    """Reasons ``tactic`` cannot serve ``problem`` beyond the declared capabilities ([] = ok).

    ``batch`` is the real batch when one is at hand (plan time, tuning, the conformance kit)
    and None when only the problem is known; reasons that depend on it are re-checked at plan.
    """


ReferenceCall = tuple[str, Callable[[], object]]
"""A label (say, the cuDNN plan it runs) and a call that writes ``inputs["out"]``."""


@hookspec(firstresult=True)
def tactix_references(  # type: ignore[empty-body]
    backend: str, op: str, inputs: dict[str, Any]
) -> list[ReferenceCall] | None:
    """Direct calls of the library ``backend`` wraps, made without tactix, for ``tactix bench``.

    The bench times them beside the backend on the same inputs with the same timer (and checks
    their output), so what the unified API costs over calling the library by hand is measured
    in one run. Return one call per variant worth timing (the bench reports the fastest), [] or
    None for none. Optional; only benchmarks call it.

    ``inputs`` for ``prefill``/``decode``: ``q [tokens, qo_heads, dim]``, ``k_cache``/``v_cache``
    (HND: ``[pages, kv_heads, page_size, dim]``), the CSR metadata as int32 CPU tensors
    ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, ``causal``,
    ``sm_scale`` and ``out``. For ``gemm``: ``a``, ``b``, ``out``, ``scale_a``, ``scale_b``
    (None unless fp8).
    """


@hookspec(firstresult=True)
def tactix_warmup(  # type: ignore[empty-body]
    backend: str, arch: str | None, progress: Callable[[int, int, str], None] | None
) -> int | None:
    """Compile ahead of time what ``backend``'s default tactics need (``tactix warmup NAME``).

    ``arch`` names a target such as ``"sm_90"`` (None: the current GPU's); ``progress(done,
    total, label)`` is called after each item. Returns how many items were compiled now (items
    found in a cache do not count). Optional: a backend with nothing to compile omits it.
    """


def __getattr__(name: str) -> Any:
    # the op-specific names that lived here before each op got its module (tactix.ops): old
    # imports keep working; new code imports them from tactix or tactix.ops
    from tactix import ops

    if name in ("AttentionPlan", "GemmPlan"):
        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
