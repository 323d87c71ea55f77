"""The cuda_native plugin without a GPU: NVRTC compiles every default variant, the disk cache,
compile errors, tactics, launch geometry, support reasons, and a clean import that says why
the backend is inactive here."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import math
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest

pytest.importorskip("tactix_cuda_native", reason="plugins/cuda_native is not installed (scripts/setup.sh installs it)")

from tactix_cuda_native import decode as decode_op
from tactix_cuda_native import gemm as gemm_op
from tactix_cuda_native import paged as paged_op
from tactix_cuda_native import plugin, runtime
from tactix_cuda_native import prefill as prefill_op
from tactix_cuda_native.decode import DecodeParams
from tactix_cuda_native.device import H200, DeviceInfo, arch_at_least, ctas_per_sm, wgmma_arch
from tactix_cuda_native.gemm import GemmParams, GemmWgmmaParams
from tactix_cuda_native.kernel import TensorMaps
from tactix_cuda_native.paged import HEAD_DIMS
from tactix_cuda_native.prefill import PrefillParams
from tactix_cuda_native.variants import candidate_variants, default_variants, fp8_decode_variants

import tactix
from tactix.ops import DecodeProblem, GemmProblem, PrefillProblem
from tactix.registry import get_registry

if runtime.cuda_core_status()[0] is None:
    pytest.skip(f"cuda.core is not usable here: {runtime.cuda_core_status()[1]}", allow_module_level=True)

DECODE = dict(
    device_type="cuda", num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=16,
    kv_layout="HND", q_dtype="bfloat16", kv_dtype="bfloat16", out_dtype="bfloat16", sm_scale=0.088,
    window_left=-1, logits_soft_cap=0.0, return_lse=False, batch_size=8, max_kv_len=2048,
)  # fmt: skip
GEMM = dict(device_type="cuda", m=16, n=4096, k=4096, a_dtype="bfloat16", b_dtype="bfloat16", out_dtype="bfloat16")
PREFILL = dict(DECODE, causal=True, num_qo_tokens=16384, max_qo_len=2048)


def decode(**changes: object) -> DecodeProblem:
    return DecodeProblem(**{**DECODE, **changes})  # type: ignore[arg-type]


def prefill(**changes: object) -> PrefillProblem:
    return PrefillProblem(**{**PREFILL, **changes})  # type: ignore[arg-type]


def gemm(**changes: object) -> GemmProblem:
    return GemmProblem(**{**GEMM, **changes})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cubins")


# -- compilation -----------------------------------------------------------------------------


def test_every_default_variant_compiles_for_sm90_without_a_gpu(cache_root: Path) -> None:
    variants = default_variants(H200)
    # bf16 and fp16: prefill for each head dim, with and without persistent CTAs (the default's
    # two forms), decode for each head dim (large and small batches), and the GEMM: on the H200 the
    # wgmma kernel, whose one variant serves every m (its tile has 64 rows)
    persistent = sum(prefill_op.default_prefill_params(d, H200).pingpong for d in HEAD_DIMS)
    assert persistent == 2  # d64 and d128
    # (and the decode variants for fp8 caches: two fp8 dtypes, each head dim, large and small batches,
    # and DeepSeek's 192/128 prefill: the wgmma kernel with its own dims (never persistent by default),
    # also with ragged K and V through tensor maps;
    # one kernel that makes decode work lists on the device, and the state merge for 3 dtypes)
    fp8 = 2 * 2 * len(HEAD_DIMS) * 2
    assert len(variants) == len(set(variants)) == 2 * (3 * len(HEAD_DIMS) + persistent + 2) + fp8 + 2 + 1 + 3
    deepseek = [v for v in variants if ("TX_DVO", "128") in v.defines]
    assert len(deepseek) == 4 and all(v.source == "prefill_sm90.cu" and ("TX_D", "192") in v.defines
                                      for v in deepseek)  # fmt: skip
    assert sum(("TX_KV_TMA", "1") in v.defines for v in deepseek) == 2
    assert sum(("TX_PERSIST", "1") in v.defines for v in variants) == 2 * persistent
    # prefill and GEMM on the H200 are the wgmma kernels, compiled for the arch-specific sm_90a
    assert {(v.source, v.arch) for v in variants} == {
        ("decode.cu", "sm_90"), ("decode_plan.cu", "sm_90"), ("gemm_sm90.cu", "sm_90a"), ("prefill_sm90.cu", "sm_90a"),
        ("merge.cu", "sm_90"),
    }  # fmt: skip
    # elsewhere (sm_80) the mma.sync kernels, GEMM for 1, 2 and 4 m-tiles, DeepSeek's zero-filled to 256
    a100 = DeviceInfo(108, 166912, 167936, "sm_80")
    assert {v.source for v in default_variants(a100)} == {"decode.cu", "decode_plan.cu", "gemm.cu", "prefill.cu",
                                                          "merge.cu"}  # fmt: skip
    assert sum(("TX_DQK", "192") in v.defines and ("TX_D", "256") in v.defines for v in default_variants(a100)) == 2
    assert sum(v.source == "gemm.cu" for v in default_variants(a100)) == 2 * 3
    seen = []
    compiled = runtime.compile_all(
        variants, lambda done, total, label: seen.append((done, total, label)), root=cache_root
    )
    assert compiled == len(variants)
    assert [s[0] for s in seen] == list(range(1, len(variants) + 1))
    for variant in variants:
        cubin, built = runtime.compile_variant(variant, root=cache_root)
        assert not built
        assert cubin[:4] == b"\x7fELF", f"{variant.label()} did not produce an ELF cubin"
    # the kernel the plans look up by name is in each (split work is merged in the same kernel)
    for variant in variants:
        cubin, _ = runtime.compile_variant(variant, root=cache_root)
        name = {"decode.cu": b"tactix_decode", "prefill.cu": b"tactix_prefill", "prefill_sm90.cu": b"tactix_prefill",
                "gemm.cu": b"tactix_gemm", "gemm_sm90.cu": b"tactix_gemm", "decode_plan.cu": b"tactix_decode_plan",
                "merge.cu": b"tactix_merge_states"}[variant.source]  # fmt: skip
        assert name in cubin, f"{name!r} missing from {variant.label()}"
        if variant.source != "merge.cu":  # (the state merge's own kernel is named for it)
            assert b"_merge" not in cubin and b"_reduce" not in cubin, variant.label()


def test_fp8_kv_decode_variants_compile_without_a_gpu(cache_root: Path) -> None:
    """The fp8-cache decode variants of the default tactics (e4m3fn and e5m2 under bf16 and fp16 q,
    every head dim, large and small batches) compile for sm_90 and sm_80 (where the conversion is
    plain bit arithmetic); they differ from the 16-bit variants only by TX_KV_FP8 and TX_FP8_CVT,
    which the 16-bit variants never carry (their defines, hence their cache keys, are as before)."""
    variants = fp8_decode_variants(H200)
    assert len(variants) == 2 * 2 * len(HEAD_DIMS) * 2 == len(set(variants))
    assert {dict(v.defines)["TX_KV_FP8"] for v in variants} == {"1", "2"}
    fp8 = set(variants)
    assert fp8 <= set(default_variants(H200))  # what warmup compiles
    assert not any("TX_KV_FP8" in dict(v.defines) for v in candidate_variants(H200) if v not in fp8)
    for v in variants:  # the same defines as the 16-bit variant of the tactic, plus the fp8 ones
        plain = dict(v.defines)
        plain.pop("TX_KV_FP8")
        assert plain.pop("TX_FP8_CVT") == "1"
        if plain["TX_D"] == "128":  # registers bounded for 4 CTAs an SM, V in registers (default_decode_params)
            assert plain.pop("TX_MIN_CTAS") == "4" and plain.pop("TX_VREG") == "1"
        assert any(dict(w.defines) == plain for w in default_variants(H200)), v.label()
    a100 = DeviceInfo(108, 166912, 167936, "sm_80")
    both = [*variants, *fp8_decode_variants(a100)[:2]]
    runtime.compile_all(both, root=cache_root)  # (the sm_90 ones: already, as default variants)
    for variant in both:
        cubin, _ = runtime.compile_variant(variant, root=cache_root)
        assert cubin[:4] == b"\x7fELF" and b"tactix_decode" in cubin, variant.label()


def test_fp8_kv_decode_takes_cp_async_tactics_only() -> None:
    """fp8 caches (16-bit q and out of one dtype) are served by the cp.async tactics (bulk and tma
    refused, none enumerated); the 16-bit problems' tactics are the same as without fp8."""
    default = tactix.Tactic.default("cuda_native")
    ok = {"tile": 64, "warps": 4, "stages": 2}
    tactic = tactix.Tactic(backend="cuda_native", kernel="decode", params=ok)
    e4m3 = decode(kv_dtype="float8_e4m3fn")
    e5m2 = decode(kv_dtype="float8_e5m2", q_dtype="float16", out_dtype="float16")
    plain_tactics = decode_op.decode_tactics(decode(), H200)
    assert plugin._reasons(decode(), default, H200) == []
    for problem in (e4m3, e5m2):
        assert plugin._reasons(problem, default, H200) == []
        assert plugin._reasons(problem, tactic, H200) == []
        tactics = decode_op.decode_tactics(problem, H200)
        assert tactics and all(not t.params.get("bulk") and not t.params.get("tma") for t in tactics)
        # the 16-bit candidates without bulk copies, and the fp8 default with V in registers (2 and 3
        # stages, 3 CTAs), which no 16-bit problem takes
        vreg = [t for t in tactics if t.params.get("vreg")]
        assert len(vreg) == 3 and not [t for t in plain_tactics if t.params.get("vreg")]
        assert len(tactics) - len(vreg) == sum(not t.params.get("bulk") for t in plain_tactics) + 1
        vreg16 = tactix.Tactic(backend="cuda_native", kernel="decode", params={**ok, "vreg": 1})
        assert "it needs an fp8 KV cache" in plugin._reasons(decode(), vreg16, H200)[-1]
        bulk = tactix.Tactic(backend="cuda_native", kernel="decode", params={**ok, "bulk": 16})
        assert "cp.async only: bulk and tma must be 0" in plugin._reasons(problem, bulk, H200)[0]
        maps = tactix.Tactic(backend="cuda_native", kernel="decode", params={**ok, "bulk": 16, "tma": 1})
        assert "cp.async only" in plugin._reasons(problem, maps, H200)[0]
    mixed = decode(kv_dtype="float8_e4m3fn", out_dtype="float16")
    assert "takes float16 or bfloat16 q and out of the same dtype" in plugin._reasons(mixed, default, H200)[0]
    # prefill reads fp8 caches too (with the mma.sync kernel: test_fp8_prefill_is_served_by_the_mma_sync_kernel_only)
    assert plugin._reasons(prefill(kv_dtype="float8_e4m3fn"), default, H200) == []
    # the variant and its shared memory: the ring holds fp8 rows, one converted 16-bit K and V tile follows
    params = DecodeParams(tile=64, warps=4, stages=3)
    defines = dict(decode_op.decode_variant("bfloat16", 128, params, "sm_90", "float8_e5m2").defines)
    assert defines["TX_KV_FP8"] == "2"
    assert "TX_KV_FP8" not in dict(decode_op.decode_variant("bfloat16", 128, params, "sm_90").defines)
    # (16-bit rows of 256 bytes: fp8 rows are 128; one 16-bit V tile of 64 rows after the fp8 ring)
    assert (decode_op.decode_smem_bytes(128, 64, 4, 2) - decode_op.decode_smem_bytes(128, 64, 4, 2, kv_bytes=1)
            == 2 * 2 * 64 * 128 - 64 * 256)  # fmt: skip
    assert (decode_op.decode_smem_bytes(128, 64, 4, 3) - decode_op.decode_smem_bytes(128, 64, 4, 3, kv_bytes=1)
            == 3 * 2 * 64 * 128 - 64 * 256)  # fmt: skip


def test_fp8_conversion_mode_default_and_override(monkeypatch: pytest.MonkeyPatch, cache_root: Path) -> None:
    """fp8 variants convert with the hardware conversion (TX_FP8_CVT=1) by default;
    TACTIX_CUDA_NATIVE_FP8_CVT (0, 1, 2) sets every fp8 variant's mode (16-bit variants never carry
    it). Each mode compiles for sm_90 and sm_80, to different code on sm_90."""
    params = DecodeParams(tile=64, warps=4, stages=3)
    pairs = (("bfloat16", "float8_e4m3fn"), ("bfloat16", "float8_e5m2"), ("float16", "float8_e4m3fn"),
             ("float16", "float8_e5m2"))  # fmt: skip
    modes = [dict(decode_op.decode_variant(dt, 128, params, "sm_90", kv).defines)["TX_FP8_CVT"] for dt, kv in pairs]
    assert modes == ["1", "1", "1", "1"]
    assert "TX_FP8_CVT" not in dict(decode_op.decode_variant("bfloat16", 128, params, "sm_90").defines)
    by_mode = {}
    for mode in ("0", "1", "2"):
        monkeypatch.setenv(paged_op.FP8_CVT_ENV, mode)
        for arch in ("sm_90", "sm_80"):
            variant = decode_op.decode_variant("bfloat16", 128, params, arch, "float8_e4m3fn")
            assert dict(variant.defines)["TX_FP8_CVT"] == mode
            by_mode[mode, arch] = variant
    runtime.compile_all(list(by_mode.values()), root=cache_root)
    cubins = {key: runtime.compile_variant(v, root=cache_root)[0] for key, v in by_mode.items()}
    assert all(c[:4] == b"\x7fELF" and b"tactix_decode" in c for c in cubins.values())
    assert len({cubins[m, "sm_90"] for m in ("0", "1", "2")}) == 3


def test_fp8_capabilities() -> None:
    """Decode and prefill declare the fp8 KV dtypes and the k_scale / v_scale run extras (and the
    attention sinks their kernels fold in); nothing is declared untested."""
    spec = plugin.tactix_backends()[0]
    assert spec.decode is not None and spec.prefill is not None
    for caps in (spec.decode, spec.prefill):
        assert caps.kv_dtypes == frozenset({"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
        assert caps.run_extras == frozenset({"k_scale", "v_scale", "sinks"})
    assert not spec.untested


def test_fp8_prefill_is_served_by_both_kernels_within_shared_memory() -> None:
    """With an fp8 cache on Hopper the default is the wgmma kernel with a ring that leaves room
    for the staged fp8 pair (d128: 2 stages, not 3), the tuner measures tactics of both kernels,
    each within the GPU's shared memory, and one too deep for the staging is refused with its
    size; the variants are the 16-bit ones plus TX_KV_FP8 and TX_FP8_CVT (the wgmma one with the
    larger TX_SMEM); fp8 under fp32 q is refused."""
    fp8 = prefill(kv_dtype="float8_e4m3fn")
    deep = tactix.Tactic(backend="cuda_native", kernel="prefill",
                         params={"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 3, "mma": "wgmma"})  # fmt: skip
    assert plugin._reasons(prefill(), deep, H200) == []
    assert any("bytes of shared memory" in r for r in plugin._reasons(fp8, deep, H200))
    assert plugin._reasons(fp8, tactix.Tactic.default("cuda_native"), H200) == []
    default = prefill_op.default_params_for(fp8, H200)
    assert default == prefill_op.default_prefill_params(128, H200).replace(stages=2) and default.mma == "wgmma"
    assert plugin._reasons(fp8, default.to_tactic(), H200) == []
    tactics = [PrefillParams.from_tactic(t) for t in prefill_op.prefill_tactics(fp8, H200)]
    assert {p.mma for p in tactics} == {"sync", "wgmma"} and len(tactics) >= 10
    assert all(p.smem_bytes(128, 1) <= H200.smem_per_block for p in tactics)
    assert PrefillParams.from_tactic(deep) not in tactics
    bad = prefill(kv_dtype="float8_e4m3fn", q_dtype="float32", out_dtype="float32")
    assert any("takes float16 or bfloat16 q" in r for r in plugin._reasons(bad, tactix.Tactic.default("cuda_native"),
                                                                           H200))  # fmt: skip
    for params in (prefill_op.default_prefill_params(128, H200, "sync"), default):
        plain = dict(prefill_op.prefill_variant("bfloat16", 128, params, "sm_90").defines)
        e5m2 = dict(prefill_op.prefill_variant("bfloat16", 128, params, "sm_90", kv_dtype="float8_e5m2").defines)
        smem = {"TX_SMEM": str(params.smem_bytes(128, 1)), "TX_STAGED": "2"} if params.mma == "wgmma" else {}
        # (Q K^T in float16 under bf16 q, TX_QK16, is opt-in: test_fp8_prefill_qk16_is_opt_in_...)
        assert e5m2 == {**plain, "TX_KV_FP8": "2", "TX_FP8_CVT": "1", **smem}
    assert prefill_op.prefill_smem_bytes(128, 128, 32, 3, kv_bytes=1) < prefill_op.prefill_smem_bytes(128, 128, 32, 3)
    # wgmma: the ring stays 16-bit and fp8 (K, V) pairs are staged beside it, two where they fit
    assert prefill_op.fp8_staged_pairs(128, 128, 128, 2) == 2 and prefill_op.fp8_staged_pairs(256, 128, 64, 2) == 1
    assert default.smem_bytes(128, 1) - default.smem_bytes(128) == 2 * 2 * 128 * 128
    assert dict(prefill_op.prefill_variant("bfloat16", 128, default, "sm_90", kv_dtype="float8_e4m3fn").defines)[
        "TX_STAGED"] == "2"  # fmt: skip


def test_fp8_prefill_qk16_is_opt_in_under_bf16_q_and_only_there(
    monkeypatch: pytest.MonkeyPatch, cache_root: Path
) -> None:
    """The wgmma kernel over an fp8 cache computes Q K^T in bfloat16 under bf16 q by default;
    TACTIX_CUDA_NATIVE_FP8_QK16=1 makes it float16 (TX_QK16, another variant and kernel key)
    under bf16 q only, not under fp16 q (already float16) nor over a 16-bit cache. Both compile
    for sm_90a without spills or serialized wgmma (what the float16 form computes:
    tests/plugins/test_cuda_native_emulated.py's fp8 prefill cases)."""
    params = prefill_op.default_params_for(prefill(kv_dtype="float8_e4m3fn"), H200)

    def variant(dtype: str = "bfloat16", kv: str | None = "float8_e4m3fn") -> runtime.Variant:
        return prefill_op.prefill_variant(dtype, 128, params, "sm_90", kv_dtype=kv)

    off = variant()
    assert ("TX_QK16", "1") not in off.defines
    monkeypatch.setenv("TACTIX_CUDA_NATIVE_FP8_QK16", "1")
    on = variant()
    assert ("TX_QK16", "1") in on.defines and on.key() != off.key()
    assert all(("TX_QK16", "1") not in v.defines for v in (variant("float16"), variant(kv=None)))
    for v in (on, off):
        usage = runtime.resource_usage(v, root=cache_root)["tactix_prefill"]
        assert usage["spill_stores"] == usage["spill_loads"] == usage["stack"] == 0, (v.label(), usage)
        assert usage["wgmma_serialized"] == 0, (v.label(), usage)


def test_decode_scale_arguments_pass_device_scales_by_address() -> None:
    """`paged.scale_args`: floats by value, tensors by address (never read on the host)."""
    import torch

    assert paged_op.scale_args(None, None) == paged_op.UNIT_SCALES == (1.0, 1.0, 0, 0)
    assert paged_op.scale_args(0.5, None) == (0.5, 1.0, 0, 0)
    t = torch.tensor([2.0])
    assert paged_op.scale_args(0.25, t) == (0.25, 1.0, 0, t.data_ptr())
    assert paged_op.scale_args(t, 3) == (1.0, 3.0, t.data_ptr(), 0)


def test_tuning_candidates_compile(cache_root: Path) -> None:
    """Every decode geometry the tuner may pick for d128, and the GEMM geometries for m=16 (both kernels)."""
    variants = {decode_op.decode_variant("bfloat16", 128, p, "sm_90") for p in decode_op.decode_candidates(128, H200)}
    variants |= {gemm_op.gemm_variant("bfloat16", 16, p, "sm_90") for p in gemm_op.gemm_candidates(16, H200)}
    variants |= {gemm_op.gemm_params_variant("bfloat16", 16, p, H200) for p in gemm_op.gemm_tactic_params(16, H200)}
    assert len(variants) >= 10
    runtime.compile_all(sorted(variants, key=lambda v: v.label()), root=cache_root)


# -- the SASS: what ptxas made of the kernels ------------------------------------------------
#
# ptxas (CUDA 13.0's and NVRTC 13.5's) miscompiles some kernels whose cp.async carry an L2 cache
# policy for sm_90: it emits the LDGSTS form `[Rx+URn+imm], desc[URn+1]` and overwrites URn while
# other LDGSTS still read URn:URn+1 as their policy (kernels/common.cuh). On the H200 every GEMM
# variant with that form died with "an illegal instruction was encountered" and every variant
# without it ran; NVRTC compiled them all without a word. The form is visible in the cubin: the
# low 12 bits of an sm_90 instruction are its opcode, 0xFAE for an LDGSTS with a register shared
# address, 0xDAE for one with register + uniform register (checked against cuobjdump's listing of
# the crashing and the clean variants; test_variants_do_not_spill compares the two where
# cuobjdump is installed).

_LDGSTS_R, _LDGSTS_R_UR = 0xFAE, 0xDAE


def _text_sections(cubin: bytes) -> dict[str, bytes]:
    """The ``.text.<kernel>`` sections of an ELF64 cubin."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]

    def name(header: tuple[int, ...]) -> str:
        start = names + header[0]
        return cubin[start : cubin.index(b"\0", start)].decode()

    return {name(h): cubin[h[4] : h[4] + h[5]] for h in headers if name(h).startswith(".text.")}


def _ldgsts_forms(cubin: bytes) -> tuple[int, int]:
    """LDGSTS instructions of an sm_90 cubin: (register shared address, register + uniform register)."""
    plain = uniform = 0
    for text in _text_sections(cubin).values():
        for at in range(0, len(text), 16):
            opcode = int.from_bytes(text[at : at + 8], "little") & 0xFFF
            plain += opcode == _LDGSTS_R
            uniform += opcode == _LDGSTS_R_UR
    return plain, uniform


def _enumerated_variants() -> list[runtime.Variant]:
    """Every variant a plan or the tuner can ask for on an H200: the defaults (bf16, fp16), and in
    bf16 every decode candidate for each head dim and every GEMM candidate for 1, 2 and 4 m-tiles."""
    out = set(default_variants(H200)) | set(fp8_decode_variants(H200))
    for d in HEAD_DIMS:
        out |= {decode_op.decode_variant("bfloat16", d, p, "sm_90") for p in decode_op.decode_candidates(d, H200)}
    for m in (1, 16, 32, 64):
        out |= {gemm_op.gemm_variant("bfloat16", m, p, "sm_90") for p in gemm_op.gemm_candidates(m, H200)}
        out |= {gemm_op.gemm_params_variant("bfloat16", m, p, H200) for p in gemm_op.gemm_tactic_params(m, H200)}
    return sorted(out, key=lambda v: v.label())


def test_no_variant_gets_the_ldgsts_form_ptxas_miscompiles(cache_root: Path) -> None:
    variants = _enumerated_variants()
    assert len(variants) >= 60
    runtime.compile_all(variants, root=cache_root)  # in parallel processes: the loop below reads the cache
    bad = []
    for variant in variants:
        cubin, _ = runtime.compile_variant(variant, root=cache_root)
        plain, uniform = _ldgsts_forms(cubin)
        if variant.source in ("decode_plan.cu", "merge.cu"):  # kernels that copy nothing asynchronously
            assert plain == uniform == 0, f"{variant.label()}: LDGSTS in a kernel without cp.async"
            continue
        if dict(variant.defines).get("TX_TMA") == "2":  # both operands through tensor maps: no cp.async at all
            assert plain == uniform == 0, f"{variant.label()}: LDGSTS in a kernel without cp.async"
            continue
        assert plain > 0, f"no LDGSTS found in {variant.label()}: the cubin reader is wrong"
        if uniform:
            bad.append(f"{variant.label()}: {uniform} LDGSTS [R+UR]")
    assert not bad, "ptxas emitted the LDGSTS form that crashes on the H200 (kernels/common.cuh):\n" + "\n".join(bad)


def test_the_check_sees_the_miscompile(tmp_path: Path) -> None:
    """The GEMM variant that crashed on the H200 (m = 16; bn 64, bk 64, 2 x 2 warps, 4 stages),
    compiled with W's evict_first policy back (TX_W_POLICY = 1): the check above must flag it."""
    params = GemmParams(bn=64, bk=64, wn=2, wk=2, stages=4)
    clean = gemm_op.gemm_variant("bfloat16", 16, params, "sm_90")
    hinted = runtime.Variant(clean.source, tuple(sorted((*clean.defines, ("TX_W_POLICY", "1")))), clean.arch)
    assert _ldgsts_forms(runtime.compile_variant(clean, root=tmp_path)[0])[1] == 0
    plain, uniform = _ldgsts_forms(runtime.compile_variant(hinted, root=tmp_path)[0])
    if not uniform:
        pytest.skip(f"NVRTC {runtime.nvrtc_version()} no longer emits the [R+UR] LDGSTS with a W policy: "
                    "the check is unproven with it (and the policy may be safe again)")  # fmt: skip
    assert plain > 0


def _cuobjdump() -> str | None:
    """cuobjdump from $CUOBJDUMP, PATH, $CUDA_HOME or the pip wheel (nvidia-cuda-cuobjdump), if any."""
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "cuobjdump"))
    wheels = importlib.util.find_spec("nvidia")  # the namespace package of NVIDIA's pip wheels
    for root in (wheels.submodule_search_locations or []) if wheels else []:
        candidates += [str(p) for p in Path(root).glob("*/bin/cuobjdump")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def test_variants_do_not_spill(cache_root: Path, tmp_path: Path) -> None:
    """No enumerated variant uses local memory (register spills) or a stack, and cuobjdump's
    listing has as many LDGSTS of each form as the cubin reader counts."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP)")
    # cuobjdump -sass runs nvdisasm, which the pip wheels (nvidia-cuda-nvdisasm) put beside it
    env = {**os.environ, "PATH": os.pathsep.join((str(Path(tool).parent), os.environ.get("PATH", "")))}

    def run(flag: str, path: Path) -> str:
        return subprocess.run([tool, flag, str(path)], capture_output=True, text=True, check=True, env=env).stdout

    def dump(item: tuple[int, runtime.Variant, bool]) -> tuple[runtime.Variant, bytes, str, str | None]:
        at, variant, listing = item
        cubin, _ = runtime.compile_variant(variant, root=cache_root)
        path = tmp_path / f"variant-{at}.cubin"
        path.write_bytes(cubin)
        return variant, cubin, run("-res-usage", path), run("-sass", path) if listing else None

    spills = []
    compared = 0
    variants = _enumerated_variants()
    runtime.compile_all(variants, root=cache_root)
    # -sass takes half a second a cubin: one cuobjdump per core, and the listing (which checks the
    # cubin reader, not the kernels) for three variants of each kind of kernel, where -res-usage
    # (milliseconds) reads every variant
    kinds: dict[tuple[str, str, str | None], int] = {}
    listed_too = set()
    for at, variant in enumerate(variants):
        kind = (variant.source, variant.arch, dict(variant.defines).get("TX_TMA"))
        kinds[kind] = kinds.get(kind, 0) + 1
        if kinds[kind] <= 3:
            listed_too.add(at)
    assert len(kinds) >= 5 and len(listed_too) >= 15
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        dumped = list(pool.map(dump, [(at, v, at in listed_too) for at, v in enumerate(variants)]))
    for variant, cubin, usage, sass in dumped:
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
        assert found, usage
        registers, stack, local = map(int, found.groups())
        if stack or local:
            spills.append(f"{variant.label()}: {registers} registers, stack {stack}, local {local}")
        if sass is None:
            continue
        listed = re.findall(r"(?<![.\w])LDGSTS\b[^;]*;", sass)  # not ARRIVES.LDGSTSBAR (cp.async.mbarrier.arrive)
        with_ur = sum(bool(re.search(r"\[R\d+\+UR\d+", i)) for i in listed)
        assert (len(listed) - with_ur, with_ur) == _ldgsts_forms(cubin), variant.label()
        compared += len(listed)
    assert compared > 0, "no listed variant has an LDGSTS: the listing compared nothing"
    assert not spills, "\n".join(spills)


def test_disk_cache_hit_then_corrupt_files_are_recompiled(tmp_path: Path) -> None:
    variant = decode_op.decode_variant("float16", 64, decode_op.default_decode_params(64, H200), "sm_90")
    first, built = runtime.compile_variant(variant, root=tmp_path)
    assert built
    path = runtime.cache_dir(tmp_path) / "sm_90" / f"{variant.key()}.cubin"
    assert path.is_file() and path.stat().st_size > len(first)
    assert [p.name for p in path.parent.iterdir()] == [path.name], "a temporary file was left behind"

    runtime._memory.clear()  # a new process: only the disk cache is left
    before = dict(runtime.stats)
    again, built = runtime.compile_variant(variant, root=tmp_path)
    assert not built and again == first
    assert runtime.stats["disk_hits"] == before["disk_hits"] + 1
    assert runtime.stats["compiled"] == before["compiled"]

    for damage in ("truncate", "flip", "garbage"):
        raw = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(raw[: len(raw) // 2])
        elif damage == "flip":
            path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
        else:
            path.write_bytes(b"not a cubin")
        runtime._memory.clear()
        before = dict(runtime.stats)
        cubin, built = runtime.compile_variant(variant, root=tmp_path)
        assert built, f"a {damage}d cache file was loaded instead of recompiled"
        assert cubin == first
        assert runtime.stats["recompiled_corrupt"] == before["recompiled_corrupt"] + 1
        assert runtime._read_cached(path) == first, "the recompiled cubin was not written back whole"


def test_cache_key_covers_every_compile_input() -> None:
    base = runtime.Variant.make("decode.cu", "sm_90", TX_BF16=1, TX_D=128, TX_TILE=64, TX_WARPS=4, TX_STAGES=3)
    assert (
        base.key()
        == runtime.Variant.make("decode.cu", "sm_90", TX_STAGES=3, TX_WARPS=4, TX_TILE=64, TX_D=128, TX_BF16=1).key()
    )
    others = [
        runtime.Variant.make("decode.cu", "sm_80", TX_BF16=1, TX_D=128, TX_TILE=64, TX_WARPS=4, TX_STAGES=3),
        runtime.Variant.make("decode.cu", "sm_90", TX_BF16=0, TX_D=128, TX_TILE=64, TX_WARPS=4, TX_STAGES=3),
        runtime.Variant.make("decode.cu", "sm_90", TX_BF16=1, TX_D=128, TX_TILE=64, TX_WARPS=4, TX_STAGES=4),
        runtime.Variant.make("gemm.cu", "sm_90", TX_BF16=1, TX_D=128, TX_TILE=64, TX_WARPS=4, TX_STAGES=3),
    ]
    assert len({base.key(), *(v.key() for v in others)}) == 1 + len(others)
    # headers are inlined into the hashed text, so editing common.cuh changes every key
    assert "tx_cp_async16" in runtime.source_text("decode.cu")
    assert "#include" not in runtime.source_text("gemm.cu")
    assert set(runtime.sources()) == {
        "common.cuh",
        "decode.cu",
        "decode_plan.cu",
        "fp8.cuh",
        "gemm.cu",
        "gemm_sm90.cu",
        "merge.cu",
        "prefill.cu",
        "prefill_sm90.cu",
        "sm90.cuh",
    }
    # the arch is part of the key: the wgmma kernel's sm_90a cubin is not an sm_90 one
    wgmma = prefill_op.default_prefill_params(128, H200)
    sm90 = prefill_op.prefill_variant("bfloat16", 128, wgmma, "sm_90")
    assert sm90.arch == "sm_90a" and prefill_op.prefill_variant("bfloat16", 128, wgmma, "sm_90a") == sm90


def test_a_compile_error_raises_tactix_error_with_the_log(tmp_path: Path) -> None:
    bad = runtime.Variant.make("decode.cu", "sm_90", TX_BF16=1, TX_D=100, TX_TILE=64, TX_WARPS=4, TX_STAGES=3)
    with pytest.raises(runtime.KernelCompileError) as info:
        runtime.compile_variant(bad, root=tmp_path)
    assert isinstance(info.value, tactix.TactixError)
    assert "head dim must be 64, 128 or 256" in info.value.log
    assert "TX_D=100" in str(info.value)
    assert not (runtime.cache_dir(tmp_path) / "sm_90" / f"{bad.key()}.cubin").exists()


def test_parallel_compile_fills_the_cache_and_reports_a_workers_error(tmp_path: Path) -> None:
    info = H200
    good = [gemm_op.gemm_variant("bfloat16", m, gemm_op.default_sync_gemm_params(m, info), "sm_90") for m in (1, 32)]
    seen: list[tuple[int, int, str]] = []
    assert runtime.compile_all(good, lambda *a: seen.append(a), root=tmp_path, jobs=2) == 2
    assert [(d, t) for d, t, _ in seen] == [(1, 2), (2, 2)]
    for v in good:  # written by the worker processes, whole and valid
        assert runtime._read_cached(runtime.cache_dir(tmp_path) / "sm_90" / f"{v.key()}.cubin") is not None
    assert runtime.compile_all(good, root=tmp_path, jobs=2) == 0  # now cached: nothing compiled
    bad = runtime.Variant.make("decode.cu", "sm_90", TX_BF16=1, TX_D=100, TX_TILE=64, TX_WARPS=4, TX_STAGES=3)
    other = gemm_op.gemm_variant("float16", 1, gemm_op.default_sync_gemm_params(1, info), "sm_90")
    with pytest.raises(runtime.KernelCompileError) as raised:
        runtime.compile_all([bad, other], root=tmp_path, jobs=2)
    assert raised.value.variant == bad
    assert "head dim must be 64, 128 or 256" in raised.value.log


def _seed_cache(cache_root: Path, target: Path, leave_out: int) -> int:
    """Copy the default variants' cubins (compiled into ``cache_root`` by the compile tests, or
    now) into the cache at ``target``, all but ``leave_out`` of them; returns how many were copied.
    The commands under test then compile only what is missing (compiling is tested above)."""
    import shutil

    variants = sorted(set(default_variants(H200)), key=lambda v: v.key())
    runtime.compile_all(variants, root=cache_root)
    copied = 0
    for variant in variants[leave_out:]:
        relative = Path(variant.arch) / f"{variant.key()}.cubin"
        path = runtime.cache_dir(cache_root) / relative
        dest = runtime.cache_dir(target) / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        copied += 1
    return copied


def test_module_command_compiles_every_candidate_variant_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    from tactix_cuda_native.__main__ import main

    every = candidate_variants(H200)
    assert set(default_variants(H200)) <= set(every)
    for problem_m in (1, 16, 64):  # every GEMM tactic the backend enumerates has its variant in the list
        for p in gemm_op.gemm_tactic_params(problem_m, H200):
            assert gemm_op.gemm_params_variant("float16", problem_m, p, H200) in every
    seeded = _seed_cache(cache_root, tmp_path, leave_out=2)  # the two missing ones are compiled
    monkeypatch.setenv("TACTIX_CACHE_DIR", str(tmp_path))
    runtime._memory.clear()
    assert main(["--arch", "sm_90", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    n = len(set(default_variants(H200)))
    assert f"{n} variants for sm_90: {n - seeded} compiled" in out and n - seeded == 2
    with pytest.raises(SystemExit):
        main(["--jobs", "0"])


def test_warmup_command_compiles_with_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    from tactix.cli import main

    seeded = _seed_cache(cache_root, tmp_path, leave_out=3)  # warmup compiles the three missing ones
    monkeypatch.setenv("TACTIX_CACHE_DIR", str(tmp_path))
    runtime._memory.clear()
    assert main(["warmup", "cuda_native", "--arch", "sm_90"]) == 0
    captured = capsys.readouterr()
    total = len(default_variants(H200))
    assert f"cuda_native: {total - seeded} compiled now" in captured.out and total - seeded == 3
    assert f"[{total}/{total}]" in captured.err and "decode.cu" in captured.err and "prefill_sm90.cu" in captured.err
    cubins = [p for arch in ("sm_90", "sm_90a") for p in (tmp_path / "cuda_native" / "v1" / arch).glob("*.cubin")]
    assert len(cubins) == total
    assert main(["warmup", "cuda_native", "--arch", "sm_90"]) == 0
    assert "cuda_native: 0 compiled now" in capsys.readouterr().out
    assert main(["warmup", "cuda_native", "--arch", "hopper"]) == 2
    assert "'--arch' must be a target like 'sm_90'" in capsys.readouterr().err
    assert main(["warmup", "torch"]) == 0
    assert "torch: nothing to compile ahead of time" in capsys.readouterr().out


# -- tactics ---------------------------------------------------------------------------------


def test_tactics_are_enumerated_valid_and_round_trip() -> None:
    backend = get_registry().get("cuda_native")
    for problem in (decode(), decode(head_dim_qk=256, head_dim_vo=256), decode(head_dim_qk=64, head_dim_vo=64)):
        tactics = plugin.tactix_tactics(problem)
        assert tactics, problem
        assert all(t.backend == "cuda_native" and t.kernel == "decode" for t in tactics)
        assert all(plugin._reasons(problem, t, H200) == [] for t in tactics)
        default = decode_op.default_decode_params(problem.head_dim_qk, H200).to_tactic()
        assert default in tactics
        assert len(set(tactics)) == len(tactics)
        for t in tactics:
            assert tactix.tactics.parse_tactic(t.to_json()) == t
            assert DecodeParams.from_tactic(t).to_tactic() == t
    assert backend.tactics(decode())[0] == tactix.Tactic.default("cuda_native")
    # bulk-copy tactics on Hopper for HND caches whose pages they divide, never otherwise
    bulk = {t.params["bulk"] for t in plugin.tactix_tactics(decode()) if "bulk" in t.params}
    assert bulk == {8, 16}
    for other in (decode(kv_layout="NHD"), decode(page_size=4)):
        assert not [t for t in plugin.tactix_tactics(other) if "bulk" in t.params]
    a100 = DeviceInfo(sms=108, smem_per_block=232448, smem_per_sm=233472, arch="sm_80")
    assert not [p for p in decode_op.decode_candidates(128, a100) if p.bulk]
    for m in (1, 16, 64):
        # elsewhere: the mma.sync kernel's every split count and L2 hint
        sync = [p.to_tactic() for p in gemm_op.gemm_tactic_params(m, a100)]
        assert sync and all(t.kernel == "gemm" for t in sync)
        assert all(plugin._reasons(gemm(m=m), t, a100) == [] for t in sync)
        assert {t.params["splits"] for t in sync} >= {0, 1, 2}
        for t in sync:
            assert GemmParams.from_tactic(t).to_tactic() == t
        # W has no L2 policy (kernels/common.cuh): l2 0 and 1 are one kernel, so only 2 is a candidate
        assert {t.params.get("l2", 1) for t in sync} == {1, 2}
        # Hopper: the wgmma kernel's candidates first (its default leading), then each mma.sync
        # shape with its split count chosen per shape; few enough for the tuner's 64-tactic budget
        tactics = plugin.tactix_tactics(gemm(m=m))
        assert len(set(tactics)) == len(tactics) <= tactix.MeasurementPolicy().max_candidates
        assert all(plugin._reasons(gemm(m=m), t, H200) == [] for t in tactics)
        kinds = [t.kernel for t in tactics]
        assert kinds == sorted(kinds, key=lambda k: k != "gemm_wgmma") and {"gemm", "gemm_wgmma"} <= set(kinds)
        assert tactics[0] == gemm_op.default_gemm_params(m, H200).to_tactic()
        assert {t.params["splits"] for t in tactics if t.kernel == "gemm_wgmma"} == {0, 2, 4, 8}
        assert {t.params["splits"] for t in tactics if t.kernel == "gemm"} == {0}
        for t in tactics:
            assert gemm_op.gemm_params_of(t).to_tactic() == t
    shape = GemmParams(bn=64, bk=64, wn=2, wk=2, stages=4)
    variants = [gemm_op.gemm_variant("bfloat16", 16, shape.replace(l2=l2), "sm_90") for l2 in (0, 1, 2)]
    assert variants[0] == variants[1] != variants[2]


def test_bad_tactic_params_give_reasons() -> None:
    def reasons(kernel: str, params: dict[str, object], problem: DecodeProblem | GemmProblem) -> list[str]:
        return plugin._reasons(problem, tactix.Tactic(backend="cuda_native", kernel=kernel, params=params), H200)  # type: ignore[arg-type]

    ok = {"tile": 64, "warps": 4, "stages": 3, "kv_chunk": 0}
    assert reasons("decode", ok, decode()) == []
    assert reasons("decode", {**ok, "l2": 0}, decode()) == reasons("decode", {**ok, "l2": 2}, decode()) == []
    # bulk copies: HND, a page size they divide, 4 to 16 copies a tile, sm_90
    assert reasons("decode", {**ok, "bulk": 16}, decode()) == reasons("decode", {**ok, "bulk": 8}, decode()) == []
    assert "needs the HND layout" in reasons("decode", {**ok, "bulk": 16}, decode(kv_layout="NHD"))[0]
    assert "multiple of it (got 8)" in reasons("decode", {**ok, "bulk": 16}, decode(page_size=8))[0]
    assert "bulk must be 0" in reasons("decode", {**ok, "bulk": 4}, decode())[0]
    assert "into 4 to 16 copies" in reasons("decode", {**ok, "bulk": 32}, decode(page_size=32))[0]
    a100 = DeviceInfo(sms=108, smem_per_block=232448, smem_per_sm=233472, arch="sm_80")
    tactic = tactix.Tactic(backend="cuda_native", kernel="decode", params={**ok, "bulk": 16})
    assert "need sm_90 or later" in plugin._reasons(decode(), tactic, a100)[0]
    assert arch_at_least("sm_90a", 90) and arch_at_least("sm_100", 90)
    assert not arch_at_least("sm_89", 90)
    # each copy's segment is 16 bytes longer in shared memory (banks): 4 segments a K or V tile
    assert decode_op.decode_smem_bytes(128, 64, 4, 2, 16) == decode_op.decode_smem_bytes(128, 64, 4, 2) + 2 * 2 * 4 * 16
    # the same segments through tensor maps: no padding (the swizzle), a variant of their own, bulk needed
    assert decode_op.decode_smem_bytes(128, 64, 4, 2, 16, 1) == decode_op.decode_smem_bytes(128, 64, 4, 2)
    assert reasons("decode", {**ok, "bulk": 16, "tma": 1}, decode()) == []
    assert "needs bulk 8, 16 or 32" in reasons("decode", {**ok, "tma": 1}, decode())[0]
    assert "tma must be 0 or 1" in reasons("decode", {**ok, "bulk": 16, "tma": 2}, decode())[0]
    assert "needs the HND layout" in reasons("decode", {**ok, "bulk": 16, "tma": 1}, decode(kv_layout="NHD"))[0]
    with_maps = DecodeParams(tile=64, warps=4, stages=3, kv_chunk=0, l2=1, bulk=16, tma=1)
    assert dict(decode_op.decode_variant("bfloat16", 128, with_maps, "sm_90").defines)["TX_TMA"] == "1"
    assert DecodeParams.from_tactic(with_maps.to_tactic()) == with_maps
    assert "l2 must be 0" in reasons("decode", {**ok, "l2": 3}, decode())[0]
    assert "tile / warps must be 16 or 32" in reasons("decode", {**ok, "tile": 48}, decode())[0]
    assert "stages must be in 2..8" in reasons("decode", {**ok, "stages": 1}, decode())[0]
    assert "multiple of tile 64" in reasons("decode", {**ok, "kv_chunk": 100}, decode())[0]
    d256 = decode(head_dim_qk=256, head_dim_vo=256)
    assert "shared memory" in reasons("decode", {"tile": 128, "warps": 4, "stages": 8}, d256)[0]
    assert "must be integers" in reasons("decode", {**ok, "tile": "64"}, decode())[0]
    assert "decode params must be" in reasons("decode", {"tile": 64}, decode())[0]
    assert "unknown decode kernel" in reasons("gemm", ok, decode())[0]
    assert "takes no params" in reasons("default", {"tile": 64}, decode())[0]
    good = {"bn": 32, "bk": 128, "wn": 1, "wk": 4, "stages": 6, "splits": 0}
    assert reasons("gemm", good, gemm()) == []
    assert reasons("gemm", {**good, "l2": 0}, gemm()) == []
    assert "l2 must be 0" in reasons("gemm", {**good, "l2": -1}, gemm())[0]
    assert "gemm params must be" in reasons("gemm", {**good, "hint": 1}, gemm())[0]
    assert "bk must be 64 or 128" in reasons("gemm", {**good, "bk": 32}, gemm())[0]
    assert "multiple of 16 * wn" in reasons("gemm", {**good, "bn": 40}, gemm())[0]
    assert "must divide among wk" in reasons("gemm", {**good, "bk": 64, "wk": 8, "wn": 1}, gemm())[0]
    # the 2 k-warps' 64 x 256 fp32 partials (128 KB) outgrow 3 stages of 40 KB; 4 stages hold them
    wide = {"bn": 256, "bk": 64, "wn": 4, "wk": 2, "stages": 3, "splits": 0}
    assert "partial sums (131072 bytes) must fit" in reasons("gemm", wide, gemm(m=64))[0]
    assert reasons("gemm", {**wide, "stages": 4}, gemm(m=64)) == []


def test_decode_run_checks_the_cache_strides_the_bulk_tactic_needs() -> None:
    """`CudaNativeDecodePlan._accept` (run() calls it when the strides change; only strides are
    read, so CPU tensors do): every cache must be dense along head_dim with 16-byte strides, and
    the bulk-copy tactic also needs each page's rows contiguous (not through tensor maps). The
    error names the argument."""
    import torch

    def accept(bulk: int, k: torch.Tensor, v: torch.Tensor, tma: int = 0) -> types.SimpleNamespace:
        plan = types.SimpleNamespace(problem=decode(), _bulk=bulk, _tma=tma)
        decode_op.CudaNativeDecodePlan._accept(plan, torch.zeros(2, 32, 128), k, v)  # type: ignore[arg-type]
        return plan

    hnd = torch.zeros(6, 8, 16, 128)  # [pages, heads, tokens, head_dim]
    assert accept(16, hnd, hnd)._strides == (16384, 128, 2048) * 2
    padded = torch.zeros(6, 8, 16, 136)[..., :128]  # rows 136 elements apart: cp.async reads them
    assert accept(0, padded, padded)._strides == (17408, 136, 2176) * 2
    with pytest.raises(tactix.InvalidArgumentError, match=r"paged_kv_cache \(k\).*token stride = head_dim"):
        accept(16, padded, hnd)
    # the same segments through tensor maps take any 16-byte strides
    assert accept(16, padded, hnd, tma=1)._strides == (17408, 136, 2176, 16384, 128, 2048)
    with pytest.raises(tactix.InvalidArgumentError, match=r"paged_kv_cache \(v\).*multiples of 8"):
        accept(0, hnd, torch.zeros(6, 8, 16, 129)[..., 1:])
    # fp8 caches: one byte an element, so 16-byte rows take strides in multiples of 16 elements
    fp8 = torch.zeros(6, 8, 16, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert accept(0, fp8, fp8)._strides == (16384, 128, 2048) * 2
    padded8 = torch.zeros(6, 8, 16, 136, dtype=torch.uint8).view(torch.float8_e4m3fn)[..., :128]
    with pytest.raises(tactix.InvalidArgumentError, match=r"paged_kv_cache \(k\).*multiples of 16"):
        accept(0, padded8, fp8)
    padded16 = torch.zeros(6, 8, 16, 144, dtype=torch.uint8).view(torch.float8_e5m2)[..., :128]
    assert accept(0, padded16, padded16)._strides == (18432, 144, 2304) * 2


# -- support reasons -------------------------------------------------------------------------


def test_unsupported_problems_have_explicit_reasons() -> None:
    default = tactix.Tactic.default("cuda_native")
    spec = get_registry().get("cuda_native").spec
    assert spec.prefill is not None and spec.decode is not None and spec.gemm is not None
    assert spec.preference == 5
    assert spec.reasons(decode(page_size=256)) == ["page size 256 not in {1, 128, 16, 2, 32, 4, 64, 8}"]
    assert "head_dim_qk 96 not in" in spec.reasons(decode(head_dim_qk=96, head_dim_vo=96))[0]
    assert "q dtype float32" in spec.reasons(decode(q_dtype="float32", kv_dtype="float32", out_dtype="float32"))[0]
    assert "head_dim_vo must equal head_dim_qk" in spec.reasons(decode(head_dim_vo=64))
    assert plugin._reasons(decode(out_dtype="float16"), default, H200) == ["q, kv and out dtypes must be the same"]
    assert plugin._reasons(decode(), default, H200) == []
    # GEMM: m above 64 goes elsewhere; fp8, m-major a, n-major b and odd k are refused with reasons
    assert spec.reasons(gemm(m=65)) == ["m 65 above 64"]
    fp8 = gemm(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", scale_mode="per_tensor")
    assert "dtype combination" in spec.reasons(fp8)[0]
    assert spec.reasons(gemm(a_k_major=False)) == ["a must be k-major (row-major [m, k])"]
    assert spec.reasons(gemm(b_k_major=False)) == ["b must be k-major (a transposed [n, k] weight)"]
    assert plugin._reasons(gemm(k=4100), default, H200) == ["k must be a multiple of 8 (16-byte rows; got k=4100)"]
    assert spec.reasons(gemm(bias_dtype="bfloat16", batched=True, batch=3)) == []


STORED_TACTICS = Path(__file__).with_name("cuda_native_tactics_v1.txt")
PARAMS = {"decode": DecodeParams, "prefill": PrefillParams, "gemm": GemmParams, "gemm_wgmma": GemmWgmmaParams}


def test_tactics_stored_before_the_op_modules_stay_readable() -> None:
    """Every tactic the plugin enumerated before its parameters became pydantic models (printed
    and as JSON, as the code of commit 7f5c496 wrote them) reads back into its kernel's parameters
    and writes out again as the same tactic, in the same printed form and the same JSON: the same
    names, keys (optional ones left out at their defaults) and value types."""
    lines = [line.split("\t") for line in STORED_TACTICS.read_text().splitlines() if not line.startswith("#")]
    kernels = {printed.split("(")[0].removeprefix("cuda_native:") for printed, _ in lines}
    assert len(lines) == 190 and kernels == set(PARAMS)
    for printed, stored in lines:
        tactic = tactix.tactics.parse_tactic(printed)
        assert tactix.tactics.parse_tactic(stored) == tactic, printed
        params = PARAMS[tactic.kernel].from_tactic(tactic)
        again = params.to_tactic()
        assert again == tactic and str(again) == printed and again.to_json() == stored, printed
        assert all(type(v) is (str if k == "mma" else int) for k, v in again.params.items()), printed
    # the models: frozen, no unknown fields, the old defaults
    p = DecodeParams(tile=64, warps=4, stages=2)
    assert (p.kv_chunk, p.l2, p.bulk, p.tma) == (0, 1, 0, 0) and p.to_tactic().params == {
        "tile": 64, "warps": 4, "stages": 2, "kv_chunk": 0}  # fmt: skip
    with pytest.raises(pydantic.ValidationError):
        p.tile = 32  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        DecodeParams(tile=64, warps=4, stages=2, hint=1)  # type: ignore[call-arg]
    assert p.replace(l2=0).to_tactic().params["l2"] == 0 and hash(p) == hash(DecodeParams(tile=64, warps=4, stages=2))


def test_a_bad_tactic_is_a_tactic_error_naming_its_params() -> None:
    """`from_tactic` on a tactic the check did not pass: a `tactix.TacticError` that names the
    parameters at fault (the check gives the same sentence as its reason)."""

    def tactic(kernel: str, **params: object) -> tactix.Tactic:
        return tactix.Tactic(backend="cuda_native", kernel=kernel, params=params)  # type: ignore[arg-type]

    with pytest.raises(tactix.TacticError, match=r"decode params must be integers .*; not integers: tile"):
        DecodeParams.from_tactic(tactic("decode", tile="64", warps=4, stages=2))
    optional = r"with kv_chunk, l2, bulk, tma, ctas and vreg optional .*; missing: warps"
    with pytest.raises(tactix.TacticError, match=optional):
        DecodeParams.from_tactic(tactic("decode", tile=64, stages=2))
    with pytest.raises(tactix.TacticError, match=r"; unknown: hint"):
        GemmParams.from_tactic(tactic("gemm", bn=32, bk=128, wn=1, wk=4, stages=4, hint=1))
    with pytest.raises(tactix.TacticError, match=r"prefill param mma must be 'sync' or 'wgmma' \(got 1\)"):
        PrefillParams.from_tactic(tactic("prefill", q_tile=128, kv_tile=128, warps=8, stages=2, mma=1))
    with pytest.raises(tactix.TacticError, match=r"not integers: persist"):
        PrefillParams.from_tactic(tactic("prefill", q_tile=128, kv_tile=128, warps=8, stages=2, persist=True))
    with pytest.raises(tactix.TacticError, match=r"not a tactic of kernel 'gemm_wgmma'"):
        GemmWgmmaParams.from_tactic(tactic("gemm", bn=32, bk=128, wn=1, wk=4, stages=4))
    reasons = plugin._reasons(decode(), tactic("decode", tile=64, warps=4.0, stages=2), H200)
    assert reasons == [
        "decode params must be integers (got {'tile': 64, 'warps': 4.0, 'stages': 2}); not integers: warps"
    ]


# -- launch geometry -------------------------------------------------------------------------


def test_decode_defaults_fit_every_head_dim_and_smaller_gpus() -> None:
    small = DeviceInfo(sms=84, smem_per_block=101376, smem_per_sm=102400, arch="sm_86")
    for info in (H200, small):
        for d in HEAD_DIMS:
            p = decode_op.default_decode_params(d, info)
            assert p.reasons(d, info) == [], (d, info.arch)
    # d128: 2 stages of 64 keys (3 CTAs per SM: 12 warps); a small batch takes a third stage (2 CTAs)
    h200_128 = decode_op.default_decode_params(128, H200)
    assert (h200_128.tile, h200_128.warps, h200_128.stages, h200_128.l2) == (64, 4, 2, 1)
    smem = decode_op.decode_smem_bytes(128, 64, 4, 2)
    assert smem == 2 * 2 * 64 * 256 + 16 * 256 + 2 * 2 * 64 * 8 + 4 * 32 * 4 + 32 * 4 + 16
    assert ctas_per_sm(H200, smem, 128) == 3
    small = decode_op.default_decode_params(128, H200, small=True)
    assert (small.tile, small.warps, small.stages) == (64, 4, 3)
    assert ctas_per_sm(H200, decode_op.decode_smem_bytes(128, 64, 4, 3), 128) == 2
    assert ctas_per_sm(H200, smem, 128, resident=5) == 5  # the driver's answer wins
    assert ctas_per_sm(H200, smem, 128, resident=0) == 1
    for d in HEAD_DIMS:
        assert decode_op.default_decode_params(d, H200, small=True).reasons(d, H200) == []
    # D2 (one request of 8192 keys, 8 KV heads) is small; D1 and D3 are not
    assert decode_op.decode_is_small([8192], 8, H200)
    assert not decode_op.decode_is_small([2048] * 256, 8, H200)
    assert not decode_op.decode_is_small([4096] * 64, 8, H200)


def test_decode_chunks_fill_the_gpu_for_the_benchmark_shapes() -> None:
    slots = H200.sms * 2
    # D2: one request of 8192 keys, 8 KV heads: 512-key chunks -> 16 splits x 8 heads = 128 CTAs
    # (the fewest keys per piece: fewer partials to merge, measured faster than 256 CTAs)
    chunk = decode_op.decode_chunk([8192], 8, 64, slots)
    assert chunk == decode_op.DECODE_MIN_CHUNK == 512
    work = decode_op.decode_work([(0, 8192)], chunk)
    assert len(work.items) == 16 and work.slots == 16 and work.splits == [(0, 16)]
    assert decode_op.decode_grid(len(work.items), 8, 4) == (16 * 8, 1, 1)
    assert slots >= 16 * 8
    # D3: 256 x 2048 keys: no split, 2048 CTAs, no merge
    chunk = decode_op.decode_chunk([2048] * 256, 8, 64, slots)
    work = decode_op.decode_work([(0, 2048)] * 256, chunk)
    assert chunk == 2048 and not work.needs_merge and len(work.items) == 256
    # ... also at 3 CTAs per SM (5 waves: a split's merge costs more than the short last wave)
    assert decode_op.decode_chunk([2048] * 256, 8, 64, H200.sms * 3) == 2048
    # a batch too short of waves is split, into equal pieces: 64 x 4096 keys at 3 CTAs per SM
    # (32768 tile-units over 4 x 396 items: 21 tiles -> 4 pieces of 16 tiles, not 21 + 21 + 21 + 1)
    assert decode_op.decode_chunk([4096] * 64, 8, 64, H200.sms * 3) == 1024
    # never below DECODE_MIN_CHUNK keys, never above the longest request
    assert decode_op.decode_chunk([1000], 8, 64, slots) == 512
    assert decode_op.decode_chunk([100] * 4096, 8, 64, slots) == 128

    # D1: 64 requests of 1k..8k keys: chunks of a few hundred to a thousand keys, many CTAs
    import torch

    torch.manual_seed(0)
    lens = torch.randint(1024, 8192, (64,)).tolist()
    chunk = decode_op.decode_chunk(lens, 8, 64, slots)
    work = decode_op.decode_work([(0, n) for n in lens], chunk)
    assert 256 <= chunk <= 2048 and chunk % 64 == 0
    assert len(work.items) * 8 >= 4 * slots
    # one request of one key: one item, no split
    assert decode_op.decode_work([(0, 1)], decode_op.decode_chunk([1], 8, 64, slots)).items == [(0, 0, 1, -1)]


def test_decode_work_covers_each_range_exactly_once() -> None:
    ranges = [(0, 1), (0, 15), (0, 16), (0, 17), (3, 700), (0, 32768), (100, 101)]
    for chunk in (64, 256, 1000 * 64):
        work = decode_op.decode_work(ranges, chunk)
        covered: dict[int, list[tuple[int, int]]] = {}
        for req, start, end, slot in work.items:
            assert start < end and end - start <= chunk
            covered.setdefault(req, []).append((start, end))
            first, count = work.splits[req]
            if count == 1:
                assert slot == -1
            else:
                assert first <= slot < first + count
        for req, (start, end) in enumerate(ranges):
            pieces = sorted(covered[req])
            assert pieces[0][0] == start and pieces[-1][1] == end
            assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
        slots = sorted(s for *_, s in work.items if s >= 0)
        assert slots == list(range(work.slots))
        lengths = [e - s for _, s, e, _ in work.items]
        assert lengths == sorted(lengths, reverse=True), "items must be longest first"
        assert len(work.items) <= decode_op.decode_capacity(len(ranges), 32768, chunk)


def test_decode_work_orders_items_as_one_stable_sort_longest_first() -> None:
    """The plan's work list equals the plain definition (every piece, then one stable sort by
    length, longest first) for ragged ranges, windows and chunks around the lengths."""

    def reference(ranges: list[tuple[int, int]], chunk: int) -> list[tuple[int, int, int, int]]:
        items, slots = [], 0
        for b, (start, end) in enumerate(ranges):
            pieces = max(1, -(-(end - start) // chunk))
            if pieces == 1:
                items.append((b, start, end, -1))
                continue
            items += [(b, start + i * chunk, min(end, start + (i + 1) * chunk), slots + i) for i in range(pieces)]
            slots += pieces
        return sorted(items, key=lambda it: it[1] - it[2])

    rng = random.Random(7)
    for _ in range(2000):
        ends = [
            rng.choice([1, 2, 63, 64, 65, 128, 256, 257, 1000, rng.randint(1, 3000)]) for _ in range(rng.randint(1, 12))
        ]
        ranges = decode_op.effective_lengths(ends, rng.choice([-1, -1, 0, 63, 300]))
        chunk = rng.choice([1, 16, 64, 128, 256, 1000])
        assert decode_op.decode_work(ranges, chunk).items == reference(ranges, chunk), (ranges, chunk)


def test_decode_plan_helpers_equal_their_plain_definitions() -> None:
    """The work-list helpers a decode plan calls every batch (written with C-level iteration)
    give what their plain definitions give: the chunk, the small-batch test and the kernel's item
    records, over ragged batches, windows and tiles."""

    def chunk_reference(lengths: list[int], units: int, tile: int, slots: int, min_chunk: int) -> int:
        tiles = max(len(lengths), math.ceil(sum(lengths) / tile))  # the batch's keys in tiles
        longest = max(1, math.ceil(max(lengths) / tile))
        chunk_tiles = math.ceil(tiles * units / (decode_op.DECODE_ITEMS_PER_SLOT * slots))
        chunk_tiles = min(max(chunk_tiles, math.ceil(min_chunk / tile), 1), longest)
        pieces = math.ceil(longest / chunk_tiles)
        return math.ceil(longest / pieces) * tile

    def items_reference(work: decode_op.DecodeWork, page_base: list[int]) -> list[int]:
        out = []
        for req, start, end, slot in work.items:
            first, count = work.splits[req]
            out += [req, start, end, slot, page_base[req], first, count, 0]
        return out

    rng = random.Random(11)
    for _ in range(1000):
        lens = [rng.choice([1, 2, 63, 64, 65, 511, 512, 513, 2048, rng.randint(1, 9000)])
                for _ in range(rng.randint(1, 70))]  # fmt: skip
        window = rng.choice([-1, -1, 0, 100, 1000])
        ranges = decode_op.effective_lengths(lens, window)
        assert ranges == [((max(0, n - 1 - window) if window >= 0 else 0), n) for n in lens]
        lengths = [e - s for s, e in ranges]
        units, tile, slots = rng.choice([1, 8, 16]), rng.choice([32, 64, 128]), rng.choice([132, 264, 396])
        min_chunk = rng.choice([64, 256, decode_op.DECODE_MIN_CHUNK])
        chunk = decode_op.decode_chunk(lengths, units, tile, slots, min_chunk)
        assert chunk == chunk_reference(lengths, units, tile, slots, min_chunk), (lengths, units, tile, slots)
        pieces = sum(max(1, -(-n // min_chunk)) for n in lengths) * units
        assert decode_op.decode_is_small(lengths, units, H200, min_chunk) == (pieces <= 2 * H200.sms)
        work = decode_op.decode_work(ranges, chunk)
        page_base = sorted(rng.sample(range(100000), len(lens)))
        assert decode_op.decode_items(work, page_base) == items_reference(work, page_base)


def test_window_limits_the_attended_range() -> None:
    assert decode_op.effective_lengths([1, 10, 100], -1) == [(0, 1), (0, 10), (0, 100)]
    assert decode_op.effective_lengths([1, 10, 100], 0) == [(0, 1), (9, 10), (99, 100)]
    assert decode_op.effective_lengths([1, 10, 100], 64) == [(0, 1), (0, 10), (35, 100)]


def test_grids_and_q_tiles() -> None:
    assert [decode_op.q_tiles(g) for g in (1, 4, 8, 16, 17, 32)] == [1, 1, 1, 1, 2, 2]
    # one CTA per item and (KV head, q tile), an item's CTAs adjacent
    assert decode_op.decode_units(4, 32) == 8
    assert decode_op.decode_grid(10, 4, 32) == (80, 1, 1)


def test_a_short_last_wave_of_whole_requests_is_cut_into_pieces() -> None:
    """D3 at 3 CTAs per SM: 256 whole requests x 8 KV heads are 5 waves of 396 CTAs and 68 more.
    The 9 requests that reach into that last wave are cut into 512-key pieces that fill it; the
    work still covers every key once, split requests merge, and items stay longest first."""
    slots = H200.sms * 3
    work = decode_op.decode_work([(0, 2048)] * 256, 2048)
    balanced = decode_op.decode_balance_tail(work, 8, slots, 64)
    assert len(balanced.items) == 247 + 9 * 4 and balanced.slots == 36
    assert balanced.items[:247] == work.items[:247]
    assert {r for r, *_ in balanced.items[247:]} == set(range(247, 256))
    assert all(e - s == 512 for _, s, e, _ in balanced.items[247:])
    assert balanced.splits[:247] == work.splits[:247] and all(c == 4 for _, c in balanced.splits[247:])
    assert slots >= 9 * 4 * 8  # the pieces fit one wave
    lengths = [e - s for _, s, e, _ in balanced.items]
    assert lengths == sorted(lengths, reverse=True)
    for req in range(247, 256):
        first, count = balanced.splits[req]
        pieces = sorted((s, e, slot) for r, s, e, slot in balanced.items if r == req)
        assert [p[:2] for p in pieces] == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
        assert sorted(p[2] for p in pieces) == list(range(first, first + count))
    # windowed ranges of 1995 keys: 3 pieces of at least 512 keys, a multiple of the tile, the last shorter
    cut = decode_op.decode_balance_tail(decode_op.decode_work([(5, 2000)] * 256, 2048), 8, slots, 64)
    assert [(s, e) for r, s, e, _ in cut.items if r == 255] == [(5, 709), (709, 1413), (1413, 2000)]
    # left alone: a whole number of waves, a last wave over half full, one wave only, a tail of
    # short requests (already short: the wave is short too) or of pieces of split requests
    same = [
        decode_op.decode_work([(0, 2048)] * 297, 2048),  # 6 waves exactly
        decode_op.decode_work([(0, 2048)] * 280, 2048),  # 5 waves and 260 CTAs
        decode_op.decode_work([(0, 2048)] * 40, 2048),
        decode_op.decode_work([(0, 2048)] * 250 + [(0, 700)] * 6, 2048),
        decode_op.decode_work([(0, 2048)] * 250 + [(0, 4096)] * 3, 2048),
    ]
    for w in same:
        assert decode_op.decode_balance_tail(w, 8, slots, 64) is w
    # the plan cuts the last wave in eager mode with the automatic chunk only
    d3 = DecodeParams(tile=64, warps=4, stages=2)
    ranges = [(0, 2048)] * 256
    for params, graph, cut in (
        (d3, False, True),
        (d3, True, False),
        (DecodeParams(tile=64, warps=4, stages=2, kv_chunk=2048), False, False),
    ):
        chunk, planned = decode_op.decode_plan_work(ranges, [2048] * 256, 8, slots, params, graph)
        assert chunk == 2048 and (len(planned.items) == 283) == cut, (params, graph)
    # pieces are never shorter than DECODE_MIN_CHUNK keys: 1000-key requests stay whole
    short = decode_op.decode_work([(0, 1000)] * 256, 1000)
    assert decode_op.decode_balance_tail(short, 8, slots, 64) is short


def test_decode_item_records() -> None:
    """8 ints per item: request, first key, end key, slot, page offset, first slot, slot count, 0."""
    work = decode_op.decode_work([(0, 300), (0, 5), (10, 700)], 256)
    flat = decode_op.decode_items(work, [0, 19, 20])
    assert len(flat) == decode_op.DECODE_ITEM_INTS * len(work.items)
    records = [tuple(flat[i : i + 8]) for i in range(0, len(flat), 8)]
    assert records[0] == (0, 0, 256, 0, 0, 0, 2, 0)
    assert (1, 0, 5, -1, 19, 0, 1, 0) in records
    assert sorted(r for r in records if r[0] == 2) == [
        (2, 10, 266, 2, 20, 2, 3, 0), (2, 266, 522, 3, 20, 2, 3, 0), (2, 522, 700, 4, 20, 2, 3, 0)]  # fmt: skip
    assert all(r[7] == 0 for r in records)


def test_plan_metadata_sections_hold_what_the_kernels_read() -> None:
    """The int32 metadata a plan writes into its staging buffer (one transfer): decode's item
    records and count, prefill's items, count and per-request ints, and the page indices where
    the kernel does not read the caller's device indices in place; every entry past a piece is
    zero (in CUDA-graph mode the capacities are the buckets', and CTAs past the count read them)."""
    import torch

    kv_lens, q_lens, page = [300, 5, 700], [3, 1, 40], 16
    pages = [-(-n // page) for n in kv_lens]
    indptr = [0, *itertools.accumulate(pages)]
    indices = torch.arange(100, 100 + indptr[-1], dtype=torch.int32)
    batch = tactix.PagedBatch.build(qo_indptr=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
                                    kv_indptr=torch.tensor(indptr, dtype=torch.int32), kv_indices=indices,
                                    kv_last_page_len=torch.tensor([(n - 1) % page + 1 for n in kv_lens],
                                                                  dtype=torch.int32),
                                    page_size=page, device=torch.device("cpu"), causal=True)  # fmt: skip
    work = decode_op.decode_work(decode_op.effective_lengths(kv_lens, -1), 256)
    records = decode_op.decode_items(work, indptr)
    eager = decode_op.decode_sections(len(work.items), None)  # device indices: read in place
    assert eager.names == ("items", "num_items") and eager.capacities[0] == len(records)
    item_cap, page_cap = decode_op.decode_capacity(4, 1024, 256), 4 * 1024 // page  # a CUDA-graph plan's buckets
    graph = decode_op.decode_sections(item_cap, page_cap)
    host = torch.full((graph.total,), -1, dtype=torch.int32)
    graph.write(host.data_ptr(), [records, [len(work.items)], indices])
    at = {name: graph.offset(name) for name in graph.names}
    assert host[: len(records)].tolist() == records and not host[len(records) : at["num_items"]].any()
    assert int(host[at["num_items"]]) == len(work.items) == 6
    assert host[at["indices"] : at["indices"] + len(indices)].tolist() == indices.tolist()
    assert not host[at["indices"] + len(indices) :].any()
    # prefill
    params = prefill_op.default_prefill_params(128, H200)
    pwork = prefill_op.prefill_work(q_lens, kv_lens, q_tile=params.q_tile, kv_tile=params.kv_tile, pack=4, causal=True,
                                    window_left=-1)  # fmt: skip
    items, reqs = prefill_op.prefill_lists(batch, pwork)
    layout = prefill_op.prefill_sections(len(pwork.items), 3, len(indices))
    assert layout.names == ("items", "num_items", "reqs", "indices")
    host = torch.full((layout.total,), -1, dtype=torch.int32)
    layout.write(host.data_ptr(), [items, [len(pwork.items)], reqs, indices])
    at = {name: layout.offset(name) for name in layout.names}
    assert host[: len(items)].tolist() == items and int(host[at["num_items"]]) == len(pwork.items)
    assert host[at["reqs"] : at["reqs"] + 12].tolist() == [0, 3, 300, 0, 3, 1, 5, 19, 4, 40, 700, 20]
    assert host[at["indices"] : at["indices"] + len(indices)].tolist() == indices.tolist()
    assert prefill_op.prefill_sections(5, 2, None).names == ("items", "num_items", "reqs")


def test_gemm_splits_and_grids() -> None:
    p1 = gemm_op.default_sync_gemm_params(1, H200)
    assert (p1.bn, p1.bk, p1.wn, p1.wk) == (32, 128, 1, 4)
    smem = gemm_op.gemm_smem_bytes(1, p1.bn, p1.bk, p1.stages)
    ctas = ctas_per_sm(H200, smem, 128)
    splits = gemm_op.gemm_splits(1, 4096, 4096, p1.bn, p1.bk, H200, ctas)
    kps, splits = gemm_op.gemm_k_per_split(4096, p1.bk, splits)
    assert splits > 1 and kps % p1.bk == 0 and kps * splits >= 4096 > kps * (splits - 1)
    # one full wave: 4 splits x 128 column blocks = 512 CTAs <= 132 SMs x 4 (5 splits ran 2 waves: slower)
    assert splits == 4 and ctas == 4
    assert H200.sms <= gemm_op.gemm_grid(4096, p1.bn, splits, 1)[0] * splits <= H200.sms * ctas
    # m = 64: 64 x 64 tiles, 6 stages (2 CTAs per SM): 4 splits; partial sums under a quarter of W
    p64 = gemm_op.default_sync_gemm_params(64, H200)
    assert (p64.bn, p64.bk, p64.wn, p64.wk, p64.stages) == (64, 64, 2, 2, 6)
    c64 = ctas_per_sm(H200, gemm_op.gemm_smem_bytes(4, p64.bn, p64.bk, p64.stages), 128)
    assert c64 == 2 and gemm_op.gemm_splits(64, 4096, 4096, p64.bn, p64.bk, H200, c64) == 4
    s64 = gemm_op.gemm_splits(64, 4096, 4096, p64.bn, p64.bk, H200, 3)
    assert s64 * 64 * 4096 * 4 <= 4096 * 4096 * 2 / 4
    # a short k never splits below four stages per split; an explicit count is honoured up to k's steps
    assert gemm_op.gemm_splits(1, 4096, 256, 32, 128, H200, 3) == 1
    assert gemm_op.gemm_splits(1, 4096, 4096, 32, 128, H200, 3, requested=4) == 4
    assert gemm_op.gemm_splits(1, 4096, 256, 32, 128, H200, 3, requested=8) == 2
    assert gemm_op.gemm_k_per_split(4096, 128, 3) == (1408, 3)
    assert gemm_op.gemm_k_per_split(136, 64, 4) == (64, 3)
    assert [gemm_op.m_tiles(m) for m in (1, 16, 17, 32, 33, 48, 64)] == [1, 1, 2, 2, 4, 4, 4]
    for m in (1, 16, 32, 64):
        assert gemm_op.default_gemm_params(m, H200).reasons(m, H200) == []


def test_wgmma_gemm_geometry() -> None:
    """The Hopper GEMM: the default on sm_90 for every m <= 64 (the mma.sync kernel's elsewhere),
    its split count a power of two up to 8 (the CTAs of a cluster) and one wave of CTAs for the
    suite's shape, and clear reasons for what it cannot run."""
    a100 = DeviceInfo(sms=108, smem_per_block=232448, smem_per_sm=233472, arch="sm_80")
    for m in (1, 16, 33, 64):
        params = gemm_op.default_gemm_params(m, H200)
        assert isinstance(params, GemmWgmmaParams) and (params.bw, params.bk, params.stages) == (64, 64, 4)
        assert isinstance(gemm_op.default_gemm_params(m, a100), GemmParams)
        assert gemm_op.gemm_wgmma_candidates(m, a100) == []
    p = GemmWgmmaParams(bw=64, bk=64, stages=4)
    assert p.smem_bytes == 4 * (64 + 64) * 64 * 2 and ctas_per_sm(H200, p.smem_bytes, p.THREADS) == 3
    # 64 column blocks x 4 splits = 256 CTAs: one wave at 3 per SM, as many k splits as fit
    splits = gemm_op.gemm_wgmma_splits(64, 4096, 4096, p, H200)
    assert splits == 4 and 64 * splits <= H200.sms * 3 < 64 * 8
    for m, n, k in ((1, 4096, 4096), (64, 14336, 4096), (16, 512, 256), (64, 40, 8), (7, 4096, 14336)):
        s = gemm_op.gemm_wgmma_splits(m, n, k, p, H200)
        assert s in gemm_op.GEMM_WGMMA_SPLITS, (m, n, k, s)
    assert gemm_op.gemm_wgmma_splits(64, 40, 8, p, H200) == 1  # one k tile: nothing to split
    # k per CTA of a cluster: whole tiles, the cluster keeps its size (trailing CTAs may get no k)
    assert gemm_op.gemm_wgmma_k_per_split(4096, 64, 4) == 1024
    assert gemm_op.gemm_wgmma_k_per_split(136, 64, 8) == 64  # 3 CTAs of 8 get k, 5 add zeros
    assert gemm_op.gemm_wgmma_k_per_split(136, 64, 1) == 136
    assert gemm_op.gemm_wgmma_splits(64, 4096, 4096, GemmWgmmaParams(bw=64, bk=64, stages=4, splits=8), H200) == 8
    # reasons
    assert "needs a Hopper GPU" in GemmWgmmaParams(bw=64, bk=64, stages=4).reasons(16, a100)[0]
    assert "m <= 64" in GemmWgmmaParams(bw=64, bk=64, stages=4).reasons(65, H200)[0]
    assert "bw must be 64, 128 or 256" in GemmWgmmaParams(bw=96, bk=64, stages=4).reasons(16, H200)[0]
    assert (
        "splits must be 0 (auto) or 1, 2, 4 or 8"
        in GemmWgmmaParams(bw=64, bk=64, stages=4, splits=3).reasons(16, H200)[0]
    )
    assert "shared memory" in GemmWgmmaParams(bw=256, bk=128, stages=4).reasons(16, H200)[0]

    # through the plugin's check: names, types, and a tactic round trip
    def reasons(params: dict[str, object]) -> list[str]:
        return plugin._reasons(
            gemm(m=16), tactix.Tactic(backend="cuda_native", kernel="gemm_wgmma", params=params), H200
        )

    good = {"bw": 128, "bk": 64, "stages": 3, "splits": 4}
    assert reasons(good) == [] and reasons({k: v for k, v in good.items() if k != "splits"}) == []
    assert "gemm_wgmma params must be" in reasons({**good, "wn": 2})[0]
    assert "must be integers" in reasons({**good, "bw": 128.0})[0]
    odd = tactix.Tactic(backend="cuda_native", kernel="gemm_x", params={})
    assert "unknown gemm kernel" in plugin._reasons(gemm(m=16), odd, H200)[0]
    wgmma = tactix.Tactic(backend="cuda_native", kernel="gemm_wgmma", params=good)
    assert gemm_op.gemm_params_of(wgmma) == GemmWgmmaParams(bw=128, bk=64, stages=3, splits=4)


def test_plans_keep_the_latest_tensor_maps_and_name_a_tensor_cuda_core_refuses() -> None:
    """`TensorMaps`, what GEMM and decode plans keep their TMA descriptors in: one encode
    per key while it is kept, the least recently used dropped past ``kept``, and an encoding
    error (cuda.core raises ValueError for what the TMA unit cannot describe) as an
    InvalidArgumentError naming the argument."""
    maps = TensorMaps(2)
    made: list[str] = []

    def make(name: str) -> Callable[[], str]:
        def encode() -> str:
            made.append(name)
            return f"map {name}"

        return encode

    assert maps.get(("w",), make("w"), "b") == "map w" and maps.get(("a1",), make("a1"), "a") == "map a1"
    assert maps.get(("w",), make("w"), "b") == "map w" and made == ["w", "a1"]  # kept: no second encode
    maps.get(("a2",), make("a2"), "a")  # drops a1, the least recently used (w was used after it)
    assert len(maps) == 2 and made == ["w", "a1", "a2"]
    maps.get(("w",), make("w"), "b")
    maps.get(("a1",), make("a1"), "a")
    assert made == ["w", "a1", "a2", "a1"]

    def refused() -> str:
        raise ValueError("globalStrides[1] must be a multiple of 16")

    with pytest.raises(tactix.InvalidArgumentError, match=r"paged_kv_cache \(k\).*multiple of 16"):
        maps.get(("bad",), refused, "paged_kv_cache (k)")
    assert len(maps) == 2


def test_tensor_maps_rebound_moves_a_kept_map_to_a_new_address_instead_of_encoding() -> None:
    """`TensorMaps.rebound`, how the ragged prefill keeps the maps of K and V that arrive at a new
    address every run: one encode per layout; the same address again costs nothing; a new address
    is swapped into the kept map (no encode); a cuda.core without ``replace_address`` encodes; a
    refused address is an InvalidArgumentError naming the argument."""
    maps = TensorMaps(4)
    log: list[tuple[str, int]] = []

    class Map:
        def __init__(self, address: int) -> None:
            self.address = address

    def make(address: int) -> Callable[[], Map]:
        def encode() -> Map:
            log.append(("encode", address))
            return Map(address)

        return encode

    def move(address: int) -> Callable[[Map], None]:
        def rebind(m: Map) -> None:
            log.append(("rebind", address))
            m.address = address

        return rebind

    k = ("k", "bfloat16", (4096, 1, 16, 128))
    first = maps.rebound(k, 0x1000, make(0x1000), move(0x1000), "k")
    assert maps.rebound(k, 0x1000, make(0x1000), move(0x1000), "k") is first and log == [("encode", 0x1000)]
    moved = maps.rebound(k, 0x9000, make(0x9000), move(0x9000), "k")
    assert moved is first and moved.address == 0x9000 and log[-1] == ("rebind", 0x9000) and len(log) == 2
    # another layout (V, or a new token count) is a map of its own
    v = maps.rebound(("v", *k[1:]), 0x9000, make(0x9000), move(0x9000), "v")
    assert v is not first and log[-1] == ("encode", 0x9000)
    assert maps.rebound(k, 0x9000, make(0x9000), move(0x9000), "k").address == 0x9000 and len(log) == 3

    def no_replace(m: Map) -> None:
        raise AttributeError("'TensorMapDescriptor' object has no attribute 'replace_address'")

    fresh = maps.rebound(k, 0x5000, make(0x5000), no_replace, "k")
    assert fresh is not first and fresh.address == 0x5000 and log[-1] == ("encode", 0x5000)

    def refused(m: Map) -> None:
        raise ValueError("pointer must be 16-byte aligned")

    with pytest.raises(tactix.InvalidArgumentError, match=r"'k'.*16-byte aligned"):
        maps.rebound(k, 0x5008, make(0x5008), refused, "k")


def test_wgmma_gemm_tensor_map_tactics(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tma`` 1 (W) and 2 (W and a) through tensor maps: an mbarrier per stage after the ring, a
    variant of its own (TX_TMA) while tma 0 keeps the variant and the stored tactic it always had,
    clear reasons for bad values and for a cuda.core that cannot encode maps, and candidates the
    tuner is offered for every m of the kernel."""
    p = GemmWgmmaParams(bw=64, bk=128, stages=4, splits=0, tma=2)
    assert p.smem_bytes == 4 * (64 + 64) * 128 * 2 + 4 * 8
    assert GemmWgmmaParams(bw=64, bk=128, stages=4).smem_bytes == 4 * (64 + 64) * 128 * 2
    assert GemmWgmmaParams(bw=64, bk=64, stages=4).to_tactic().params == {"bw": 64, "bk": 64, "stages": 4, "splits": 0}
    assert GemmWgmmaParams.from_tactic(p.to_tactic()) == p and p.to_tactic().params["tma"] == 2
    variant = gemm_op.gemm_wgmma_variant("bfloat16", p, 2, "sm_90")
    plain = gemm_op.gemm_wgmma_variant("bfloat16", GemmWgmmaParams(bw=64, bk=128, stages=4), 2, "sm_90")
    assert dict(variant.defines)["TX_TMA"] == "2" and "TX_TMA" not in dict(plain.defines)
    assert dict(variant.defines)["TX_SMEM"] == str(p.smem_bytes)
    assert (
        "tma must be 0 (cp.async), 1" in GemmWgmmaParams(bw=64, bk=64, stages=4, splits=0, tma=3).reasons(16, H200)[0]
    )
    tactic = tactix.Tactic(backend="cuda_native", kernel="gemm_wgmma", params={"bw": 64, "bk": 64, "stages": 4,
                                                                                "tma": 1})  # fmt: skip
    assert plugin._reasons(gemm(m=16), tactic, H200) == []
    monkeypatch.setattr(gemm_op, "tensor_maps_status", lambda: "this cuda.core cannot encode tensor maps (x)")
    assert plugin._reasons(gemm(m=16), tactic, H200) == [
        "tma 1 needs tensor maps: this cuda.core cannot encode tensor maps (x)"
    ]
    for m in (1, 16, 64):
        tmas = {c.tma for c in gemm_op.gemm_wgmma_candidates(m, H200)}
        assert tmas == {0, 1, 2}, (m, tmas)


# -- prefill ---------------------------------------------------------------------------------


def _prefill_variants() -> list[runtime.Variant]:
    """Every default prefill variant (both dtypes; on the H200 the wgmma kernel), the mma.sync
    defaults (both dtypes) and every tuning candidate of both kernels (bf16)."""
    variants = {v for v in default_variants(H200) if v.source.startswith("prefill")}
    for d in HEAD_DIMS:
        for dtype in ("bfloat16", "float16"):
            variants.add(
                prefill_op.prefill_variant(dtype, d, prefill_op.default_prefill_params(d, H200, "sync"), "sm_90")
            )
        for p in prefill_op.prefill_candidates(d, H200, gqa=4):
            variants.add(prefill_op.prefill_variant("bfloat16", d, p, "sm_90"))
    # the defaults for a custom mask (mma.sync, TX_MASK) and for an fp8 cache (TX_KV_FP8) at d128, the
    # head dim at the register edge (d64 and d256 measured without spills in session 13)
    variants.add(prefill_op.prefill_variant("bfloat16", 128, prefill_op.default_masked_prefill_params(128, H200),
                                            "sm_90", masked=True))  # fmt: skip
    variants.add(prefill_op.prefill_variant("bfloat16", 128, prefill_op.default_prefill_params(128, H200, "sync"),
                                            "sm_90", kv_dtype="float8_e4m3fn"))  # fmt: skip
    # unequal head dims (TX_DVO: the producer gathers rows of two widths): every wgmma candidate of
    # DeepSeek's 192/128 (the widest K rows), the default of 128/64; with an fp8 cache (the producer
    # converts: its registers are few) every wgmma candidate at d128 and the defaults of the others
    # (a session-17 check of every candidate at every head dim found no spill; this keeps CI short)
    for qk, vo, every in ((192, 128, True), (128, 64, False)):
        problem = prefill(head_dim_qk=qk, head_dim_vo=vo)
        chosen = prefill_op.prefill_candidates(qk, H200, gqa=4, head_dim_vo=vo) if every else [
            prefill_op.default_params_for(problem, H200)]  # fmt: skip
        variants |= {prefill_op.prefill_variant("bfloat16", qk, p, "sm_90", dims=(qk, vo)) for p in chosen
                     if p.mma == "wgmma"}  # fmt: skip
    for d in HEAD_DIMS:
        fp8 = prefill(kv_dtype="float8_e4m3fn", head_dim_qk=d, head_dim_vo=d)
        chosen = [PrefillParams.from_tactic(t) for t in prefill_op.prefill_tactics(fp8, H200)] if d == 128 else [
            prefill_op.default_params_for(fp8, H200)]  # fmt: skip
        variants |= {prefill_op.prefill_variant("bfloat16", d, p, "sm_90", kv_dtype="float8_e4m3fn") for p in chosen
                     if p.mma == "wgmma"}  # fmt: skip
    # ragged K and V through tensor maps (TX_KV_TMA): the d128 default in both forms (192/128's are
    # among the defaults above)
    base = prefill_op.default_prefill_params(128, H200)
    for params in (base, prefill_op.prefill_default_persist(base, [1], 128, H200)):
        variants.add(prefill_op.prefill_variant("bfloat16", 128, params, "sm_90", kv_tma=True))
    return sorted(variants, key=lambda v: v.label())


def test_custom_masks_are_served_by_the_mma_sync_kernel_only() -> None:
    """Prefill declares custom masks; with one, wgmma tactics are refused with the reason, the tuner
    measures only mma.sync tactics, and the variant is the unmasked one plus TX_MASK (so unmasked
    variants keep their cache keys)."""
    spec = plugin.tactix_backends()[0]
    assert spec.prefill is not None and spec.prefill.custom_mask
    masked = prefill(custom_mask=True, causal=False)
    wgmma = tactix.Tactic(backend="cuda_native", kernel="prefill",
                          params={"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma"})  # fmt: skip
    sync = tactix.Tactic(backend="cuda_native", kernel="prefill",
                         params={"q_tile": 128, "kv_tile": 32, "warps": 4, "stages": 3})  # fmt: skip
    assert prefill_op.MASK_NEEDS_SYNC in plugin._reasons(masked, wgmma, H200)
    assert plugin._reasons(prefill(causal=False), wgmma, H200) == []
    assert plugin._reasons(masked, sync, H200) == []
    assert plugin._reasons(masked, tactix.Tactic.default("cuda_native"), H200) == []
    tactics = prefill_op.prefill_tactics(masked, H200)
    every = prefill_op.prefill_tactics(prefill(causal=False), H200)
    chosen = [PrefillParams.from_tactic(t) for t in tactics]
    assert len(chosen) >= 3 and all(p.mma == "sync" and p.m_tiles == 1 for p in chosen)
    assert prefill_op.default_masked_prefill_params(128, H200) in chosen
    assert set(tactics) - {prefill_op.default_masked_prefill_params(128, H200).to_tactic()} < set(every)
    params = prefill_op.default_masked_prefill_params(128, H200)
    plain = dict(prefill_op.prefill_variant("bfloat16", 128, params, "sm_90").defines)
    assert dict(prefill_op.prefill_variant("bfloat16", 128, params, "sm_90", masked=True).defines) == {
        **plain, "TX_MASK": "1"}  # fmt: skip
    # the metadata: one mask offset per request, before the page indices
    layout = prefill_op.prefill_sections(10, 4, 32, masked=True)
    assert layout.names == ("items", "num_items", "reqs", "mask", "indices") and layout.capacities[3] == 4
    assert "mask" not in prefill_op.prefill_sections(10, 4, 32).names


def test_prefill_variants_compile_without_spills(cache_root: Path) -> None:
    """Every prefill variant a plan or the tuner can ask for on an H200, for sm_90 (mma.sync) and
    sm_90a (wgmma): no local-memory spills, no stack frame, and no wgmma serialized by ptxas (it
    does that, with an advisory, where it cannot keep the accumulators in place across the
    asynchronous issue and wait), per ptxas' own report."""
    variants = _prefill_variants()
    wgmma = [v for v in variants if v.source == "prefill_sm90.cu"]
    assert len(variants) >= 6 + 12 + 6 and len(wgmma) >= 6 + 9
    assert {v.arch for v in wgmma} == {"sm_90a"} and {v.arch for v in variants if v not in wgmma} == {"sm_90"}
    # (the cubins go into the module's cache: the SASS checks below read them.) NVRTC lets go of the
    # GIL while it compiles: one thread per core
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        reports = list(pool.map(lambda v: runtime.resource_usage(v, root=cache_root), variants))
    for variant, report in zip(variants, reports, strict=True):
        usage = report["tactix_prefill"]
        assert usage["spill_stores"] == usage["spill_loads"] == usage["stack"] == 0, (variant.label(), usage)
        assert usage["wgmma_serialized"] == 0, (variant.label(), usage)
        assert usage["registers"] <= 255


def test_resource_usage_sees_serialized_wgmma() -> None:
    """The check above is not vacuous: d256 with 128-key tiles (refused by the tactic rules: O, S
    and P need 224 registers) makes ptxas spill and serialize the wgmma."""
    variant = runtime.Variant.make("prefill_sm90.cu", "sm_90a", TX_BF16=1, TX_D=256, TX_QTILE=128, TX_KVTILE=128,
                                   TX_STAGES=2)  # fmt: skip
    usage = runtime.resource_usage(variant)["tactix_prefill"]
    if not usage["wgmma_serialized"]:
        pytest.skip(f"NVRTC {runtime.nvrtc_version()} no longer serializes this variant: the check is unproven")
    assert usage["spill_stores"] > 0
    params = PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma")
    assert "at most 176 fit" in params.reasons(256, H200)[0]


_HGMMA_SS, _HGMMA_RS = 0x9F0, 0xDF0  # sm_90 opcodes (low 12 bits): wgmma with A from shared memory, from registers


def _opcodes(cubin: bytes, *opcodes: int) -> list[int]:
    counts = [0] * len(opcodes)
    for text in _text_sections(cubin).values():
        for at in range(0, len(text), 16):
            op = int.from_bytes(text[at : at + 8], "little") & 0xFFF
            for i, want in enumerate(opcodes):
                counts[i] += op == want
    return counts


def test_wgmma_variants_run_on_the_tensor_cores_asynchronously(cache_root: Path) -> None:
    """The SASS of every wgmma variant has HGMMA with A from shared memory (S = Q K^T: D / 16 per
    tile) and from registers (O += P V: kv_tile / 16), and the mma.sync kernel none (the opcode
    reader finds what it should). Opcodes read off cuobjdump's listing of an sm_90a cubin."""
    for variant in _prefill_variants():
        cubin, _ = runtime.compile_variant(variant, root=cache_root)
        ss, rs = _opcodes(cubin, _HGMMA_SS, _HGMMA_RS)
        defines = dict(variant.defines)
        if variant.source == "prefill_sm90.cu":
            want = (int(defines["TX_D"]) // 16, int(defines["TX_KVTILE"]) // 16)
            if defines.get("TX_PINGPONG") == "1":
                # ping-pong issues the last tile's P V after the loop (a second copy of those), and
                # ptxas may duplicate an S wgmma on a peeled path (9 for d128 with persist)
                assert want[0] <= ss <= 2 * want[0] and rs == 2 * want[1], (variant.label(), ss, rs)
            else:
                assert (ss, rs) == want, variant.label()
        else:
            assert ss == rs == 0, variant.label()


def test_wgmma_smem_layout_matches_the_plan(tmp_path: Path) -> None:
    """The plan launches with `prefill_op.prefill_smem_bytes`; the kernel static_asserts that its own
    layout (Q, the K/V ring, row pointers, mbarriers) has that size (TX_SMEM), so every variant
    compiled above agrees with it, and a wrong size does not compile."""
    params = PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma")
    assert params.smem_bytes(128) == 128 * 256 + 2 * 2 * 128 * 256 + 128 * 16 + 4 * 2 * 8 == 165952
    assert params.threads == 384 and PrefillParams(q_tile=64, kv_tile=64, warps=4, stages=2, mma="wgmma").threads == 256
    variant = prefill_op.prefill_variant("bfloat16", 128, params, "sm_90")
    assert dict(variant.defines)["TX_SMEM"] == "165952"
    wrong = runtime.Variant(variant.source, tuple((k, "165936" if k == "TX_SMEM" else v) for k, v in variant.defines),
                            variant.arch)  # fmt: skip
    with pytest.raises(runtime.KernelCompileError) as info:
        runtime.compile_variant(wrong, root=tmp_path)
    assert "prefill_smem_bytes disagrees" in info.value.log
    # every candidate fits the H200's 227 KB; the deepest d128 ring just does, with sched 3's turns too
    deepest = max(prefill_op.prefill_candidates(128, H200), key=lambda p: p.smem_bytes(128))
    assert deepest.dynamic and deepest.smem_bytes(128) == 231520 + prefill_op.DYN_TURNS_SMEM <= H200.smem_per_block


def test_prefill_tactics_are_enumerated_valid_and_round_trip() -> None:
    backend = get_registry().get("cuda_native")
    for d in HEAD_DIMS:
        for hq, hkv in ((32, 8), (8, 8), (32, 4)):
            problem = prefill(head_dim_qk=d, head_dim_vo=d, num_qo_heads=hq, num_kv_heads=hkv)
            tactics = plugin.tactix_tactics(problem)
            assert tactics and all(t.backend == "cuda_native" and t.kernel == "prefill" for t in tactics)
            assert len(set(tactics)) == len(tactics)
            assert all(plugin._reasons(problem, t, H200) == [] for t in tactics), problem
            default = prefill_op.default_prefill_params(d, H200)
            assert default.mma == "wgmma" and default.to_tactic() in tactics
            assert prefill_op.default_prefill_params(d, H200, "sync").to_tactic() in tactics
            # both kernels, so the tuner compares them; "sync" stays implicit in the params
            assert {t.params.get("mma", "sync") for t in tactics} == {"sync", "wgmma"}
            assert all(t.params.get("mma") in (None, "wgmma") for t in tactics)
            assert {t.params["sched"] for t in tactics} == {0, 1, 2, 3}
            # turns from a counter (sched 3): persistent wgmma only
            assert all(t.params.get("persist") == 1 and t.params["mma"] == "wgmma" for t in tactics
                       if t.params["sched"] == 3)  # fmt: skip
            # persistent CTAs, off by default (left out of the params), enumerated for the wgmma shapes
            assert "persist" not in default.to_tactic().params
            persistent = [t for t in tactics if t.params.get("persist")]
            assert persistent and all(t.params["persist"] == 1 and t.params["mma"] == "wgmma" for t in persistent)
            assert default.replace(persist=1).to_tactic() in tactics
            # the warpgroups' ping-pong: the default at d128 (measured there), enumerated for every q_tile 128
            assert (default.to_tactic().params.get("pingpong") == 1) == (d in (64, 128))
            pingpong = [t for t in tactics if t.params.get("pingpong")]
            assert {(t.params["q_tile"], t.params.get("persist", 0)) for t in pingpong} == {(128, 0), (128, 1)}
            assert default.replace(pingpong=1).to_tactic() in tactics
            assert default.replace(pingpong=0).to_tactic() in tactics
            assert ({t.params["pack"] for t in tactics} == {0, 1}) == (hq > hkv)
            for t in tactics:
                assert tactix.tactics.parse_tactic(t.to_json()) == t
                assert PrefillParams.from_tactic(t).to_tactic() == t
    assert backend.tactics(prefill())[0] == tactix.Tactic.default("cuda_native")
    # a tactic stored before the wgmma kernel existed still means the mma.sync kernel
    old = tactix.tactics.parse_tactic('{"backend":"cuda_native","kernel":"prefill","params":{"pack":0,"q_tile":128,'
                                      '"sched":0,"stages":3,"kv_tile":32,"warps":4},"schema_version":1}')  # fmt: skip
    assert PrefillParams.from_tactic(old) == PrefillParams(q_tile=128, kv_tile=32, warps=4, stages=3)
    assert PrefillParams(q_tile=128, kv_tile=32, warps=4, stages=3).to_tactic() == old
    wgp = PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma", persist=1).to_tactic()
    assert wgp.params["persist"] == 1 and PrefillParams.from_tactic(wgp).persist == 1
    both = PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma", persist=1, pingpong=1)
    assert PrefillParams.from_tactic(both.to_tactic()) == both
    assert dict(prefill_op.prefill_variant("bfloat16", 128, both, "sm_90").defines)["TX_PINGPONG"] == "1"
    wgp_params = PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma")
    assert "TX_PINGPONG" not in dict(prefill_op.prefill_variant("bfloat16", 128, wgp_params, "sm_90").defines)
    assert "TX_PERSIST" not in dict(prefill_op.prefill_variant("bfloat16", 128, wgp_params, "sm_90").defines)
    wg = PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma").to_tactic()
    assert wg.to_json() == ('{"backend":"cuda_native","kernel":"prefill","params":{"kv_tile":128,"mma":"wgmma",'
                            '"pack":0,"q_tile":128,"sched":0,"stages":2,"warps":8},"schema_version":1}')  # fmt: skip
    # defaults on the H200: the wgmma kernel, two consumer warpgroups; mma.sync: 32 rows per warp
    # where the accumulators fit, two CTAs per H200 SM
    for d, want in ((64, (128, 128, 8, 3, 1)), (128, (128, 128, 8, 3, 1)), (256, (128, 64, 8, 2, 0))):
        p = prefill_op.default_prefill_params(d, H200)
        assert (p.q_tile, p.kv_tile, p.warps, p.stages, p.pingpong, p.mma) == (*want, "wgmma")
    for d, want in ((64, (128, 64, 4, 3)), (128, (128, 32, 4, 3)), (256, (64, 32, 4, 2))):
        p = prefill_op.default_prefill_params(d, H200, "sync")
        assert (p.q_tile, p.kv_tile, p.warps, p.stages, p.mma) == (*want, "sync")
        smem = prefill_op.prefill_smem_bytes(d, p.q_tile, p.kv_tile, p.stages)
        assert ctas_per_sm(H200, smem, 32 * p.warps) >= 2
    # other GPUs: the mma.sync kernel only (wgmma needs sm_90)
    for info in (DeviceInfo(sms=84, smem_per_block=101376, smem_per_sm=102400, arch="sm_86"),
                 DeviceInfo(sms=108, smem_per_block=232448, smem_per_sm=233472, arch="sm_80")):  # fmt: skip
        for d in HEAD_DIMS:
            p = prefill_op.default_prefill_params(d, info)
            assert p.mma == "sync" and p.reasons(d, info) == [], (d, info.arch)
            assert all(c.mma == "sync" for c in prefill_op.prefill_candidates(d, info, 4))
    assert wgmma_arch("sm_90") == wgmma_arch("sm_90a") == "sm_90a"


def test_bad_prefill_tactics_and_problems_give_reasons() -> None:
    def reasons(params: dict[str, object], problem: PrefillProblem | None = None, kernel: str = "prefill") -> list[str]:
        tactic = tactix.Tactic(backend="cuda_native", kernel=kernel, params=params)  # type: ignore[arg-type]
        return plugin._reasons(problem or prefill(), tactic, H200)

    ok = {"q_tile": 128, "kv_tile": 32, "warps": 4, "stages": 3, "pack": 0, "sched": 0}
    assert reasons(ok) == []
    assert reasons({"q_tile": 64, "kv_tile": 64, "warps": 4, "stages": 2}) == []  # pack and sched optional
    assert "16 or 32 rows per warp" in reasons({**ok, "q_tile": 256})[0]
    assert "16 or 32 rows per warp" in reasons({**ok, "q_tile": 96})[0]
    assert "kv_tile must be 32, 64 or 128" in reasons({**ok, "kv_tile": 48})[0]
    assert "stages must be in 2..4" in reasons({**ok, "stages": 5})[0]
    assert "must divide the GQA group size 4" in reasons({**ok, "pack": 3})[0]
    assert reasons({**ok, "pack": 4}) == [] and reasons({**ok, "pack": 2}) == []
    assert reasons({**ok, "sched": 2}) == []
    assert "sched must be 0, 1, 2 or 3" in reasons({**ok, "sched": 4})[0]
    assert "sched 3 (turns from a counter) needs persist 1" in reasons({**ok, "sched": 3})[0]
    assert "accumulators need 192 registers" not in " ".join(reasons({**ok, "kv_tile": 64}))
    d256 = prefill(head_dim_qk=256, head_dim_vo=256)
    assert "accumulators need" in reasons({**ok, "q_tile": 128, "warps": 4}, d256)[0]
    assert "shared memory" in reasons({"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 4}, d256)[0]
    assert "must be integers" in reasons({**ok, "warps": "4"})[0]
    assert "must be integers" in reasons({**ok, "sched": True})[0]
    # the wgmma kernel
    wg = {"q_tile": 128, "kv_tile": 128, "warps": 8, "stages": 2, "mma": "wgmma"}
    assert reasons(wg) == [] and reasons({**ok, "mma": "sync"}) == []
    assert reasons({**wg, "q_tile": 64, "warps": 4, "stages": 4, "kv_tile": 64, "pack": 4, "sched": 2}) == []
    assert "mma must be 'sync' or 'wgmma'" in reasons({**wg, "mma": "hgmma"})[0]
    assert "mma must be 'sync' or 'wgmma'" in reasons({**wg, "mma": "WGMMA"})[0]
    assert "param mma must be" in reasons({**wg, "mma": 1})[0]
    assert "warps q_tile / 16" in reasons({**wg, "warps": 4})[0]
    assert "warps q_tile / 16" in reasons({**wg, "q_tile": 256, "warps": 16})[0]
    assert "kv_tile must be 64 or 128" in reasons({**wg, "kv_tile": 32})[0]
    assert "stages must be in 2..4" in reasons({**wg, "stages": 5})[0]
    assert "at most 176 fit" in reasons(wg, prefill(head_dim_qk=256, head_dim_vo=256))[0]
    assert "shared memory" in reasons({**wg, "stages": 4})[0]  # 4 x 64 KB of K/V at d128
    # persistent CTAs: wgmma only, 0 or 1, not where the register split cannot hold the loop
    assert reasons({**wg, "persist": 1}) == [] and reasons({**wg, "persist": 0}) == []
    assert reasons({**wg, "q_tile": 64, "warps": 4, "kv_tile": 64, "persist": 1}) == []
    assert "persist must be 0" in reasons({**wg, "persist": 2})[0]
    assert "must be integers" in reasons({**wg, "persist": True})[0]
    assert "persist 1 needs mma 'wgmma'" in reasons({**ok, "persist": 1})[0]
    assert "spills registers" in reasons({**wg, "q_tile": 64, "warps": 4, "persist": 1})[0]
    assert reasons({**wg, "q_tile": 64, "warps": 4, "persist": 1}, prefill(head_dim_qk=64, head_dim_vo=64)) == []
    # the warpgroups' ping-pong: two consumer warpgroups (q_tile 128), with or without persist
    assert reasons({**wg, "pingpong": 1}) == [] and reasons({**wg, "pingpong": 1, "persist": 1}) == []
    assert "pingpong must be 0 or 1" in reasons({**wg, "pingpong": 3})[0]
    assert "two consumer warpgroups" in reasons({**wg, "q_tile": 64, "warps": 4, "kv_tile": 64, "pingpong": 1})[0]
    assert "two consumer warpgroups" in reasons({**ok, "pingpong": 1})[0]
    ampere = DeviceInfo(sms=108, smem_per_block=232448, smem_per_sm=233472, arch="sm_80")
    tactic = tactix.Tactic(backend="cuda_native", kernel="prefill", params=wg)  # type: ignore[arg-type]
    assert "needs a Hopper GPU (sm_90); this one is sm_80" in plugin._reasons(prefill(), tactic, ampere)[0]
    assert "prefill params must be" in reasons({"q_tile": 128})[0]
    assert "with pack, sched, mma, persist and pingpong optional" in reasons({"q_tile": 128})[0]
    assert "prefill params must be" in reasons({**ok, "tile": 64})[0]
    assert "unknown prefill kernel" in reasons(ok, kernel="decode")[0]
    assert "takes no params" in reasons({"q_tile": 64}, kernel="default")[0]
    default = tactix.Tactic.default("cuda_native")
    assert plugin._reasons(prefill(), default, H200) == []
    assert plugin._reasons(prefill(out_dtype="float16"), default, H200) == ["q, kv and out dtypes must be the same"]
    spec = get_registry().get("cuda_native").spec
    assert spec.reasons(prefill(page_size=256)) == ["page size 256 not in {1, 128, 16, 2, 32, 4, 64, 8}"]
    assert "head_dim_qk 96 not in" in spec.reasons(prefill(head_dim_qk=96, head_dim_vo=96))[0]
    # other value head dims (DeepSeek's 192/128, 128/64): the wgmma kernel with its own dims, or the
    # mma.sync kernel zero-filled to the next kernel dim; 64/128 (v/o wider than q/k) zero-filled only
    deepseek = prefill(head_dim_qk=192, head_dim_vo=128)
    assert spec.reasons(deepseek) == spec.reasons(prefill(head_dim_vo=64)) == []
    wgmma_ok = {"q_tile": 64, "kv_tile": 64, "warps": 4, "stages": 2, "mma": "wgmma"}
    assert reasons(wgmma_ok) == reasons(wgmma_ok, prefill(head_dim_vo=64)) == reasons(wgmma_ok, deepseek) == []
    assert "runs it zero-filled" in reasons(wgmma_ok, prefill(head_dim_qk=64, head_dim_vo=128))[0]
    assert "needs equal head dims" in reasons(wgmma_ok, prefill(head_dim_vo=64, kv_dtype="float8_e4m3fn"))[0]
    assert reasons(ok, prefill(head_dim_vo=64)) == []
    sync64 = {"q_tile": 64, "kv_tile": 32, "warps": 4, "stages": 2}  # (the kernel of 256: one m16 tile a warp)
    assert reasons(sync64, deepseek) == []
    assert "accumulators need" in reasons(ok, deepseek)[0]
    assert "shared memory" in reasons({**wgmma_ok, "q_tile": 128, "warps": 8, "kv_tile": 128, "stages": 3}, deepseek)[0]
    default = prefill_op.default_params_for(deepseek, H200)
    assert (default.mma, default.stages, default.pingpong) == ("wgmma", 2, 1)
    a100 = DeviceInfo(108, 166912, 167936, "sm_80")
    assert prefill_op.default_params_for(deepseek, a100).mma == "sync"
    # the tuner measures both kernels: mma.sync shapes at 256, wgmma ones at 192/128
    tactics = [PrefillParams.from_tactic(t) for t in prefill_op.prefill_tactics(deepseek, H200)]
    assert {p.mma for p in tactics} == {"sync", "wgmma"}
    assert all(not p.reasons(192, H200, head_dim_vo=128) for p in tactics if p.mma == "wgmma")
    assert all(not p.reasons(256, H200) for p in tactics if p.mma == "sync")
    float32 = prefill(q_dtype="float32", kv_dtype="float32", out_dtype="float32")
    assert "q dtype float32" in spec.reasons(float32)[0]
    assert spec.reasons(prefill(window_left=64, logits_soft_cap=30.0, return_lse=True, causal=False)) == []
    # untuned auto keeps preferring cudnn for prefill (unproven here); decode stays first
    assert spec.preference_for("prefill") == 5 < 10
    assert spec.preference_for("decode") == 20


def _oracle_pairs(q_len: int, kv_len: int, causal: bool, window: int) -> set[tuple[int, int]]:
    """(token, key) pairs the float64 oracle's mask allows (bottom-right aligned)."""
    allowed = set()
    for t in range(q_len):
        pos = kv_len - q_len + t
        for key in range(kv_len):
            if (not causal or key <= pos) and (window < 0 or key >= pos - window):
                allowed.add((t, key))
    return allowed


def _kernel_pairs(q_lens: list[int], kv_lens: list[int], params: PrefillParams, pack: int, hq: int,
                  causal: bool, window: int) -> dict[tuple[int, int, int, int], int]:  # fmt: skip
    """Model of the prefill kernels' control flow (kernels/prefill.cu and prefill_sm90.cu, same
    formulas): how often each (request, token, head, key) enters a written row's softmax
    unmasked. The unit that skips tiles and masks is a warp (sync) or a warpgroup of 64 rows (wgmma)."""
    work = prefill_op.prefill_work(q_lens, kv_lens, q_tile=params.q_tile, kv_tile=params.kv_tile, pack=pack,
                                   causal=causal, window_left=window, sched=params.sched)  # fmt: skip
    bq, bk = params.q_tile, params.kv_tile
    units = params.q_tile // 64 if params.mma == "wgmma" else params.warps
    wrows = params.q_tile // units
    counts: dict[tuple[int, int, int, int], int] = {}
    for (req, t0), tiles in zip(work.items, work.tiles, strict=True):
        q_len, kv_len = q_lens[req], kv_lens[req]
        nt = min(bq // pack, q_len - t0)
        assert nt >= 1
        delta = kv_len - q_len

        def lo_of(tl: int, t0: int = t0, delta: int = delta) -> int:
            return delta + t0 + tl - window if window >= 0 else -(1 << 30)

        def hi_of(tl: int, t0: int = t0, delta: int = delta, kv_len: int = kv_len) -> int:
            return delta + t0 + tl if causal else kv_len - 1

        kv_lo, kv_hi = max(0, lo_of(0)), min(kv_len, hi_of(nt - 1) + 1)
        assert (kv_lo, kv_hi) == prefill_op.prefill_range(q_len, kv_len, t0, t0 + nt, causal, window)
        ntiles = -(-(kv_hi - kv_lo) // bk)
        assert ntiles == tiles
        rowb = [(lo_of(min(r // pack, nt - 1)), hi_of(min(r // pack, nt - 1))) for r in range(bq)]
        for w in range(units):
            wrow0 = w * wrows
            if wrow0 // pack >= nt:
                continue  # an idle warp: no valid row
            (lo_min, hi_min), (lo_max, hi_max) = rowb[wrow0], rowb[wrow0 + wrows - 1]
            for i in range(ntiles):
                kv0 = kv_lo + i * bk
                last = kv0 + bk - 1
                if not (kv0 <= hi_max and last >= lo_min):
                    continue  # the tile lies outside every row of the warp
                need_mask = kv0 < lo_max or last > hi_min
                for r in range(wrow0, wrow0 + wrows):
                    if r // pack >= nt:
                        continue  # computed, never written
                    lo, hi = rowb[r]
                    for key in range(kv0, kv0 + bk):
                        if need_mask and not lo <= key <= hi:
                            continue
                        for hg in range(hq // pack):
                            k = (req, t0 + r // pack, hg * pack + r % pack, key)
                            counts[k] = counts.get(k, 0) + 1
    return counts


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("window", [-1, 0, 5, 40])
def test_prefill_work_covers_every_allowed_pair_exactly_once(causal: bool, window: int) -> None:
    """Ragged q (length 1, lengths around and off the tile sizes), chunked (q shorter than kv),
    non-causal with q longer than kv: under every tile shape and head packing, each (row, key)
    pair the oracle allows enters the softmax exactly once, and no other pair does."""
    q_lens = [1, 5, 17, 70, 33, 1, 0, 9]
    kv_lens = [1, 40, 17, 130, 33, 64, 3, 9] if causal else [3, 2, 50, 64, 33, 1, 3, 5]
    hq, gqa = 8, 4
    shapes = [(128, 32, 4, "sync"), (64, 64, 4, "sync"), (128, 64, 8, "sync"), (64, 32, 2, "sync"),
              (128, 128, 8, "wgmma"), (128, 64, 8, "wgmma"), (64, 64, 4, "wgmma")]  # fmt: skip
    for q_tile, kv_tile, warps, mma in shapes:
        for pack in (1, 2, 4):
            params = PrefillParams(q_tile=q_tile, kv_tile=kv_tile, warps=warps, stages=2, pack=pack, mma=mma)
            assert params.reasons(128, H200, gqa) == []
            got = _kernel_pairs(q_lens, kv_lens, params, pack, hq, causal, window)
            want: set[tuple[int, int, int, int]] = set()
            for req, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
                for t, key in _oracle_pairs(q_len, kv_len, causal, window):
                    want |= {(req, t, h, key) for h in range(hq)}
            what = f"q_tile {q_tile} kv_tile {kv_tile} warps {warps} mma {mma} pack {pack}"
            extra = {k for k in got if k not in want}
            assert not extra, f"{what}: masked pairs let in, e.g. {sorted(extra)[:5]}"
            missing = want - set(got)
            assert not missing, f"{what}: allowed pairs never computed, e.g. {sorted(missing)[:5]}"
            twice = {k: n for k, n in got.items() if n != 1}
            assert not twice, f"{what}: pairs computed more than once, e.g. {list(twice.items())[:5]}"


def test_prefill_work_order_capacity_and_grid() -> None:
    import torch

    torch.manual_seed(3)
    q_lens = torch.randint(64, 2048, (16,)).tolist()  # P3's lengths
    for sched in (0, 1, 2):
        work = prefill_op.prefill_work(q_lens, q_lens, q_tile=128, kv_tile=32, pack=4, causal=True, window_left=-1,
                                       sched=sched)  # fmt: skip
        assert work.tokens == 32 and work.pack == 4
        assert sorted(work.items) == [(b, t0) for b, n in enumerate(q_lens) for t0 in range(0, n, 32)]
        if sched == 0:
            # requests by total work (largest first), each request's items longest first
            totals: dict[int, int] = {}
            for (b, _), n in zip(work.items, work.tiles, strict=True):
                totals[b] = totals.get(b, 0) + n
            requests = list(dict.fromkeys(b for b, _ in work.items))
            assert [totals[b] for b in requests] == sorted(totals.values(), reverse=True)
            for b in requests:
                mine = [n for (r, _), n in zip(work.items, work.tiles, strict=True) if r == b]
                assert mine == sorted(mine, reverse=True)
            assert work.items[-1][0] == min(totals, key=lambda b: (totals[b], -b))
        elif sched == 2:
            assert work.tiles == sorted(work.tiles, reverse=True), "items must be longest first"
            # ties keep request order, so the order is deterministic
            for a, b in itertools.pairwise(range(len(work.items))):
                if work.tiles[a] == work.tiles[b]:
                    assert work.items[a] < work.items[b]
        else:
            assert work.items == sorted(work.items)
        assert len(work.items) <= prefill_op.prefill_capacity(16, sum(q_lens), work.tokens)
        b_cap, t_cap = 16, 1 << (sum(q_lens) - 1).bit_length()
        assert len(work.items) <= prefill_op.prefill_capacity(b_cap, t_cap, work.tokens)
    # P1: 8 x 2048 causal, 32 query heads over 8 KV heads: a whole GQA group per CTA
    assert prefill_op.prefill_pack(4, 128) == 4 and prefill_op.prefill_pack(4, 128, 1) == 1
    assert prefill_op.prefill_pack(6, 128) == 6 and prefill_op.prefill_pack(32, 16) == 16
    assert prefill_op.prefill_pack(7, 4) == 1
    work = prefill_op.prefill_work([2048] * 8, [2048] * 8, q_tile=128, kv_tile=32, pack=4, causal=True, window_left=-1)
    assert len(work.items) == 8 * 64 and work.tiles[0] == 64 and work.tiles[-1] == 1
    assert prefill_op.prefill_grid(len(work.items), 32, 4) == (8 * 64 * 8, 1, 1)
    # P4: 512 new tokens over a 4096-token prefix: every item walks at least the prefix
    work = prefill_op.prefill_work([512] * 8, [4608] * 8, q_tile=128, kv_tile=32, pack=4, causal=True, window_left=-1)
    assert min(work.tiles) == -(-(4096 + 32) // 32) and max(work.tiles) == 4608 // 32
    # a window bounds every item's range
    work = prefill_op.prefill_work([8192], [8192], q_tile=128, kv_tile=64, pack=1, causal=True, window_left=255)
    assert max(work.tiles) <= -(-(255 + 128) // 64) + 1
    assert prefill_op.prefill_range(10, 100, 0, 5, True, -1) == (0, 95)
    assert prefill_op.prefill_range(10, 100, 0, 10, False, -1) == (0, 100)
    assert prefill_op.prefill_range(10, 100, 5, 10, True, 3) == (92, 100)
    assert prefill_op.prefill_range(10, 5, 0, 10, False, 2) == (0, 5)
    assert (
        prefill_op.prefill_work([0, 0], [3, 4], q_tile=64, kv_tile=32, pack=1, causal=True, window_left=-1).items == []
    )


def test_persistent_prefill_grid_and_cuda_graph_sizing() -> None:
    """Persistent CTAs: the grid is the GPU's resident CTAs (SMs x CTAs per SM, the driver's count
    where it answers), never more than the items x head groups; in CUDA-graph mode it comes from
    the plan's item capacity, so it is the same for every batch of the buckets (the kernel ends
    each CTA's loop at the real item count), and it does not depend on the batch."""
    d128 = PrefillParams(q_tile=128, kv_tile=128, warps=8, stages=2, mma="wgmma", persist=1)
    smem = d128.smem_bytes(128)
    assert ctas_per_sm(H200, smem, d128.threads) == 1
    slots = prefill_op.prefill_persistent_ctas(H200, ctas_per_sm(H200, smem, d128.threads))
    assert slots == 132
    assert prefill_op.prefill_persistent_ctas(H200, ctas_per_sm(H200, smem, d128.threads, resident=2)) == 264
    q64 = PrefillParams(q_tile=64, kv_tile=64, warps=4, stages=2, mma="wgmma", persist=1)  # two CTAs per H200 SM
    assert ctas_per_sm(H200, q64.smem_bytes(128), q64.threads) == 2
    # P1: 8 x 2048 causal, 32 query heads over 8 KV heads, pack 4: 512 items x 8 head groups
    work = prefill_op.prefill_work([2048] * 8, [2048] * 8, q_tile=128, kv_tile=128, pack=4, causal=True,
                                   window_left=-1)  # fmt: skip
    assert prefill_op.prefill_grid(len(work.items), 32, 4) == (4096, 1, 1)
    assert prefill_op.prefill_grid(len(work.items), 32, 4, slots) == (132, 1, 1)
    assert prefill_op.prefill_grid(3, 8, 4, slots) == (6, 1, 1)  # fewer virtual CTAs than slots: one each
    assert prefill_op.prefill_grid(0, 8, 4, slots) == (2, 1, 1)  # an empty batch still launches (graph mode)
    # graph mode: the capacity of the buckets fixes the grid for every batch in them
    grids = set()
    for q_lens in ([2048] * 8, [100, 2000, 7, 1500, 1, 900, 64, 1000], [1] * 5):
        b_cap = 1 << (len(q_lens) - 1).bit_length()
        t_cap = 1 << (16384 - 1).bit_length()
        item_cap = prefill_op.prefill_capacity(b_cap, t_cap, 128 // 4)
        work = prefill_op.prefill_work(q_lens, q_lens, q_tile=128, kv_tile=128, pack=4, causal=True, window_left=-1)
        assert len(work.items) <= item_cap
        grids.add(prefill_op.prefill_grid(item_cap, 32, 4, slots))
    assert grids == {(132, 1, 1)}


# -- import without a GPU --------------------------------------------------------------------


def test_imports_cleanly_and_says_why_it_cannot_run_here() -> None:
    code = (
        "import torch, tactix\n"
        "import tactix_cuda_native.plugin as p\n"
        "b = tactix.get_registry().get('cuda_native')\n"
        "print(b.environment() if not torch.cuda.is_available() else 'gpu')\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() != "gpu":
        assert "no CUDA GPU is visible" in done.stdout


def test_auto_never_picks_it_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    backend = get_registry().get("cuda_native")
    assert backend.check(decode(), tactix.Tactic.default("cuda_native")) == ["no CUDA GPU is visible"]


def test_untuned_auto_order_puts_the_skinny_gemm_behind_cublas_and_decode_first() -> None:
    """Selection order from the measured defaults: decode first, prefill behind cudnn, GEMM
    behind the torch backend (cuBLAS), so untuned 'auto' never picks a slower default."""
    registry = get_registry()
    order = {op: [b.name for b in registry.active(op)] for op in ("prefill", "decode", "gemm")}  # type: ignore[arg-type]
    assert order["decode"][0] == "cuda_native"
    assert order["gemm"].index("torch") < order["gemm"].index("cuda_native")
    if "cudnn" in order["prefill"]:
        assert order["prefill"].index("cudnn") < order["prefill"].index("cuda_native")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_default_prefill_goes_persistent_for_batches_of_short_work_items(d: int) -> None:
    """The default tactic is chosen per batch: persistent CTAs where the work items walk few KV
    tiles on average (many short requests, P1/P3-like), one CTA per item where they are long."""
    base = prefill_op.default_prefill_params(d, H200)

    def chosen(q_lens: list[int], kv_lens: list[int]) -> PrefillParams:
        pack = prefill_op.prefill_pack(4, base.q_tile)
        work = prefill_op.prefill_work(q_lens, kv_lens, q_tile=base.q_tile, kv_tile=base.kv_tile, pack=pack,
                                       causal=True, window_left=-1)  # fmt: skip
        return prefill_op.prefill_default_persist(base, work.tiles, d, H200)

    short = chosen([2048] * 8, [2048] * 8)  # causal 2k: items walk 1..16 tiles of 128 keys (d256: 1..32 of 64)
    long = chosen([512], [8192])  # chunked prefill over a long prefix: every item walks the whole prefix
    assert long == base
    if not base.pingpong:  # d256: persistent CTAs without the ping-pong were slower on every case
        assert short == base
        return
    assert short == base.replace(persist=1) and short.reasons(d, H200) == []
    # the tactic the plan reports names the choice; tactics without wgmma are never changed
    assert short.to_tactic().params["persist"] == 1 and "persist" not in base.to_tactic().params
    sync = prefill_op.default_prefill_params(d, H200, "sync")
    assert prefill_op.prefill_default_persist(sync, [1] * 100, d, H200) == sync
    assert prefill_op.prefill_default_persist(base, [], d, H200) == base  # an empty batch launches nothing


def test_the_default_deepseek_prefill_stays_one_cta_per_item() -> None:
    """With a v/o head dim of its own (DeepSeek's 192/128, the wgmma kernel with the ping-pong) the
    default keeps one CTA per work item even for short ones: persistent CTAs measured slower on R1."""
    base = prefill_op.default_prefill_params(192, H200, "wgmma", head_dim_vo=128)
    assert base.mma == "wgmma" and base.pingpong and not base.persist
    assert base.replace(persist=1).reasons(192, H200, head_dim_vo=128) == []  # the kernel would take them
    assert prefill_op.prefill_default_persist(base, [8] * 512, 192, H200, 128) == base


def test_decode_work_lists_are_made_on_the_device_up_to_the_batch_the_kernel_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode plan makes its work list on the device (kernels/decode_plan.cu) unless the batch is
    larger than the kernel takes or TACTIX_CUDA_NATIVE_HOST_PLAN=1; its shared memory stays within
    the 48 KB a launch gets without asking."""
    on = decode_op.decode_plan_on_device
    assert not decode_op.host_plan_forced()
    assert on(1, False) and on(decode_op.DECODE_PLAN_MAX_BATCH, False)
    assert not on(decode_op.DECODE_PLAN_MAX_BATCH + 1, False) and not on(8, True)
    monkeypatch.setenv(decode_op.HOST_PLAN_ENV, "1")
    assert decode_op.host_plan_forced()
    assert decode_op.decode_plan_smem(decode_op.DECODE_PLAN_MAX_BATCH) <= 48 * 1024
    assert decode_op.decode_plan_smem(5) == 8 * 8 + 8 * 5 + 8 * decode_op.DECODE_PLAN_THREADS


def test_device_plan_bounds_hold_every_list_and_recut_it_may_make() -> None:
    """`decode_bounds` (what an eager plan sizes its grid and workspace for, from a max and a sum)
    is never below the items and partial slots of the list the device makes, a recut short last
    wave included, over ragged and uniform batches and chunks; and it is exact where no request is
    split and no recut may happen (no idle CTAs launched for nothing)."""
    rng = random.Random(13)
    recut = 0
    for _ in range(3000):
        uniform = rng.random() < 0.5
        n = rng.randint(1, 400)
        lens = [rng.choice([1000, 2048, 700])] * n if uniform else [rng.randint(1, 9000) for _ in range(n)]
        units, tile, slots = rng.choice([8, 16]), 64, rng.choice([264, 396])
        chunk = decode_op.decode_chunk(lens, units, tile, slots)
        plain = decode_op.decode_work([(0, x) for x in lens], chunk)
        work = decode_op.decode_balance_tail(plain, units, slots, tile)
        recut += work is not plain
        items, partial = decode_op.decode_bounds(lens, chunk, units, slots, True)
        assert len(work.items) <= items and work.slots <= partial, (lens[:8], len(lens), chunk, units, slots)
        items, partial = decode_op.decode_bounds(lens, chunk, units, slots, False)
        assert len(plain.items) <= items and plain.slots <= partial
    assert recut > 20
    # D2 (one request of 8192 keys in 512-key pieces): exact
    assert decode_op.decode_bounds([8192], 512, 8, 396, True) == (16, 16)
    # 40 whole requests, one wave: exact
    assert decode_op.decode_bounds([2048] * 40, 2048, 8, 396, True) == (40, 0)
    # D1 (64 x 4096 in 1024-key pieces): every request split, so no recut: exact
    assert decode_op.decode_bounds([4096] * 64, 1024, 8, 396, True) == (256, 256)
