"""``tactix bench``: the shape suite of benchmarks/README.md for every backend and for ``auto``,
untuned (what a process without stored tactics plans: `tactix.untuned_order`) and tuned.

Backends that offer direct calls of the library they wrap (``tactix_references``; cuDNN does)
get extra "NAME (direct)" rows: the library called by hand, same inputs, same timer, so the
cost of the unified API is read off one run. Where flashinfer is installed, its own wrappers add
``flashinfer fa2`` / ``tc`` / ``fa3`` anchor rows to every attention case (`tactix.bench_flashinfer`).

Every implementation gets the same inputs (one paged cache, pages in random order), is checked
against the float64 oracle, and is timed by the tuner's timer under one policy (L2 flushed
before each timed call, CUDA-event medians, CUDA-graph replay where the plan captures). Decode
is reported in TB/s (bytes of K and V actually read, plus q and out), prefill and GEMM in
TFLOP/s (4·h·d per attended (q, k) pair; 2·m·n·k), each with its ratio to the best row of the
case. Each row also gets the host time of a re-plan and of an eager ``run()``, and its eager cost,
the longer of its device and ``run()`` host times (`eager_cost`); with ``--execution eager`` the
rows are timed eagerly and ranked by that cost. A quick CPU suite runs the same code on small
shapes.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import tempfile
import textwrap
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import torch

import tactix
from tactix import bench_flashinfer, untuned_order
from tactix.attention import PagedDecode, PagedPrefill, attention_problem
from tactix.autotune.context import autotune
from tactix.autotune.policy import MeasurementPolicy
from tactix.autotune.timing import host_us, interleaved, interleaved_rounds, measure_with_policy
from tactix.dtypes import to_torch_dtype
from tactix.errors import TactixError
from tactix.gemm import Gemm, gemm_problem
from tactix.ragged import RaggedPrefill, ragged_problem
from tactix.registry import get_registry
from tactix.testing.oracle import (
    attention_reference,
    attention_tolerance,
    gemm_reference,
    ragged_reference,
    relative_error,
    tolerance_for,
)

__all__ = ["SUITES", "BenchCase", "BenchRow", "run_bench", "select_cases", "suite"]

SUITES = ("gpu", "cpu")


@dataclass(frozen=True)
class BenchCase:
    id: str
    op: str  # prefill | decode | ragged_prefill | gemm
    description: str
    kv_lens: tuple[int, ...] = ()
    q_lens: tuple[int, ...] = ()
    m: int = 0
    n: int = 0
    k: int = 0
    fp8: bool = False
    heads: tuple[int, int] = (32, 8)
    head_dim: int = 128
    page_size: int = 16
    kv_dtype: str = ""  # attention: the cache's dtype when not the query's (an fp8 cache, with scales)
    head_dim_vo: int = 0  # attention: the values' head dim when not head_dim (DeepSeek's 192/128)
    window_left: int = -1  # attention: a sliding window (gpt-oss's alternate layers: 128)
    sinks: bool = False  # attention: a sink logit per query head (gpt-oss), passed to run()

    @property
    def dim_vo(self) -> int:
        return self.head_dim_vo or self.head_dim

    @property
    def q_len_per_req(self) -> int:
        """Decode: rows per request (``q_lens``, uniform; more than one is a multi-token decode step)."""
        return self.q_lens[0] if self.op == "decode" and self.q_lens else 1


FP8_KV_SCALES: Final = (0.25, 0.5)
"""``(k_scale, v_scale)`` of the fp8-KV cases: the cache holds ``k / k_scale`` (and ``v / v_scale``)
in e4m3, and the run passes the scales as device tensors (as an engine that captures graphs does)."""


def _fp8_kv(case: BenchCase, kv_dtype: str = "float8_e4m3fn") -> BenchCase:
    """The fp8-KV variant of an attention case (id ``<id>-fp8``)."""
    return replace(case, id=f"{case.id}-fp8", description=f"{case.description}, e4m3 KV", kv_dtype=kv_dtype)


@dataclass
class BenchRow:
    case: str
    description: str
    implementation: str
    tactic: str
    status: str  # ok | wrong | failed | unsupported
    time_us: float | None = None
    rate: float | None = None
    unit: str = ""
    ratio_to_best: float | None = None
    error: float | None = None
    timed_as: str | None = None
    detail: str = ""  # the whole message: the Markdown table shortens it, the JSON keeps it
    reasons: list[str] = field(default_factory=list)  # unsupported: each reason the backend gave
    samples_us: list[float] = field(default_factory=list)  # what time_us is the median of, in the order taken
    blocks: int | None = None  # first round: blocks timed until the times settled (MeasurementPolicy.settle_blocks)
    rounds: int = 0  # interleaved rounds over the case's rows pooled in time_us (0: the first round's time)
    retime: Any = field(default=None, repr=False, compare=False)  # the timed call, until the interleaved rounds
    plan_host_us: float | None = None  # host time of a re-plan for new lengths (`host_us`; no device sync)
    run_host_us: float | None = None  # host time of an eager run() (`host_us`; enqueue only, no device sync)
    eager_us: float | None = None  # max(time_us, run_host_us): a call's cost to an eager caller (`eager_cost`)
    op: str = ""  # the case's op and its shape class (`tactix.untuned_order`)
    shape_class: str = ""


def _other_lengths(case: BenchCase, last: torch.Tensor) -> torch.Tensor:
    """``last`` with the first request one key longer (or shorter, when its last page is full):
    a batch of new lengths in the same shape bucket, as the next serving step plans (unchanged
    where neither is a valid batch)."""
    other = last.clone()
    n, q_len = int(other[0]), case.q_lens[0] if case.q_lens else 1
    if n < case.page_size:
        other[0] = n + 1
    elif n > 1 and case.kv_lens[0] - 1 >= q_len:
        other[0] = n - 1
    return other


def _randint(low: int, high: int, count: int, seed: int) -> tuple[int, ...]:
    """What ``torch.manual_seed(seed); torch.randint(...)`` gives, leaving torch's global generator alone."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(low, high, (count,), generator=gen))


def suite(name: str) -> list[BenchCase]:
    """``gpu``: the standard suite (benchmarks/README.md); ``cpu``: small shapes of the same kinds."""
    if name not in SUITES:
        raise tactix.InvalidArgumentError("suite", f"one of {', '.join(map(repr, SUITES))}", repr(name))
    if name == "cpu":
        return [
            BenchCase(
                "d1", "decode", "decode b8, kv 64-512", kv_lens=_randint(64, 512, 8, 0), heads=(8, 2), head_dim=64
            ),
            BenchCase("d2", "decode", "decode b1, kv 1024", kv_lens=(1024,), heads=(8, 2), head_dim=64),
            BenchCase(
                "p1",
                "prefill",
                "prefill 4x128 causal",
                kv_lens=(128,) * 4,
                q_lens=(128,) * 4,
                heads=(8, 2),
                head_dim=64,
            ),
            BenchCase(
                "p4",
                "prefill",
                "chunked 4x32 over 256",
                kv_lens=(288,) * 4,
                q_lens=(32,) * 4,
                heads=(8, 2),
                head_dim=64,
            ),
            _fp8_kv(
                BenchCase(
                    "d1", "decode", "decode b8, kv 64-512", kv_lens=_randint(64, 512, 8, 0), heads=(8, 2), head_dim=64
                )
            ),
            BenchCase(
                "v1",
                "decode",
                "verify b8 x 4 rows, kv 64-512",
                kv_lens=_randint(64, 512, 8, 0),
                q_lens=(4,) * 8,
                heads=(8, 2),
                head_dim=64,
            ),
            BenchCase(
                "r1",
                "ragged_prefill",
                "ragged 4x64 over 128, 192/128 causal",
                kv_lens=(192,) * 4,
                q_lens=(64,) * 4,
                heads=(4, 4),
                head_dim=192,
                head_dim_vo=128,
            ),
            BenchCase(
                "o1",
                "decode",
                "decode b8, kv 64-512, sinks, window 32",
                kv_lens=_randint(64, 512, 8, 0),
                heads=(8, 2),
                head_dim=64,
                sinks=True,
                window_left=32,
            ),
            BenchCase("g1", "gemm", "gemm f32 256^3", m=256, n=256, k=256),
            BenchCase("g2", "gemm", "gemm f32 m=1, n=k=1024", m=1, n=1024, k=1024),
        ]
    p3 = _randint(64, 2048, 16, 3)
    d1 = BenchCase("D1", "decode", "decode b64, kv 1k-8k", kv_lens=_randint(1024, 8192, 64, 0))
    d2 = BenchCase("D2", "decode", "decode b1, kv 8192", kv_lens=(8192,))
    d3 = BenchCase("D3", "decode", "decode b256, kv 2048", kv_lens=(2048,) * 256)
    p1 = BenchCase("P1", "prefill", "prefill 8x2048 causal", kv_lens=(2048,) * 8, q_lens=(2048,) * 8)
    p3_case = BenchCase("P3", "prefill", "prefill ragged 16 req causal", kv_lens=p3, q_lens=p3)
    return [
        d1,
        d2,
        d3,
        p1,
        BenchCase("P2", "prefill", "prefill 1x8192 causal", kv_lens=(8192,), q_lens=(8192,)),
        p3_case,
        BenchCase("P4", "prefill", "chunked 512 over 4096", kv_lens=(4608,) * 8, q_lens=(512,) * 8),
        *[_fp8_kv(c) for c in (d1, d2, d3, p1, p3_case)],
        BenchCase(
            "V1", "decode", "verify b64 x 4 rows, kv 1k-8k", kv_lens=_randint(1024, 8192, 64, 0), q_lens=(4,) * 64
        ),  # speculative decoding's verify step (multi-token decode)
        # DeepSeek-style prefill (MLA's expanded prefill: head_dim_qk 192, head_dim_vo 128, 16 heads),
        # keys and values packed per request; a chunked prefill's new tokens over their prefix
        BenchCase(
            "R1",
            "ragged_prefill",
            "DeepSeek ragged 4x1024, 192/128, 16 heads",
            kv_lens=(1024,) * 4,
            q_lens=(1024,) * 4,
            heads=(16, 16),
            head_dim=192,
            head_dim_vo=128,
        ),
        BenchCase(
            "R2",
            "ragged_prefill",
            "DeepSeek ragged 1x8192, 192/128, 16 heads",
            kv_lens=(8192,),
            q_lens=(8192,),
            heads=(16, 16),
            head_dim=192,
            head_dim_vo=128,
        ),
        BenchCase("R3", "ragged_prefill", "ragged chunk 8x512 over 4096", kv_lens=(4608,) * 8, q_lens=(512,) * 8),
        # gpt-oss decode: 64/8 heads, d64, attention sinks; a window of 128 on alternate layers
        BenchCase(
            "O1",
            "decode",
            "gpt-oss decode b64, kv 1k-8k, sinks",
            kv_lens=_randint(1024, 8192, 64, 0),
            heads=(64, 8),
            head_dim=64,
            sinks=True,
        ),
        BenchCase(
            "O1-w128",
            "decode",
            "gpt-oss decode b64, kv 1k-8k, sinks, window 128",
            kv_lens=_randint(1024, 8192, 64, 0),
            heads=(64, 8),
            head_dim=64,
            sinks=True,
            window_left=128,
        ),
        BenchCase("G1", "gemm", "gemm bf16 8192^3", m=8192, n=8192, k=8192),
        *[BenchCase(f"G2-m{m}", "gemm", f"gemm bf16 m={m}, n=k=4096", m=m, n=4096, k=4096) for m in (1, 16, 64, 256)],
        BenchCase("G3-n14336", "gemm", "gemm bf16 4096x14336x4096", m=4096, n=14336, k=4096),
        BenchCase("G3-k14336", "gemm", "gemm bf16 4096x4096x14336", m=4096, n=4096, k=14336),
        BenchCase("G4", "gemm", "gemm fp8 e4m3 4096^3, bf16 out", m=4096, n=4096, k=4096, fp8=True),
    ]


@dataclass
class _Attention:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    # the run extras run() receives, on the device: k_scale and v_scale (fp8 caches), sinks
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # the page indices as every implementation's plan receives them: on the device, as an engine
    # keeps its page table (its CSR offsets and last-page lengths stay on the host)
    kv_indices_device: torch.Tensor | None = None

    def scale_values(self) -> tuple[float, float]:
        """``(k_scale, v_scale)`` as floats (1.0 without scales)."""
        if "k_scale" not in self.extras:
            return 1.0, 1.0
        return float(self.extras["k_scale"]), float(self.extras["v_scale"])


def select_cases(suite_name: str, ids: list[str] | None, argument: str = "cases") -> list[BenchCase]:
    """The suite's cases whose ids are in ``ids`` (None: all), in suite order; an unknown id is an
    `InvalidArgumentError` naming ``argument`` and listing the suite's ids."""
    cases = suite(suite_name)
    if ids is None:
        return cases
    valid = [c.id for c in cases]
    unknown = [i for i in ids if i not in valid]
    if unknown or not ids:
        given = ", ".join(map(repr, unknown)) if unknown else "no id"
        raise tactix.InvalidArgumentError(argument, f"ids of the {suite_name} suite: {', '.join(valid)}", given)
    return [c for c in cases if c.id in ids]


def _ok_row(case: BenchCase, name: str, tactic: str, timing: Any, work: tuple[float, str], error: float,
            call: Any = None, **extra: Any) -> BenchRow:  # fmt: skip
    """The row of a checked, timed implementation: its median, rate and samples (``extra``: the
    host costs, a detail); ``call`` is what was timed, timed again in the interleaved rounds."""
    amount, unit = work
    return BenchRow(case.id, case.description, name, tactic, "ok", timing.median * 1e6, amount / timing.median / 1e12,
                    unit, error=error, timed_as=timing.timed_as, samples_us=[x * 1e6 for x in timing.samples],
                    blocks=timing.blocks, retime=call, **extra)  # fmt: skip


def eager_cost(time_us: float | None, run_host_us: float | None) -> float | None:
    """What one call costs a caller that enqueues calls back to back without a CUDA graph: the
    longer of its device time and its ``run()`` host time (`tactix.untuned_order` ranks by it)."""
    if time_us is None:
        return None
    return max(time_us, run_host_us or 0.0)


def _rank(rows: list[BenchRow], eager: bool) -> None:
    """Each row's ratio to the case's best, and the rows best first: by rate (work per device
    time), or with ``eager`` (``--execution eager``) by `eager_cost`, host time included."""
    if eager:
        cheapest = min((r.eager_us for r in rows if r.status == "ok" and r.eager_us), default=None)
        for r in rows:
            if r.status == "ok" and r.eager_us and cheapest:
                r.ratio_to_best = cheapest / r.eager_us
        rows.sort(key=lambda r: r.eager_us if r.status == "ok" and r.eager_us else math.inf)
        return
    best = max((r.rate for r in rows if r.status == "ok" and r.rate), default=None)
    for r in rows:
        if r.rate and best:
            r.ratio_to_best = r.rate / best
    rows.sort(key=lambda r: -(r.rate or 0))


def _interleaved_rounds(rows: list[BenchRow], device: torch.device, policy: MeasurementPolicy,
                        rounds: int | None = None) -> None:  # fmt: skip
    """Time every timed row of a case again against the others (`timing.interleaved`: short
    blocks that alternate between the rows, six rounds on a GPU) and give each row the median of
    all its blocks' samples. The first round times the rows one after another, each from its own
    state of the card (the tuning run before `auto (tuned)`, the torch backend's attention, a
    clock falling as the case heats the card); interleaved, every row sees the same mix, so rows
    compare as their kernels do. A row whose call fails now keeps its first-round time."""
    timed: list[tuple[BenchRow, Any]] = []
    for row in rows:
        call, row.retime = row.retime, None
        if call is not None and row.time_us is not None:
            timed.append((row, call))
    if not timed:
        return
    used = rounds if rounds is not None else interleaved_rounds(device)
    pooled = interleaved([call for _, call in timed], device, policy, used)
    for (row, _call), samples in zip(timed, pooled, strict=True):
        if not samples or row.time_us is None:
            continue
        median_us = statistics.median(samples) * 1e6
        if row.rate:
            row.rate *= row.time_us / median_us
        row.time_us = median_us
        row.samples_us = [x * 1e6 for x in samples]
        row.rounds = used


def _plan_host_us(plan: Any, last: torch.Tensor, other: torch.Tensor, device: torch.device) -> float:
    """`host_us` of ``plan(lengths)`` alternating between ``other`` and ``last`` (a serving step
    planning new lengths each time), then ``plan(last)``: the case's batch is planned again."""
    order = [last, other]

    def replan() -> None:
        order.reverse()
        plan(order[0])

    cost = host_us(replan, device)
    plan(last)
    return cost


def _unsupported(case: BenchCase, name: str, exc: TactixError) -> BenchRow:
    if isinstance(exc, tactix.UnsupportedProblemError):
        return BenchRow(case.id, case.description, name, "-", "unsupported", detail=str(exc), reasons=exc.reasons)
    return BenchRow(case.id, case.description, name, "-", "failed", detail=str(exc))


def _attention_index(case: BenchCase, gen: torch.Generator) -> tuple[list[int], list[int], list[int], list[int]]:
    """A case's batch metadata: ``qo_indptr``, ``kv_indptr`` (pages; rows for a ragged case), the
    page indices (in random order) and the last pages' lengths."""
    page = case.page_size
    pages = [-(-n // page) for n in case.kv_lens]
    order = torch.randperm(sum(pages), generator=gen).tolist()
    indptr, indices = [0], []
    for n in pages:
        indices += [order.pop() for _ in range(n)]
        indptr.append(len(indices))
    last = [(n - 1) % page + 1 for n in case.kv_lens]
    if case.op == "ragged_prefill":  # keys packed per request: kv_indptr counts rows, not pages
        indptr = [0]
        for n in case.kv_lens:
            indptr.append(indptr[-1] + n)
    q_lens = case.q_lens or (1,) * len(case.kv_lens)
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    return qo, indptr, indices, last


def case_problem(case: BenchCase, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The problem a case's plans are made for (on a CUDA device, ``dtype`` queries; no tensor
    data is made): what `tactix.untuned_order` classifies it by."""
    device = torch.device("cuda")
    if case.op == "gemm":
        a = torch.float8_e4m3fn if case.fp8 else dtype
        return gemm_problem(case.m, case.n, case.k, batch=None, a_dtype=a, b_dtype=None,
                            out_dtype=torch.bfloat16 if case.fp8 else None, a_k_major=True, b_k_major=True,
                            bias_dtype=None, device=device)  # fmt: skip
    qo, indptr, indices, last = _attention_index(case, torch.Generator().manual_seed(1))
    i32 = torch.int32
    common: dict[str, Any] = dict(
        device=device, num_qo_heads=case.heads[0], num_kv_heads=case.heads[1], head_dim_qk=case.head_dim,
        head_dim_vo=case.head_dim_vo or None, causal=case.op != "decode" or case.q_len_per_req > 1, sm_scale=None,
        window_left=case.window_left, logits_soft_cap=None, q_data_type=dtype,
        kv_data_type=case.kv_dtype or dtype, o_data_type=None, return_lse=False,
        run_extras=("sinks",) if case.sinks else ())  # fmt: skip
    if case.op == "ragged_prefill":
        ragged, _ = ragged_problem(qo_indptr=torch.tensor(qo, dtype=i32), kv_indptr=torch.tensor(indptr, dtype=i32),
                                   **common)  # fmt: skip
        return ragged
    decode = case.op == "decode"
    problem, _ = attention_problem(case.op, kv_layout="HND", qo_indptr=None if decode else torch.tensor(qo, dtype=i32),
                                   paged_kv_indptr=torch.tensor(indptr, dtype=i32),
                                   paged_kv_indices=torch.tensor(indices, dtype=i32),
                                   paged_kv_last_page_len=torch.tensor(last, dtype=i32), page_size=case.page_size,
                                   q_len_per_req=case.q_len_per_req, **common)  # fmt: skip
    return problem


def _attention_inputs(case: BenchCase, device: torch.device, dtype: torch.dtype) -> _Attention:
    gen = torch.Generator().manual_seed(1)
    qo, indptr, indices, last = _attention_index(case, gen)
    hq, hkv = case.heads
    # HND pages; a ragged case packs its keys and values per request instead, [kv_tokens, heads, d]
    ragged = case.op == "ragged_prefill"
    pages, page = len(indices), case.page_size
    shape = (sum(case.kv_lens), hkv, case.head_dim) if ragged else (pages, hkv, page, case.head_dim)
    v_shape = (*shape[:-1], case.dim_vo)
    extras: dict[str, torch.Tensor] = {}
    if case.kv_dtype:
        kv_dtype = to_torch_dtype(case.kv_dtype)
        k_scale, v_scale = FP8_KV_SCALES
        k = (torch.randn(shape, device=device) / k_scale).to(kv_dtype)
        v = (torch.randn(v_shape, device=device) / v_scale).to(kv_dtype)
        extras = {"k_scale": torch.tensor(k_scale, device=device), "v_scale": torch.tensor(v_scale, device=device)}
    else:
        k = torch.randn(shape, device=device, dtype=dtype)
        v = torch.randn(v_shape, device=device, dtype=dtype)
    if case.sinks:  # about the log-sum-exp of a row's logits: the sinks take a real share
        extras["sinks"] = (torch.rand(hq, generator=gen) * 4 + 4).to(device)
    q = torch.randn(qo[-1], hq, case.head_dim, device=device, dtype=dtype)
    out = torch.empty(qo[-1], hq, case.dim_vo, device=device, dtype=dtype)
    i32 = torch.int32
    host_indices = torch.tensor(indices, dtype=i32)
    return _Attention(
        torch.tensor(qo, dtype=i32),
        torch.tensor(indptr, dtype=i32),
        host_indices,
        torch.tensor(last, dtype=i32),
        q,
        k,
        v,
        out,
        extras,
        host_indices.to(device),
    )


def _attention_work(case: BenchCase, dtype: torch.dtype) -> tuple[float, str]:
    hq, hkv = case.heads
    d = case.head_dim
    size = torch.tensor([], dtype=dtype).element_size()
    kv_size = torch.tensor([], dtype=to_torch_dtype(case.kv_dtype)).element_size() if case.kv_dtype else size
    if case.op == "decode":  # the bytes of K and V actually read (fp8: one per element), q and out
        # (a window reads the last window_left + 1 keys of a row, those of the request's rows together)
        reach = case.window_left + case.q_len_per_req if case.window_left >= 0 else None
        kv_bytes = 2 * sum(min(n, reach or n) for n in case.kv_lens) * hkv * d * kv_size
        return kv_bytes + 2 * len(case.kv_lens) * case.q_len_per_req * hq * d * size, "TB/s"
    pairs = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(case.q_lens, case.kv_lens, strict=True))
    return 2.0 * hq * (d + case.dim_vo) * pairs, "TFLOP/s"  # q.k and p.v: 2 flops per element each


def _measure_attention(
    case: BenchCase,
    inputs: _Attention,
    device: torch.device,
    policy: MeasurementPolicy,
    dtype: torch.dtype,
    backend: str,
    reference: torch.Tensor,
    deterministic: bool,
    name: str | None = None,
) -> BenchRow:
    name = name or backend
    hq, hkv = case.heads
    kw: dict[str, Any] = {"q_data_type": dtype, "deterministic": deterministic,
                          **({"causal": True} if case.op != "decode" else {})}  # fmt: skip
    if case.q_len_per_req > 1:
        kw["q_len_per_req"] = case.q_len_per_req
    if case.kv_dtype:
        kw["kv_data_type"] = to_torch_dtype(case.kv_dtype)
    if case.head_dim_vo:
        kw["head_dim_vo"] = case.head_dim_vo
    if case.window_left >= 0:
        kw["window_left"] = case.window_left
    wrapper: Any
    extras = tuple(inputs.extras)  # what every run passes: auto plans only backends that take it
    if case.op == "ragged_prefill":
        wrapper = RaggedPrefill(backend=backend, device=device, run_extras=extras)
        ragged_indptr = inputs.kv_indptr  # the keys' row offsets

        def plan(last: torch.Tensor) -> None:  # (a ragged batch has no pages: re-planned as it is)
            wrapper.plan(inputs.qo_indptr, ragged_indptr, hq, hkv, case.head_dim, **kw)

        operands: tuple[Any, ...] = (inputs.q, inputs.k, inputs.v)
    else:
        cls = PagedPrefill if case.op == "prefill" else PagedDecode
        wrapper = cls("HND", backend=backend, device=device, run_extras=extras)
        meta = (inputs.kv_indptr, inputs.kv_indices if inputs.kv_indices_device is None else inputs.kv_indices_device)
        args = (inputs.qo_indptr, *meta) if case.op == "prefill" else meta

        def plan(last: torch.Tensor) -> None:
            wrapper.plan(*args, last, hq, hkv, case.head_dim, case.page_size, **kw)

        operands = (inputs.q, (inputs.k, inputs.v))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tactix.FallbackWarning)
            plan(inputs.last)
    except TactixError as exc:
        return _unsupported(case, name, exc)
    inputs.out.fill_(float("nan"))
    try:
        wrapper.run(*operands, out=inputs.out, **inputs.extras)
    except tactix.InvalidArgumentError as exc:  # a backend that does not take a run extra (scales, sinks)
        return BenchRow(case.id, case.description, name, str(wrapper.tactic), "unsupported", detail=str(exc),
                        reasons=[str(exc)])  # fmt: skip
    except TactixError as exc:
        return _unsupported(case, name, exc)
    err = relative_error(inputs.out, reference)
    tactic = str(wrapper.tactic)
    if not err <= attention_tolerance(dtype, case.kv_dtype or dtype, dtype):
        return BenchRow(case.id, case.description, name, tactic, "wrong", error=err, detail="wrong result")

    def call() -> None:
        wrapper.run(*operands, out=inputs.out, **inputs.extras)

    timing = measure_with_policy(call, device, policy)
    plan_host = _plan_host_us(plan, inputs.last, _other_lengths(case, inputs.last), device)
    run_host = host_us(call, device)
    return _ok_row(case, name, tactic, timing, _attention_work(case, dtype), err, call, plan_host_us=plan_host,
                   run_host_us=run_host)  # fmt: skip


def _gemm_inputs(case: BenchCase, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    a = torch.randn(case.m, case.k, device=device)
    w = torch.randn(case.n, case.k, device=device) / math.sqrt(case.k)
    if case.fp8:
        return {
            "a": a.to(torch.float8_e4m3fn),
            "b": (w * 16).to(torch.float8_e4m3fn).t(),
            "scale_a": torch.tensor(1.0, device=device),
            "scale_b": torch.tensor(1 / 16, device=device),
        }
    return {"a": a.to(dtype), "b": w.to(dtype).t()}


def _measure_gemm(
    case: BenchCase,
    inputs: dict[str, Any],
    device: torch.device,
    policy: MeasurementPolicy,
    dtype: torch.dtype,
    backend: str,
    reference: torch.Tensor,
    name: str | None = None,
) -> BenchRow:
    name = name or backend
    g = Gemm(backend=backend, device=device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tactix.FallbackWarning)
            g.plan(case.m, case.n, case.k, a_dtype=inputs["a"].dtype, out_dtype=torch.bfloat16 if case.fp8 else None)
    except TactixError as exc:
        return _unsupported(case, name, exc)
    scales = {k: inputs[k] for k in ("scale_a", "scale_b") if k in inputs}
    out = g.run(inputs["a"], inputs["b"], **scales)
    out_dtype = torch.bfloat16 if case.fp8 else dtype
    err = relative_error(out, reference)
    if not err <= tolerance_for(out_dtype, inputs["a"].dtype):
        return BenchRow(case.id, case.description, name, str(g.tactic), "wrong", error=err, detail="wrong result")

    def call() -> None:
        g.run(inputs["a"], inputs["b"], out=out, **scales)

    timing = measure_with_policy(call, device, policy)
    out_dtype_arg = torch.bfloat16 if case.fp8 else None
    plan_host = host_us(lambda: g.plan(case.m, case.n, case.k, a_dtype=inputs["a"].dtype, out_dtype=out_dtype_arg),
                        device)  # fmt: skip
    run_host = host_us(lambda: g.run(inputs["a"], inputs["b"], out=out, **scales), device)
    return _ok_row(case, name, str(g.tactic), timing, _gemm_work(case, inputs), err, call, plan_host_us=plan_host,
                   run_host_us=run_host)  # fmt: skip


def _measure_references(
    case: BenchCase,
    backend: str,
    inputs: dict[str, Any],
    device: torch.device,
    policy: MeasurementPolicy,
    reference: torch.Tensor,
    tolerance: float,
    work: tuple[float, str],
) -> list[BenchRow]:
    """Rows for the direct library calls a backend offers (``tactix_references``): the fastest correct one."""
    name = f"{backend} (direct)"
    try:
        calls = get_registry().get(backend).references(case.op, inputs)
    except Exception as exc:  # a reference that cannot be set up is reported, not fatal
        return [BenchRow(case.id, case.description, name, "-", "failed", detail=f"{type(exc).__name__}: {exc}")]
    out = inputs["out"]
    timed: list[tuple[str, Any, float]] = []
    problems: list[str] = []
    for label, call in calls:
        try:
            out.fill_(float("nan"))
            call()
            err = relative_error(out, reference)
            if not err <= tolerance:
                problems.append(f"{label}: wrong result ({err:.1e})")
                continue
            timed.append((label, measure_with_policy(call, device, policy), err))
        except Exception as exc:
            problems.append(f"{label}: {type(exc).__name__}: {exc}")
    if not timed:
        if not calls:
            return []
        return [BenchRow(case.id, case.description, name, "-", "failed", detail="; ".join(problems))]
    label, timing, err = min(timed, key=lambda t: t[1].median)
    fastest = next(call for lbl, call in calls if lbl == label)
    run_host = host_us(fastest, device)
    variants = ", ".join(f"{lbl} {t.median * 1e6:.1f} us" for lbl, t, _ in sorted(timed, key=lambda t: t[1].median))
    detail = f"fastest of {len(timed)} variants: {variants}" + (f"; {'; '.join(problems)}" if problems else "")
    return [_ok_row(case, name, label, timing, work, err, fastest, detail=detail, run_host_us=run_host)]


def _measure_flashinfer(
    case: BenchCase,
    inputs: dict[str, Any],
    device: torch.device,
    policy: MeasurementPolicy,
    reference: torch.Tensor,
    tolerance: float,
    work: tuple[float, str],
) -> list[BenchRow]:
    """One row per FlashInfer wrapper of the case's op (`tactix.bench_flashinfer`)."""
    try:
        anchors = bench_flashinfer.calls(case.op, inputs)
    except Exception as exc:  # flashinfer imported but could not be set up: one row that says why
        return [BenchRow(case.id, case.description, "flashinfer", "-", "failed", detail=f"{type(exc).__name__}: {exc}")]
    out = inputs["out"]
    rows = []
    for anchor in anchors:
        if not isinstance(anchor, bench_flashinfer.Anchor):
            name, error = anchor
            if isinstance(error, bench_flashinfer.NotServed):
                rows.append(BenchRow(case.id, case.description, name, "-", "unsupported", detail=f"{name}: {error}"))
            else:
                rows.append(BenchRow(case.id, case.description, name, "-", "failed",
                                     detail=f"plan: {type(error).__name__}: {error}"))  # fmt: skip
            continue
        name, call = anchor.name, anchor.run
        try:
            out.fill_(float("nan"))
            call()
            err = relative_error(out, reference)
            if not err <= tolerance:
                rows.append(BenchRow(case.id, case.description, name, "-", "wrong", error=err, detail="wrong result"))
                continue
            timing = measure_with_policy(call, device, policy)
            last = inputs["kv_last_page_len"]
            plan_host = _plan_host_us(anchor.plan, last, _other_lengths(case, last), device)
            run_host = host_us(call, device)
        except Exception as exc:
            rows.append(BenchRow(case.id, case.description, name, "-", "failed",
                                 detail=f"run: {type(exc).__name__}: {exc}"))  # fmt: skip
            continue
        rows.append(_ok_row(case, name, "-", timing, work, err, call, plan_host_us=plan_host, run_host_us=run_host))
    return rows


def _gemm_work(case: BenchCase, inputs: dict[str, Any]) -> tuple[float, str]:
    if case.m <= 64:  # memory-bound: report the bytes of the weight (and activations) moved
        size = inputs["a"].element_size()
        return (case.n * case.k + case.m * case.k) * size + case.m * case.n * 2, "TB/s"
    return 2.0 * case.m * case.n * case.k, "TFLOP/s"


def _bench_case(
    case: BenchCase,
    device: torch.device,
    dtype: torch.dtype,
    names: list[str],
    policy: MeasurementPolicy,
    store: str,
    references: bool,
    anchor_version: str | None,
    untuned: bool,
    tune: bool,
    deterministic: bool,
    progress: Any,
) -> list[BenchRow]:
    """One case's rows: every serving backend, the references, FlashInfer's anchors, untuned and tuned `auto`."""
    if progress:
        progress(f"{case.id}: {case.description}")
    if case.op == "gemm":
        inputs_g = _gemm_inputs(case, device, dtype)
        ref = gemm_reference(
            inputs_g["a"], inputs_g["b"], scale_a=inputs_g.get("scale_a"), scale_b=inputs_g.get("scale_b")
        )

        def measure_one(
            backend: str, name: str | None = None, inputs: Any = inputs_g, ref: torch.Tensor = ref,
            c: BenchCase = case,
        ) -> BenchRow:  # fmt: skip
            return _measure_gemm(c, inputs, device, policy, dtype, backend, ref, name)

        out_dtype = torch.bfloat16 if case.fp8 else dtype
        ref_inputs: dict[str, Any] = {
            "a": inputs_g["a"],
            "b": inputs_g["b"],
            "scale_a": inputs_g.get("scale_a"),
            "scale_b": inputs_g.get("scale_b"),
            "out": torch.empty(case.m, case.n, dtype=out_dtype, device=device),
        }
        tolerance = tolerance_for(out_dtype, inputs_g["a"].dtype)
        work = _gemm_work(case, inputs_g)
    else:
        inputs_a = _attention_inputs(case, device, dtype)
        qo = inputs_a.qo_indptr
        k_scale, v_scale = inputs_a.scale_values()
        masking: dict[str, Any] = {
            "causal": case.op != "decode" or case.q_len_per_req > 1,
            "sm_scale": 1 / math.sqrt(case.head_dim),
            "window_left": case.window_left,
            "k_scale": k_scale,
            "v_scale": v_scale,
            "sinks": inputs_a.extras.get("sinks"),
        }
        a = inputs_a
        if case.op == "ragged_prefill":
            ref, _ = ragged_reference(a.q, a.k, a.v, qo, a.kv_indptr, **masking)
        else:
            ref, _ = attention_reference(a.q, a.k, a.v, qo, a.kv_indptr, a.kv_indices, a.last, kv_layout="HND",
                                         **masking)  # fmt: skip

        def measure_one(
            backend: str, name: str | None = None, inputs: Any = inputs_a, ref: torch.Tensor = ref,
            c: BenchCase = case,
        ) -> BenchRow:  # fmt: skip
            return _measure_attention(c, inputs, device, policy, dtype, backend, ref, deterministic, name)

        ref_inputs = {
            "q": inputs_a.q,
            "k_cache": inputs_a.k,
            "v_cache": inputs_a.v,
            "qo_indptr": inputs_a.qo_indptr,
            "kv_indptr": inputs_a.kv_indptr,
            "kv_indices": inputs_a.kv_indices_device,
            "kv_last_page_len": inputs_a.last,
            "causal": case.op != "decode" or case.q_len_per_req > 1,
            "q_len_per_req": case.q_len_per_req,
            "sm_scale": 1 / math.sqrt(case.head_dim),
            "window_left": case.window_left,
            "out": inputs_a.out,
            **inputs_a.extras,
        }
        tolerance = attention_tolerance(dtype, case.kv_dtype or dtype, dtype)
        work = _attention_work(case, dtype)

    registry = get_registry()
    serving = [n for n in names if registry.get(n).spec.capabilities(case.op) is not None]  # type: ignore[arg-type]
    case_rows = [measure_one(name) for name in serving]
    if references:
        for name in serving:
            case_rows += _measure_references(case, name, ref_inputs, device, policy, ref, tolerance, work)
    if anchor_version and case.op != "gemm":
        case_rows += _measure_flashinfer(case, ref_inputs, device, policy, ref, tolerance, work)
    # untuned `auto`: what a process without stored tactics plans (the untuned order), from a
    # store that has none
    if untuned:
        with autotune(mode="off", cache_dir=tempfile.mkdtemp(prefix="tactix-bench-empty-"), policy=policy):
            case_rows.append(measure_one("auto", "auto (untuned)"))
    if tune:
        with autotune(mode="tune", cache_dir=store, policy=policy):
            case_rows.append(measure_one("auto", "auto (tuned)"))
    _interleaved_rounds(case_rows, device, policy)
    del ref
    problem = case_problem(case, dtype)
    for r in case_rows:
        r.eager_us = eager_cost(r.time_us, r.run_host_us)
        r.op, r.shape_class = problem.op, untuned_order.shape_class(problem)
    _rank(case_rows, policy.execution == "eager")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return case_rows


def run_bench(
    suite_name: str,
    device: torch.device,
    *,
    cases: list[str] | None = None,
    backends: list[str] | None = None,
    tune: bool = True,
    untuned: bool = True,
    references: bool = True,
    flashinfer: bool = True,
    deterministic: bool = False,
    policy: MeasurementPolicy | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Run the suite; returns the JSON-ready report (rows per case, best first).

    Attention is planned with ``deterministic=False`` unless asked otherwise: the suite compares
    speed with the libraries' fastest plans, which need not be run-to-run deterministic.
    ``flashinfer`` adds FlashInfer's own wrappers as anchor rows where flashinfer is installed;
    ``untuned`` an ``auto (untuned)`` row (planned from an empty store), ``tune`` an ``auto (tuned)``.
    """
    policy = policy or MeasurementPolicy(warmup=3, repeat=20)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    chosen = select_cases(suite_name, cases)
    names = backends or [b.name for b in get_registry().active()]
    rows: list[BenchRow] = []
    store = tempfile.mkdtemp(prefix="tactix-bench-store-")
    anchor_version = bench_flashinfer.version(device) if flashinfer else None
    interrupted: str | None = None
    try:
        for case in chosen:
            interrupted = case.id
            rows += _bench_case(case, device, dtype, names, policy, store, references, anchor_version, untuned, tune,
                                deterministic, progress)  # fmt: skip
        interrupted = None
    except KeyboardInterrupt:
        # a stopped run (Ctrl-C, `timeout -s INT`) still reports the cases it finished
        if progress:
            progress(f"interrupted during {interrupted}: the report holds the cases before it")
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "arch": untuned_order.arch_of(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tactix": tactix.__version__,
        "backends": {b.name: b.spec.version for b in get_registry().active()},
        "flashinfer": anchor_version,
        "policy": policy.model_dump(mode="json"),
        "suite": suite_name,
        "deterministic": deterministic,
    }
    if interrupted is not None:
        env["interrupted"] = interrupted
    return {"environment": env, "rows": [{k: v for k, v in asdict(r).items() if k != "retime"} for r in rows]}


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# tactix bench: {env['suite']} suite on {env['device']}",
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}), tactix {env['tactix']}, backends "
        + ", ".join(f"{k} {v}" for k, v in env["backends"].items())
        + (f"; anchors: flashinfer {env['flashinfer']}" if env.get("flashinfer") else "")
        + f". Policy: {env['policy']}."
        + (f" **Interrupted during {env['interrupted']}**: the cases before it." if env.get("interrupted") else ""),
        "",
        "| case | shape | implementation | tactic | time (us) | rate | vs best | plan host (us) | run host (us) "
        "| eager (us) | rel. error | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        time_s = f"{r['time_us']:,.1f}" if r["time_us"] else "-"
        rate = f"{r['rate']:.3g} {r['unit']}" if r["rate"] else "-"
        ratio = f"{r['ratio_to_best']:.2f}" if r["ratio_to_best"] else "-"
        err = f"{r['error']:.1e}" if r["error"] is not None else "-"
        plan_host = f"{r['plan_host_us']:,.1f}" if r.get("plan_host_us") else "-"
        run_host = f"{r['run_host_us']:,.1f}" if r.get("run_host_us") else "-"
        eager = f"{r['eager_us']:,.1f}" if r.get("eager_us") else "-"
        why = "; ".join(r.get("reasons") or []) or r["detail"]
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {_cell(why, 100)}"
        lines.append(
            f"| {r['case']} | {r['description']} | {r['implementation']} | `{r['tactic']}` | {time_s} | "
            f"{rate} | {ratio} | {plan_host} | {run_host} | {eager} | {err} | {status} |"
        )
    return "\n".join(lines) + "\n"


def _cell(text: str, width: int) -> str:
    """``text`` for a Markdown table cell: cut at a word boundary (marked with an ellipsis), no
    ``|`` (it would end the cell)."""
    return textwrap.shorten(text.replace("|", "/"), width, placeholder=" …")


def chart(report: dict[str, Any], path: str) -> bool:
    """A bar chart of each case's ratio to its best row (needs matplotlib; returns False without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["rows"] if r["ratio_to_best"]]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, len(cases) * 0.9), 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        values = [
            next((r["ratio_to_best"] for r in rows if r["case"] == c and r["implementation"] == impl), 0) for c in cases
        ]
        ax.bar([x + i * width for x in range(len(cases))], values, width, label=impl)
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(cases))], cases, rotation=45, ha="right")
    ax.set_ylabel("rate / best rate of the case")
    ax.set_title(f"tactix bench on {report['environment']['device']}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(report: dict[str, Any], json_path: str | None, md_path: str | None, png_path: str | None) -> None:
    """The report's files (``tactix bench --json PATH --markdown PATH --png PATH``)."""
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    if md_path:
        Path(md_path).write_text(markdown(report))
    if png_path and not chart(report, png_path):
        warnings.warn("matplotlib is not installed: no chart written (pip install 'tactix[bench]')", stacklevel=2)
