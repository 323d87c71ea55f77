"""The tactic schema: one pydantic model for every backend's choice of kernel and parameters.

A tactic names a backend, a kernel of that backend, and the kernel's parameters as a JSON
object whose meaning the backend defines (cuDNN: engine id and knobs; cuda_native: tile sizes;
torch: the SDPA implementation). Tactics serialise to canonical JSON (sorted keys, no spaces)
and hash stably across processes. A bare integer (a plan index) is never a tactic: indices are
not stable across library rebuilds, so one found where a tactic is expected is rejected.

``str(tactic)`` is the form tactix prints (wrappers, benchmark tables, warnings), and
`parse_tactic` reads it back to the same tactic::

    torch:explicit
    torch:sdpa(impl=efficient)
    cudnn:sdpa(engine=8,knobs={"KERNEL_CFG":35})

Parameters are sorted by name. A value is a bare word when it is a string that cannot be read
as anything else (letters, digits, ``_``, ``.`` and ``-``, starting with a letter or ``_``, and
not ``true``, ``false``, ``null``, ``NaN`` or ``Infinity``); every other value is canonical
JSON, so ``stages=2`` is a number, ``mode="2"`` a string and ``pdl=true`` a bool.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from tactix.errors import TacticError

__all__ = ["DEFAULT_KERNEL", "SCHEMA_VERSION", "Tactic", "parse_tactic"]

SCHEMA_VERSION: Final = 1
"""Version of the tactic and store schema. Bumped when a stored tactic's meaning changes."""

DEFAULT_KERNEL: Final = "default"
"""Kernel name of every backend's default tactic: its own heuristic choice for the problem."""

_BACKEND_NAME: Final = r"^[a-z][a-z0-9_]*$"  # the same rule as `BackendSpec.name`
_WORD: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
"""A kernel name, a bare parameter name or a bare string value in the printed form."""
_JSON_WORDS: Final = frozenset({"true", "false", "null", "NaN", "Infinity"})
"""Words that JSON (as Python's json reads it) takes for values: printed strings never use them bare."""
_decoder = json.JSONDecoder()


class Tactic(BaseModel):
    """A backend's choice of kernel and parameters for a problem.

    Examples
    --------
    >>> tactic = Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})
    >>> tactic.to_json()
    '{"backend":"torch","kernel":"sdpa","params":{"impl":"math"},"schema_version":1}'
    >>> str(tactic), parse_tactic(str(tactic)) == tactic
    ('torch:sdpa(impl=math)', True)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = Field(default=SCHEMA_VERSION)
    backend: str = Field(pattern=_BACKEND_NAME)
    # a word, so the printed form `backend:kernel(...)` reads back unambiguously
    kernel: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
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
        return _canonical(self.model_dump(mode="json"))

    def digest(self) -> str:
        """A stable hash of :meth:`to_json`."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tactic) and self.to_json() == other.to_json()

    def __str__(self) -> str:
        """The printed form (see the module docstring); `parse_tactic` reads it back."""
        if not self.params:
            return f"{self.backend}:{self.kernel}"
        args = ",".join(f"{_shown_name(k)}={_shown_value(v)}" for k, v in sorted(self.params.items()))
        return f"{self.backend}:{self.kernel}({args})"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _shown_name(name: str) -> str:
    return name if _WORD.fullmatch(name) else _canonical(name)


def _shown_value(value: JsonValue) -> str:
    if isinstance(value, str) and value not in _JSON_WORDS and _WORD.fullmatch(value):
        return value
    return _canonical(value)


def _read_printed(text: str) -> dict[str, Any] | None:
    """The fields of a tactic in the printed form, or None for text that is not in that form
    (no ``name:`` in front). Text that starts like it but breaks the form raises `ValueError`."""
    head = re.match(r"([A-Za-z0-9_]+):", text)
    if head is None:
        return None
    kernel = _WORD.match(text, head.end())
    if kernel is None:
        raise ValueError(f"a kernel name after '{head.group()}'")
    fields: dict[str, Any] = {"backend": head.group(1), "kernel": kernel.group()}
    at = kernel.end()
    if at == len(text):
        return fields
    if text[at] != "(":
        raise ValueError(f"'(name=value,...)' or nothing after the kernel name, at character {at}")
    if text[-1] != ")":
        raise ValueError("')' at the end")
    params: dict[str, Any] = {}
    at = _skip_spaces(text, at + 1)
    while text[at] != ")":
        name, at = _read_item(text, at, value=False)
        at = _skip_spaces(text, at)
        if text[at] != "=":
            raise ValueError(f"'=' after parameter {name!r}, at character {at}")
        value, at = _read_item(text, _skip_spaces(text, at + 1), value=True)
        if name in params:
            raise ValueError(f"each parameter once ({name!r} is given twice)")
        params[name] = value
        at = _skip_spaces(text, at)
        if text[at] == ",":
            at = _skip_spaces(text, at + 1)
        elif text[at] != ")":
            raise ValueError(f"',' or ')' after parameter {name!r}, at character {at}")
    if at != len(text) - 1:
        raise ValueError(f"nothing after ')' at character {at}")
    fields["params"] = params
    return fields


def _skip_spaces(text: str, at: int) -> int:
    while text[at] == " ":
        at += 1
    return at


def _read_item(text: str, at: int, value: bool) -> tuple[Any, int]:
    """A parameter name (``value=False``: a word or a JSON string) or a value (a word or JSON)
    starting at ``at``; the item and where it ends."""
    word = _WORD.match(text, at)
    if word is not None:
        found = word.group()
        if value and found in _JSON_WORDS:
            return json.loads(found), word.end()
        return found, word.end()
    if value or text[at] == '"':
        try:
            item, end = _decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            pass
        else:
            if value or isinstance(item, str):
                return item, end
    what = "value" if value else "parameter name"
    raise ValueError(f"a {what} (a word or {'JSON' if value else 'a JSON string'}) at character {at}")


_FORMS: Final = (
    "'backend:kernel' or 'backend:kernel(name=value,...)' as tactix prints tactics, or a tactic's JSON object"
)


def parse_tactic(value: Tactic | dict[str, Any] | str, argument: str = "tactic") -> Tactic:
    """Accept a `Tactic`, its dict form, its JSON text, or the form ``str(tactic)`` prints
    (``torch:explicit``, ``torch:sdpa(impl=math)``); anything else is a `TacticError`."""
    if isinstance(value, Tactic):
        return value
    try:
        if isinstance(value, str):
            text = value.strip()
            if text[:1] != "{":
                try:
                    printed = _read_printed(text) if text else None
                except (ValueError, IndexError) as exc:
                    why = str(exc) if isinstance(exc, ValueError) else "')' at the end"
                    raise TacticError(f"'{argument}' is not a valid tactic: expected {why} in {value!r}") from None
                if printed is not None:
                    return Tactic.model_validate(printed)
            try:
                return Tactic.model_validate_json(value)
            except ValidationError as exc:
                if exc.errors()[0]["type"] != "json_invalid":
                    raise
                raise TacticError(f"'{argument}' is not a valid tactic: expected {_FORMS} (got {value!r})") from None
        return Tactic.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        msg = error["msg"].removeprefix("Value error, ")
        where = ".".join(map(str, error["loc"]))
        raise TacticError(f"'{argument}' is not a valid tactic: {where + ': ' if where else ''}{msg}") from None


_DEFAULTS: dict[str, Tactic] = {}  # Tactic.default per backend name (tactics are immutable)
