"""Autotuning: measurement, candidate search, the tactic store and rank-consistent tactics.

The package itself is callable, so ``with tactix.autotune(mode="tune"): ...`` reads the way
the docs say; ``from tactix.autotune import autotune`` is the same function, for type checkers.
"""

import sys
import types
from typing import Any

from tactix.autotune.context import Autotuner, autotune
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.stats import reset_stats, stats
from tactix.autotune.store import StoreEntry, StoreWarning, TacticStore
from tactix.autotune.timing import Timing, measure, measure_with_policy

__all__ = [
    "Autotuner",
    "MeasurementPolicy",
    "StoreEntry",
    "StoreWarning",
    "TacticStore",
    "Timing",
    "autotune",
    "measure",
    "measure_with_policy",
    "reset_stats",
    "stats",
]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return autotune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
