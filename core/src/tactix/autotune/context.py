"""``tactix.autotune(...)``: the tuning mode, measurement policy and tactic store in force.

* ``mode="tune"``: a plan whose problem has no stored tactic measures the candidates (under
  ``backend="auto"``), stores the winner and uses it.
* ``mode="replay"``: stored tactics are used; a miss gets the untuned choice; nothing is measured.
* Outside any ``autotune`` block, serving uses stored tactics from the default store (if it
  exists for this environment and the default policy) and heuristics; it never measures.

A plan that names a backend uses a stored tactic only if it belongs to that backend, and is
never tuned (tuning compares backends, which a named backend rules out).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from tactix.arguments import described
from tactix.autotune import distributed
from tactix.autotune.environment import environment
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.stats import bump, stored_tactics_changed
from tactix.autotune.store import StoreEntry, TacticStore, default_root
from tactix.autotune.tuner import tune
from tactix.batch import Batch
from tactix.errors import DistributedError, InvalidArgumentError, UnsupportedProblemError
from tactix.ops import AnyProblem
from tactix.registry import Registry, get_registry
from tactix.tactics import Tactic

__all__ = ["Autotuner", "autotune", "current", "stored_tactic"]

log = logging.getLogger("tactix.autotune")

Mode = Literal["tune", "replay", "off"]
_MODES = ("tune", "replay", "off")


class Autotuner:
    """The tuning state in force: mode, policy, store and (optionally) a process group."""

    def __init__(
        self,
        mode: Mode,
        policy: MeasurementPolicy,
        store: TacticStore | None,
        process_group: Any = None,
        registry: Registry | None = None,
        timeout: dt.timedelta | None = None,
    ) -> None:
        self.mode = mode
        self.policy = policy
        self.store = store
        self.process_group = process_group
        self.timeout = timeout
        self.registry = registry or get_registry()
        self._lock = threading.RLock()

    def tactic_for(self, problem: AnyProblem, batch: Batch | None, backend: str) -> Tactic | None:
        """The stored tactic for ``problem`` (tuning it first in tune mode), or None."""
        return self.lookup(problem, batch, backend)[0]

    def lookup(self, problem: AnyProblem, batch: Batch | None, backend: str) -> tuple[Tactic | None, str | None, bool]:
        """`tactic_for`, with what a memo of its answer needs: the stats counter it bumped, and
        whether the answer holds until the store is written or the tuning state changes (a
        miss of a store that looks for other processes' entries on disk does not)."""
        if self.store is None:
            return None, None, True
        with self._lock:
            entry = self.store.lookup(problem)
            if entry is not None:
                if backend not in ("auto", entry.tactic.backend):
                    return None, None, True
                bump("store_hits")
                log.debug("%s served by stored entry %s: %s", problem, entry.key_hash, entry.tactic)
                return entry.tactic, "store_hits", True
            bump("store_misses")
            if self.mode != "tune" or backend != "auto":
                return None, "store_misses", not self.store.reads_disk
            entry = self._tune(problem, batch)
            self.store.put(entry)
            log.info("tuned %s: %s (untuned %s, %s)", problem, entry.tactic, entry.baseline,
                     f"{entry.speedup():.2f}x" if entry.speedup() else "no timing")  # fmt: skip
            return entry.tactic, None, False  # the next plan finds the entry: a hit

    def _tune(self, problem: AnyProblem, batch: Batch | None) -> StoreEntry:
        assert self.store is not None
        device = _problem_device(problem, batch)

        def measure() -> StoreEntry:
            return tune(problem, batch, registry=self.registry, backend="auto", policy=self.policy, device=device,
                        env_hash=self.store.env_hash)  # type: ignore[union-attr]  # fmt: skip

        if self.process_group is None:
            return measure()
        text: str | None = None
        failure: BaseException | None = None
        if distributed.rank(self.process_group) == 0:
            try:
                text = measure().to_json()
            except Exception as exc:  # every rank must learn it, or the others wait for rank 0 until the timeout
                failure = exc
                text = json.dumps({"error": f"{type(exc).__name__}: {exc}", "unsupported": isinstance(
                    exc, UnsupportedProblemError)})  # fmt: skip
        agreed = json.loads(distributed.broadcast_text(text, self.process_group, self.timeout,
                                                       f"the tuning result of {problem}"))  # fmt: skip
        if failure is not None:
            raise failure
        if "error" in agreed:
            if agreed.get("unsupported"):
                raise UnsupportedProblemError("auto", problem, [f"rank 0 could not tune it: {agreed['error']}"])
            raise DistributedError(f"rank {distributed.rank(self.process_group)}: rank 0 failed to tune {problem}, "
                                   f"so no rank uses a tuned tactic for it: {agreed['error']}")  # fmt: skip
        return StoreEntry.model_validate(agreed)


def _problem_device(problem: AnyProblem, batch: Batch | None) -> torch.device:
    if problem.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(problem.device_type)


_lock = threading.Lock()
_stack: list[Autotuner] = []
_implicit: dict[int, Autotuner] = {}


def current() -> Autotuner:
    """The innermost ``autotune`` block's state, else the implicit serving state (mode ``off``)."""
    if _stack:
        return _stack[-1]
    registry = get_registry()
    found = _implicit.get(id(registry))
    if found is None or found.registry is not registry:
        policy = MeasurementPolicy()
        store = TacticStore(default_root(), environment(policy, registry=registry))
        found = Autotuner("off", policy, store.attach() if store.path.exists() else None, registry=registry)
        with _lock:
            _implicit.clear()
            _implicit[id(registry)] = found
    return found


def stored_tactic(problem: AnyProblem, batch: Batch | None, backend: str) -> Tactic | None:
    return current().tactic_for(problem, batch, backend)


@contextlib.contextmanager
def autotune(
    mode: Mode = "tune",
    *,
    policy: MeasurementPolicy | None = None,
    cache_dir: str | Path | None = None,
    process_group: Any = None,
    timeout: dt.timedelta | float | None = None,
) -> Iterator[Autotuner]:
    """Tune (or replay) tactics for the plans made inside the block.

    Parameters
    ----------
    mode : ``"tune"``, ``"replay"`` or ``"off"``
    policy : MeasurementPolicy, optional
        How candidates are timed; part of the store's environment (default: `MeasurementPolicy()`).
    cache_dir : path, optional
        Store root (default: ``$TACTIX_CACHE_DIR`` or the user cache directory).
    process_group : torch.distributed group, optional
        Make every rank use rank 0's tactics (rank 0 measures; entries are broadcast). Every
        rank's environment must equal rank 0's, or every rank raises `DistributedError`.
    timeout : datetime.timedelta or seconds, optional
        With a process group: how long a rank waits for the others at each exchange (the
        environments, rank 0's entries, each tuning result) before raising `DistributedError`
        that names the rank it waited for (default: the process group's own timeout). Leave room
        for rank 0 to compile and measure a problem's candidates.

    Examples
    --------
    >>> with tactix.autotune(mode="tune", cache_dir="/tmp/tactix-store"):   # doctest: +SKIP
    ...     wrapper.plan(...)        # measured once per shape bucket, then stored
    """
    if mode not in _MODES:
        raise InvalidArgumentError("mode", "'tune', 'replay' or 'off'", repr(mode))
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if not timeout > 0:
            raise InvalidArgumentError("timeout", "a positive number of seconds or a timedelta", repr(timeout))
        timeout = dt.timedelta(seconds=timeout)
    elif timeout is not None and (not isinstance(timeout, dt.timedelta) or timeout <= dt.timedelta(0)):
        raise InvalidArgumentError("timeout", "a positive number of seconds or a timedelta", repr(timeout))
    if policy is not None and not isinstance(policy, MeasurementPolicy):
        raise InvalidArgumentError("policy", "None or a tactix.MeasurementPolicy", described(policy))
    if cache_dir is not None and (not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir)):
        # ("" would be the working directory: a store written where the process happens to run)
        raise InvalidArgumentError("cache_dir", "None (the default root) or a non-empty path", repr(cache_dir))
    policy = policy or MeasurementPolicy()
    registry = get_registry()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    store = TacticStore(Path(cache_dir) if cache_dir is not None else default_root(),
                        environment(policy, device, registry)).attach()  # fmt: skip
    if process_group is not None:
        distributed.sync_store(store, process_group, timeout)
    state = Autotuner(mode, policy, store, process_group, registry, timeout)
    with _lock:
        _stack.append(state)
    stored_tactics_changed()
    try:
        yield state
    finally:
        with _lock:
            _stack.remove(state)
        stored_tactics_changed()
