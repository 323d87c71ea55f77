"""The tactic schema: one pydantic model for every backend's choice of kernel and parameters.

A tactic names a backend, a kernel of that backend, and the kernel's parameters as a JSON
object whose meaning the backend defines (cuDNN: engine id and knobs; cuda_native: tile sizes;
torch: the SDPA implementation). Tactics serialise to canonical JSON (sorted keys, no spaces)
and hash stably across processes. A bare integer (a plan index) is never a tactic: indices are
not stable across library rebuilds, so one found where a tactic is expected is rejected.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from tactix.errors import TacticError

__all__ = ["DEFAULT_KERNEL", "SCHEMA_VERSION", "Tactic", "parse_tactic"]

SCHEMA_VERSION: Final = 1
"""Version of the tactic and store schema. Bumped when a stored tactic's meaning changes."""

DEFAULT_KERNEL: Final = "default"
"""Kernel name of every backend's default tactic: its own heuristic choice for the problem."""


class Tactic(BaseModel):
    """A backend's choice of kernel and parameters for a problem.

    Examples
    --------
    >>> Tactic(backend="torch", kernel="sdpa", params={"sdpa_backend": "math"}).to_json()
    '{"backend":"torch","kernel":"sdpa","params":{"sdpa_backend":"math"},"schema_version":1}'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = Field(default=SCHEMA_VERSION)
    backend: str = Field(min_length=1)
    kernel: str = Field(min_length=1)
    params: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _reject_plan_index(cls, data: Any) -> Any:
        if isinstance(data, bool) or not isinstance(data, (dict, Tactic)):
            raise ValueError(
                "a tactic must be an object with 'backend', 'kernel' and 'params' "
                f"(got {type(data).__name__} {data!r}); bare plan indices are not stable "
                "across library versions and are never accepted"
            )
        return data

    @model_validator(mode="after")
    def _known_version(self) -> Tactic:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"tactic schema_version must be {SCHEMA_VERSION} (got {self.schema_version})")
        return self

    @classmethod
    def default(cls, backend: str) -> Tactic:
        """The backend's default tactic: its own heuristic choice for each problem."""
        found = _DEFAULTS.get(backend)
        if found is None or type(found) is not cls:
            found = _DEFAULTS[backend] = cls(backend=backend, kernel=DEFAULT_KERNEL)
        return found

    @property
    def is_default(self) -> bool:
        return self.kernel == DEFAULT_KERNEL

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace. Equal tactics give equal strings."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """A stable hash of :meth:`to_json`."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tactic) and self.to_json() == other.to_json()

    def __str__(self) -> str:
        if not self.params:
            return f"{self.backend}:{self.kernel}"
        args = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.backend}:{self.kernel}({args})"


def parse_tactic(value: Tactic | dict[str, Any] | str, argument: str = "tactic") -> Tactic:
    """Accept a `Tactic`, its JSON text, or its dict form; anything else is a `TacticError`."""
    if isinstance(value, Tactic):
        return value
    try:
        if isinstance(value, str):
            return Tactic.model_validate_json(value)
        return Tactic.model_validate(value)
    except ValidationError as exc:
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise TacticError(f"'{argument}' is not a valid tactic: {msg}") from None


_DEFAULTS: dict[str, Tactic] = {}  # Tactic.default per backend name (tactics are immutable)
