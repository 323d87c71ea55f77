"""Build the cuda_native kernel sources for the CPU emulation (tx_emulate.h) with g++ and run them.

The same ``kernels/*.cu`` text the GPU runs, compiled with ``-DTX_EMULATE`` and the same ``-D``
parameters as a `runtime.Variant`, into a shared library per variant (cached under the
system's temporary directory, keyed by the sources' hash). Inputs are CPU tensors; the host
metadata comes from the plugin's own functions (`geometry.prefill_work`, `plugin.prefill_lists`,
`plugin.prefill_scalars`), so what runs here is the plan's data as well as the kernel's code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from tactix import PagedBatch
from tactix.problems import DecodeProblem, PrefillProblem

HERE = Path(__file__).resolve().parent


def available() -> str | None:
    """None if g++ is here, else why not."""
    return None if shutil.which("g++") else "g++ is not installed"


@functools.cache
def _library(source: str, defines: tuple[tuple[str, str], ...]) -> ctypes.CDLL:
    from tactix_cuda_native import runtime

    kernels = runtime.KERNEL_DIR
    text = "".join(p.read_text() for p in sorted(kernels.iterdir()) if p.suffix in (".cu", ".cuh"))
    text += (HERE / "tx_emulate.h").read_text() + (HERE / source).read_text()
    key = hashlib.sha256((text + repr(defines)).encode()).hexdigest()[:24]
    out = Path(tempfile.gettempdir()) / "tactix-emulator" / f"{Path(source).stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{id(out)}.tmp")
        cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-include", str(HERE / "tx_emulate.h"),
               "-I", str(kernels), *(f"-D{k}={v}" for k, v in defines), str(HERE / source), "-o", str(tmp)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"g++ failed for {source} {defines}:\n{done.stderr[-4000:]}")
        tmp.replace(out)
    lib = ctypes.CDLL(str(out))
    for name in ("emu_prefill", "emu_decode", "emu_decode_merge"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_char_p
    return lib


def _args(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, float):
            out.append(ctypes.c_double(v))
        elif isinstance(v, torch.Tensor):
            out.append(ctypes.c_void_p(v.data_ptr() if v.numel() else 0))
        elif v is None:
            out.append(ctypes.c_void_p(0))
        else:
            out.append(ctypes.c_longlong(int(v)))
    return out


def run_prefill(problem: PrefillProblem, batch: PagedBatch, tactic: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
    """The prefill kernel on the emulation: (out, lse or None, the work list)."""
    from tactix_cuda_native import geometry, plugin

    params = (
        geometry.default_prefill_params(problem.head_dim_qk, geometry.H200)
        if tactic.is_default
        else geometry.PrefillParams.from_tactic(tactic)
    )
    variant = plugin.prefill_variant(problem.q_dtype, problem.head_dim_qk, params, "sm_90")
    runner = "emu_prefill_sm90.cpp" if variant.source == "prefill_sm90.cu" else "emu_prefill.cpp"
    lib = _library(runner, variant.defines)
    pack = geometry.prefill_pack(problem.gqa_ratio, params.q_tile, params.pack)
    work = geometry.prefill_work(batch.qo_lens_list, batch.kv_lens_list, q_tile=params.q_tile,
                                 kv_tile=params.kv_tile, pack=pack, causal=problem.causal,
                                 window_left=problem.window_left, sched=params.sched)  # fmt: skip
    items, reqs = plugin.prefill_lists(batch, work)
    i32 = torch.int32
    items_t = torch.tensor(items or [0, 0], dtype=i32)
    num_items = torch.tensor([len(work.items)], dtype=i32)
    reqs_t = torch.tensor(reqs, dtype=i32)
    indices = batch.kv_indices.to(i32).contiguous()
    strides = plugin._cache_strides(problem.kv_layout, k, v)
    rows = q.shape[0]
    out = torch.full((rows, problem.num_qo_heads, problem.head_dim_vo), float("nan"), dtype=q.dtype)
    lse = torch.full((rows, problem.num_qo_heads), float("nan"), dtype=torch.float32) if return_lse else None
    grid = geometry.prefill_grid(len(work.items), problem.num_qo_heads, pack)[0]
    args = _args([grid, params.threads, q, q.stride(0), q.stride(1), k, v, *strides, out, lse, items_t,
                  num_items, reqs_t, indices, *plugin.prefill_scalars(problem, pack)])  # fmt: skip
    args[0] = ctypes.c_uint(grid)
    args[1] = ctypes.c_int(params.threads)
    err = lib.emu_prefill(*args)
    if err:
        raise RuntimeError(f"emulated kernel misuse: {err.decode()}")
    return out, lse, work


def run_decode(problem: DecodeProblem, batch: PagedBatch, tactic: Any, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, *, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
    """The decode kernel (and its merge) on the emulation, with the plan's own work list."""
    from tactix_cuda_native import geometry, plugin

    info = geometry.H200
    params = (
        geometry.default_decode_params(problem.head_dim_qk, info)
        if tactic.is_default
        else geometry.DecodeParams.from_tactic(tactic)
    )
    variant = plugin.decode_variant(problem.q_dtype, problem.head_dim_qk, params, "sm_90")
    lib = _library("emu_decode.cpp", variant.defines)
    hq, hkv, d, gqa = problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk, problem.gqa_ratio
    units = hkv * geometry.q_tiles(gqa)
    ranges = geometry.effective_lengths(batch.kv_lens_list, problem.window_left)
    smem = geometry.decode_smem_bytes(d, params.tile, params.warps, params.stages)
    slots = info.sms * geometry.ctas_per_sm(info, smem, 32 * params.warps)
    chunk = params.kv_chunk or geometry.decode_chunk([e - s for s, e in ranges], units, params.tile, slots)
    work = geometry.decode_work(ranges, chunk)
    i32 = torch.int32
    items = torch.tensor(work.items, dtype=i32).reshape(-1)
    splits = torch.tensor(work.splits, dtype=i32).reshape(-1)
    page_base = torch.tensor(batch.kv_indptr_list[:-1], dtype=i32)
    indices = batch.kv_indices.to(i32).contiguous()
    part_o = torch.zeros(max(work.slots, 1) * hq * d, dtype=torch.float32)
    part_lse = torch.zeros(max(work.slots, 1) * hq, dtype=torch.float32)
    strides = plugin._cache_strides(problem.kv_layout, k, v)
    b = batch.batch_size
    out = torch.full((b, hq, d), float("nan"), dtype=q.dtype)
    lse = torch.full((b, hq), float("nan"), dtype=torch.float32) if return_lse else None
    shift = geometry.log2_exact(problem.page_size)
    gx, gy, _ = geometry.decode_grid(len(work.items), hkv, gqa)
    num_items = torch.tensor([len(work.items)], dtype=i32)  # kept alive: the kernel reads it
    args = _args([q, q.stride(0), q.stride(1), k, v, *strides, out, lse, items, num_items, page_base, indices,
                  part_o, part_lse, hq, gqa, geometry.q_tiles(gqa), shift, problem.sm_scale * 1.4426950408889634,
                  float(problem.logits_soft_cap)])  # fmt: skip
    err = lib.emu_decode(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_int(32 * params.warps), *args)
    if not err and work.needs_merge:
        mx, my, _ = geometry.merge_grid(b, hq, d)
        err = lib.emu_decode_merge(ctypes.c_uint(mx), ctypes.c_uint(my), *_args([part_o, part_lse, splits, out, lse,
                                                                                  hq]))  # fmt: skip
    if err:
        raise RuntimeError(f"emulated kernel misuse: {err.decode()}")
    return out, lse, work
