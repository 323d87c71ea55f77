"""fp8 KV caches through the torch backend (the dequantize-and-compute reference path, CPU here):
numerics against the float64 oracle, the checks, the store key, and the FlashInfer mapping."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tactix
from tactix.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from tactix.testing.oracle import attention_reference, attention_tolerance, relative_error

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# two requests over pages of 8: kv lengths 13 and 3 (decode), with 5 and 2 new tokens (prefill)
KV_META = (i32(0, 2, 3), i32(1, 0, 2), i32(5, 3))
QO = i32(0, 5, 7)


def _cache(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # values beyond e4m3's range (448) in unused slots must not turn into NaN
    k = torch.randn(4, 8, 2, 32, generator=gen) * 3
    v = torch.randn(4, 8, 2, 32, generator=gen) * 3
    k[3], v[3] = 1000.0, -1000.0  # page 3 belongs to no request
    return k.to(dtype), v.to(dtype)


def _reference(q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], qo: torch.Tensor, causal: bool,
               k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return attention_reference(q, *cache, qo, *KV_META, kv_layout="NHD", causal=causal, sm_scale=1 / math.sqrt(32),
                               k_scale=k_scale, v_scale=v_scale)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_form", ["float", "tensor", "none"])
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_fp8_cache_matches_the_dequantizing_oracle(kv_dtype: torch.dtype, scale_form: str, op: str) -> None:
    cache = _cache(kv_dtype)
    gen = torch.Generator().manual_seed(1)
    rows = 2 if op == "decode" else 7
    q = torch.randn(rows, 4, 32, generator=gen).to(torch.bfloat16)
    kwargs = dict(q_data_type=torch.bfloat16, kv_data_type=kv_dtype, return_lse=True)
    if op == "decode":
        wrapper: tactix.PagedDecode | tactix.PagedPrefill = tactix.PagedDecode("NHD", device="cpu")
        wrapper.plan(*KV_META, 4, 2, 32, 8, **kwargs)  # type: ignore[arg-type]
        qo = i32(0, 1, 2)
    else:
        wrapper = tactix.PagedPrefill("NHD", device="cpu")
        wrapper.plan(QO, *KV_META, 4, 2, 32, 8, causal=True, **kwargs)  # type: ignore[arg-type]
        qo = QO
    assert wrapper.backend == "torch" and wrapper.problem.kv_dtype == str(kv_dtype).removeprefix("torch.")
    scales: dict[str, object] = {}
    k_scale, v_scale = 1.0, 1.0
    if scale_form != "none":
        k_scale, v_scale = 0.5, 4.0
        as_value = (lambda x: torch.tensor(x)) if scale_form == "tensor" else float
        scales = {"k_scale": as_value(k_scale), "v_scale": as_value(v_scale)}
    out, lse = wrapper.run(q, cache, **scales)  # type: ignore[arg-type]
    ref, ref_lse = _reference(q, cache, qo, op == "prefill", k_scale, v_scale)
    assert bool(torch.isfinite(out).all())
    # the torch backend reads the cache exactly and computes in float32: bf16-output accuracy
    assert relative_error(out, ref) < 1e-2 <= attention_tolerance("bfloat16", kv_dtype, "bfloat16")
    assert float((lse - ref_lse).abs().max()) < 1e-3


def test_an_fp8_plan_refuses_a_16_bit_cache_and_fp8_queries() -> None:
    wrapper = tactix.PagedDecode("NHD", device="cpu")
    wrapper.plan(*KV_META, 4, 2, 32, 8, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    q = torch.randn(2, 4, 32).to(torch.bfloat16)
    with pytest.raises(tactix.InvalidArgumentError, match=r"paged_kv_cache \(k\).*float8_e4m3fn"):
        wrapper.run(q, _cache(torch.bfloat16))
    with pytest.raises(tactix.UnsupportedProblemError, match="q dtype float8_e4m3fn"):
        wrapper.plan(*KV_META, 4, 2, 32, 8, q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)


def test_scales_are_run_time_values_never_part_of_the_store_key(tmp_path: Path) -> None:
    def step(k_scale: float) -> tuple[str, torch.Tensor]:
        wrapper = tactix.PagedDecode("NHD", device="cpu")
        wrapper.plan(*KV_META, 4, 2, 32, 8, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e5m2)
        out = wrapper.run(torch.ones(2, 4, 32, dtype=torch.bfloat16), _cache(torch.float8_e5m2), k_scale=k_scale)
        assert isinstance(out, torch.Tensor)
        return wrapper.problem.key_hash(), out

    policy = tactix.MeasurementPolicy(warmup=1, repeat=2)
    tactix.reset_stats()
    with tactix.autotune(mode="tune", cache_dir=tmp_path, policy=policy):
        first, out_a = step(0.5)
    assert tactix.stats()["tuned_problems"] == 1
    with tactix.autotune(mode="replay", cache_dir=tmp_path, policy=policy):
        second, out_b = step(2.0)
    assert first == second and tactix.stats()["store_hits"] >= 1
    assert not torch.equal(out_a, out_b)  # the scale was applied, not the one tuned with
    key = tactix.PagedDecode("NHD", device="cpu")
    key.plan(*KV_META, 4, 2, 32, 8, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e5m2)
    assert key.problem.key()["kv_dtype"] == "float8_e5m2" and "k_scale" not in key.problem.key()


def test_flashinfer_decode_with_an_fp8_cache_and_scales() -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1, dtype=torch.uint8), "NHD")
    wrapper.plan(*KV_META, 4, 2, 32, 8, data_type=torch.float8_e4m3fn, q_data_type=torch.bfloat16)
    cache = _cache(torch.float8_e4m3fn)
    q = torch.randn(2, 4, 32).to(torch.bfloat16)
    out, lse = wrapper.run(q, cache, k_scale=0.5, v_scale=2.0, return_lse=True)
    ref, ref_lse = _reference(q, cache, i32(0, 1, 2), False, 0.5, 2.0)
    assert relative_error(out, ref) < 1e-2
    assert float((lse - ref_lse / math.log(2)).abs().max()) < 1e-2  # FlashInfer's LSE is base 2
