"""`TacticParams`: the base of each op's tactic parameters (`decode.DecodeParams`, `prefill.PrefillParams`,
`gemm.GemmParams`, `gemm.GemmWgmmaParams`), a frozen pydantic model read from and written to a `tactix.Tactic`.

A tactic's ``params`` are the model's fields by name: integers, and strings where a field is one
(prefill's ``mma``), nothing else (no bools, no floats, no numeric strings: pydantic's strict
mode), no unknown keys, the fields without a default required. A field named in ``IMPLICIT`` is
left out of the params at its default, so that tactics stored before it existed still match;
every other field is always written. What a value means for a problem and a GPU (tile shapes,
shared memory) is each model's ``reasons``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from tactix import Tactic, TacticError
from tactix_cuda_native import NAME

__all__ = ["TacticParams"]


class TacticParams(BaseModel):
    """A kernel's tactic parameters (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    KERNEL: ClassVar[str]
    """The tactic's kernel name."""
    IMPLICIT: ClassVar[tuple[str, ...]] = ()
    """Fields left out of a tactic's params when they hold their default."""
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}
    """The values of each string field (for the message when one is not a string)."""

    _implicit: ClassVar[dict[str, Any]] = {}  # IMPLICIT's defaults

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._implicit = {name: cls.model_fields[name].default for name in cls.IMPLICIT}

    def to_tactic(self) -> Tactic:
        implicit = self._implicit
        params = {k: v for k, v in self.__dict__.items() if k not in implicit or v != implicit[k]}
        return Tactic(backend=NAME, kernel=self.KERNEL, params=params)

    @classmethod
    def read(cls, tactic: Tactic) -> Self | str:
        """The parameters of ``tactic`` (a tactic of this kernel), or why its params are not: a
        sentence naming the parameters at fault."""
        try:
            return cls.model_validate(tactic.params)
        except ValidationError as exc:
            return cls._explain(tactic.params, exc)

    @classmethod
    def from_tactic(cls, tactic: Tactic) -> Self:
        """The parameters of a tactic of this kernel; a `tactix.TacticError` naming the parameters
        at fault for one whose params are not (`read`)."""
        if tactic.kernel != cls.KERNEL:
            raise TacticError(f"{NAME}: {tactic} is not a tactic of kernel '{cls.KERNEL}'")
        found = cls.read(tactic)
        if isinstance(found, str):
            raise TacticError(f"{NAME}: {tactic}: {found}")
        return found

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (validated, like a new model)."""
        return self.model_validate({**self.__dict__, **changes})

    def __eq__(self, other: object) -> bool:
        """Plans key their memos by parameters: the fields alone (there are no private or extra
        ones), without pydantic's general-purpose checks. (The hash is pydantic's: the fields'.)"""
        return type(other) is type(self) and self.__dict__ == other.__dict__

    @classmethod
    def _explain(cls, params: dict[str, Any], exc: ValidationError) -> str:
        fields = cls.model_fields
        errors = exc.errors()
        missing = sorted(str(e["loc"][0]) for e in errors if e["type"] == "missing")
        unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
        if missing or unknown:
            optional = [name for name, field in fields.items() if not field.is_required()]
            at_fault = "; ".join(f"{what}: {', '.join(names)}" for what, names in (("missing", missing),
                                 ("unknown", unknown)) if names)  # fmt: skip
            return (f"{cls.KERNEL} params must be {sorted(fields)} with {_and(optional)} optional "
                    f"(got {sorted(params)}); {at_fault}")  # fmt: skip
        wrong = sorted({str(e["loc"][0]) for e in errors})
        strings = [name for name in fields if fields[name].annotation is str]
        numbers = [name for name in wrong if name not in strings]
        if numbers:
            what = ", ".join(["integers", *(f"{name} a string" for name in strings)])
            return f"{cls.KERNEL} params must be {what} (got {params}); not integers: {', '.join(numbers)}"
        name = wrong[0]
        return f"{cls.KERNEL} param {name} must be {_or(cls.CHOICES.get(name, ()))} (got {params[name]!r})"


def _and(names: list[str]) -> str:
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1] if names else "")))


def _or(values: tuple[str, ...]) -> str:
    if not values:
        return "a string"
    shown = [repr(v) for v in values]
    return " or ".join(filter(None, (", ".join(shown[:-1]), shown[-1])))
