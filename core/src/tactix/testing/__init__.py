"""Tools for proving a backend correct: the float64 oracle and its tolerances."""

from tactix.testing.oracle import (
    LSE_TOLERANCE,
    TOLERANCE,
    attention_reference,
    gemm_reference,
    lse_error,
    merge_reference,
    ragged_reference,
    relative_error,
    tolerance_for,
)

__all__ = [
    "LSE_TOLERANCE",
    "TOLERANCE",
    "attention_reference",
    "gemm_reference",
    "lse_error",
    "merge_reference",
    "ragged_reference",
    "relative_error",
    "tolerance_for",
]
