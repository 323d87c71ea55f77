"""The built-in torch backend's paged prefill and decode, through the public API, against the oracle.

Every case builds a random paged KV cache whose pages are handed out in a shuffled order (the
pages of different requests interleave, and unused pages sit between them), runs
`tactix.PagedPrefill` / `tactix.PagedDecode` with ``backend="torch"`` on the CPU, and compares
the result with the float64 oracle `tactix.testing.attention_reference` under the tolerances of
`tactix.testing.oracle`. Memory the batch does not own (unused pages, the tail of each request's
last page) holds values ten times larger than the real keys and values, so reading it shows up
as a large error.

Each case carries its RNG seed in its test id and in every assertion message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

import tactix
from tactix.testing import (
    LSE_TOLERANCE,
    attention_reference,
    lse_error,
    relative_error,
    tolerance_for,
)

CPU = torch.device("cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GARBAGE_SCALE = 10.0  # memory outside the batch's keys holds values this much larger


# ----------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    name: str
    kv_lens: tuple[int, ...]
    qo_lens: tuple[int, ...] | None = None  # None: decode (one query row per request)
    hq: int = 4
    hkv: int = 4
    dqk: int = 64
    dvo: int | None = None
    page: int = 16
    layout: str = "NHD"
    form: str = "tuple"  # "tuple": (k, v); "5d": one [pages, 2, ...] tensor
    causal: bool = False
    window: int = -1
    cap: float = 0.0
    lse: bool = False
    dtype: torch.dtype = F32
    out_dtype: torch.dtype | None = None
    sm_scale: float | None = None
    q_scale: float = 1.0  # larger queries make the soft-cap bite
    index_dtype: torch.dtype = torch.int32
    pad_indices: bool = False  # paged_kv_indices longer than paged_kv_indptr[-1], junk at the end
    seed: int = 0

    @property
    def decode(self) -> bool:
        return self.qo_lens is None

    @property
    def head_dim_vo(self) -> int:
        return self.dqk if self.dvo is None else self.dvo

    @property
    def o_dtype(self) -> torch.dtype:
        return self.dtype if self.out_dtype is None else self.out_dtype

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.dqk) if self.sm_scale is None else self.sm_scale

    @property
    def id(self) -> str:
        return f"{self.name}-seed{self.seed}"


def P(name: str, qo: tuple[int, ...], kv: tuple[int, ...], **kw: object) -> Case:
    return Case(name=name, qo_lens=qo, kv_lens=kv, **kw)  # type: ignore[arg-type]


def D(name: str, kv: tuple[int, ...], **kw: object) -> Case:
    return Case(name=name, kv_lens=kv, **kw)  # type: ignore[arg-type]


def _seeded(cases: list[Case], base: int) -> list[Case]:
    return [replace(c, seed=base + i) for i, c in enumerate(cases)]


PREFILL_CASES = _seeded(
    [
        # float32, plain: q length 1, a kv length that is an exact multiple of the page size
        P("basic", qo=(5, 17, 1), kv=(5, 40, 16)),
        P("causal_5d", qo=(7, 16, 1), kv=(7, 16, 33), causal=True, form="5d"),
        P("gqa4_hnd_d128_chunked", qo=(10, 3), kv=(64, 50), hq=8, hkv=2, dqk=128, layout="HND", causal=True),
        P(
            "gqa8_p64_5d_chunked",
            qo=(20, 1, 33),
            kv=(100, 64, 33),
            hq=8,
            hkv=1,
            page=64,
            causal=True,
            form="5d",
        ),
        P("hnd_p1_causal_chunked", qo=(4, 1, 6), kv=(9, 1, 6), page=1, layout="HND", causal=True),
        P("hnd_p1_5d_gqa4", qo=(3, 5), kv=(1, 7), hq=8, hkv=2, page=1, layout="HND", form="5d"),
        P("nhd_p1_window_causal", qo=(5, 2), kv=(12, 2), hkv=2, page=1, causal=True, window=3),
        P("window_causal_chunked", qo=(12, 30), kv=(70, 30), hq=8, hkv=2, causal=True, window=8),
        P(
            "window0_causal_chunked_hnd_5d",
            qo=(6, 1),
            kv=(20, 5),
            dqk=128,
            layout="HND",
            form="5d",
            causal=True,
            window=0,
        ),
        P("window_noncausal_hnd", qo=(9, 4), kv=(32, 17), layout="HND", window=5),
        P("softcap", qo=(6, 11), kv=(30, 11), cap=1.0, q_scale=3.0),
        P(
            "softcap_lse_causal_hnd_gqa4",
            qo=(8, 2),
            kv=(24, 40),
            hq=8,
            hkv=2,
            dqk=128,
            layout="HND",
            causal=True,
            cap=2.0,
            lse=True,
            q_scale=3.0,
        ),
        P("lse_5d_gqa8_kv1_q1", qo=(1, 16), kv=(1, 48), hq=8, hkv=1, form="5d", lse=True),
        P(
            "lse_window_causal_chunked_hnd",
            qo=(7, 9),
            kv=(40, 9),
            layout="HND",
            causal=True,
            window=6,
            lse=True,
        ),
        P("lse_softcap_window_b1", qo=(5,), kv=(37,), cap=5.0, window=10, lse=True, q_scale=3.0),
        P("d256_causal", qo=(8, 3), kv=(8, 40), dqk=256, causal=True),
        P(
            "d256_hnd_p64_gqa8_lse_b1",
            qo=(4,),
            kv=(130,),
            dqk=256,
            hq=8,
            hkv=1,
            page=64,
            layout="HND",
            lse=True,
        ),
        P("b1_q1_kv1_causal", qo=(1,), kv=(1,), causal=True),
        P("b1_square_exact_pages_5d", qo=(64,), kv=(64,), causal=True, form="5d"),
        P("noncausal_q_longer_than_kv_hnd", qo=(10, 2), kv=(3, 2), layout="HND"),
        P("vo32_gqa4_causal_chunked", qo=(6, 3), kv=(20, 3), hq=8, hkv=2, dqk=64, dvo=32, causal=True),
        P(
            "vo64_hnd_window_softcap_lse",
            qo=(5, 8),
            kv=(29, 8),
            dqk=128,
            dvo=64,
            layout="HND",
            causal=True,
            window=7,
            cap=2.0,
            lse=True,
            q_scale=3.0,
        ),
        P("vo32_p1_hnd", qo=(3,), kv=(5,), dqk=64, dvo=32, page=1, layout="HND"),
        P("sm_scale", qo=(4, 6), kv=(10, 6), sm_scale=0.3, causal=True),
        P(
            "int64_meta_padded_indices",
            qo=(3, 5),
            kv=(19, 5),
            index_dtype=torch.int64,
            pad_indices=True,
            causal=True,
        ),
        P(
            "many_requests_hnd_gqa4",
            qo=(1, 8, 3, 16, 2, 5),
            kv=(17, 8, 40, 16, 2, 64),
            hq=8,
            hkv=2,
            layout="HND",
            causal=True,
        ),
        P(
            "bf16_gqa4_5d_chunked",
            qo=(9, 4),
            kv=(50, 4),
            dtype=BF16,
            hq=8,
            hkv=2,
            dqk=128,
            form="5d",
            causal=True,
        ),
        P(
            "bf16_hnd_window_lse",
            qo=(6, 2),
            kv=(33, 2),
            dtype=BF16,
            layout="HND",
            window=4,
            lse=True,
            causal=True,
        ),
        P("bf16_in_f32_out", qo=(4, 7), kv=(20, 7), dtype=BF16, out_dtype=F32, causal=True),
        P("fp16_gqa8_p64_hnd", qo=(5, 3), kv=(70, 64), dtype=F16, hq=8, hkv=1, page=64, layout="HND"),
        P(
            "fp16_softcap_lse_5d",
            qo=(4, 1),
            kv=(18, 1),
            dtype=F16,
            form="5d",
            causal=True,
            cap=3.0,
            lse=True,
            q_scale=3.0,
        ),
        P("bf16_d256", qo=(3,), kv=(40,), dtype=BF16, dqk=256, causal=True),
    ],
    base=1000,
)

DECODE_CASES = _seeded(
    [
        D("basic_kv1_exact", kv=(1, 16, 37)),
        D("gqa4_hnd_5d_d128", kv=(64, 5, 17), hq=8, hkv=2, dqk=128, layout="HND", form="5d"),
        D("gqa8_p64_5d", kv=(200, 64, 1), hq=8, hkv=1, page=64, form="5d"),
        D("p1_hnd", kv=(1, 7, 3), page=1, layout="HND"),
        D("p1_nhd_5d_gqa4_b1", kv=(12,), hq=8, hkv=2, page=1, form="5d"),
        D("window", kv=(30, 3, 16), window=4),
        D("window0_hnd_5d_lse", kv=(20, 9), window=0, layout="HND", form="5d", lse=True),
        D("softcap", kv=(25, 6), cap=1.0, q_scale=3.0),
        D("softcap_lse_gqa4_hnd", kv=(33, 48), hq=8, hkv=2, layout="HND", cap=2.0, lse=True, q_scale=3.0),
        D("d256_hnd", kv=(40, 16), dqk=256, layout="HND"),
        D("d256_p64_lse_b1", kv=(65,), dqk=256, page=64, lse=True),
        D("vo32_gqa4", kv=(10, 21), dqk=64, dvo=32, hq=8, hkv=2),
        D(
            "vo64_hnd_window_softcap_lse",
            kv=(31, 4),
            dqk=128,
            dvo=64,
            layout="HND",
            window=9,
            cap=2.0,
            lse=True,
            q_scale=3.0,
        ),
        D("b1_kv1", kv=(1,)),
        D("many_requests_hnd_gqa4", kv=(3, 1, 64, 17, 32, 100, 5, 48), hq=8, hkv=2, layout="HND"),
        D(
            "sm_scale_int64_padded_indices",
            kv=(9, 14),
            sm_scale=0.2,
            index_dtype=torch.int64,
            pad_indices=True,
        ),
        D("bf16_gqa4_hnd_5d", kv=(40, 7), dtype=BF16, hq=8, hkv=2, dqk=128, layout="HND", form="5d"),
        D("bf16_lse_window", kv=(26, 3), dtype=BF16, window=5, lse=True),
        D("fp16_gqa8_p64_softcap", kv=(19, 64), dtype=F16, hq=8, hkv=1, page=64, cap=3.0, q_scale=3.0),
        D("bf16_in_f32_out_p1", kv=(5, 2), dtype=BF16, out_dtype=F32, page=1),
    ],
    base=2000,
)


# ----------------------------------------------------------------------------------------------
# Building a random paged batch


@dataclass
class Batch:
    case: Case
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor  # [pages, ...] views (of the 5-D tensor when form == "5d")
    v: torch.Tensor
    cache: tuple[torch.Tensor, torch.Tensor] | torch.Tensor  # what run() is given
    used_pages: list[int]


def make_batch(case: Case, seed: int | None = None, extra_pages: int | None = None) -> Batch:
    """A random batch for ``case``: shuffled, interleaved page assignment and unused pages."""
    gen = torch.Generator().manual_seed(case.seed if seed is None else seed)
    page = case.page
    counts = [-(-n // page) for n in case.kv_lens]
    needed = sum(counts)
    if extra_pages is None:
        extra_pages = 2 + int(torch.randint(0, 4, (1,), generator=gen))
    total = needed + extra_pages
    perm = torch.randperm(total, generator=gen)
    indices = perm[:needed]
    indptr = [0]
    for c in counts:
        indptr.append(indptr[-1] + c)
    last = [n - (c - 1) * page for n, c in zip(case.kv_lens, counts, strict=True)]
    qo_lens = case.qo_lens if case.qo_lens is not None else (1,) * len(case.kv_lens)
    qo_indptr = [0]
    for n in qo_lens:
        qo_indptr.append(qo_indptr[-1] + n)
    if case.pad_indices:  # entries past paged_kv_indptr[-1] are not part of the batch
        indices = torch.cat([indices, torch.tensor([total + 100, -7, 10**6])])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    hkv, dqk, dvo = case.hkv, case.dqk, case.head_dim_vo
    if case.layout == "NHD":
        kshape, vshape = (total, page, hkv, dqk), (total, page, hkv, dvo)
    else:
        kshape, vshape = (total, hkv, page, dqk), (total, hkv, page, dvo)
    # garbage everywhere first; the batch's own tokens are then overwritten with unit-scale data
    if case.form == "5d":
        assert dqk == dvo
        full = randn(total, 2, *kshape[1:]) * GARBAGE_SCALE
        k, v = full[:, 0], full[:, 1]
    else:
        k, v = randn(*kshape) * GARBAGE_SCALE, randn(*vshape) * GARBAGE_SCALE
    for r, n in enumerate(case.kv_lens):
        pages = perm[indptr[r] : indptr[r + 1]].tolist()
        for i, p in enumerate(pages):
            valid = page if i < len(pages) - 1 else n - i * page
            if case.layout == "NHD":
                k[p, :valid] = randn(valid, hkv, dqk)
                v[p, :valid] = randn(valid, hkv, dvo)
            else:
                k[p, :, :valid] = randn(hkv, valid, dqk)
                v[p, :, :valid] = randn(hkv, valid, dvo)
    if case.form == "5d":
        full = full.to(case.dtype)
        k, v = full[:, 0], full[:, 1]
        cache: tuple[torch.Tensor, torch.Tensor] | torch.Tensor = full
    else:
        k, v = k.to(case.dtype), v.to(case.dtype)
        cache = (k, v)
    q = (randn(qo_indptr[-1], case.hq, dqk) * case.q_scale).to(case.dtype)
    it = case.index_dtype
    return Batch(
        case=case,
        qo_indptr=torch.tensor(qo_indptr, dtype=it),
        kv_indptr=torch.tensor(indptr, dtype=it),
        kv_indices=indices.to(it),
        last_page_len=torch.tensor(last, dtype=it),
        q=q,
        k=k,
        v=v,
        cache=cache,
        used_pages=sorted(perm[:needed].tolist()),
    )


def make_wrapper(case: Case) -> tactix.PagedPrefill | tactix.PagedDecode:
    cls = tactix.PagedDecode if case.decode else tactix.PagedPrefill
    return cls(kv_layout=case.layout, backend="torch", device="cpu")  # type: ignore[arg-type]


def plan(wrapper: tactix.PagedPrefill | tactix.PagedDecode, b: Batch, **overrides: object) -> None:
    c = b.case
    kwargs: dict[str, object] = dict(
        head_dim_vo=c.dvo,
        sm_scale=c.sm_scale,
        window_left=c.window,
        logits_soft_cap=c.cap if c.cap > 0 else None,
        q_data_type=c.dtype,
        o_data_type=c.out_dtype,
        return_lse=c.lse,
    )
    kwargs.update(overrides)
    args = (b.kv_indptr, b.kv_indices, b.last_page_len, c.hq, c.hkv, c.dqk, c.page)
    if c.decode:
        assert isinstance(wrapper, tactix.PagedDecode)
        wrapper.plan(*args, **kwargs)  # type: ignore[arg-type]
    else:
        assert isinstance(wrapper, tactix.PagedPrefill)
        wrapper.plan(b.qo_indptr, *args, causal=c.causal, **kwargs)  # type: ignore[arg-type]


def reference(b: Batch, **overrides: object) -> tuple[torch.Tensor, torch.Tensor]:
    c = b.case
    kwargs: dict[str, object] = dict(
        kv_layout=c.layout,
        causal=c.causal,
        sm_scale=c.scale,
        window_left=c.window,
        logits_soft_cap=c.cap,
    )
    kwargs.update(overrides)
    return attention_reference(
        b.q,
        b.k,
        b.v,
        b.qo_indptr,
        b.kv_indptr,
        b.kv_indices,
        b.last_page_len,
        **kwargs,  # type: ignore[arg-type]
    )


def check(b: Batch, out: torch.Tensor, lse: torch.Tensor | None = None, what: str = "") -> None:
    """``out`` (and ``lse``) against the oracle, with the case and seed in the message."""
    c = b.case
    label = f"{c.id}{' ' + what if what else ''}"
    rows = b.q.shape[0]
    assert out.shape == (rows, c.hq, c.head_dim_vo), f"{label}: out shape {tuple(out.shape)}"
    assert out.dtype == c.o_dtype, f"{label}: out dtype {out.dtype}"
    ref_out, ref_lse = reference(b)
    tol = tolerance_for(c.o_dtype)
    err = relative_error(out, ref_out)
    assert err <= tol, f"{label}: relative error {err:.3g} > {tol} (seed {c.seed})"
    if lse is not None:
        assert lse.shape == (rows, c.hq) and lse.dtype == torch.float32, f"{label}: lse {lse.dtype} {tuple(lse.shape)}"
        ltol = LSE_TOLERANCE[str(c.dtype).removeprefix("torch.")]
        lerr = lse_error(lse, ref_lse)
        assert lerr <= ltol, f"{label}: LSE error {lerr:.3g} > {ltol} (seed {c.seed})"


def run_case(case: Case) -> None:
    b = make_batch(case)
    wrapper = make_wrapper(case)
    plan(wrapper, b)
    result = wrapper.run(b.q, b.cache)
    if case.lse:
        assert isinstance(result, tuple) and len(result) == 2, f"{case.id}: expected (out, lse)"
        out, lse = result
        check(b, out, lse)
    else:
        assert isinstance(result, torch.Tensor), f"{case.id}: expected a tensor, got {type(result)}"
        check(b, result)


def assert_discriminative(case: Case) -> None:
    """The case's window and soft-cap really change the answer (so ignoring them would fail)."""
    b = make_batch(case)
    ref, _ = reference(b)
    tol = tolerance_for(case.o_dtype)
    if case.cap > 0:
        plain, _ = reference(b, logits_soft_cap=0.0)
        assert relative_error(plain, ref) > 10 * tol, f"{case.id}: soft-cap {case.cap} changes nothing"
    if case.window >= 0:
        plain, _ = reference(b, window_left=-1)
        assert relative_error(plain, ref) > 10 * tol, f"{case.id}: window {case.window} changes nothing"
    if not case.decode and case.causal and max(case.qo_lens or (1,)) > 1:
        plain, _ = reference(b, causal=False)
        assert relative_error(plain, ref) > 10 * tol, f"{case.id}: causal mask changes nothing"


# ----------------------------------------------------------------------------------------------
# The case matrix


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c.id for c in PREFILL_CASES])
def test_prefill_matches_oracle(case: Case) -> None:
    assert_discriminative(case)
    run_case(case)


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
def test_decode_matches_oracle(case: Case) -> None:
    assert_discriminative(case)
    run_case(case)


def test_case_matrix_covers_every_feature() -> None:
    """Guards the matrix above against edits that drop a feature."""
    for cases in (PREFILL_CASES, DECODE_CASES):
        assert {c.hq // c.hkv for c in cases} >= {1, 4, 8}
        assert any(c.hkv == 1 and c.hq == 8 for c in cases)
        assert {c.dqk for c in cases} >= {64, 128, 256}
        assert {c.page for c in cases} >= {1, 16, 64}
        assert {c.layout for c in cases} == {"NHD", "HND"}
        assert any(c.layout == "HND" and c.page == 1 for c in cases)
        assert {c.form for c in cases} == {"tuple", "5d"}
        assert {c.dtype for c in cases} == {F32, BF16, F16}
        assert any(c.window == 0 for c in cases) and any(c.window > 0 for c in cases)
        assert any(c.cap > 0 and c.lse for c in cases)
        assert any(c.dvo is not None and c.dvo != c.dqk for c in cases)
        assert any(1 in c.kv_lens for c in cases)
        assert any(any(n % c.page == 0 and n > c.page for n in c.kv_lens) for c in cases)
        assert any(len(c.kv_lens) == 1 for c in cases)
    assert {c.causal for c in PREFILL_CASES} == {True, False}
    assert any(
        c.causal and c.window >= 0 and any(kv > q for q, kv in zip(c.qo_lens or (), c.kv_lens, strict=True))
        for c in PREFILL_CASES
    )
    assert any(1 in (c.qo_lens or ()) for c in PREFILL_CASES)


# ----------------------------------------------------------------------------------------------
# Every tactic the backend lists


TACTIC_CASES = _seeded(
    [
        # uniform lengths: every listed tactic (SDPA flash included) must serve these
        P("uniform_bf16_causal_square_gqa4", qo=(16, 16), kv=(16, 16), dtype=BF16, hq=8, hkv=2, causal=True),
        P(
            "uniform_bf16_noncausal_chunked_hnd_5d",
            qo=(5, 5),
            kv=(37, 37),
            dtype=BF16,
            layout="HND",
            form="5d",
        ),
        P("uniform_fp16_noncausal_p1", qo=(3, 3, 3), kv=(9, 9, 9), dtype=F16, page=1, hq=8, hkv=1),
        P("uniform_f32_causal_chunked", qo=(6, 6), kv=(20, 20), causal=True),
        P("uniform_f32_vo32", qo=(4,), kv=(9,), dvo=32),
        D("uniform_bf16_decode_gqa4", kv=(33, 33, 33), dtype=BF16, hq=8, hkv=2),
        # ragged lengths / window: a mask is needed; the maskless SDPA kinds may refuse at plan
        P("ragged_f32_window_causal_chunked", qo=(3, 7), kv=(19, 7), hq=8, hkv=2, causal=True, window=4),
        P("ragged_bf16_hnd", qo=(2, 9), kv=(40, 9), dtype=BF16, layout="HND", causal=True),
        D("ragged_f32_decode_hnd_5d", kv=(5, 40), layout="HND", form="5d"),
        D("ragged_bf16_decode_window", kv=(5, 40), dtype=BF16, window=3),
    ],
    base=3000,
)

_MASKLESS = ("flash", "cudnn")


@pytest.mark.parametrize("case", TACTIC_CASES, ids=[c.id for c in TACTIC_CASES])
def test_every_listed_tactic(case: Case) -> None:
    b = make_batch(case)
    probe = make_wrapper(case)
    plan(probe, b)
    listed = tactix.get_registry().get("torch").tactics(probe.problem)
    kinds = {(t.kernel, t.params.get("impl")) for t in listed}
    assert all(t.backend == "torch" for t in listed)
    assert ("explicit", None) in kinds and ("sdpa", "math") in kinds, f"{case.id}: listed {listed}"
    if case.dtype in (BF16, F16) and case.window < 0 and case.head_dim_vo == case.dqk:
        assert ("sdpa", "flash") in kinds, f"{case.id}: listed {listed}"
    uniform = len(set(case.kv_lens)) == 1 and len(set(case.qo_lens or (1,))) == 1 and case.window < 0
    ran = []
    for tactic in listed:
        wrapper = make_wrapper(case)
        if not uniform and tactic.kernel == "sdpa" and tactic.params.get("impl") in _MASKLESS:
            # listed for the problem, but this batch needs a mask: refused at plan, not run wrongly
            with pytest.raises(tactix.UnsupportedProblemError):
                plan(wrapper, b, tactic=tactic)
            continue
        plan(wrapper, b, tactic=tactic)
        assert wrapper.backend == "torch"
        assert wrapper.selection_source == "explicit"
        if not tactic.is_default:
            assert wrapper.tactic == tactic, f"{case.id}: asked for {tactic}, got {wrapper.tactic}"
        out = wrapper.run(b.q, b.cache)
        assert isinstance(out, torch.Tensor)
        check(b, out, what=f"tactic {tactic}")
        ran.append(tactic)
    assert len(ran) >= 3, f"{case.id}: only {ran} ran"


# ----------------------------------------------------------------------------------------------
# Plan reuse, re-plan, preallocated outputs, what was chosen


REUSE_CASES = [
    P(
        "reuse_prefill",
        qo=(4, 9, 1),
        kv=(4, 30, 16),
        hq=8,
        hkv=2,
        layout="HND",
        causal=True,
        window=6,
        lse=True,
        seed=4001,
    ),
    D("reuse_decode", kv=(1, 30, 17), hq=4, hkv=1, form="5d", cap=2.0, q_scale=3.0, seed=4002),
]


@pytest.mark.parametrize("case", REUSE_CASES, ids=[c.id for c in REUSE_CASES])
def test_plan_once_run_with_fresh_data(case: Case) -> None:
    """One plan serves many runs (layers): each run reads only its own q and cache."""
    planned = make_batch(case)
    wrapper = make_wrapper(case)
    plan(wrapper, planned)
    top = int(planned.kv_indices[: int(planned.kv_indptr[-1])].max())
    for i in range(4):
        # same metadata; new q and cache values, in a cache with a different number of pages
        b = fresh_data(planned, num_pages=top + 1 + i, seed=case.seed * 100 + i)
        result = wrapper.run(b.q, b.cache)
        out, lse = result if case.lse else (result, None)
        check(b, out, lse, what=f"run {i}")


def fresh_data(planned: Batch, num_pages: int, seed: int) -> Batch:
    """``planned``'s metadata with new random q and cache values (garbage outside used pages)."""
    case = planned.case
    gen = torch.Generator().manual_seed(seed)
    used = torch.zeros(num_pages, dtype=torch.bool)
    used[planned.kv_indices[: int(planned.kv_indptr[-1])].long()] = True
    scale = torch.where(used, 1.0, GARBAGE_SCALE)

    def pages(tail: torch.Size) -> torch.Tensor:
        t = torch.randn(num_pages, *tail, generator=gen)
        return t * scale.view(-1, *([1] * len(tail)))

    if case.form == "5d":
        full = pages(torch.Size((2, *planned.k.shape[1:]))).to(case.dtype)
        k, v = full[:, 0], full[:, 1]
        cache: tuple[torch.Tensor, torch.Tensor] | torch.Tensor = full
    else:
        k = pages(planned.k.shape[1:]).to(case.dtype)
        v = pages(planned.v.shape[1:]).to(case.dtype)
        cache = (k, v)
    q = (torch.randn(*planned.q.shape, generator=gen) * case.q_scale).to(case.dtype)
    return replace(planned, q=q, k=k, v=v, cache=cache)


def test_replan_same_wrapper_with_new_batch() -> None:
    """A wrapper re-planned for another batch (size, lengths, features) serves the new batch."""
    batches = [
        P("replan_a", qo=(5, 2, 8), kv=(20, 2, 40), hq=8, hkv=2, causal=True, seed=4101),
        P("replan_b", qo=(1,), kv=(70,), hq=8, hkv=2, causal=True, seed=4102),
        P(
            "replan_c",
            qo=(3, 3, 3, 3, 7),
            kv=(3, 17, 33, 1 + 3, 64),
            hq=8,
            hkv=2,
            window=5,
            lse=True,
            seed=4103,
        ),
        P("replan_a_again", qo=(5, 2, 8), kv=(20, 2, 40), hq=8, hkv=2, causal=True, seed=4104),
    ]
    wrapper = tactix.PagedPrefill(kv_layout="NHD", backend="torch", device="cpu")
    for case in batches:
        b = make_batch(case)
        plan(wrapper, b)
        assert wrapper.problem.batch_size == len(case.kv_lens)
        result = wrapper.run(b.q, b.cache)
        out, lse = result if case.lse else (result, None)
        check(b, out, lse, what="after re-plan")


def test_replan_decode_with_new_batch() -> None:
    wrapper = tactix.PagedDecode(kv_layout="HND", backend="torch", device="cpu")
    for case in [
        D("replan_decode_a", kv=(9, 40, 1), layout="HND", seed=4201),
        D("replan_decode_b", kv=(100,) * 2 + (5,) * 5, layout="HND", seed=4202),
        D("replan_decode_c", kv=(3,), layout="HND", seed=4203),
    ]:
        b = make_batch(case)
        plan(wrapper, b)
        out = wrapper.run(b.q, b.cache)
        assert isinstance(out, torch.Tensor)
        check(b, out, what="after re-plan")


OUT_CASES = [
    P("out_lse_prefill", qo=(6, 1, 13), kv=(6, 17, 40), hq=8, hkv=2, causal=True, lse=True, seed=4301),
    P("out_prefill_bf16_hnd", qo=(3, 9), kv=(25, 9), dtype=BF16, layout="HND", form="5d", seed=4302),
    D("out_lse_decode", kv=(1, 30, 64), hq=8, hkv=1, layout="HND", lse=True, cap=2.0, seed=4303),
    D("out_decode_vo32", kv=(7, 12), dvo=32, seed=4304),
]


@pytest.mark.parametrize("case", OUT_CASES, ids=[c.id for c in OUT_CASES])
def test_preallocated_out_and_lse_are_fully_written(case: Case) -> None:
    b = make_batch(case)
    wrapper = make_wrapper(case)
    plan(wrapper, b)
    rows = b.q.shape[0]
    for i in range(2):  # twice: a plan must write the whole buffer every run
        out = torch.full((rows, case.hq, case.head_dim_vo), float("nan"), dtype=case.o_dtype)
        if case.lse:
            lse = torch.full((rows, case.hq), float("nan"), dtype=torch.float32)
            result = wrapper.run(b.q, b.cache, out=out, lse=lse)
            assert isinstance(result, tuple)
            assert result[0] is out and result[1] is lse
            assert not bool(torch.isnan(lse).any()), f"{case.id}: NaN left in lse (run {i})"
        else:
            result = wrapper.run(b.q, b.cache, out=out)
            assert result is out
        assert not bool(torch.isnan(out).any()), f"{case.id}: NaN left in out (run {i})"
        check(b, out, lse if case.lse else None, what=f"out= run {i}")


def test_lse_buffer_alone_implies_return_lse() -> None:
    case = P("lse_buffer_only", qo=(4, 2), kv=(10, 2), causal=True, lse=True, seed=4401)
    b = make_batch(case)
    wrapper = make_wrapper(case)
    plan(wrapper, b)
    lse = torch.full((6, case.hq), float("nan"))
    result = wrapper.run(b.q, b.cache, lse=lse)
    assert isinstance(result, tuple) and result[1] is lse
    check(b, result[0], lse)
    # planned with the LSE but not asked for it: the output alone
    out = wrapper.run(b.q, b.cache, return_lse=False)
    assert isinstance(out, torch.Tensor)
    check(b, out)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_backend_and_tactic_after_plan(op: str, backend: str) -> None:
    case = (
        P("chosen_prefill", qo=(3, 4), kv=(9, 4), causal=True, seed=4501)
        if op == "prefill"
        else D("chosen_decode", kv=(9, 4), seed=4502)
    )
    b = make_batch(case)
    cls = tactix.PagedDecode if case.decode else tactix.PagedPrefill
    wrapper = cls(kv_layout="NHD", backend=backend, device="cpu")
    if backend == "auto":
        # only the built-in backend is installed here, so auto must land on it
        plan(wrapper, b, backend="torch")
    else:
        plan(wrapper, b)
    assert wrapper.backend == "torch"
    assert wrapper.tactic.backend == "torch"
    assert not wrapper.tactic.is_default, "the plan's tactic must be concrete"
    assert wrapper.tactic in tactix.get_registry().get("torch").tactics(wrapper.problem)
    out = wrapper.run(b.q, b.cache)
    assert isinstance(out, torch.Tensor)
    check(b, out)


def test_same_plan_serves_tuple_and_5d_cache() -> None:
    case = P("forms", qo=(5, 3), kv=(21, 3), hq=8, hkv=2, layout="HND", form="5d", causal=True, seed=4601)
    b = make_batch(case)
    wrapper = make_wrapper(case)
    plan(wrapper, b)
    from_5d = wrapper.run(b.q, b.cache)
    from_tuple = wrapper.run(b.q, (b.k.contiguous(), b.v.contiguous()))
    from_views = wrapper.run(b.q, (b.k, b.v))
    for name, out in (("5d", from_5d), ("tuple", from_tuple), ("views", from_views)):
        assert isinstance(out, torch.Tensor)
        check(b, out, what=name)


@pytest.mark.parametrize("kernel", ["explicit", "sdpa-math"])
def test_nan_outside_the_batch_does_not_leak(kernel: str) -> None:
    """Only the batch's own tokens may influence the result, whatever the rest of the cache holds."""
    case = P("nan_outside", qo=(3, 2), kv=(6, 2), page=4, seed=4701)
    b = make_batch(case)
    # NaN in every unused page and in the unused tail of every request's last page
    used = set(b.used_pages)
    for p in range(b.k.shape[0]):
        if p not in used:
            b.k[p] = float("nan")
            b.v[p] = float("nan")
    for r in range(len(case.kv_lens)):
        last_page = int(b.kv_indices[int(b.kv_indptr[r + 1]) - 1])
        valid = int(b.last_page_len[r])
        b.k[last_page, valid:] = float("nan")  # NHD: [page, slot, head, dim]
        b.v[last_page, valid:] = float("nan")
    tactic = (
        tactix.Tactic(backend="torch", kernel="explicit")
        if kernel == "explicit"
        else tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})
    )
    wrapper = make_wrapper(case)
    plan(wrapper, b, tactic=tactic)
    out = wrapper.run(b.q, b.cache)
    assert isinstance(out, torch.Tensor)
    assert not bool(torch.isnan(out).any()), (
        f"NaN rows: {torch.isnan(out).any(-1).any(-1).nonzero().flatten().tolist()}"
    )
    check(b, out)
