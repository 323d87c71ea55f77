"""Checks of the plain (non-tensor) arguments of the public API, shared by every wrapper, so
one kind of argument is refused by one rule with one message."""

from __future__ import annotations

from tactix.errors import InvalidArgumentError

__all__ = ["described", "flag", "number", "positive_int"]


def flag(value: object, argument: str) -> bool:
    """``value`` if it is a bool. Anything else (``1``, ``"yes"``, a tensor) is refused rather
    than read by its truth value: ``causal="no"`` would otherwise mean causal."""
    if not isinstance(value, bool):  # bool cannot be subclassed: exactly True or False
        raise InvalidArgumentError(argument, "a bool", repr(value))
    return value


def positive_int(value: object, argument: str) -> int:
    """``value`` if it is an int >= 1 (a bool is not: ``True`` would mean 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(argument, "a positive int", repr(value))
    return value


def number(value: object, argument: str, expected: str) -> float:
    """``value`` as a float: a Python or NumPy number or a one-element tensor. A string (``"0.5"``
    is not read as a number), a bool or anything else is refused, saying it ``expected``."""
    if isinstance(value, (str, bytes, bool)):
        raise InvalidArgumentError(argument, expected, repr(value))
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise InvalidArgumentError(argument, expected, repr(value)) from None


def described(value: object) -> str:
    """What an error says was given for a tensor argument: dtype, shape and device, else the type."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return "None" if value is None else type(value).__name__
