"""The conformance kit's tests. Run them against a backend with

    pytest --pyargs tactix.testing.suite --tactix-backend=NAME      (or: tactix conformance NAME)

Each case goes through the public API with ``backend=NAME`` and is compared with the float64
oracle. A case the backend does not claim (its capabilities or its ``check`` refuse it) is
skipped with that reason; a claimed case must pass: run on the claimed path (a fallback warning
fails it), write every output element (outputs are poisoned with NaN first), stay within the
tolerance, give bit-identical output when repeated, stay right with new data under the same
plan, refuse bad input (out-of-range pages or keys, mistyped tensors, an empty batch) with a
`TactixError`, and on a GPU make no host sync in ``run()`` and replay inside a CUDA graph.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch

from tactix.attention import attention_problem
from tactix.batch import Batch
from tactix.errors import FallbackWarning, InvalidArgumentError, TactixError
from tactix.gemm import Gemm, gemm_problem
from tactix.ops import OPS, AnyProblem, GemmProblem
from tactix.problems import make_problem
from tactix.ragged import ragged_problem
from tactix.registry import Backend
from tactix.tactics import Tactic
from tactix.testing.cases import (
    AttentionCase,
    AttentionInputs,
    GemmCase,
    GemmInputs,
    MergeCase,
    RaggedCase,
    RaggedInputs,
    build_attention_inputs,
    build_gemm_inputs,
    build_merge_inputs,
    build_ragged_inputs,
)
from tactix.testing.oracle import (
    LSE_TOLERANCE,
    attention_lse_tolerance,
    attention_reference,
    attention_tolerance,
    gemm_reference,
    lse_error,
    merge_reference,
    ragged_reference,
    relative_error,
    tolerance_for,
)
from tactix.testing.plugin import kit_device

SAMPLED_TACTICS = 3


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    return kit_device(request.config)


@pytest.fixture
def all_tactics(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--tactix-all-tactics"))


@contextmanager
def claimed_path() -> Iterator[None]:
    """A fallback during a claimed case means the kit would test some other code: fail it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        yield


def _require(backend: Backend | None) -> Backend:
    if backend is None:
        pytest.skip("pass --tactix-backend=NAME to run the conformance kit")
    return backend


# -- attention -------------------------------------------------------------------------------
#
# Every attention op's cases (paged prefill and decode: `AttentionCase`; ragged-KV prefill:
# `RaggedCase`) go through the same tests; what differs (the inputs, the problem, the oracle) is
# told apart here and in the inputs' own methods.

Case = AttentionCase | RaggedCase
Inputs = AttentionInputs | RaggedInputs


def _inputs(case: Case, device: torch.device) -> Any:
    return build_ragged_inputs(case, device) if isinstance(case, RaggedCase) else build_attention_inputs(case, device)


def _problem(case: Any, inputs: Any, device: torch.device) -> tuple[AnyProblem, Batch]:
    """The problem and batch the case's wrapper (`_wrapper`: declaring the case's run extras) plans."""
    kwargs = case.plan_kwargs()
    if isinstance(case, RaggedCase):
        return ragged_problem(device=device, qo_indptr=inputs.qo_indptr, kv_indptr=inputs.kv_indptr, sm_scale=None,
                              run_extras=case.run_extras, **kwargs)  # fmt: skip
    return attention_problem(
        case.op,
        device=device,
        kv_layout=case.kv_layout,
        qo_indptr=inputs.qo_indptr if case.ragged else None,
        paged_kv_indptr=inputs.kv_indptr,
        paged_kv_indices=inputs.kv_indices,
        paged_kv_last_page_len=inputs.kv_last_page_len,
        causal=kwargs.pop("causal", False),
        sm_scale=None,
        run_extras=case.run_extras,
        **kwargs,
        **inputs.mask_kwargs,
    )


def _skip_unless_claimed(
    backend: Backend,
    problem: Any,
    batch: Batch | None,
    tactic: Tactic | None = None,
) -> None:
    """Skip the case with the backend's reasons (its declared run extras among them: the problem
    carries the case's, `_problem`) when its check refuses it."""
    reasons = backend.check(problem, tactic or Tactic.default(backend.name), batch)
    if reasons:
        pytest.skip("not claimed: " + "; ".join(reasons))


def _wrapper(case: Case, backend: Backend, device: torch.device, graph: bool = False) -> Any:
    cls = OPS[case.op].wrapper()
    return cls(*case.layout_args, backend=backend.name, device=device, use_cuda_graph=graph,
               run_extras=case.run_extras)  # fmt: skip


def _plan(wrapper: Any, case: Case, inputs: Inputs, tactic: Tactic | None = None) -> None:
    with claimed_path():
        wrapper.plan(*inputs.plan_args(case.op), **case.plan_kwargs(), **inputs.mask_kwargs, tactic=tactic)


def _run(wrapper: Any, case: Case, inputs: Inputs) -> None:
    result = wrapper.run(*inputs.run_args(), out=inputs.out, lse=inputs.lse, **inputs.extras)
    out = result[0] if case.return_lse else result
    assert out is inputs.out, "run(out=...) must return the given out tensor"


def _reference(case: Any, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(inputs, RaggedInputs):
        return ragged_reference(
            inputs.q, inputs.k, inputs.v, inputs.qo_indptr, inputs.kv_indptr, causal=case.causal,
            sm_scale=case.sm_scale, window_left=case.window_left, logits_soft_cap=case.logits_soft_cap,
            k_scale=case.k_scale, v_scale=case.v_scale, sinks=inputs.extras.get("sinks"),
        )  # fmt: skip
    rows, step = inputs.q.shape[0], case.q_len_per_req
    qo = inputs.qo_indptr if case.ragged else torch.arange(0, rows + 1, step, dtype=torch.int32)
    return attention_reference(
        inputs.q, inputs.k_cache, inputs.v_cache, qo, inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len,
        kv_layout=case.kv_layout, causal=case.masked_causally, sm_scale=case.sm_scale, window_left=case.window_left,
        logits_soft_cap=case.logits_soft_cap, k_scale=case.k_scale, v_scale=case.v_scale,
        custom_mask=inputs.custom_mask, sinks=inputs.extras.get("sinks"),
    )  # fmt: skip


def _nan_cause(case: Case) -> str:
    if case.stale == "large":
        return "were never written"
    value = "NaN" if case.stale == "nan" else "Inf"
    return f"are NaN: never written, or the {value} in cache slots no request owns reached the output"


def _check_attention(case: Case, inputs: Inputs, what: str) -> None:
    ref, ref_lse = _reference(case, inputs)
    unwritten = int(torch.isnan(inputs.out).sum())
    assert unwritten == 0, f"{what}: {unwritten} of {inputs.out.numel()} output elements {_nan_cause(case)}"
    err = relative_error(inputs.out, ref)
    tol = attention_tolerance(case.q_dtype, case.kv_dtype, case.out_dtype)
    assert err <= tol, f"{what}: relative error {err:.3e} above {tol:.0e} ({case.q_dtype} in, {case.out_dtype} out)"
    if case.return_lse:
        assert inputs.lse is not None
        unwritten = int(torch.isnan(inputs.lse).sum())
        assert unwritten == 0, f"{what}: {unwritten} of {inputs.lse.numel()} LSE elements {_nan_cause(case)}"
        lse_err = lse_error(inputs.lse, ref_lse)
        lse_tol = attention_lse_tolerance(case.q_dtype, case.kv_dtype)
        assert lse_err <= lse_tol, f"{what}: LSE error {lse_err:.3e} above {lse_tol:.0e} (natural log expected)"


def _snapshot(inputs: Inputs) -> list[torch.Tensor]:
    return [inputs.out.clone()] + ([inputs.lse.clone()] if inputs.lse is not None else [])


def test_attention(backend: Backend | None, attention_case: Case, device: torch.device) -> None:
    """Numerics, full writes, determinism and plan reuse for one case, on the claimed path."""
    backend = _require(backend)
    case = attention_case
    inputs = _inputs(case, device)
    problem, batch = _problem(case, inputs, device)
    _skip_unless_claimed(backend, problem, batch)

    wrapper = _wrapper(case, backend, device)
    _plan(wrapper, case, inputs)
    assert wrapper.backend == backend.name, f"served by '{wrapper.backend}', not '{backend.name}'"
    what = f"{case.id} with tactic {wrapper.tactic}"
    _run(wrapper, case, inputs)
    _check_attention(case, inputs, what)

    first = _snapshot(inputs)
    inputs.poison()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")  # run() must not wait for the device
        try:
            _run(wrapper, case, inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        _run(wrapper, case, inputs)
    for before, now in zip(first, _snapshot(inputs), strict=True):
        differ = int((before != now).sum())
        assert differ == 0, f"{what}: the same inputs gave different output in {differ} elements"

    inputs.refill(case, torch.Generator().manual_seed(case.seed + 1))
    _run(wrapper, case, inputs)
    _check_attention(case, inputs, f"{what}, same plan with new q and cache data")


def test_attention_tactics(backend: Backend | None, tactic_case: Case, device: torch.device, all_tactics: bool) -> None:
    """Every tactic the backend enumerates and accepts for the case computes the right thing."""
    backend = _require(backend)
    case = tactic_case
    inputs = _inputs(case, device)
    problem, batch = _problem(case, inputs, device)
    _skip_unless_claimed(backend, problem, batch)
    tactics = [t for t in backend.tactics(problem) if not t.is_default and not backend.check(problem, t, batch)]
    if not tactics:
        pytest.skip(f"{backend.name} enumerates no tactic besides its default for {case.id}")
    if not all_tactics and len(tactics) > SAMPLED_TACTICS:
        tactics = random.Random(case.seed).sample(tactics, SAMPLED_TACTICS)
    failures = []
    for tactic in tactics:
        wrapper = _wrapper(case, backend, device)
        inputs.poison()
        try:
            _plan(wrapper, case, inputs, tactic)
            assert wrapper.tactic == tactic, f"planned {tactic} but the plan runs {wrapper.tactic}"
            _run(wrapper, case, inputs)
            _check_attention(case, inputs, f"{case.id} with tactic {tactic}")
        except (AssertionError, TactixError, FallbackWarning) as exc:
            failures.append(f"{tactic}: {exc}")
    assert not failures, "\n".join(failures)


def test_attention_replan(backend: Backend | None, graph_case: Case, device: torch.device) -> None:
    """One wrapper re-planned for a different batch, then for the first batch again."""
    backend = _require(backend)
    first = graph_case
    kv_lens = (5, 1, 1030, 64, 200, 17)
    rows = first.q_len_per_req  # decode: the same rows per request (each request holds at least that many keys)
    q_lens = (5, 1, 3, 64, 1, 17) if first.ragged else (rows,) * 6
    second = replace(first, kv_lens=tuple(max(n, rows) for n in kv_lens), q_lens=q_lens, seed=first.seed + 77)
    wrapper = _wrapper(first, backend, device)
    for case in (first, second, first):
        inputs = _inputs(case, device)
        problem, batch = _problem(case, inputs, device)
        _skip_unless_claimed(backend, problem, batch)
        _plan(wrapper, case, inputs)
        _run(wrapper, case, inputs)
        _check_attention(case, inputs, f"{case.id} re-planned on a used wrapper (batch {case.kv_lens})")


def test_attention_rejects_bad_input(backend: Backend | None, graph_case: Case, device: torch.device) -> None:
    """Keys out of bounds (a page past the cache; ragged: k shorter than its indptr says) and
    mistyped tensors raise TactixError before the backend reads anything."""
    backend = _require(backend)
    case = graph_case
    inputs = _inputs(case, device)
    problem, batch = _problem(case, inputs, device)
    _skip_unless_claimed(backend, problem, batch)
    bad, argument = inputs.out_of_bounds()
    wrapper = _wrapper(case, backend, device)
    _plan(wrapper, case, bad)
    inputs.poison()
    with pytest.raises(InvalidArgumentError, match=argument):
        _run(wrapper, case, bad)
    assert bool(torch.isnan(inputs.out).all()), f"keys out of bounds ({argument}) refused only after output was written"
    _plan(wrapper, case, inputs)
    wrong = inputs.q.to(torch.float32 if inputs.q.dtype != torch.float32 else torch.float16)
    with pytest.raises(TactixError, match="'q'"):
        wrapper.run(wrong, *inputs.run_args()[1:], out=inputs.out, lse=inputs.lse)


def test_attention_refuses_an_empty_batch(backend: Backend | None, graph_case: Case, device: torch.device) -> None:
    """A batch with no query rows is refused at plan, naming the argument, and the wrapper still
    serves the next batch (an engine must skip the call, not get a crash or garbage)."""
    backend = _require(backend)
    case = graph_case
    inputs = _inputs(case, device)
    problem, batch = _problem(case, inputs, device)
    _skip_unless_claimed(backend, problem, batch)
    wrapper = _wrapper(case, backend, device)
    argument = "qo_indptr" if case.ragged else "paged_kv_indptr"
    with pytest.raises(InvalidArgumentError, match=f"'{argument}'"), claimed_path():
        wrapper.plan(*inputs.empty_plan_args(case.op), **case.plan_kwargs())
    _plan(wrapper, case, inputs)
    _run(wrapper, case, inputs)
    _check_attention(case, inputs, f"{case.id} planned after an empty batch was refused")


def test_attention_cuda_graph(backend: Backend | None, graph_case: Case, device: torch.device) -> None:
    """run() captures in a CUDA graph and the graph replays fresh data correctly (and, where the
    scales are device tensors, the scales they hold at each replay)."""
    backend = _require(backend)
    case = graph_case
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    inputs = _inputs(case, device)
    problem, batch = _problem(case, inputs, device)
    served = backend.served(problem).op  # multi-token decode may be served by the prefill plans
    caps = backend.spec.capabilities(served)
    if caps is None or caps.cuda_graph != "fixed_buffers":
        pytest.skip(f"{backend.name} declares no CUDA-graph support for {served}")
    _skip_unless_claimed(backend, problem, batch)
    wrapper = _wrapper(case, backend, device, graph=True)
    _plan(wrapper, case, inputs)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _run(wrapper, case, inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(wrapper, case, inputs)
    for round_ in range(2):
        inputs.refill(case, torch.Generator().manual_seed(case.seed + 10 + round_))
        now, what = case, "new data"
        if case.scale_form == "tensor":  # new values in the captured scale tensors
            now = replace(case, k_scale=case.k_scale * (round_ + 2), v_scale=case.v_scale / (round_ + 2))
            for name in case.run_extras:
                inputs.extras[name].fill_(getattr(now, name))
            what = f"new data and scales k_scale={now.k_scale:g}, v_scale={now.v_scale:g}"
        graph.replay()
        torch.cuda.synchronize(device)
        _check_attention(now, inputs, f"{case.id} replayed from a CUDA graph with {what}")
    if isinstance(inputs, AttentionInputs) and isinstance(now, AttentionCase) and not now.mask:
        # a serving step re-plans the captured wrapper for a shorter batch (smaller length buckets)
        # and replays: the captured buffers must hold it, and the replay must read its lengths only
        short_inputs, short = inputs.shortened(now)  # (the scales of the last round: the extras hold them)
        _plan(wrapper, short, short_inputs)
        short_inputs.refill(short, torch.Generator().manual_seed(case.seed + 20))
        graph.replay()
        torch.cuda.synchronize(device)
        _check_attention(short, short_inputs, f"{case.id} re-planned for kv lengths {short.kv_lens} (captured "
                                              f"at {case.kv_lens}) and replayed from its CUDA graph")  # fmt: skip


# -- GEMM ------------------------------------------------------------------------------------


def _gemm_problem(case: GemmCase, device: torch.device) -> GemmProblem:
    return gemm_problem(
        case.m, case.n, case.k, batch=case.batch, a_dtype=case.a_dtype, b_dtype=case.b_dtype,
        out_dtype=case.out_dtype, a_k_major=case.a_k_major, b_k_major=case.b_k_major,
        bias_dtype=case.out_dtype if case.bias else None, device=device,
    )  # fmt: skip


def _plan_gemm(case: GemmCase, backend: Backend, device: torch.device, tactic: Tactic | None = None) -> Gemm:
    g = Gemm(backend=backend.name, device=device)
    with claimed_path():
        g.plan(case.m, case.n, case.k, batch=case.batch, a_dtype=case.a_dtype, b_dtype=case.b_dtype,
               out_dtype=case.out_dtype, a_k_major=case.a_k_major, b_k_major=case.b_k_major,
               bias_dtype=case.out_dtype if case.bias else None, tactic=tactic)  # fmt: skip
    return g


def _check_gemm(case: GemmCase, inputs: GemmInputs, what: str) -> None:
    ref = gemm_reference(inputs.a, inputs.b, bias=inputs.bias, scale_a=inputs.scale_a, scale_b=inputs.scale_b)
    unwritten = int(torch.isnan(inputs.out).sum())
    cause = "are NaN: never written, or the NaN around an operand was read" if case.stale else "were never written"
    assert unwritten == 0, f"{what}: {unwritten} of {inputs.out.numel()} output elements {cause}"
    err = relative_error(inputs.out, ref)
    tol = tolerance_for(case.out_dtype, case.a_dtype, case.b_dtype)
    assert err <= tol, f"{what}: relative error {err:.3e} above {tol:.0e} ({case.a_dtype} in, {case.out_dtype} out)"


def test_gemm(backend: Backend | None, gemm_case: GemmCase, device: torch.device) -> None:
    backend = _require(backend)
    case = gemm_case
    _skip_unless_claimed(backend, _gemm_problem(case, device), None)
    inputs = build_gemm_inputs(case, device)
    g = _plan_gemm(case, backend, device)
    assert g.backend == backend.name, f"served by '{g.backend}', not '{backend.name}'"
    what = f"{case.id} with tactic {g.tactic}"
    result = g.run(inputs.a, inputs.b, out=inputs.out, **inputs.run_kwargs())
    assert result is inputs.out, "run(out=...) must return the given out tensor"
    _check_gemm(case, inputs, what)
    first = inputs.out.clone()
    inputs.out.fill_(float("nan"))
    g.run(inputs.a, inputs.b, out=inputs.out, **inputs.run_kwargs())
    differ = int((first != inputs.out).sum())
    assert differ == 0, f"{what}: the same inputs gave different output in {differ} elements"
    fresh = build_gemm_inputs(replace(case, seed=case.seed + 1), device)
    inputs.a.copy_(fresh.a)
    inputs.b.copy_(fresh.b)
    inputs.out.fill_(float("nan"))
    g.run(inputs.a, inputs.b, out=inputs.out, **inputs.run_kwargs())
    _check_gemm(case, inputs, f"{what}, same plan with new operands")


def test_gemm_rejects_bad_input(backend: Backend | None, gemm_edge_case: GemmCase, device: torch.device) -> None:
    """Operands and outputs of the wrong dtype, shape or device raise a TactixError naming the
    argument before the backend writes anything."""
    backend = _require(backend)
    case = gemm_edge_case
    _skip_unless_claimed(backend, _gemm_problem(case, device), None)
    inputs = build_gemm_inputs(case, device)
    g = _plan_gemm(case, backend, device)
    other = torch.float16 if inputs.a.dtype != torch.float16 else torch.bfloat16
    bad: list[tuple[str, dict[str, Any]]] = [
        ("a", {"a": inputs.a.to(other)}),
        ("a", {"a": inputs.a[..., :-1]}),
        ("b", {"b": inputs.b[..., :-1]}),
        ("out", {"out": torch.empty_like(inputs.out, dtype=other if inputs.out.dtype != other else torch.float32)}),
        ("out", {"out": torch.empty_like(inputs.out, device="meta")}),
    ]
    for argument, change in bad:
        call = {"a": inputs.a, "b": inputs.b, "out": inputs.out, **inputs.run_kwargs(), **change}
        inputs.out.fill_(float("nan"))
        with pytest.raises(TactixError, match=f"'{argument}'"):  # the message names it: "'a' must be ..."
            g.run(call.pop("a"), call.pop("b"), **call)
        assert bool(torch.isnan(inputs.out).all()), (
            f"{case.id}: bad '{argument}' was refused only after output was written"
        )


def test_gemm_tactics(backend: Backend | None, gemm_case: GemmCase, device: torch.device, all_tactics: bool) -> None:
    backend = _require(backend)
    case = gemm_case
    problem = _gemm_problem(case, device)
    _skip_unless_claimed(backend, problem, None)
    tactics = [t for t in backend.tactics(problem) if not t.is_default and not backend.check(problem, t)]
    if not tactics:
        pytest.skip(f"{backend.name} enumerates no tactic besides its default for {case.id}")
    if not all_tactics and len(tactics) > SAMPLED_TACTICS:
        tactics = random.Random(case.seed).sample(tactics, SAMPLED_TACTICS)
    failures = []
    inputs = build_gemm_inputs(case, device)
    for tactic in tactics:
        inputs.out.fill_(float("nan"))
        try:
            g = _plan_gemm(case, backend, device, tactic)
            assert g.tactic == tactic, f"planned {tactic} but the plan runs {g.tactic}"
            g.run(inputs.a, inputs.b, out=inputs.out, **inputs.run_kwargs())
            _check_gemm(case, inputs, f"{case.id} with tactic {tactic}")
        except (AssertionError, TactixError, FallbackWarning) as exc:
            failures.append(f"{tactic}: {exc}")
    assert not failures, "\n".join(failures)


# -- merging attention states ----------------------------------------------------------------


def test_merge_states(backend: Backend | None, merge_case: MergeCase, device: torch.device) -> None:
    """The states' merge against the float64 oracle: outputs poisoned first (every element
    written; with a mask, the rows it leaves out untouched), empty states and rows exact (zeros,
    -inf), the same bits on a second run, and a plan that serves another number of rows."""
    from tactix.merge import MergeStates

    backend = _require(backend)
    case = merge_case
    problem = make_problem("merge_states", device_type=device.type, v_dtype=case.v_dtype,
                           num_states=case.num_states, num_heads=case.heads, head_dim=case.head_dim, rows=case.rows,
                           masked=case.masked)  # fmt: skip
    _skip_unless_claimed(backend, problem, None)
    m = MergeStates(backend=backend.name, device=device)
    m.plan(num_states=case.num_states, num_heads=case.heads, head_dim=case.head_dim, v_dtype=case.v_dtype,
           rows=case.rows, masked=case.masked)  # fmt: skip
    assert m.backend == backend.name, f"served by '{m.backend}', not '{backend.name}'"
    what = f"{case.id} with tactic {m.tactic}"
    tol = tolerance_for(case.v_dtype)
    for rows in (case.rows, max(1, case.rows // 3)):  # the plan serves any number of rows
        inputs = build_merge_inputs(case, device)  # (afresh: an in-place run changed the first state)
        ref_v, ref_s = merge_reference(inputs.vs, inputs.ss)
        vs, ss = tuple(v[:rows] for v in inputs.vs), tuple(x[:rows] for x in inputs.ss)
        mask = None if inputs.mask is None else inputs.mask[:rows]
        if case.form == "in_place":
            before_v, before_s = vs[0].clone(), ss[0].clone()
            out_v, out_s = m.run(vs, ss, out_v=vs[0], out_s=ss[0], mask=mask)
            assert out_v is vs[0] and out_s is ss[0], f"{what}: run(out_v=..., out_s=...) must return them"
        else:
            out_v = torch.full_like(vs[0], float("nan"))
            out_s = torch.full(ss[0].shape, float("nan"), device=device)
            m.run(vs, ss, out_v=out_v, out_s=out_s, mask=mask)
        want_v, want_s = ref_v[:rows], ref_s[:rows]
        if mask is not None:
            keep = ~mask.cpu()
            kept = keep.to(device)
            unchanged = torch.equal(out_v[kept], before_v[kept]) and torch.equal(out_s[kept], before_s[kept])
            assert unchanged, f"{what}: rows outside the mask changed"
            want_v = torch.where(keep[:, None, None], before_v.cpu().double(), want_v)
            want_s = torch.where(keep[:, None], before_s.cpu().double(), want_s)
        assert not bool(torch.isnan(out_v).any()) and not bool(torch.isnan(out_s).any()), f"{what}: NaN in the output"
        err = relative_error(out_v, want_v)
        assert err <= tol, f"{what}, {rows} rows: relative error {err:.3e} above {tol:.0e}"
        assert lse_error(out_s, want_s) <= LSE_TOLERANCE["float32"], f"{what}, {rows} rows: LSE off"
        empty = torch.isneginf(ref_s[:rows])  # rows the merge wrote whose states are all over no key
        if mask is not None:
            empty &= mask.cpu()[:, None]
        if bool(empty.any()):
            assert bool(torch.isneginf(out_s.cpu()[empty]).all()), f"{what}: a row of empty states must give -inf"
            assert not bool(out_v.cpu()[empty].float().abs().sum()), f"{what}: a row of empty states must give zeros"
    if case.form != "in_place":
        again = torch.full_like(out_v, float("nan"))
        m.run(vs, ss, out_v=again, out_s=torch.empty_like(out_s), mask=mask)
        assert torch.equal(again, out_v), f"{what}: the same states gave different output"
