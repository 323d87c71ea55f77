"""Tuning: broken tactics never win, tuning never slows a shape down, replay never measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tactix
from tactix.autotune.store import StoreEntry, TacticStore
from tests.plugin_fixtures import heating_plugin, plugins_on_path, tuning_plugin, write_distribution

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
QUICK = tactix.MeasurementPolicy(warmup=1, repeat=3)


def plan_decode(wrapper: tactix.PagedDecode) -> None:
    wrapper.plan(i32(0, 2, 5), i32(0, 1, 2, 3, 4), i32(5, 16), 8, 2, 64, 16, q_data_type=torch.float32)


def stored_entries(root: Path) -> list[StoreEntry]:
    [env_dir] = TacticStore.environments(root)
    return TacticStore.open(env_dir).attach().entries()


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Iterator[Path]:
    site = tmp_path / "site"
    write_distribution(site, "tactix-tuner", "1.0", {"tuner": "tx_tuner"}, {"tx_tuner": tuning_plugin("tuner")})
    with plugins_on_path(site):
        yield site


def test_tactics_that_raise_lie_or_compute_wrong_results_never_win(tmp_path: Path, plugin_dir: Path) -> None:
    tactix.reset_stats()
    with tactix.autotune(mode="tune", cache_dir=tmp_path / "store", policy=QUICK):
        wrapper = tactix.PagedDecode("HND", device="cpu")
        plan_decode(wrapper)
    [entry] = stored_entries(tmp_path / "store")
    by_kernel = {(c.tactic.backend, c.tactic.kernel): c for c in entry.candidates}
    assert by_kernel[("tuner", "boom")].status == "failed"
    assert "illegal instruction in kernel boom" in (by_kernel[("tuner", "boom")].reason or "")
    assert by_kernel[("tuner", "liar")].status == "failed"
    assert "the plan runs tuner:good" in (by_kernel[("tuner", "liar")].reason or "")
    assert by_kernel[("tuner", "wrong")].status == "failed"
    assert "wrong result" in (by_kernel[("tuner", "wrong")].reason or "")
    assert all(c.median_s is None for c in entry.candidates if c.status == "failed")  # never timed
    assert entry.tactic.kernel not in ("boom", "liar", "wrong")
    assert entry.baseline == tactix.Tactic.default("tuner")  # the untuned choice: highest preference
    assert tactix.stats()["candidates_failed"] >= 3
    # the wrapper runs the winner, and the result is right
    assert wrapper.tactic.kernel not in ("boom", "liar", "wrong")


def test_a_backend_whose_default_fails_is_skipped_with_the_reason(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_distribution(site, "tactix-broken-default", "1.0", {"brokendefault": "tx_bd"},
                       {"tx_bd": tuning_plugin("brokendefault", default_fails=True)})  # fmt: skip
    with plugins_on_path(site), tactix.autotune(mode="tune", cache_dir=tmp_path / "store", policy=QUICK):
        wrapper = tactix.PagedDecode("HND", device="cpu")
        plan_decode(wrapper)
    [entry] = stored_entries(tmp_path / "store")
    results = [c for c in entry.candidates if c.tactic.backend == "brokendefault"]
    assert results[0].status == "failed" and "default kernel unavailable" in (results[0].reason or "")
    assert all(c.status == "skipped" and "default failed" in (c.reason or "") for c in results[1:])
    # the winner is whichever working backend measured fastest (torch or the example 'naive'), never
    # the broken one; the untuned choice it had to beat is auto's first backend
    assert entry.baseline == tactix.Tactic.default("torch")
    ok = {c.ran or c.tactic for c in entry.candidates if c.status == "ok"}  # a default is stored as what it ran
    assert entry.tactic.backend != "brokendefault" and entry.tactic in ok
    assert wrapper.backend == entry.tactic.backend


def test_a_winner_must_beat_the_untuned_choice(tmp_path: Path) -> None:
    policy = tactix.MeasurementPolicy(warmup=1, repeat=3, min_speedup=1e6)
    with tactix.autotune(mode="tune", cache_dir=tmp_path, policy=policy):
        plan_decode(tactix.PagedDecode("HND", device="cpu"))
    [entry] = stored_entries(tmp_path)
    assert entry.tactic == next(c.ran for c in entry.candidates if c.tactic == entry.baseline)
    assert sum(c.status == "ok" for c in entry.candidates) >= 2  # there were rivals; none was 1e6x faster


def test_a_stored_tactic_that_no_longer_validates_falls_back_once(tmp_path: Path) -> None:
    with tactix.autotune(mode="tune", cache_dir=tmp_path, policy=QUICK) as state:
        plan_decode(tactix.PagedDecode("HND", device="cpu"))
        assert state.store is not None
        [entry] = state.store.entries()
        # SDPA flash takes no mask, so it cannot serve this ragged batch
        flash = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "flash"})
        state.store.put(entry.model_copy(update={"tactic": flash}))
    with tactix.autotune(mode="replay", cache_dir=tmp_path, policy=QUICK):
        wrapper = tactix.PagedDecode("HND", device="cpu")
        with pytest.warns(tactix.FallbackWarning, match=r"torch:sdpa\(impl=flash\).*takes no mask.*torch's default"):
            plan_decode(wrapper)
        assert wrapper.tactic.kernel == "explicit"
        with warnings.catch_warnings():
            warnings.simplefilter("error", tactix.FallbackWarning)
            plan_decode(wrapper)  # the same cause is not announced twice


def test_ragged_prefill_is_tuned_stored_under_its_op_and_replayed(tmp_path: Path) -> None:
    """The tuner times every tactic that serves a ragged-KV problem on random packed k and v, and
    the store files the winner under the op's folder, where replay finds it."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(9, 4, 32, generator=gen), torch.randn(12, 2, 32, generator=gen), torch.randn(12, 2, 32)

    def plan(wrapper: tactix.RaggedPrefill) -> None:
        wrapper.plan(i32(0, 7, 9), i32(0, 7, 12), 4, 2, 32, causal=True, q_data_type=torch.float32)

    with tactix.autotune(mode="tune", cache_dir=tmp_path, policy=QUICK):
        tuned = tactix.RaggedPrefill(device="cpu")
        plan(tuned)
    [entry] = stored_entries(tmp_path)
    [env_dir] = TacticStore.environments(tmp_path)
    assert (
        entry.op == "ragged_prefill" and (env_dir / "entries" / "ragged_prefill" / f"{entry.key_hash}.json").is_file()
    )
    measured = {str(c.tactic) for c in entry.candidates if c.status == "ok"}
    assert {"torch:default", "torch:sdpa(impl=math)"} <= measured  # each compared with the untuned choice
    with tactix.autotune(mode="replay", cache_dir=tmp_path, policy=QUICK):
        replayed = tactix.RaggedPrefill(device="cpu")
        plan(replayed)
    assert replayed.selection_source == "store" and replayed.tactic == entry.tactic
    assert torch.allclose(replayed.run(q, k, v), tuned.run(q, k, v), atol=1e-5)  # type: ignore[arg-type]


SERVE = textwrap.dedent(
    """
    import json, sys, torch, tactix
    mode, root = sys.argv[1], sys.argv[2]
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    policy = tactix.MeasurementPolicy(warmup=1, repeat=3)
    chosen = {}
    with tactix.autotune(mode=mode, cache_dir=root, policy=policy):
        for lens in ((5, 16), (16, 16, 3)):
            n = len(lens)
            indptr = i32(*range(0, 2 * n + 1, 2))
            d = tactix.PagedDecode("HND", device="cpu")
            d.plan(indptr, i32(*range(2 * n)), i32(*lens), 8, 2, 64, 16, q_data_type=torch.float32)
            chosen[str(d.problem)] = d.tactic.to_json()
        p = tactix.PagedPrefill("NHD", device="cpu")
        p.plan(i32(0, 7, 9), i32(0, 1, 2), i32(0, 1), i32(7, 8), 4, 4, 32, 8, causal=True, q_data_type=torch.bfloat16)
        chosen[str(p.problem)] = p.tactic.to_json()
        r = tactix.RaggedPrefill(device="cpu")
        r.plan(i32(0, 7, 9), i32(0, 7, 12), 4, 2, 32, causal=True, q_data_type=torch.bfloat16)
        chosen[str(r.problem)] = r.tactic.to_json()
        g = tactix.Gemm(device="cpu")
        g.plan(12, 96, 64, a_dtype=torch.bfloat16)
        chosen[str(g.problem)] = g.tactic.to_json()
    print(json.dumps({"chosen": chosen, "stats": tactix.stats()}))
    """
)


def test_replay_in_a_fresh_process_serves_the_same_choices_without_measuring(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(SERVE)

    def serve(mode: str) -> dict[str, dict[str, object]]:
        done = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "store")], capture_output=True,
                              text=True, check=True)  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    tuned = serve("tune")
    assert tuned["stats"]["tuned_problems"] == 5 and tuned["stats"]["timer_calls"] > 0
    replayed = serve("replay")
    assert replayed["chosen"] == tuned["chosen"]
    assert replayed["stats"]["timer_calls"] == 0 and replayed["stats"]["tuned_problems"] == 0
    assert replayed["stats"]["store_hits"] == 5 and replayed["stats"]["store_misses"] == 0


def test_outside_a_block_serving_uses_the_default_store_and_never_measures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TACTIX_CACHE_DIR", str(tmp_path))
    with tactix.autotune(mode="tune", policy=tactix.MeasurementPolicy(warmup=1, repeat=3, cold_l2=True)):
        pass  # a block with another policy lives in another environment: not used below
    with tactix.autotune(mode="tune"):
        plan_decode(tactix.PagedDecode("HND", device="cpu"))
    tactix.reset_stats()
    wrapper = tactix.PagedDecode("HND", device="cpu")
    plan_decode(wrapper)
    assert wrapper.selection_source == "store"
    counts = tactix.stats()
    assert counts["timer_calls"] == 0 and counts["store_hits"] == 1
    other = tactix.PagedDecode("HND", device="cpu")
    other.plan(i32(0, 1), i32(0), i32(3), 8, 2, 64, 16, q_data_type=torch.float32)  # a bucket never tuned
    assert other.selection_source == "default" and tactix.stats()["timer_calls"] == 0
    assert os.environ["TACTIX_CACHE_DIR"] == str(tmp_path)


def test_stats_count_plans_builds_hits_misses_and_fallbacks(tmp_path: Path, plugin_dir: Path) -> None:
    tactix.reset_stats()
    wrapper = tactix.PagedDecode("HND", device="cpu", backend="tuner")
    plan_decode(wrapper)  # this plugin's plans report a build (a JIT compile, say)
    plan_decode(wrapper)
    counts = tactix.stats()
    assert counts["plans"] == 2 and counts["builds"] == 2
    with tactix.autotune(mode="replay", cache_dir=tmp_path, policy=QUICK) as state:
        plan_decode(tactix.PagedDecode("HND", device="cpu", backend="torch"))
        counts = tactix.stats()
        assert counts["store_misses"] == 1 and counts["store_hits"] == 0 and counts["timer_calls"] == 0
        assert state.store is not None
        problem = tactix.PagedDecode("HND", device="cpu", backend="torch")
        plan_decode(problem)
        flash = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "flash"})  # refused: ragged batch
        state.store.put(
            StoreEntry(
                op="decode",
                key=problem.problem.key(),
                key_hash=problem.problem.key_hash(),
                tactic=flash,
                baseline=tactix.Tactic.default("torch"),
                env_hash=state.store.env_hash,
            )
        )
        with warnings.catch_warnings():  # announced once per process; another test may have seen it
            warnings.simplefilter("ignore", tactix.FallbackWarning)
            plan_decode(tactix.PagedDecode("HND", device="cpu", backend="torch"))
    counts = tactix.stats()
    assert counts["store_hits"] == 1 and counts["fallbacks"] == 1


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"mode": "fast"}, "'mode'"),
        ({"timeout": -1}, "'timeout'"),
        ({"timeout": "60"}, "'timeout'"),
        ({"policy": {"repeat": 3}}, "'policy'"),
        ({"cache_dir": 123}, "'cache_dir'"),
        ({"cache_dir": ""}, "'cache_dir'"),
    ],
    ids=["mode", "negative-timeout", "timeout-str", "policy-dict", "cache-dir-int", "cache-dir-empty"],
)
def test_bad_autotune_arguments_are_refused_before_any_store_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object], argument: str
) -> None:
    monkeypatch.chdir(tmp_path)  # an empty cache_dir would have meant the working directory
    monkeypatch.setenv("TACTIX_CACHE_DIR", str(tmp_path / "default"))
    with pytest.raises(tactix.InvalidArgumentError, match=argument), tactix.autotune(**kwargs):  # type: ignore[arg-type]
        pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("final_round", [True, False], ids=["final-round", "first-pass-only"])
def test_the_winner_is_decided_by_timing_the_contenders_against_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, final_round: bool
) -> None:
    """A card that slows down as it runs (it heats) favours whichever candidate the first pass
    timed first. The final round times the fastest candidates and the untuned choice against each
    other, back and forth, so the one that is faster on the same card wins; timed one after the
    other only, the slower kernel would have won."""
    import types

    from tactix.autotune import timing, tuner

    site = tmp_path / "site"
    plugin = heating_plugin("heating")
    write_distribution(site, "tactix-heating", "1.0", {"heating": "tx_heating"}, {"tx_heating": plugin})
    monkeypatch.setenv("TACTIX_DISABLE_BACKENDS", "torch,naive")  # their kernels would not move the fake clock
    with plugins_on_path(site):
        import tx_heating  # type: ignore[import-not-found]

        monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=tx_heating.now))
        if not final_round:
            monkeypatch.setattr(tuner, "interleaved", lambda calls, *_: [None] * len(calls))
        policy = tactix.MeasurementPolicy(warmup=1, repeat=5)
        with tactix.autotune(mode="tune", cache_dir=tmp_path / "store", policy=policy):
            wrapper = tactix.PagedDecode("HND", device="cpu")
            plan_decode(wrapper)
    [entry] = stored_entries(tmp_path / "store")
    ok = {c.ran or c.tactic: c for c in entry.candidates if c.status == "ok"}
    fast, plain = (ok[tactix.Tactic(backend="heating", kernel=k)] for k in ("fast", "plain"))
    assert fast.median_s is not None and plain.median_s is not None
    if final_round:
        assert entry.tactic.kernel == "fast" and wrapper.tactic.kernel == "fast"
        assert fast.median_s < plain.median_s and fast.samples == plain.samples == 2 * 5  # two rounds of 5
    else:  # the counterfactual: the first pass alone picks the kernel it happened to time first
        assert entry.tactic.kernel == "plain" and fast.median_s > plain.median_s


@pytest.mark.parametrize(("execution", "device", "order"), [
    ("eager", "cuda", ["device_bound", "host_bound"]),
    ("cuda_graph", "cuda", ["host_bound", "device_bound"]),
    ("eager", "cpu", ["host_bound", "device_bound"]),
])  # fmt: skip
def test_the_eager_final_round_charges_a_call_the_longer_of_its_device_and_host_times(
    monkeypatch: pytest.MonkeyPatch, execution: str, device: str, order: list[str]
) -> None:
    """Under the eager policy on a GPU a contender's median is max(device time, host time): a
    tactic that launches more (host-bound: 4 us on the device, 14 us of host a call) loses to one
    that does not (6 us device, 10 us host), as an eager caller pays it; replayed from CUDA graphs,
    or on the CPU where the timer already reads the caller's thread, device times alone decide.
    The timer and the host clock are given (`interleaved`, `host_us`): the rule, not a GPU, is tested."""
    from tactix.autotune import tuner
    from tactix.autotune.store import CandidateResult

    def host_bound() -> None: ...
    def device_bound() -> None: ...

    device_s = {host_bound: 4e-6, device_bound: 6e-6}
    host_us = {host_bound: 14.0, device_bound: 10.0}
    monkeypatch.setattr(tuner, "interleaved", lambda calls, *_: [[device_s[c]] * 6 for c in calls])
    monkeypatch.setattr(tuner, "host_us", lambda call, _device: host_us[call])
    results = [CandidateResult(tactic=tactix.Tactic(backend="x", kernel=k), status="ok", median_s=1.0, samples=1)
               for k in ("host_bound", "device_bound")]  # fmt: skip
    policy = tactix.MeasurementPolicy(execution=execution)  # type: ignore[arg-type]
    final = tuner._final_round(results, {0: host_bound, 1: device_bound}, torch.device(device), policy)
    assert [r.tactic.kernel for r in sorted(final, key=lambda r: r.median_s or 0.0)] == order
    if execution == "eager" and device == "cuda":
        assert [r.median_s for r in final] == pytest.approx([14e-6, 10e-6])
