"""The built-in torch backend's GEMM, through `tactix.gemm` and `tactix.Gemm`, against the oracle.

Operand layouts, as `tactix.gemm` defines them:

* ``a`` k-major: row-major ``[m, k]``; m-major: ``x.t()`` of a contiguous ``[k, m]``.
* ``b`` k-major: ``w.t()`` of a contiguous ``[n, k]`` (``nn.Linear``'s weight); n-major:
  contiguous ``[k, n]``.

Results are compared with `tactix.testing.gemm_reference` (float64, from the operands as stored)
under the tolerance of the output dtype. Seeds are in the test ids and the assertion messages.
"""

from __future__ import annotations

import pytest
import torch

import tactix
from tactix.testing import gemm_reference, relative_error, tolerance_for

F32, BF16, F16, E4M3 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn
CPU = torch.device("cpu")


def _short(dtype: torch.dtype) -> str:
    return {F32: "f32", BF16: "bf16", F16: "f16", E4M3: "e4m3"}[dtype]


def make_a(
    gen: torch.Generator,
    m: int,
    k: int,
    dtype: torch.dtype,
    layout: str,
    batch: int | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    lead = () if batch is None else (batch,)
    if layout == "k":  # row-major [.., m, k]
        return (torch.randn(*lead, m, k, generator=gen) * scale).to(dtype)
    t = (torch.randn(*lead, k, m, generator=gen) * scale).to(dtype)  # m-major: transposed [k, m]
    return t.transpose(-1, -2)


def make_b(
    gen: torch.Generator,
    k: int,
    n: int,
    dtype: torch.dtype,
    layout: str,
    batch: int | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    lead = () if batch is None else (batch,)
    if layout == "k":  # transposed [n, k] weight
        return (torch.randn(*lead, n, k, generator=gen) * scale).to(dtype).transpose(-1, -2)
    return (torch.randn(*lead, k, n, generator=gen) * scale).to(dtype)


def assert_close(out: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype, label: str) -> None:
    assert out.dtype == out_dtype, f"{label}: out dtype {out.dtype}, expected {out_dtype}"
    assert out.shape == ref.shape, f"{label}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    tol = tolerance_for(out_dtype)
    err = relative_error(out, ref)
    assert err <= tol, f"{label}: relative error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------------------------
# 16/32-bit operands: every dtype x layout of a x layout of b x bias, at odd sizes and m = 1


SHAPES = [(1, 33, 17), (7, 48, 32), (5, 1, 9)]  # (m, n, k): m = 1, odd n/k, n = 1

DENSE_CASES = [
    pytest.param(
        dtype,
        la,
        lb,
        bias,
        SHAPES[i % len(SHAPES)],
        100 + i,
        id=f"{_short(dtype)}-A{la}-B{lb}-{'bias' if bias else 'nobias'}-"
        f"m{SHAPES[i % len(SHAPES)][0]}n{SHAPES[i % len(SHAPES)][1]}k{SHAPES[i % len(SHAPES)][2]}"
        f"-seed{100 + i}",
    )
    for i, (dtype, la, lb, bias) in enumerate(
        (dtype, la, lb, bias)
        for dtype in (F32, BF16, F16)
        for la in ("k", "m")
        for lb in ("k", "n")
        for bias in (False, True)
    )
]


@pytest.mark.parametrize(("dtype", "la", "lb", "with_bias", "shape", "seed"), DENSE_CASES)
def test_gemm_dense(
    dtype: torch.dtype, la: str, lb: str, with_bias: bool, shape: tuple[int, int, int], seed: int
) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    a = make_a(gen, m, k, dtype, la)
    b = make_b(gen, k, n, dtype, lb)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    out = tactix.gemm(a, b, bias=bias, backend="torch")
    assert_close(out, gemm_reference(a, b, bias=bias), dtype, f"seed {seed}")


def test_dense_case_matrix_has_m1_and_odd_sizes() -> None:
    shapes = {p.values[4] for p in DENSE_CASES}
    assert any(m == 1 for m, _, _ in shapes)
    assert any(n % 2 and k % 2 for _, n, k in shapes)
    combos = {(p.values[0], p.values[1], p.values[2], p.values[3]) for p in DENSE_CASES}
    assert len(combos) == 3 * 2 * 2 * 2


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_short)
@pytest.mark.parametrize(("la", "lb"), [("k", "k"), ("m", "n"), ("k", "n"), ("m", "k")])
def test_gemm_batched(dtype: torch.dtype, la: str, lb: str) -> None:
    seed = 200 + 10 * [F32, BF16, F16].index(dtype) + ["kk", "mn", "kn", "mk"].index(la + lb)
    gen = torch.Generator().manual_seed(seed)
    batch, m, n, k = 3, 5, 33, 17
    a = make_a(gen, m, k, dtype, la, batch=batch)
    b = make_b(gen, k, n, dtype, lb, batch=batch)
    out = tactix.gemm(a, b, backend="torch")
    assert_close(out, gemm_reference(a, b), dtype, f"batched A{la} B{lb} seed {seed}")
    bias = torch.randn(n, generator=gen).to(dtype)
    out = tactix.gemm(a, b, bias=bias, backend="torch")
    assert_close(out, gemm_reference(a, b, bias=bias), dtype, f"batched+bias A{la} B{lb} seed {seed}")


# ----------------------------------------------------------------------------------------------
# fp8 (e4m3) with per-tensor scales


def _fp8_problem(
    m: int, n: int, k: int, la: str, lb: str, batch: int | None, out_dtype: torch.dtype, bias: bool
) -> tactix.GemmProblem:
    g = tactix.Gemm(backend="torch", device="cpu")
    g.plan(
        m,
        n,
        k,
        batch=batch,
        a_dtype=E4M3,
        out_dtype=out_dtype,
        a_k_major=la == "k",
        b_k_major=lb == "k",
        bias_dtype=out_dtype if bias else None,
    )
    return g.problem


FP8_CASES = [
    # (m, n, k, a layout, b layout, batch, out dtype, bias)
    pytest.param(16, 32, 64, "k", "k", None, BF16, False, id="k-major-n32k64-bf16"),
    pytest.param(1, 48, 16, "k", "k", None, BF16, True, id="m1-bias-bf16"),
    pytest.param(9, 64, 32, "k", "k", None, F16, True, id="bias-f16"),
    pytest.param(7, 32, 48, "k", "k", None, F32, False, id="f32-out"),
    pytest.param(5, 33, 17, "k", "k", None, BF16, False, id="odd-n33k17-bf16"),
    pytest.param(8, 32, 32, "m", "k", None, BF16, False, id="a-m-major-bf16"),
    pytest.param(8, 32, 32, "k", "n", None, BF16, True, id="b-n-major-bias-bf16"),
    pytest.param(6, 16, 32, "k", "k", 2, BF16, False, id="batched-bf16"),
]


@pytest.mark.parametrize(("m", "n", "k", "la", "lb", "batch", "out_dtype", "with_bias"), FP8_CASES)
def test_fp8_every_listed_tactic(
    m: int, n: int, k: int, la: str, lb: str, batch: int | None, out_dtype: torch.dtype, with_bias: bool
) -> None:
    seed = 300 + m * 7 + n + k + (batch or 0)
    gen = torch.Generator().manual_seed(seed)
    a = make_a(gen, m, k, E4M3, la, batch=batch, scale=2.0)
    b = make_b(gen, k, n, E4M3, lb, batch=batch, scale=2.0)
    scale_a = torch.tensor([0.37])
    scale_b = torch.tensor([1.9])
    bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
    ref = gemm_reference(a, b, bias=bias, scale_a=scale_a, scale_b=scale_b)

    problem = _fp8_problem(m, n, k, la, lb, batch, out_dtype, with_bias)
    listed = tactix.get_registry().get("torch").tactics(problem)
    kernels = [t.kernel for t in listed]
    assert "dequant" in kernels, kernels
    scaled_mm_fits = (
        la == "k"
        and lb == "k"
        and batch is None
        and k % 16 == 0
        and n % 16 == 0
        and (not with_bias or out_dtype != F32)
    )
    assert ("scaled_mm" in kernels) == scaled_mm_fits, f"listed {kernels}"
    assert "matmul" not in kernels, "matmul applies no scales"

    for tactic in listed:
        label = f"{tactic} seed {seed}"
        out = tactix.gemm(
            a,
            b,
            bias=bias,
            scale_a=scale_a,
            scale_b=scale_b,
            out_dtype=out_dtype,
            backend="torch",
            tactic=tactic,
        )
        assert_close(out, ref, out_dtype, label)
        g = tactix.Gemm(backend="torch", device="cpu")
        g.plan(
            m,
            n,
            k,
            batch=batch,
            a_dtype=E4M3,
            out_dtype=out_dtype,
            a_k_major=la == "k",
            b_k_major=lb == "k",
            bias_dtype=out_dtype if with_bias else None,
            tactic=tactic,
        )
        assert g.backend == "torch" and g.tactic.backend == "torch"
        if not tactic.is_default:
            assert g.tactic == tactic
        assert_close(g.run(a, b, bias=bias, scale_a=scale_a, scale_b=scale_b), ref, out_dtype, "Gemm " + label)


def test_fp8_scales_actually_scale() -> None:
    """Scales are read on every call (the one-shot plan cache must not freeze them)."""
    gen = torch.Generator().manual_seed(350)
    a = make_a(gen, 8, 32, E4M3, "k")
    b = make_b(gen, 32, 16, E4M3, "k")
    for tactic in ("scaled_mm", "dequant"):
        t = tactix.Tactic(backend="torch", kernel=tactic)
        for sa, sb in ((1.0, 1.0), (0.25, 3.0), (4.0, 0.125)):
            scale_a, scale_b = torch.tensor([sa]), torch.tensor([sb])
            out = tactix.gemm(a, b, scale_a=scale_a, scale_b=scale_b, backend="torch", tactic=t)
            ref = gemm_reference(a, b, scale_a=scale_a, scale_b=scale_b)
            assert_close(out, ref, BF16, f"{tactic} scales {sa}, {sb}")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=_short)
def test_dense_lists_matmul_only(dtype: torch.dtype) -> None:
    g = tactix.Gemm(backend="torch", device="cpu")
    g.plan(4, 8, 16, a_dtype=dtype)
    kernels = [t.kernel for t in tactix.get_registry().get("torch").tactics(g.problem)]
    assert "matmul" in kernels
    assert "scaled_mm" not in kernels and "dequant" not in kernels
    assert g.backend == "torch" and g.tactic.kernel == "matmul"


# ----------------------------------------------------------------------------------------------
# Gemm: plan once, run many; out=


@pytest.mark.parametrize(
    ("dtype", "la", "lb", "batch", "with_bias"),
    [
        (BF16, "k", "k", None, True),
        (F32, "m", "n", None, False),
        (F16, "k", "n", 2, True),
        (E4M3, "k", "k", None, True),
        (E4M3, "m", "n", None, False),
    ],
    ids=["bf16-bias", "f32-Am-Bn", "f16-batched-bias", "fp8-kk-bias", "fp8-Am-Bn"],
)
def test_gemm_plan_reuse_with_new_data(
    dtype: torch.dtype, la: str, lb: str, batch: int | None, with_bias: bool
) -> None:
    m, n, k = 6, 32, 48
    fp8 = dtype == E4M3
    out_dtype = BF16 if fp8 else dtype
    g = tactix.Gemm(backend="torch", device="cpu")
    g.plan(
        m,
        n,
        k,
        batch=batch,
        a_dtype=dtype,
        a_k_major=la == "k",
        b_k_major=lb == "k",
        bias_dtype=out_dtype if with_bias else None,
    )
    assert g.backend == "torch" and g.tactic.backend == "torch"
    for i in range(3):
        seed = 400 + i
        gen = torch.Generator().manual_seed(seed)
        a = make_a(gen, m, k, dtype, la, batch=batch)
        b = make_b(gen, k, n, dtype, lb, batch=batch)
        bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
        scales = {}
        if fp8:
            scales = {
                "scale_a": torch.rand(1, generator=gen) + 0.5,
                "scale_b": torch.rand(1, generator=gen) + 0.5,
            }
        out = g.run(a, b, bias=bias, **scales)
        assert_close(out, gemm_reference(a, b, bias=bias, **scales), out_dtype, f"run {i} seed {seed}")


@pytest.mark.parametrize(
    ("dtype", "tactic", "batch", "with_bias"),
    [
        (BF16, None, None, True),
        (F32, None, 3, False),
        (E4M3, "scaled_mm", None, True),
        (E4M3, "dequant", None, False),
        (E4M3, "dequant", 2, True),
    ],
    ids=["bf16-bias", "f32-batched", "fp8-scaled_mm-bias", "fp8-dequant", "fp8-dequant-batched-bias"],
)
def test_out_buffer_fully_written(dtype: torch.dtype, tactic: str | None, batch: int | None, with_bias: bool) -> None:
    m, n, k = 9, 32, 16
    gen = torch.Generator().manual_seed(500)
    fp8 = dtype == E4M3
    out_dtype = BF16 if fp8 else dtype
    a = make_a(gen, m, k, dtype, "k", batch=batch)
    b = make_b(gen, k, n, dtype, "k", batch=batch)
    bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
    scales = {"scale_a": torch.tensor([0.5]), "scale_b": torch.tensor([1.5])} if fp8 else {}
    ref = gemm_reference(a, b, bias=bias, **scales)
    t = None if tactic is None else tactix.Tactic(backend="torch", kernel=tactic)
    lead = () if batch is None else (batch,)

    out = torch.full((*lead, m, n), float("nan"), dtype=out_dtype)
    got = tactix.gemm(a, b, bias=bias, out=out, backend="torch", tactic=t, **scales)
    assert got is out
    assert not bool(torch.isnan(out).any()), "gemm(out=) left NaN in out"
    assert_close(out, ref, out_dtype, "gemm(out=)")

    g = tactix.Gemm(backend="torch", device="cpu")
    g.plan(m, n, k, batch=batch, a_dtype=dtype, bias_dtype=out_dtype if with_bias else None, tactic=t)
    out2 = torch.full((*lead, m, n), float("nan"), dtype=out_dtype)
    got2 = g.run(a, b, bias=bias, out=out2, **scales)
    assert got2 is out2
    assert not bool(torch.isnan(out2).any()), "Gemm.run(out=) left NaN in out"
    assert_close(out2, ref, out_dtype, "Gemm.run(out=)")


def test_one_shot_plan_cache_keeps_layouts_apart() -> None:
    """The same sizes in another layout must not reuse a plan made for the first layout."""
    gen = torch.Generator().manual_seed(600)
    m, n, k = 8, 24, 40
    for la, lb in (("k", "k"), ("m", "k"), ("k", "n"), ("m", "n"), ("k", "k")):
        a = make_a(gen, m, k, F32, la)
        b = make_b(gen, k, n, F32, lb)
        assert_close(tactix.gemm(a, b, backend="torch"), gemm_reference(a, b), F32, f"A{la} B{lb}")
