"""Candidate search: measure every tactic that may serve a problem and pick the fastest correct one.

Inputs are synthetic but real-sized: random (never zero) tensors of the problem's shapes and
dtypes, and a compact cache holding exactly the batch's pages. The untuned choice (what
``auto`` or the named backend would run without a store) is measured first; its output is the
reference every other candidate must reproduce within the dtype tolerance. A candidate that
raises, runs a different tactic than the one asked for, emits a fallback warning, or computes a
different result is recorded as failed with the reason and is never timed. A winner must beat
the untuned choice by the policy's ``min_speedup``, so tuning never makes a shape slower. The
fastest candidates and the untuned choice are timed once more against each other, in blocks
that alternate between them, before the winner is picked (`_final_round`).
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from tactix import untuned_order
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.stats import bump
from tactix.autotune.store import CandidateResult, StoreEntry
from tactix.autotune.timing import host_us, interleaved, measure_with_policy
from tactix.batch import Batch
from tactix.errors import FallbackWarning, UnsupportedProblemError
from tactix.hookspecs import PlanOptions
from tactix.ops import AnyProblem, definition
from tactix.ops.definition import TunerInputs
from tactix.registry import Backend, Registry
from tactix.tactics import Tactic
from tactix.testing.oracle import relative_error

__all__ = ["tune"]


def _tolerance(problem: AnyProblem) -> float:
    return problem.tolerance()


class _Progress:
    """Progress on stderr for a problem whose tuning takes a while.

    On a terminal: one line, rewritten in place. Anywhere else (a log file, a pipe) the cursor
    controls would show up as literal ``[K``, so plain lines go out instead, at most one every
    ``LOG_INTERVAL_S``, to keep a log short.
    """

    QUIET_S: Final = 2.0  # quick problems print nothing
    LOG_INTERVAL_S: Final = 30.0

    def __init__(self, problem: AnyProblem, total: int) -> None:
        self.problem, self.total, self.start = problem, total, time.monotonic()
        self.last: float | None = None  # when a line was last written
        isatty = getattr(sys.stderr, "isatty", None)
        self.terminal = bool(isatty and isatty())

    def update(self, done: int, tactic: Tactic) -> None:
        now = time.monotonic()
        if self.last is None and now - self.start < self.QUIET_S:
            return
        line = f"tactix: tuning {self.problem} [{done}/{self.total}] {tactic}"
        if self.terminal:
            sys.stderr.write(f"\r{line}\033[K")
        elif self.last is None or now - self.last >= self.LOG_INTERVAL_S:
            sys.stderr.write(f"{line}\n")
        else:
            return
        self.last = now
        sys.stderr.flush()

    def close(self) -> None:
        if self.last is not None and self.terminal:
            sys.stderr.write("\n")


def tune(
    problem: AnyProblem,
    batch: Batch | None,
    *,
    registry: Registry,
    backend: str,
    policy: MeasurementPolicy,
    device: torch.device,
    env_hash: str,
    seed: int = 0,
) -> StoreEntry:
    """Measure the candidates for ``problem`` and return the store entry for its bucket.

    ``backend``: ``"auto"`` (every active backend competes) or a name (only its tactics).
    Raises `UnsupportedProblemError` when no candidate can serve the problem at all.
    """
    gen = torch.Generator().manual_seed(seed)
    make_inputs = definition(problem.op).tuner_inputs
    if make_inputs is None:
        raise UnsupportedProblemError(backend, problem, [f"the {problem.op} op does not define tuner inputs"])
    inputs = make_inputs(problem, batch, device, gen)
    # the run extras the problem's runs pass (`run_extras`): every candidate is timed with them
    # (a backend that does not take them fails its check), each a sample of the extra's
    known = definition(problem.op).extras
    extras = {name: known[name].sample(problem, device, gen)  # type: ignore[misc]
              for name in getattr(problem, "run_extras", ()) if known[name].sample is not None}  # fmt: skip
    # auto's competitors in the order untuned auto tries them (`untuned_order`: the measured table,
    # else the preferences), so the first default that works is the untuned choice a winner must beat
    competitors = (untuned_order.ordered(registry.active(problem.op), problem, device) if backend == "auto"
                   else [registry.get(backend)])  # fmt: skip
    candidates: list[tuple[Backend, Tactic]] = []
    refused: list[str] = []
    for b in competitors:
        default = Tactic.default(b.name)
        reasons = b.check(problem, default, inputs.batch)
        if reasons:  # a backend that cannot serve the problem offers no candidate
            refused.append(f"{b.name}: {'; '.join(reasons)}")
            continue
        candidates += [(b, t) for t in b.tactics(problem) if t.is_default or not b.check(problem, t, inputs.batch)]
    if not candidates:
        raise UnsupportedProblemError(backend, problem, refused or ["no backend is active"])

    results: list[CandidateResult] = []
    reference: torch.Tensor | None = None
    baseline: Tactic | None = None
    ran_already: set[Tactic] = set()
    calls: dict[int, Callable[[], object]] = {}  # the timed calls of the final round's contenders, by result index
    base_index = -1
    broken: dict[str, str] = {}  # backends whose default failed: their other tactics are not tried
    started = time.monotonic()
    progress = _Progress(problem, min(len(candidates), policy.max_candidates))
    tolerance = _tolerance(problem)
    for index, (b, tactic) in enumerate(candidates):
        if index >= policy.max_candidates or time.monotonic() - started > policy.max_seconds:
            why = "candidate limit" if index >= policy.max_candidates else "time budget"
            results.append(CandidateResult(tactic=tactic, status="skipped", reason=f"{why} reached"))
            continue
        if b.name in broken:
            results.append(CandidateResult(tactic=tactic, status="skipped", reason=broken[b.name]))
            continue
        progress.update(index + 1, tactic)
        outcome = _measure_one(b, tactic, problem, inputs, device, policy, reference, tolerance, ran_already, extras)
        results.append(outcome.result)
        if outcome.result.status == "ok":
            bump("candidates_measured")
            if baseline is None and tactic.is_default:
                baseline, reference = tactic, outcome.output  # the untuned choice: first default that works
                base_index = len(results) - 1
            if outcome.call is not None:
                calls[len(results) - 1] = outcome.call
                _keep_contenders(calls, results, base_index)
        elif outcome.result.status == "failed":
            bump("candidates_failed")
            if tactic.is_default:
                broken[b.name] = f"skipped: {b.name}'s default failed ({outcome.result.reason})"
    progress.close()
    bump("tuned_problems")

    ok = [r for r in results if r.status == "ok" and r.median_s is not None]
    if baseline is None or not ok:
        failures = "; ".join(f"{r.tactic}: {r.reason}" for r in results if r.status == "failed")
        raise UnsupportedProblemError(backend, problem, [f"no candidate ran correctly ({failures})"])
    finalists = _final_round(results, calls, device, policy)
    base_time = next(r.median_s for r in finalists if r.tactic == baseline)
    best = min(finalists, key=lambda r: r.median_s or float("inf"))
    assert base_time is not None and best.median_s is not None
    won = best if best.median_s * policy.min_speedup < base_time else next(r for r in finalists if r.tactic == baseline)
    # named by the tactic its plan ran (what a default resolved to), the name the wrapper reports
    winner = won.ran or won.tactic
    return StoreEntry(
        op=problem.op,
        key=problem.key(),
        key_hash=problem.key_hash(),
        tactic=winner,
        baseline=baseline,
        candidates=results,
        env_hash=env_hash,
    )


FINALISTS: Final = 3
"""The fastest candidates of the first pass timed again against each other and the untuned
choice (`_final_round`)."""


def _keep_contenders(calls: dict[int, Callable[[], object]], results: list[CandidateResult], base_index: int) -> None:
    """Drop the timed calls (and so the plans, with their workspaces) of candidates that can no
    longer reach the final round: all but the `FINALISTS` fastest so far and the untuned choice."""
    if len(calls) <= FINALISTS + 1:
        return
    ranked = sorted(calls, key=lambda i: results[i].median_s or 0.0)
    for i in ranked[FINALISTS:]:
        if i != base_index:
            del calls[i]


def _final_round(results: list[CandidateResult], calls: dict[int, Callable[[], object]], device: torch.device,
                 policy: MeasurementPolicy) -> list[CandidateResult]:  # fmt: skip
    """The contenders `_keep_contenders` left in ``calls`` (the fastest of the first pass and the
    untuned choice), timed again against each other (`timing.interleaved`: short blocks
    alternating between them), each result's median and sample count replaced by the pooled ones
    in ``results``; returned, the winner is among them. Under the eager policy on a GPU a median
    is the longer of the pooled device time and the call's host time (`timing.host_us`), what an
    eager caller pays per call and what ``tactix bench --execution eager`` ranks by: with the L2
    flushed before each timed call the host's work hides behind the flush, so device times alone
    can choose a tactic whose extra launches cost more host time than its kernels save (cuda_native's
    split G2-m16 GEMM: 2.5 us more host a call, 2.6 us more a call back to back, 0.2 us less on the
    device; benchmarks/results/h100-gemm-eager-probe-session36.log). The first pass times candidates one after
    another, each in its own state of the card (a clock falling as the card heats, the candidate
    before): a 3 % difference there is as likely the card as the kernel. A contender that raises
    now keeps its first-pass time."""
    chosen = sorted(calls)
    if len(chosen) > 1:
        pooled = interleaved([calls[i] for i in chosen], device, policy)
        eager = policy.execution == "eager" and device.type == "cuda"
        for i, samples in zip(chosen, pooled, strict=True):
            if samples:
                median = statistics.median(samples)
                if eager:  # the longer of the device time and the host time of a call (`eager_cost`)
                    median = max(median, host_us(calls[i], device) * 1e-6)
                results[i] = results[i].model_copy(update={"median_s": median, "samples": len(samples)})
    return [results[i] for i in chosen]


@dataclass
class _Outcome:
    result: CandidateResult
    output: torch.Tensor | None = None
    call: Callable[[], object] | None = None  # the timed call (ok results)


def _measure_one(
    b: Backend,
    tactic: Tactic,
    problem: AnyProblem,
    inputs: TunerInputs,
    device: torch.device,
    policy: MeasurementPolicy,
    reference: torch.Tensor | None,
    tolerance: float,
    ran_already: set[Tactic],
    extras: dict[str, Any],
) -> _Outcome:
    def failed(reason: str) -> _Outcome:
        return _Outcome(CandidateResult(tactic=tactic, status="failed", reason=reason))

    options = PlanOptions(device=device, use_cuda_graph=False, previous=None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            plan = b.plan(problem, tactic, options, inputs.batch)
    except Exception as exc:  # recorded as this candidate's failure; tuning goes on
        return failed(f"plan raised {type(exc).__name__}: {exc}")
    ran: Tactic = plan.tactic
    if ran.backend != b.name or (not tactic.is_default and ran != tactic):
        return failed(f"asked for {tactic}, the plan runs {ran}: timing it would time something else")
    if ran in ran_already and not tactic.is_default:
        return _Outcome(CandidateResult(tactic=tactic, status="skipped", reason=f"same kernel as an earlier {ran}"))
    ran_already.add(ran)
    run: Callable[..., None] = plan.run
    try:
        inputs.out.fill_(float("nan"))
        run(*inputs.args, **extras)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:
        return failed(f"run raised {type(exc).__name__}: {exc}")
    output = inputs.out.clone()
    if reference is not None:
        err = relative_error(output, reference.double())
        if not err <= tolerance:
            return failed(
                f"wrong result: relative error {err:.2e} against the untuned choice (tolerance {tolerance:.0e})"
            )
    elif not bool(torch.isfinite(output).all()):
        return failed("output has NaN or infinite values")

    def call() -> None:
        run(*inputs.args, **extras)

    try:
        timing = measure_with_policy(call, device, policy)
    except Exception as exc:
        return failed(f"run raised while timed {type(exc).__name__}: {exc}")
    return _Outcome(
        CandidateResult(tactic=tactic, ran=ran, status="ok", median_s=timing.median, samples=len(timing.samples),
                        timed_as=timing.timed_as),
        output,
        call,
    )  # fmt: skip
