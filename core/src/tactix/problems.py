"""Problem descriptors: what every op's problem shares (keys, buckets, hashes), and building one.

A problem is a frozen pydantic model of everything about a call that changes which kernel is
valid or fastest. Each op defines its own (`tactix.ops`: ``PrefillProblem``, ``DecodeProblem``,
``RaggedPrefillProblem``, ``GemmProblem``) on `ProblemBase`. A problem holds the *real* sizes
of the batch it was made from (so a backend's ``check`` can look at them), and
:meth:`ProblemBase.bucketed` turns it into the key under which tuned tactics are stored.

Bucketing
---------
The sizes an op lists as dynamic (``ProblemBase.dynamic``: batch size, token counts, kv
length, GEMM ``m``) are rounded **up to the next power of two** for the key; everything else is
part of the key exactly. A tactic stored for a bucket is always re-checked against the real
problem at plan time, so a tactic that is valid for some sizes of a bucket but not others is
never used where it is invalid.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from tactix.errors import InvalidArgumentError
from tactix.layouts import KVLayout

if TYPE_CHECKING:
    from tactix.ops import AnyProblem

__all__ = ["KVLayout", "ProblemBase", "bucket_size", "key_hash", "make_problem", "problem_from_key"]


def bucket_size(n: int) -> int:
    """The bucket a dynamic size falls in: the next power of two (0 stays 0)."""
    if n <= 1:
        return max(n, 0)
    return 1 << (n - 1).bit_length()


def key_hash(key: dict[str, Any]) -> str:
    """The stable hash of a problem key (:meth:`ProblemBase.key`): the same in every process and
    Python version. The store names entry files by it and checks them against it."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _values(names: list[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A C-level getter of ``names`` from a dict, always giving a tuple."""
    if not names:
        return lambda d: ()
    if len(names) == 1:
        name = names[0]
        return lambda d: (d[name],)
    return operator.itemgetter(*names)  # type: ignore[return-value]


class ProblemBase(BaseModel):
    """The base of every op's problem: ``op`` names it, ``dynamic`` lists its bucketed sizes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: ClassVar[str]
    dynamic: ClassVar[tuple[str, ...]] = ()
    implicit: ClassVar[tuple[str, ...]] = ()
    """Fields left out of :meth:`key` while they hold their default (fields added after entries
    were stored: those entries' keys, and hashes, stay what they were)."""
    _static_values: ClassVar[staticmethod[[dict[str, Any]], tuple[Any, ...]]]
    _dynamic_values: ClassVar[staticmethod[[dict[str, Any]], tuple[Any, ...]]]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # staticmethod: a lambda stored on the class would otherwise bind as a method
        cls._static_values = staticmethod(_values([n for n in cls.model_fields if n not in cls.dynamic]))
        cls._dynamic_values = staticmethod(_values(list(cls.dynamic)))

    def tolerance(self) -> float:
        """The largest relative error against a float64 reference a correct result may have
        (`tactix.testing.oracle`'s bounds for the problem's dtypes; the autotuner's agreement
        check between candidates uses it)."""
        raise NotImplementedError(f"{type(self).__name__} must say how exact its results can be")

    def bucketed(self) -> Self:
        """This problem with its dynamic sizes rounded up to their bucket: the store key."""
        changes = {name: bucket_size(getattr(self, name)) for name in self.dynamic}
        return self.model_copy(update=changes)

    def static_key(self) -> tuple[Any, ...]:
        """A hashable identity of everything but the dynamic sizes (for memos of what depends
        on the static problem only)."""
        return (self.op, *self._static_values(self.__dict__))

    def bucket_key(self) -> tuple[Any, ...]:
        """A hashable identity of this problem's bucket, cheap to compute (in-memory lookups);
        equal exactly when :meth:`key_hash` is equal."""
        d = self.__dict__
        return (self.op, *self._static_values(d), *map(bucket_size, self._dynamic_values(d)))

    def key(self) -> dict[str, Any]:
        """The JSON object identifying this problem's bucket (includes the op)."""
        key = {"op": self.op, **self.bucketed().model_dump(mode="json")}
        for name in self.implicit:
            default = type(self).model_fields[name].default
            if key[name] == (list(default) if isinstance(default, tuple) else default):  # (JSON: a tuple is a list)
                del key[name]
        return key

    def key_json(self) -> str:
        return json.dumps(self.key(), sort_keys=True, separators=(",", ":"))

    def key_hash(self) -> str:
        """A stable hash of :meth:`key`; the same in every process and Python version."""
        return key_hash(self.key())


def make_problem(op: str, **fields: Any) -> AnyProblem:
    """Build ``op``'s problem, turning pydantic's validation error into an `InvalidArgumentError`."""
    from tactix.ops import definition

    cls = definition(op).problem
    try:
        return cls(**fields)  # type: ignore[return-value]
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(p) for p in err["loc"]) or "problem"
        given = err.get("input")
        if not err["loc"] and isinstance(given, dict):
            given = {k: given[k] for k in ("num_qo_heads", "num_kv_heads") if k in given}
        raise InvalidArgumentError(name, err["msg"].removeprefix("Value error, "), given) from None


def problem_from_key(key: Any) -> AnyProblem:
    """Rebuild a problem from :meth:`ProblemBase.key` output (used when reading stored entries).

    A key is file content, not a caller's argument: a defect raises `ValueError` (pydantic's
    `ValidationError` for a bad field), never an error that blames an argument.
    """
    from tactix.ops import OPS

    if not isinstance(key, dict):
        raise ValueError(f"a key must be a JSON object (got {type(key).__name__})")
    fields = dict(key)
    op = fields.pop("op", None)
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"a key's 'op' must be one of {sorted(OPS)} (got {op!r:.40})")
    return OPS[op].problem.model_validate(fields)  # type: ignore[return-value]


def __getattr__(name: str) -> Any:
    # the op-specific names that lived here before each op got its module (tactix.ops): old
    # imports keep working; new code imports them from tactix or tactix.ops
    from tactix import ops

    if name in ("PrefillProblem", "DecodeProblem", "GemmProblem", "Problem", "Op"):
        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
