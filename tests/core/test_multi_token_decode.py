"""Multi-token decode (speculative decoding's verify step): ``PagedDecode.plan(q_len_per_req=N)``.

Each request's N rows are its last N tokens, causal among them; a backend whose decode plans do
not take N rows is served through its prefill plans by the core; one without prefill refuses
with a reason naming the rows per request.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tactix
from tactix.ops import DecodeProblem, PrefillProblem
from tactix.problems import problem_from_key
from tactix.registry import get_registry
from tactix.testing import attention_reference, lse_error, relative_error
from tests.plugin_fixtures import plugins_on_path, write_distribution

PAGE, HQ, HKV, D = 8, 8, 2, 32
KV_LENS = (5, 17, 9, 24)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture
def cache() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    pages = [-(-n // PAGE) for n in KV_LENS]
    total = sum(pages) + 2
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    return {
        "indptr": i32(*indptr),
        "indices": torch.randperm(total, generator=gen)[: indptr[-1]].to(torch.int32),
        "last": i32(*[(n - 1) % PAGE + 1 for n in KV_LENS]),
        "k": torch.randn(total, HKV, PAGE, D, generator=gen),
        "v": torch.randn(total, HKV, PAGE, D, generator=gen),
        "q": torch.randn(len(KV_LENS) * 4, HQ, D, generator=gen),
    }


def reference(cache: dict[str, torch.Tensor], n: int, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    b = len(KV_LENS)
    return attention_reference(
        cache["q"][: b * n], cache["k"], cache["v"], torch.arange(0, b * n + 1, n, dtype=torch.int32), cache["indptr"],
        cache["indices"], cache["last"], kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(D), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("window", [-1, 3])
def test_rows_are_the_last_tokens_causal_among_them(cache: dict[str, torch.Tensor], n: int, window: int) -> None:
    wrapper = tactix.PagedDecode("HND", device="cpu")
    wrapper.plan(cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, q_data_type=torch.float32,
                 q_len_per_req=n, window_left=window, return_lse=True)  # fmt: skip
    q = cache["q"][: len(KV_LENS) * n]
    out, lse = wrapper.run(q, (cache["k"], cache["v"]))
    ref, ref_lse = reference(cache, n, window_left=window)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse) < 1e-5
    # the same as a chunked causal prefill of n rows per request
    prefill = tactix.PagedPrefill("HND", device="cpu")
    qo = torch.arange(0, len(KV_LENS) * n + 1, n, dtype=torch.int32)
    prefill.plan(qo, cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, causal=True,
                 q_data_type=torch.float32, window_left=window)  # fmt: skip
    assert torch.equal(prefill.run(q, (cache["k"], cache["v"])), out)
    # one row per request is the plain decode step (its last token)
    one = tactix.PagedDecode("HND", device="cpu")
    one.plan(cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, q_data_type=torch.float32,
             window_left=window)  # fmt: skip
    last_rows = q.view(len(KV_LENS), n, HQ, D)[:, -1]
    assert torch.allclose(one.run(last_rows.contiguous(), (cache["k"], cache["v"])),
                          out.view(len(KV_LENS), n, HQ, D)[:, -1], atol=1e-6)  # fmt: skip


def test_a_replan_keeps_the_rows_per_request_and_q_must_match(cache: dict[str, torch.Tensor]) -> None:
    wrapper = tactix.PagedDecode("HND", device="cpu", use_cuda_graph=True)
    plan = lambda last: wrapper.plan(cache["indptr"], cache["indices"], last, HQ, HKV, D, PAGE,  # noqa: E731
                                     q_data_type=torch.float32, q_len_per_req=3)  # fmt: skip
    plan(cache["last"])
    shorter = cache["last"].clone()
    shorter[3] -= 1  # one key fewer for request 3
    plan(shorter)
    out = wrapper.run(cache["q"][:12], (cache["k"], cache["v"]))
    b = len(KV_LENS)
    ref, _ = attention_reference(cache["q"][:12], cache["k"], cache["v"], torch.arange(0, 13, 3, dtype=torch.int32),
                                 cache["indptr"], cache["indices"], shorter, kv_layout="HND", causal=True,
                                 sm_scale=1 / math.sqrt(D))  # fmt: skip
    assert relative_error(out, ref) < 1e-5
    with pytest.raises(tactix.InvalidArgumentError, match="'q'"):
        wrapper.run(cache["q"][:b], (cache["k"], cache["v"]))  # one row per request: not what was planned


def _cut(cache: dict[str, torch.Tensor], kv_lens: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The metadata of the cache's requests cut to ``kv_lens`` keys (each keeps its first pages)."""
    indptr, indices, old = [0], [], cache["indptr"].tolist()
    for r, n in enumerate(kv_lens):
        indices += cache["indices"][old[r] : old[r] + -(-n // PAGE)].tolist()
        indptr.append(len(indices))
    return i32(*indptr), i32(*indices), i32(*[(n - 1) % PAGE + 1 for n in kv_lens])


def test_cuda_graph_mode_serves_a_shorter_batch_in_the_captured_buffers(cache: dict[str, torch.Tensor]) -> None:
    """A serving step's CUDA-graph pattern (FlashInfer's own test of it): capture at the longest
    batch, re-plan every step for shorter ones, of smaller length buckets too, and replay. The
    re-plans keep the captured buffers; a batch longer than the captured one is refused."""
    wrapper = tactix.PagedDecode("HND", backend="torch", device="cpu", use_cuda_graph=True)
    b, n = len(KV_LENS), 3
    q = cache["q"][: b * n]

    def plan(indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> list[int]:
        wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.float32, q_len_per_req=n)
        plan = wrapper.plan_object
        return [t.data_ptr() for t in (plan.page_table, plan.q_index, plan.out_index, plan.mask, plan.key_valid)]

    captured = plan(cache["indptr"], cache["indices"], cache["last"])  # the longest: 24 keys (bucket 32)
    qo = torch.arange(0, b * n + 1, n, dtype=torch.int32)
    for kv_lens in ((5, 16, 9, 16), (3, 3, 4, 3)):  # longest 16 and 4: smaller buckets
        meta = _cut(cache, kv_lens)
        assert plan(*meta) == captured, f"a re-plan for kv lengths {kv_lens} moved the captured buffers"
        out = wrapper.run(q, (cache["k"], cache["v"]))
        ref, _ = attention_reference(q, cache["k"], cache["v"], qo, *meta, kv_layout="HND", causal=True,
                                     sm_scale=1 / math.sqrt(D))  # fmt: skip
        assert relative_error(out, ref) < 1e-5, f"kv lengths {kv_lens}"
    longer = cache["last"].clone()
    longer[0] += 1  # request 0 grows; still in its page, but the captured wrapper was planned at 24 keys ...
    plan(cache["indptr"], cache["indices"], longer)  # ... and 6 fits the bucket 32: served
    grown = torch.cat([cache["indices"], cache["indices"][:2]])  # request 3 gets two pages more: 40 keys
    indptr = cache["indptr"].clone()
    indptr[-1] += 2
    big = cache["last"].clone()
    big[-1] = PAGE
    with pytest.raises(tactix.UnsupportedProblemError, match="capture with the longest batch"):
        plan(indptr, grown, big)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_bad_rows_per_request_name_the_argument(cache: dict[str, torch.Tensor], bad: object) -> None:
    wrapper = tactix.PagedDecode("HND", device="cpu")
    with pytest.raises(tactix.InvalidArgumentError, match="q_len_per_req"):
        wrapper.plan(cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, q_len_per_req=bad)  # type: ignore[arg-type]


def test_more_rows_than_a_requests_keys_is_refused(cache: dict[str, torch.Tensor]) -> None:
    wrapper = tactix.PagedDecode("HND", device="cpu")
    with pytest.raises(tactix.InvalidArgumentError, match=r"q_len_per_req.*request 0 has 5 kv tokens"):
        wrapper.plan(cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, q_len_per_req=6)


def test_one_row_per_request_keeps_the_stored_key() -> None:
    """Entries stored before multi-token decode existed keep their keys (and hashes)."""
    fields = dict(device_type="cpu", num_qo_heads=8, num_kv_heads=2, head_dim_qk=32, head_dim_vo=32, page_size=8,
                  kv_layout="HND", q_dtype="float32", kv_dtype="float32", out_dtype="float32", sm_scale=0.125,
                  window_left=-1, logits_soft_cap=0.0, return_lse=False, batch_size=4, max_kv_len=24)  # fmt: skip
    one = DecodeProblem(**fields)  # type: ignore[arg-type]
    assert "q_len_per_req" not in one.key()
    assert problem_from_key(one.key()) == one.bucketed()
    four = DecodeProblem(**fields, q_len_per_req=4)  # type: ignore[arg-type]
    assert four.key()["q_len_per_req"] == 4 and four.key_hash() != one.key_hash()
    assert problem_from_key(four.key()) == four.bucketed()
    assert "-q4" in str(four) and four.causal and four.max_qo_len == 4 and not one.causal


SPLIT_PLUGIN = """
import tactix
from tactix.backends import torch as _torch

NAME = "splitter"
SEEN = []


@tactix.hookimpl
def tactix_backends():
    spec = _torch.tactix_backends()[0]
    one_row = spec.decode.model_copy(update={"max_q_len_per_req": 1})  # with the k/v scales
    unscaled = spec.prefill.model_copy(update={"run_extras": frozenset()})
    return [tactix.BackendSpec(name=NAME, version="1.0", decode=one_row, prefill=unscaled, preference=-300)]


@tactix.hookimpl
def tactix_tactics(problem):
    SEEN.append(("tactics", problem))
    return [tactix.Tactic(backend=NAME, kernel=problem.op)]


@tactix.hookimpl
def tactix_check(problem, tactic):
    SEEN.append(("check", problem))
    return [] if tactic.is_default or tactic.kernel == problem.op else [f"kernel {tactic.kernel} is not {problem.op}"]


def _plan(problem, batch, tactic, options, hook):
    SEEN.append(("plan", problem))
    plan = hook(problem, batch, tactix.Tactic.default("torch"), options)
    plan.tactic = tactix.Tactic(backend=NAME, kernel=problem.op)
    return plan


@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    assert problem.q_len_per_req == 1, "the core must not hand this backend more rows than it declares"
    return _plan(problem, batch, tactic, options, _torch.tactix_plan_decode)


@tactix.hookimpl
def tactix_plan_prefill(problem, batch, tactic, options):
    return _plan(problem, batch, tactic, options, _torch.tactix_plan_prefill)
"""

DECODE_ONLY = """
import tactix
from tactix.backends import torch as _torch


@tactix.hookimpl
def tactix_backends():
    spec = _torch.tactix_backends()[0]
    return [tactix.BackendSpec(name="onerow", version="1.0", decode=spec.decode.model_copy(
        update={"max_q_len_per_req": 1}), preference=-300)]


@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    return _torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options)
"""


def test_a_backend_without_multi_token_decode_serves_it_through_its_prefill(
    cache: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    root = tmp_path / "site"
    write_distribution(root, "tactix-splitter", "1.0", {"splitter": "split_plugin", "onerow": "onerow_plugin"},
                       {"split_plugin": SPLIT_PLUGIN, "onerow_plugin": DECODE_ONLY})  # fmt: skip
    with plugins_on_path(root):
        import split_plugin  # type: ignore[import-not-found]

        wrapper = tactix.PagedDecode("HND", backend="splitter", device="cpu")
        wrapper.plan(cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, q_data_type=torch.float32,
                     q_len_per_req=4)  # fmt: skip
        out = wrapper.run(cache["q"][:16], (cache["k"], cache["v"]))
        assert str(wrapper.tactic) == "splitter:prefill"
        planned = [p for what, p in split_plugin.SEEN if what == "plan"]
        assert planned and all(isinstance(p, PrefillProblem) for p in planned)
        assert planned[-1].causal and planned[-1].max_qo_len == 4 and planned[-1].num_qo_tokens == 16
        assert relative_error(out, reference(cache, 4)[0]) < 1e-5
        # the run extras are those of the op whose plan runs (prefill's: none here), not decode's
        with pytest.raises(tactix.InvalidArgumentError, match="k_scale"):
            wrapper.run(cache["q"][:16], (cache["k"], cache["v"]), k_scale=0.5)
        # one row per request stays on its decode plans
        split_plugin.SEEN.clear()
        wrapper.plan(cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, q_data_type=torch.float32)
        assert str(wrapper.tactic) == "splitter:decode"
        assert all(isinstance(p, DecodeProblem) for what, p in split_plugin.SEEN if what == "plan")
        # the tactics a tuner would try for the multi-token problem are its prefill tactics
        registry = get_registry()
        multi = DecodeProblem(
            device_type="cpu", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, head_dim_vo=D, page_size=PAGE,
            kv_layout="HND", q_dtype="float32", kv_dtype="float32", out_dtype="float32", sm_scale=0.1,
            window_left=-1, logits_soft_cap=0.0, return_lse=False, batch_size=4, max_kv_len=24, q_len_per_req=4,
        )  # fmt: skip
        assert [str(t) for t in registry.get("splitter").tactics(multi)] == ["splitter:default", "splitter:prefill"]
        # a backend with no prefill refuses, saying why
        only = tactix.PagedDecode("HND", backend="onerow", device="cpu")
        with pytest.raises(tactix.UnsupportedProblemError, match=r"4 query rows per request \(multi-token decode\)"):
            only.plan(cache["indptr"], cache["indices"], cache["last"], HQ, HKV, D, PAGE, q_data_type=torch.float32,
                      q_len_per_req=4)  # fmt: skip
