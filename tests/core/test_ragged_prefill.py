"""`tactix.RaggedPrefill`: ragged queries over keys and values packed per request, as an engine uses
it (a chunk's new tokens, merged with the paged prefix through the LSE), through the public API.

The reference here is written row by row (each query row's attended keys listed explicitly, the
softmax in float64), independently of both the torch backend and the kit's oracle, which it
checks as well.
"""

from __future__ import annotations

import math

import pytest
import torch

import tactix
from tactix.testing import ragged_reference

F32, BF16 = torch.float32, torch.bfloat16


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def by_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], kv_lens: list[int], *,
            causal: bool, window: int = -1, cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each query row's attention over the keys it may see, one row at a time, in float64."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], hq, v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(q.shape[0], hq, dtype=torch.float64)
    row = key0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        for i in range(q_len):
            position = kv_len - q_len + i  # the query is the (position)-th key of its request
            keys = [
                j for j in range(kv_len) if (not causal or j <= position) and (window < 0 or j >= position - window)
            ]
            for h in range(hq):
                g = h // (hq // hkv)
                logits = torch.stack([(q[row, h].double() @ k[key0 + j, g].double()) / math.sqrt(q.shape[-1])
                                      for j in keys])  # fmt: skip
                if cap > 0:
                    logits = cap * torch.tanh(logits / cap)
                weights = torch.exp(logits - logits.max())
                out[row, h] = sum(
                    w * v[key0 + j, g].double() for w, j in zip(weights / weights.sum(), keys, strict=True)
                )
                lse[row, h] = logits.max() + torch.log(weights.sum())
            row += 1
        key0 += kv_len
    return out, lse


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def packed(q_lens: list[int], kv_lens: list[int], hq: int = 4, hkv: int = 2, dqk: int = 16, dvo: int = 16,
           seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    qo, kv = [0], [0]
    for a, b in zip(q_lens, kv_lens, strict=True):
        qo.append(qo[-1] + a)
        kv.append(kv[-1] + b)
    q = torch.randn(qo[-1], hq, dqk, generator=gen)
    k = torch.randn(kv[-1], hkv, dqk, generator=gen)
    v = torch.randn(kv[-1], hkv, dvo, generator=gen)
    return i32(*qo), i32(*kv), q, k, v


@pytest.mark.parametrize(
    ("q_lens", "kv_lens", "causal", "window", "cap", "dvo"),
    [
        ([3, 5, 1], [3, 9, 4], True, -1, 0.0, 16),  # new tokens of a chunk over their prefix
        ([0, 4, 0, 2], [0, 4, 6, 2], True, 2, 0.0, 16),  # requests without query rows, a window
        ([6, 2], [3, 2], False, -1, 5.0, 8),  # more query rows than keys (not causal), soft-cap, dv != dqk
        ([5], [7], False, 1, 0.0, 16),  # a window without causal masking
    ],
)
def test_outputs_and_lse_match_a_row_by_row_reference(
    q_lens: list[int], kv_lens: list[int], causal: bool, window: int, cap: float, dvo: int
) -> None:
    qo, kv, q, k, v = packed(q_lens, kv_lens, dvo=dvo)
    wrapper = tactix.RaggedPrefill(device="cpu")
    wrapper.plan(qo, kv, 4, 2, 16, dvo, causal=causal, window_left=window, logits_soft_cap=cap or None,
                 q_data_type=F32, return_lse=True)  # fmt: skip
    out, lse = wrapper.run(q, k, v)
    ref, ref_lse = by_rows(q, k, v, q_lens, kv_lens, causal=causal, window=window, cap=cap)
    assert relative(out, ref) < 1e-5
    assert float((lse.double() - ref_lse).abs().max()) < 1e-5  # natural log, as PagedPrefill's
    # the kit's oracle says the same
    oracle, oracle_lse = ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=1 / 4, window_left=window,
                                          logits_soft_cap=cap)  # fmt: skip
    assert relative(oracle, ref) < 1e-12 and float((oracle_lse - ref_lse).abs().max()) < 1e-12


def test_causal_rows_are_aligned_bottom_right() -> None:
    """Query row i of a request with q_len rows and kv_len keys attends keys 0 .. kv_len - q_len + i:
    with zero queries the weights are uniform, so each output is the mean of the values it sees."""
    wrapper = tactix.RaggedPrefill(device="cpu")
    wrapper.plan(i32(0, 2), i32(0, 5), 1, 1, 4, 5, causal=True, q_data_type=F32)
    values = torch.eye(5).view(5, 1, 5)  # key j's value is the j-th unit vector
    out = wrapper.run(torch.zeros(2, 1, 4), torch.randn(5, 1, 4), values)
    assert torch.allclose(out[0, 0], torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0]))
    assert torch.allclose(out[1, 0], torch.full((5,), 0.2))


def paged_plan(
    qo: torch.Tensor, pages: list[list[int]], lens: list[int], page: int, causal: bool
) -> tactix.PagedPrefill:
    """A paged prefill (4 query heads, 2 KV heads, head dim 16) of requests holding ``pages``."""
    wrapper = tactix.PagedPrefill("NHD", device="cpu")
    indptr = i32(*[sum(len(p) for p in pages[:r]) for r in range(len(pages) + 1)])
    last = i32(*[n - (len(p) - 1) * page for n, p in zip(lens, pages, strict=True)])
    wrapper.plan(qo, indptr, i32(*[i for p in pages for i in p]), last, 4, 2, 16, page, causal=causal,
                 q_data_type=F32, return_lse=True)  # fmt: skip
    return wrapper


def test_new_tokens_merged_with_the_paged_prefix_give_the_whole_prefill() -> None:
    """The engine's chunked prefill: the prefix is in the paged cache, the chunk's keys and values
    are fresh; paged attention over the prefix and ragged attention over the chunk (causal), merged
    through their LSEs, equal paged prefill over prefix and chunk together."""
    gen = torch.Generator().manual_seed(3)
    page, prefix, chunk = 4, [6, 8], [3, 5]
    cache_k, cache_v = torch.randn(8, page, 2, 16, generator=gen), torch.randn(8, page, 2, 16, generator=gen)
    pages = [[0, 1, 2], [3, 4, 5, 6]]  # request 0: 6 + 3 tokens, request 1: 8 + 5
    prefix_pages = [[0, 1], [3, 4]]
    q = torch.randn(sum(chunk), 4, 16, generator=gen)
    qo = i32(0, chunk[0], sum(chunk))

    def tokens(cache: torch.Tensor, r: int) -> torch.Tensor:  # the chunk's tokens of request r
        return cache[pages[r]].reshape(-1, 2, 16)[prefix[r] : prefix[r] + chunk[r]]

    expected, _ = paged_plan(qo, pages, [p + c for p, c in zip(prefix, chunk, strict=True)], page, True).run(
        q, (cache_k, cache_v))  # fmt: skip
    old_out, old_lse = paged_plan(qo, prefix_pages, prefix, page, False).run(q, (cache_k, cache_v))
    fresh = tactix.RaggedPrefill(device="cpu")
    fresh.plan(qo, qo, 4, 2, 16, causal=True, q_data_type=F32, return_lse=True)
    new_k, new_v = (torch.cat([tokens(c, 0), tokens(c, 1)]) for c in (cache_k, cache_v))
    new_out, new_lse = fresh.run(q, new_k, new_v)
    merged, _ = tactix.merge_state(old_out, old_lse, new_out, new_lse)
    assert relative(merged, expected.double()) < 1e-5
    # (and the causal mask matters: without it the chunk's rows would see their future)
    fresh.plan(qo, qo, 4, 2, 16, causal=False, q_data_type=F32, return_lse=True)
    wrong, _ = tactix.merge_state(old_out, old_lse, *fresh.run(q, new_k, new_v))
    assert relative(wrong, expected.double()) > 1e-2


def test_lse_follows_the_plan_unless_run_asks() -> None:
    qo, kv, q, k, v = packed([3, 2], [3, 4])
    wrapper = tactix.RaggedPrefill(device="cpu")
    wrapper.plan(qo, kv, 4, 2, 16, causal=True, q_data_type=F32)
    assert isinstance(wrapper.run(q, k, v), torch.Tensor)
    with pytest.raises(tactix.InvalidArgumentError, match="'return_lse'"):
        wrapper.run(q, k, v, return_lse=True)
    wrapper.plan(qo, kv, 4, 2, 16, causal=True, q_data_type=F32, return_lse=True)
    out, lse = wrapper.run(q, k, v)
    buffer = torch.full((5, 4), float("nan"))
    again, written = wrapper.run(q, k, v, lse=buffer)
    assert written is buffer and torch.equal(buffer, lse) and torch.equal(again, out)
    alone = wrapper.run(q, k, v, return_lse=False)
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, out)


def test_run_extras_dequantize_k_and_v() -> None:
    qo, kv, q, k, v = packed([3, 2], [3, 4])
    wrapper = tactix.RaggedPrefill(device="cpu")
    wrapper.plan(qo, kv, 4, 2, 16, causal=True, q_data_type=F32)
    scaled = wrapper.run(q, k, v, k_scale=0.5, v_scale=2.0)
    ref, _ = by_rows(q, k * 0.5, v * 2.0, [3, 2], [3, 4], causal=True)
    assert relative(scaled, ref) < 1e-5


def test_strided_views_of_fused_projections_are_read_as_they_are() -> None:
    """Engines hand over q, k and v as slices of one QKV projection output."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, (4 + 2 + 2) * 16, generator=gen)
    q, k, v = (qkv[:, a * 16 : b * 16].view(7, b - a, 16) for a, b in ((0, 4), (4, 6), (6, 8)))
    wrapper = tactix.RaggedPrefill(device="cpu")
    wrapper.plan(i32(0, 3, 7), i32(0, 3, 7), 4, 2, 16, causal=True, q_data_type=F32)
    out = wrapper.run(q, k, v)
    ref, _ = by_rows(q, k, v, [3, 4], [3, 4], causal=True)
    assert not q.is_contiguous() and relative(out, ref) < 1e-5


def test_a_re_plan_with_the_same_arguments_validates_the_new_batch_and_takes_its_sizes() -> None:
    wrapper = tactix.RaggedPrefill(device="cpu")
    for q_lens, kv_lens in (([3, 2], [3, 4]), ([1, 6, 2], [9, 6, 2]), ([3, 2], [3, 4])):
        qo, kv, q, k, v = packed(q_lens, kv_lens, seed=sum(kv_lens))
        wrapper.plan(qo, kv, 4, 2, 16, causal=True, q_data_type=F32)
        problem = wrapper.problem
        assert (problem.batch_size, problem.num_qo_tokens, problem.num_kv_tokens, problem.max_kv_len) == (
            len(q_lens),
            sum(q_lens),
            sum(kv_lens),
            max(kv_lens),
        )
        ref, _ = by_rows(q, k, v, q_lens, kv_lens, causal=True)
        assert relative(wrapper.run(q, k, v), ref) < 1e-5
    with pytest.raises(tactix.InvalidArgumentError, match="'kv_indptr'"):
        wrapper.plan(i32(0, 4), i32(0, 0), 4, 2, 16, causal=True, q_data_type=F32)  # the memo still validates


def test_bf16_within_the_kits_tolerance_and_the_problem_reads_like_an_id() -> None:
    qo, kv, q, k, v = packed([5, 3], [9, 3], dqk=32, dvo=32)
    wrapper = tactix.RaggedPrefill(device="cpu")
    wrapper.plan(qo, kv, 4, 2, 32, causal=True, q_data_type=BF16)
    out = wrapper.run(q.to(BF16), k.to(BF16), v.to(BF16))
    ref, _ = by_rows(q.to(BF16), k.to(BF16), v.to(BF16), [5, 3], [9, 3], causal=True)
    assert out.dtype == BF16 and relative(out, ref) < 1e-2
    assert str(wrapper.problem) == "ragged_prefill[bf16-h4/2-d32-causal-cpu]"
    assert wrapper.backend == "torch" and str(wrapper.tactic) == "torch:explicit"


@pytest.mark.parametrize(("q_lens", "kv_lens", "causal", "window"), [
    ([3, 5, 1], [3, 9, 4], True, -1),
    ([0, 4, 0, 2], [0, 4, 6, 2], True, 2),  # requests without query rows (one without keys), a window
    ([6, 2], [3, 2], False, -1),
])  # fmt: skip
def test_the_paged_equivalent_of_a_ragged_batch_computes_the_same(
    q_lens: list[int], kv_lens: list[int], causal: bool, window: int
) -> None:
    """What a backend serves ragged prefill with through its paged prefill (cuda_native does):
    `RaggedBatch.paged` (one-token pages, the identity table, the same lengths) and
    `RaggedPrefillProblem.as_paged_prefill` (page size 1, NHD, the same static fields and sizes),
    planned by the torch backend's paged prefill over ``k.unsqueeze(1)``, give the row-by-row
    reference's output and LSE."""
    qo, kv, q, k, v = packed(q_lens, kv_lens)
    problem, batch = tactix.ragged.ragged_problem(
        device=torch.device("cpu"), qo_indptr=qo, kv_indptr=kv, num_qo_heads=4, num_kv_heads=2, head_dim_qk=16,
        head_dim_vo=None, causal=causal, sm_scale=None, window_left=window, logits_soft_cap=None,
        q_data_type=F32, kv_data_type=None, o_data_type=None, return_lse=True,
    )  # fmt: skip
    paged, pages = problem.as_paged_prefill(), batch.paged
    assert isinstance(paged, tactix.PrefillProblem) and (paged.page_size, paged.kv_layout) == (1, "NHD")
    assert paged.static_key() == problem.as_paged_prefill().static_key()  # one template per static problem
    assert (paged.batch_size, paged.num_qo_tokens, paged.max_qo_len, paged.max_kv_len) == (
        batch.batch_size, batch.num_qo_tokens, batch.max_qo_len, batch.max_kv_len)  # fmt: skip
    assert pages.kv_indices.tolist() == list(range(sum(kv_lens))) and pages.kv_lens_list == kv_lens
    backend = tactix.get_registry().get("torch")
    assert not backend.static_reasons(paged)
    plan = backend.plan(paged, tactix.Tactic.default("torch"), {"device": torch.device("cpu"), "use_cuda_graph": False,
                                                                 "previous": None}, pages)  # fmt: skip
    out = torch.empty(q.shape[0], 4, 16)
    lse = torch.empty(q.shape[0], 4)
    plan.run(q, k.unsqueeze(1), v.unsqueeze(1), out, lse)
    ref, ref_lse = by_rows(q, k, v, q_lens, kv_lens, causal=causal, window=window)
    assert relative(out, ref) < 1e-5 and float((lse.double() - ref_lse).abs().max()) < 1e-4
