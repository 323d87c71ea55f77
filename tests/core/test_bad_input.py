"""Bad input is refused with a `tactix.TactixError` naming the argument, before any kernel runs.

Every test starts from a valid call, breaks exactly one thing, and checks the error's class, that
its message names the argument (and the offending value where one is meaningful), and, through a
spy on the torch backend, that no attention or GEMM kernel was reached. A wrong device is a
tensor on the ``meta`` device, which a CPU-only machine can make.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
import torch

import tactix
import tactix.backends.torch as torch_backend
from tactix.tactics import parse_tactic

F32, BF16, E4M3 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
PAGE, HQ, HKV, D = 16, 8, 2, 32
NUM_PAGES = 8


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# A spy on the torch backend: counts plans made and kernels run


class Spy:
    def __init__(self) -> None:
        self.plans = 0
        self.runs = 0
        self.last_problem: Any = None  # the problem of the last attention plan


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    s = Spy()
    attn_init = torch_backend._AttentionPlan.__init__
    attn_run = torch_backend._AttentionPlan.run

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        s.plans += 1
        s.last_problem = args[0] if args else kwargs.get("problem")
        attn_init(self, *args, **kwargs)

    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        s.runs += 1
        attn_run(self, *args, **kwargs)

    monkeypatch.setattr(torch_backend._AttentionPlan, "__init__", init)
    monkeypatch.setattr(torch_backend._AttentionPlan, "run", run)
    gemm_init = torch_backend._GemmPlan.__init__

    def gemm_plan_init(self: Any, *args: Any, **kwargs: Any) -> None:
        s.plans += 1
        gemm_init(self, *args, **kwargs)

    monkeypatch.setattr(torch_backend._GemmPlan, "__init__", gemm_plan_init)
    for name in ("_matmul", "_scaled_mm", "_dequant"):
        original = getattr(torch_backend._GemmPlan, name)

        def kernel(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> None:
            s.runs += 1
            _original(self, *args, **kwargs)

        monkeypatch.setattr(torch_backend._GemmPlan, name, kernel)
    yield s


def test_spy_sees_kernels(spy: Spy) -> None:
    """The spy itself works: a valid call is counted (so a count of 0 below means something)."""
    w = prefill()
    w.plan(*prefill_args(), **prefill_kwargs())
    w.run(*prefill_data())
    g = tactix.Gemm(backend="torch", device="cpu")
    g.plan(2, 4, 3, a_dtype=F32)
    g.run(torch.randn(2, 3), torch.randn(4, 3).t())
    assert spy.plans == 2 and spy.runs == 2


# ----------------------------------------------------------------------------------------------
# A valid prefill / decode to break


def prefill(layout: str = "NHD") -> tactix.PagedPrefill:
    return tactix.PagedPrefill(kv_layout=layout, backend="torch", device="cpu")  # type: ignore[arg-type]


def decode(layout: str = "NHD") -> tactix.PagedDecode:
    return tactix.PagedDecode(kv_layout=layout, backend="torch", device="cpu")  # type: ignore[arg-type]


def prefill_args(**changes: Any) -> list[Any]:
    """qo_indptr, kv_indptr, kv_indices, last_page_len, heads, kv heads, head dim, page size."""
    args = {
        "qo_indptr": i32(0, 3, 5),
        "paged_kv_indptr": i32(0, 2, 3),
        "paged_kv_indices": i32(4, 1, 7),
        "paged_kv_last_page_len": i32(3, 2),  # kv lengths 19 and 2
        "num_qo_heads": HQ,
        "num_kv_heads": HKV,
        "head_dim_qk": D,
        "page_size": PAGE,
    }
    args.update(changes)
    return list(args.values())


def prefill_kwargs(**changes: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"q_data_type": F32, "causal": True}
    kwargs.update(changes)
    return kwargs


def decode_args(**changes: Any) -> list[Any]:
    args = {
        "paged_kv_indptr": i32(0, 2, 3),
        "paged_kv_indices": i32(4, 1, 7),
        "paged_kv_last_page_len": i32(3, 2),
        "num_qo_heads": HQ,
        "num_kv_heads": HKV,
        "head_dim_qk": D,
        "page_size": PAGE,
    }
    args.update(changes)
    return list(args.values())


def kv(
    layout: str = "NHD", pages: int = NUM_PAGES, dtype: torch.dtype = F32, page: int = PAGE, dim: int = D
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (pages, page, HKV, dim) if layout == "NHD" else (pages, HKV, page, dim)
    return torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)


def prefill_data(rows: int = 5) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    return torch.randn(rows, HQ, D), kv()


def planned_prefill(**kwargs: Any) -> tactix.PagedPrefill:
    w = prefill()
    w.plan(*prefill_args(), **prefill_kwargs(**kwargs))
    return w


def raises(cls: type[Exception], *fragments: object) -> Any:
    """pytest.raises for ``cls`` whose message holds every fragment (checked by `check`)."""
    return _Raises(cls, [str(f) for f in fragments])


class _Raises:
    def __init__(self, cls: type[Exception], fragments: list[str]) -> None:
        self.cls = cls
        self.fragments = fragments
        self._ctx = pytest.raises(cls)

    def __enter__(self) -> Any:
        self.info = self._ctx.__enter__()
        return self.info

    def __exit__(self, *exc: Any) -> bool:
        handled = self._ctx.__exit__(*exc)
        if not handled:  # another exception type: let it propagate as the test's failure
            return False
        message = str(self.info.value)
        assert isinstance(self.info.value, tactix.TactixError), f"not a TactixError: {self.info.value!r}"
        for fragment in self.fragments:
            assert fragment in message, f"{fragment!r} not in the message: {message}"
        return bool(handled)


# ----------------------------------------------------------------------------------------------
# run(): tensors that do not match the plan


def test_q_wrong_dtype(spy: Spy) -> None:
    w = planned_prefill()
    q, cache = prefill_data()
    with raises(tactix.InvalidArgumentError, "'q'", "torch.float16"):
        w.run(q.half(), cache)
    assert spy.runs == 0


def test_q_wrong_head_dim(spy: Spy) -> None:
    w = planned_prefill()
    _, cache = prefill_data()
    with raises(tactix.InvalidArgumentError, "'q'", f"({5}, {HQ}, {D // 2})"):
        w.run(torch.randn(5, HQ, D // 2), cache)
    assert spy.runs == 0


def test_q_wrong_number_of_rows(spy: Spy) -> None:
    w = planned_prefill()
    _, cache = prefill_data()
    with raises(tactix.InvalidArgumentError, "'q'", "(6, 8, 32)"):
        w.run(torch.randn(6, HQ, D), cache)
    assert spy.runs == 0


def test_decode_q_wrong_shape(spy: Spy) -> None:
    w = decode()
    w.plan(*decode_args(), q_data_type=F32)
    with raises(tactix.InvalidArgumentError, "'q'", "(2, 1, 8, 32)"):
        w.run(torch.randn(2, 1, HQ, D), kv())
    assert spy.runs == 0


@pytest.mark.parametrize("which", ["k", "v"])
def test_cache_wrong_dtype(spy: Spy, which: str) -> None:
    w = planned_prefill()
    q, (k, v) = prefill_data()
    cache = (k.to(BF16), v) if which == "k" else (k, v.to(BF16))
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", which, "torch.bfloat16"):
        w.run(q, cache)
    assert spy.runs == 0


def test_5d_cache_wrong_dtype(spy: Spy) -> None:
    w = planned_prefill()
    q, _ = prefill_data()
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", "torch.float16"):
        w.run(q, torch.randn(NUM_PAGES, 2, PAGE, HKV, D, dtype=torch.float16))
    assert spy.runs == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_head_dim_does_not_match_plan(spy: Spy, layout: str) -> None:
    w = prefill(layout)
    w.plan(*prefill_args(), **prefill_kwargs())
    k, v = kv(layout, dim=D * 2)
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", "head_dim", str(D * 2)):
        w.run(torch.randn(5, HQ, D), (k, v))
    assert spy.runs == 0


def test_v_head_dim_does_not_match_head_dim_vo(spy: Spy) -> None:
    w = prefill()
    w.plan(*prefill_args(), **prefill_kwargs(head_dim_vo=16))
    k, _ = kv()
    v = torch.randn(NUM_PAGES, PAGE, HKV, 24)
    with raises(tactix.InvalidArgumentError, "paged_kv_cache (v)", "head_dim=16", "24"):
        w.run(torch.randn(5, HQ, D), (k, v))
    assert spy.runs == 0


def test_cache_wrong_number_of_kv_heads(spy: Spy) -> None:
    w = planned_prefill()
    k = torch.randn(NUM_PAGES, PAGE, HKV * 2, D)
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", f"num_kv_heads={HKV}"):
        w.run(torch.randn(5, HQ, D), (k, k))
    assert spy.runs == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["tuple", "5d"])
def test_page_size_differs_from_cache(spy: Spy, layout: str, form: str) -> None:
    w = prefill(layout)
    w.plan(*prefill_args(), **prefill_kwargs())  # page_size 16
    if form == "tuple":
        cache: Any = kv(layout, page=8)
    else:
        shape = (NUM_PAGES, 2, 8, HKV, D) if layout == "NHD" else (NUM_PAGES, 2, HKV, 8, D)
        cache = torch.randn(*shape)
    with raises(tactix.InvalidArgumentError, "page_size", "16", "8"):
        w.run(torch.randn(5, HQ, D), cache)
    assert spy.runs == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["tuple", "5d"])
def test_cache_in_the_other_layout_is_named_as_such(spy: Spy, layout: str, form: str) -> None:
    """An HND cache given to an NHD wrapper (or the reverse) is a layout mistake, not a page size one."""
    other = "HND" if layout == "NHD" else "NHD"
    w = prefill(layout)
    w.plan(*prefill_args(), **prefill_kwargs())
    k, v = kv(other)
    cache: Any = (k, v) if form == "tuple" else torch.stack([k, v], dim=1)
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", f"kv_layout='{layout}'", f"the {other} layout",
                f"kv_layout='{other}'") as info:  # fmt: skip
        w.run(torch.randn(5, HQ, D), cache)
    assert info.value.argument.startswith("paged_kv_cache")
    assert spy.runs == 0


def test_a_page_size_mismatch_says_the_layout_may_be_wrong(spy: Spy) -> None:
    """Where the shapes cannot tell a page size mistake from a layout one, the message says both."""
    w = prefill("NHD")
    w.plan(*prefill_args(), **prefill_kwargs())
    k, v = kv("HND", page=8)  # neither an NHD cache of page 16 nor its HND transpose
    with raises(tactix.InvalidArgumentError, "'page_size'", "kv_layout='NHD'", "if the cache is HND",
                "kv_layout='HND'"):  # fmt: skip
        w.run(torch.randn(5, HQ, D), (k, v))
    assert spy.runs == 0


def test_5d_cache_wrong_dim_1(spy: Spy) -> None:
    w = planned_prefill()
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", f"({NUM_PAGES}, 3, {PAGE}, {HKV}, {D})"):
        w.run(torch.randn(5, HQ, D), torch.randn(NUM_PAGES, 3, PAGE, HKV, D))
    assert spy.runs == 0


def test_4d_single_tensor_cache(spy: Spy) -> None:
    w = planned_prefill()
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", "5-D"):
        w.run(torch.randn(5, HQ, D), torch.randn(NUM_PAGES, PAGE, HKV, D))
    assert spy.runs == 0


def test_cache_tuple_of_three(spy: Spy) -> None:
    w = planned_prefill()
    k, v = kv()
    with raises(tactix.InvalidArgumentError, "paged_kv_cache"):
        w.run(torch.randn(5, HQ, D), (k, v, v))  # type: ignore[arg-type]
    assert spy.runs == 0


def test_cache_tuple_of_non_tensors(spy: Spy) -> None:
    w = planned_prefill()
    with raises(tactix.InvalidArgumentError, "paged_kv_cache"):
        w.run(torch.randn(5, HQ, D), ([1.0], [2.0]))  # type: ignore[arg-type]
    assert spy.runs == 0


def test_k_and_v_with_different_page_counts(spy: Spy) -> None:
    w = planned_prefill()
    k, v = kv()
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", str(NUM_PAGES - 1)):
        w.run(torch.randn(5, HQ, D), (k, v[:-1]))
    assert spy.runs == 0


def test_k_and_v_with_different_page_counts_after_a_good_run(spy: Spy) -> None:
    w = planned_prefill()
    k, v = kv()
    w.run(torch.randn(5, HQ, D), (k, v))
    spy.runs = 0
    short_v = v[:5].clone()  # page 7 is used by the batch but v has only 5 pages
    with raises(tactix.InvalidArgumentError, "paged_kv_cache", "5"):
        w.run(torch.randn(5, HQ, D), (k, short_v))
    assert spy.runs == 0


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_page_index_outside_cache_raises_at_run_before_reading(spy: Spy, op: str) -> None:
    # index 8 == num_pages of the cache given at run
    indices = i32(4, 1, NUM_PAGES)
    if op == "prefill":
        w: Any = prefill()
        w.plan(*prefill_args(paged_kv_indices=indices), **prefill_kwargs())
        q = torch.randn(5, HQ, D)
    else:
        w = decode()
        w.plan(*decode_args(paged_kv_indices=indices), q_data_type=F32)
        q = torch.randn(2, HQ, D)
    out = torch.full((q.shape[0], HQ, D), 123.0)
    with raises(tactix.InvalidArgumentError, "paged_kv_indices", str(NUM_PAGES)):
        w.run(q, kv(), out=out)
    assert spy.runs == 0, "the kernel ran although a page index is outside the cache"
    assert bool((out == 123.0).all())
    # the same plan with a big enough cache is fine
    w.run(q, kv(pages=NUM_PAGES + 1))
    assert spy.runs == 1


def test_page_index_check_follows_the_cache_given(spy: Spy) -> None:
    """A cache shrunk after a good run is checked again."""
    w = planned_prefill()  # largest index 7
    w.run(torch.randn(5, HQ, D), kv(pages=NUM_PAGES))
    with raises(tactix.InvalidArgumentError, "paged_kv_indices", "7"):
        w.run(torch.randn(5, HQ, D), kv(pages=7))
    assert spy.runs == 1


@pytest.mark.parametrize("argument", ["q", "paged_kv_cache", "out", "lse"])
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_tensor_on_another_device_is_refused_at_run(spy: Spy, op: str, argument: str) -> None:
    """A meta tensor has no data: a CPU plan that ran it would compute garbage (zeros or NaN)."""
    if op == "prefill":
        w: Any = prefill()
        w.plan(*prefill_args(), **prefill_kwargs(return_lse=True))
        rows = 5
    else:
        w = decode()
        w.plan(*decode_args(), q_data_type=F32, return_lse=True)
        rows = 2
    given: dict[str, Any] = {"q": torch.randn(rows, HQ, D), "paged_kv_cache": kv(),
                             "out": torch.empty(rows, HQ, D), "lse": torch.empty(rows, HQ)}  # fmt: skip
    w.run(given["q"], given["paged_kv_cache"], out=given["out"], lse=given["lse"])  # all on the plan's device
    spy.runs = 0
    meta = given[argument]
    given[argument] = tuple(t.to("meta") for t in meta) if isinstance(meta, tuple) else meta.to("meta")
    with raises(tactix.InvalidArgumentError, argument, "on cpu", "on meta"):
        w.run(given["q"], given["paged_kv_cache"], out=given["out"], lse=given["lse"])
    assert spy.runs == 0


def test_gemm_operand_on_another_device_is_refused_at_run(spy: Spy) -> None:
    g = _gemm_planned()
    with raises(tactix.InvalidArgumentError, "'a'", "on cpu", "on meta"):
        g.run(torch.randn(4, 8, device="meta"), torch.randn(6, 8).t())
    assert spy.runs == 0


def test_return_lse_at_run_when_planned_without(spy: Spy) -> None:
    w = planned_prefill()
    q, cache = prefill_data()
    with raises(tactix.InvalidArgumentError, "return_lse"):
        w.run(q, cache, return_lse=True)
    with raises(tactix.InvalidArgumentError, "return_lse"):
        w.run(q, cache, lse=torch.empty(5, HQ))
    assert spy.runs == 0


@pytest.mark.parametrize(
    ("out", "fragments"),
    [
        (torch.empty(5, HQ, D + 1), ["'out'", f"(5, {HQ}, {D + 1})"]),
        (torch.empty(4, HQ, D), ["'out'", f"(4, {HQ}, {D})"]),
        (torch.empty(5, HQ, D, dtype=BF16), ["'out'", "torch.bfloat16"]),
        (torch.empty(HQ, 5, D).transpose(0, 1), ["'out'", "non-contiguous"]),
    ],
    ids=["wrong-dim", "wrong-rows", "wrong-dtype", "non-contiguous"],
)
def test_bad_out(spy: Spy, out: Any, fragments: list[str]) -> None:
    w = planned_prefill()
    q, cache = prefill_data()
    with raises(tactix.InvalidArgumentError, *fragments):
        w.run(q, cache, out=out)
    assert spy.runs == 0


@pytest.mark.parametrize("name", ["out", "lse"])
def test_out_or_lse_not_a_tensor(spy: Spy, name: str) -> None:
    w = planned_prefill(return_lse=True)
    q, cache = prefill_data()
    with raises(tactix.InvalidArgumentError, f"'{name}'", "list"):
        w.run(q, cache, **{name: [0.0] * 5})
    assert spy.runs == 0


@pytest.mark.parametrize(
    ("lse", "fragments"),
    [
        (torch.empty(5, HQ, dtype=BF16), ["'lse'", "torch.bfloat16"]),
        (torch.empty(5, HQ + 1), ["'lse'", f"(5, {HQ + 1})"]),
        (torch.empty(HQ, 5).t(), ["'lse'", "non-contiguous"]),
    ],
    ids=["wrong-dtype", "wrong-shape", "non-contiguous"],
)
def test_bad_lse(spy: Spy, lse: torch.Tensor, fragments: list[str]) -> None:
    w = planned_prefill(return_lse=True)
    q, cache = prefill_data()
    with raises(tactix.InvalidArgumentError, *fragments):
        w.run(q, cache, lse=lse)
    assert spy.runs == 0


@pytest.mark.parametrize("cls", [tactix.PagedPrefill, tactix.PagedDecode])
def test_run_before_plan(spy: Spy, cls: type) -> None:
    w = cls(kv_layout="NHD", backend="torch", device="cpu")
    with raises(tactix.TactixError, "plan()"):
        w.run(torch.randn(5, HQ, D), kv())
    with raises(tactix.TactixError, "plan()"):
        _ = w.problem
    assert spy.runs == 0


# ----------------------------------------------------------------------------------------------
# plan(): batch metadata


def _plan_prefill(**changes: Any) -> None:
    kwargs = {
        k: changes.pop(k)
        for k in list(changes)
        if k in ("causal", "q_data_type", "tactic", "backend", "window_left", "sm_scale")
    }
    prefill().plan(*prefill_args(**changes), **prefill_kwargs(**kwargs))


@pytest.mark.parametrize("argument", ["paged_kv_indices", "paged_kv_indptr", "paged_kv_last_page_len", "qo_indptr"])
def test_index_array_of_float_dtype(spy: Spy, argument: str) -> None:
    valid = dict(
        zip(
            ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"],
            prefill_args()[:4],
            strict=True,
        )
    )
    with raises(tactix.InvalidArgumentError, f"'{argument}'", "torch.float32"):
        _plan_prefill(**{argument: valid[argument].float()})
    assert spy.plans == 0


def test_index_array_2d(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'paged_kv_indices'", "1-D", "(3, 1)"):
        _plan_prefill(paged_kv_indices=i32(4, 1, 7).view(3, 1))
    assert spy.plans == 0


@pytest.mark.parametrize("argument", ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"])
def test_index_array_not_a_tensor(spy: Spy, argument: str) -> None:
    valid = dict(
        zip(
            ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"],
            prefill_args()[:4],
            strict=True,
        )
    )
    with raises(tactix.InvalidArgumentError, f"'{argument}'", "list"):
        _plan_prefill(**{argument: valid[argument].tolist()})
    assert spy.plans == 0


def test_decode_indptr_not_a_tensor(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'paged_kv_indptr'", "list"):
        decode().plan(*decode_args(paged_kv_indptr=[0, 2, 3]), q_data_type=F32)
    assert spy.plans == 0


def test_qo_indptr_not_monotonic(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'qo_indptr'", "non-decreasing", "qo_indptr[1] = 6", "= 5"):
        _plan_prefill(qo_indptr=i32(0, 6, 5), causal=False)
    assert spy.plans == 0


def test_paged_kv_indptr_not_monotonic(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'paged_kv_indptr'", "non-decreasing", "paged_kv_indptr[1] = 3"):
        _plan_prefill(paged_kv_indptr=i32(0, 3, 2), causal=False)
    assert spy.plans == 0


@pytest.mark.parametrize("argument", ["qo_indptr", "paged_kv_indptr"])
def test_indptr_not_starting_at_zero(spy: Spy, argument: str) -> None:
    bad = {"qo_indptr": i32(1, 3, 5), "paged_kv_indptr": i32(1, 2, 3)}[argument]
    with raises(tactix.InvalidArgumentError, f"'{argument}'", "starting at 0", f"{argument}[0] = 1"):
        _plan_prefill(**{argument: bad}, causal=False)
    assert spy.plans == 0


def test_qo_indptr_length_differs_from_kv_indptr(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'qo_indptr'", "length 4"):
        _plan_prefill(qo_indptr=i32(0, 1, 3, 5))
    assert spy.plans == 0


def test_last_page_len_length_differs(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "paged_kv_last_page_len", "length 3"):
        _plan_prefill(paged_kv_last_page_len=i32(3, 2, 1))
    assert spy.plans == 0


def test_kv_indptr_end_beyond_indices(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'paged_kv_indices'", "paged_kv_indptr[-1] = 4", "3 entries"):
        _plan_prefill(paged_kv_indptr=i32(0, 2, 4))
    assert spy.plans == 0


def test_request_with_zero_pages(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'paged_kv_indptr'", "request 1"):
        _plan_prefill(paged_kv_indptr=i32(0, 3, 3), paged_kv_last_page_len=i32(3, 1), causal=False)
    assert spy.plans == 0


def test_decode_request_with_zero_pages(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'paged_kv_indptr'", "request 0"):
        decode().plan(*decode_args(paged_kv_indptr=i32(0, 0, 3)), q_data_type=F32)
    assert spy.plans == 0


@pytest.mark.parametrize("value", [0, PAGE + 1])
def test_last_page_len_out_of_range(spy: Spy, value: int) -> None:
    with raises(tactix.InvalidArgumentError, "paged_kv_last_page_len", f"page_size={PAGE}", f"(got {value})"):
        _plan_prefill(paged_kv_last_page_len=i32(3, value), causal=False)
    assert spy.plans == 0


def test_negative_page_index(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'paged_kv_indices'", "-1"):
        _plan_prefill(paged_kv_indices=i32(4, -1, 7))
    assert spy.plans == 0


def test_causal_kv_shorter_than_q_is_planned_with_rows_that_attend_no_key(spy: Spy) -> None:
    # request 1 has 2 kv tokens and 4 query rows: its first 2 rows attend no key (tests/core/test_keyless_rows.py)
    _plan_prefill(qo_indptr=i32(0, 3, 7), causal=True)
    assert spy.plans == 1 and spy.last_problem.keyless_rows
    _plan_prefill(qo_indptr=i32(0, 3, 7), causal=False)  # without the causal mask every row attends every key
    assert spy.plans == 2 and not spy.last_problem.keyless_rows


@pytest.mark.parametrize("qo_indptr", [i32(0, 0, 0), torch.tensor([0, 0, 0], dtype=torch.int64)], ids=["i32", "i64"])
def test_prefill_batch_without_query_rows_is_refused_at_plan(spy: Spy, qo_indptr: torch.Tensor) -> None:
    """An empty batch would plan and then fail inside a kernel (index_select on zero rows)."""
    with raises(tactix.InvalidArgumentError, "'qo_indptr'", "at least one query row", "qo_indptr[-1] = 0"):
        _plan_prefill(qo_indptr=qo_indptr, causal=False)
    assert spy.plans == 0
    w = prefill()
    w.plan(*prefill_args(qo_indptr=i32(0, 0, 2)), **prefill_kwargs(causal=False))  # one empty request is fine
    w.run(torch.randn(2, HQ, D), kv())
    assert spy.runs == 1


def test_qo_indptr_beyond_int32_is_refused_naming_it(spy: Spy) -> None:
    big = torch.tensor([0, 3, 2**31], dtype=torch.int64)
    with raises(tactix.InvalidArgumentError, "'qo_indptr'", str(2**31 - 1), f"qo_indptr[-1] = {2**31}"):
        _plan_prefill(qo_indptr=big, causal=False)
    assert spy.plans == 0


def test_paged_kv_indptr_beyond_int32_is_refused_naming_it(spy: Spy) -> None:
    big = torch.tensor([0, 2, 2**31], dtype=torch.int64)
    with raises(tactix.InvalidArgumentError, "'paged_kv_indptr'", str(2**31 - 1), f"paged_kv_indptr[-1] = {2**31}"):
        _plan_prefill(paged_kv_indptr=big, causal=False)
    assert spy.plans == 0


def test_kv_length_beyond_int32_is_refused_naming_it(spy: Spy) -> None:
    page = 65536
    pages = 2**31 // page + 1  # (pages - 1) * page_size + 1 keys: one past the int32 range
    indices = torch.zeros(pages, dtype=torch.int32)
    with raises(tactix.InvalidArgumentError, "'paged_kv_indptr'", "kv length", str(2**31 + 1)):
        decode().plan(torch.tensor([0, pages]), indices, i32(1), HQ, HKV, D, page, q_data_type=F32)
    assert spy.plans == 0


@pytest.mark.parametrize("page_size", [2**16 + 1, 2**28, 2**40])
def test_page_size_has_an_upper_bound(spy: Spy, page_size: int) -> None:
    """A huge page_size planned a 3 GiB mask for a 3-token request (2**28), or overflowed int32."""
    with raises(tactix.InvalidArgumentError, "'page_size'", "between 1 and 65536", str(page_size)):
        decode().plan(i32(0, 1), i32(0), i32(3), HQ, HKV, D, page_size, q_data_type=F32)
    assert spy.plans == 0
    decode().plan(i32(0, 1), i32(0), i32(3), HQ, HKV, D, 2**16, q_data_type=F32)  # the bound itself plans
    assert spy.plans == 1


# ----------------------------------------------------------------------------------------------
# plan(): sizes, options


def test_qo_heads_not_a_multiple_of_kv_heads(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'num_qo_heads'", "num_kv_heads = 4", "(got 6)"):
        _plan_prefill(num_qo_heads=6, num_kv_heads=4)
    assert spy.plans == 0


@pytest.mark.parametrize("argument", ["num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size"])
@pytest.mark.parametrize("value", [0, -2])
def test_sizes_must_be_positive(spy: Spy, argument: str, value: int) -> None:
    with raises(tactix.InvalidArgumentError, f"'{argument}'", str(value)):
        _plan_prefill(**{argument: value})
    assert spy.plans == 0


def _flashinfer_prefill(**kwargs: Any) -> Any:
    from tactix.compat.flashinfer import BatchPrefillWithPagedKVCacheWrapper

    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(8), "NHD", backend="torch")
    w.plan(*prefill_args(), q_data_type=F32, **kwargs)
    return w


def _flashinfer_decode(**kwargs: Any) -> Any:
    from tactix.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper

    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(8), "NHD", backend="torch", **kwargs)
    w.plan(*decode_args(), q_data_type=F32)
    return w


BOOL_ARGUMENTS: dict[str, Any] = {
    "causal": lambda v: _plan_prefill(causal=v),
    "return_lse": lambda v: planned_prefill(return_lse=v),
    "deterministic": lambda v: planned_prefill(deterministic=v),
    "return_lse (decode)": lambda v: decode().plan(*decode_args(), q_data_type=F32, return_lse=v),
    "deterministic (decode)": lambda v: decode().plan(*decode_args(), q_data_type=F32, deterministic=v),
    "use_cuda_graph": lambda v: tactix.PagedPrefill("NHD", backend="torch", device="cpu", use_cuda_graph=v),
    "use_cuda_graph (decode)": lambda v: tactix.PagedDecode("NHD", backend="torch", device="cpu", use_cuda_graph=v),
    "return_lse (run)": lambda v: planned_prefill(return_lse=True).run(*prefill_data(), return_lse=v),
    "a_k_major": lambda v: _gemm_planned(a_k_major=v),
    "b_k_major": lambda v: _gemm_planned(b_k_major=v),
    "causal (flashinfer)": lambda v: _flashinfer_prefill(causal=v),
    "non_blocking (flashinfer)": lambda v: _flashinfer_prefill(non_blocking=v),
    "use_cuda_graph (flashinfer)": lambda v: _flashinfer_decode(use_cuda_graph=v),
    "use_tensor_cores (flashinfer)": lambda v: _flashinfer_decode(use_tensor_cores=v),
    "return_lse (flashinfer run)": lambda v: _flashinfer_prefill().run(*prefill_data(), return_lse=v),
    "enable_pdl (flashinfer run)": lambda v: _flashinfer_prefill().run(*prefill_data(), enable_pdl=v),
}


@pytest.mark.parametrize(
    "value", ["yes", "", 1, 0, 1.0, torch.tensor(True)], ids=["yes", "empty", "1", "0", "1.0", "tensor"]
)
@pytest.mark.parametrize("argument", list(BOOL_ARGUMENTS))
def test_every_bool_argument_refuses_a_non_bool(spy: Spy, argument: str, value: Any) -> None:
    """One rule for every flag: ``causal="no"`` must not mean causal, nor ``return_lse=0`` mean False."""
    name = argument.split(" ")[0]
    with raises(tactix.InvalidArgumentError, f"'{name}' must be a bool", repr(value)):
        BOOL_ARGUMENTS[argument](value)
    assert spy.runs == 0
    BOOL_ARGUMENTS[argument](True)  # the same call with a bool goes through
    BOOL_ARGUMENTS[argument](False)


def test_window_left_below_minus_one(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'window_left'", "-2"):
        _plan_prefill(window_left=-2)
    assert spy.plans == 0


def test_unknown_q_dtype(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'q_data_type'", "int8"):
        _plan_prefill(q_data_type=torch.int8)
    assert spy.plans == 0


def test_unknown_kv_layout() -> None:
    with raises(tactix.InvalidArgumentError, "'kv_layout'", "NDH"):
        tactix.PagedPrefill(kv_layout="NDH", backend="torch", device="cpu")  # type: ignore[arg-type]
    with raises(tactix.InvalidArgumentError, "'kv_layout'", "nhd"):
        tactix.PagedDecode(kv_layout="nhd", backend="torch", device="cpu")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Backends and tactics


@pytest.mark.parametrize(
    "make",
    [
        lambda: tactix.PagedPrefill(backend="no_such_backend", device="cpu"),
        lambda: tactix.PagedDecode(backend="no_such_backend", device="cpu"),
        lambda: tactix.Gemm(backend="no_such_backend", device="cpu"),
        lambda: tactix.gemm(torch.randn(2, 3), torch.randn(3, 4), backend="no_such_backend"),
        lambda: _plan_prefill(backend="no_such_backend"),
    ],
    ids=["PagedPrefill", "PagedDecode", "Gemm", "gemm", "plan-override"],
)
def test_unknown_backend(spy: Spy, make: Any) -> None:
    with raises(tactix.BackendNotFoundError, "'backend'", "no_such_backend", "'torch'"):
        make()
    assert spy.plans == 0 and spy.runs == 0


def test_tactic_of_another_backend(spy: Spy) -> None:
    with raises(tactix.TacticError, "'tactic'", "cudnn", "torch"):
        _plan_prefill(tactic=tactix.Tactic(backend="cudnn", kernel="x"))
    with raises(tactix.TacticError, "'tactic'", "cudnn", "torch"):
        g = tactix.Gemm(backend="torch", device="cpu")
        g.plan(2, 4, 3, a_dtype=F32, tactic=tactix.Tactic(backend="cudnn", kernel="x"))
    assert spy.plans == 0


@pytest.mark.parametrize("value", [3, 0, True], ids=["3", "0", "True"])
def test_bare_integer_tactic(spy: Spy, value: Any) -> None:
    with raises(tactix.TacticError, "'tactic'", "never accepted", repr(value)):
        _plan_prefill(tactic=value)
    with raises(tactix.TacticError, "'tactic'", "never accepted"):
        tactix.gemm(torch.randn(2, 3), torch.randn(3, 4), backend="torch", tactic=value)
    assert spy.plans == 0


@pytest.mark.parametrize(
    "text",
    [
        '{"backend": "torch", "kernel": ',
        "not json",
        '{"backend": "torch"}',
        "[1, 2]",
        '"torch:explicit"',
        '{"backend": "torch", "kernel": "explicit", "schema_version": 99}',
    ],
    ids=["truncated", "not-json", "no-kernel", "list", "string", "future-schema"],
)
def test_malformed_tactic_json(spy: Spy, text: str) -> None:
    with raises(tactix.TacticError, "'tactic'"):
        _plan_prefill(tactic=text)
    assert spy.plans == 0


def test_tactic_json_that_is_valid_is_accepted(spy: Spy) -> None:
    """Contrast to the malformed cases: the same path accepts good JSON."""
    _plan_prefill(tactic='{"backend":"torch","kernel":"explicit","params":{}}')
    assert spy.plans == 1


def test_the_tactic_a_wrapper_prints_plans_the_same_tactic(spy: Spy) -> None:
    """``print(wrapper.tactic)`` (and every bench table) shows a form that ``tactic=`` accepts."""
    w = planned_prefill(causal=False)
    tactics = [t for t in tactix.get_registry().get("torch").tactics(w.problem) if not t.is_default]
    assert any(t.params for t in tactics)  # sdpa(impl=...): params travel through the printed form too
    for tactic in tactics:
        again = planned_prefill(causal=False, tactic=str(tactic))
        assert again.tactic == tactic and again.selection_source == "explicit"
        assert planned_prefill(causal=False, tactic=str(again.tactic)).tactic == tactic
    d = decode()
    d.plan(*decode_args(), q_data_type=F32)
    d.plan(*decode_args(), q_data_type=F32, tactic=str(d.tactic))
    assert d.selection_source == "explicit"
    g = _gemm_planned()
    a, b = torch.randn(4, 8), torch.randn(6, 8).t()
    assert torch.equal(tactix.gemm(a, b, backend="torch", tactic=str(g.tactic)), a @ b)
    assert torch.equal(tactix.gemm(a, b, tactic="torch:matmul"), a @ b)
    assert _gemm_planned(tactic="torch:matmul").tactic == tactix.Tactic(backend="torch", kernel="matmul")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("torch explicit", "'backend:kernel' or 'backend:kernel(name=value,...)'"),
        ("torch:", "a kernel name"),
        ("torch:sdpa(impl=math", "')' at the end"),
        ("torch:sdpa(impl)", "'=' after parameter 'impl'"),
        ("torch:sdpa(impl=math,impl=flash)", "'impl' is given twice"),
        ("torch:sdpa(impl=ma th)", "',' or ')'"),
        ("Torch:explicit", "backend"),
    ],
    ids=["no-colon", "no-kernel", "unclosed", "no-value", "twice", "blank-in-word", "capital-backend"],
)
def test_malformed_printed_tactic(spy: Spy, text: str, expected: str) -> None:
    with raises(tactix.TacticError, "'tactic' is not a valid tactic", expected):
        _plan_prefill(tactic=text)
    with raises(tactix.TacticError, "'tactic'", expected):
        tactix.gemm(torch.randn(2, 3), torch.randn(3, 4), backend="torch", tactic=text)
    assert spy.plans == 0


def test_torch_tactic_unknown_kernel(spy: Spy) -> None:
    with raises(tactix.UnsupportedProblemError, "no_such_kernel"):
        _plan_prefill(tactic=tactix.Tactic(backend="torch", kernel="no_such_kernel"))
    assert spy.plans == 0


def test_tactic_model_rejects_integers() -> None:
    for value in (5, 0, True, 2.0, None, [1]):
        with pytest.raises(pydantic.ValidationError, match="never accepted"):
            tactix.Tactic.model_validate(value)
        with raises(tactix.TacticError, "'tactic'", "never accepted"):
            parse_tactic(value)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# GEMM


def _gemm_planned(**kwargs: Any) -> tactix.Gemm:
    g = tactix.Gemm(backend="torch", device="cpu")
    plan = {"a_dtype": F32}
    plan.update(kwargs)
    g.plan(4, 6, 8, **plan)
    return g


def test_gemm_mismatched_k(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'b'", "k=8", "(7, 6)"):
        tactix.gemm(torch.randn(4, 8), torch.randn(7, 6), backend="torch")
    g = _gemm_planned()
    with raises(tactix.InvalidArgumentError, "'b'", "(7, 6)"):
        g.run(torch.randn(4, 8), torch.randn(6, 7).t())
    with raises(tactix.InvalidArgumentError, "'a'", "(4, 7)"):
        g.run(torch.randn(4, 7), torch.randn(6, 8).t())
    assert spy.runs == 0


def test_gemm_mismatched_batch_and_rank(spy: Spy) -> None:
    with raises(tactix.InvalidArgumentError, "'b'", "batch 2", "3"):
        tactix.gemm(torch.randn(2, 4, 8), torch.randn(3, 8, 6), backend="torch")
    with raises(tactix.InvalidArgumentError, "'b'", "3-D like a", "2-D"):
        tactix.gemm(torch.randn(2, 4, 8), torch.randn(8, 6), backend="torch")
    with raises(tactix.InvalidArgumentError, "'a'", "2-D or 3-D"):
        tactix.gemm(torch.randn(8), torch.randn(8, 6), backend="torch")
    assert spy.runs == 0


def test_gemm_wrong_dtype(spy: Spy) -> None:
    g = _gemm_planned()
    with raises(tactix.InvalidArgumentError, "'a'", "torch.bfloat16"):
        g.run(torch.randn(4, 8, dtype=BF16), torch.randn(6, 8).t())
    with raises(tactix.InvalidArgumentError, "'b'", "torch.float16"):
        g.run(torch.randn(4, 8), torch.randn(6, 8, dtype=torch.float16).t())
    with raises(tactix.InvalidArgumentError, "'a_dtype'", "int32"):
        _gemm_planned(a_dtype=torch.int32)
    with raises(tactix.InvalidArgumentError, "'b_dtype'", "bfloat16"):
        _gemm_planned(a_dtype=E4M3, b_dtype=BF16)
    assert spy.runs == 0


def test_gemm_mixed_operand_dtypes_one_shot(spy: Spy) -> None:
    with raises(tactix.TactixError):
        tactix.gemm(torch.randn(4, 8), torch.randn(6, 8, dtype=BF16).t(), backend="torch")
    assert spy.runs == 0


def _fp8_operands() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 16).to(E4M3), torch.randn(16, 16).to(E4M3).t()


@pytest.mark.parametrize(
    ("scales", "missing"),
    [
        ({}, "scale_a"),
        ({"scale_a": torch.tensor([1.0])}, "scale_b"),
        ({"scale_b": torch.tensor([1.0])}, "scale_a"),
        ({"scale_a": torch.tensor([1.0], dtype=BF16), "scale_b": torch.tensor([1.0])}, "scale_a"),
        ({"scale_a": torch.tensor([1.0]), "scale_b": torch.ones(2)}, "scale_b"),
        ({"scale_a": 1.0, "scale_b": torch.tensor([1.0])}, "scale_a"),
    ],
    ids=["none", "no-scale_b", "no-scale_a", "bf16-scale", "two-element-scale", "python-float"],
)
def test_gemm_fp8_without_proper_scales(spy: Spy, scales: dict[str, Any], missing: str) -> None:
    a, b = _fp8_operands()
    with raises(tactix.InvalidArgumentError, f"'{missing}'", "per-tensor"):
        tactix.gemm(a, b, backend="torch", **scales)
    g = tactix.Gemm(backend="torch", device="cpu")
    g.plan(4, 16, 16, a_dtype=E4M3)
    with raises(tactix.InvalidArgumentError, f"'{missing}'"):
        g.run(a, b, **scales)
    assert spy.runs == 0


def test_gemm_scales_for_non_fp8(spy: Spy) -> None:
    g = _gemm_planned()
    with raises(tactix.InvalidArgumentError, "scale_a", "non-fp8"):
        g.run(torch.randn(4, 8), torch.randn(6, 8).t(), scale_a=torch.tensor([1.0]), scale_b=torch.tensor([1.0]))
    assert spy.runs == 0


def test_gemm_bias_given_when_planned_without(spy: Spy) -> None:
    g = _gemm_planned()
    with raises(tactix.InvalidArgumentError, "'bias'", "planned without bias"):
        g.run(torch.randn(4, 8), torch.randn(6, 8).t(), bias=torch.randn(6))
    g = _gemm_planned(bias_dtype=F32)
    with raises(tactix.InvalidArgumentError, "'bias'", "None"):
        g.run(torch.randn(4, 8), torch.randn(6, 8).t())
    with raises(tactix.InvalidArgumentError, "'bias'", "(7,)"):
        g.run(torch.randn(4, 8), torch.randn(6, 8).t(), bias=torch.randn(7))
    assert spy.runs == 0


def test_gemm_bias_of_wrong_dtype(spy: Spy) -> None:
    a, b = torch.randn(4, 8, dtype=BF16), torch.randn(6, 8, dtype=BF16).t()
    with raises(tactix.TactixError, "bias", "float32"):
        tactix.gemm(a, b, bias=torch.randn(6, dtype=F32), backend="torch")
    assert spy.runs == 0


def test_gemm_wrong_layout_for_planned(spy: Spy) -> None:
    k_major_a, m_major_a = torch.randn(4, 8), torch.randn(8, 4).t()
    k_major_b, n_major_b = torch.randn(6, 8).t(), torch.randn(8, 6)
    g = _gemm_planned()  # both k-major
    with raises(tactix.InvalidArgumentError, "'a'", "k-major", "strides (1, 4)"):
        g.run(m_major_a, k_major_b)
    with raises(tactix.InvalidArgumentError, "'b'", "k-major", "strides (6, 1)"):
        g.run(k_major_a, n_major_b)
    g = _gemm_planned(a_k_major=False, b_k_major=False)
    with raises(tactix.InvalidArgumentError, "'a'", "m-major"):
        g.run(k_major_a, n_major_b)
    with raises(tactix.InvalidArgumentError, "'b'", "n-major"):
        g.run(m_major_a, k_major_b)
    assert spy.runs == 0


def test_gemm_operand_dense_in_neither_layout(spy: Spy) -> None:
    a = torch.randn(4, 16)[:, ::2]  # strides (16, 2)
    with raises(tactix.InvalidArgumentError, "'a'", "strides (16, 2)"):
        tactix.gemm(a, torch.randn(6, 8).t(), backend="torch")
    assert spy.runs == 0


@pytest.mark.parametrize(("argument", "value"), [("m", -1), ("m", 0), ("n", -3), ("k", 0), ("batch", 0)])
def test_gemm_non_positive_sizes(spy: Spy, argument: str, value: int) -> None:
    sizes: dict[str, Any] = {"m": 4, "n": 6, "k": 8}
    batch = None
    if argument == "batch":
        batch = value
    else:
        sizes[argument] = value
    with raises(tactix.InvalidArgumentError, f"'{argument}'", str(value)):
        tactix.Gemm(backend="torch", device="cpu").plan(sizes["m"], sizes["n"], sizes["k"], batch=batch, a_dtype=F32)
    assert spy.plans == 0


@pytest.mark.parametrize(("a", "b", "argument"), [((0, 8), (8, 6), "'m'"), ((4, 0), (0, 6), "'k'"),
                                                   ((4, 8), (8, 0), "'n'")])  # fmt: skip
def test_one_shot_gemm_of_an_empty_dimension_names_it(spy: Spy, a: tuple[int, int], b: tuple[int, int],
                                                       argument: str) -> None:  # fmt: skip
    with raises(tactix.InvalidArgumentError, argument, "positive size", f"a of shape {a}"):
        tactix.gemm(torch.randn(*a), torch.randn(*b), backend="torch")
    assert spy.plans == 0


@pytest.mark.parametrize(
    ("out", "fragments"),
    [
        (torch.empty(4, 7), ["'out'", "(4, 7)"]),
        (torch.empty(4, 6, dtype=BF16), ["'out'", "torch.bfloat16"]),
        (torch.empty(6, 4).t(), ["'out'", "non-contiguous"]),
    ],
    ids=["wrong-shape", "wrong-dtype", "non-contiguous"],
)
def test_gemm_bad_out(spy: Spy, out: torch.Tensor, fragments: list[str]) -> None:
    g = _gemm_planned()
    with raises(tactix.InvalidArgumentError, *fragments):
        g.run(torch.randn(4, 8), torch.randn(6, 8).t(), out=out)
    assert spy.runs == 0


@pytest.mark.parametrize("name", ["out", "bias"])
def test_gemm_out_or_bias_not_a_tensor(spy: Spy, name: str) -> None:
    g = _gemm_planned(bias_dtype=F32)
    kwargs: dict[str, Any] = {"bias": torch.randn(6)}
    kwargs[name] = [0.0] * 6
    with raises(tactix.InvalidArgumentError, f"'{name}'", "list"):
        g.run(torch.randn(4, 8), torch.randn(6, 8).t(), **kwargs)
    assert spy.runs == 0


def test_gemm_run_before_plan(spy: Spy) -> None:
    with raises(tactix.TactixError, "plan()"):
        tactix.Gemm(backend="torch", device="cpu").run(torch.randn(4, 8), torch.randn(6, 8).t())
    assert spy.runs == 0


def test_int64_page_index_beyond_int32_is_refused_not_wrapped() -> None:
    """2**32 + 1 would wrap to page 1 if narrowed blindly: another request's memory."""
    wrapper = tactix.PagedDecode("NHD", device="cpu")
    indices = torch.tensor([2**32 + 1], dtype=torch.int64)
    with pytest.raises(tactix.InvalidArgumentError, match="paged_kv_indices") as info:
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int64), indices, torch.tensor([3]), 4, 4, 16, 8,
                     q_data_type=torch.float32)  # fmt: skip
    assert str(2**32 + 1) in str(info.value)


def test_replanning_with_the_same_arguments_still_validates_and_resizes() -> None:
    """A wrapper remembers the validated problem of its static arguments; each batch is still checked."""
    wrapper = tactix.PagedDecode("HND", device="cpu")
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper.plan(i32(0, 1, 3), i32(0, 1, 2), i32(3, 4), 4, 1, 16, 4, q_data_type=torch.float32)
    assert wrapper._selection is not None and wrapper._selection.problem.max_kv_len == 8
    wrapper.plan(i32(0, 2, 3), i32(0, 1, 2), i32(4, 1), 4, 1, 16, 4, q_data_type=torch.float32)
    problem = wrapper._selection.problem
    assert (problem.batch_size, problem.max_kv_len) == (2, 8) and problem.num_kv_heads == 1
    wrapper.plan(i32(0, 1), i32(2), i32(2), 4, 1, 16, 4, q_data_type=torch.float32)
    assert (wrapper._selection.problem.batch_size, wrapper._selection.problem.max_kv_len) == (1, 2)
    with pytest.raises(tactix.InvalidArgumentError, match="num_kv_heads"):  # True == 1, but is not an int
        wrapper.plan(i32(0, 1), i32(2), i32(2), 4, True, 16, 4, q_data_type=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(tactix.InvalidArgumentError, match="paged_kv_last_page_len"):  # the batch is checked
        wrapper.plan(i32(0, 1), i32(2), i32(9), 4, 1, 16, 4, q_data_type=torch.float32)


# ----------------------------------------------------------------------------------------------
# Ragged-KV prefill: the same rules for its indptrs, tensors and static arguments


def ragged() -> tactix.RaggedPrefill:
    return tactix.RaggedPrefill(backend="torch", device="cpu")


RAGGED_QO, RAGGED_KV = (0, 3, 3, 5), (0, 3, 3, 7)  # 3 rows over 3 keys, an empty request, 2 over 4


def planned_ragged(**kwargs: Any) -> tactix.RaggedPrefill:
    w = ragged()
    w.plan(i32(*RAGGED_QO), i32(*RAGGED_KV), HQ, HKV, D, **{"q_data_type": F32, "causal": True, **kwargs})
    return w


def ragged_data() -> dict[str, torch.Tensor]:
    return {"q": torch.randn(5, HQ, D), "k": torch.randn(7, HKV, D), "v": torch.randn(7, HKV, D)}


@pytest.mark.parametrize(
    ("argument", "value", "fragments"),
    [
        ("q", torch.randn(4, HQ, D), ["'q'", f"(5, {HQ}, {D})", f"(4, {HQ}, {D})"]),
        ("q", torch.randn(5, HQ, D, dtype=BF16), ["'q'", "torch.float32", "torch.bfloat16"]),
        ("k", torch.randn(6, HKV, D), ["'k'", "num_kv_tokens = kv_indptr[-1] is 7, not 6"]),
        ("k", torch.randn(7, HKV + 1, D), ["'k'", f"num_kv_heads is {HKV}, not {HKV + 1}"]),
        ("v", torch.randn(7, HKV, D + 1), ["'v'", f"head_dim_vo is {D}, not {D + 1}"]),
        ("v", torch.randn(7, HKV, D).to(BF16), ["'v'", "torch.float32", "torch.bfloat16"]),
        ("k", torch.randn(7, HKV, D, device="meta"), ["'k'", "on cpu", "on meta"]),
        ("v", [0.0] * 7, ["'v'", f"(7, {HKV}, {D})", "got list"]),
        ("out", torch.empty(5, HQ, D + 1), ["'out'", f"(5, {HQ}, {D + 1})"]),
        ("out", torch.empty(HQ, 5, D).transpose(0, 1), ["'out'", "non-contiguous"]),
        ("out", torch.empty(5, HQ, D, device="meta"), ["'out'", "on meta"]),
        ("lse", torch.empty(5, HQ + 1), ["'lse'", f"(5, {HQ + 1})"]),
        ("lse", torch.empty(5, HQ, dtype=BF16), ["'lse'", "torch.bfloat16"]),
    ],
    ids=["q-rows", "q-dtype", "k-rows", "k-heads", "v-dim", "v-dtype", "k-device", "v-list", "out-dim",
         "out-strided", "out-device", "lse-shape", "lse-dtype"],
)  # fmt: skip
def test_ragged_run_refuses_tensors_the_plan_does_not_take(
    spy: Spy, argument: str, value: Any, fragments: list[str]
) -> None:
    w = planned_ragged(return_lse=True)
    given: dict[str, Any] = ragged_data()
    w.run(given["q"], given["k"], given["v"])  # valid as it is
    spy.runs = 0
    given[argument] = value
    with raises(tactix.InvalidArgumentError, *fragments):
        w.run(given.pop("q"), given.pop("k"), given.pop("v"), **given)
    assert spy.runs == 0


def test_ragged_run_before_plan_and_lse_not_planned(spy: Spy) -> None:
    data = ragged_data()
    with raises(tactix.TactixError, "plan()"):
        ragged().run(data["q"], data["k"], data["v"])
    w = planned_ragged()
    with raises(tactix.InvalidArgumentError, "'return_lse'", "pass return_lse=True to plan()"):
        w.run(data["q"], data["k"], data["v"], lse=torch.empty(5, HQ))
    with raises(tactix.InvalidArgumentError, "'k_scale'", "a finite float > 0"):
        w.run(data["q"], data["k"], data["v"], k_scale=-1.0)
    assert spy.runs == 0


@pytest.mark.parametrize(
    ("qo", "kv", "kwargs", "fragments"),
    [
        ([0, 3, 3, 5], [0, 3, 3, 3], {}, ["'kv_indptr'", "at least one key", "request 2: 2 query rows, no key"]),
        ([0, 3, 3, 5], [0, 3, 3, 3], {"causal": False}, ["'kv_indptr'", "at least one key", "request 2: 2 query rows"]),
        ([0, 0, 0], [0, 2, 4], {}, ["'qo_indptr'", "at least one query row", "qo_indptr[-1] = 0"]),
        ([0, 3, 2, 5], [0, 3, 3, 7], {}, ["'qo_indptr'", "non-decreasing", "qo_indptr[1] = 3 > qo_indptr[2] = 2"]),
        ([0, 3, 3, 5], [0, 3, 2, 7], {}, ["'kv_indptr'", "non-decreasing"]),
        ([1, 3, 3, 5], [0, 3, 3, 7], {}, ["'qo_indptr'", "starting at 0"]),
        ([0, 3, 5], [0, 3, 3, 7], {}, ["'qo_indptr'", "of length batch_size + 1 = 4 like kv_indptr"]),
        ([0], [0], {}, ["'kv_indptr'", "batch_size + 1 >= 2"]),
        ([0, 3], [0, 2**31], {"causal": False}, ["'kv_indptr'", "offsets up to 2147483647"]),
    ],
    ids=["causal-no-key", "no-key", "empty-batch", "qo-decreasing", "kv-decreasing", "qo-start", "lengths",
         "no-request", "beyond-int32"],
)  # fmt: skip
def test_ragged_plan_refuses_bad_indptrs(
    spy: Spy, qo: list[int], kv: list[int], kwargs: dict[str, Any], fragments: list[str]
) -> None:
    w = ragged()
    with raises(tactix.InvalidArgumentError, *fragments):
        w.plan(torch.tensor(qo, dtype=torch.int64), torch.tensor(kv, dtype=torch.int64), HQ, HKV, D,
               **{"q_data_type": F32, "causal": True, **kwargs})  # fmt: skip
    assert spy.plans == 0


@pytest.mark.parametrize(
    ("argument", "value", "fragment"),
    [
        ("qo_indptr", [0, 3, 3, 5], "torch.Tensor"),
        ("kv_indptr", torch.tensor([0.0, 3.0, 3.0, 7.0]), "int32 or int64"),
        ("kv_indptr", torch.zeros(2, 2, dtype=torch.int32), "1-D"),
        ("qo_indptr", torch.tensor(RAGGED_QO, dtype=torch.int32, device="meta"), "on the CPU or on cpu"),
    ],
    ids=["list", "float", "2d", "meta"],
)
def test_ragged_plan_refuses_index_arrays_of_the_wrong_kind(spy: Spy, argument: str, value: Any, fragment: str) -> None:
    given: dict[str, Any] = {"qo_indptr": i32(*RAGGED_QO), "kv_indptr": i32(*RAGGED_KV), argument: value}
    with raises(tactix.InvalidArgumentError, f"'{argument}'", fragment):
        ragged().plan(given["qo_indptr"], given["kv_indptr"], HQ, HKV, D, q_data_type=F32)
    assert spy.plans == 0


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"num_qo_heads": 6, "num_kv_heads": 4}, ["'num_qo_heads'", "multiple of num_kv_heads = 4"]),
        ({"head_dim_qk": 0}, ["'head_dim_qk'", "positive int"]),
        ({"head_dim_vo": -2}, ["'head_dim_vo'", "positive int"]),
        ({"causal": 1}, ["'causal'", "a bool"]),
        ({"return_lse": "yes"}, ["'return_lse'", "a bool"]),
        ({"window_left": -2}, ["'window_left'", "-1 (no window)"]),
        ({"logits_soft_cap": -1.0}, ["'logits_soft_cap'"]),
        ({"sm_scale": 0.0}, ["'sm_scale'", "finite float > 0"]),
        ({"q_data_type": "int8"}, ["'q_data_type'"]),
        ({"backend": 3}, ["'backend'"]),
        ({"tactic": "torch:nope"}, ["unknown kernel 'nope'"]),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else None,
)
def test_ragged_plan_refuses_bad_static_arguments(spy: Spy, changes: dict[str, Any], fragments: list[str]) -> None:
    args = {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim_qk": D, "head_dim_vo": None}
    kwargs = {"q_data_type": F32, "causal": True}
    for name, value in changes.items():
        (args if name in args else kwargs)[name] = value
    error = tactix.UnsupportedProblemError if "tactic" in changes else tactix.InvalidArgumentError
    with raises(error, *fragments):
        ragged().plan(i32(*RAGGED_QO), i32(*RAGGED_KV), *args.values(), **kwargs)
    assert spy.plans == 0


# ----------------------------------------------------------------------------------------------
# The wrapper's device, checked when the wrapper is made


@pytest.mark.parametrize(
    "device",
    ["cpux", "gpu", "cuda:99", torch.device("cuda", 99), 99, [0], True, "meta"],
    ids=["typo", "unknown-type", "cuda-index-str", "cuda-index-device", "cuda-index-int", "list", "bool", "meta"],
)
@pytest.mark.parametrize("cls", [tactix.PagedPrefill, tactix.PagedDecode, tactix.RaggedPrefill, tactix.Gemm,
                                 tactix.MergeStates])  # fmt: skip
def test_a_device_this_machine_lacks_is_refused_naming_the_argument(spy: Spy, cls: type, device: object) -> None:
    kwargs: dict[str, Any] = {"device": device}
    if cls in (tactix.PagedPrefill, tactix.PagedDecode):
        kwargs["kv_layout"] = "NHD"
    with raises(tactix.InvalidArgumentError, "'device'", "'cpu'"):
        cls(**kwargs)
    assert spy.plans == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a CUDA GPU")
def test_a_cuda_device_without_a_gpu_says_none_is_visible() -> None:
    with raises(tactix.InvalidArgumentError, "'device'", "no CUDA GPU is visible", "'cuda'"):
        tactix.PagedDecode("NHD", device="cuda")


@pytest.mark.parametrize("argument", ["sm_scale", "logits_soft_cap"])
@pytest.mark.parametrize("value", ["0.5", "a", [0.5], b"1", True])
def test_a_scale_that_is_not_a_number_is_refused_naming_it(spy: Spy, argument: str, value: object) -> None:
    with raises(tactix.InvalidArgumentError, f"'{argument}'", repr(value)):
        decode().plan(*decode_args(), q_data_type=F32, **{argument: value})
    assert spy.plans == 0


def test_a_scale_given_as_a_one_element_tensor_is_its_value() -> None:
    q, (k, v) = torch.randn(2, HQ, D), kv()
    by_tensor, by_float = decode(), decode()
    by_tensor.plan(*decode_args(), q_data_type=F32, sm_scale=torch.tensor(0.25))
    by_float.plan(*decode_args(), q_data_type=F32, sm_scale=0.25)
    torch.testing.assert_close(by_tensor.run(q, (k, v)), by_float.run(q, (k, v)), rtol=0, atol=0)
