"""GEMM: `Gemm` (plan once, run many times) and the one-shot `gemm`.

``out = scale_a * scale_b * (a @ b) + bias`` with ``a`` of logical shape ``[m, k]`` and ``b`` of
logical shape ``[k, n]`` (``[batch, m, k]`` and ``[batch, k, n]`` when batched), exactly as
``torch.matmul`` reads them. Either operand may be stored in either layout:

* ``a`` k-major: row-major ``[m, k]`` (``a.stride(-1) == 1``); m-major: the transpose of a
  row-major ``[k, m]`` tensor.
* ``b`` k-major: the transpose of a row-major ``[n, k]`` weight, as ``nn.Linear`` stores it
  (``b.stride(-2) == 1``); n-major: row-major ``[k, n]``.

The layout is part of the problem (a kernel valid for one layout may be invalid for the other).
fp8 (``float8_e4m3fn``) operands take per-tensor float32 scales ``scale_a`` and ``scale_b``
(one element each) and produce bf16, fp16 or fp32; 16- and 32-bit operands produce their own
dtype. ``bias`` is ``[n]`` of the output dtype.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

import torch

from tactix.arguments import described, flag, positive_int
from tactix.devices import resolve_device
from tactix.dtypes import parse_dtype, to_torch_dtype
from tactix.errors import InvalidArgumentError, TactixError
from tactix.hookspecs import PlanOptions
from tactix.ops import GemmProblem
from tactix.problems import make_problem
from tactix.selection import PlannedOp, select_and_plan
from tactix.tactics import Tactic, parse_tactic

__all__ = ["Gemm", "gemm", "gemm_problem"]

_FP8 = ("float8_e4m3fn", "float8_e5m2")


def _a_layout(a: torch.Tensor) -> Literal["k", "m"] | None:
    """'k' if ``a [.., m, k]`` is dense along k, 'm' if along m, None if neither."""
    m, k = a.shape[-2], a.shape[-1]
    if a.stride(-1) == 1 and (a.stride(-2) == k or m == 1):
        return "k"
    if a.stride(-2) == 1 and (a.stride(-1) == m or k == 1):
        return "m"
    return None


def _b_layout(b: torch.Tensor) -> Literal["k", "n"] | None:
    """'k' if ``b [.., k, n]`` is dense along k (a transposed [n, k] weight), 'n' if along n."""
    k, n = b.shape[-2], b.shape[-1]
    if b.stride(-2) == 1 and (b.stride(-1) == k or n == 1):
        return "k"
    if b.stride(-1) == 1 and (b.stride(-2) == n or k == 1):
        return "n"
    return None


def _layout_matches(t: torch.Tensor, k_major: bool, is_a: bool) -> bool:
    # a dimension of size 1 makes both layouts true at once; accept either then.
    rows, cols = t.shape[-2], t.shape[-1]
    if is_a:
        if rows == 1 or cols == 1:
            return _a_layout(t) is not None
        return _a_layout(t) == ("k" if k_major else "m")
    if rows == 1 or cols == 1:
        return _b_layout(t) is not None
    return _b_layout(t) == ("k" if k_major else "n")


def gemm_problem(
    m: int,
    n: int,
    k: int,
    *,
    batch: int | None,
    a_dtype: torch.dtype | str,
    b_dtype: torch.dtype | str | None,
    out_dtype: torch.dtype | str | None,
    a_k_major: bool,
    b_k_major: bool,
    bias_dtype: torch.dtype | str | None,
    device: torch.device,
) -> GemmProblem:
    """Validate `Gemm.plan` arguments into the problem a backend is asked about (also used by the kit)."""
    m, n, k = positive_int(m, "m"), positive_int(n, "n"), positive_int(k, "k")
    if batch is not None:
        batch = positive_int(batch, "batch")
    a_k_major, b_k_major = flag(a_k_major, "a_k_major"), flag(b_k_major, "b_k_major")
    a_name = parse_dtype(a_dtype, "a_dtype")
    b_name = a_name if b_dtype is None else parse_dtype(b_dtype, "b_dtype")
    if (a_name in _FP8) != (b_name in _FP8):
        raise InvalidArgumentError("b_dtype", f"fp8 exactly when a is ({a_name})", b_name)
    fp8 = a_name in _FP8
    default_out = "bfloat16" if fp8 else a_name
    out_name = default_out if out_dtype is None else parse_dtype(out_dtype, "out_dtype")
    bias_name = None if bias_dtype is None else parse_dtype(bias_dtype, "bias_dtype")
    if bias_name is not None and bias_name != out_name:
        raise InvalidArgumentError("bias_dtype", f"the output dtype {out_name}", bias_name)
    problem = make_problem(
        "gemm",
        device_type=device.type,
        m=m,
        n=n,
        k=k,
        batch=batch or 1,
        batched=batch is not None,
        a_dtype=a_name,
        b_dtype=b_name,
        out_dtype=out_name,
        a_k_major=a_k_major,
        b_k_major=b_k_major,
        scale_mode="per_tensor" if fp8 else "none",
        bias_dtype=bias_name,
    )
    assert isinstance(problem, GemmProblem)
    return problem


class Gemm(PlannedOp):
    """A planned GEMM, reusable across calls of the same shape.

    Examples
    --------
    >>> import torch, tactix
    >>> weight = torch.randn(96, 64, dtype=torch.bfloat16)            # nn.Linear layout [n, k]
    >>> g = tactix.Gemm(device="cpu")
    >>> g.plan(8, 96, 64, a_dtype=torch.bfloat16)                     # b k-major by default
    >>> g.run(torch.randn(8, 64, dtype=torch.bfloat16), weight.t()).shape
    torch.Size([8, 96])
    """

    def plan(
        self,
        m: int,
        n: int,
        k: int,
        *,
        batch: int | None = None,
        a_dtype: torch.dtype | str = torch.bfloat16,
        b_dtype: torch.dtype | str | None = None,
        out_dtype: torch.dtype | str | None = None,
        a_k_major: bool = True,
        b_k_major: bool = True,
        bias_dtype: torch.dtype | str | None = None,
        backend: str | None = None,
        tactic: Tactic | dict[str, Any] | str | None = None,
    ) -> None:
        """Plan ``[batch,] m x n x k``. fp8 operands imply per-tensor scales.

        ``a_k_major`` and ``b_k_major`` are bools; ``tactic`` is a `Tactic`, the form it prints
        (``"torch:matmul"``) or its JSON object."""
        device = resolve_device(self._device)
        chosen_backend = self._backend if backend is None else backend
        problem = gemm_problem(
            m, n, k, batch=batch, a_dtype=a_dtype, b_dtype=b_dtype, out_dtype=out_dtype,
            a_k_major=a_k_major, b_k_major=b_k_major, bias_dtype=bias_dtype, device=device,
        )  # fmt: skip
        a_name, b_name, out_name, bias_name = problem.a_dtype, problem.b_dtype, problem.out_dtype, problem.bias_dtype
        fp8 = problem.scale_mode == "per_tensor"
        selection = select_and_plan(
            problem,
            None,
            backend=chosen_backend,
            tactic=None if tactic is None else parse_tactic(tactic),
            options=PlanOptions(device=device, use_cuda_graph=False, previous=None),
        )
        self._selection = selection
        self._problem = problem
        self._device_now = device
        lead = (batch,) if batch is not None else ()
        self._a_shape = torch.Size((*lead, m, k))
        self._b_shape = torch.Size((*lead, k, n))
        self._out_shape = torch.Size((*lead, m, n))
        self._a_dtype = to_torch_dtype(a_name)
        self._b_dtype = to_torch_dtype(b_name)
        self._out_dtype = to_torch_dtype(out_name)
        self._bias_dtype = None if bias_name is None else to_torch_dtype(bias_name)
        self._fp8 = fp8
        self._run = selection.plan.run

    def run(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale_a: torch.Tensor | None = None,
        scale_b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        run = self._run
        if run is None:
            raise TactixError("Gemm: call plan() before run()")
        p = self._problem
        device = self._device_now
        if type(a) is not torch.Tensor or a.shape != self._a_shape or a.dtype != self._a_dtype or a.device != device:
            _reject("a", a, self._a_shape, self._a_dtype, device)
        if type(b) is not torch.Tensor or b.shape != self._b_shape or b.dtype != self._b_dtype or b.device != device:
            _reject("b", b, self._b_shape, self._b_dtype, device)
        if not _layout_matches(a, p.a_k_major, True):
            want = "k-major (row-major [m, k])" if p.a_k_major else "m-major (a transposed [k, m] tensor)"
            raise InvalidArgumentError("a", f"{want} as planned", f"strides {a.stride()}")
        if not _layout_matches(b, p.b_k_major, False):
            want = "k-major (a transposed [n, k] weight)" if p.b_k_major else "n-major (row-major [k, n])"
            raise InvalidArgumentError("b", f"{want} as planned", f"strides {b.stride()}")
        if (bias is None) != (self._bias_dtype is None):
            raise InvalidArgumentError(
                "bias",
                "given" if self._bias_dtype is not None else "None (planned without bias)",
                "None" if bias is None else "a tensor",
            )
        if bias is not None and (
            not isinstance(bias, torch.Tensor)
            or bias.shape != (p.n,)
            or bias.dtype != self._bias_dtype
            or bias.device != device
        ):
            _reject("bias", bias, torch.Size((p.n,)), self._bias_dtype, device)  # type: ignore[arg-type]
        if self._fp8:
            for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
                if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32 or s.device != device:
                    raise InvalidArgumentError(
                        name,
                        f"a one-element float32 tensor on {device} (fp8 operands need per-tensor scales)",
                        described(s),
                    )
        elif scale_a is not None or scale_b is not None:
            raise InvalidArgumentError("scale_a", "None for non-fp8 operands", "a scale")
        if out is None:
            out = torch.empty(self._out_shape, dtype=self._out_dtype, device=device)
        elif (
            not isinstance(out, torch.Tensor)
            or out.shape != self._out_shape
            or out.dtype != self._out_dtype
            or out.device != device
            or not out.is_contiguous()
        ):
            _reject("out", out, self._out_shape, self._out_dtype, device, contiguous=True)
        run(a, b, out, bias, scale_a, scale_b)
        return out


def _reject(
    name: str,
    t: object,
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    contiguous: bool = False,
) -> None:
    expected = f"a {'contiguous ' if contiguous else ''}{dtype} tensor of shape {tuple(shape)} on {device}"
    got = described(t)
    if contiguous and isinstance(t, torch.Tensor) and not t.is_contiguous():
        got = "non-contiguous " + got
    raise InvalidArgumentError(name, expected, got)


_PLANS: OrderedDict[tuple[Any, ...], Gemm] = OrderedDict()
_PLAN_CACHE_SIZE = 256


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | str | None = None,
    backend: str = "auto",
    tactic: Tactic | dict[str, Any] | str | None = None,
) -> torch.Tensor:
    """One-shot ``scale_a * scale_b * (a @ b) + bias``; plans are cached per exact problem.

    >>> import torch, tactix
    >>> x, w = torch.randn(4, 32), torch.randn(16, 32)
    >>> torch.allclose(tactix.gemm(x, w.t()), x @ w.t())
    True
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3):
            raise InvalidArgumentError(name, "a 2-D or 3-D (batched) torch.Tensor", described(t))
    if a.dim() != b.dim():
        raise InvalidArgumentError("b", f"{a.dim()}-D like a", f"{b.dim()}-D")
    if a.shape[-1] != b.shape[-2]:
        raise InvalidArgumentError("b", f"of shape [..., k={a.shape[-1]}, n] to match a", f"shape {tuple(b.shape)}")
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise InvalidArgumentError("b", f"batch {a.shape[0]} like a", b.shape[0])
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise InvalidArgumentError("bias", "None or a torch.Tensor [n]", described(bias))
    if a.device != b.device:
        raise InvalidArgumentError("b", f"on {a.device} like a", b.device)
    for name, size in (("m", a.shape[-2]), ("k", a.shape[-1]), ("n", b.shape[-1])):
        if size == 0:  # (a zero-size matrix has no meaningful strides: say which dimension is empty)
            raise InvalidArgumentError(name, "a positive size (a, b: [..., m, k] @ [..., k, n])",
                                       f"a of shape {tuple(a.shape)}, b of shape {tuple(b.shape)}")  # fmt: skip
    a_layout, b_layout = _a_layout(a), _b_layout(b)
    if a_layout is None:
        raise InvalidArgumentError("a", "dense along k or along m", f"strides {a.stride()}")
    if b_layout is None:
        raise InvalidArgumentError("b", "dense along k or along n", f"strides {b.stride()}")
    if out is not None and out_dtype is None:
        out_dtype = out.dtype
    batch = a.shape[0] if a.dim() == 3 else None
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    tactic_key = None if tactic is None else parse_tactic(tactic).to_json()
    key = (
        m,
        n,
        k,
        batch,
        a.dtype,
        b.dtype,
        out_dtype,
        a_layout,
        b_layout,
        None if bias is None else bias.dtype,
        a.device,
        backend,
        tactic_key,
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = Gemm(backend=backend, device=a.device)
        plan.plan(
            m,
            n,
            k,
            batch=batch,
            a_dtype=a.dtype,
            b_dtype=b.dtype,
            out_dtype=out_dtype,
            a_k_major=a_layout == "k",
            b_k_major=b_layout == "k",
            bias_dtype=None if bias is None else bias.dtype,
            tactic=tactic,
        )
        _PLANS[key] = plan
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan.run(a, b, out=out, bias=bias, scale_a=scale_a, scale_b=scale_b)
