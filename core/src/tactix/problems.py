"""Problem descriptors: everything about a call that changes which kernel is valid or fastest.

A problem is a frozen pydantic model. It holds the *real* sizes of the batch it was made from
(so a backend's ``check`` can look at them), and :meth:`bucketed` turns it into the key under
which tuned tactics are stored.

Bucketing
---------
Sizes that change from batch to batch are rounded **up to the next power of two** for the key:

* prefill: ``batch_size``, ``num_qo_tokens``, ``max_qo_len``, ``max_kv_len``
* decode:  ``batch_size``, ``max_kv_len``
* GEMM:    ``m``

Everything else (heads, head dims, page size, layout, dtypes, masks, scale, soft-cap, LSE, GEMM
``n``/``k``/batch/operand layouts/scales/bias, device type) is part of the key exactly. A tactic
stored for a bucket is always re-checked against the real problem at plan time, so a tactic
that is valid for some sizes of a bucket but not others is never used where it is invalid.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tactix.dtypes import DTypeName
from tactix.errors import InvalidArgumentError

__all__ = [
    "DecodeProblem",
    "GemmProblem",
    "KVLayout",
    "Op",
    "PrefillProblem",
    "Problem",
    "bucket_size",
    "make_problem",
]

Op = Literal["prefill", "decode", "gemm"]
KVLayout = Literal["NHD", "HND"]

_SHORT_DTYPE = {
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}


def bucket_size(n: int) -> int:
    """The bucket a dynamic size falls in: the next power of two (0 stays 0)."""
    if n <= 1:
        return max(n, 0)
    return 1 << (n - 1).bit_length()


def _values(names: list[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A C-level getter of ``names`` from a dict, always giving a tuple."""
    if not names:
        return lambda d: ()
    if len(names) == 1:
        name = names[0]
        return lambda d: (d[name],)
    return operator.itemgetter(*names)  # type: ignore[return-value]


class _ProblemBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op: ClassVar[Op]
    _dynamic: ClassVar[tuple[str, ...]] = ()
    _static_values: ClassVar[staticmethod[[dict[str, Any]], tuple[Any, ...]]]
    _dynamic_values: ClassVar[staticmethod[[dict[str, Any]], tuple[Any, ...]]]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # staticmethod: a lambda stored on the class would otherwise bind as a method
        cls._static_values = staticmethod(_values([n for n in cls.model_fields if n not in cls._dynamic]))
        cls._dynamic_values = staticmethod(_values(list(cls._dynamic)))

    def bucketed(self) -> Self:
        """This problem with its dynamic sizes rounded up to their bucket: the store key."""
        changes = {name: bucket_size(getattr(self, name)) for name in self._dynamic}
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
        return {"op": self.op, **self.bucketed().model_dump(mode="json")}

    def key_json(self) -> str:
        return json.dumps(self.key(), sort_keys=True, separators=(",", ":"))

    def key_hash(self) -> str:
        """A stable hash of :meth:`key_json`; the same in every process and Python version."""
        return hashlib.sha256(self.key_json().encode()).hexdigest()[:32]


class _AttentionProblem(_ProblemBase):
    device_type: str = Field(description="torch device type of the tensors: 'cpu', 'cuda', ...")
    num_qo_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim_qk: int = Field(ge=1)
    head_dim_vo: int = Field(ge=1)
    page_size: int = Field(ge=1)
    kv_layout: KVLayout
    q_dtype: DTypeName
    kv_dtype: DTypeName
    out_dtype: DTypeName
    sm_scale: float = Field(gt=0)
    window_left: int = Field(ge=-1, description="-1: no sliding window")
    logits_soft_cap: float = Field(ge=0, description="0: no soft-cap")
    return_lse: bool
    deterministic: bool = Field(
        default=True,
        description="bitwise identical output for identical inputs (False admits faster tactics that "
        "reduce in a run-dependent order)",
    )
    batch_size: int = Field(ge=1)
    max_kv_len: int = Field(ge=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> Self:
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self

    @property
    def gqa_ratio(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def _label(self) -> str:
        dims = (
            f"d{self.head_dim_qk}"
            if self.head_dim_qk == self.head_dim_vo
            else f"d{self.head_dim_qk}x{self.head_dim_vo}"
        )
        dtype = _SHORT_DTYPE[self.q_dtype]
        if self.kv_dtype != self.q_dtype:
            dtype += f"/{_SHORT_DTYPE[self.kv_dtype]}"
        parts = [
            dtype,
            f"h{self.num_qo_heads}/{self.num_kv_heads}",
            dims,
            f"p{self.page_size}",
            self.kv_layout,
        ]
        if isinstance(self, (PrefillProblem, DecodeProblem)) and self.causal:
            parts.append("causal")
        if self.window_left >= 0:
            parts.append(f"win{self.window_left}")
        if self.logits_soft_cap > 0:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.return_lse:
            parts.append("lse")
        if not self.deterministic:
            parts.append("nondet")
        if self.device_type != "cuda":
            parts.append(self.device_type)
        return "-".join(parts)


class PrefillProblem(_AttentionProblem):
    """Ragged queries over a paged KV cache (prefill, append, chunked prefill)."""

    op: ClassVar[Op] = "prefill"
    _dynamic: ClassVar[tuple[str, ...]] = (
        "batch_size",
        "num_qo_tokens",
        "max_qo_len",
        "max_kv_len",
    )

    causal: bool
    num_qo_tokens: int = Field(ge=0)
    max_qo_len: int = Field(ge=0)

    def __str__(self) -> str:
        return f"prefill[{self._label()}]"


class DecodeProblem(_AttentionProblem):
    """One query token per request over a paged KV cache."""

    op: ClassVar[Op] = "decode"
    _dynamic: ClassVar[tuple[str, ...]] = ("batch_size", "max_kv_len")

    @property
    def causal(self) -> bool:
        """Never: a decode row attends every key of its request (`PrefillProblem.causal`'s twin,
        so code over both reads it directly; not a field, so keys are unchanged)."""
        return False

    @property
    def max_qo_len(self) -> int:
        """One query row per request (`PrefillProblem.max_qo_len`'s twin; not a field)."""
        return 1

    def __str__(self) -> str:
        return f"decode[{self._label()}]"


class GemmProblem(_ProblemBase):
    """``out[b, m, n] = scale_a * scale_b * (a[b, m, k] @ b[b, k, n]) + bias[n]``.

    ``a_k_major``: ``a`` is contiguous along k (row-major ``[m, k]``).
    ``b_k_major``: ``b`` is contiguous along k (the ``[n, k]`` weight layout of ``nn.Linear``,
    passed as its transpose).
    """

    op: ClassVar[Op] = "gemm"
    _dynamic: ClassVar[tuple[str, ...]] = ("m",)

    device_type: str
    m: int = Field(ge=1)
    n: int = Field(ge=1)
    k: int = Field(ge=1)
    batch: int = Field(ge=1, default=1)
    batched: bool = False
    a_dtype: DTypeName
    b_dtype: DTypeName
    out_dtype: DTypeName
    a_k_major: bool = True
    b_k_major: bool = True
    scale_mode: Literal["none", "per_tensor"] = "none"
    bias_dtype: DTypeName | None = None

    def __str__(self) -> str:
        dtype = _SHORT_DTYPE[self.a_dtype]
        if self.b_dtype != self.a_dtype:
            dtype += f"x{_SHORT_DTYPE[self.b_dtype]}"
        parts = [
            f"{dtype}->{_SHORT_DTYPE[self.out_dtype]}",
            f"m{self.m}n{self.n}k{self.k}",
            ("A-k" if self.a_k_major else "A-m") + ("B-k" if self.b_k_major else "B-n"),
        ]
        if self.batched:
            parts.append(f"batch{self.batch}")
        if self.scale_mode != "none":
            parts.append(self.scale_mode)
        if self.bias_dtype is not None:
            parts.append("bias")
        if self.device_type != "cuda":
            parts.append(self.device_type)
        return f"gemm[{'-'.join(parts)}]"


Problem = PrefillProblem | DecodeProblem | GemmProblem

_CLASSES: dict[str, type[_ProblemBase]] = {
    "prefill": PrefillProblem,
    "decode": DecodeProblem,
    "gemm": GemmProblem,
}


def make_problem(op: Op, **fields: Any) -> Problem:
    """Build a problem, turning pydantic's validation error into an `InvalidArgumentError`."""
    cls = _CLASSES[op]
    try:
        return cls(**fields)  # type: ignore[return-value]
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(p) for p in err["loc"]) or "problem"
        given = err.get("input")
        if not err["loc"] and isinstance(given, dict):
            given = {k: given[k] for k in ("num_qo_heads", "num_kv_heads") if k in given}
        raise InvalidArgumentError(name, err["msg"].removeprefix("Value error, "), given) from None


def problem_from_key(key: Any) -> Problem:
    """Rebuild a problem from :meth:`key` output (used when reading stored entries).

    A key is file content, not a caller's argument: a defect raises `ValueError` (pydantic's
    `ValidationError` for a bad field), never an error that blames an argument.
    """
    if not isinstance(key, dict):
        raise ValueError(f"a key must be a JSON object (got {type(key).__name__})")
    fields = dict(key)
    op = fields.pop("op", None)
    if not isinstance(op, str) or op not in _CLASSES:
        raise ValueError(f"a key's 'op' must be one of {sorted(_CLASSES)} (got {op!r:.40})")
    return _CLASSES[op].model_validate(fields)  # type: ignore[return-value]
