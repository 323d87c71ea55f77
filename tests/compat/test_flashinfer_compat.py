"""FlashInfer's wrapper names and signatures, served by tactix (switching is an import change)."""

from __future__ import annotations

import math

import pytest
import torch

import tactix
from tactix.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from tactix.testing import attention_reference, lse_error, relative_error

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
WORKSPACE = torch.empty(128 * 1024, dtype=torch.uint8)  # FlashInfer code allocates one; tactix reads its device


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    return {
        "qo_indptr": i32(0, 7, 8, 20),
        "kv_indptr": i32(0, 2, 3, 5),
        "kv_indices": i32(6, 0, 3, 1, 4),
        "last": i32(5, 8, 4),  # kv lengths 13, 8, 12
        "k": torch.randn(7, 2, 8, 32, generator=gen),  # HND pages
        "v": torch.randn(7, 2, 8, 32, generator=gen),
        "q": torch.randn(20, 4, 32, generator=gen),
    }


def test_prefill_wrapper_plans_and_runs_with_flashinfer_positional_arguments(batch: dict[str, torch.Tensor]) -> None:
    wrapper = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
    # FlashInfer's positional order: indptrs, indices, last_page_len, heads, head dim, page size
    wrapper.plan(
        batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
        causal=True, q_data_type="float32", logits_soft_cap=20.0,
    )  # fmt: skip
    out = wrapper.run(batch["q"], (batch["k"], batch["v"]))
    ref, _ = attention_reference(
        batch["q"], batch["k"], batch["v"], batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"],
        batch["last"], kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(32), logits_soft_cap=20.0,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor) and relative_error(out, ref) < 1e-5


def test_lse_asked_for_only_at_run_time_comes_back_in_base_2(batch: dict[str, torch.Tensor]) -> None:
    wrapper = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
    wrapper.plan(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                 causal=True, q_data_type=torch.float32)  # fmt: skip
    out, lse = wrapper.run(batch["q"], (batch["k"], batch["v"]), return_lse=True)
    ref, ref_lse = attention_reference(
        batch["q"], batch["k"], batch["v"], batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"],
        batch["last"], kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(32),
    )  # fmt: skip
    assert relative_error(out, ref) < 1e-5
    assert lse_error(lse, ref_lse / math.log(2)) < 1e-5
    # a caller-provided lse buffer is filled in base 2 as well
    buffer = torch.full((20, 4), float("nan"))
    _, again = wrapper.run(batch["q"], (batch["k"], batch["v"]), lse=buffer)
    assert again is buffer and lse_error(buffer, ref_lse / math.log(2)) < 1e-5


def test_decode_wrapper_matches_the_oracle(batch: dict[str, torch.Tensor]) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    wrapper.plan(batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8, q_data_type=torch.float32)
    q = batch["q"][:3]
    cache = torch.stack([batch["k"], batch["v"]], dim=1)  # FlashInfer's single-tensor HND cache
    out = wrapper.run(q, cache)
    ref, _ = attention_reference(
        q, batch["k"], batch["v"], i32(0, 1, 2, 3), batch["kv_indptr"], batch["kv_indices"], batch["last"],
        kv_layout="HND", causal=False, sm_scale=1 / math.sqrt(32),
    )  # fmt: skip
    assert isinstance(out, torch.Tensor) and relative_error(out, ref) < 1e-5


@pytest.mark.parametrize(
    ("argument", "plan_kwargs"),
    [
        ("pos_encoding_mode", {"pos_encoding_mode": "ROPE_LLAMA"}),
        ("custom_mask", {"custom_mask": torch.ones(4, dtype=torch.bool)}),
        ("use_fp16_qk_reduction", {"use_fp16_qk_reduction": True}),
    ],
)
def test_features_tactix_lacks_raise_naming_the_argument(
    batch: dict[str, torch.Tensor], argument: str, plan_kwargs: dict[str, object]
) -> None:
    wrapper = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
    with pytest.raises(tactix.InvalidArgumentError, match=argument):
        wrapper.plan(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                     q_data_type=torch.float32, **plan_kwargs)  # type: ignore[arg-type]  # fmt: skip


def test_run_time_scales_follow_flashinfer_semantics(batch: dict[str, torch.Tensor]) -> None:
    # FlashInfer: logits (q . k) * k_scale * sm_scale, output from v * v_scale
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    wrapper.plan(batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8, q_data_type=torch.float32)
    q = batch["q"][:3]
    out = wrapper.run(q, (batch["k"], batch["v"]), k_scale=0.5, v_scale=2.0)
    ref, _ = attention_reference(
        q, batch["k"], batch["v"], i32(0, 1, 2, 3), batch["kv_indptr"], batch["kv_indices"], batch["last"],
        kv_layout="HND", causal=False, sm_scale=1 / math.sqrt(32), k_scale=0.5, v_scale=2.0,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor) and relative_error(out, ref) < 1e-5
    plain = wrapper.run(q, (batch["k"], batch["v"]))
    assert isinstance(plain, torch.Tensor) and relative_error(plain, ref) > 1e-2  # the scales did something
    with pytest.raises(tactix.InvalidArgumentError, match="k_scale"):
        wrapper.run(q, (batch["k"], batch["v"]), k_scale=-1.0)


def test_multi_token_decode_is_refused(batch: dict[str, torch.Tensor]) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    wrapper.plan(batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8, q_data_type=torch.float32)
    with pytest.raises(tactix.InvalidArgumentError, match="q_len_per_req"):
        wrapper.run(batch["q"][:3], (batch["k"], batch["v"]), q_len_per_req=2)


def test_workspace_must_be_a_tensor() -> None:
    with pytest.raises(tactix.InvalidArgumentError, match="float_workspace_buffer"):
        BatchDecodeWithPagedKVCacheWrapper(None, "NHD")  # type: ignore[arg-type]
