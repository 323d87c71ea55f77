"""The fast re-plan (`tactix.selection.replan_selection`): a plan that offers ``replan`` makes the
next batch's plan when the static arguments, the backend argument and the first candidate are
the same; anything else, or a plan that declines or fails, goes down the full path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tactix
from tactix.autotune import autotune
from tactix.autotune.store import StoreEntry, write_atomically
from tactix.backends import torch as torch_backend
from tactix.registry import get_registry
from tactix.selection import set_tactic_source
from tactix.testing import attention_reference


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


MATH = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})


class Replannable:
    """A real torch-backend plan that also offers ``replan`` (which plans the batch through the
    torch backend's own hook, so outputs are real) and records how each plan was made."""

    def __init__(self, inner: Any, log: list[str], behaviour: dict[str, Any], hook: str) -> None:
        self.inner, self.log, self.behaviour, self.hook = inner, log, behaviour, hook
        self.tactic = inner.tactic
        self.built = False

    def run(self, *args: Any) -> None:
        self.inner.run(*args)

    def replan(self, problem: Any, batch: Any, options: Any) -> Replannable | None:
        self.log.append("replan")
        what = self.behaviour.get("replan", "plan")
        if what == "decline":
            return None
        if isinstance(what, BaseException):
            raise what
        inner = self.behaviour[self.hook](problem, batch, self.inner.tactic, unwrapped(options))
        if self.behaviour.get("in_place"):  # as the cudnn plugin's: the plan becomes the new batch's
            self.inner = inner
            return self
        return Replannable(inner, self.log, self.behaviour, self.hook)


def unwrapped(options: Any) -> Any:
    """The options with the torch backend's own plan as ``previous`` (its CUDA-graph re-plans read it)."""
    previous = options["previous"]
    return {**options, "previous": previous.inner} if isinstance(previous, Replannable) else options


@pytest.fixture
def replannable() -> Iterator[tuple[list[str], dict[str, Any]]]:
    """The torch backend's decode and prefill plans, made replannable; (log, behaviour).

    A plugin registered first on the torch backend's own plugin manager answers its plan hooks
    (pluggy's ``tryfirst``; the plan hooks are ``firstresult``) by wrapping the real plans."""
    set_tactic_source(None)
    manager = get_registry().get("torch").manager
    log: list[str] = []
    behaviour: dict[str, Any] = {
        "tactix_plan_decode": torch_backend.tactix_plan_decode,
        "tactix_plan_prefill": torch_backend.tactix_plan_prefill,
    }

    def planned(name: str, problem: Any, batch: Any, tactic: Any, options: Any) -> Any:
        made = behaviour[name](problem, batch, tactic, unwrapped(options))
        if made is None:
            return None
        log.append("hook")
        return Replannable(made, log, behaviour, name)

    class Wrapping:
        @tactix.hookimpl(tryfirst=True)
        def tactix_plan_decode(self, problem: Any, batch: Any, tactic: Any, options: Any) -> Any:
            return planned("tactix_plan_decode", problem, batch, tactic, options)

        @tactix.hookimpl(tryfirst=True)
        def tactix_plan_prefill(self, problem: Any, batch: Any, tactic: Any, options: Any) -> Any:
            return planned("tactix_plan_prefill", problem, batch, tactic, options)

    wrapping = Wrapping()
    manager.register(wrapping)
    try:
        yield log, behaviour
    finally:
        manager.unregister(wrapping)
        set_tactic_source(None)


def plan(wrapper: tactix.PagedDecode, last: int = 5, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """Two requests of 16 + ``last`` and 16 keys (one bucket for any ``last`` in 1..16)."""
    kwargs = {"q_data_type": torch.float32, **kwargs}
    metadata = (i32(0, 2, 3), i32(0, 1, 2), i32(last, 16))
    wrapper.plan(*metadata, 8, 2, 64, 16, **kwargs)
    return metadata


def check_output(wrapper: tactix.PagedDecode, metadata: tuple[torch.Tensor, ...]) -> None:
    gen = torch.Generator().manual_seed(int(metadata[2][0]))
    q = torch.randn(2, 8, 64, generator=gen)
    k, v = torch.randn(3, 16, 2, 64, generator=gen), torch.randn(3, 16, 2, 64, generator=gen)
    out = wrapper.run(q, (k, v))
    assert isinstance(out, torch.Tensor)
    ref = attention_reference(q, k, v, i32(0, 1, 2), *metadata, kv_layout="NHD", causal=False,
                              sm_scale=wrapper.problem.sm_scale)  # fmt: skip
    ref_out = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(out, ref_out.to(out.dtype), rtol=1e-4, atol=1e-4)


def test_re_plans_of_the_same_static_arguments_take_the_plans_fast_path(replannable: Any) -> None:
    log, _ = replannable
    wrapper = tactix.PagedDecode(device="cpu")
    tactix.reset_stats()
    check_output(wrapper, plan(wrapper))
    for last in (6, 7, 16):  # new batches of the same bucket
        check_output(wrapper, plan(wrapper, last))
        assert wrapper.selection_source == "default" and wrapper.backend == "torch"
    assert log == ["hook", "replan", "replan", "replan"]
    assert tactix.stats()["plans"] == 4  # fast re-plans are counted as plans


def test_a_declined_or_failed_replan_goes_down_the_full_path(replannable: Any) -> None:
    log, behaviour = replannable
    wrapper = tactix.PagedDecode(device="cpu")
    plan(wrapper)
    behaviour["replan"] = "decline"
    check_output(wrapper, plan(wrapper, 6))
    behaviour["replan"] = RuntimeError("the fast path broke")
    check_output(wrapper, plan(wrapper, 7))
    assert log == ["hook", "replan", "hook", "replan", "hook"]
    behaviour["replan"] = tactix.InvalidArgumentError("paged_kv_indices", "in range", "index 99")
    with pytest.raises(tactix.InvalidArgumentError, match="paged_kv_indices"):
        plan(wrapper, 8)


def test_other_static_arguments_an_explicit_tactic_or_backend_take_the_full_path(replannable: Any) -> None:
    log, _ = replannable
    wrapper = tactix.PagedDecode(device="cpu")
    plan(wrapper)
    plan(wrapper, 6, sm_scale=0.5)  # another static argument
    plan(wrapper, 7, sm_scale=0.5)  # ... whose own re-plan is fast
    assert log == ["hook", "hook", "replan"]
    log.clear()
    plan(wrapper, 8, sm_scale=0.5, tactic=MATH)  # an explicit tactic: planned and checked every time
    plan(wrapper, 9, sm_scale=0.5, tactic=MATH)
    assert log == ["hook", "hook"] and wrapper.selection_source == "explicit"
    log.clear()
    plan(wrapper, 10, sm_scale=0.5)  # no tactic again: the full path once, then fast
    plan(wrapper, 11, sm_scale=0.5, backend="torch")  # another backend argument
    plan(wrapper, 12, sm_scale=0.5, backend="torch")
    assert log == ["hook", "hook", "replan"]


def test_store_misses_replan_fast_until_a_stored_tactic_appears(replannable: Any, tmp_path: Path) -> None:
    """A store miss (the untuned choice of a server whose store lacks this bucket) re-plans fast
    while a look on disk still finds no entry; an entry another process writes meanwhile (no
    write through this process) and one written here are each selected at the next plan."""
    log, _ = replannable
    wrapper = tactix.PagedDecode(device="cpu")
    explicit = tactix.Tactic(backend="torch", kernel="explicit")

    def entry(tactic: tactix.Tactic) -> StoreEntry:
        problem = wrapper.problem
        assert state.store is not None
        return StoreEntry(op=problem.op, key=problem.key(), key_hash=problem.key_hash(), tactic=tactic,
                          baseline=tactix.Tactic.default("torch"), env_hash=state.store.env_hash)  # fmt: skip

    with autotune(mode="replay", cache_dir=tmp_path) as state:
        assert state.store is not None and state.store.reads_disk
        tactix.reset_stats()
        plan(wrapper)
        check_output(wrapper, plan(wrapper, 6))  # a miss, looked up on disk again: still a miss
        plan(wrapper, 7)
        assert log == ["hook", "replan", "replan"] and wrapper.selection_source == "default"
        assert tactix.stats()["store_misses"] == 3  # every plan asked the store
        # another process tunes this bucket: its entry file appears, this process's epoch stays
        made = entry(MATH)
        write_atomically(state.store.path / "entries" / made.op / f"{made.key_hash}.json", made.to_json())
        plan(wrapper, 8)  # the look on disk finds it: selected again, and the stored tactic wins
        plan(wrapper, 9)  # a hit is remembered: re-planned fast
        assert log[3:] == ["hook", "replan"]
        assert wrapper.selection_source == "store" and wrapper.tactic == MATH
        state.store.put(entry(explicit))  # a re-tune in this process
        plan(wrapper, 10)
        assert log[5:] == ["hook"] and wrapper.tactic == explicit
    plan(wrapper, 11)  # outside the block: no store, selected again
    plan(wrapper, 12)
    assert log[6:] == ["hook", "replan"] and wrapper.selection_source == "default"
    set_tactic_source(lambda problem: None)  # a new source: selected again
    plan(wrapper, 13)
    assert log[8:] == ["hook"]


def test_a_new_bucket_is_selected_again(replannable: Any) -> None:
    log, _ = replannable
    wrapper = tactix.PagedDecode(device="cpu")
    plan(wrapper)
    wrapper.plan(i32(0, 3), i32(0, 1, 2), i32(5), 8, 2, 64, 16, q_data_type=torch.float32)  # one request
    assert log == ["hook", "hook"]


def test_a_plan_kept_by_its_replan_serves_a_batch_of_other_rows(replannable: Any) -> None:
    """A re-plan that keeps its plan object (as cudnn's does) with another number of query rows
    in the same bucket: run() takes the new batch's q shape and refuses the old one."""
    log, behaviour = replannable
    behaviour["in_place"] = True
    wrapper = tactix.PagedPrefill(device="cpu")
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 16, 2, 64, generator=gen), torch.randn(4, 16, 2, 64, generator=gen)
    outputs = []
    for q_lens in ([5, 2], [6, 2]):  # 7 then 8 query rows: one bucket (8 rows, longest q 8)
        qo = i32(0, q_lens[0], sum(q_lens))
        metadata = (qo, i32(0, 2, 4), i32(0, 1, 2, 3), i32(16, 16))
        wrapper.plan(*metadata, 8, 2, 64, 16, q_data_type=torch.float32, causal=True)
        q = torch.randn(sum(q_lens), 8, 64, generator=gen)
        out = wrapper.run(q, (k, v))
        assert isinstance(out, torch.Tensor)
        ref, _ = attention_reference(q, k, v, *metadata, kv_layout="NHD", causal=True,
                                     sm_scale=wrapper.problem.sm_scale)  # fmt: skip
        torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-4, atol=1e-4)
        outputs.append(wrapper.plan_object)
    assert log == ["hook", "replan"] and outputs[0] is outputs[1]
    with pytest.raises(tactix.InvalidArgumentError, match="q"):
        wrapper.run(torch.randn(7, 8, 64), (k, v))


def test_after_a_declined_replan_a_cuda_graph_wrapper_takes_the_fast_path_again(replannable: Any) -> None:
    """In CUDA-graph mode a declined re-plan goes through the full path's graph branch (same
    backend and tactic); the plan it makes still offers the fast path to the next batch."""
    log, behaviour = replannable
    wrapper = tactix.PagedDecode(device="cpu", use_cuda_graph=True)
    check_output(wrapper, plan(wrapper))
    behaviour["replan"] = "decline"
    check_output(wrapper, plan(wrapper, 6))
    behaviour["replan"] = "plan"
    check_output(wrapper, plan(wrapper, 7))
    assert log == ["hook", "replan", "hook", "replan"]
