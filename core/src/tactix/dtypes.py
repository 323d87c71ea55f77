"""Data-type names used in problems and capabilities, and their conversion to and from torch dtypes.

Problems hold dtypes as stable strings (``"bfloat16"``), never as ``torch.dtype`` objects, so that
they serialise to JSON and hash the same in every process.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

import torch

from tactix.errors import InvalidArgumentError

__all__ = ["SHORT_NAMES", "DTypeName", "dtype_name", "element_size", "parse_dtype", "to_torch_dtype"]

DTypeName = Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]

_BY_NAME: Final[dict[str, torch.dtype]] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_ALIASES: Final[dict[str, str]] = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
}
_BY_DTYPE: Final[dict[torch.dtype, str]] = {v: k for k, v in _BY_NAME.items()}
assert set(_BY_NAME) == set(get_args(DTypeName))
SHORT_NAMES: Final[dict[str, str]] = {
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}
"""The short name of each dtype in problem labels and conformance case ids (``bf16``)."""


def dtype_name(dtype: torch.dtype) -> DTypeName:
    """The problem-schema name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _BY_DTYPE[dtype]  # type: ignore[return-value]
    except KeyError:
        raise InvalidArgumentError("dtype", f"one of {sorted(_BY_NAME)}", dtype) from None


def parse_dtype(value: torch.dtype | str, argument: str) -> DTypeName:
    """Accept a torch dtype or a name (``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``)."""
    if isinstance(value, torch.dtype):
        if value in _BY_DTYPE:
            return _BY_DTYPE[value]  # type: ignore[return-value]
    elif isinstance(value, str):
        key = value.removeprefix("torch.").lower()
        key = _ALIASES.get(key, key)
        if key in _BY_NAME:
            return key  # type: ignore[return-value]
    raise InvalidArgumentError(argument, f"a dtype among {sorted(_BY_NAME)}", value)


def to_torch_dtype(name: str) -> torch.dtype:
    return _BY_NAME[name]


def element_size(name: str) -> int:
    return _BY_NAME[name].itemsize
