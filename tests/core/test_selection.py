"""Choosing backend and tactic: preference order, explicit choices, stored tactics, fallbacks."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tactix
from tactix.selection import set_tactic_source
from tactix.testing import attention_reference, relative_error
from tests.plugin_fixtures import delegating_plugin, plugins_on_path, write_distribution

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731


@pytest.fixture
def third_party(tmp_path: Path) -> Iterator[None]:
    write_distribution(
        tmp_path,
        "tactix-fast",
        "1.0",
        {"fast": "tx_fast"},
        {"tx_fast": delegating_plugin("fast", 10, plan_raises="kernel exploded")},
    )
    write_distribution(
        tmp_path,
        "tactix-good",
        "1.0",
        {"good": "tx_good"},
        {"tx_good": delegating_plugin("good", 5, check_reason="needs sm_100")},
    )
    with plugins_on_path(tmp_path):
        yield
    set_tactic_source(None)


def _plan_decode(wrapper: tactix.PagedDecode, batch: int = 2, **kwargs: object) -> None:
    indptr = torch.arange(batch + 1, dtype=torch.int32)
    wrapper.plan(
        indptr,
        torch.arange(batch, dtype=torch.int32),
        torch.full((batch,), 3, dtype=torch.int32),
        4,
        2,
        16,
        4,
        q_data_type=torch.float32,
        **kwargs,
    )  # type: ignore[arg-type]


def test_auto_prefers_higher_preference_and_falls_back_once_with_a_warning(third_party: None) -> None:
    wrapper = tactix.PagedDecode(device="cpu")
    with pytest.warns(tactix.FallbackWarning) as caught:
        _plan_decode(wrapper)
    messages = [str(w.message) for w in caught if issubclass(w.category, tactix.FallbackWarning)]
    assert len(messages) == 1
    assert "decode[f32-h4/2-d16-p4-NHD-cpu]" in messages[0]
    assert "fast:default" in messages[0] and "RuntimeError: kernel exploded" in messages[0]
    # 'fast' (preference 10) failed, 'good' (5) serves, before torch (-100)
    assert wrapper.backend == "good" and wrapper.selection_source == "fallback"
    with warnings.catch_warnings():
        warnings.simplefilter("error", tactix.FallbackWarning)
        _plan_decode(wrapper)  # the same failure is not announced twice
    assert wrapper.backend == "good"


def test_explicit_backend_whose_default_fails_raises_without_fallback(third_party: None) -> None:
    wrapper = tactix.PagedDecode(device="cpu", backend="fast")
    with pytest.raises(tactix.BackendError, match="kernel exploded") as info:
        _plan_decode(wrapper)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_explicit_tactic_that_fails_its_check_raises_with_the_reason(third_party: None) -> None:
    wrapper = tactix.PagedDecode(device="cpu")
    with pytest.raises(tactix.UnsupportedProblemError, match="needs sm_100"):
        _plan_decode(wrapper, tactic=tactix.Tactic(backend="good", kernel="special"))


def test_stored_tactic_that_no_longer_validates_falls_back_to_that_backends_default(
    third_party: None,
) -> None:
    stored = tactix.Tactic(backend="good", kernel="special")
    set_tactic_source(lambda problem: stored)
    wrapper = tactix.PagedDecode(device="cpu", backend="good")
    with pytest.warns(tactix.FallbackWarning, match=r"good:special.*needs sm_100.*good's default"):
        _plan_decode(wrapper)
    assert wrapper.backend == "good" and wrapper.tactic.kernel == "plain"


def test_stored_tactic_of_a_missing_backend_warns_and_uses_the_untuned_choice(third_party: None) -> None:
    set_tactic_source(lambda problem: tactix.Tactic(backend="gone", kernel="x"))
    wrapper = tactix.PagedDecode(device="cpu", backend="auto")
    with pytest.warns(tactix.FallbackWarning) as caught:
        _plan_decode(wrapper)
    assert any("gone:x" in str(w.message) for w in caught)
    assert wrapper.backend == "good"


def test_stored_tactic_is_used_when_valid() -> None:
    tactic = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})
    set_tactic_source(lambda problem: tactic)
    try:
        wrapper = tactix.PagedDecode(device="cpu")
        _plan_decode(wrapper)
        assert wrapper.tactic == tactic and wrapper.selection_source == "store"
    finally:
        set_tactic_source(None)


@pytest.mark.parametrize("winner", ["untuned", "any"])
def test_the_store_names_a_tuned_choice_as_the_wrapper_does(tmp_path: Path, winner: str) -> None:
    """The tuned entry and the wrapper it serves print one tactic, also when the untuned choice
    (a backend's ``default``, which its plan resolves to a concrete kernel) wins."""
    min_speedup = 1e6 if winner == "untuned" else 1.01  # 1e6: no rival can beat the untuned choice
    policy = tactix.MeasurementPolicy(warmup=1, repeat=3, min_speedup=min_speedup)
    with tactix.autotune(mode="tune", cache_dir=tmp_path, policy=policy) as state:
        tuned = tactix.PagedDecode("HND", device="cpu")
        _plan_decode(tuned)
        assert state.store is not None
        [entry] = state.store.entries()
    assert not entry.tactic.is_default, f"the store names {entry.tactic}, a placeholder for another kernel"
    assert str(entry.tactic) == str(tuned.tactic)
    if winner == "untuned":
        assert entry.baseline.is_default and entry.speedup() == 1.0  # the untuned choice's own timing
    with tactix.autotune(mode="replay", cache_dir=tmp_path, policy=policy):
        served = tactix.PagedDecode("HND", device="cpu")
        _plan_decode(served)
    assert served.selection_source == "store" and served.tactic == entry.tactic


def test_cuda_graph_mode_rewrites_buffers_in_place_within_a_bucket() -> None:
    """With use_cuda_graph, a re-plan of the same shape bucket keeps every buffer's address.

    That is what lets a CUDA graph captured after the first plan replay later batches; the
    CPU run checks the addresses and the numbers, the GPU tests replay real graphs.
    """
    gen = torch.Generator().manual_seed(7)
    wrapper = tactix.PagedDecode("HND", device="cpu", use_cuda_graph=True)
    k = torch.randn(12, 2, 4, 16, generator=gen)
    v = torch.randn(12, 2, 4, 16, generator=gen)
    batches = [  # kv lengths 7 and 5, then 6 and 8: same batch size, same bucket (8)
        (i32(0, 2, 4), i32(3, 9, 0, 11), i32(3, 1)),
        (i32(0, 2, 4), i32(5, 1, 2, 6), i32(2, 4)),
    ]
    addresses = None
    for indptr, indices, last in batches:
        wrapper.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float32)
        plan = wrapper.plan_object
        now = [
            plan.page_table.data_ptr(),
            plan.q_index.data_ptr(),
            plan.out_index.data_ptr(),
            plan.mask.data_ptr(),
        ]
        addresses = addresses or now
        assert now == addresses
        q = torch.randn(2, 4, 16, generator=gen)
        ref, _ = attention_reference(
            q,
            k,
            v,
            i32(0, 1, 2),
            indptr,
            indices,
            last,
            kv_layout="HND",
            causal=False,
            sm_scale=1 / math.sqrt(16),
        )
        assert relative_error(wrapper.run(q, (k, v)), ref) < 1e-5
    with pytest.raises(tactix.UnsupportedProblemError, match="CUDA-graph mode"):
        wrapper.plan(i32(0, 1, 2, 3), i32(1, 2, 3), i32(1, 1, 1), 4, 2, 16, 4, q_data_type=torch.float32)


def test_a_replan_with_the_same_arguments_gives_the_problem_a_fresh_validation_gives() -> None:
    """The wrapper's memo of validated arguments: the problem of a re-plan equals (and hashes,
    keys and prints like) the one `attention_problem` builds from scratch for that batch."""
    from tactix.attention import attention_problem

    for op in ("decode", "prefill"):
        wrapper = (
            tactix.PagedDecode("NHD", device="cpu") if op == "decode" else tactix.PagedPrefill("NHD", device="cpu")
        )
        for lens in ([5, 40, 17], [300], [1, 2, 3, 4, 5, 6, 7, 8, 9]):
            pages = [-(-n // 16) for n in lens]
            indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
            kw = dict(device=torch.device("cpu"), kv_layout="NHD",
                      qo_indptr=None if op == "decode" else torch.tensor([0, *itertools.accumulate(lens)],
                                                                         dtype=torch.int32),
                      paged_kv_indptr=indptr, paged_kv_indices=torch.arange(int(indptr[-1]), dtype=torch.int32),
                      paged_kv_last_page_len=torch.tensor([(n - 1) % 16 + 1 for n in lens], dtype=torch.int32),
                      num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_vo=None, page_size=16,
                      causal=op == "prefill", sm_scale=None, window_left=-1, logits_soft_cap=None,
                      q_data_type=torch.float32, kv_data_type=None, o_data_type=None, return_lse=False)  # fmt: skip
            fresh, _ = attention_problem(op, **kw)  # type: ignore[arg-type]
            meta = (kw["paged_kv_indptr"], kw["paged_kv_indices"], kw["paged_kv_last_page_len"])
            if op == "prefill":
                wrapper.plan(kw["qo_indptr"], *meta, 8, 2, 64, 16, causal=True, q_data_type=torch.float32)
            else:
                wrapper.plan(*meta, 8, 2, 64, 16, q_data_type=torch.float32)
            remembered, batch = wrapper.problem, wrapper._batch
            assert remembered == fresh and hash(remembered) == hash(fresh)
            assert remembered.key_json() == fresh.key_json() and str(remembered) == str(fresh)
            assert remembered.batch_size == len(lens) and remembered.max_kv_len == max(lens)
            assert type(remembered) is type(fresh) and batch is not None and batch.batch_size == len(lens)
            if op == "decode":  # read like a prefill problem's, but not fields: keys are unchanged
                assert remembered.causal is False and remembered.max_qo_len == 1
                assert "causal" not in remembered.key() and "max_qo_len" not in remembered.key()
    # an argument of another type is validated again, not served from the memo
    with pytest.raises(tactix.InvalidArgumentError, match="num_qo_heads"):
        wrapper.plan(kw["qo_indptr"], *meta, 8.0, 2, 64, 16, causal=True, q_data_type=torch.float32)  # type: ignore[arg-type]
