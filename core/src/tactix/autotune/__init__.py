"""Measurement for tuning and benchmarks (timer; the tuner and tactic store build on it)."""

from tactix.autotune.timing import Timing, measure

__all__ = ["Timing", "measure"]
