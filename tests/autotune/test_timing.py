"""When the timer keeps timing: `settled` decides whether a block of samples is the one to keep.

After memory is freed a GPU runs kernels a few percent slower for milliseconds (measured on the
H200: benchmarks/two_speeds.py); a block taken then is slow throughout or steps down partway.
These check the rule that repeats such blocks, on sample lists shaped like the measured ones."""

from __future__ import annotations

import pytest
import torch

from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import Timing, measure_with_policy, settled


def block(*samples: float) -> Timing:
    ordered = sorted(samples)
    return Timing(median=ordered[len(ordered) // 2], samples=samples)


STEADY = block(*([183.0, 182.5, 183.4, 182.8] * 5))
SLOW = block(*([198.0, 197.5, 199.1, 198.4] * 5))
STEP = block(*([198.0] * 13 + [183.0] * 7))  # D1-fp8 in session 19: fast from call 14


def test_a_first_block_is_never_settled_alone() -> None:
    """Without a block before it, even a steady block is timed again (a uniformly slow block looks
    steady)."""
    assert not settled(None, STEADY)
    assert not settled(None, SLOW)


def test_a_block_faster_than_the_one_before_is_not_settled() -> None:
    assert not settled(SLOW, STEADY)


def test_a_block_that_steps_down_within_itself_is_not_settled() -> None:
    assert not settled(STEADY, STEP)


def test_a_steady_block_no_faster_than_before_is_settled() -> None:
    assert settled(STEADY, block(*([183.2, 182.9, 183.6, 182.7] * 5)))
    assert settled(STEADY, SLOW)  # slower than before: the times are not falling


def test_noise_within_the_tolerance_is_settled() -> None:
    noisy = block(*([184.0, 182.0, 185.0, 181.5, 183.0] * 4))
    assert settled(STEADY, noisy)


def test_settle_blocks_is_part_of_the_store_environment() -> None:
    """Times taken with and without settling are not compared: the store keys them apart."""
    assert MeasurementPolicy(settle_blocks=1).identity() != MeasurementPolicy().identity()


def test_settle_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="settle_blocks"):
        MeasurementPolicy(settle_blocks=0)


def test_the_cpu_times_one_block() -> None:
    """On the CPU (a monotonic clock, no freed-memory slowdown) one block is taken, as before."""
    calls = []
    timing = measure_with_policy(lambda: calls.append(1), torch.device("cpu"), MeasurementPolicy(warmup=2, repeat=7))
    assert timing.blocks == 1 and len(timing.samples) == 7 and len(calls) == 9


def test_warmup_ms_is_part_of_the_store_environment_and_not_negative() -> None:
    assert MeasurementPolicy(warmup_ms=0).identity() != MeasurementPolicy().identity()
    with pytest.raises(ValueError, match="warmup_ms"):
        MeasurementPolicy(warmup_ms=-1)
