"""Timing a call: CUDA events on a GPU, a monotonic clock on the CPU; median of repeats.

One module serves the demo, the tuner and ``tactix bench``, so every figure tactix reports is
taken the same way: `measure` for a bare median, `measure_with_policy` for the tuner's and the
benchmark's policy (cold L2, CUDA-graph replay).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.stats import bump

__all__ = ["Timing", "measure", "measure_with_policy"]


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median and every sample, and how the calls were made."""

    median: float
    samples: tuple[float, ...]
    timed_as: Literal["cuda_graph", "eager"] = "eager"

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
    ``fn`` enqueues); ``before_each`` (an L2 flush, say) runs outside the timed region.
    """
    if repeat < 1:
        raise ValueError(f"'repeat' must be >= 1 (got {repeat})")
    bump("timer_calls")
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


_flush_buffers: dict[torch.device, torch.Tensor] = {}


def l2_flush(device: torch.device, nbytes: int) -> Callable[[], object] | None:
    """A function that overwrites ``nbytes`` of device memory (evicting L2), or None on the CPU."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    buf = _flush_buffers.get(device)
    if buf is None or buf.numel() < nbytes:
        buf = _flush_buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf.zero_


def measure_with_policy(fn: Callable[[], object], device: torch.device, policy: MeasurementPolicy) -> Timing:
    """Time ``fn`` as ``policy`` says: replayed from a CUDA graph where it captures, else eagerly."""
    flush = l2_flush(device, policy.l2_flush_bytes) if policy.cold_l2 else None
    if device.type == "cuda" and policy.execution == "cuda_graph":
        graph = _capture(fn, device)
        if graph is not None:
            timing = measure(graph.replay, device, warmup=policy.warmup, repeat=policy.repeat, before_each=flush)
            return Timing(timing.median, timing.samples, "cuda_graph")
    return measure(fn, device, warmup=policy.warmup, repeat=policy.repeat, before_each=flush)


def _capture(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph | None:
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            fn()  # warm up outside capture (allocator, lazy initialisation)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # not capturable: the caller times it eagerly and records that
        torch.cuda.synchronize(device)
        return None
    return graph
