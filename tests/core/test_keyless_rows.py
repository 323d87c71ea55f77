"""Causal prefill with more query rows than keys (FlashInfer #4452, ``test_paged_prefill_fully_masked_rows``).

The queries are aligned with a request's last keys, so when ``qo_len > kv_len`` its first
``qo_len - kv_len`` rows come before every key: they attend none, and FlashInfer gives zeros and
an LSE of -inf for them. tactix plans such batches (the problem's ``keyless_rows``) on backends
that declare it (``AttentionCapabilities.keyless_rows``: the torch backend's explicit kernel) and
refuses them, with the reason, elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch

import tactix
from tactix.registry import get_registry
from tactix.testing import attention_reference, lse_error, relative_error

PAGE, HQ, HKV, D = 4, 4, 2, 16
Q_LENS, KV_LENS = (6, 3, 5), (2, 7, 5)  # request 0: 4 rows before its first key; 1: a prefix; 2: square


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def inputs(seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in KV_LENS]
    kv_indptr, qo = [0], [0]
    for n, q in zip(pages, Q_LENS, strict=True):
        kv_indptr.append(kv_indptr[-1] + n)
        qo.append(qo[-1] + q)
    return {
        "qo": i32(*qo),
        "indptr": i32(*kv_indptr),
        "indices": torch.randperm(kv_indptr[-1], generator=gen).to(torch.int32),
        "last": i32(*[(n - 1) % PAGE + 1 for n in KV_LENS]),
        "k": torch.randn(kv_indptr[-1], HKV, PAGE, D, generator=gen),
        "v": torch.randn(kv_indptr[-1], HKV, PAGE, D, generator=gen),
        "q": torch.randn(qo[-1], HQ, D, generator=gen),
    }


def plan(x: dict[str, torch.Tensor], backend: str = "torch", **kw: object) -> tactix.PagedPrefill:
    w = tactix.PagedPrefill("HND", backend=backend, run_extras=tuple(kw.pop("run_extras", ())))  # type: ignore[arg-type]
    w.plan(x["qo"], x["indptr"], x["indices"], x["last"], HQ, HKV, D, PAGE, causal=True, q_data_type=torch.float32,
           **kw)  # fmt: skip
    return w


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_before_the_first_key_give_zeros_and_an_lse_of_minus_infinity(backend: str, sinks: bool) -> None:
    x = inputs()
    extras = {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])} if sinks else {}
    w = plan(x, backend, return_lse=True, run_extras=tuple(extras))
    out, lse = w.run(x["q"], (x["k"], x["v"]), return_lse=True, **extras)
    ref, ref_lse = attention_reference(x["q"], x["k"], x["v"], x["qo"], x["indptr"], x["indices"], x["last"],
                                       kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(D),
                                       sinks=extras.get("sinks"))  # fmt: skip
    assert not torch.isnan(out).any() and relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse) < 1e-5
    keyless = slice(0, Q_LENS[0] - KV_LENS[0])
    assert out[keyless].abs().max() == 0  # a row with no key: zeros (with a sink too: it has no value)
    if sinks:
        assert torch.equal(lse[keyless], extras["sinks"].expand(4, HQ))  # the sink alone
    else:
        assert torch.isneginf(lse[keyless]).all()
    assert torch.isfinite(lse[Q_LENS[0] - KV_LENS[0] :]).all()


def test_the_problem_says_so_and_backends_that_do_not_declare_it_refuse() -> None:
    x = inputs()
    problem = plan(x)._selection.problem
    assert problem.keyless_rows and "keyless" in str(problem) and "keyless_rows" in problem.key()
    square = inputs()
    square["qo"] = i32(0, 2, 5, 10)  # every request has at least as many keys as rows
    assert "keyless_rows" not in plan(square)._selection.problem.key()
    torch_spec = get_registry().get("torch").spec
    assert torch_spec.prefill is not None and torch_spec.prefill.keyless_rows
    without = torch_spec.prefill.model_copy(update={"keyless_rows": False})
    assert "causal rows with no key (a request with more query rows than keys) not supported" in without.reasons(
        problem
    )
    # SDPA's own mask turns a row with no key into NaN: only the explicit kernel serves these batches
    sdpa = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})
    assert any("causal row with no key" in r for r in get_registry().get("torch").check(problem, sdpa))


def test_a_replan_follows_the_batch() -> None:
    """The flag is per batch: a re-plan with the same static arguments and square lengths plans
    without it, and back."""
    x = inputs()
    w = plan(x)
    assert w._selection.problem.keyless_rows
    w.plan(i32(0, 2, 5, 10), x["indptr"], x["indices"], x["last"], HQ, HKV, D, PAGE, causal=True,
           q_data_type=torch.float32)  # fmt: skip
    assert not w._selection.problem.keyless_rows
    w.plan(x["qo"], x["indptr"], x["indices"], x["last"], HQ, HKV, D, PAGE, causal=True, q_data_type=torch.float32)
    assert w._selection.problem.keyless_rows
    out = w.run(x["q"], (x["k"], x["v"]))
    assert out[: Q_LENS[0] - KV_LENS[0]].abs().max() == 0 and not torch.isnan(out).any()


def test_multi_token_decode_still_needs_as_many_keys_as_rows() -> None:
    """Decode's rows are a request's last tokens: more rows than keys is an error there."""
    w = tactix.PagedDecode("HND", backend="torch")
    with pytest.raises(tactix.InvalidArgumentError, match="'q_len_per_req' must be at most each request's kv length"):
        w.plan(i32(0, 1), i32(0), i32(2), HQ, HKV, D, PAGE, q_data_type=torch.float32, q_len_per_req=4)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_ragged_prefill_rows_before_the_first_key(backend: str) -> None:
    """The same for keys and values packed per request (`tactix.RaggedPrefill`): zeros and an LSE
    of -inf before a request's first key, the rest as the oracle says; the problem says so."""
    from tactix.testing import ragged_reference

    gen = torch.Generator().manual_seed(9)
    kv_indptr, qo = i32(0, 2, 9, 14), i32(0, 6, 9, 14)
    q = torch.randn(14, HQ, D, generator=gen)
    k, v = torch.randn(14, HKV, D, generator=gen), torch.randn(14, HKV, D, generator=gen)
    w = tactix.RaggedPrefill(backend=backend, device="cpu")
    w.plan(qo, kv_indptr, HQ, HKV, D, causal=True, q_data_type=torch.float32, return_lse=True)
    assert w._selection.problem.keyless_rows and "keyless_rows" in w._selection.problem.key()
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = ragged_reference(q, k, v, qo, kv_indptr, causal=True, sm_scale=1 / math.sqrt(D))
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse) < 1e-5
    assert out[:4].abs().max() == 0 and torch.isneginf(lse[:4]).all() and torch.isfinite(lse[4:]).all()
