"""The plugin contract: pluggy hook specifications (``tactix_`` prefix) and the plan protocols.

A backend plugin is a module or object, named by an entry point in the ``tactix.backends``
group, that implements some of these hooks with ``@tactix.hookimpl``. Every hook except
``tactix_backends`` receives the backend name first; a plugin returns ``None`` for a name that
is not its own. Specs only ever grow by adding arguments, and an implementation may accept
fewer arguments than its spec, so plugins written against an older spec keep working.

Plan hooks return plan objects whose ``run`` is the per-layer call. ``run`` is never reached
through a hook: the unified API calls the plan directly, after allocating any missing output,
so ``run`` must not allocate, sync with the host, or call back into tactix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypedDict, runtime_checkable

import pluggy
import torch

from tactix.batch import PagedBatch
from tactix.capabilities import BackendSpec
from tactix.problems import DecodeProblem, GemmProblem, PrefillProblem, Problem
from tactix.tactics import Tactic

__all__ = [
    "AttentionPlan",
    "GemmPlan",
    "PlanOptions",
    "ReferenceCall",
    "hookimpl",
    "hookspec",
]

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


@runtime_checkable
class AttentionPlan(Protocol):
    """A planned prefill or decode batch.

    ``run(q, k_cache, v_cache, out, lse)`` writes ``out`` (and ``lse`` when it is not None) for
    every query row of the batch. ``q`` is ``[num_qo_tokens, num_qo_heads, head_dim_qk]``
    (decode: one row per request); the caches are ``[num_pages, page_size, num_kv_heads, d]``
    (NHD) or ``[num_pages, num_kv_heads, page_size, d]`` (HND), possibly strided views of one
    5-D tensor; ``out`` is ``[rows, num_qo_heads, head_dim_vo]``; ``lse`` is ``[rows,
    num_qo_heads]`` float32 natural-log log-sum-exp of the scaled (and soft-capped) logits.

    Optional fast re-plan: a plan may also define ``replan(problem, batch, options)``, returning
    the plan of a new batch or None. The core calls it instead of the selection, the check and
    the plan hook when a wrapper re-plans with the same static arguments (``problem`` differs
    only in its sizes) and this plan's tactic is still the one the selection would try first
    (see `tactix.selection.replan_selection`). The plan must then vouch for everything its
    ``tactix_check`` would say for the new sizes and return None for any batch it cannot serve
    the same way (the full path then plans it); an exception other than `InvalidArgumentError`
    also sends the batch down the full path.
    """

    tactic: Tactic
    """The concrete tactic this plan runs (never the ``default`` placeholder)."""
    built: bool
    """Whether making this plan built something expensive (a graph, a JIT compile)."""

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None: ...


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
def tactix_tactics(backend: str, problem: Problem) -> list[Tactic] | None:  # type: ignore[empty-body]
    """The tactic space of ``backend`` for ``problem`` (the default tactic need not be listed)."""


@hookspec(firstresult=True)
def tactix_check(  # type: ignore[empty-body]
    backend: str, problem: Problem, tactic: Tactic, batch: PagedBatch | None
) -> list[str] | None:
    """Reasons ``tactic`` cannot serve ``problem`` beyond the declared capabilities ([] = ok).

    ``batch`` is the real batch when one is at hand (plan time, tuning, the conformance kit)
    and None when only the problem is known; reasons that depend on it are re-checked at plan.
    """


@hookspec(firstresult=True)
def tactix_plan_prefill(  # type: ignore[empty-body]
    backend: str,
    problem: PrefillProblem,
    batch: PagedBatch,
    tactic: Tactic,
    options: PlanOptions,
) -> AttentionPlan | None:
    """Plan a prefill batch. May allocate, build graphs or compile; ``run`` may not."""


@hookspec(firstresult=True)
def tactix_plan_decode(  # type: ignore[empty-body]
    backend: str,
    problem: DecodeProblem,
    batch: PagedBatch,
    tactic: Tactic,
    options: PlanOptions,
) -> AttentionPlan | None:
    """Plan a decode batch (one query row per request)."""


@hookspec(firstresult=True)
def tactix_plan_gemm(  # type: ignore[empty-body]
    backend: str,
    problem: GemmProblem,
    tactic: Tactic,
    options: PlanOptions,
) -> GemmPlan | None:
    """Plan a GEMM."""


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
