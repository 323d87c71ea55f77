"""How candidates are measured. The policy is part of the tactic store's environment identity:
times taken one way are never compared with, or replayed as, times taken another way."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MeasurementPolicy"]


class MeasurementPolicy(BaseModel):
    """Timer settings for the tuner and ``tactix bench``.

    ``execution``: ``cuda_graph`` times kernel work replayed from a captured CUDA graph (what a
    graph-captured server pays; used where the plan supports capture, else the call is timed
    eagerly and the entry says so); ``eager`` times each call as enqueued, host cost included
    where it stalls the device (what an eager server pays), and the tuner's final round ranks by
    the longer of a call's device and host times.

    ``warmup_ms`` and ``settle_blocks``: after other work (memory returned to the driver, the
    torch backend's attention, large GEMMs, a tuning run) an H200 runs the next kernels 5-15 %
    slower for 10-50 ms of busy time; idling does not end it, running does
    (benchmarks/two_speeds.py, benchmarks/results/h200-two-speeds-session20.md). A block of calls
    taken then reads slow throughout, or fast after a step. The time-based warm-up runs through
    that state, and blocks are then repeated until the times stop falling, so a candidate or a
    benchmark row is not judged by what ran before it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    warmup: int = Field(default=3, ge=0, description="untimed calls before measuring")
    warmup_ms: float = Field(
        default=50.0,
        ge=0,
        description="on a GPU, untimed calls (each after the L2 flush, as timed) go on for at least this much "
        "device time first",
    )
    repeat: int = Field(default=20, ge=1, description="timed calls; the median is kept")
    statistic: Literal["median"] = "median"
    cold_l2: bool = Field(default=True, description="overwrite a buffer larger than L2 before each timed call")
    l2_flush_bytes: int = Field(default=256 * 2**20, ge=0)
    execution: Literal["cuda_graph", "eager"] = "cuda_graph"
    settle_blocks: int = Field(
        default=3,
        ge=1,
        description="on a GPU, time up to this many blocks of `repeat` calls, until a block is no faster than "
        "the one before and does not speed up within itself; the last block is kept (1: one block)",
    )
    min_speedup: float = Field(
        default=1.01,
        ge=1.0,
        description="a tuned winner must beat the untuned choice by this factor, else the untuned choice is kept",
    )
    max_candidates: int = Field(default=64, ge=1, description="at most this many tactics measured per problem")
    max_seconds: float = Field(default=60.0, gt=0, description="time budget for measuring one problem")

    def identity(self) -> dict[str, object]:
        """What enters the store's environment hash: everything that changes a measured time."""
        return self.model_dump(mode="json", include={"warmup", "warmup_ms", "repeat", "statistic", "cold_l2",
                                                      "l2_flush_bytes", "execution", "settle_blocks"})  # fmt: skip
