"""Backend discovery: entry points of the ``tactix.backends`` group, loaded one at a time.

Our own loader wraps each ``EntryPoint.load()`` and registration call, so a plugin that fails
to import or register is recorded (name, distribution, version, error) and skipped; the rest
keep working. ``TACTIX_BACKENDS`` (comma-separated allow-list) and ``TACTIX_DISABLE_BACKENDS``
(deny-list) are applied before anything is imported. Two distributions registering the same
name disable that name with an error naming both. Loading a plugin never initialises CUDA.
"""

from __future__ import annotations

import importlib.metadata as metadata
import logging
import operator
import os
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import pluggy
import torch

from tactix import hookspecs
from tactix.capabilities import BackendSpec
from tactix.devices import cuda_available
from tactix.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    DuplicateBackendError,
    PluginError,
)
from tactix.ops import OPS, AnyProblem
from tactix.tactics import Tactic

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendRecord",
    "Registry",
    "get_registry",
    "plugin_manager",
    "set_registry",
]

log = logging.getLogger("tactix.registry")

ENTRY_POINT_GROUP: Final = "tactix.backends"
Status = Literal["active", "disabled", "failed"]


@dataclass(frozen=True)
class BackendRecord:
    """What discovery learned about one entry point."""

    name: str
    distribution: str | None
    distribution_version: str | None
    entry_point: str
    status: Status
    error: str | None = None
    spec: BackendSpec | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "distribution_version": self.distribution_version,
            "entry_point": self.entry_point,
            "status": self.status,
            "error": self.error,
            "version": self.spec.version if self.spec else None,
            "ops": self.spec.ops if self.spec else [],
        }


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, counting its registrations (``generation``) so that a `Backend` can keep
    what it looked up about a hook's implementations until a plugin is registered or removed."""

    generation = 0

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        self.generation += 1
        return super().register(plugin, name)

    def unregister(self, plugin: Any | None = None, name: str | None = None) -> Any | None:
        self.generation += 1
        return super().unregister(plugin, name)

    def add_hookspecs(self, module_or_class: Any) -> None:
        self.generation += 1
        super().add_hookspecs(module_or_class)


def plugin_manager() -> PluginManager:
    """A plugin manager that knows every hookspec: the shared ones and each op's plan hook."""
    manager = PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    for op in OPS.values():
        manager.add_hookspecs(op.hookspecs)
    return manager


_UNSET: Final = object()
_SIZED_OPS: Final = frozenset(name for name, op in OPS.items() if op.sized_capabilities)
_CHECK_ARGUMENTS: Final = ("backend", "problem", "tactic", "batch")
_PLAN_CALLS: Final = {
    name: (
        op.plan_hook,
        ("backend", "problem", "tactic", "options", *(("batch",) if "batch" in op.plan_arguments else ())),
    )
    for name, op in OPS.items()
}
"""Per op: its plan hook and the arguments the core passes it, in this order."""


def _several_gpus() -> bool:
    """Whether this process sees more than one GPU (remembered once it sees CUDA at all): only
    then may two plans' devices differ in compute capability."""
    global _gpus
    if _gpus is None:
        if not cuda_available():
            return False
        _gpus = torch.cuda.device_count()
    return _gpus > 1


_gpus: int | None = None


@dataclass
class Backend:
    """An active backend: its spec and the pluggy manager holding its plugin alone.

    Every hook is called through pluggy on that manager, so only this plugin's implementations
    answer for this backend (no implementation compares the ``backend`` argument with its name)
    and pluggy passes each implementation the arguments it declares. Hooks are called at plan
    time only; ``run`` is the plan's own method.
    """

    record: BackendRecord
    spec: BackendSpec
    manager: pluggy.PluginManager = field(repr=False)  # (a `PluginManager` where discovery made it)
    _environment: list[str] | None = field(default=None, repr=False)
    # reasons from the environment and the declared capabilities, by problem.static_key(): both
    # are fixed for a backend, and attention capabilities read no dynamic size
    _static_reasons: dict[tuple[Any, ...], tuple[str, ...]] = field(default_factory=dict, repr=False)
    # per op: None where `served` returns the problem as it is, else (conversion, capabilities of the op)
    _routes: dict[str, Any] = field(default_factory=dict, repr=False)
    _last_served: tuple[Any, Any] = field(default=(None, None), repr=False)
    # per hook: what `_hook` found (`_direct`)
    _hooks: dict[str, tuple[Any, ...]] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def _call(self, hook: str, **kwargs: Any) -> Any:
        """This plugin's answer to ``hook`` (a firstresult hook: None when it implements none)."""
        return self._hook(hook, ("backend", *kwargs), (self.name, *kwargs.values()))

    def _hook(self, hook: str, names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
        """Call ``hook`` on this backend's manager with the arguments ``names`` = ``values``, as
        pluggy does, but where the hook has one plain implementation (every hook of a plugin alone
        on its manager) call its function directly with the arguments it declares, picked by
        position: pluggy's general dispatch (its multicall loop, result list and argument checks)
        costs about 2 us a call, twice per ``plan()``. Anything else (two implementations, a
        wrapper, an argument the implementation wants and the call lacks) goes through pluggy,
        which then says what is wrong. What was found is kept until the manager's
        ``generation`` changes (`PluginManager` counts registrations), so a plugin registered
        later on the manager is honoured."""
        generation = getattr(self.manager, "generation", None)  # None: a plain pluggy manager
        found = self._hooks.get(hook)
        if found is None or generation is None or found[0] != generation or found[1] != names:
            found = self._hooks[hook] = self._direct(hook, names, generation)
        _, _, caller, fn, pick = found
        if fn is None:
            return caller(**dict(zip(names, values, strict=True)))
        return fn(*pick(values))

    def _direct(self, hook: str, names: tuple[str, ...], generation: int | None) -> tuple[Any, ...]:
        """`_hook`'s record: (generation, names, the hook caller, the one plain implementation's
        function or None, what picks its arguments out of the values)."""
        caller = getattr(self.manager.hook, hook)
        impls = caller.get_hookimpls()
        if len(impls) != 1 or impls[0].hookwrapper or impls[0].wrapper:
            return generation, names, caller, None, None
        impl = impls[0]
        if not set(impl.argnames) <= set(names):
            return generation, names, caller, None, None
        index = [names.index(name) for name in impl.argnames]
        pick: Callable[[tuple[Any, ...]], tuple[Any, ...]]
        if len(index) > 1:
            pick = operator.itemgetter(*index)
        else:  # itemgetter of one index gives the item itself, not a tuple
            pick = (lambda values: (values[index[0]],)) if index else (lambda values: ())
        return generation, names, caller, impl.function, pick

    def implements(self, hook: str) -> bool:
        return bool(getattr(self.manager.hook, hook).get_hookimpls())

    def warmup(self, arch: str | None, progress: Callable[[int, int, str], None] | None) -> int | None:
        """Compile ahead of time what the default tactics need (``tactix_warmup``); None: nothing to."""
        compiled: int | None = self._call("tactix_warmup", arch=arch, progress=progress)
        return compiled

    def environment(self) -> list[str]:
        """Reasons this backend cannot run on this machine (cached; empty list: it can)."""
        if self._environment is None:
            try:
                reasons = self._call("tactix_environment")
            except Exception as exc:  # a plugin bug must not take discovery down
                reasons = [f"tactix_environment raised {type(exc).__name__}: {exc}"]
            self._environment = list(reasons or [])
        return self._environment

    def known_failures(self) -> dict[str, str]:
        """Conformance case-id globs this backend declares it fails, with the reason."""
        declared = self._call("tactix_known_failures")
        if declared is None:
            return {}
        if not isinstance(declared, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in declared.items()
        ):
            raise PluginError(f"plugin '{self.name}' must return dict[str, str] from tactix_known_failures")
        return dict(declared)

    def served(self, problem: AnyProblem) -> AnyProblem:
        """The problem this backend's hooks are asked about: ``problem``, or the problem of another
        op that computes the same on the same batch where this backend's capabilities of
        ``problem.op`` do not take it but those of the other op may (the op's ``served_through``:
        multi-token decode through prefill)."""
        last = self._last_served  # check, static_reasons and plan of one plan() ask about one object
        if last[0] is problem:
            found: AnyProblem = last[1]
            return found
        route = self._routes.get(problem.op, _UNSET)
        if route is _UNSET:  # per op, once: the conversion and this backend's capabilities of the op
            through = OPS[problem.op].served_through
            route = None
            if through is not None and self.spec.capabilities(through[0]) is not None:
                route = (through[1], self.spec.capabilities(problem.op))
            self._routes[problem.op] = route
        if route is None:
            return problem
        convert, caps = route
        converted: AnyProblem | None = convert(problem, caps)
        served = problem if converted is None else converted
        self._last_served = (problem, served)  # (one tuple: a thread reading it sees a matching pair)
        return served

    def run_extras(self, problem: AnyProblem) -> frozenset[str]:
        """The run extras this backend's plans of ``problem`` take: those its capabilities of the
        op whose plan serves it (`served`) declare."""
        caps = self.spec.implements.get(self.served(problem).op)
        return caps.run_extras if caps is not None else frozenset()

    def tactics(self, problem: AnyProblem) -> list[Tactic]:
        """The backend's tactic space for ``problem``, default first, without duplicates."""
        problem = self.served(problem)
        listed = self._call("tactix_tactics", problem=problem) or []
        out = [Tactic.default(self.name)]
        for tactic in listed:
            if not isinstance(tactic, Tactic) or tactic.backend != self.name:
                raise PluginError(
                    f"plugin '{self.name}' returned {tactic!r} from tactix_tactics; expected "
                    f"Tactic objects with backend='{self.name}'"
                )
            if tactic not in out:
                out.append(tactic)
        return out

    def static_reasons(self, problem: AnyProblem) -> Sequence[str]:
        """Why this backend cannot serve ``problem`` whatever the tactic and the batch: the
        environment and the declared capabilities. Remembered per static problem (attention)."""
        problem = self.served(problem)
        op = problem.op
        if op in _SIZED_OPS:  # e.g. GEMM's max_m: not a static answer
            return self.environment() + self.spec.reasons(problem)
        key = problem.static_key()
        if problem.device_type == "cuda" and _several_gpus():  # compute capabilities differ by GPU
            key = (*key, torch.cuda.current_device())
        found = self._static_reasons.get(key)
        if found is None:
            if len(self._static_reasons) >= 1024:
                self._static_reasons.clear()
            found = self._static_reasons[key] = tuple(self.environment() + self.spec.reasons(problem))
        return found

    def check(self, problem: AnyProblem, tactic: Tactic, batch: Any = None) -> list[str]:
        """Reasons ``tactic`` cannot serve ``problem`` here: environment, capabilities, plugin.

        The plugin's ``tactix_check`` is asked every time (its answer may depend on the sizes and
        the batch); what comes before it is remembered per static problem."""
        name = self.spec.name
        if tactic.backend != name:
            return [f"tactic {tactic} belongs to backend '{tactic.backend}', not '{name}'"]
        static = self.static_reasons(problem)
        if static:
            return list(static)
        problem = self.served(problem)
        try:
            extra = self._hook("tactix_check", _CHECK_ARGUMENTS, (name, problem, tactic, batch))
        except Exception as exc:
            return [f"tactix_check raised {type(exc).__name__}: {exc}"]
        return list(extra or [])

    def references(self, op: str, inputs: dict[str, Any]) -> list[hookspecs.ReferenceCall]:
        """Direct calls of the library this backend wraps, for benchmarks (see the hookspec)."""
        return list(self._call("tactix_references", op=op, inputs=inputs) or [])

    def plan(self, problem: AnyProblem, tactic: Tactic, options: hookspecs.PlanOptions, batch: Any = None) -> Any:
        """Call this backend's plan hook for ``problem.op`` (or for the op that serves it, see
        `served`). Exceptions propagate."""
        problem = self.served(problem)
        name, names = _PLAN_CALLS[problem.op]
        values = (self.spec.name, problem, tactic, options, batch)
        plan = self._hook(name, names, values if len(names) == 5 else values[:4])
        if plan is None:
            raise PluginError(f"backend '{self.name}' returned no plan from {name} for {problem}")
        return plan


class Registry:
    """The backends discovered in this process."""

    def __init__(self, records: Sequence[BackendRecord], backends: Mapping[str, Backend]) -> None:
        self._records = list(records)
        self._backends = dict(backends)
        self._by_preference = sorted(self._backends.values(), key=lambda b: (-b.spec.preference, b.name))
        self._by_op: dict[str, list[Backend]] = {}  # active(op), sorted once (specs are frozen)

    @classmethod
    def discover(
        cls,
        entry_points: Iterable[metadata.EntryPoint] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Registry:
        env = os.environ if environ is None else environ
        eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP) if entry_points is None else entry_points)
        allow = _name_list(env.get("TACTIX_BACKENDS"))
        deny = _name_list(env.get("TACTIX_DISABLE_BACKENDS")) or set()

        by_name: dict[str, list[metadata.EntryPoint]] = {}
        for ep in eps:
            by_name.setdefault(ep.name, []).append(ep)

        records: list[BackendRecord] = []
        backends: dict[str, Backend] = {}
        for name, group in sorted(by_name.items()):
            dists = {_dist_name(ep) for ep in group}
            if len(group) > 1:
                listed = " and ".join(f"'{d}'" for d in sorted(dists, key=str))
                err = DuplicateBackendError(
                    f"backend '{name}' is registered by more than one distribution ({listed}); uninstall one of them"
                )
                records += [_record(ep, "failed", str(err)) for ep in group]
                continue
            ep = group[0]
            if allow is not None and name not in allow:
                records.append(_record(ep, "disabled", "not listed in TACTIX_BACKENDS"))
                continue
            if name in deny:
                records.append(_record(ep, "disabled", "listed in TACTIX_DISABLE_BACKENDS"))
                continue
            record, backend = _load(ep)
            records.append(record)
            if backend is not None:
                backends[name] = backend
        if allow is not None:
            for missing in sorted(allow - set(by_name)):
                log.warning("TACTIX_BACKENDS names '%s', which no installed plugin provides", missing)
        return cls(records, backends)

    def records(self) -> list[BackendRecord]:
        return list(self._records)

    def active(self, op: str | None = None) -> list[Backend]:
        """Active backends, most preferred first (for ``op``, when given: see ``op_preference``)."""
        if op is None:
            return list(self._by_preference)
        ordered = self._by_op.get(op)
        if ordered is None:
            ordered = self._by_op[op] = sorted(self._by_preference, key=lambda b: (-b.spec.preference_for(op), b.name))
        return list(ordered)

    def get(self, name: str) -> Backend:
        """The active backend called ``name``; an error naming the valid choices otherwise."""
        backend = self._backends.get(name)
        if backend is not None:
            return backend
        for record in self._records:
            if record.name == name:
                if record.error and record.status == "failed" and "more than one distribution" in record.error:
                    raise DuplicateBackendError(record.error)
                raise BackendUnavailableError(f"backend '{name}' is {record.status}: {record.error}")
        raise BackendNotFoundError(name, self._backends)


def _name_list(value: str | None) -> set[str] | None:
    if value is None or not value.strip():
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


def _dist_name(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else None


def _record(
    ep: metadata.EntryPoint, status: Status, error: str | None = None, spec: BackendSpec | None = None
) -> BackendRecord:
    dist = getattr(ep, "dist", None)
    return BackendRecord(
        name=ep.name,
        distribution=dist.name if dist is not None else None,
        distribution_version=dist.version if dist is not None else None,
        entry_point=ep.value,
        status=status,
        error=error,
        spec=spec,
    )


def _load(ep: metadata.EntryPoint) -> tuple[BackendRecord, Backend | None]:
    def failed(what: str, exc: BaseException) -> tuple[BackendRecord, None]:
        log.warning("tactix backend '%s' (%s) %s: %s", ep.name, ep.value, what, exc)
        log.debug("%s", "".join(traceback.format_exception(exc)))
        return _record(ep, "failed", f"{what}: {type(exc).__name__}: {exc}"), None

    try:
        plugin = ep.load()
    except Exception as exc:
        return failed("failed to import", exc)
    manager = plugin_manager()
    try:
        manager.register(plugin, name=f"{ep.name}@{ep.value}")
        manager.check_pending()  # a misspelt tactix_* hook would otherwise be ignored silently
    except Exception as exc:
        return failed("failed to register its hooks", exc)
    if not manager.hook.tactix_backends.get_hookimpls():
        return failed("is not a tactix plugin", PluginError("it implements no tactix_backends hook"))
    try:
        specs = [s for found in manager.hook.tactix_backends() for s in (found or [])]
    except Exception as exc:
        return failed("failed in tactix_backends", exc)
    mine = [s for s in specs if isinstance(s, BackendSpec) and s.name == ep.name]
    if len(mine) != 1:
        names = [getattr(s, "name", type(s).__name__) for s in specs]
        return failed(
            "registered no matching backend",
            PluginError(f"entry point '{ep.name}' must register one BackendSpec named '{ep.name}' (got {names})"),
        )
    record = _record(ep, "active", None, mine[0])
    return record, Backend(record=record, spec=mine[0], manager=manager)


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                _registry = Registry.discover()
    return _registry


def set_registry(registry: Registry | None) -> Registry | None:
    """Replace the process-wide registry (None: rediscover on next use). Returns the old one."""
    global _registry
    with _lock:
        old, _registry = _registry, registry
    return old
