"""The cuda_native kernel sources run on a CPU emulation of the CUDA features they use
(tests/emulator/tx_emulate.h, built with g++): prefill and the Hopper skinny GEMM against the
float64 oracle on a machine without a GPU.

The emulation is checked first on the decode kernel, which is proven on the H200 (it passes
there against the same oracle): the same fragment layouts (ldmatrix with and without .trans,
mma.sync m16n8k16), cp.async groups and shuffles serve both kernels. The decode runs are launched
as the plugin's plan launches them (`emulate.DecodePlan`), and split requests are merged inside
the kernel by the CTA that draws the last ticket: they run under several CTA schedules (one at a
time, overlapping, held back after their tickets), which must all give the same bits. The
prefill runs use the plan's own host data (`prefill.prefill_work`, `prefill.prefill_lists`,
`prefill.prefill_scalars`). cp.async copies land when their thread waits for them (the latest
legal moment) or, with TXE_EAGER_COPIES=1, at once (the earliest); shared memory starts as NaN
for every CTA, and so does the decode workspace before each launch.
What this cannot show: speed, and the real memory model: global memory is sequentially
consistent here; the fences a ticket needs are checked by rule (tx_emulate.h), not by effect.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from typing import Any

import pytest
import torch

pytest.importorskip("tactix_cuda_native", reason="plugins/cuda_native is not installed (scripts/setup.sh installs it)")

from tactix_cuda_native import gemm, plugin, prefill
from tactix_cuda_native.device import H200

import tactix
from tactix import Tactic
from tactix.attention import attention_problem
from tactix.ragged import ragged_problem
from tactix.testing import (
    LSE_TOLERANCE,
    attention_reference,
    gemm_reference,
    lse_error,
    merge_reference,
    ragged_reference,
    relative_error,
    tolerance_for,
)
from tactix.testing.cases import MergeCase, build_merge_inputs
from tactix.testing.cases import _mask as mask_of
from tactix.testing.cases import _packbits as packbits
from tactix.testing.oracle import attention_lse_tolerance, attention_tolerance
from tests.emulator import emulate

if emulate.available() is not None:
    pytest.skip(f"no CPU emulation here: {emulate.available()}", allow_module_level=True)

CPU = torch.device("cpu")


Tensors = tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _cache(lens: list[int], page: int, hkv: int, d: int, layout: str, dtype: torch.dtype, gen: torch.Generator,
           five_d: bool) -> Tensors:  # fmt: skip
    pages = [-(-n // page) for n in lens]
    total = sum(pages) + 3
    order = torch.randperm(total, generator=gen).tolist()
    indptr, indices = [0], []
    for count in pages:
        indices += [order.pop() for _ in range(count)]
        indptr.append(len(indices))

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    shape = (total, page, hkv, d) if layout == "NHD" else (total, hkv, page, d)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    if five_d:  # one [pages, 2, ...] tensor: k and v are strided views of it
        both = torch.stack([k, v], dim=1)
        k, v = both[:, 0], both[:, 1]
    return (k, v), k, v, i32(indptr), i32(indices), i32([(n - 1) % page + 1 for n in lens])


def prefill_case(q_lens: list[int], kv_lens: list[int], *, page: int = 16, hq: int = 4, hkv: int = 2, d: int = 64,
                 layout: str = "HND", dtype: torch.dtype = torch.bfloat16, causal: bool = True, window: int = -1,
                 cap: float = 0.0, scale: float | None = None, tactic: dict[str, Any] | None = None, seed: int = 0,
                 five_d: bool = False, q_view: bool = False, schedule: emulate.Schedule | None = None,
                 persistent: int = 0, capacity: int = 0, mask: str = "", packed: bool = False,
                 sinks: bool = False, head_section: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run one batch through the emulated prefill kernel (its CTAs as ``schedule`` says: one at a
    time by default; with a ``persist`` tactic ``persistent`` CTAs, see `emulate.run_prefill`, as
    ``capacity``) and hold it to the oracle's tolerances; (out, lse). ``mask``: a custom mask of
    the kit's kinds ("tree", "random": with a row that attends nothing) per request, given
    bit-packed where ``packed``. ``sinks``: attention sinks, one logit per query head (some far
    above every logit: most of a row's weight goes to its sink). ``head_section``: head groups per
    section of the grid (`emulate.run_prefill`)."""
    gen = torch.Generator().manual_seed(seed)
    _, k, v, indptr, indices, last = _cache(kv_lens, page, hkv, d, layout, dtype, gen, five_d)
    qo = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    rows = sum(q_lens)
    q = torch.randn(rows, hq, d, generator=gen).to(dtype)
    if q_view:  # the first columns of a fused QKV projection
        fused = torch.zeros(rows, (hq + 2 * hkv) * d, dtype=dtype)
        fused[:, : hq * d] = q.reshape(rows, hq * d)
        q = fused[:, : hq * d].view(rows, hq, d)
    parts = [mask_of(mask, ql, kl, gen) for ql, kl in zip(q_lens, kv_lens, strict=True)] if mask else []
    flat = torch.cat([m.reshape(-1) for m in parts]) if mask else None
    given: dict[str, torch.Tensor] = {}
    if flat is not None:
        given = {"packed_custom_mask": torch.cat([packbits(m.reshape(-1)) for m in parts])} if packed else {
            "custom_mask": flat}  # fmt: skip
    problem, batch = attention_problem(
        "prefill", device=CPU, kv_layout=layout, qo_indptr=qo, paged_kv_indptr=indptr,  # type: ignore[arg-type]
        paged_kv_indices=indices, paged_kv_last_page_len=last, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d,
        head_dim_vo=None, page_size=page, causal=causal, sm_scale=scale, window_left=window, logits_soft_cap=cap,
        q_data_type=dtype, kv_data_type=None, o_data_type=None, return_lse=True, **given,
    )  # fmt: skip
    problem = problem.model_copy(update={"device_type": "cuda"})
    t = Tactic.default("cuda_native") if tactic is None else Tactic(backend="cuda_native", kernel="prefill",
                                                                     params=tactic)  # type: ignore[arg-type]  # fmt: skip
    assert plugin._reasons(problem, t, H200) == []  # type: ignore[arg-type]
    sink_t = None
    if sinks:
        sink_t = (torch.randn(hq, generator=torch.Generator().manual_seed(seed + 1)) * 3).to(torch.float32)
        sink_t[::3] = 12.0
    out, lse, _ = emulate.run_prefill(problem, batch, t, q, k, v, return_lse=True,  # type: ignore[arg-type]
                                      schedule=schedule, persistent=persistent, capacity=capacity,
                                      sinks=sink_t, head_section=head_section)  # fmt: skip
    ref, ref_lse = attention_reference(q, k, v, qo, indptr, indices, last, kv_layout=layout, causal=causal,
                                       sm_scale=problem.sm_scale, window_left=window, logits_soft_cap=cap,
                                       custom_mask=flat, sinks=sink_t)  # fmt: skip
    name = (f"d{d} p{page} {layout} h{hq}/{hkv} {str(dtype)[6:]} causal={causal} window={window} cap={cap} "
            f"mask={mask or None}{' packed' if packed else ''}{' sinks' if sinks else ''} "
            f"q {q_lens} kv {kv_lens} tactic {tactic}")  # fmt: skip
    bad = torch.isnan(out)
    if bad.any():
        which = sorted({int(r) for r in bad.any(dim=2).any(dim=1).nonzero().flatten()})
        raise AssertionError(f"{name}: {int(bad.sum())} output elements unwritten or NaN (rows {which[:10]})")
    err = relative_error(out, ref)
    assert err <= tolerance_for(dtype), f"{name}: relative error {err:.3e}"
    # per (row, head) too: one key let in or left out in a single row hides in the norm of the batch
    per_row = (out.double() - ref).norm(dim=2) / ref.norm(dim=2).clamp(min=1e-12)
    worst = float(per_row.max()) if per_row.numel() else 0.0
    where = divmod(int(per_row.argmax()), hq) if per_row.numel() else None
    assert worst <= 2 * tolerance_for(dtype), f"{name}: (row, head) {where} relative error {worst:.3e}"
    assert lse is not None and not torch.isnan(lse).any(), f"{name}: LSE unwritten"
    lerr = lse_error(lse, ref_lse)
    assert lerr <= LSE_TOLERANCE[str(dtype)[6:]], f"{name}: LSE error {lerr:.3e}"
    return out, lse


# -- the emulation itself, on the kernel proven on the H200 ------------------------------------


def _emulated_decode_plan(problem: Any, batch: Any, tactic: dict[str, Any] | None, split: bool) -> Any:
    """The emulated decode plan of ``tactic``'s params (None: the default), which the plugin's check
    accepts and which splits some request exactly when ``split`` says."""
    t = Tactic.default("cuda_native") if tactic is None else Tactic(backend="cuda_native", kernel="decode",
                                                                     params=tactic)  # fmt: skip
    assert plugin._reasons(problem, t, H200) == []
    plan = emulate.DecodePlan(problem, batch, t)
    assert any(count > 1 for _, count in plan.work.splits) == split, plan.work
    return plan


def _decode_case(lens: list[int], kw: dict[str, Any], seed: int = 1,
                 sinks: torch.Tensor | None = None) -> tuple[Any, ...]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    d, page, layout, hq, hkv = kw.get("d", 64), kw.get("page", 16), kw.get("layout", "HND"), kw.get("hq", 8), kw.get(
        "hkv", 2)  # fmt: skip
    dtype = kw.get("dtype", torch.bfloat16)
    window, cap = kw.get("window", -1), kw.get("cap", 0.0)
    _, k, v, indptr, indices, last = _cache(lens, page, hkv, d, layout, dtype, gen, False)
    if kw.get("nan_outside"):  # every cache slot outside the batch's keys is NaN
        inside = torch.zeros(k.shape[0], page, dtype=torch.bool)
        for r, n in enumerate(lens):
            for i, p in enumerate(indices[indptr[r] : indptr[r + 1]].tolist()):
                inside[p, : min(page, n - i * page)] = True
        mask = ~inside[:, :, None, None] if layout == "NHD" else ~inside[:, None, :, None]
        k, v = k.masked_fill(mask, float("nan")), v.masked_fill(mask, float("nan"))
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    problem, batch = attention_problem(
        "decode", device=CPU, kv_layout=layout, qo_indptr=None, paged_kv_indptr=indptr, paged_kv_indices=indices,
        paged_kv_last_page_len=last, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, head_dim_vo=None,
        page_size=page, causal=False, sm_scale=None, window_left=window, logits_soft_cap=cap, q_data_type=dtype,
        kv_data_type=None, o_data_type=None, return_lse=True,
    )  # fmt: skip
    ref, ref_lse = attention_reference(q, k, v, torch.arange(len(lens) + 1, dtype=torch.int32), indptr, indices,
                                       last, kv_layout=layout, causal=False, sm_scale=problem.sm_scale,
                                       window_left=window, logits_soft_cap=cap, sinks=sinks)  # fmt: skip
    return problem, batch, q, k, v, ref, ref_lse


def _decode_run(plan: emulate.DecodePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, lse: bool,
                schedule: emulate.Schedule) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """One launch into NaN-filled outputs; the ticket counters are zero before and after it."""
    b, hq, d = q.shape
    out = torch.full((b, hq, d), float("nan"), dtype=q.dtype)
    lse_t = torch.full((b, hq), float("nan"), dtype=torch.float32) if lse else None
    assert not plan.counters.any(), "counters not zero before the launch"
    plan.run(q, k, v, out, lse_t, schedule)
    assert not plan.counters.any(), f"{schedule}: counters {plan.counters.tolist()} not reset by the merging CTAs"
    return out, lse_t


DECODE_CASES = [
    # (lens, options, whether a request is split: its partials merged inside the kernel)
    ([1, 17, 700, 64], {}, True),
    ([1, 17, 300, 64], {"d": 128, "page": 1, "layout": "NHD", "hq": 4, "hkv": 4, "window": 20, "cap": 10.0}, False),
    ([700, 5], {"tactic": {"tile": 64, "warps": 4, "stages": 3, "kv_chunk": 128}}, True),
    ([33, 2], {"d": 256, "page": 128, "dtype": torch.float16}, False),
]


@pytest.mark.parametrize(("lens", "kw", "split"), DECODE_CASES)
def test_emulation_reproduces_the_h200_proven_decode_kernel(lens: list[int], kw: dict[str, Any], split: bool) -> None:
    """The kernel as the plugin launches it (`emulate.DecodePlan` repeats the plan's steps), under
    every schedule of `emulate.SCHEDULES`: one CTA at a time forwards and backwards, and CTAs
    overlapping (tickets drawn in any order, merges early and late). Each launch matches the
    oracle, leaves the counters at zero (so the next launch, a CUDA-graph replay, starts clean)
    and, merged in slot order whoever merges, is bitwise the same as the first."""
    problem, batch, q, k, v, ref, ref_lse = _decode_case(lens, kw)
    dtype = q.dtype
    plan = _emulated_decode_plan(problem, batch, kw.get("tactic"), split)
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    for schedule in emulate.SCHEDULES:
        out, lse = _decode_run(plan, q, k, v, lse=True, schedule=schedule)
        assert lse is not None
        err, lerr = relative_error(out, ref), lse_error(lse, ref_lse)
        assert err <= tolerance_for(dtype), f"{schedule}: relative error {err:.3e}"
        assert lerr <= LSE_TOLERANCE[str(dtype)[6:]], f"{schedule}: LSE error {lerr:.3e}"
        if first is None:
            first = out, lse
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"{schedule}: not bitwise the same"
    assert first is not None
    # without an LSE output (a null pointer): the same output
    out, _ = _decode_run(plan, q, k, v, lse=False, schedule=emulate.SCHEDULES[-1])
    assert torch.equal(out, first[0])


SINK_CASES = [
    # (lens, options, whether a request is split): sinks folded by the whole request's CTA, or once
    # by the merging CTA after the partials
    ([1, 17, 700, 64], {}, True),
    ([1, 17, 300, 64], {"d": 128, "page": 1, "layout": "NHD", "hq": 4, "hkv": 4, "window": 20, "cap": 10.0}, False),
    # GQA 20: a 16-row and a 4-row q tile
    (
        [33, 260],
        {
            "d": 128,
            "page": 32,
            "hq": 40,
            "hkv": 2,
            "tactic": {"tile": 32, "warps": 2, "stages": 2, "kv_chunk": 64, "l2": 0},
        },
        True,
    ),
    ([700, 5], {"tactic": {"tile": 64, "warps": 4, "stages": 3, "kv_chunk": 128, "bulk": 16}}, True),
]


@pytest.mark.parametrize(("lens", "kw", "split"), SINK_CASES)
def test_emulated_decode_with_attention_sinks(lens: list[int], kw: dict[str, Any], split: bool) -> None:
    """Attention sinks (gpt-oss): each head's sink joins every row's softmax denominator, against
    the float64 oracle with the sink term: sinks below, near and far above the logits (the last
    rescales the running maximum), the LSE including them, whole and split requests under every
    schedule (bitwise the same), GQA groups of more than 8 rows in two q tiles, a window and the
    soft cap; new sink values in the same tensor are read by the next launch (a graph replay)."""
    hq = kw.get("hq", 8)
    sinks = (torch.randn(hq, generator=torch.Generator().manual_seed(7)) * 3).to(torch.float32)
    sinks[::3] = 12.0  # far above every logit: most of each row's weight goes to the sink
    problem, batch, q, k, v, ref, ref_lse = _decode_case(lens, kw, sinks=sinks)
    plan = _emulated_decode_plan(problem, batch, kw.get("tactic"), split)

    def launch(schedule: emulate.Schedule) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32)
        plan.run(q, k, v, out, lse, schedule, sinks=sinks)
        assert not plan.counters.any(), f"{schedule}: counters not reset"
        return out, lse

    first = None
    for schedule in emulate.SCHEDULES if split else emulate.SCHEDULES[:1]:
        out, lse = launch(schedule)
        err, lerr = relative_error(out, ref), lse_error(lse, ref_lse)
        assert err <= tolerance_for(q.dtype), f"{schedule}: relative error {err:.3e}"
        assert lerr <= LSE_TOLERANCE[str(q.dtype)[6:]], f"{schedule}: LSE error {lerr:.3e}"
        if first is None:
            first = out, lse
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"{schedule}: not bitwise the same"
    plain, _ = _decode_run(plan, q, k, v, lse=True, schedule=emulate.SCHEDULES[0])
    assert relative_error(plain, ref) > 10 * tolerance_for(q.dtype)  # without the sinks: another answer
    sinks.fill_(-3.0)  # new values in the same tensor: the next launch reads them
    *_, ref, ref_lse = _decode_case(lens, kw, sinks=sinks)
    out, lse = launch(emulate.SCHEDULES[-1])
    assert relative_error(out, ref) <= tolerance_for(q.dtype) and lse_error(lse, ref_lse) <= LSE_TOLERANCE[
        str(q.dtype)[6:]]  # fmt: skip


_B64 = {"tile": 64, "warps": 4}
BULK_CASES = [
    ([1, 17, 700, 64], {"tactic": {**_B64, "stages": 2, "bulk": 16}}),
    ([1, 7, 9, 300], {"page": 8, "window": 37, "tactic": {**_B64, "stages": 3, "bulk": 8, "l2": 0}}),  # no L2 hint
    ([700, 5, 130], {"window": 200, "cap": 10.0, "tactic": {**_B64, "stages": 2, "kv_chunk": 64, "bulk": 16}}),
    (
        [33, 260],
        {
            "d": 128,
            "page": 32,
            "hq": 40,
            "hkv": 2,
            "tactic": {"tile": 32, "warps": 2, "stages": 2, "kv_chunk": 64, "bulk": 8, "l2": 0},
        },
    ),
    ([100, 513], {"d": 256, "page": 128, "dtype": torch.float16, "tactic": {**_B64, "stages": 2, "bulk": 16}}),
]


@pytest.mark.exhaustive(sample=8)  # (bulk cases x copies x maps: a sample per CI run)
@pytest.mark.parametrize("tma", [0, 1], ids=["linear", "tensor-maps"])
@pytest.mark.parametrize("eager", [False, True], ids=["late-copies", "eager-copies"])
@pytest.mark.parametrize(("lens", "kw"), BULK_CASES)
def test_emulated_bulk_copy_decode(lens: list[int], kw: dict[str, Any], eager: bool, tma: int,
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The bulk-copy tactics (whole segments of a page per copy, an mbarrier per stage; linear
    copies, or tensor-map boxes in the 128-byte swizzle) with NaN in every cache slot outside the
    batch: keys before a window and past a request's end are copied with their segment and must
    not reach the output. Unaligned windows, forced splits, GQA 20 (two q tiles), page sizes 8 to
    128, d 64 to 256; every schedule; copies landing at once and as late as allowed."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    problem, batch, q, k, v, ref, ref_lse = _decode_case(lens, {**kw, "nan_outside": True})
    t = Tactic(backend="cuda_native", kernel="decode", params={**kw["tactic"], "tma": tma})
    assert plugin._reasons(problem, t, H200) == []  # type: ignore[arg-type]
    plan = emulate.DecodePlan(problem, batch, t)  # type: ignore[arg-type]
    first = None
    for schedule in emulate.SCHEDULES:
        out, lse = _decode_run(plan, q, k, v, lse=True, schedule=schedule)
        assert lse is not None and not torch.isnan(out).any(), f"{schedule}: NaN in the output"
        err, lerr = relative_error(out, ref), lse_error(lse, ref_lse)
        assert err <= tolerance_for(q.dtype), f"{schedule}: relative error {err:.3e}"
        assert lerr <= LSE_TOLERANCE[str(q.dtype)[6:]], f"{schedule}: LSE error {lerr:.3e}"
        if first is None:
            first = out
        else:
            assert torch.equal(out, first), f"{schedule}: not bitwise the same"


def test_emulated_decode_graph_mode_replays_and_replans() -> None:
    """CUDA-graph sizing: capacities from the kv-length bucket (idle CTAs past the work list, whose
    item records are still read), replays into the same counters, then a re-plan of another
    batch of the bucket into the same buffers (counters included) and more replays."""
    kw: dict[str, Any] = {"tactic": {"tile": 64, "warps": 4, "stages": 2, "kv_chunk": 128}, "hq": 8, "hkv": 2}
    plan = None
    for lens, seed in (([700, 5, 260], 1), ([300, 1000, 64], 2)):
        problem, batch, q, k, v, ref, ref_lse = _decode_case(lens, kw, seed=seed)
        t = Tactic(backend="cuda_native", kernel="decode", params=kw["tactic"])
        plan = emulate.DecodePlan(problem, batch, t, graph=True, previous=plan)  # type: ignore[arg-type]
        assert plan.grid[0] > len(plan.work.items) and plan.work.needs_merge
        for schedule in emulate.SCHEDULES[2:]:
            out, lse = _decode_run(plan, q, k, v, lse=True, schedule=schedule)
            assert lse is not None
            assert relative_error(out, ref) <= tolerance_for(q.dtype), f"{lens} {schedule}"
            assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"], f"{lens} {schedule}"


def test_device_plan_makes_the_work_list_the_host_makes() -> None:
    """kernels/decode_plan.cu (the work list a plan makes on the device) writes exactly the records
    and the count `decode_items(decode_balance_tail(decode_work(...)))` gives on the host, for
    ragged batches up to the largest it takes, windows, chunks around the lengths, and short last
    waves it recuts (D3's, windowed ones, several lengths at once) or leaves alone; nothing past
    them; and never more items or partial slots than `decode_bounds` sized the plan for."""
    from tactix_cuda_native import decode

    rng = random.Random(5)
    i32 = torch.int32
    cases: list[tuple[list[int], int, int, tuple[int, int, int] | None]] = [
        ([2048] * 256, -1, 2048, (8, 396, 64)),  # D3: 9 requests cut into 4 pieces each
        ([2000] * 256, 1994, 2048, (8, 396, 64)),  # windowed: 3 pieces, the last one shorter
        ([2048] * 250 + [1600] * 6, -1, 2048, (8, 396, 64)),  # pieces of two lengths, sorted
        ([1900, 2048, 1700] * 89, -1, 2048, (4, 264, 32)),  # tile 32
        ([2048] * 250 + [700] * 6, -1, 2048, (8, 396, 64)),  # a tail too short to recut
        ([2048] * 250 + [4096] * 3, -1, 2048, (8, 396, 64)),  # a tail of split requests: left alone
    ]
    for _ in range(24):
        b = rng.choice([1, 2, 3, 7, 64, 255, 256, 300, 1000, decode.DECODE_PLAN_MAX_BATCH])
        if rng.random() < 0.5:
            lens = [rng.choice([1, 2, 15, 16, 17, 63, 64, 65, 511, 512, 513, rng.randint(1, 9000)]) for _ in range(b)]
        else:  # near-uniform long requests: the batches a recut is for
            top = rng.choice([1024, 2048, 4096])
            lens = [rng.randint(top * 3 // 4, top) for _ in range(b)]
        chunk = rng.choice([1, 16, 64, 128, 512, 1024, 2048, 4096, 8192])
        recut = rng.choice([None, (rng.choice([1, 4, 8]), rng.choice([132, 264, 396]), rng.choice([32, 64]))])
        cases.append((lens, rng.choice([-1, -1, 0, 1, 63, 300]), chunk, recut))
    recuts = 0
    for lens, window, chunk, recut in cases:
        b = len(lens)
        ranges = decode.effective_lengths(lens, window)
        indptr = [0, *itertools.accumulate(-(-n // 16) for n in lens)]
        plain = decode.decode_work(ranges, chunk)
        work = plain if recut is None else decode.decode_balance_tail(plain, *recut)
        recuts += work is not plain
        want = decode.decode_items(work, indptr)
        items = torch.full((len(want) + 16,), -5, dtype=i32)
        count = torch.full((1,), -5, dtype=i32)
        emulate.decode_plan_records(torch.tensor(indptr, dtype=i32), torch.tensor(lens, dtype=i32), items, count, b,
                                    chunk, window, recut)  # fmt: skip
        assert items[: len(want)].tolist() == want, (b, window, chunk, recut)
        assert items[len(want) :].tolist() == [-5] * 16
        assert count.item() == len(work.items)
        if recut is not None:
            most, partial = decode.decode_bounds([e - s for s, e in ranges], chunk, recut[0], recut[1], True)
            assert len(work.items) <= most and work.slots <= partial, (b, window, chunk, recut)
        most, partial = decode.decode_bounds([e - s for s, e in ranges], chunk, 1, 1 << 30, False)
        assert len(plain.items) <= most and plain.slots <= partial
    assert recuts >= 4  # the listed recuts, at least


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_emulated_decode_is_the_same_with_the_work_list_made_on_either_side(
    graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode whose work list the device plan made gives the bits of the same decode planned on
    the host (`TACTIX_CUDA_NATIVE_HOST_PLAN=1`), split requests and their merge included."""
    from tactix_cuda_native import decode

    kw: dict[str, Any] = {"tactic": {"tile": 64, "warps": 4, "stages": 2}, "hq": 8, "hkv": 2}
    problem, batch, q, k, v, ref, _ = _decode_case([700, 5, 260, 1500, 33], kw, seed=3)
    t = Tactic(backend="cuda_native", kernel="decode", params=kw["tactic"])
    on_device = emulate.DecodePlan(problem, batch, t, graph=graph)  # type: ignore[arg-type]
    monkeypatch.setenv(decode.HOST_PLAN_ENV, "1")
    on_host = emulate.DecodePlan(problem, batch, t, graph=graph)  # type: ignore[arg-type]
    assert on_device.on_device and not on_host.on_device and on_device.work.needs_merge
    assert torch.equal(on_device.packed[: on_host.packed.numel()][:8], on_host.packed[:8])
    a, _ = _decode_run(on_device, q, k, v, lse=False, schedule=emulate.SCHEDULES[2])
    b, _ = _decode_run(on_host, q, k, v, lse=False, schedule=emulate.SCHEDULES[2])
    assert relative_error(a, ref) <= tolerance_for(q.dtype) and torch.equal(a, b)


# -- fp8 KV caches (decode) ------------------------------------------------------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("mode", [0, 2], ids=["bits", "int"])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", [1, 2], ids=["e4m3fn", "e5m2"])
def test_fp8_conversion_is_exact_for_every_code(fmt: int, bf16: bool, mode: int) -> None:
    """fp8.cuh's fp8 -> 16-bit conversion of each of the 256 codes, in the bit-arithmetic mode and
    the integer-placement mode, is torch's, exactly: NaN for NaN codes, e5m2's infinities, the
    signs of zeros, subnormals and the largest values."""
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(E4M3 if fmt == 1 else E5M2).float()
    got = emulate.fp8_convert(codes, fmt, bf16, mode).float()
    nan = torch.isnan(ref)
    assert int(nan.sum()) == (2 if fmt == 1 else 6)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], ref[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(ref[~nan]))


def _fp8_case(lens: list[int], kw: dict[str, Any], seed: int = 1) -> tuple[Any, ...]:
    """A decode batch over a ``kw["kv"]`` cache (fp8, or 16-bit) under ``kw["dtype"]`` q and out,
    the slots no request owns holding 448 (e4m3's largest: large but finite)."""
    gen = torch.Generator().manual_seed(seed)
    d, page, layout = kw.get("d", 64), kw.get("page", 16), kw.get("layout", "HND")
    hq, hkv, dtype, kv = kw.get("hq", 8), kw.get("hkv", 2), kw.get("dtype", torch.bfloat16), kw["kv"]
    _, k, v, indptr, indices, last = _cache(lens, page, hkv, d, layout, torch.float32, gen, False)
    inside = torch.zeros(k.shape[0], page, dtype=torch.bool)
    for r, n in enumerate(lens):
        for i, p in enumerate(indices[indptr[r] : indptr[r + 1]].tolist()):
            inside[p, : min(page, n - i * page)] = True
    mask = ~inside[:, :, None, None] if layout == "NHD" else ~inside[:, None, :, None]
    k, v = (3 * k).masked_fill(mask, 448.0).to(kv), (3 * v).masked_fill(mask, 448.0).to(kv)
    q = (torch.randn(len(lens), hq, d, generator=gen) * kw.get("q_scale", 1.0)).to(dtype)
    problem, batch = attention_problem(
        "decode", device=CPU, kv_layout=layout, qo_indptr=None, paged_kv_indptr=indptr, paged_kv_indices=indices,
        paged_kv_last_page_len=last, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, head_dim_vo=None,
        page_size=page, causal=False, sm_scale=kw.get("sm_scale"), window_left=kw.get("window", -1),
        logits_soft_cap=kw.get("cap", 0.0), q_data_type=dtype, kv_data_type=kv, o_data_type=None, return_lse=True,
    )  # fmt: skip

    def reference(k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return attention_reference(q, k, v, torch.arange(len(lens) + 1, dtype=torch.int32), indptr, indices, last,
                                   kv_layout=layout, causal=False, sm_scale=problem.sm_scale,
                                   window_left=kw.get("window", -1), logits_soft_cap=kw.get("cap", 0.0),
                                   k_scale=k_scale, v_scale=v_scale)  # fmt: skip

    return problem, batch, q, k, v, reference


_T32 = {"tile": 32, "warps": 2, "stages": 2, "kv_chunk": 64, "l2": 0}
_LOCAL = {"d": 128, "page": 1, "layout": "NHD", "hq": 4, "hkv": 4, "window": 20, "cap": 10.0}
FP8_CASES = [
    # (lens, options, whether a request is split)
    ([1, 17, 700, 64], {"kv": E4M3, "scales": (0.5, 2.0)}, True),
    ([33, 2, 300], {"kv": E5M2, "dtype": torch.float16, **_LOCAL, "scales": (0.25, 0.5), "tensor": True}, False),
    ([700, 5], {"kv": E5M2, "tactic": {**_B64, "stages": 3, "kv_chunk": 128}, "scales": (2.0, 0.25), "tensor": True},
     True),
    ([33, 2], {"kv": E4M3, "dtype": torch.float16, "d": 256, "page": 128, "scales": (1.0, 1.0)}, False),
    ([33, 260], {"kv": E4M3, "d": 128, "page": 32, "hq": 40, "hkv": 2, "scales": (0.5, 1.0), "tensor": True,
                 "tactic": _T32}, True),
    # a 16-bit cache with scales: the same scale arguments of the kernel
    ([700, 5, 64], {"kv": torch.bfloat16, "scales": (0.5, 2.0), "tensor": True}, True),
    # bfloat16 q beyond float16's range, above (2^20: inf in float16) and below (2^-30: zero), with
    # logits of order one: Q K^T runs in float16, each row scaled by a power of two into its range
    ([40, 300], {"kv": E4M3, "q_scale": 2.0**20, "sm_scale": 2.0**-23, "scales": (1.0, 1.0)}, False),
    ([40, 300], {"kv": E5M2, "q_scale": 2.0**-30, "sm_scale": 2.0**27, "scales": (0.5, 1.0), "d": 128,
                 "tactic": _T32}, True),
    # vreg 1: V's fragments built in registers (byte-permuted pairs of keys, the output dims put
    # back in the epilogue): 16 and 32 keys a warp per tile, d 128 and 256, both formats
    ([1, 17, 700, 64], {"kv": E4M3, "d": 128, "scales": (0.5, 2.0), "tensor": True,
                        "tactic": {"tile": 64, "warps": 4, "stages": 2, "ctas": 4, "vreg": 1}}, True),
    ([33, 300], {"kv": E5M2, "dtype": torch.float16, "d": 128, "hq": 40, "hkv": 2, "scales": (0.25, 0.5),
                 "tactic": {"tile": 64, "warps": 2, "stages": 3, "kv_chunk": 128, "vreg": 1}}, True),
    ([33, 2], {"kv": E4M3, "d": 256, "page": 128, "scales": (1.0, 2.0),
               "tactic": {"tile": 32, "warps": 2, "stages": 2, "vreg": 1}}, False),
    ([40, 300], {"kv": E4M3, "q_scale": 2.0**20, "sm_scale": 2.0**-23, "scales": (1.0, 1.0), "d": 128,
                 "tactic": {"tile": 64, "warps": 4, "stages": 2, "vreg": 1}}, False),
]  # fmt: skip


@pytest.mark.exhaustive(sample=6)  # (12 points, about 55 s on 2 cores: a sample per CI run)
@pytest.mark.parametrize(("lens", "kw", "split"), FP8_CASES)
def test_emulated_fp8_kv_decode(lens: list[int], kw: dict[str, Any], split: bool) -> None:
    """fp8 (e4m3fn, e5m2) caches under bf16 and fp16 q against the float64 oracle with the same
    scales: as floats and as one-element tensors (read by the kernel: a new value is seen by the
    next launch, as in a CUDA-graph replay), with and without the LSE, split requests merged under
    every schedule (bitwise the same), 448 in the slots no request owns, windows, the soft cap, GQA
    20 (two q tiles), d 64 to 256, a 32-key tile of 2 warps."""
    problem, batch, q, k, v, reference = _fp8_case(lens, kw)
    plan = _emulated_decode_plan(problem, batch, kw.get("tactic"), split)
    tol, ltol = attention_tolerance(q.dtype, k.dtype, q.dtype), attention_lse_tolerance(q.dtype, k.dtype)
    ks, vs = kw["scales"]

    def scales(a: float, b: float) -> tuple[Any, Any]:
        if kw.get("tensor"):
            return torch.tensor(a, dtype=torch.float32), torch.tensor([b], dtype=torch.float32)  # 0-d and [1]
        return (None if a == 1.0 else a), (None if b == 1.0 else b)

    def launch(k_scale: Any, v_scale: Any, schedule: emulate.Schedule, lse: bool = True) -> tuple[Any, Any]:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        lse_t = torch.full(q.shape[:2], float("nan"), dtype=torch.float32) if lse else None
        plan.run(q, k, v, out, lse_t, schedule, k_scale, v_scale)
        assert not plan.counters.any(), f"{schedule}: counters not reset"
        return out, lse_t

    ref, ref_lse = reference(ks, vs)
    k_scale, v_scale = scales(ks, vs)
    first = None
    for schedule in emulate.SCHEDULES if split else emulate.SCHEDULES[:1]:
        out, lse = launch(k_scale, v_scale, schedule)
        assert lse is not None and not torch.isnan(out).any(), f"{schedule}: NaN in the output"
        err, lerr = relative_error(out, ref), lse_error(lse, ref_lse)
        assert err <= tol, f"{schedule}: relative error {err:.3e}"
        assert lerr <= ltol, f"{schedule}: LSE error {lerr:.3e}"
        if first is None:
            first = out, lse
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"{schedule}: not bitwise the same"
    assert first is not None
    out, _ = launch(k_scale, v_scale, emulate.SCHEDULES[-1], lse=False)  # no LSE (a null pointer): the same output
    assert torch.equal(out, first[0])
    if kw.get("tensor"):  # new values in the same tensors: the next launch reads them
        assert isinstance(k_scale, torch.Tensor) and isinstance(v_scale, torch.Tensor)
        k_scale.fill_(ks * 3), v_scale.fill_(vs / 2)
        ref, ref_lse = reference(ks * 3, vs / 2)
        out, lse = launch(k_scale, v_scale, emulate.SCHEDULES[-1])
        assert lse is not None
        assert relative_error(out, ref) <= tol and lse_error(lse, ref_lse) <= ltol
        # the LSE follows k_scale only
        _, lse_v = launch(k_scale, torch.tensor([vs * 4], dtype=torch.float32), emulate.SCHEDULES[0])
        assert lse_v is not None and torch.equal(lse_v, lse)


# -- prefill ---------------------------------------------------------------------------------

Q = [1, 15, 17, 70, 3, 64]
KV = [1, 18, 57, 130, 40, 64]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(("page", "layout"), [(1, "NHD"), (16, "HND"), (128, "NHD")])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)], ids=["gqa1", "gqa4"])
def test_emulated_prefill_matches_oracle(d: int, page: int, layout: str, heads: tuple[int, int]) -> None:
    prefill_case(Q, KV, d=d, page=page, layout=layout, hq=heads[0], hkv=heads[1], seed=d + page)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "features",
    [
        {"causal": False},
        {"window": 0},
        {"window": 37},
        {"causal": False, "window": 5},
        {"cap": 30.0},
        {"causal": False, "cap": 5.0, "window": 20},
        {"scale": 0.3},
    ],
    ids=["noncausal", "win0", "win37", "noncausal-win5", "cap30", "noncausal-cap5-win20", "scale0.3"],
)
def test_emulated_prefill_masks_softcap_scale(dtype: torch.dtype, features: dict[str, Any]) -> None:
    prefill_case(Q, KV, dtype=dtype, layout="NHD", hq=6, hkv=2, seed=3, **features)


def test_emulated_prefill_edge_batches() -> None:
    # q longer than kv (non-causal), empty requests, q length 1 everywhere, a GQA ratio of 3
    prefill_case([40, 0, 1, 30], [3, 5, 1, 17], causal=False, seed=4)
    prefill_case([40, 0, 1, 30], [3, 5, 1, 17], causal=False, window=2, seed=4)
    prefill_case([1] * 7, [1, 5, 16, 17, 100, 33, 2], hq=6, hkv=2, seed=5)
    # a 5-D cache (k and v strided views of one tensor) and q as a view of a fused projection
    prefill_case(Q, KV, five_d=True, q_view=True, layout="NHD", seed=6)
    prefill_case(Q, KV, five_d=True, q_view=True, layout="HND", page=1, seed=6)


# every prefill kernel shape: the default, mma.sync, wgmma, and wgmma with persistent CTAs and the ping-pong
EVERY_PREFILL_KERNEL = pytest.mark.parametrize(
    "tactic", [None, {"q_tile": 128, "kv_tile": 32, "warps": 4, "stages": 2},
               {"q_tile": 64, "kv_tile": 64, "warps": 4, "stages": 4, "mma": "wgmma"},
               {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma", "persist": 1, "pingpong": 1}],
    ids=["default", "mma.sync", "wgmma", "wgmma-persist-pingpong"])  # fmt: skip


@EVERY_PREFILL_KERNEL
def test_emulated_prefill_with_attention_sinks(tactic: dict[str, Any] | None) -> None:
    """Attention sinks folded into each row's softmax by the mma.sync and the Hopper wgmma kernels
    (with persistent CTAs and the ping-pong), against the oracle's sink term, the LSE including
    it: causal chunks with GQA packing, a window with the soft cap, d 128; on mma.sync a custom
    mask with a row that attends nothing (zeros, the LSE its sink)."""
    prefill_case(Q, KV, hq=8, hkv=2, sinks=True, tactic=tactic, seed=21)
    prefill_case([90, 7, 33], [300, 40, 33], d=128, hq=4, hkv=4, window=70, cap=10.0, sinks=True, tactic=tactic,
                 seed=22)  # fmt: skip
    if tactic is None or tactic.get("mma") != "wgmma":
        prefill_case([3, 70, 1, 17], [40, 200, 1, 17], causal=False, hq=8, hkv=2, mask="random", sinks=True,
                     tactic=tactic, seed=23)  # fmt: skip


@EVERY_PREFILL_KERNEL
def test_emulated_prefill_causal_rows_before_the_first_key(tactic: dict[str, Any] | None) -> None:
    """Causal requests with more query rows than keys (FlashInfer's fully masked rows): the rows
    before a request's first key give zeros and an LSE of -inf (with sinks, the LSE of the sink
    alone), whole q tiles of them and tiles that straddle the first key, by both kernels, GQA
    packing, a window, the soft cap."""
    q_lens, kv_lens = [150, 7, 33, 64, 5], [3, 7, 1, 100, 2]
    out, lse = prefill_case(q_lens, kv_lens, d=128, hq=8, hkv=2, tactic=tactic, seed=31)
    first = 150 - 3  # request 0's rows before its first key
    assert out[:first].float().abs().max() == 0 and torch.isneginf(lse[:first]).all()
    assert torch.isfinite(lse[first:150]).all()
    prefill_case(q_lens, kv_lens, d=128, hq=4, hkv=4, window=20, cap=10.0, sinks=True, tactic=tactic, seed=32)


RAGGED_TACTICS = [
    None,
    {"q_tile": 128, "kv_tile": 32, "warps": 4, "stages": 2},
    {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma", "persist": 1, "pingpong": 1},
]


@pytest.mark.parametrize("tactic", RAGGED_TACTICS, ids=["default", "mma.sync", "wgmma-persist-pingpong"])
def test_emulated_ragged_prefill_through_one_token_pages(tactic: dict[str, Any] | None) -> None:
    """cuda_native's ragged-KV prefill (`tactix_cuda_native.ragged`): the paged prefill kernels over
    `RaggedBatch.paged` (one-token pages, the identity table) and `as_paged_prefill`, with packed k
    and v as ``k.unsqueeze(1)`` views of a fused KV projection (strided rows), against the ragged
    oracle: a chunk's new tokens over longer keys, a request without query rows or keys, GQA 4,
    a window with the soft cap and the sinks; held to the oracle's tolerances."""
    gen = torch.Generator().manual_seed(31)
    q_lens, kv_lens, hq, hkv, d = [70, 0, 1, 33, 17], [200, 0, 1, 33, 90], 8, 2, 128
    qo = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    kv = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32)
    fused = torch.randn(int(kv[-1]), 2 * hkv, d, generator=gen).to(torch.bfloat16)  # [tokens, k heads | v heads, d]
    k, v = fused[:, :hkv], fused[:, hkv:]
    q = torch.randn(int(qo[-1]), hq, d, generator=gen).to(torch.bfloat16)
    sinks = (torch.randn(hq, generator=gen) * 3).to(torch.float32)
    t = Tactic.default("cuda_native") if tactic is None else Tactic(backend="cuda_native", kernel="prefill",
                                                                     params=tactic)  # type: ignore[arg-type]  # fmt: skip
    for window, cap, sink in ((-1, 0.0, None), (50, 10.0, sinks)):
        problem, batch = ragged_problem(device=CPU, qo_indptr=qo, kv_indptr=kv, num_qo_heads=hq, num_kv_heads=hkv,
                                        head_dim_qk=d, head_dim_vo=None, causal=True, sm_scale=None,
                                        window_left=window, logits_soft_cap=cap, q_data_type=torch.bfloat16,
                                        kv_data_type=None, o_data_type=None, return_lse=True)  # fmt: skip
        paged = problem.as_paged_prefill().model_copy(update={"device_type": "cuda"})
        assert (paged.page_size, paged.kv_layout, paged.causal, paged.window_left) == (1, "NHD", True, window)
        assert plugin._reasons(problem.model_copy(update={"device_type": "cuda"}), t, H200) == []
        pages = batch.paged
        assert pages.kv_indices.tolist() == list(range(int(kv[-1]))) and pages.kv_lens_list == kv_lens
        out, lse, _ = emulate.run_prefill(paged, pages, t, q, k.unsqueeze(1), v.unsqueeze(1), return_lse=True,
                                          sinks=sink)  # fmt: skip
        ref, ref_lse = ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=problem.sm_scale, window_left=window,
                                        logits_soft_cap=cap, sinks=sink)  # fmt: skip
        assert lse is not None and not torch.isnan(out).any()
        assert relative_error(out, ref) <= tolerance_for(torch.bfloat16), (window, relative_error(out, ref))
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"]


@pytest.mark.parametrize(("dqk", "dvo", "tactic"), [
    (128, 128, {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma", "persist": 1, "pingpong": 1}),
    (192, 128, {"q_tile": 64, "kv_tile": 64, "warps": 4, "stages": 2, "mma": "wgmma"}),
], ids=["128-wgmma-persist-pingpong", "192x128-wgmma-q64"])  # fmt: skip
def test_emulated_ragged_prefill_through_tensor_maps_equals_the_gather(dqk: int, dvo: int,
                                                                      tactic: dict[str, Any]) -> None:  # fmt: skip
    """The wgmma kernel's ragged path with K and V tiles through tensor maps of the packed tensors
    (TX_KV_TMA: one producer thread, no page lookups; `prefill.ragged_tma`) gives the gather's
    output and LSE bit for bit, within the oracle's tolerance: strided views of a fused KV
    projection, a request without query rows or keys, GQA 4, a window and the sinks, and a last
    request whose last tile runs past the end of the tensors (zeros there, masked); persistent
    CTAs looping over several items; a CUDA-graph plan's item list padded past the batch (records
    that must never be read)."""
    gen = torch.Generator().manual_seed(37)
    q_lens, kv_lens, hq, hkv = [70, 0, 1, 33, 17], [200, 0, 1, 40, 90], 8, 2
    qo = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    kv = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32)
    fused = torch.randn(int(kv[-1]), hkv, dqk + dvo, generator=gen).to(torch.bfloat16)  # [tokens, heads, k | v]
    k, v = fused[:, :, :dqk], fused[:, :, dqk:]
    q = torch.randn(int(qo[-1]), hq, dqk, generator=gen).to(torch.bfloat16)
    sinks = (torch.randn(hq, generator=gen) * 3).to(torch.float32)
    t = Tactic(backend="cuda_native", kernel="prefill", params=tactic)  # type: ignore[arg-type]
    for window, sink in ((-1, None), (50, sinks)):
        problem, batch = ragged_problem(device=CPU, qo_indptr=qo, kv_indptr=kv, num_qo_heads=hq, num_kv_heads=hkv,
                                        head_dim_qk=dqk, head_dim_vo=dvo, causal=True, sm_scale=None,
                                        window_left=window, logits_soft_cap=0.0, q_data_type=torch.bfloat16,
                                        kv_data_type=None, o_data_type=None, return_lse=True)  # fmt: skip
        paged = problem.as_paged_prefill().model_copy(update={"device_type": "cuda"})
        assert plugin._reasons(problem.model_copy(update={"device_type": "cuda"}), t, H200) == []
        runs = [emulate.run_prefill(paged, batch.paged, t, q, k.unsqueeze(1), v.unsqueeze(1), return_lse=True,
                                    sinks=sink, persistent=3, kv_tma=tma) for tma in (True, False)]  # fmt: skip
        (out, lse, work), (gather_out, gather_lse, _) = runs
        graph_out, graph_lse, _ = emulate.run_prefill(paged, batch.paged, t, q, k.unsqueeze(1), v.unsqueeze(1),
                                                      return_lse=True, sinks=sink, persistent=3, kv_tma=True,
                                                      capacity=len(work.items) + 5)  # fmt: skip
        assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse), window
        ref, ref_lse = ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=problem.sm_scale, window_left=window,
                                        sinks=sink)  # fmt: skip
        assert lse is not None and gather_lse is not None and not torch.isnan(out).any()
        assert relative_error(out, ref) <= tolerance_for(torch.bfloat16), (window, relative_error(out, ref))
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"]
        assert torch.equal(out, gather_out) and torch.equal(lse, gather_lse), window


@pytest.mark.parametrize("tactic", [
    {"q_tile": 64, "kv_tile": 32, "warps": 4, "stages": 2, "pack": 1},
    {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma", "pack": 1},
    {"q_tile": 128, "kv_tile": 64, "warps": 8, "stages": 2, "mma": "wgmma", "pack": 1, "pingpong": 1},
], ids=["sync", "wgmma", "wgmma-pingpong"])  # fmt: skip
def test_emulated_prefill_head_sections_give_the_same_bits(tactic: dict[str, Any]) -> None:
    """The grid's head groups in sections (`prefill.prefill_head_section`: each section's items
    before the next section's, for L2) reorder the CTAs only: the same output and LSE bit for bit
    as one section, with sections that do not divide the head groups (8 in sections of 3: 3, 3,
    2), one head group a section, CTAs in flight at once in a shuffled order, and a CUDA-graph
    plan's padded item list. (Persistent CTAs keep one section: the plan passes every head group.)"""
    shuffled = emulate.Schedule(order="shuffled", resident=3, seed=5)
    runs = {}
    for section, schedule, capacity in ((0, None, 0), (3, shuffled, 0), (1, None, 40)):
        runs[(section, schedule is not None, capacity)] = prefill_case(
            [130, 1, 20], [200, 9, 20], hq=8, hkv=2, d=64, tactic=tactic, seed=53, schedule=schedule,
            persistent=3, capacity=capacity, head_section=section)  # fmt: skip
    out, lse = runs[(0, False, 0)]
    for key, (o, s_) in runs.items():
        assert torch.equal(o, out) and torch.equal(s_, lse), key


def test_prefill_head_section_keeps_a_section_of_heads_within_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Head groups per section of the prefill grid (opted into with
    TACTIX_CUDA_NATIVE_HEAD_SECTIONS=1): every head group where the longest request's keys and
    values over all heads fit in half of L2; else whole KV heads' groups, as many as fit, at least
    one. Unset or 0: one section whatever the batch."""
    monkeypatch.setenv(prefill.HEAD_SECTIONS_ENV, "1")
    l2 = 50 * 2**20
    row = (192 + 128) * 2  # DeepSeek's K and V rows of one head, 16-bit
    assert prefill.prefill_head_section(16, 1, 1024, row, l2) == 16  # R1: 4 x 1024, 10 MB over 16 heads
    per_head = 8192 * row  # R2: 1 x 8192, 5.2 MB a head, 84 MB over 16
    assert prefill.prefill_head_section(16, 1, 8192, row, l2) == (l2 // 2) // per_head == 5
    assert prefill.prefill_head_section(32, 4, 16384, 256 * 2, l2) == 4 * 3  # GQA 4: 3 of 8 KV heads fit
    assert prefill.prefill_head_section(32, 4, 1 << 20, 256 * 2, l2) == 4  # one KV head's groups at least
    assert prefill.prefill_head_section(8, 1, 8192, 256, l2) == 8  # fp8 d128: all fit
    for off in ("0", None):
        if off is None:
            monkeypatch.delenv(prefill.HEAD_SECTIONS_ENV)
        else:
            monkeypatch.setenv(prefill.HEAD_SECTIONS_ENV, off)
        assert prefill.prefill_head_section(16, 1, 8192, row, l2) == 16


_WG = {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma"}  # the d128 wgmma shape


@pytest.mark.parametrize(("dqk", "dvo", "tactic"), [
    (192, 128, None), (192, 128, {"q_tile": 64, "kv_tile": 32, "warps": 4, "stages": 2}),
    (192, 128, {**_WG, "persist": 1, "pingpong": 1}), (192, 128, {**_WG, "q_tile": 64, "kv_tile": 64, "warps": 4}),
    (256, 128, {**_WG, "kv_tile": 64}), (128, 64, None), (128, 64, {"q_tile": 64, "kv_tile": 32, "warps": 4,
                                                                    "stages": 2}),
    (64, 128, None)],
    ids=["192x128-default", "192x128-sync-q64", "192x128-wgmma-persist-pingpong", "192x128-wgmma-q64",
         "256x128-wgmma", "128x64-default", "128x64-sync", "64x128-default"])  # fmt: skip
def test_emulated_prefill_with_other_value_head_dims(dqk: int, dvo: int, tactic: dict[str, Any] | None) -> None:
    """q/k and v/o head dims that differ (DeepSeek's 192/128, the kit's 128/64, 256/128) or are not
    a kernel dim, against the oracle, output and LSE: the wgmma kernel with its own dims (TX_DVO:
    the default on Hopper where it takes them, `prefill.wgmma_head_dims`), and the mma.sync kernel
    of the next dim (`prefill.kernel_head_dim`), rows zero-filled past their own dims (64/128 only
    that way: wgmma tactics refused); the caches are views whose columns past the rows' dims hold
    NaN (a K column read past ``dqk`` would reach every logit), paged and ragged (one-token pages),
    with GQA packing and a window."""
    gen = torch.Generator().manual_seed(41)
    q_lens, kv_lens, hq, hkv, page = [70, 1, 33, 5], [200, 1, 33, 60], 8, 2, 16
    d = prefill.kernel_head_dim(
        tactix.PrefillProblem.model_construct(head_dim_qk=dqk, head_dim_vo=dvo)  # (only the dims are read)
    )
    assert d == (256 if dqk >= 192 else 128)
    _, k, v, indptr, indices, last = _cache(kv_lens, page, hkv, d, "NHD", torch.bfloat16, gen, False)
    k[..., dqk:], v[..., dvo:] = float("nan"), float("nan")
    k, v = k[..., :dqk], v[..., :dvo]
    qo = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(int(qo[-1]), hq, dqk, generator=gen).to(torch.bfloat16)
    t = Tactic.default("cuda_native") if tactic is None else Tactic(backend="cuda_native", kernel="prefill",
                                                                     params=tactic)  # type: ignore[arg-type]  # fmt: skip
    for window in (-1, 50):
        problem, batch = attention_problem(
            "prefill", device=CPU, kv_layout="NHD", qo_indptr=qo, paged_kv_indptr=indptr, paged_kv_indices=indices,
            paged_kv_last_page_len=last, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=dqk, head_dim_vo=dvo,
            page_size=page, causal=True, sm_scale=None, window_left=window, logits_soft_cap=0.0,
            q_data_type=torch.bfloat16, kv_data_type=None, o_data_type=None, return_lse=True,
        )  # fmt: skip
        problem = problem.model_copy(update={"device_type": "cuda"})
        assert plugin._reasons(problem, t, H200) == [] and prefill.padded(problem)
        native = prefill.wgmma_head_dims(dqk, dvo)
        params = prefill.default_params_for(problem, H200) if tactic is None else prefill.PrefillParams.from_tactic(t)
        assert params.mma == ("wgmma" if native and (tactic is None or tactic.get("mma")) else "sync")
        wgmma = Tactic(backend="cuda_native", kernel="prefill", params=_wgmma((64, 64, 4, 2)))
        if native:
            assert plugin._reasons(problem, wgmma, H200) == []
        else:
            assert any("runs it zero-filled" in r for r in plugin._reasons(problem, wgmma, H200))
        out, lse, _ = emulate.run_prefill(problem, batch, t, q, k, v, return_lse=True)  # type: ignore[arg-type]
        ref, ref_lse = attention_reference(q, k, v, qo, indptr, indices, last, kv_layout="NHD", causal=True,
                                           sm_scale=problem.sm_scale, window_left=window)  # fmt: skip
        assert out.shape[-1] == dvo and not torch.isnan(out).any() and lse is not None
        assert relative_error(out, ref) <= tolerance_for(torch.bfloat16), (window, relative_error(out, ref))
        assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"]
    # ragged, through one-token pages (k and v packed per request, views with NaN past their dims)
    kv = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32)
    wide = torch.randn(int(kv[-1]), 2 * hkv, d, generator=gen).to(torch.bfloat16)
    wide[:, :hkv, dqk:], wide[:, hkv:, dvo:] = float("nan"), float("nan")
    rk, rv = wide[:, :hkv, :dqk], wide[:, hkv:, :dvo]
    rproblem, rbatch = ragged_problem(device=CPU, qo_indptr=qo, kv_indptr=kv, num_qo_heads=hq, num_kv_heads=hkv,
                                      head_dim_qk=dqk, head_dim_vo=dvo, causal=True, sm_scale=None, window_left=-1,
                                      logits_soft_cap=0.0, q_data_type=torch.bfloat16, kv_data_type=None,
                                      o_data_type=None, return_lse=True)  # fmt: skip
    paged = rproblem.as_paged_prefill().model_copy(update={"device_type": "cuda"})
    out, lse, _ = emulate.run_prefill(paged, rbatch.paged, t, q, rk.unsqueeze(1), rv.unsqueeze(1), return_lse=True)
    ref, ref_lse = ragged_reference(q, rk, rv, qo, kv, causal=True, sm_scale=rproblem.sm_scale)
    assert relative_error(out, ref) <= tolerance_for(torch.bfloat16) and lse is not None
    assert lse_error(lse, ref_lse) <= LSE_TOLERANCE["bfloat16"]


MASK_SYNC_TACTICS = [  # mma.sync shapes: one and two m16 tiles a warp, kv tiles of 32 to 128, 4 and 8 warps
    None,
    {"q_tile": 128, "kv_tile": 32, "warps": 4, "stages": 2},
    {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2},
]


@pytest.mark.parametrize("tactic", MASK_SYNC_TACTICS, ids=lambda t: "default" if t is None else
                         f"q{t['q_tile']}-kv{t['kv_tile']}-w{t['warps']}")  # fmt: skip
@pytest.mark.parametrize("kind", ["tree", "random"])
def test_emulated_prefill_custom_masks(kind: str, tactic: dict[str, Any] | None) -> None:
    """Tree attention over cached prefixes (drafts of 1-70 tokens) and random masks with a row that
    attends nothing (zeros, LSE -inf), flat and bit-packed, with GQA packing (8 query heads over 2)
    and a draft longer than one q tile."""
    q_lens, kv_lens = [3, 70, 1, 17, 0], [40, 200, 1, 17, 9]
    prefill_case(q_lens, kv_lens, causal=False, hq=8, hkv=2, mask=kind, tactic=tactic, seed=11)
    prefill_case(q_lens, kv_lens, causal=False, hq=4, hkv=4, mask=kind, packed=True, tactic=tactic, seed=12)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_emulated_prefill_custom_mask_with_window_softcap_and_every_head_dim(d: int) -> None:
    prefill_case([5, 33], [60, 90], d=d, causal=False, window=24, cap=20.0, mask="tree", seed=d)
    prefill_case([5, 33], [60, 90], d=d, causal=False, mask="random", packed=True, layout="NHD", page=1, seed=d)


FP8_PREFILL_CASES = [
    # (q lens, kv lens, options); "kv": the cache dtype, "scales": (k_scale, v_scale)
    ([1, 70, 3, 129], [1, 130, 40, 129], {"kv": E4M3, "scales": (0.5, 2.0)}),
    ([5, 33, 0, 17], [60, 90, 9, 17], {"kv": E5M2, "dtype": torch.float16, "causal": False, "window": 24,
                                        "cap": 20.0, "page": 1, "layout": "NHD", "scales": (0.25, 0.5),
                                        "tensor": True}),
    ([40, 2], [300, 2], {"kv": E4M3, "d": 256, "hq": 8, "hkv": 8, "scales": (2.0, 0.25)}),
    ([17, 70], [17, 200], {"kv": E4M3, "tactic": {"q_tile": 128, "kv_tile": 64, "warps": 4, "stages": 3},
                           "scales": (0.5, 1.0), "tensor": True}),
    ([17, 70], [17, 200], {"kv": E5M2, "d": 128, "tactic": {"q_tile": 32, "kv_tile": 32, "warps": 2, "stages": 2},
                           "scales": (1.0, 1.0)}),
    ([5, 40, 1], [60, 300, 1], {"kv": E4M3, "causal": False, "mask": "tree", "scales": (0.5, 2.0)}),
    # the wgmma kernel (the default above is it too): its producer converts the staged fp8 rows
    ([1, 70, 3, 129], [1, 130, 40, 129], {"kv": E4M3, "d": 128, "scales": (0.5, 2.0), "tactic": _WG}),
    ([5, 33, 0, 17], [60, 290, 9, 17], {"kv": E5M2, "dtype": torch.float16, "d": 128, "causal": False,
                                         "window": 70, "cap": 20.0, "page": 1, "layout": "NHD", "scales": (0.25, 0.5),
                                         "tensor": True, "tactic": {**_WG, "persist": 1, "pingpong": 1}}),
    ([40, 2], [300, 2], {"kv": E5M2, "d": 256, "hq": 8, "hkv": 8, "scales": (2.0, 0.25),
                         "tactic": {**_WG, "kv_tile": 64}}),
    ([17, 70, 130], [17, 200, 500], {"kv": E4M3, "tactic": {**_WG, "q_tile": 64, "kv_tile": 64, "warps": 4},
                                     "scales": (0.5, 1.0)}),
    # bf16 q over an fp8 cache, Q K^T in float16 (TX_QK16, opt-in: "qk16"), each warp's Q rows rescaled
    # by a power of two: rows from 2^-16 to 2^16 times randn (past float16's range at the top), with the
    # soft cap and a window; from 2^-6 to 2^6 without the cap (the logit scale's path, `mul_q`)
    ([1, 70, 3, 129], [1, 130, 40, 129], {"kv": E4M3, "d": 128, "scales": (0.5, 2.0), "q_pow2": 16, "cap": 30.0,
                                          "window": 90, "qk16": True, "tactic": {**_WG, "persist": 1, "pingpong": 1}}),
    ([17, 70], [17, 200], {"kv": E5M2, "d": 64, "scales": (1.0, 0.5), "q_pow2": 6, "qk16": True,
                           "tactic": {**_WG, "q_tile": 64, "kv_tile": 64, "warps": 4}}),
    # 16-bit caches with scales: every prefill kernel applies them, the wgmma one too
    ([1, 70, 3, 129], [1, 130, 40, 129], {"kv": torch.bfloat16, "scales": (0.5, 2.0), "tensor": True}),
    ([1, 70, 3, 129], [1, 130, 40, 129], {"kv": torch.bfloat16, "d": 128, "scales": (0.25, 3.0), "tactic": _WG}),
]  # fmt: skip


@pytest.mark.parametrize(("q_lens", "kv_lens", "kw"), FP8_PREFILL_CASES)
def test_emulated_fp8_kv_prefill(
    q_lens: list[int], kv_lens: list[int], kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both prefill kernels over fp8 caches (e4m3fn, e5m2; bf16 and fp16 q) against the float64
    oracle with the same scales, as floats and as one-element tensors (a new value is read by
    the next launch): causal and not, a window, the soft cap, d 64 to 256, GQA packing, tile
    shapes of both (wgmma: one and two consumer warpgroups, persistent and ping-pong), a tree
    mask, 448 in the slots no request owns; and 16-bit caches with scales on both kernels."""
    gen = torch.Generator().manual_seed(7)
    d, page, layout = kw.get("d", 64), kw.get("page", 16), kw.get("layout", "HND")
    hq, hkv, dtype, kv = kw.get("hq", 8), kw.get("hkv", 2), kw.get("dtype", torch.bfloat16), kw["kv"]
    monkeypatch.setenv("TACTIX_CUDA_NATIVE_FP8_QK16", "1" if kw.get("qk16") else "0")
    causal, window, cap = kw.get("causal", True), kw.get("window", -1), kw.get("cap", 0.0)
    _, k, v, indptr, indices, last = _cache(kv_lens, page, hkv, d, layout, torch.float32, gen, False)
    inside = torch.zeros(k.shape[0], page, dtype=torch.bool)
    for r, n in enumerate(kv_lens):
        for i, pg in enumerate(indices[indptr[r] : indptr[r + 1]].tolist()):
            inside[pg, : min(page, n - i * page)] = True
    outside = ~inside[:, :, None, None] if layout == "NHD" else ~inside[:, None, :, None]
    k, v = (3 * k).masked_fill(outside, 448.0).to(kv), (3 * v).masked_fill(outside, 448.0).to(kv)
    qo = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(int(qo[-1]), hq, d, generator=gen)
    if "q_pow2" in kw:  # each (token, head) row times 2^u, u uniform in [-q_pow2, q_pow2]
        q = q * torch.exp2(torch.randint(-kw["q_pow2"], kw["q_pow2"] + 1, (q.shape[0], hq, 1), generator=gen).float())
    q = q.to(dtype)
    parts = [mask_of(kw["mask"], ql, kl, gen) for ql, kl in zip(q_lens, kv_lens, strict=True)] if "mask" in kw else []
    flat = torch.cat([m.reshape(-1) for m in parts]) if parts else None
    problem, batch = attention_problem(
        "prefill", device=CPU, kv_layout=layout, qo_indptr=qo, paged_kv_indptr=indptr,  # type: ignore[arg-type]
        paged_kv_indices=indices, paged_kv_last_page_len=last, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d,
        head_dim_vo=None, page_size=page, causal=causal, sm_scale=None, window_left=window, logits_soft_cap=cap,
        q_data_type=dtype, kv_data_type=kv, o_data_type=None, return_lse=True,
        **({"custom_mask": flat} if flat is not None else {}),
    )  # fmt: skip
    problem = problem.model_copy(update={"device_type": "cuda"})
    tactic = kw.get("tactic")
    t = Tactic.default("cuda_native") if tactic is None else Tactic(backend="cuda_native", kernel="prefill",
                                                                     params=tactic)  # type: ignore[arg-type]  # fmt: skip
    assert plugin._reasons(problem, t, H200) == []  # type: ignore[arg-type]
    tol, ltol = attention_tolerance(dtype, kv, dtype), attention_lse_tolerance(dtype, kv)

    def check(ks: float, vs: float, k_scale: Any, v_scale: Any) -> None:
        out, lse, _ = emulate.run_prefill(problem, batch, t, q, k, v, return_lse=True,  # type: ignore[arg-type]
                                          k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        ref, ref_lse = attention_reference(q, k, v, qo, indptr, indices, last, kv_layout=layout, causal=causal,
                                           sm_scale=problem.sm_scale, window_left=window, logits_soft_cap=cap,
                                           k_scale=ks, v_scale=vs, custom_mask=flat)  # fmt: skip
        assert lse is not None and not torch.isnan(out).any(), "NaN in the output"
        err, lerr = relative_error(out, ref), lse_error(lse, ref_lse)
        assert err <= tol, f"scales {ks}, {vs}: relative error {err:.3e}"
        assert lerr <= ltol, f"scales {ks}, {vs}: LSE error {lerr:.3e}"

    ks, vs = kw["scales"]
    if kw.get("tensor"):
        k_t, v_t = torch.tensor(ks, dtype=torch.float32), torch.tensor([vs], dtype=torch.float32)  # 0-d and [1]
        check(ks, vs, k_t, v_t)
        k_t.fill_(ks * 3), v_t.fill_(vs / 2)  # new values in the same tensors: the next launch reads them
        check(ks * 3, vs / 2, k_t, v_t)
    else:
        check(ks, vs, None if ks == 1.0 else ks, None if vs == 1.0 else vs)


PREFILL_HEADS = (8, 2)
PREFILL_TACTICS = [
    pytest.param(d, params.to_tactic().params, id=f"d{d}-{params.to_tactic()}")
    for d in (64, 128, 256)
    for params in prefill.prefill_candidates(d, H200, gqa=PREFILL_HEADS[0] // PREFILL_HEADS[1])
]


@pytest.mark.exhaustive(sample=6)
@pytest.mark.parametrize(("d", "tactic"), PREFILL_TACTICS)
def test_emulated_prefill_every_enumerated_tactic(d: int, tactic: dict[str, Any]) -> None:
    for features in ({"causal": True}, {"causal": False, "window": 50}):
        prefill_case([1, 70, 3, 129], [1, 130, 40, 129], d=d, hq=PREFILL_HEADS[0], hkv=PREFILL_HEADS[1],
                     tactic=tactic, seed=d, **features)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("eager", [False, True], ids=["late-copies", "eager-copies"])
@pytest.mark.parametrize("seed", range(4))
def test_emulated_prefill_random_ragged_batches(seed: int, eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random lengths (tile edges are hit at random), random features, both copy timings."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    gen = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 6, (1,), generator=gen))
    q_lens = torch.randint(1, 150, (n,), generator=gen).tolist()
    causal = bool(seed % 2 == 0)
    prefix = torch.randint(0, 200, (n,), generator=gen).tolist()
    kv_lens = [q + p for q, p in zip(q_lens, prefix, strict=True)] if causal else [p + 1 for p in prefix]
    window = [-1, 0, 7, 64][seed]
    cap = [0.0, 0.0, 20.0, 0.0][seed]
    shapes = [(128, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 32, 4, 4)]
    q_tile, kv_tile, warps, stages = shapes[seed]
    for pack in (0, 1):
        tactic = {"q_tile": q_tile, "kv_tile": kv_tile, "warps": warps, "stages": stages, "pack": pack}
        prefill_case(q_lens, kv_lens, causal=causal, window=window, cap=cap, tactic=tactic, hq=8, hkv=2,
                     page=[1, 16, 4, 128][seed], seed=seed)  # fmt: skip
    assert math.isfinite(float(n))


@pytest.mark.parametrize(
    ("shape", "features"),
    [((64, 32, 4, 2), {}), ((128, 32, 4, 3), {"window": 3}), ((128, 64, 8, 2), {}), ((64, 64, 4, 2), {"window": 40})],
    ids=["q64-kv32", "q128-kv32-win3", "q128-kv64-w8", "q64-kv64-win40"],
)
def test_emulated_prefill_every_diagonal_alignment(shape: tuple[int, int, int, int], features: dict[str, Any]) -> None:
    """One request per prefix length 0..kv_tile + 1: the diagonal (and window edge) meets every
    key offset of a tile, for every warp, so an off-by-one in the masked-tile tests shows."""
    q_tile, kv_tile, warps, stages = shape
    q_lens = [37] * (kv_tile + 2)
    kv_lens = [37 + p for p in range(kv_tile + 2)]
    tactic = {"q_tile": q_tile, "kv_tile": kv_tile, "warps": warps, "stages": stages, "pack": 1}
    prefill_case(q_lens, kv_lens, hq=1, hkv=1, tactic=tactic, seed=9, **features)


# -- the Hopper kernel (kernels/prefill_sm90.cu) -----------------------------------------------

WGMMA_SHAPES = [(128, 128, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 4)]


def _wgmma(shape: tuple[int, int, int, int], **extra: Any) -> dict[str, Any]:
    q_tile, kv_tile, warps, stages = shape
    return {"q_tile": q_tile, "kv_tile": kv_tile, "warps": warps, "stages": stages, "mma": "wgmma", **extra}


@pytest.mark.exhaustive(sample=4)  # (8 points, about 45 s on 2 cores: a sample per CI run)
@pytest.mark.parametrize("eager", [False, True], ids=["late-copies", "eager-copies"])
@pytest.mark.parametrize("shape", WGMMA_SHAPES, ids=lambda s: "q{}-kv{}-s{}".format(*s[:2], s[3]))
def test_emulated_wgmma_ring_wraps_and_warpgroups_skip(shape: tuple[int, int, int, int], eager: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Key ranges many times the ring (every slot reused, both mbarrier parities, K released a
    tile before V), a chunk over a long prefix, and one head per CTA so that the two consumer
    warpgroups own different tokens: with causal masks and windows one skips tiles the other
    computes (while both keep the barrier protocol); short requests leave a warpgroup idle."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    q_lens, kv_lens = [300, 5, 129, 1], [1100, 700, 129, 900]
    for pack, window in ((0, -1), (1, -1), (1, 90)):
        prefill_case(q_lens, kv_lens, d=64, hq=8, hkv=2, tactic=_wgmma(shape, pack=pack), window=window,
                     page=16 if window < 0 else 1, seed=11)  # fmt: skip
    prefill_case([200, 3], [200, 1000], d=128, hq=2, hkv=2, tactic=_wgmma(shape), causal=False, window=300, seed=12)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_emulated_wgmma_every_head_dim_with_long_keys(d: int, dtype: torch.dtype) -> None:
    """The default wgmma tactic for each head dim past its ring (soft-cap and LSE too)."""
    params = prefill.default_prefill_params(d, H200)
    assert params.mma == "wgmma"
    prefill_case([150, 1, 64], [700, 333, 64], d=d, dtype=dtype, hq=4, hkv=2, cap=20.0, layout="NHD", seed=d)


@pytest.mark.parametrize("shape", [(128, 128, 8, 2), (64, 64, 4, 2)], ids=["q128-kv128", "q64-kv64"])
def test_emulated_wgmma_every_diagonal_alignment(shape: tuple[int, int, int, int]) -> None:
    """One request per prefix length 0..kv_tile + 1 (as for the mma.sync kernel): the diagonal
    meets every key offset of a tile, for both warpgroups."""
    kv_tile = shape[1]
    q_lens = [70] * (kv_tile + 2)
    kv_lens = [70 + p for p in range(kv_tile + 2)]
    prefill_case(q_lens, kv_lens, d=64, hq=1, hkv=1, tactic=_wgmma(shape, pack=1), seed=13)


# -- CTAs in flight together -------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [emulate.Schedule("grid", resident=2), emulate.Schedule("shuffled", resident=5, seed=3)],
    ids=["two-resident", "shuffled-five-resident"],
)
@pytest.mark.parametrize(
    "tactic",
    [
        {"q_tile": 64, "kv_tile": 32, "warps": 4, "stages": 3},
        _wgmma((64, 64, 4, 2)),  # one consumer warpgroup: two CTAs share an H200 SM
        _wgmma((128, 128, 8, 2)),
    ],
    ids=["sync", "wgmma-q64", "wgmma-q128"],
)
@pytest.mark.parametrize("eager", [False, True], ids=["late-copies", "eager-copies"])
def test_emulated_prefill_concurrent_ctas(tactic: dict[str, Any], schedule: emulate.Schedule, eager: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Several CTAs resident at once, their threads interleaved at every synchronisation point:
    each keeps its own shared memory, barriers, mbarriers (phases, pending cp.async arrivals),
    named and warpgroup barriers and wgmma queues across the switches. Every output element is
    computed by one CTA in a fixed order, so the result is bitwise the one-at-a-time launch's."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    case: dict[str, Any] = {"hq": 4, "hkv": 2, "window": 150, "page": 16, "tactic": tactic, "seed": 14}
    q_lens, kv_lens = [130, 5, 70], [400, 300, 70]
    out, lse = prefill_case(q_lens, kv_lens, **case)
    out2, lse2 = prefill_case(q_lens, kv_lens, schedule=schedule, **case)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{schedule}: not bitwise the one-at-a-time result"


# -- persistent CTAs (kernels/prefill_sm90.cu with TX_PERSIST, tactic param persist 1) ---------

PERSIST_SHAPES = [(128, 128, 8, 2), (128, 64, 8, 3), (64, 128, 4, 3), (64, 64, 4, 2)]


@pytest.mark.exhaustive(sample=3)  # (8 points, about 50 s on 2 cores: a sample per CI run)
@pytest.mark.parametrize("eager", [False, True], ids=["late-copies", "eager-copies"])
@pytest.mark.parametrize("shape", PERSIST_SHAPES, ids=lambda s: "q{}-kv{}-s{}".format(*s[:2], s[3]))
def test_emulated_persistent_ctas_loop_over_items(shape: tuple[int, int, int, int], eager: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Fewer CTAs than items (1, 2 and 3 CTAs: each walks many items, its ring and mbarrier phases
    running on from one item into the next, items with few tiles, many tiles, and none in a row;
    warpgroups without rows in an item keep the protocol), ragged requests, windows, one head
    per CTA and whole GQA groups. Each item is computed as by its own CTA without persist, in
    the same order: the result is bitwise the non-persistent kernel's."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    q_lens, kv_lens = [300, 5, 129, 1, 40], [1100, 700, 129, 900, 40]
    for ctas, pack, window in ((1, 0, -1), (2, 1, -1), (3, 1, 90)):
        case: dict[str, Any] = {"d": 64, "hq": 8, "hkv": 2, "window": window, "page": 16 if window < 0 else 1,
                                "seed": 21}  # fmt: skip
        ref = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, pack=pack), **case)
        got = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, pack=pack, persist=1), persistent=ctas, **case)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (shape, ctas, pack, window)


@pytest.mark.parametrize("pingpong", [0, 1], ids=["plain", "pingpong"])
def test_emulated_persistent_rounds_back_and_forth_with_the_batch_longest_first(pingpong: int) -> None:
    """sched 2 (items longest first over the whole batch) with persistent CTAs compiles TX_SNAKE:
    odd rounds go back from the last CTA, and the partial last round is taken by the CTAs at
    the end in odd rounds. 1..5 CTAs over 9+ items (odd and even round counts, a partial last
    round each way): bitwise the non-persistent kernel's result."""
    shape = (128, 128, 8, 2)
    q_lens, kv_lens = [300, 5, 129, 1, 40, 260], [1100, 700, 129, 900, 40, 260]
    params = prefill.PrefillParams.model_validate(_wgmma(shape, sched=2, persist=1, pingpong=pingpong))
    variant = prefill.prefill_variant("bfloat16", 64, params, "sm_90a")
    assert ("TX_SNAKE", "1") in variant.defines
    case: dict[str, Any] = {"d": 64, "hq": 8, "hkv": 2, "page": 16, "seed": 23}
    ref = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, sched=2, pingpong=pingpong), **case)
    for ctas in (1, 2, 3, 5):
        got = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, sched=2, persist=1, pingpong=pingpong),
                           persistent=ctas, **case)  # fmt: skip
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), ctas


@pytest.mark.parametrize("pingpong", [0, 1], ids=["plain", "pingpong"])
def test_emulated_persistent_turns_from_a_counter(pingpong: int) -> None:
    """sched 3 (TX_DYN): after the first round each persistent CTA takes its next turn from a
    counter in global memory, published to its warps through two shared-memory slots. One CTA,
    5 CTAs resident together and shuffled, held back right after each draw (turns drawn in any
    order) over a CUDA-graph capacity past the work list, and a grid larger than the work list,
    over a batch of short and long items, and a windowed batch: bitwise the non-persistent
    kernel's result every time, and the launch leaves its counters at zero (`emulate.run_prefill`
    checks them)."""
    shape = (128, 128, 8, 2)
    q_lens, kv_lens = [300, 5, 129, 1, 40, 260], [1100, 700, 129, 900, 40, 260]
    params = prefill.PrefillParams.model_validate(_wgmma(shape, sched=3, persist=1, pingpong=pingpong))
    variant = prefill.prefill_variant("bfloat16", 64, params, "sm_90a")
    assert ("TX_DYN", "1") in variant.defines and ("TX_SNAKE", "1") not in variant.defines
    assert params.smem_bytes(64) == prefill.prefill_smem_bytes(64, 128, 128, 2, "wgmma") + prefill.DYN_TURNS_SMEM
    case: dict[str, Any] = {"d": 64, "hq": 8, "hkv": 2, "page": 16, "seed": 29}
    ref = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, sched=2, pingpong=pingpong), **case)
    dyn = _wgmma(shape, sched=3, persist=1, pingpong=pingpong)
    runs = [(1, emulate.SCHEDULES[0], 0), (5, emulate.SCHEDULES[5], 40), (64, emulate.SCHEDULES[4], 0)]
    for ctas, schedule, capacity in runs:
        got = prefill_case(q_lens, kv_lens, tactic=dyn, persistent=ctas, schedule=schedule, capacity=capacity,
                           **case)  # fmt: skip
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (ctas, schedule)
    windowed = {**case, "window": 90, "page": 1}
    ref = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, pingpong=pingpong), **windowed)
    got = prefill_case(q_lens, kv_lens, tactic=dyn, persistent=2, schedule=emulate.SCHEDULES[3], **windowed)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_sched_3_needs_persistent_wgmma_over_a_16_bit_cache() -> None:
    fine = prefill.PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma", persist=1, sched=3)
    assert fine.reasons(128, H200) == [] and fine.dynamic
    for bad, kv_bytes in ((fine.replace(persist=0), 2), (fine, 1)):
        (why,) = bad.reasons(128, H200, kv_bytes=kv_bytes)
        assert "sched 3" in why and "persist 1" in why and "16-bit cache" in why
    assert "sched must be 0, 1, 2 or 3" in fine.replace(sched=4).reasons(128, H200)[0]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_emulated_persistent_every_head_dim_and_features(d: int) -> None:
    """The persistent variant of the default wgmma shape of each head dim (the register split
    differs with d128 and 128-key tiles), non-causal with q longer than kv, soft-cap, fp16, an
    empty request, and a single CTA over everything."""
    base = prefill.default_prefill_params(d, H200)
    tactic = _wgmma((base.q_tile, base.kv_tile, base.warps, base.stages), persist=1)
    prefill_case([150, 0, 1, 64], [700, 3, 333, 64], d=d, hq=4, hkv=2, cap=20.0, layout="NHD", tactic=tactic,
                 persistent=2, seed=d)  # fmt: skip
    prefill_case([40, 0, 1, 30], [3, 5, 1, 17], d=d, dtype=torch.float16, causal=False, window=2, tactic=tactic,
                 persistent=1, seed=d + 1)  # fmt: skip


@pytest.mark.parametrize("shape", [(128, 128, 8, 2), (64, 64, 4, 2)], ids=["q128-kv128", "q64-kv64"])
def test_emulated_persistent_every_diagonal_alignment(shape: tuple[int, int, int, int]) -> None:
    """The diagonal alignment cases of the non-persistent kernel (one request per prefix length
    0..kv_tile + 1), walked by 5 persistent CTAs."""
    kv_tile = shape[1]
    q_lens = [70] * (kv_tile + 2)
    kv_lens = [70 + p for p in range(kv_tile + 2)]
    prefill_case(q_lens, kv_lens, d=64, hq=1, hkv=1, tactic=_wgmma(shape, pack=1, persist=1), persistent=5, seed=13)


@pytest.mark.parametrize("seed", range(3))
def test_emulated_persistent_random_ragged_batches(seed: int) -> None:
    """Random lengths, features and CTA counts (1..7), bitwise against the non-persistent kernel."""
    gen = torch.Generator().manual_seed(300 + seed)
    n = int(torch.randint(2, 7, (1,), generator=gen))
    q_lens = torch.randint(1, 200, (n,), generator=gen).tolist()
    prefix = torch.randint(0, 300, (n,), generator=gen).tolist()
    causal = seed != 1
    kv_lens = [q + p for q, p in zip(q_lens, prefix, strict=True)] if causal else [p + 1 for p in prefix]
    ctas = int(torch.randint(1, 8, (1,), generator=gen))
    shape = PERSIST_SHAPES[seed % len(PERSIST_SHAPES)]
    case: dict[str, Any] = {"causal": causal, "window": [-1, 33, 100][seed], "cap": [0.0, 0.0, 15.0][seed],
                            "hq": 8, "hkv": 2, "page": [1, 16, 128][seed], "seed": seed}  # fmt: skip
    ref = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape), **case)
    got = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, persist=1), persistent=ctas, **case)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (q_lens, kv_lens, ctas)


@pytest.mark.parametrize(
    "schedule",
    [emulate.Schedule("grid", resident=2), emulate.Schedule("shuffled", resident=4, seed=5)],
    ids=["two-resident", "shuffled-four-resident"],
)
@pytest.mark.parametrize("shape", [(128, 128, 8, 2), (64, 64, 4, 2)], ids=["q128-kv128", "q64-kv64"])
@pytest.mark.parametrize("eager", [False, True], ids=["late-copies", "eager-copies"])
def test_emulated_persistent_concurrent_ctas_and_graph_capacity(shape: tuple[int, int, int, int],
                                                                schedule: emulate.Schedule, eager: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Persistent CTAs resident together (interleaved at every synchronisation point), and the
    CUDA-graph sizing: the grid from an item capacity larger than the batch (the padding records
    past the real count are never read: each CTA's loop ends at the real count). Bitwise the
    one-at-a-time non-persistent result."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    case: dict[str, Any] = {"hq": 4, "hkv": 2, "window": 150, "page": 16, "seed": 14}
    q_lens, kv_lens = [130, 5, 70, 1], [400, 300, 70, 20]
    out, lse = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape), **case)
    for ctas, capacity in ((3, 0), (4, 64), (1000, 64)):  # 1000: more CTAs than items x head groups
        got = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, persist=1), schedule=schedule, persistent=ctas,
                           capacity=capacity, **case)  # fmt: skip
        assert torch.equal(out, got[0]) and torch.equal(lse, got[1]), f"{schedule} ctas {ctas} capacity {capacity}"


# -- the consumer warpgroups' ping-pong (TX_PINGPONG, tactic param pingpong 1) -----------------

PINGPONG_SHAPES = [(128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3)]


@pytest.mark.exhaustive(sample=4)  # (12 points, about 70 s on 2 cores: a sample per CI run)
@pytest.mark.parametrize("persist", [0, 1], ids=["one-cta-per-item", "persistent"])
@pytest.mark.parametrize("eager", [False, True], ids=["late-copies", "eager-copies"])
@pytest.mark.parametrize("shape", PINGPONG_SHAPES, ids=lambda s: "q{}-kv{}-s{}".format(*s[:2], s[3]))
def test_emulated_pingpong_matches_the_plain_kernel(shape: tuple[int, int, int, int], eager: bool, persist: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The warpgroups take turns (named barriers: bar.sync on its own, bar.arrive on the other's),
    each issuing S of a tile with P V of the previous one: long key ranges (both mbarrier
    parities), one head per CTA (one warpgroup's rows end a tile before the other's: it masks a
    tile whole instead of skipping it), windows, short requests (a warpgroup idle: no turns
    without TX_PERSIST; with it both keep turning). Bitwise the plain kernel's result: a tile
    masked whole adds exact zeros."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    q_lens, kv_lens = [300, 5, 129, 1, 40], [1100, 700, 129, 900, 40]
    for pack, window in ((0, -1), (1, -1), (1, 90)):
        case: dict[str, Any] = {"d": 64, "hq": 8, "hkv": 2, "window": window, "page": 16 if window < 0 else 1,
                                "seed": 31, "persistent": 3 if persist else 0}  # fmt: skip
        ref = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, pack=pack), **case)
        got = prefill_case(q_lens, kv_lens, tactic=_wgmma(shape, pack=pack, pingpong=1, persist=persist), **case)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (shape, pack, window)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("persist", [0, 1], ids=["one-cta-per-item", "persistent"])
def test_emulated_pingpong_every_head_dim_and_diagonal(d: int, persist: int) -> None:
    """Ping-pong for the default shape of every head dim (soft-cap, fp16, non-causal with q longer
    than kv, an empty request), and the diagonal alignment cases (one request per prefix length
    0..kv_tile + 1) at d64."""
    base = prefill.default_prefill_params(d, H200)
    tactic = _wgmma((base.q_tile, base.kv_tile, base.warps, base.stages), pingpong=1, persist=persist)
    n = 2 if persist else 0
    prefill_case([150, 0, 1, 64], [700, 3, 333, 64], d=d, hq=4, hkv=2, cap=20.0, layout="NHD", tactic=tactic,
                 persistent=n, seed=d)  # fmt: skip
    prefill_case([40, 0, 1, 30], [3, 5, 1, 17], d=d, dtype=torch.float16, causal=False, window=2, tactic=tactic,
                 persistent=n, seed=d + 1)  # fmt: skip
    if d == 64:
        kv_tile = base.kv_tile
        q_lens, kv_lens = [70] * (kv_tile + 2), [70 + p for p in range(kv_tile + 2)]
        prefill_case(q_lens, kv_lens, d=64, hq=1, hkv=1, tactic={**tactic, "pack": 1}, persistent=5 if persist else 0,
                     seed=13)  # fmt: skip


@pytest.mark.parametrize(
    "schedule",
    [emulate.Schedule("grid", resident=2), emulate.Schedule("shuffled", resident=4, seed=7)],
    ids=["two-resident", "shuffled-four-resident"],
)
@pytest.mark.parametrize("persist", [0, 1], ids=["one-cta-per-item", "persistent"])
def test_emulated_pingpong_concurrent_ctas(schedule: emulate.Schedule, persist: int) -> None:
    """Ping-pong CTAs resident together: each CTA's named barriers (turns) are its own."""
    case: dict[str, Any] = {"hq": 4, "hkv": 2, "window": 150, "page": 16, "seed": 14}
    q_lens, kv_lens = [130, 5, 70, 1], [400, 300, 70, 20]
    out, lse = prefill_case(q_lens, kv_lens, tactic=_wgmma((128, 128, 8, 2)), **case)
    got = prefill_case(q_lens, kv_lens, tactic=_wgmma((128, 128, 8, 2), pingpong=1, persist=persist),
                       schedule=schedule, persistent=3 if persist else 0, capacity=32 if persist else 0,
                       **case)  # fmt: skip
    assert torch.equal(out, got[0]) and torch.equal(lse, got[1]), f"{schedule} persist {persist}"


# -- the wgmma kernel without its options (one kernel serves every combination) ---------------

PLAIN_WGMMA_CASES = [
    pytest.param(d, shape, id="d{}-q{}-kv{}-s{}".format(d, *shape[:2], shape[3]))
    for d, shape in ((128, (128, 128, 8, 3)), (256, (128, 64, 8, 2)), (64, (64, 64, 4, 2)), (64, (128, 128, 8, 2)))
]


@pytest.mark.parametrize(("d", "shape"), PLAIN_WGMMA_CASES)
def test_emulated_wgmma_without_options_matches_the_oracle(d: int, shape: tuple[int, int, int, int]) -> None:
    """A wgmma tactic without persist and pingpong runs the one kernel with both options off (the
    d128 default's tile shape without the ping-pong, the d256 default, one consumer warpgroup),
    with a window and one head per CTA too; a second copy of the kernel once kept for this case
    was measured on the H200 no faster (benchmarks/results/h200-prefill-kernel-ab.json)."""
    params = prefill.PrefillParams.model_validate(_wgmma(shape))
    assert "TX_PERSIST" not in dict(prefill.prefill_variant("bfloat16", d, params, "sm_90a").defines)
    case: dict[str, Any] = {"d": d, "hq": 4, "hkv": 2, "seed": 41 + d}
    windowed = {"window": 70, "page": 1, "tactic": _wgmma(shape, pack=1)}
    for q_lens, kv_lens, extra in (([200, 1, 64], [700, 333, 64], {}), ([90, 7], [300, 40], windowed)):
        prefill_case(q_lens, kv_lens, **{"tactic": _wgmma(shape), **case, **extra})  # held to the oracle


# -- the Hopper skinny GEMM (kernels/gemm_sm90.cu) -------------------------------------------


def _gemm_check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Every element within the output dtype's rounding of the float64 oracle (plus a little of the
    result's scale for the fp32 sums): a lost k chunk, a wrong fragment or an unwritten element
    each show in single elements, which a norm-wise error could average away."""
    assert bool(torch.isfinite(out).all()), f"{what}: unwritten or NaN output"
    diff = (out.to(torch.float64) - ref).abs()
    bound = ref.abs() * 2.0**-7 + ref.pow(2).mean().sqrt() * 2.0**-9
    worst = int(torch.argmax(diff - bound))
    got, want = out.flatten()[worst].item(), ref.flatten()[worst].item()
    assert bool((diff <= bound).all()), f"{what}: element {worst} (of {ref.numel()}) is {got}, oracle {want}"


def _gemm_run(m: int, n: int, k: int, params: tuple[int, ...] | None, *, dtype: torch.dtype = torch.bfloat16,
              bias: bool = False, batch: int = 1, offset: int = 0, seed: int = 0,
              schedule: emulate.Schedule = emulate.SCHEDULES[0]) -> tuple[torch.Tensor, emulate.GemmPlan]:  # fmt: skip
    """One emulated launch as the plan makes it: ``out`` a contiguous [batch,] m x n view ``offset``
    elements into a NaN buffer whose rest must stay NaN; checked against the float64 oracle."""
    gen = torch.Generator().manual_seed(seed)
    lead = (batch,) if batch > 1 else ()
    a = torch.randn(*lead, m, k, generator=gen).to(dtype)
    w = (torch.randn(*lead, n, k, generator=gen) / math.sqrt(k)).to(dtype)
    b = w.transpose(-1, -2)  # the k-major [k, n] view of the nn.Linear weight
    bias_t = torch.randn(n, generator=gen).to(dtype) if bias else None
    name = str(dtype).removeprefix("torch.")
    problem = tactix.GemmProblem(device_type="cuda", m=m, n=n, k=k, batch=batch, batched=batch > 1, a_dtype=name,
                                 b_dtype=name, out_dtype=name, bias_dtype=name if bias else None)  # fmt: skip
    default = gemm.default_gemm_params(m, H200)
    assert isinstance(default, gemm.GemmWgmmaParams)
    fields = gemm.GemmWgmmaParams.model_fields  # (bw, bk, stages, splits, tma)
    chosen = default if params is None else gemm.GemmWgmmaParams(**dict(zip(fields, params, strict=False)))
    tactic = chosen.to_tactic()
    assert plugin._reasons(problem, tactic, H200) == [], tactic
    plan = emulate.GemmPlan(problem, tactic)
    size = batch * m * n
    buf = torch.full((offset + size + 64,), float("nan"), dtype=dtype)
    out = buf[offset : offset + size].view(*lead, m, n)
    plan.run(a, b, out, bias_t, schedule)
    ref = gemm_reference(a, b, bias=bias_t)
    what = f"m{m} n{n} k{k} batch {batch} {tactic} splits {plan.splits} offset {offset} {schedule}"
    _gemm_check(out, ref, what)
    assert bool(buf[:offset].isnan().all()) and bool(buf[offset + size :].isnan().all()), f"{what}: wrote outside out"
    return out, plan


GEMM_CASES = [
    # m, n, k, (bw, bk, stages, splits[, tma]) or None (the default), dtype, bias, batch, out offset
    (64, 256, 1024, None, torch.bfloat16, True, 1, 0),  # the default: its auto splits (a cluster of 4 here)
    (64, 256, 512, (64, 64, 4, 4), torch.bfloat16, False, 1, 0),
    (1, 200, 264, (64, 64, 4, 2), torch.bfloat16, True, 1, 0),  # a ragged column block, a k tail
    (37, 201, 136, (128, 64, 3, 8), torch.float16, True, 1, 1),  # odd n, out 2-byte aligned, splits with no k
    (16, 64, 1024, (64, 128, 3, 2), torch.bfloat16, True, 3, 0),  # batched (a cluster per batch entry)
    (24, 300, 8, None, torch.float16, False, 1, 0),  # one 16-byte chunk of k
    (64, 130, 704, (128, 64, 6, 1), torch.bfloat16, True, 2, 2),  # one split: out from registers, n % 4 != 0
    (33, 520, 2048, (256, 64, 3, 4), torch.bfloat16, False, 1, 0),  # the widest tile (m64n256k16)
    # operands through tensor maps (tma 1: W, 2: W and a): boxes past n, m and k read as zeros
    (1, 200, 264, (64, 64, 4, 2, 1), torch.bfloat16, True, 1, 0),  # a ragged column block, a k tail
    (37, 201, 136, (64, 128, 3, 8, 2), torch.float16, True, 1, 1),  # splits with no k, a box past k
    (16, 64, 1024, (64, 128, 3, 2, 2), torch.bfloat16, True, 3, 0),  # batched: the maps' third dimension
    (64, 130, 704, (128, 64, 4, 1, 2), torch.bfloat16, False, 2, 2),  # one split, 128-row boxes of W
    (24, 300, 8, (64, 64, 3, 0, 1), torch.float16, False, 1, 0),  # one 16-byte chunk of k
]


@pytest.mark.parametrize("eager", [False, True], ids=["copies-late", "copies-early"])
@pytest.mark.parametrize(("m", "n", "k", "params", "dtype", "bias", "batch", "offset"), GEMM_CASES)
def test_emulated_wgmma_gemm_matches_oracle(m: int, n: int, k: int, params: tuple[int, ...] | None,
                                           dtype: torch.dtype, bias: bool, batch: int, offset: int, eager: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """kernels/gemm_sm90.cu as the plan launches it: every element of ``out`` matches the float64
    oracle and nothing outside it is written (column blocks past n, rows past m, k tails and k
    splits that get no k, out not 4-byte aligned, batches, both dtypes). Copies land as late as the
    hardware allows (a tile read before its copies shows) and as early (a stage refilled while a
    wgmma still reads it shows)."""
    monkeypatch.setenv("TXE_EAGER_COPIES", "1" if eager else "0")
    _gemm_run(m, n, k, params, dtype=dtype, bias=bias, batch=batch, offset=offset, seed=m + n + k)


def test_emulated_wgmma_gemm_clusters_give_the_same_bits_under_every_schedule() -> None:
    """The k splits of a column block are one cluster that adds its partial tiles up in rank order
    through distributed shared memory: whichever CTAs run first, interleave or wait, the output is
    bitwise the same, and no CTA reads a partial tile its owner has not written or has left (the
    emulation fails a read of an exited CTA's shared memory)."""
    first = None
    for schedule in emulate.SCHEDULES:
        out, plan = _gemm_run(48, 320, 1536, (64, 64, 3, 8), bias=True, schedule=schedule, seed=5)
        assert plan.splits == 8 and plan.grid == (5, 8, 1)
        if first is None:
            first = out.clone()
        else:
            assert torch.equal(out, first), f"{schedule}: not bitwise the same"


GEMM_WGMMA_TACTICS = [p for p in gemm.gemm_tactic_params(40, H200) if isinstance(p, gemm.GemmWgmmaParams)]


def test_the_hopper_gemm_enumerates_a_real_choice_of_tactics() -> None:
    assert len(GEMM_WGMMA_TACTICS) >= 10


@pytest.mark.exhaustive(sample=3)
@pytest.mark.parametrize("p", GEMM_WGMMA_TACTICS, ids=lambda p: str(p.to_tactic()))
def test_emulated_wgmma_gemm_every_enumerated_tactic(p: gemm.GemmWgmmaParams) -> None:
    """Every Hopper GEMM tactic the backend enumerates, on one skinny shape with a bias."""
    _gemm_run(40, 256, 1024, (p.bw, p.bk, p.stages, p.splits, p.tma), bias=True, seed=p.bw + p.stages + p.splits)


# -- merging attention states ------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        MergeCase("bfloat16"),
        MergeCase("float16", empty=True),
        MergeCase("float32", head_dim=64, heads=4),
        MergeCase("bfloat16", form="stacked", num_states=5, empty=True, head_dim=40, rows=9),
        MergeCase("bfloat16", num_states=40, rows=3, heads=2, head_dim=33),  # more states than lanes, an odd dim
        MergeCase("float16", form="in_place", masked=True, empty=True, rows=20),
    ],
    ids=lambda c: c.id,
)
def test_emulated_merge_matches_the_float64_merge(case: MergeCase) -> None:
    """kernels/merge.cu (cuda_native's merge_states) against the float64 merge on the kit's inputs:
    separate tensors (passed by their address difference), stacked views, 40 states (more than a
    warp's lanes), empty states and rows (zeros, -inf), and the in-place form with a mask (rows
    it leaves out untouched)."""
    inputs = build_merge_inputs(replace(case, seed=7), CPU)
    ref_v, ref_s = merge_reference(inputs.vs, inputs.ss)
    if case.form == "in_place":
        before_v, before_s = inputs.vs[0].clone(), inputs.ss[0].clone()
        out_v, out_s = inputs.vs[0], inputs.ss[0]
    else:
        out_v = torch.full_like(inputs.vs[0], float("nan"))
        out_s = torch.full(inputs.ss[0].shape, float("nan"))
    emulate.merge_states(inputs.vs, inputs.ss, out_v, out_s, inputs.mask)
    empty = torch.isneginf(ref_s)  # rows of states all over no key (where the merge wrote them)
    if inputs.mask is not None:
        empty &= inputs.mask[:, None]
        keep = ~inputs.mask
        assert torch.equal(out_v[keep], before_v[keep]) and torch.equal(out_s[keep], before_s[keep])
        ref_v = torch.where(keep[:, None, None], before_v.double(), ref_v)
        ref_s = torch.where(keep[:, None], before_s.double(), ref_s)
    assert relative_error(out_v, ref_v) <= tolerance_for(out_v.dtype)
    assert lse_error(out_s, ref_s) <= 1e-5
    if inputs.mask is None:
        assert bool(empty.any()) == case.empty
    assert not bool(out_v[empty].float().abs().sum())
