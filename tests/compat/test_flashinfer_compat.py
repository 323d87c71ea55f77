"""FlashInfer's wrapper names and signatures, served by tactix (switching is an import change)."""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any

import pytest
import torch

import tactix
from tactix.compat.flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    fast_decode_plan,
)
from tactix.testing import attention_reference, lse_error, ragged_reference, relative_error

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


def test_custom_masks_replace_causal_as_in_flashinfer(batch: dict[str, torch.Tensor]) -> None:
    """``custom_mask`` (bool) and ``packed_custom_mask`` (FlashInfer's segment-packed bits) give
    the masked oracle; ``causal=True`` beside a mask is ignored, as FlashInfer ignores it."""
    q_lens, kv_lens = (7, 1, 12), (13, 8, 12)
    gen = torch.Generator().manual_seed(4)
    masks = [torch.rand(q, k, generator=gen) < 0.6 for q, k in zip(q_lens, kv_lens, strict=True)]
    for m in masks:
        m[:, 0] = True  # every row attends a key
    flat = torch.cat([m.reshape(-1) for m in masks])
    bits = []
    for m in masks:
        values = m.reshape(-1).tolist() + [False] * (-m.numel() % 8)
        bits += [sum(int(b) << i for i, b in enumerate(values[j : j + 8])) for j in range(0, len(values), 8)]
    ref, _ = attention_reference(
        batch["q"], batch["k"], batch["v"], batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"],
        batch["last"], kv_layout="HND", causal=False, sm_scale=1 / math.sqrt(32), custom_mask=flat,
    )  # fmt: skip
    for kw in ({"custom_mask": flat}, {"packed_custom_mask": torch.tensor(bits, dtype=torch.uint8)}):
        wrapper = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
        wrapper.plan(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                     q_data_type=torch.float32, causal=True, **kw)  # fmt: skip
        out = wrapper.run(batch["q"], (batch["k"], batch["v"]))
        assert isinstance(out, torch.Tensor) and relative_error(out, ref) < 1e-5


@pytest.mark.parametrize(
    ("argument", "plan_kwargs"),
    [
        ("pos_encoding_mode", {"pos_encoding_mode": "ROPE_LLAMA"}),
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


def test_multi_token_decode_rows_are_causal_among_the_last_tokens(batch: dict[str, torch.Tensor]) -> None:
    """FlashInfer's ``q_len_per_req``: request b owns rows [b N, (b + 1) N), its last N tokens,
    row i attending the keys up to kv_len - N + i (a chunked prefill of N rows per request).
    As in FlashInfer, it takes a wrapper made with ``use_tensor_cores=True``."""
    with pytest.raises(tactix.InvalidArgumentError) as info:
        BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND").plan(
            batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8, q_data_type=torch.float32,
            q_len_per_req=4)  # fmt: skip
    assert info.value.argument == "use_tensor_cores"
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND", use_tensor_cores=True)
    wrapper.plan(batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8, q_data_type=torch.float32,
                 q_len_per_req=4)  # fmt: skip
    q = batch["q"][:12]
    out, lse = wrapper.run(q, (batch["k"], batch["v"]), return_lse=True, q_len_per_req=4)
    ref, ref_lse = attention_reference(
        q, batch["k"], batch["v"], i32(0, 4, 8, 12), batch["kv_indptr"], batch["kv_indices"], batch["last"],
        kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(32),
    )  # fmt: skip
    assert relative_error(out, ref) < 1e-5
    assert lse_error(lse * math.log(2.0), ref_lse) < 1e-5  # FlashInfer's base-2 LSE
    with pytest.raises(tactix.InvalidArgumentError, match="q_len_per_req"):
        wrapper.run(q, (batch["k"], batch["v"]), q_len_per_req=2)  # not what was planned
    with pytest.raises(tactix.InvalidArgumentError, match=r"'q'.*3 requests x q_len_per_req 4 rows"):
        wrapper.run(batch["q"][:9], (batch["k"], batch["v"]))  # 9 rows: not 3 requests of 4
    with pytest.raises(tactix.InvalidArgumentError, match="q_len_per_req"):  # more rows than request 1's 8 keys
        wrapper.plan(batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8, q_data_type=torch.float32,
                     q_len_per_req=9)  # fmt: skip


def test_workspace_must_be_a_tensor() -> None:
    with pytest.raises(tactix.InvalidArgumentError, match="float_workspace_buffer"):
        BatchDecodeWithPagedKVCacheWrapper(None, "NHD")  # type: ignore[arg-type]


# -- backend names ------------------------------------------------------------------------------


def decode_reference(batch: dict[str, torch.Tensor], q: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle of a decode batch (``kv_indptr``, ``kv_indices``, ``last`` of ``batch``)."""
    rows = batch["last"].shape[0]
    kw.setdefault("sm_scale", 1 / math.sqrt(32))
    return attention_reference(q, batch["k"], batch["v"], torch.arange(rows + 1, dtype=torch.int32),
                               batch["kv_indptr"], batch["kv_indices"], batch["last"], kv_layout="HND", causal=False,
                               **kw)  # fmt: skip


def plan_decode(wrapper: BatchDecodeWithPagedKVCacheWrapper, batch: dict[str, torch.Tensor], **kw: Any) -> None:
    wrapper.plan(batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8, q_data_type=torch.float32, **kw)


@pytest.mark.parametrize("name", ["auto", "fa2", "fa3"])
def test_flashinfer_auto_names_are_served_by_tactix_auto(batch: dict[str, torch.Tensor], name: str) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND", backend=name)
    plan_decode(wrapper, batch)
    out = wrapper.run(batch["q"][:3], (batch["k"], batch["v"]))
    ref, _ = decode_reference(batch, batch["q"][:3])
    assert isinstance(out, torch.Tensor) and relative_error(out, ref) < 1e-5
    prefill = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND", backend=name)
    prefill.plan(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                 q_data_type=torch.float32)  # fmt: skip
    assert prefill.run(batch["q"], (batch["k"], batch["v"])).shape == (20, 4, 32)


@pytest.mark.parametrize(("name", "tactix_name"), [("cudnn", "cudnn"), ("trtllm-gen", "trtllm"), ("torch", "torch")])
def test_flashinfer_backend_names_select_the_matching_tactix_backend(
    batch: dict[str, torch.Tensor], name: str, tactix_name: str
) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND", backend=name)
    if tactix_name == "torch":
        plan_decode(wrapper, batch)
        return
    # on this CPU the named backend itself refuses (auto would have served the batch with torch)
    with pytest.raises(tactix.UnsupportedProblemError) as info:
        plan_decode(wrapper, batch)
    assert info.value.backend == tactix_name


def test_a_name_that_only_selects_auto_is_noted_once_per_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import tactix.compat.flashinfer as compat

    monkeypatch.setattr(compat, "_noted", set())
    with caplog.at_level(logging.INFO, logger="tactix.compat"):
        for name in ("auto", "fa2", "fa2", "fa3", "auto", "fa3"):
            BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND", backend=name)
        BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND", backend="fa2")
    notes = [r for r in caplog.records if r.name == "tactix.compat"]
    assert [r.levelno for r in notes] == [logging.INFO, logging.INFO]
    assert "'fa2'" in notes[0].getMessage() and "'fa3'" in notes[1].getMessage()
    assert all("'auto'" in r.getMessage() for r in notes)


@pytest.mark.parametrize("name", ["cute-dsl", "fa4", "FA2", "", 3])
def test_an_unknown_backend_name_is_refused_naming_the_choices(name: object) -> None:
    for cls in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        with pytest.raises(tactix.InvalidArgumentError) as info:
            cls(WORKSPACE, "HND", backend=name)  # type: ignore[arg-type]
        assert info.value.argument == "backend" and info.value.given == repr(name)
        assert "'trtllm-gen'" in info.value.expected and "torch" in info.value.expected


# -- fast_decode_plan ---------------------------------------------------------------------------

# a second decode batch over the same cache: kv lengths 7, 11, 16 (the first has 13, 8, 12: the
# same batch size and length bucket, so a CUDA-graph wrapper re-plans it in place)
NEXT = {"kv_indptr": i32(0, 1, 3, 5), "kv_indices": i32(2, 5, 6, 0, 1), "last": i32(7, 3, 8)}


def test_fast_decode_plan_replans_as_plan_does(batch: dict[str, torch.Tensor]) -> None:
    nxt = {**batch, **NEXT}
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(5))
    fresh = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    plan_decode(fresh, nxt, o_data_type=torch.bfloat16)
    expected = fresh.run(q, (batch["k"], batch["v"]))

    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    plan_decode(wrapper, batch, o_data_type=torch.bfloat16)
    wrapper.plan = partial(fast_decode_plan, wrapper)  # type: ignore[method-assign]  # what vLLM and SGLang do
    override = torch.zeros(9, dtype=torch.int32)  # a host buffer sized for the largest batch
    override[:4] = NEXT["kv_indptr"]
    wrapper.plan(NEXT["kv_indptr"], NEXT["kv_indices"], NEXT["last"], 4, 2, 32, 8, q_data_type=torch.float32,
                 non_blocking=True, global_override_indptr_cpu=override)  # fmt: skip
    out = wrapper.run(q, (batch["k"], batch["v"]))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16  # the planned output dtype is kept
    assert torch.equal(out, expected)
    ref, ref_lse = decode_reference(nxt, q)
    assert relative_error(out, ref) < 1e-2  # bfloat16 output
    _, lse = wrapper.run(q, (batch["k"], batch["v"]), return_lse=True)
    assert lse_error(lse, ref_lse / math.log(2)) < 1e-5


def test_fast_decode_plan_needs_no_earlier_plan_and_keeps_flashinfer_dtype_rules(
    batch: dict[str, torch.Tensor],
) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    # q_data_type=None stands for data_type, as in FlashInfer's fast_decode_plan
    fast_decode_plan(wrapper, batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                     data_type=torch.float32, sm_scale=0.3)  # fmt: skip
    out = wrapper.run(batch["q"][:3], (batch["k"], batch["v"]))
    ref, _ = decode_reference(batch, batch["q"][:3], sm_scale=0.3)
    assert isinstance(out, torch.Tensor) and relative_error(out, ref) < 1e-5


def test_fast_decode_plan_keeps_cuda_graph_buffers_of_both_plans(batch: dict[str, torch.Tensor]) -> None:
    """A captured graph replays the plan objects it was captured with: after fast_decode_plan those
    same objects (plain and LSE) must compute the new batch. Called directly here, on the CPU."""
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND", use_cuda_graph=True)
    assert wrapper.is_cuda_graph_enabled
    plan_decode(wrapper, batch)
    q = batch["q"][:3]
    wrapper.run(q, (batch["k"], batch["v"]))
    wrapper.run_return_lse(q, (batch["k"], batch["v"]))  # the warm-up run that makes the LSE plan
    captured = wrapper._plain.plan_object, wrapper._with_lse.plan_object  # type: ignore[union-attr]
    fast_decode_plan(wrapper, NEXT["kv_indptr"], NEXT["kv_indices"], NEXT["last"], 4, 2, 32, 8,
                     q_data_type=torch.float32)  # fmt: skip
    ref, ref_lse = decode_reference({**batch, **NEXT}, q)
    k, v = batch["k"], batch["v"]
    out = torch.empty(3, 4, 32)
    captured[0].run(q, k, v, out, None)  # "replay"
    assert relative_error(out, ref) < 1e-5
    lse = torch.empty(3, 4)
    captured[1].run(q, k, v, out, lse)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse) < 1e-5
    with pytest.raises(tactix.UnsupportedProblemError, match="CUDA-graph mode"):  # as plan() refuses it
        fast_decode_plan(wrapper, i32(0, 1, 2), i32(0, 1), i32(1, 1), 4, 2, 32, 8, q_data_type=torch.float32)


def test_fast_decode_plan_refuses_what_plan_refuses(batch: dict[str, torch.Tensor]) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    args = (batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8)
    for argument, kw in [
        ("q_len_per_req", {"q_len_per_req": 0}),
        ("pos_encoding_mode", {"pos_encoding_mode": "ROPE_LLAMA"}),
        ("kv_data_type", {"kv_data_type": torch.uint8}),
        ("global_override_indptr_cpu", {"global_override_indptr_cpu": [0, 2, 3, 5]}),
    ]:
        with pytest.raises(tactix.InvalidArgumentError) as info:
            fast_decode_plan(wrapper, *args, q_data_type=torch.float32, **kw)  # type: ignore[arg-type]
        assert info.value.argument == argument
    with pytest.raises(tactix.InvalidArgumentError, match="'self'"):
        fast_decode_plan(BatchPrefillWithPagedKVCacheWrapper(WORKSPACE), *args)  # type: ignore[arg-type]


def test_flashinfer_internals_are_missing_with_a_pointer_to_fast_decode_plan() -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    with pytest.raises(AttributeError, match=r"_requested_backend.*tactix\.compat\.flashinfer\.fast_decode_plan"):
        _ = wrapper._requested_backend  # the first internal FlashInfer 0.7's fast_decode_plan reads
    assert getattr(wrapper, "_user_block_tables", False) is False  # getattr with a default still works


# -- FlashInfer's other members -----------------------------------------------------------------


def test_use_tensor_cores_is_the_decode_wrappers_property() -> None:
    assert BatchDecodeWithPagedKVCacheWrapper(WORKSPACE).use_tensor_cores is False
    assert BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, use_tensor_cores=True).use_tensor_cores is True
    assert BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, backend="trtllm-gen").use_tensor_cores is True
    assert not hasattr(BatchPrefillWithPagedKVCacheWrapper(WORKSPACE), "use_tensor_cores")  # nor has FlashInfer's


@pytest.mark.parametrize("cls", [BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper])
def test_is_cuda_graph_enabled(cls: type[Any]) -> None:
    assert cls(WORKSPACE, "HND", use_cuda_graph=True).is_cuda_graph_enabled is True
    assert cls(WORKSPACE, "HND").is_cuda_graph_enabled is False


def test_run_return_lse_begin_forward_and_end_forward(batch: dict[str, torch.Tensor]) -> None:
    decode = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    decode.begin_forward(batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                         q_data_type=torch.float32)  # fmt: skip
    q = batch["q"][:3]
    out, lse = decode.run_return_lse(q, (batch["k"], batch["v"]))
    ref, ref_lse = decode_reference(batch, q)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse / math.log(2)) < 1e-5
    decode.end_forward()  # no effect: the plan stays usable
    assert relative_error(decode.run(q, (batch["k"], batch["v"])), ref) < 1e-5  # type: ignore[arg-type]

    prefill = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
    prefill.begin_forward(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                          causal=True, q_data_type=torch.float32)  # fmt: skip
    out, lse = prefill.run_return_lse(batch["q"], (batch["k"], batch["v"]))
    ref, ref_lse = attention_reference(
        batch["q"], batch["k"], batch["v"], batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"],
        batch["last"], kv_layout="HND", causal=True, sm_scale=1 / math.sqrt(32),
    )  # fmt: skip
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse / math.log(2)) < 1e-5
    prefill.end_forward()


def test_forward_arguments_replace_the_planned_ones_as_in_flashinfer(batch: dict[str, torch.Tensor]) -> None:
    # the legacy pattern: begin_forward with the batch only, attention arguments given to forward
    prefill = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
    prefill.begin_forward(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                          q_data_type=torch.float32)  # fmt: skip
    cache = (batch["k"], batch["v"])

    def reference(causal: bool, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kw.setdefault("sm_scale", 1 / math.sqrt(32))
        return attention_reference(batch["q"], batch["k"], batch["v"], batch["qo_indptr"], batch["kv_indptr"],
                                   batch["kv_indices"], batch["last"], kv_layout="HND", causal=causal,
                                   **kw)  # fmt: skip

    ref, _ = reference(True, sm_scale=0.2, logits_soft_cap=5.0)
    out = prefill.forward(batch["q"], cache, causal=True, sm_scale=0.2, logits_soft_cap=5.0)
    assert relative_error(out, ref) < 1e-5
    ref, ref_lse = reference(False)  # forward's defaults are FlashInfer's: not causal, default scale
    out, lse = prefill.forward_return_lse(batch["q"], cache)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse / math.log(2)) < 1e-5
    with pytest.raises(tactix.InvalidArgumentError, match="causal"):
        prefill.forward(batch["q"], cache, causal=1)  # type: ignore[arg-type]

    decode = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    plan_decode(decode, batch, sm_scale=0.7)
    q = batch["q"][:3]
    ref, ref_lse = decode_reference(batch, q, sm_scale=0.1, window_left=4)
    assert relative_error(decode.forward(q, cache, sm_scale=0.1, window_left=4), ref) < 1e-5
    out, lse = decode.forward_return_lse(q, cache, sm_scale=0.1, window_left=4)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse / math.log(2)) < 1e-5
    with pytest.raises(tactix.InvalidArgumentError, match="pos_encoding_mode"):
        decode.forward(q, cache, pos_encoding_mode="ALIBI")
    with pytest.raises(tactix.TactixError, match="plan"):
        BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND").forward(q, cache)


def test_reset_workspace_buffer_takes_tensors_on_the_wrappers_device(batch: dict[str, torch.Tensor]) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    plan_decode(wrapper, batch)
    wrapper.reset_workspace_buffer(torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8))
    assert isinstance(wrapper.run(batch["q"][:3], (batch["k"], batch["v"])), torch.Tensor)
    with pytest.raises(tactix.InvalidArgumentError, match="int_workspace_buffer"):
        wrapper.reset_workspace_buffer(torch.empty(64), None)  # type: ignore[arg-type]
    with pytest.raises(tactix.InvalidArgumentError, match="float_workspace_buffer"):
        BatchPrefillWithPagedKVCacheWrapper(WORKSPACE).reset_workspace_buffer(
            torch.empty(64, device="meta"), torch.empty(64)
        )


def test_flashinfer_neutral_plan_arguments_are_accepted(batch: dict[str, torch.Tensor]) -> None:
    # values a FlashInfer caller passes explicitly that ask for nothing tactix lacks
    decode = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    plan_decode(decode, batch, q_len_per_req=1, fixed_split_size=16, disable_split_kv=True, window_right=0)
    prefill = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
    prefill.plan(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                 q_data_type=torch.float32, disable_split_kv=False, fixed_split_size=None,
                 token_pos_in_items_len=0)  # fmt: skip
    with pytest.raises(tactix.InvalidArgumentError, match="block_tables"):
        plan_decode(decode, batch, block_tables=torch.zeros(3, 2, dtype=torch.int32))


# -- NVFP4 --------------------------------------------------------------------------------------

NVFP4 = [torch.uint8, "uint8"] + ([torch.float4_e2m1fn_x2] if hasattr(torch, "float4_e2m1fn_x2") else [])


@pytest.mark.parametrize("dtype", NVFP4, ids=str)
def test_nvfp4_kv_caches_are_refused_at_plan(batch: dict[str, torch.Tensor], dtype: object) -> None:
    args = (batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8)
    cases: list[tuple[str, Any]] = [
        ("kv_data_type", lambda w: w.plan(*args, q_data_type=torch.float16, kv_data_type=dtype)),
        ("data_type", lambda w: w.plan(*args, data_type=dtype)),  # FlashInfer's older name: both q and kv
    ]
    for argument, plan in cases:
        wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND", use_tensor_cores=True)
        with pytest.raises(tactix.InvalidArgumentError, match=r"NVFP4 KV caches .* not supported by tactix") as info:
            plan(wrapper)
        assert info.value.argument == argument
        with pytest.raises(tactix.TactixError, match="plan"):  # nothing was planned
            wrapper.run(batch["q"][:3], (batch["k"], batch["v"]))
    prefill = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "HND")
    with pytest.raises(tactix.InvalidArgumentError, match="NVFP4") as info:
        prefill.plan(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["last"], 4, 2, 32, 8,
                     q_data_type=torch.float16, kv_data_type=dtype)  # fmt: skip
    assert info.value.argument == "kv_data_type"


def test_nvfp4_scale_factors_are_refused_at_run(batch: dict[str, torch.Tensor]) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND")
    plan_decode(wrapper, batch)
    scales = torch.zeros(7, 2, 2, 8, 2, dtype=torch.uint8)
    with pytest.raises(tactix.InvalidArgumentError, match=r"kv_cache_sf.*NVFP4"):
        wrapper.run(batch["q"][:3], (batch["k"], batch["v"]), kv_cache_sf=scales)


# -- ragged KV (BatchPrefillWithRaggedKVCacheWrapper) -------------------------------------------

RAGGED_QO, RAGGED_KV = i32(0, 3, 3, 9), i32(0, 5, 5, 14)  # 3 rows over 5 keys, an empty request, 6 over 9


@pytest.fixture
def ragged() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    return {"q": torch.randn(9, 4, 32, generator=gen), "k": torch.randn(14, 2, 32, generator=gen),
            "v": torch.randn(14, 2, 16, generator=gen)}  # fmt: skip


def ragged_ref(data: dict[str, torch.Tensor], **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    kw = {"causal": True, "sm_scale": 1 / math.sqrt(32), **kw}
    return ragged_reference(data["q"], data["k"], data["v"], RAGGED_QO, RAGGED_KV, **kw)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_wrapper_plans_and_runs_with_flashinfer_positional_arguments(
    ragged: dict[str, torch.Tensor], layout: str
) -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE, layout)
    # FlashInfer's positional order: indptrs, heads, head dims; HND keys are [heads, tokens, dim]
    wrapper.plan(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, causal=True, q_data_type="float32", logits_soft_cap=20.0)
    k, v = ragged["k"], ragged["v"]
    if layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    out = wrapper.run(ragged["q"], k, v)
    ref, _ = ragged_ref(ragged, logits_soft_cap=20.0)
    assert isinstance(out, torch.Tensor) and out.shape == (9, 4, 16) and relative_error(out, ref) < 1e-5


def test_ragged_lse_comes_back_in_base_2_or_as_asked(ragged: dict[str, torch.Tensor]) -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    wrapper.plan(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, causal=True, q_data_type=torch.float32)
    ref, ref_lse = ragged_ref(ragged)
    out, lse = wrapper.run(ragged["q"], ragged["k"], ragged["v"], return_lse=True)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse / math.log(2)) < 1e-5
    buffer = torch.full((9, 4), float("nan"))
    _, again = wrapper.run_return_lse(ragged["q"], ragged["k"], ragged["v"], lse=buffer)
    assert again is buffer and lse_error(buffer, ref_lse / math.log(2)) < 1e-5
    _, natural = wrapper.run(ragged["q"], ragged["k"], ragged["v"], return_lse=True, lse_base="ln")
    assert lse_error(natural, ref_lse) < 1e-5
    with pytest.raises(tactix.InvalidArgumentError, match="lse_base"):
        wrapper.run(ragged["q"], ragged["k"], ragged["v"], return_lse=True, lse_base="log10")


def test_ragged_parts_merge_through_flashinfers_base_2_merge_state(ragged: dict[str, torch.Tensor]) -> None:
    """The engine pattern: attention over two parts of each request's keys, the base-2 LSEs into
    FlashInfer's merge_state, gives attention over all of them."""
    from tactix.compat.flashinfer import merge_state

    parts = []  # request 0's keys 0-2 and 3-4, request 2's keys 5-7 and 8-13
    for kv_indptr, rows in ((i32(0, 3, 3, 6), [0, 1, 2, 5, 6, 7]), (i32(0, 2, 2, 8), [3, 4, *range(8, 14)])):
        part = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
        part.plan(RAGGED_QO, kv_indptr, 4, 2, 32, 16, q_data_type=torch.float32)
        parts.append(part.run(ragged["q"], ragged["k"][rows], ragged["v"][rows], return_lse=True))
    (out_a, lse_a), (out_b, lse_b) = parts
    merged, _ = merge_state(out_a, lse_a, out_b, lse_b)
    assert relative_error(merged, ragged_ref(ragged, causal=False)[0]) < 1e-5


def test_ragged_run_time_scales_follow_flashinfer_semantics(ragged: dict[str, torch.Tensor]) -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    wrapper.plan(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, causal=True, q_data_type=torch.float32)
    out = wrapper.run(ragged["q"], ragged["k"], ragged["v"], k_scale=0.5, v_scale=2.0)
    ref, _ = ragged_ref(ragged, k_scale=0.5, v_scale=2.0)
    assert isinstance(out, torch.Tensor) and relative_error(out, ref) < 1e-5


def test_ragged_forward_arguments_replace_the_planned_ones(ragged: dict[str, torch.Tensor]) -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    wrapper.begin_forward(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, q_data_type=torch.float32)
    out = wrapper.forward(ragged["q"], ragged["k"], ragged["v"], causal=True, window_left=2)
    assert relative_error(out, ragged_ref(ragged, window_left=2)[0]) < 1e-5
    out, lse = wrapper.forward_return_lse(ragged["q"], ragged["k"], ragged["v"])  # back to the defaults
    ref, ref_lse = ragged_ref(ragged, causal=False)
    assert relative_error(out, ref) < 1e-5 and lse_error(lse, ref_lse / math.log(2)) < 1e-5
    wrapper.end_forward()


@pytest.mark.parametrize(
    ("argument", "plan_kwargs"),
    [
        ("custom_mask", {"custom_mask": torch.ones(3 * 5 + 6 * 9, dtype=torch.bool)}),
        ("packed_custom_mask", {"packed_custom_mask": torch.ones(9, dtype=torch.uint8)}),
        ("pos_encoding_mode", {"pos_encoding_mode": "ROPE_LLAMA"}),
        ("use_fp16_qk_reduction", {"use_fp16_qk_reduction": True}),
        ("prefix_len_ptr", {"prefix_len_ptr": torch.zeros(3, dtype=torch.uint32)}),
        ("v_indptr", {"v_indptr": RAGGED_KV}),
        ("kv_data_type", {"kv_data_type": torch.uint8}),
        ("some_future_option", {"some_future_option": 1}),
    ],
)
def test_ragged_plan_refuses_what_tactix_does_not_serve_by_name(argument: str, plan_kwargs: dict[str, Any]) -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    with pytest.raises(tactix.InvalidArgumentError) as info:
        wrapper.plan(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, q_data_type=torch.float32, **plan_kwargs)
    assert info.value.argument == argument
    with pytest.raises(tactix.TactixError, match="plan"):  # nothing was planned
        wrapper.run(torch.randn(9, 4, 32), torch.randn(14, 2, 32), torch.randn(14, 2, 16))


@pytest.mark.parametrize(
    ("argument", "run_kwargs"),
    [("q_scale", {"q_scale": 2.0}), ("o_scale", {"o_scale": 2.0}), ("lse_layout", {"lse_layout": "HN"}),
     ("kv_cache_sf", {"kv_cache_sf": torch.zeros(14, 2, 2, dtype=torch.uint8)}), ("*args", {})],
)  # fmt: skip
def test_ragged_run_refuses_what_tactix_does_not_serve_by_name(
    ragged: dict[str, torch.Tensor], argument: str, run_kwargs: dict[str, Any]
) -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    wrapper.plan(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, q_data_type=torch.float32)
    extra = (1.0,) if argument == "*args" else ()
    with pytest.raises(tactix.InvalidArgumentError) as info:
        wrapper.run(ragged["q"], ragged["k"], ragged["v"], *extra, return_lse=True, **run_kwargs)
    assert info.value.argument == argument


def test_ragged_scheduling_hints_and_redundant_lengths_are_accepted(ragged: dict[str, torch.Tensor]) -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE, use_cuda_graph=False, qo_indptr_buf=None)
    wrapper.plan(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, causal=True, q_data_type=torch.float32, fixed_split_size=64,
                 disable_split_kv=True, uniform_q_len=None, non_blocking=False, seq_lens=i32(5, 0, 9),
                 max_sequence_kv=9, token_pos_in_items_len=0, rope_theta=1e4)  # fmt: skip
    assert relative_error(wrapper.run(ragged["q"], ragged["k"], ragged["v"]), ragged_ref(ragged)[0]) < 1e-5


def test_ragged_hnd_keys_must_be_three_dimensional() -> None:
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE, "HND")
    wrapper.plan(RAGGED_QO, RAGGED_KV, 4, 2, 32, 16, q_data_type=torch.float32)
    with pytest.raises(tactix.InvalidArgumentError, match=r"'k'.*HND"):
        wrapper.run(torch.randn(9, 4, 32), torch.randn(2, 14 * 32), torch.randn(2, 14, 16))
    with pytest.raises(tactix.InvalidArgumentError, match="'v'"):  # v [heads, tokens, dim_vo], read as such
        wrapper.run(torch.randn(9, 4, 32), torch.randn(2, 14, 32), torch.randn(14, 2, 16))
