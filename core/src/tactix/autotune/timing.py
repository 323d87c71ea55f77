"""Timing a call: CUDA events on a GPU, a monotonic clock on the CPU; median of repeats.

One module serves the demo, the tuner and ``tactix bench``, so every figure tactix reports is
taken the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Timing", "measure"]


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median and every sample."""

    median: float
    samples: tuple[float, ...]

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples: how noisy the measurement was."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median > 0 else 0.0


def measure(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 3,
    repeat: int = 10,
    before_each: Callable[[], object] | None = None,
) -> Timing:
    """Run ``fn`` ``warmup`` times, then time ``repeat`` calls one by one.

    On CUDA each call is bracketed by events on the current stream (device time of the work
    ``fn`` enqueues, host overhead excluded unless it stalls the GPU); ``before_each`` (an L2
    flush, say) runs outside the timed region.
    """
    if repeat < 1:
        raise ValueError(f"'repeat' must be >= 1 (got {repeat})")
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        new_event = torch.cuda.Event
        events = [(new_event(enable_timing=True), new_event(enable_timing=True)) for _ in range(repeat)]  # type: ignore[no-untyped-call]
        for start, end in events:
            if before_each is not None:
                before_each()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for _ in range(repeat):
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return Timing(median=statistics.median(samples), samples=tuple(samples))
