"""Process-wide counters of what planning cost: store hits and misses, fallbacks, builds, tuning;
and the epoch of the stored tactics, which remembered selections are checked against."""

from __future__ import annotations

import threading
from typing import Final

__all__ = ["bump", "reset_stats", "stats", "stored_epoch", "stored_tactics_changed"]

COUNTERS: Final = (
    "store_hits",  # a stored tactic served a plan
    "store_misses",  # the store had no (valid) entry for a problem it was asked about
    "fallbacks",  # a stored tactic or a backend failed and another served
    "builds",  # plans that reported building something expensive (graph, JIT compile)
    "plans",  # plans made
    "tuned_problems",  # problems measured by the tuner
    "candidates_measured",  # tactics timed by the tuner
    "candidates_failed",  # tactics that raised, ran something else, or computed a wrong result
    "timer_calls",  # calls of the timer (the tuner and bench)
)

_lock = threading.Lock()
_counts = dict.fromkeys(COUNTERS, 0)


def bump(name: str, by: int = 1) -> None:
    with _lock:
        _counts[name] += by


def stats() -> dict[str, int]:
    """A snapshot of the counters since the process started (or since `reset_stats`)."""
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    with _lock:
        for name in _counts:
            _counts[name] = 0


_epoch = 0


def stored_epoch() -> int:
    """Bumped by whatever can change a stored tactic: `tactix.selection.set_tactic_source`, a
    store write, entering or leaving an ``autotune`` block. Selections remembered in another
    epoch are not used (see `tactix.selection`)."""
    return _epoch


def stored_tactics_changed() -> None:
    """A stored tactic may now be another: forget remembered selections."""
    global _epoch
    with _lock:
        _epoch += 1
