"""Merging attention states (`tactix.merge_state`, `merge_states`, `merge_state_in_place`): the
attention over a cached prefix and over the new tokens, merged, is the attention over both."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import tactix
from tactix.compat import flashinfer as compat
from tactix.testing import lse_error, merge_reference, relative_error

H, D = 4, 16


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float64 attention of q [rows, H, D] over k, v [keys, H, D] where ``allowed`` [rows, keys]."""
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    logits = logits.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v.double()), lse.transpose(0, 1)


def test_prefix_and_new_tokens_merge_into_the_whole() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, prefix, new = 6, 11, 6
    q = torch.randn(rows, H, D, generator=gen)
    k = torch.randn(prefix + new, H, D, generator=gen)
    v = torch.randn(prefix + new, H, D, generator=gen)
    causal = torch.ones(rows, prefix + new, dtype=torch.bool).tril(prefix)
    whole, whole_lse = attend(q, k, v, causal)
    part_a = attend(q, k[:prefix], v[:prefix], causal[:, :prefix])
    part_b = attend(q, k[prefix:], v[prefix:], causal[:, prefix:])
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        out, lse = tactix.merge_state(part_a[0].to(dtype), part_a[1].float(), part_b[0].to(dtype), part_b[1].float())
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert relative_error(out, whole) < tolerance and lse_error(lse, whole_lse) < 1e-6


def test_the_paged_prefix_and_a_causal_chunk_planned_apart_merge_exactly() -> None:
    """What an engine does for a chunked prefill: the new tokens over the cached pages (no mask:
    every cached key precedes them) and over themselves (causal), merged through the LSE."""
    gen = torch.Generator().manual_seed(1)
    page, new = 4, 5  # a prefix of 3 full pages (12 keys), 5 new tokens on pages 3 and 4
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    k = torch.randn(6, H, page, D, generator=gen)  # HND pages: 0-2 the prefix, 3-4 the new tokens
    v = torch.randn(6, H, page, D, generator=gen)
    q = torch.randn(new, H, D, generator=gen)
    kw = {"q_data_type": torch.float32, "return_lse": True}
    cached = tactix.PagedPrefill("HND", device="cpu")
    cached.plan(i32(0, new), i32(0, 3), i32(0, 1, 2), i32(page), H, H, D, page, causal=False, **kw)  # type: ignore[arg-type]
    fresh = tactix.PagedPrefill("HND", device="cpu")
    fresh.plan(i32(0, new), i32(0, 2), i32(3, 4), i32(1), H, H, D, page, causal=True, **kw)  # type: ignore[arg-type]
    whole = tactix.PagedPrefill("HND", device="cpu")
    whole.plan(i32(0, new), i32(0, 5), i32(0, 1, 2, 3, 4), i32(1), H, H, D, page, causal=True, **kw)  # type: ignore[arg-type]
    (va, sa), (vb, sb), (ref, ref_lse) = (w.run(q, (k, v)) for w in (cached, fresh, whole))
    out, lse = tactix.merge_state(va, sa, vb, sb)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse) < 1e-5


def test_many_states_and_empty_ones() -> None:
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(5, 3, H, D, generator=gen)
    s = torch.randn(5, 3, H, generator=gen)
    s[1, 2] = -math.inf  # row 1's third state attended no key: it contributes nothing
    s[4] = -math.inf  # row 4 attended nothing at all: zeros and -inf
    out, lse = tactix.merge_states(v, s)
    pair = tactix.merge_state(v[:, 0].contiguous(), s[:, 0].contiguous(), v[:, 1].contiguous(), s[:, 1].contiguous())
    three = tactix.merge_state(pair[0], pair[1], v[:, 2].contiguous(), s[:, 2].contiguous())
    assert torch.allclose(out, three[0], atol=1e-5) and torch.allclose(lse, three[1], atol=1e-5)
    two = tactix.merge_state(v[1:2, 0], s[1:2, 0], v[1:2, 1], s[1:2, 1])
    assert torch.allclose(out[1:2], two[0], atol=1e-6)
    assert bool((out[4] == 0).all()) and bool(torch.isneginf(lse[4]).all())
    assert bool(torch.isfinite(out).all())


def test_in_place_merges_only_the_masked_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    v, v_other = torch.randn(4, H, D, generator=gen), torch.randn(4, H, D, generator=gen)
    s, s_other = torch.randn(4, H, generator=gen), torch.randn(4, H, generator=gen)
    expected = tactix.merge_state(v, s, v_other, s_other)
    keep_v, keep_s = v.clone(), s.clone()
    mask = torch.tensor([True, False, True, False])
    tactix.merge_state_in_place(v, s, v_other, s_other, mask)
    assert torch.allclose(v[mask], expected[0][mask]) and torch.allclose(s[mask], expected[1][mask])
    assert torch.equal(v[~mask], keep_v[~mask]) and torch.equal(s[~mask], keep_s[~mask])


def test_flashinfer_compat_takes_and_gives_base_2() -> None:
    gen = torch.Generator().manual_seed(4)
    v_a, v_b = torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen)
    s_a, s_b = torch.randn(3, H, generator=gen), torch.randn(3, H, generator=gen)
    out, lse = tactix.merge_state(v_a, s_a, v_b, s_b)
    log2e = 1 / math.log(2)
    out2, lse2 = compat.merge_state(v_a, s_a * log2e, v_b, s_b * log2e)
    assert torch.allclose(out2, out, atol=1e-6) and torch.allclose(lse2, lse * log2e, atol=1e-5)
    many, many_lse = compat.merge_states(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1) * log2e)
    assert torch.allclose(many, out, atol=1e-6) and torch.allclose(many_lse, lse * log2e, atol=1e-5)
    s_in = s_a * log2e
    compat.merge_state_in_place(v_a, s_in, v_b, s_b * log2e)
    assert torch.allclose(v_a, out, atol=1e-6) and torch.allclose(s_in, lse * log2e, atol=1e-5)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda v, s: tactix.merge_state(v, s, v[:2], s[:2]), "v_b"),  # another shape
        (lambda v, s: tactix.merge_state(v, s.double(), v, s), "s_a"),  # not float32
        (lambda v, s: tactix.merge_state(v, s[:, :2], v, s), "s_a"),  # not v's shape
        (lambda v, s: tactix.merge_state(v.int(), s, v.int(), s), "v_a"),
        (lambda v, s: tactix.merge_state(v, s, v.half(), s), "v_b"),
        (lambda v, s: tactix.merge_states(v, s), "v"),  # 3-D: merge_states takes [seq, states, heads, dim]
        (lambda v, s: tactix.merge_state_in_place(v, s, v, s, torch.ones(2, dtype=torch.bool)), "mask"),
        (lambda v, s: tactix.merge_state([1.0], s, v, s), "v_a"),  # type: ignore[arg-type]
    ],
)
def test_bad_states_name_the_argument(call: object, argument: str) -> None:
    v, s = torch.randn(3, H, D), torch.randn(3, H)
    with pytest.raises(tactix.InvalidArgumentError, match=f"'{argument}'"):
        call(v, s)  # type: ignore[operator]


def test_merge_is_an_op_planned_through_auto_and_tunable(tmp_path: Path) -> None:
    """The functions plan the registry's merge op (the torch backend here); a wrapper plans once
    and serves any number of rows; tuning stores its choice like any op's."""
    m = tactix.MergeStates(device="cpu")
    m.plan(num_states=3, num_heads=2, head_dim=8, v_dtype=torch.float32)
    assert (m.backend, str(m.tactic), m.problem.op) == ("torch", "torch:ops", "merge_states")
    for rows in (1, 7, 300):
        vs = [torch.randn(rows, 2, 8) for _ in range(3)]
        ss = [torch.randn(rows, 2) for _ in range(3)]
        v, s = m.run(vs, ss)
        ref_v, ref_s = merge_reference(vs, ss)
        assert relative_error(v, ref_v) < 1e-5 and float((s.double() - ref_s).abs().max()) < 1e-5
    with tactix.autotune(mode="tune", cache_dir=tmp_path) as state:
        tuned = tactix.MergeStates(device="cpu")
        tuned.plan(num_states=2, num_heads=4, head_dim=16, v_dtype=torch.bfloat16, rows=64)
        assert tuned.selection_source == "store" and [e.key["op"] for e in state.store.entries()] == ["merge_states"]


@pytest.mark.parametrize(
    ("change", "argument", "fragment"),
    [
        ({"vs": "short"}, "vs", "3 output tensors"),
        ({"vs": "dtype"}, "vs[1]", "torch.float32 tensor"),
        ({"ss": "rows"}, "ss[2]", "float32 tensor of shape (5, 2)"),
        ({"mask": "given"}, "mask", "None (planned without a mask)"),
        ({"out_v": "shape"}, "out_v", "of shape (5, 2, 8)"),
    ],
    ids=["count", "dtype", "lse-shape", "mask", "out"],
)
def test_the_wrapper_names_the_bad_argument(change: dict[str, str], argument: str, fragment: str) -> None:
    m = tactix.MergeStates(device="cpu")
    with pytest.raises(tactix.TactixError, match="call plan"):
        m.run([], [])
    m.plan(num_states=3, num_heads=2, head_dim=8, v_dtype="float32")
    vs = [torch.randn(5, 2, 8) for _ in range(3)]
    ss = [torch.randn(5, 2) for _ in range(3)]
    kwargs: dict[str, object] = {}
    if "vs" in change:
        vs = vs[:2] if change["vs"] == "short" else [vs[0], vs[1].half(), vs[2]]
    if "ss" in change:
        ss = [ss[0], ss[1], torch.randn(4, 2)]
    if "mask" in change:
        kwargs["mask"] = torch.ones(5, dtype=torch.bool)
    if "out_v" in change:
        kwargs["out_v"] = torch.empty(5, 2, 9)
    with pytest.raises(
        tactix.InvalidArgumentError, match=re.escape(f"'{argument}' must be") + ".*" + re.escape(fragment)
    ):
        m.run(vs, ss, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(tactix.InvalidArgumentError, match="'num_states' must be an int >= 2"):
        m.plan(num_states=1, num_heads=2, head_dim=8, v_dtype="float32")
