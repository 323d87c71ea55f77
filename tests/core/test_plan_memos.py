"""What a re-plan remembers (static problem, capability reasons, stored tactics) and what makes it
ask again: a store write, a new tactic source, an ``autotune`` block, another static field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tactix
from tactix.autotune import autotune
from tactix.autotune.store import StoreEntry, TacticStore, write_atomically
from tactix.capabilities import BackendSpec
from tactix.ops import AttentionCapabilities, DecodeProblem, Problem
from tactix.registry import Backend, BackendRecord, plugin_manager
from tactix.selection import set_tactic_source


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


MATH = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})


@pytest.fixture(autouse=True)
def no_source() -> Iterator[None]:
    set_tactic_source(None)
    yield
    set_tactic_source(None)


def plan(wrapper: tactix.PagedDecode, last: int = 5, **kwargs: object) -> None:
    """Two requests of 16 + ``last`` and 16 keys (one bucket for any ``last`` in 1..16)."""
    kwargs = {"q_data_type": torch.float32, **kwargs}
    wrapper.plan(i32(0, 2, 3), i32(0, 1, 2), i32(last, 16), 8, 2, 64, 16, **kwargs)  # type: ignore[arg-type]


def entry(problem: Problem, tactic: tactix.Tactic, store: TacticStore) -> StoreEntry:
    return StoreEntry(op=problem.op, key=problem.key(), key_hash=problem.key_hash(), tactic=tactic,
                      baseline=tactix.Tactic.default(tactic.backend), env_hash=store.env_hash)  # fmt: skip


def test_a_store_write_after_a_plan_changes_the_next_plans_choice(tmp_path: Path) -> None:
    explicit = tactix.Tactic(backend="torch", kernel="explicit")
    wrapper = tactix.PagedDecode(device="cpu")
    with autotune(mode="replay", cache_dir=tmp_path) as state:
        assert state.store is not None
        plan(wrapper)
        assert wrapper.selection_source == "default"
        state.store.put(entry(wrapper.problem, explicit, state.store))
        tactix.reset_stats()
        for last in (6, 7, 8):  # new batches of the same bucket
            plan(wrapper, last)
            assert wrapper.selection_source == "store" and wrapper.tactic == explicit
        assert tactix.stats()["store_hits"] == 3  # remembered, and still counted per plan
        state.store.put(entry(wrapper.problem, MATH, state.store))  # a re-tune, say
        plan(wrapper, 9)
        assert wrapper.selection_source == "store" and wrapper.tactic == MATH
        state.store.adopt([entry(wrapper.problem, explicit, state.store)])  # rank 0's view, say
        plan(wrapper, 10)
        assert wrapper.selection_source == "store" and wrapper.tactic == explicit


def test_a_miss_looks_on_disk_every_time_for_entries_other_processes_wrote(tmp_path: Path) -> None:
    wrapper = tactix.PagedDecode(device="cpu")
    with autotune(mode="replay", cache_dir=tmp_path) as state:
        assert state.store is not None
        plan(wrapper)
        plan(wrapper, 6)
        assert wrapper.selection_source == "default"
        # what another process's put leaves: the file, and no write through this store
        problem = wrapper.problem
        write_atomically(state.store.path / "entries" / "decode" / f"{problem.key_hash()}.json",
                         entry(problem, MATH, state.store).to_json())  # fmt: skip
        plan(wrapper, 7)
        assert wrapper.selection_source == "store" and wrapper.tactic == MATH


def test_a_new_tactic_source_after_a_plan_changes_the_next_plans_choice() -> None:
    wrapper = tactix.PagedDecode(device="cpu")
    plan(wrapper)
    untuned = wrapper.tactic
    set_tactic_source(lambda problem: MATH)
    plan(wrapper, 6)
    assert wrapper.selection_source == "store" and wrapper.tactic == MATH
    set_tactic_source(None)
    plan(wrapper, 7)
    assert wrapper.selection_source == "default" and wrapper.tactic == untuned


def test_a_source_is_asked_once_per_bucket_and_backend() -> None:
    asked: list[tuple[int, int]] = []

    def source(problem: Problem) -> tactix.Tactic | None:
        assert isinstance(problem, DecodeProblem)
        asked.append((problem.batch_size, problem.max_kv_len))
        return MATH

    set_tactic_source(source)
    wrapper = tactix.PagedDecode(device="cpu")
    for last in (5, 6, 7):
        plan(wrapper, last)
    assert asked == [(2, 21)]
    plan(wrapper, 5, backend="torch")  # another backend argument: asked again
    wrapper.plan(i32(0, 3), i32(0, 1, 2), i32(5), 8, 2, 64, 16, q_data_type=torch.float32)  # another bucket
    assert asked == [(2, 21), (2, 21), (1, 37)]
    assert wrapper.selection_source == "store"


def test_entering_and_leaving_an_autotune_block_changes_the_choice(tmp_path: Path) -> None:
    wrapper = tactix.PagedDecode(device="cpu")
    plan(wrapper)
    outside = (wrapper.selection_source, wrapper.tactic)
    with autotune(mode="replay", cache_dir=tmp_path) as state:
        assert state.store is not None
        state.store.put(entry(wrapper.problem, MATH, state.store))
    with autotune(mode="replay", cache_dir=tmp_path):
        plan(wrapper, 6)
        assert wrapper.selection_source == "store" and wrapper.tactic == MATH
    plan(wrapper, 7)
    assert (wrapper.selection_source, wrapper.tactic) == outside


def test_a_problem_differing_in_one_static_field_is_not_served_from_the_memos() -> None:
    set_tactic_source(lambda problem: MATH if isinstance(problem, DecodeProblem) and problem.sm_scale == 0.25 else None)
    wrapper = tactix.PagedDecode(device="cpu")
    plan(wrapper, sm_scale=0.25)
    assert wrapper.selection_source == "store"
    plan(wrapper, 6, sm_scale=0.5)
    assert wrapper.selection_source == "default" and wrapper.problem.sm_scale == 0.5
    plan(wrapper, 7, sm_scale=0.25)
    assert wrapper.selection_source == "store" and wrapper.problem.sm_scale == 0.25
    # every static argument reaches the problem of a re-plan, not the remembered one's value
    for changed, field, value in (({"return_lse": True}, "return_lse", True),
                                  ({"window_left": 3}, "window_left", 3),
                                  ({"logits_soft_cap": 2.0}, "logits_soft_cap", 2.0),
                                  ({"deterministic": False}, "deterministic", False),
                                  ({"q_data_type": torch.bfloat16}, "q_dtype", "bfloat16")):  # fmt: skip
        plan(wrapper, 8, **changed)
        assert getattr(wrapper.problem, field) == value
        plan(wrapper, 9)
        assert wrapper.problem == DecodeProblem.model_validate({**wrapper.problem.__dict__})
        assert getattr(wrapper.problem, field) != value


def test_capability_reasons_are_remembered_per_static_problem_only() -> None:
    caps = AttentionCapabilities(devices=frozenset({"cpu"}), q_dtypes=frozenset({"float32"}),
                                 kv_dtypes=frozenset({"float32"}), out_dtypes=frozenset({"float32"}), head_dims=None,
                                 page_sizes=None, kv_layouts=frozenset({"NHD"}))  # fmt: skip
    spec = BackendSpec(name="picky", version="1", decode=caps)
    backend = Backend(
        record=BackendRecord("picky", None, None, "x:y", "active", spec=spec), spec=spec, manager=plugin_manager()
    )
    tactic = tactix.Tactic.default("picky")
    problem = DecodeProblem(device_type="cpu", num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64,
                            page_size=16, kv_layout="NHD", q_dtype="float32", kv_dtype="float32",
                            out_dtype="float32", sm_scale=0.125, window_left=-1, logits_soft_cap=0.0,
                            return_lse=False, batch_size=2, max_kv_len=21)  # fmt: skip
    assert backend.check(problem, tactic) == []
    assert backend.check(problem.model_copy(update={"batch_size": 64, "max_kv_len": 9000}), tactic) == []
    assert backend.check(problem.model_copy(update={"kv_layout": "HND"}), tactic) == ["kv layout HND not in {NHD}"]
    assert backend.check(problem.model_copy(update={"window_left": 3}), tactic) == [
        "sliding window (window_left >= 0) not supported"
    ]
    assert backend.check(problem.model_copy(update={"q_dtype": "bfloat16"}), tactic) == [
        "q dtype bfloat16 not in {float32}"
    ]
    assert backend.check(problem, tactic) == []


def test_an_unhashable_static_argument_is_named_not_a_type_error() -> None:
    wrapper = tactix.PagedDecode(device="cpu")
    plan(wrapper)
    with pytest.raises(tactix.InvalidArgumentError, match="num_qo_heads"):
        wrapper.plan(i32(0, 2, 3), i32(0, 1, 2), i32(5, 16), [8], 2, 64, 16)  # type: ignore[arg-type]
    with pytest.raises(tactix.InvalidArgumentError, match="q_data_type"):
        plan(wrapper, q_data_type=["bf16"])


def test_declared_compute_capabilities_are_enforced_by_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend declaring compute capabilities is refused, by core and with the reason, on a GPU
    outside them (the capability query is the one thing stood in for: this machine has no GPU)."""
    from tactix import capabilities

    caps = AttentionCapabilities(devices=frozenset({"cuda"}), compute_capabilities=frozenset({"9.0"}),
                                 q_dtypes=frozenset({"bfloat16"}), kv_dtypes=frozenset({"bfloat16"}),
                                 out_dtypes=frozenset({"bfloat16"}), head_dims=None, page_sizes=None,
                                 kv_layouts=frozenset({"HND"}))  # fmt: skip
    problem = DecodeProblem(device_type="cuda", num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64,
                            page_size=16, kv_layout="HND", q_dtype="bfloat16", kv_dtype="bfloat16",
                            out_dtype="bfloat16", sm_scale=0.125, window_left=-1, logits_soft_cap=0.0,
                            return_lse=False, batch_size=2, max_kv_len=21)  # fmt: skip
    monkeypatch.setattr(capabilities, "compute_capability", lambda: (8, 0))
    assert caps.reasons(problem) == ["compute capability 8.0 not in {9.0}"]
    monkeypatch.setattr(capabilities, "compute_capability", lambda: (9, 0))
    assert caps.reasons(problem) == []
    monkeypatch.setattr(capabilities, "compute_capability", lambda: None)  # no GPU: the environment says so
    assert caps.reasons(problem) == []
