"""Choosing the (backend, tactic) that serves a problem, and the fallback policy.

Order: an explicit tactic, else an explicit backend's default, else (``auto``) a stored tactic
if a tactic source is attached, else each active backend's default, most preferred first.
An explicit choice that cannot serve raises. Under ``auto``, a stored tactic that no longer
validates or whose plan raises falls back to that backend's default and then to the next
backend, with one `FallbackWarning` naming the problem, the tactic and the cause; when the
last candidate's plan raises, that error propagates. Nothing is ever retried.

A serving engine re-plans every step with a new batch of the same shapes, so the candidates of
each (backend, problem bucket) are remembered until a stored tactic may change: a store write,
`set_tactic_source`, an ``autotune`` block entered or left (`stored_epoch`), or another registry.
A store miss that looks on disk for other processes' entries is remembered too, but asked again
every plan (a stat of the entry's file): while it stays a miss, the remembered candidates stand,
fast re-plan included; when another process has written the entry, the plan selects again. Each
candidate's ``check`` (which may depend on the batch) and plan are made every time, except on a
plan's own fast re-plan (`replan_selection`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tactix import untuned_order
from tactix.autotune.stats import bump, stored_epoch, stored_tactics_changed
from tactix.batch import Batch
from tactix.devices import checked_device
from tactix.errors import (
    BackendError,
    FallbackWarning,
    InvalidArgumentError,
    TacticError,
    TactixError,
    UnsupportedProblemError,
)
from tactix.hookspecs import PlanOptions
from tactix.ops import AnyProblem
from tactix.problems import bucket_size
from tactix.registry import Backend, Registry, get_registry
from tactix.tactics import Tactic

__all__ = ["Planned", "Selection", "replan_selection", "select_and_plan", "set_tactic_source"]

TacticSource = Callable[[AnyProblem], Tactic | None]
"""Given a problem, the stored tactic for its bucket, or None (the autotuner installs one)."""

_source: TacticSource | None = None
_warned: set[tuple[str, str, str]] = set()
_warned_lock = threading.Lock()


class Candidate(NamedTuple):
    """One (backend, tactic) the selection tries, and where the tactic came from."""

    backend: Backend
    tactic: Tactic
    source: str
    """'store' or 'default'."""


class _Remembered:
    """The candidates of one (backend argument, problem bucket), valid while the stored tactics
    (`stored_epoch`) and the registry are the ones they were found under."""

    __slots__ = ("candidates", "counter", "epoch", "recheck", "registry")

    def __init__(self, epoch: int, registry: Registry, candidates: tuple[Candidate, ...], counter: str | None,
                 recheck: bool = False) -> None:  # fmt: skip
        self.epoch = epoch
        self.registry = registry
        self.candidates = candidates
        self.counter = counter
        """The store counter their lookup bumped (bumped again per use, so counts stay per plan)."""
        self.recheck = recheck
        """Found on a store miss that looks on disk: valid while the lookup, asked again on each
        use (`_still_missed`), still misses; the lookup counts itself (``counter`` is None)."""

    def current(self) -> bool:
        return self.epoch == stored_epoch() and self.registry is get_registry()


class _ReplanNote:
    """What `replan_selection` checked for a selection: the remembered candidates and the
    buckets of the problem it checked them for (the same again: nothing to check)."""

    __slots__ = ("as_is", "buckets", "remembered")

    def __init__(self, remembered: _Remembered, buckets: tuple[int, ...], as_is: bool) -> None:
        self.remembered = remembered
        self.buckets = buckets
        self.as_is = as_is
        """Whether the backend's plans are given the problem itself (`Backend.served`)."""


_remembered: dict[tuple[Any, ...], _Remembered] = {}
"""The candidates of each (backend argument, problem bucket); cleared when it reaches 1024 entries."""


def set_tactic_source(source: TacticSource | None) -> TacticSource | None:
    """Install the function consulted for stored tactics under ``auto``; returns the old one.

    The source is asked once per problem bucket and backend: its answers are remembered until the
    next call of this function (a source gives "the stored tactic for the bucket")."""
    global _source
    old, _source = _source, source
    stored_tactics_changed()
    return old


class Selection:
    """The outcome of planning: which backend serves, with which plan."""

    __slots__ = ("backend", "plan", "problem", "replan_token", "requested", "source")

    def __init__(self, backend: Backend, plan: Any, source: str, problem: AnyProblem | None = None,
                 requested: Tactic | None = None) -> None:  # fmt: skip
        self.backend = backend
        self.plan = plan
        self.problem = problem
        """How the tactic was chosen: 'explicit', 'store', 'default' or 'fallback'."""
        self.source = source
        self.requested = requested
        """The candidate tactic that was planned (``plan.tactic`` may name a concrete one)."""
        self.replan_token: _ReplanNote | None = None
        """`replan_selection`'s note: the remembered candidates it checked, and their buckets."""


class Planned:
    """What a planned wrapper reports about its current plan (shared by attention, GEMM and the
    state merge; `PlannedOp` adds the constructor of the wrappers that take only a backend and a
    device)."""

    _selection: Selection | None = None

    @property
    def problem(self) -> Any:
        """The problem of the current plan (real sizes; ``problem.bucketed()`` is its store key)."""
        return self._chosen().problem

    @property
    def backend(self) -> str:
        """Name of the backend that serves the current plan."""
        name: str = self._chosen().backend.name
        return name

    @property
    def tactic(self) -> Tactic:
        """The concrete tactic of the current plan."""
        tactic: Tactic = self._chosen().plan.tactic
        return tactic

    @property
    def selection_source(self) -> str:
        """How the tactic was chosen: 'explicit', 'store', 'default' or 'fallback'."""
        return self._chosen().source

    @property
    def plan_object(self) -> Any:
        """The backend's plan: its ``run`` is what the wrapper's ``run`` calls."""
        return self._chosen().plan

    def _chosen(self) -> Selection:
        if self._selection is None:
            raise TactixError(f"{type(self).__name__}: call plan() first")
        return self._selection


class PlannedOp(Planned):
    """A wrapper constructed from a backend name and a device only (`tactix.Gemm`,
    `tactix.MergeStates`): both checked here, the plan made by the subclass's ``plan``."""

    def __init__(self, *, backend: str = "auto", device: torch.device | str | None = None) -> None:
        if not isinstance(backend, str):
            raise InvalidArgumentError("backend", "'auto' or a backend name", repr(backend))
        if backend != "auto":
            get_registry().get(backend)
        self._backend = backend
        self._device = checked_device("device", device)
        self._selection: Selection | None = None
        self._run: Any = None


def warn_fallback(problem: AnyProblem, tactic: Tactic, cause: str, instead: str) -> None:
    bump("fallbacks")
    key = (problem.key_json(), tactic.to_json(), cause)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        FallbackWarning(f"{problem}: tactic {tactic} cannot serve ({cause}); using {instead}"),
        stacklevel=4,
    )


def select_and_plan(
    problem: AnyProblem,
    batch: Batch | None,
    *,
    backend: str,
    tactic: Tactic | None,
    options: PlanOptions,
    previous: Selection | None = None,
) -> Selection:
    """Choose and plan: the stored tactic, then each candidate's default, the first whose check
    passes and whose plan succeeds. The run extras the caller's runs will pass are the
    problem's (``run_extras``): a backend that does not take them all fails its check, the
    declared capabilities' reason."""
    registry = get_registry()

    def plan(b: Backend, t: Tactic) -> Any:
        opts = dict(options)
        if previous is None or previous.backend is not b:
            opts["previous"] = None
        made = b.plan(problem, t, opts, batch)  # type: ignore[arg-type]
        bump("plans")
        if getattr(made, "built", False):
            bump("builds")
        return made

    if options["use_cuda_graph"] and previous is not None:
        # a captured graph reads the previous plan's buffers: the same backend and tactic must
        # rewrite them, so there is no fallback here (any error propagates).
        b, t = previous.backend, previous.plan.tactic
        if (tactic is not None and tactic != t) or backend not in ("auto", b.name):
            raise TacticError(
                "in CUDA-graph mode a wrapper keeps its backend and tactic across re-plans "
                f"(planned with {t}); create a new wrapper to change them"
            )
        return Selection(b, _plan_or_raise(b, t, problem, batch, plan), previous.source, problem, previous.requested)

    if tactic is not None:
        if backend != "auto" and tactic.backend != backend:
            raise TacticError(
                f"'tactic' must belong to backend '{backend}' (got a tactic of backend '{tactic.backend}')"
            )
        b = registry.get(tactic.backend)
        _require(b, problem, tactic, batch)
        return Selection(b, _plan_or_raise(b, tactic, problem, batch, plan), "explicit", problem)

    candidates = _candidates(registry, problem, batch, backend, options["device"])
    unsupported: list[str] = []
    failure: tuple[Tactic, BaseException] | None = None
    for index, (b, t, source) in enumerate(candidates):
        reasons = b.check(problem, t, batch)
        if reasons:
            if source == "store":
                warn_fallback(problem, t, "; ".join(reasons), f"{b.name}'s default")
            unsupported.append(f"{b.name}: {'; '.join(reasons)}")
            continue
        if failure is not None:
            warn_fallback(problem, failure[0], _describe(failure[1]), str(t))
        try:
            chosen = plan(b, t)
        except InvalidArgumentError:
            raise  # bad input is the caller's to fix, whichever backend noticed it
        except Exception as exc:
            failure = (t, exc)
            last = index == len(candidates) - 1
            if last or (backend != "auto" and source == "default"):
                if isinstance(exc, TactixError):
                    raise
                raise BackendError(b.name, f"plan {problem} with {t}", exc) from exc
            continue
        return Selection(b, chosen, source if failure is None else "fallback", problem, t)
    if failure is not None:
        raise BackendError(failure[0].backend, f"plan {problem} with {failure[0]}", failure[1]) from failure[1]
    raise UnsupportedProblemError(backend, problem, unsupported or ["no backend is active"])


def replan_selection(previous: Selection, problem: AnyProblem, batch: Batch, backend: str,
                     options: PlanOptions) -> Selection | None:  # fmt: skip
    """The fast re-plan of a wrapper whose static plan arguments are unchanged (same problem but
    for its sizes, same ``backend`` argument, no explicit tactic), or None for the full path.

    It applies where the full path would choose the same: the previous selection was the first
    candidate of ``problem``'s bucket as remembered (the same epoch and registry) that the static
    problem does not exclude (environment, capabilities: the same for every batch), not a fallback.
    The plan's own ``replan(problem, batch, options)`` then makes the new plan without the
    selection, the check and the plugin hook: a plan that offers it vouches that its check
    would pass for any batch it accepts, and returns None for one it does not (a new graph
    bucket, another device, ...).
    """
    replan = getattr(previous.plan, "replan", None)
    if replan is None or previous.requested is None:
        return None
    buckets = tuple(map(bucket_size, problem._dynamic_values(problem.__dict__)))
    note = previous.replan_token
    checked = note.remembered if note is not None else None
    same = note is not None and note.buckets == buckets
    # the same buckets: the entry checked last time (the same static problem: see the caller)
    found = checked if same else _remembered.get((backend, problem.bucket_key(), options["device"]))
    if found is None or found.epoch != stored_epoch() or found.registry is not get_registry():
        return None  # (`_Remembered.current`, inline: a call costs about 0.1 us)
    if found.recheck and not _still_missed(problem, batch, backend):
        return None  # another process stored a tactic: the full path selects again
    if found is not checked:
        first = next((c for c in found.candidates if not c.backend.static_reasons(problem)), None)
        if first is None:
            return None
        # the candidate itself (not an equal tactic: comparing tactics serialises them)
        if (first.backend is not previous.backend or first.source != previous.source
                or first.tactic is not previous.requested):  # fmt: skip
            return None
    b, source, tactic = previous.backend, previous.source, previous.requested
    try:
        # the problem its plan hook was given (`Backend.served`, whose answer depends on the static
        # problem only: the note says whether it was the problem itself)
        served = problem if note is not None and same and note.as_is else b.served(problem)
        made = replan(served, batch, options)
    except InvalidArgumentError:
        raise  # bad input is the caller's to fix, whichever path noticed it
    except Exception:
        return None  # the full path plans (and reports a failure) as if there were no fast one
    if made is None:
        return None
    if found.counter is not None:
        bump(found.counter)
    bump("plans")
    if getattr(made, "built", False):
        bump("builds")
    selection = Selection(b, made, source, problem, tactic)
    # (the note is immutable: the last one again when it says the same)
    selection.replan_token = note if note is not None and same else _ReplanNote(found, buckets, served is problem)
    return selection


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _candidates(registry: Registry, problem: AnyProblem, batch: Batch | None, backend: str,
                device: Any) -> tuple[Candidate, ...]:  # fmt: skip
    """(backend, tactic, source) to try in order: the stored tactic first, then defaults (for
    ``auto``, every active backend's, in the untuned order of ``problem`` on ``device``:
    `tactix.untuned_order`).

    Remembered per backend, problem bucket and device while the epoch and the registry stay the
    same; where the answer may change without either (a store miss that asks the disk), while
    the store, asked again, still misses."""
    named = None if backend == "auto" else registry.get(backend)  # an unknown name fails before any lookup
    key = (backend, problem.bucket_key(), device)
    epoch = stored_epoch()
    found = _remembered.get(key)
    if found is not None and found.epoch == epoch and found.registry is registry:
        if not found.recheck:
            if found.counter is not None:
                bump(found.counter)
            return found.candidates
        stored, counter, stable = _stored(problem, batch, backend)
        if stored is None:
            return found.candidates  # still a miss (its lookup counted it)
    else:
        stored, counter, stable = _stored(problem, batch, backend)
    candidates: list[Candidate] = []
    if named is not None:
        b = named
        if stored is not None and stored.backend == b.name:
            candidates.append(Candidate(b, stored, "store"))
        candidates.append(Candidate(b, Tactic.default(b.name), "default"))
    else:
        if stored is not None:
            try:
                candidates.append(Candidate(registry.get(stored.backend), stored, "store"))
            except TactixError as exc:
                warn_fallback(problem, stored, str(exc), "the untuned choice")
                stable = False  # the warning (and its count) is the caller's on every plan
        untuned = untuned_order.ordered(registry.active(problem.op), problem, device)
        candidates += [Candidate(b, Tactic.default(b.name), "default") for b in untuned]
    chosen = tuple(candidates)
    if stable or stored is None:  # (not a stored tactic that warns on every plan)
        if len(_remembered) >= 1024:
            _remembered.clear()
        _remembered[key] = _Remembered(epoch, registry, chosen, counter if stable else None, recheck=not stable)
    return chosen


def _still_missed(problem: AnyProblem, batch: Batch | None, backend: str) -> bool:
    """Whether the store lookup for ``problem`` still finds no tactic (it looks on disk for an
    entry another process wrote since, and counts itself)."""
    return _stored(problem, batch, backend)[0] is None


def _stored(problem: AnyProblem, batch: Batch | None, backend: str) -> tuple[Tactic | None, str | None, bool]:
    """The stored tactic, the stats counter its lookup bumped, and whether the answer may be
    remembered until the epoch changes."""
    if _source is not None:
        return _source(problem), None, True
    from tactix.autotune.context import current  # the tuner plans through the registry, not here

    return current().lookup(problem, batch, backend)


def _require(b: Backend, problem: AnyProblem, tactic: Tactic, batch: Batch | None) -> None:
    reasons = b.check(problem, tactic, batch)
    if reasons:
        raise UnsupportedProblemError(b.name, problem, reasons)


def _plan_or_raise(
    b: Backend, t: Tactic, problem: AnyProblem, batch: Batch | None, plan: Callable[[Backend, Tactic], Any]
) -> Any:
    try:
        return plan(b, t)
    except TactixError:
        raise
    except Exception as exc:
        raise BackendError(b.name, f"plan {problem} with {t}", exc) from exc
