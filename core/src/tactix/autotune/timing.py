"""Timing a call: CUDA events on a GPU, a monotonic clock on the CPU; median of repeats.

One module serves the demo, the tuner and ``tactix bench``, so every figure tactix reports is
taken the same way: `measure` for a bare median, `measure_with_policy` for the tuner's and the
benchmark's policy (cold L2, CUDA-graph replay).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import torch

from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.stats import bump

__all__ = [
    "Timing",
    "host_us",
    "interleaved",
    "interleaved_rounds",
    "least_disturbed",
    "measure",
    "measure_with_policy",
    "prepared_call",
]


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median and every sample, and how the calls were made."""

    median: float
    samples: tuple[float, ...]
    timed_as: Literal["cuda_graph", "eager"] = "eager"
    blocks: int = 1  # blocks of calls timed before the times settled; the samples are the last block's

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


MAX_WARMUP_CALLS = 20_000


def busy_warmup(
    fn: Callable[[], object], device: torch.device, seconds: float, before_each: Callable[[], object] | None = None
) -> int:
    """Keep the GPU busy with ``fn`` (``before_each`` first, as when timed) for about ``seconds`` of
    device time, judged by the first call's time; returns the number of calls made."""
    if seconds <= 0:
        return 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    if before_each is not None:
        before_each()
    fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) * 1e-3, 1e-6)
    calls = min(MAX_WARMUP_CALLS, math.ceil(seconds / float(one)))
    for _ in range(calls - 1):
        if before_each is not None:
            before_each()
        fn()
    return calls


SETTLE_TOLERANCE = 0.015  # a block this much faster than the one before (or its own start) is not settled


def settled(previous: Timing | None, block: Timing, tolerance: float = SETTLE_TOLERANCE) -> bool:
    """Whether ``block`` shows times that have stopped falling: it is not faster than ``previous``
    by more than ``tolerance``, and the median of its last third is not below the median of its
    first third by more than that (blocks under 9 calls are judged by the first test alone)."""
    if previous is not None and block.median < previous.median * (1 - tolerance):
        return False
    third = len(block.samples) // 3
    if third >= 3:
        head = statistics.median(block.samples[:third])
        tail = statistics.median(block.samples[-third:])
        if tail < head * (1 - tolerance):
            return False
    return previous is not None


def measure_with_policy(fn: Callable[[], object], device: torch.device, policy: MeasurementPolicy) -> Timing:
    """Time ``fn`` as ``policy`` says: replayed from a CUDA graph where it captures, else eagerly.

    On a GPU, `busy_warmup` runs it for ``policy.warmup_ms`` of device time first, then blocks of
    ``policy.repeat`` calls are timed until one has `settled` (at most ``policy.settle_blocks``, at
    least two when more than one is allowed); the last block is kept."""
    flush = l2_flush(device, policy.l2_flush_bytes) if policy.cold_l2 else None
    call, timed_as = prepared_call(fn, device, policy)
    if device.type == "cuda":
        busy_warmup(call, device, policy.warmup_ms * 1e-3, flush)
    timing = measure(call, device, warmup=policy.warmup, repeat=policy.repeat, before_each=flush)
    blocks = 1
    if device.type == "cuda":
        previous: Timing | None = None
        while blocks < policy.settle_blocks and not settled(previous, timing):
            previous = timing
            timing = measure(call, device, warmup=0, repeat=policy.repeat, before_each=flush)
            blocks += 1
    return Timing(timing.median, timing.samples, timed_as, blocks)


TimedAs = Literal["cuda_graph", "eager"]


def prepared_call(fn: Callable[[], object], device: torch.device,
                  policy: MeasurementPolicy) -> tuple[Callable[[], object], TimedAs]:  # fmt: skip
    """What `measure_with_policy` times for ``fn``: the replay of a CUDA graph that captured it
    (``policy.execution == "cuda_graph"`` on a GPU, where it captures), else ``fn`` itself; and
    which of the two it is."""
    if device.type == "cuda" and policy.execution == "cuda_graph":
        graph = _capture(fn, device)
        if graph is not None:
            return graph.replay, "cuda_graph"
    return fn, "eager"


INTERLEAVED_ROUNDS: Final = 6
"""Rounds of `interleaved` on a GPU; on the CPU two (`INTERLEAVED_ROUNDS_CPU`: one back, one
forth), where calls heat no card but other processes still come and go."""
INTERLEAVED_ROUNDS_CPU: Final = 2


def interleaved_rounds(device: torch.device) -> int:
    """The rounds `interleaved` makes on ``device`` unless told otherwise."""
    return INTERLEAVED_ROUNDS if device.type == "cuda" else INTERLEAVED_ROUNDS_CPU


def interleaved(calls: Sequence[Callable[[], object]], device: torch.device, policy: MeasurementPolicy,
                rounds: int | None = None) -> list[list[float] | None]:  # fmt: skip
    """Time ``calls`` against each other: ``rounds`` short blocks each (``policy.warmup`` untimed
    calls, then at least 3 timed, ``policy.repeat`` over all rounds), visiting the calls in
    reverse order, then forwards, and so on; each call's samples in seconds, or None for a call
    that raised. Each call is timed as `measure_with_policy` times it (`prepared_call`, the cold
    L2 flush).

    Calls timed one after another each meet their own state of the device: what ran just before
    makes the next kernels up to 8 % slower for tens of milliseconds (benchmarks/two_speeds.py),
    and a card's clock falls as a compute-bound run heats it (on an H200, four rows of one cuDNN
    GEMM tactic read 1388 to 1581 us in the order timed, each steady within itself: session 30,
    G1). Blocks that alternate between the calls give every call the same mix of states."""
    if rounds is None:
        rounds = interleaved_rounds(device)
    flush = l2_flush(device, policy.l2_flush_bytes) if policy.cold_l2 else None
    block = max(3, -(-policy.repeat // rounds)) if device.type == "cuda" else policy.repeat
    prepared: list[Callable[[], object] | None] = []
    for call in calls:
        try:
            prepared.append(prepared_call(call, device, policy)[0])
        except Exception:
            prepared.append(None)
    samples: list[list[float] | None] = [[] if p is not None else None for p in prepared]
    order = list(range(len(prepared)))
    for n in range(max(rounds, 0)):
        for i in reversed(order) if n % 2 == 0 else order:
            replay, got = prepared[i], samples[i]
            if replay is None or got is None:
                continue
            try:
                got.extend(measure(replay, device, warmup=policy.warmup, repeat=block, before_each=flush).samples)
            except Exception:
                samples[i] = None
    return samples


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


HOST_CALLS: Final = 60
"""Calls per host-cost measurement (plan and run) on a GPU, in `HOST_BLOCKS` blocks; on the CPU,
where run() computes in the caller's thread, a few (`HOST_CALLS_CPU`, one block) are enough."""
HOST_CALLS_CPU: Final = 4
HOST_BLOCKS: Final = 5
"""Blocks a GPU host-cost measurement is cut into: the least disturbed block's median is kept.
Other tenants of a lent host only ever add time: one median of 40 calls read torch.matmul's
run() host cost as 15 us in one eager suite and 25 us in the next (H100, session 26)."""


def host_us(fn: Callable[[], object], device: torch.device, calls: int | None = None) -> float:
    """Host wall time of ``fn()`` in microseconds, with no device synchronisation inside the
    timed calls (a synchronisation before and after): what an eager caller's thread pays. On a
    GPU the calls are cut into `HOST_BLOCKS` blocks and the lowest block median is kept (the
    undisturbed cost: another tenant's burst lands in one block); on the CPU, one median."""
    gpu = device.type == "cuda"
    if calls is None:
        calls = HOST_CALLS if gpu else HOST_CALLS_CPU
    if gpu:
        torch.cuda.synchronize(device)
    fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    if gpu:
        torch.cuda.synchronize(device)
    return least_disturbed(samples, HOST_BLOCKS if gpu else 1) * 1e6


def least_disturbed(samples: list[float], blocks: int) -> float:
    """The lowest median of ``samples`` cut into ``blocks`` consecutive blocks (at most one a
    sample; a remainder joins no block)."""
    blocks = max(1, min(blocks, len(samples)))
    size = len(samples) // blocks
    return min(statistics.median(samples[i * size : (i + 1) * size]) for i in range(blocks))
