"""The exception tree of tactix: every error the library raises on purpose is a `TactixError`.

TactixError
├── InvalidArgumentError (also ValueError)   bad input: names the argument, what was expected, what was given
├── TacticError (also ValueError)            a tactic that cannot be used (malformed, bare integer, wrong backend)
├── UnsupportedProblemError                  the chosen backend cannot serve this problem (carries the reasons)
├── BackendNotFoundError (also LookupError)  an unknown backend name (lists the valid ones)
├── BackendUnavailableError                  a known backend that is disabled, failed to load, or cannot run here
│   └── DuplicateBackendError                two distributions register the same backend name
├── PluginError                              a plugin broke its contract (wrong return type, wrong name, ...)
├── StoreError                               a store directory cannot be used as asked (bad manifest, unwritable)
├── DistributedError                         the ranks of a process group differ, or one stopped answering
└── BackendError (also RuntimeError)         a backend's plan or run raised; the original error is the cause

TactixWarning (UserWarning)
└── FallbackWarning                          a stored tactic or a backend failed and another served instead
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "BackendError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "DistributedError",
    "DuplicateBackendError",
    "FallbackWarning",
    "InvalidArgumentError",
    "PluginError",
    "StoreError",
    "TacticError",
    "TactixError",
    "TactixWarning",
    "UnsupportedProblemError",
]


class TactixError(Exception):
    """Base class of every error tactix raises on purpose."""


class InvalidArgumentError(TactixError, ValueError):
    """An argument has the wrong type, shape, dtype, device or value.

    The message reads ``'<argument>' must be <expected> (got <given>)``.
    """

    def __init__(self, argument: str, expected: str, given: Any) -> None:
        self.argument = argument
        self.expected = expected
        self.given = given
        super().__init__(f"'{argument}' must be {expected} (got {given})")


class TacticError(TactixError, ValueError):
    """A tactic that cannot be used: malformed, a bare plan index, or from another backend."""


class UnsupportedProblemError(TactixError):
    """The backend cannot serve the problem; ``reasons`` lists why (from its ``check``)."""

    def __init__(self, backend: str, problem: object, reasons: Sequence[str]) -> None:
        self.backend = backend
        self.problem = problem
        self.reasons = list(reasons)
        joined = "; ".join(self.reasons)
        super().__init__(f"backend '{backend}' cannot serve {problem}: {joined}")


class BackendNotFoundError(TactixError, LookupError):
    """A backend name that no installed plugin registers."""

    def __init__(self, name: str, valid: Iterable[str]) -> None:
        self.name = name
        self.valid = sorted(valid)
        choices = ", ".join(repr(v) for v in self.valid) or "none"
        super().__init__(f"'backend' must be 'auto' or one of {choices} (got {name!r})")


class BackendUnavailableError(TactixError):
    """A backend that is installed but disabled, failed to load, or cannot run on this machine."""


class DuplicateBackendError(BackendUnavailableError):
    """Two distributions register the same backend name; neither is used until one is removed."""


class PluginError(TactixError):
    """A plugin broke the plugin contract (wrong return type from a hook, mismatched name, ...)."""


class StoreError(TactixError):
    """A tactic store directory cannot be used as asked: its manifest is defective, or it cannot be
    written where writing was the point (``tactix cache import``, ``clear``, ``verify --delete``)."""


class DistributedError(TactixError):
    """The ranks of a process group cannot agree on tactics: their environments differ, a rank
    stopped answering within the timeout, or rank 0 failed while the others waited for it."""


class BackendError(TactixError, RuntimeError):
    """A backend's plan or run raised. ``__cause__`` holds the original exception."""

    def __init__(self, backend: str, what: str, cause: BaseException) -> None:
        self.backend = backend
        super().__init__(f"backend '{backend}' failed to {what}: {type(cause).__name__}: {cause}")


class TactixWarning(UserWarning):
    """Base class of tactix warnings."""


class FallbackWarning(TactixWarning):
    """A tactic or backend could not serve a problem and another one was used instead."""
