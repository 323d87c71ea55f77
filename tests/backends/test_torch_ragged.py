"""The built-in torch backend's ragged-KV prefill, through `tactix.RaggedPrefill` on the CPU, against
the float64 oracle: every tactic it lists, fp8 keys and values, and the fixed buffers of its
CUDA-graph mode (which a CPU can check: the addresses a captured graph would read)."""

from __future__ import annotations

import math

import pytest
import torch

import tactix
from tactix.testing import ragged_reference, relative_error, tolerance_for

F32, BF16 = torch.float32, torch.bfloat16


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def batch(
    q_lens: list[int], kv_lens: list[int], dtype: torch.dtype, seed: int, d: int = 32
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    qo = i32(0, *torch.tensor(q_lens).cumsum(0).tolist())
    kv = i32(0, *torch.tensor(kv_lens).cumsum(0).tolist())
    q = torch.randn(sum(q_lens), 4, d, generator=gen).to(dtype)
    k = torch.randn(sum(kv_lens), 2, d, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), 2, d, generator=gen).to(dtype)
    return qo, kv, q, k, v


@pytest.mark.parametrize(
    ("q_lens", "kv_lens", "causal", "dtype"),
    [([8, 8], [8, 8], True, BF16), ([5, 0, 9], [12, 3, 9], True, BF16), ([7, 4], [3, 4], False, F32)],
    ids=["uniform-bf16", "ragged-bf16", "q-longer-f32"],
)
def test_every_listed_tactic_matches_the_oracle(q_lens: list[int], kv_lens: list[int], causal: bool,
                                                dtype: torch.dtype) -> None:  # fmt: skip
    qo, kv, q, k, v = batch(q_lens, kv_lens, dtype, seed=len(q_lens))
    ref, _ = ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=1 / math.sqrt(32))
    probe = tactix.RaggedPrefill(backend="torch", device="cpu")
    probe.plan(qo, kv, 4, 2, 32, causal=causal, q_data_type=dtype)
    backend = tactix.get_registry().get("torch")
    tactics = [t for t in backend.tactics(probe.problem) if not t.is_default]
    assert tactics and {t.kernel for t in tactics} >= {"explicit", "sdpa"}
    ran = []
    for tactic in tactics:
        if backend.check(probe.problem, tactic, probe._batch):
            continue  # e.g. SDPA flash, which takes no mask, for ragged lengths
        wrapper = tactix.RaggedPrefill(backend="torch", device="cpu")
        wrapper.plan(qo, kv, 4, 2, 32, causal=causal, q_data_type=dtype, tactic=tactic)
        out = wrapper.run(q, k, v)
        assert wrapper.tactic == tactic and relative_error(out, ref) < tolerance_for(dtype), tactic
        ran.append(str(tactic))
    assert "torch:explicit" in ran and "torch:sdpa(impl=math)" in ran
    assert ("torch:sdpa(impl=flash)" in ran) == (q_lens == kv_lens and len(set(q_lens)) == 1)  # uniform lengths only


def test_fp8_keys_and_values_are_read_in_the_query_dtype_and_scaled() -> None:
    qo, kv, q, k, v = batch([3, 6], [7, 6], BF16, seed=9)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    wrapper = tactix.RaggedPrefill(backend="torch", device="cpu")
    wrapper.plan(qo, kv, 4, 2, 32, causal=True, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn)
    out = wrapper.run(q, k8, v8, k_scale=0.5, v_scale=2.0)
    ref, _ = ragged_reference(q, k8, v8, qo, kv, causal=True, sm_scale=1 / math.sqrt(32), k_scale=0.5, v_scale=2.0)
    assert relative_error(out, ref) < 1e-2


def test_cuda_graph_mode_keeps_its_buffers_across_re_plans_of_a_bucket() -> None:
    """With ``use_cuda_graph`` a re-plan of the same batch size, token counts and length buckets
    rewrites the plan's buffers in place (a captured graph reads them); any other is refused."""
    wrapper = tactix.RaggedPrefill(backend="torch", device="cpu", use_cuda_graph=True)
    addresses = None
    # 7 rows and 14 keys each time, the longest request's rows and keys in the buckets 4 and 16
    for q_lens, kv_lens, seed in (([3, 4], [9, 5], 1), ([4, 3], [4, 10], 2)):
        qo, kv, q, k, v = batch(q_lens, kv_lens, F32, seed)
        wrapper.plan(qo, kv, 4, 2, 32, causal=True, q_data_type=F32)
        plan = wrapper.plan_object
        now = [t.data_ptr() for t in (plan.kv_index, plan.q_index, plan.out_index, plan.mask, plan.key_valid)]
        addresses = addresses or now
        assert now == addresses
        ref, _ = ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=1 / math.sqrt(32))
        assert relative_error(wrapper.run(q, k, v), ref) < 1e-5
    qo, kv, *_ = batch([4, 3], [4, 11], F32, 3)  # one key more: k and v change shape
    with pytest.raises(tactix.UnsupportedProblemError, match="CUDA-graph mode"):
        wrapper.plan(qo, kv, 4, 2, 32, causal=True, q_data_type=F32)
