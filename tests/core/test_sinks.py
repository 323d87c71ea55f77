"""Attention sinks (``run(..., sinks=...)``, gpt-oss): a logit per query head joining each row's
softmax with no value. The torch backend against the float64 oracle on every attention op, the
LSE that includes the sinks so a chunked prefill merges exactly, bad sinks named, a backend that
does not declare them refusing with the ones that do, and FlashInfer's compat run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tactix
from tactix.autotune.context import current
from tactix.compat import flashinfer as fi
from tactix.testing.oracle import attention_reference, ragged_reference, relative_error
from tests.core.test_run_extras import NO_EXTRAS
from tests.plugin_fixtures import plugins_on_path, write_distribution

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
HQ, HKV, D, PAGE = 8, 2, 32, 4
SCALE = 1 / math.sqrt(D)


def _paged(kv_lens: tuple[int, ...], seed: int = 0) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(kv_indptr, kv_indices, last_page_len) and an HND cache (k, v) holding those requests."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in kv_lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    total = indptr[-1] + 2  # two pages no request owns
    indices = torch.randperm(total, generator=gen)[: indptr[-1]].to(torch.int32)
    last = [(n - 1) % PAGE + 1 for n in kv_lens]
    k = torch.randn(total, HKV, PAGE, D, generator=gen)
    v = torch.randn(total, HKV, PAGE, D, generator=gen)
    return (i32(*indptr), indices, i32(*last)), (k, v)


def _sinks(seed: int = 1) -> torch.Tensor:
    return torch.rand(HQ, generator=torch.Generator().manual_seed(seed)) * 7 - 1


@pytest.mark.parametrize("sdpa", [False, True], ids=["default", "sdpa"])
def test_decode_and_prefill_with_sinks_match_the_oracle_with_the_sinks_in_the_lse(sdpa: bool) -> None:
    """The torch backend's SDPA tactics have no sink term (nor an LSE): a call with sinks takes its
    explicit path, whatever the tactic."""
    meta, cache = _paged((13, 3, 9))
    sinks = _sinks()
    chosen = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "math"}) if sdpa else None
    with_lse = not sdpa
    gen = torch.Generator().manual_seed(5)
    decode = tactix.PagedDecode("HND", backend="torch", device="cpu")
    decode.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32, tactic=chosen, return_lse=with_lse)
    q = torch.randn(3, HQ, D, generator=gen)
    ref, ref_lse = attention_reference(q, *cache, i32(0, 1, 2, 3), *meta, kv_layout="HND", causal=False,
                                       sm_scale=SCALE, sinks=sinks)  # fmt: skip
    if with_lse:
        out, lse = decode.run(q, cache, sinks=sinks)
        assert float((lse - ref_lse).abs().max()) < 1e-5
        plain, plain_lse = decode.run(q, cache)  # without: another answer, a smaller LSE
        assert relative_error(plain, ref) > 1e-2 and bool((plain_lse < lse).all())
    else:
        out = decode.run(q, cache, sinks=sinks)
        assert relative_error(decode.run(q, cache), ref) > 1e-2
    assert relative_error(out, ref) < 1e-5

    qo = i32(0, 5, 6, 9)
    prefill = tactix.PagedPrefill("HND", backend="torch", device="cpu")
    prefill.plan(qo, *meta, HQ, HKV, D, PAGE, causal=True, q_data_type=torch.float32, tactic=chosen,
                 return_lse=with_lse)  # fmt: skip
    q = torch.randn(9, HQ, D, generator=gen)
    result = prefill.run(q, cache, sinks=sinks)
    ref, ref_lse = attention_reference(q, *cache, qo, *meta, kv_layout="HND", causal=True, sm_scale=SCALE,
                                       sinks=sinks)  # fmt: skip
    out = result[0] if with_lse else result
    assert relative_error(out, ref) < 1e-5
    if with_lse:
        assert float((result[1] - ref_lse).abs().max()) < 1e-5


def test_a_chunk_with_the_sinks_merges_exactly_with_its_cached_prefix() -> None:
    """Chunked prefill with sinks: the new tokens (ragged, causal) carry the sinks, the cached
    prefix (paged, every key visible) does not; merged through their LSEs, they are the whole
    request's attention with the sinks counted once."""
    gen = torch.Generator().manual_seed(11)
    prefix, new = 12, 5
    meta, cache = _paged((prefix,), seed=2)
    k_new, v_new = torch.randn(new, HKV, D, generator=gen), torch.randn(new, HKV, D, generator=gen)
    q = torch.randn(new, HQ, D, generator=gen)
    sinks = _sinks(3)

    paged = tactix.PagedPrefill("HND", backend="torch", device="cpu")
    paged.plan(i32(0, new), *meta, HQ, HKV, D, PAGE, causal=False, q_data_type=torch.float32, return_lse=True)
    o_prefix, s_prefix = paged.run(q, cache, return_lse=True)
    ragged = tactix.RaggedPrefill(backend="torch", device="cpu")
    ragged.plan(i32(0, new), i32(0, new), HQ, HKV, D, causal=True, q_data_type=torch.float32, return_lse=True)
    o_new, s_new = ragged.run(q, k_new, v_new, sinks=sinks, return_lse=True)
    merged, merged_lse = tactix.merge_state(o_prefix, s_prefix, o_new, s_new)

    pages = meta[1].long()
    k_all = torch.cat([cache[0][pages].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:prefix], k_new])
    v_all = torch.cat([cache[1][pages].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:prefix], v_new])
    ref, ref_lse = ragged_reference(q, k_all, v_all, i32(0, new), i32(0, prefix + new), causal=True,
                                    sm_scale=SCALE, sinks=sinks)  # fmt: skip
    assert relative_error(merged, ref) < 1e-5
    assert float((merged_lse - ref_lse).abs().max()) < 1e-5


@pytest.mark.parametrize(
    ("value", "given"),
    [
        (torch.zeros(HQ, dtype=torch.bfloat16), "torch.bfloat16 tensor of shape (8,)"),
        (torch.zeros(HQ + 1), "shape (9,)"),
        (torch.zeros(1, HQ), "shape (1, 8)"),
        (torch.zeros(HQ, device="meta"), "on meta"),
        ([0.0] * HQ, "list"),
        (torch.zeros(2 * HQ)[::2], "stride 2"),
    ],
    ids=["bf16", "heads", "2d", "meta", "list", "strided"],
)
def test_bad_sinks_name_the_argument_and_what_was_expected(value: object, given: str) -> None:
    meta, cache = _paged((13, 3))
    wrapper = tactix.PagedDecode("HND", backend="torch", device="cpu")
    wrapper.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32)
    with pytest.raises(tactix.InvalidArgumentError) as err:
        wrapper.run(torch.randn(2, HQ, D), cache, sinks=value)
    assert "'sinks'" in str(err.value) and "float32 tensor [num_qo_heads = 8]" in str(err.value)
    assert given in str(err.value)


def test_a_backend_that_does_not_declare_sinks_refuses_them_naming_the_backends_that_do(tmp_path: Path) -> None:
    write_distribution(tmp_path, "tactix-plain", "1.0", {"plain": "tx_plain"}, {"tx_plain": NO_EXTRAS})
    meta, cache = _paged((13, 3))
    with plugins_on_path(tmp_path):
        import tx_plain  # type: ignore[import-not-found]

        wrapper = tactix.PagedDecode("HND", device="cpu")  # auto: the plain backend's preference wins
        wrapper.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32)
        assert wrapper.backend == "plain"
        tx_plain.CALLS.clear()
        with pytest.raises(tactix.InvalidArgumentError) as err:
            wrapper.run(torch.randn(2, HQ, D), cache, sinks=_sinks())
        message = str(err.value)
        assert "'sinks'" in message and "None: backend 'plain' does not take sinks" in message
        assert "backends that take it and can serve this problem: torch" in message
        assert tx_plain.CALLS == []  # refused before the plan ran


def test_flashinfer_compat_passes_sinks_and_returns_a_base_2_lse_with_them() -> None:
    meta, cache = _paged((13, 3, 9))
    sinks = _sinks(4)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), kv_layout="HND")
    wrapper.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(8))
    out, lse2 = wrapper.run(q, cache, sinks=sinks, return_lse=True)
    ref, ref_lse = attention_reference(q, *cache, i32(0, 1, 2, 3), *meta, kv_layout="HND", causal=False,
                                       sm_scale=SCALE, sinks=sinks)  # fmt: skip
    assert relative_error(out, ref) < 1e-5
    assert float((lse2 - ref_lse / math.log(2)).abs().max()) < 1e-4


def test_a_wrapper_made_for_sinks_plans_only_backends_that_take_them(tmp_path: Path) -> None:
    """``run_extras=("sinks",)`` at construction: auto passes over a backend whose run() would
    refuse the sinks (here one that auto would otherwise prefer), and a named one that cannot take
    them is refused at plan time, with the reason."""
    write_distribution(tmp_path, "tactix-plain", "1.0", {"plain": "tx_plain"}, {"tx_plain": NO_EXTRAS})
    meta, cache = _paged((13, 3))
    sinks = _sinks(6)
    with plugins_on_path(tmp_path):
        wrapper = tactix.PagedDecode("HND", device="cpu", run_extras=("sinks",))
        wrapper.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32)
        assert wrapper.backend == "torch"
        q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(9))
        ref, _ = attention_reference(q, *cache, i32(0, 1, 2), *meta, kv_layout="HND", causal=False, sm_scale=SCALE,
                                     sinks=sinks)  # fmt: skip
        assert relative_error(wrapper.run(q, cache, sinks=sinks), ref) < 1e-5
        named = tactix.PagedDecode("HND", backend="plain", device="cpu", run_extras=["sinks"])
        with pytest.raises(tactix.UnsupportedProblemError, match="run extra sinks not declared"):
            named.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32)
        with pytest.raises(tactix.UnsupportedProblemError, match="run extra sinks not declared"):
            named.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32, tactic=tactix.Tactic.default("plain"))


@pytest.mark.parametrize("value", ["sinks", ("sinks", "alibi"), (3,)], ids=["a-string", "unknown", "not-a-name"])
def test_run_extras_that_are_not_the_ops_extras_are_refused(value: object) -> None:
    with pytest.raises(tactix.InvalidArgumentError, match=r"'run_extras' must be names of decode's run extras"):
        tactix.PagedDecode("HND", device="cpu", run_extras=value)  # type: ignore[arg-type]


def test_tuning_a_wrapper_made_for_sinks_times_only_backends_that_take_them_under_its_own_key(
    tmp_path: Path,
) -> None:
    """The run extras a wrapper declares are part of its problem (``run_extras``), so tuning it
    (``autotune(mode="tune")``) measures only the backends that take them, with sinks passed (the
    candidates are checked against each other with them), and stores the winner under a key of
    its own (``run_extras`` in it): the same shape planned without sinks is another entry, whose
    key (and hash) is what it was before run extras were part of problems."""
    write_distribution(tmp_path, "tactix-plain", "1.0", {"plain": "tx_plain"}, {"tx_plain": NO_EXTRAS})
    meta, _ = _paged((13, 3))
    with plugins_on_path(tmp_path), tactix.autotune(mode="tune", cache_dir=tmp_path / "store"):
        sinks_wrapper = tactix.PagedDecode("HND", device="cpu", run_extras=("sinks",))
        sinks_wrapper.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32)
        plain_wrapper = tactix.PagedDecode("HND", device="cpu")
        plain_wrapper.plan(*meta, HQ, HKV, D, PAGE, q_data_type=torch.float32)
        with_sinks, without = sinks_wrapper.problem, plain_wrapper.problem
        assert with_sinks.run_extras == ("sinks",) and without.run_extras == ()
        assert with_sinks.key()["run_extras"] == ["sinks"] and "run_extras" not in without.key()
        assert with_sinks.key_hash() != without.key_hash()
        store = current().store
        assert store is not None
        entries = {e.key_hash: e for e in store.entries()}
    tuned = entries[with_sinks.key_hash()]
    assert {c.tactic.backend for c in tuned.candidates} == {"torch"}  # plain cannot take sinks: not a candidate
    assert sinks_wrapper.backend == "torch"
    assert {"torch", "plain"} <= {c.tactic.backend for c in entries[without.key_hash()].candidates}


RECORDS_SINKS = """
import tactix
from tactix.backends import torch as _torch

SEEN = []

class _Plan:
    def __init__(self, inner):
        self.inner, self.tactic, self.built = inner, tactix.Tactic(backend="rec", kernel="k"), False

    def run(self, q, k_cache, v_cache, out, lse, sinks=None):
        SEEN.append(None if sinks is None else tuple(sinks.shape))
        self.inner.run(q, k_cache, v_cache, out, lse, sinks=sinks)

@tactix.hookimpl
def tactix_backends():
    decode = _torch.tactix_backends()[0].decode.model_copy(update={"run_extras": frozenset({"sinks"})})
    return [tactix.BackendSpec(name="rec", version="1.0", decode=decode, preference=100)]

@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    return _Plan(_torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options))
"""


def test_the_tuner_times_a_sinks_problem_with_sinks(tmp_path: Path) -> None:
    """Every run the tuner times of a problem whose runs pass sinks is given sinks of the
    problem's heads (`RunExtra.sample`), so what is measured is what the wrapper will run."""
    write_distribution(tmp_path, "tactix-rec", "1.0", {"rec": "tx_rec"}, {"tx_rec": RECORDS_SINKS})
    meta, _ = _paged((13, 3))
    with plugins_on_path(tmp_path), tactix.autotune(mode="tune", cache_dir=tmp_path / "store"):
        import tx_rec  # type: ignore[import-not-found]

        tactix.PagedDecode("HND", device="cpu", run_extras=("sinks",)).plan(*meta, HQ, HKV, D, PAGE,
                                                                            q_data_type=torch.float32)  # fmt: skip
        assert tx_rec.SEEN and set(tx_rec.SEEN) == {(HQ,)}
