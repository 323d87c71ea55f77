"""Custom masks for prefill: ``PagedPrefill.plan(custom_mask=... | packed_custom_mask=...)``.

FlashInfer's layout (each request's ``q_len x kv_len`` matrix, row-major, requests one after
another; packed: little-endian bits, each request from a byte of its own), replacing ``causal``;
tree attention for speculative decoding is the use.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tactix
from tactix.registry import get_registry
from tactix.testing import attention_reference, lse_error, relative_error

PAGE, HQ, HKV, D = 8, 4, 2, 16
Q_LENS, KV_LENS = (3, 5, 1), (7, 12, 4)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
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


def tree_masks() -> list[torch.Tensor]:
    """Each request's new tokens as a chain that branches: token i attends the prefix, itself and
    its ancestors (parents: 0 <- 1, 0 <- 2, 2 <- 3, ...)."""
    masks = []
    for q_len, kv_len in zip(Q_LENS, KV_LENS, strict=True):
        prefix = kv_len - q_len
        m = torch.zeros(q_len, kv_len, dtype=torch.bool)
        m[:, :prefix] = True
        for i in range(q_len):
            parent = i - 1 - (i % 2) if i >= 2 else (0 if i == 1 else -1)
            if parent >= 0:
                m[i, prefix:] = m[parent, prefix:]
            m[i, prefix + i] = True
        masks.append(m)
    return masks


def packed(masks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.from_numpy(np.packbits(m.reshape(-1).numpy(), bitorder="little")) for m in masks])


def plan(batch: dict[str, torch.Tensor], **kw: object) -> tactix.PagedPrefill:
    wrapper = tactix.PagedPrefill("HND", device="cpu")
    wrapper.plan(batch["qo"], batch["indptr"], batch["indices"], batch["last"], HQ, HKV, D, PAGE,
                 q_data_type=torch.float32, **kw)  # type: ignore[arg-type]  # fmt: skip
    return wrapper


def reference(batch: dict[str, torch.Tensor], mask: torch.Tensor | None, **kw: object) -> tuple[torch.Tensor, ...]:
    return attention_reference(batch["q"], batch["k"], batch["v"], batch["qo"], batch["indptr"], batch["indices"],
                               batch["last"], kv_layout="HND", sm_scale=1 / math.sqrt(D), custom_mask=mask,
                               **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("window", [-1, 2])
def test_a_tree_mask_bool_or_packed_gives_the_oracle(batch: dict[str, torch.Tensor], window: int) -> None:
    masks = tree_masks()
    flat = torch.cat([m.reshape(-1) for m in masks])
    ref, ref_lse = reference(batch, flat, causal=False, window_left=window)
    both = {"custom_mask": ~flat, "packed_custom_mask": packed(masks)}  # packed wins, as in FlashInfer
    for kw in ({"custom_mask": flat}, {"packed_custom_mask": packed(masks)}, both):
        out, lse = plan(batch, window_left=window, return_lse=True, **kw).run(batch["q"], (batch["k"], batch["v"]))
        assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse) < 1e-5
    # a lower-triangular (bottom-right) mask is causal attention
    causal_masks = [torch.ones(q, k, dtype=torch.bool).tril(k - q) for q, k in zip(Q_LENS, KV_LENS, strict=True)]
    cache = (batch["k"], batch["v"])
    out = plan(batch, custom_mask=torch.cat([m.reshape(-1) for m in causal_masks])).run(batch["q"], cache)
    assert torch.allclose(out, plan(batch, causal=True).run(batch["q"], cache), atol=1e-6)


def test_a_row_that_attends_no_key_gives_zeros_and_minus_infinity(batch: dict[str, torch.Tensor]) -> None:
    masks = tree_masks()
    masks[1][2] = False
    flat = torch.cat([m.reshape(-1) for m in masks])
    out, lse = plan(batch, custom_mask=flat, return_lse=True).run(batch["q"], (batch["k"], batch["v"]))
    row = Q_LENS[0] + 2
    assert bool((out[row] == 0).all()) and bool(torch.isneginf(lse[row]).all())
    ref, ref_lse = reference(batch, flat, causal=False)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse) < 1e-5


def test_a_replan_takes_the_new_batchs_mask(batch: dict[str, torch.Tensor]) -> None:
    masks = tree_masks()
    flat = torch.cat([m.reshape(-1) for m in masks])
    wrapper = plan(batch, custom_mask=flat)
    wrapper.run(batch["q"], (batch["k"], batch["v"]))
    other = torch.ones_like(flat)
    wrapper.plan(batch["qo"], batch["indptr"], batch["indices"], batch["last"], HQ, HKV, D, PAGE,
                 q_data_type=torch.float32, custom_mask=other)  # fmt: skip
    out = wrapper.run(batch["q"], (batch["k"], batch["v"]))
    assert relative_error(out, reference(batch, None, causal=False)[0]) < 1e-5  # all ones: no mask


@pytest.mark.parametrize(
    ("kw", "argument"),
    [
        ({"custom_mask": torch.ones(5, dtype=torch.bool)}, "custom_mask"),  # not sum(q_len * kv_len)
        ({"custom_mask": torch.ones(sum(q * k for q, k in zip(Q_LENS, KV_LENS, strict=True)))}, "custom_mask"),  # float
        ({"custom_mask": [True] * 4}, "custom_mask"),
        ({"packed_custom_mask": torch.zeros(3, dtype=torch.uint8)}, "packed_custom_mask"),
        ({"custom_mask": torch.ones(85, dtype=torch.bool, device="meta")}, "custom_mask"),
        ({"custom_mask": torch.ones(85, dtype=torch.bool), "causal": True}, "causal"),
    ],
)
def test_bad_masks_name_the_argument(batch: dict[str, torch.Tensor], kw: dict[str, object], argument: str) -> None:
    assert sum(q * k for q, k in zip(Q_LENS, KV_LENS, strict=True)) == 85
    with pytest.raises(tactix.InvalidArgumentError, match=f"'{argument}'"):
        plan(batch, **kw)


def test_backends_declare_custom_masks_and_the_rest_refuse_them(batch: dict[str, torch.Tensor]) -> None:
    wrapper = plan(batch, custom_mask=torch.ones(85, dtype=torch.bool))
    problem = wrapper._selection.problem
    assert problem.custom_mask and "mask" in str(problem)
    assert "custom_mask" in problem.key() and "custom_mask" not in plan(batch)._selection.problem.key()
    torch_spec = get_registry().get("torch").spec
    assert torch_spec.prefill is not None and torch_spec.prefill.custom_mask
    unmasked = torch_spec.prefill.model_copy(update={"custom_mask": False})
    assert "custom masks not supported" in unmasked.reasons(problem)
    # SDPA's own mask would turn a row with no key into NaN: only the explicit kernel serves them
    sdpa = tactix.Tactic(backend="torch", kernel="sdpa", params={"impl": "math"})
    assert any("custom mask" in r for r in get_registry().get("torch").check(problem, sdpa))
