"""Would one small kernel make the page table of device page indices cheaper to plan than today's
two torch calls?

    python benchmarks/gather_probe.py [--batch 64] [--calls 300] [--json PATH]

trtllm's XQA plan and cudnn's plan with device page indices (what vLLM passes) lay out the block
table ``[rows, width]`` on the device from the caller's CSR indices: `Staging.copy_in` copies the
indices after the staging slot's transfer (one D2D ``cudaMemcpyAsync``), then `Staging.gather`
gathers each row's window of them with ``torch.index_select`` over an unfold view. On an H200
the two cost ~20-25 us of host time a plan (benchmarks/results/h200-plan-timers-session30.log),
the largest piece of trtllm's b64 plan that FlashInfer's own plan does not have.

This probe compiles a CSR-to-table kernel with NVRTC and launches it with the driver's
``cuLaunchKernel`` through ctypes (no cuda-python: what tactix's core could ship), reading the
caller's indices in place, and reports per plan, in one process:
- the host time of today's ``copy_in`` + ``gather``, and of each alone;
- the host time of the kernel's launch (arguments updated as a plan would);
- that both give the same table (each row's pages; the kernel writes page 0 past them);
- the kernel's device time.
It changes nothing in tactix. Needs a CUDA GPU and libnvrtc (the CUDA toolkit's or the
nvidia-cuda-nvrtc wheel's).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import random
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any

import torch

from tactix import cudart
from tactix.staging import Staging, sections

SOURCE = r"""
extern "C" __global__ void tx_csr_to_table(const int* __restrict__ indices, const int* __restrict__ starts,
                                           int nnz, int rows, int width, int* __restrict__ table) {
  // row blockIdx.y: its pages indices[starts[r] .. next start), page 0 (a valid page) past them
  const int r = blockIdx.y;
  const int s = starts[r];
  const int e = r + 1 < rows ? starts[r + 1] : nnz;
  const int n = e - s;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < width; j += gridDim.x * blockDim.x) {
    table[(long long)r * width + j] = j < n ? indices[s + j] : 0;
  }
}
"""


def _find_nvrtc() -> str:
    candidates: list[str] = []
    for root in {sysconfig.get_paths()["purelib"], os.path.dirname(torch.__file__) + "/.."}:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libnvrtc.so*"), recursive=True))
    candidates += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for path in candidates:
        if "builtins" in os.path.basename(path):  # (NVRTC's own helper library)
            continue
        try:
            ctypes.CDLL(path)
            return path
        except OSError:
            continue
    sys.exit("gather_probe: no loadable libnvrtc (CUDA toolkit or nvidia-cuda-nvrtc wheel)")


class Driver:
    """The few driver and NVRTC entry points the probe uses, through ctypes."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.nvrtc_path = _find_nvrtc()
        self.nvrtc = ctypes.CDLL(self.nvrtc_path)
        vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        self.launch = self.cuda.cuLaunchKernel
        self.launch.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
        self.launch.restype = i

    def check(self, rc: int, what: str) -> None:
        if rc:
            text = ctypes.c_char_p()
            self.cuda.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{what} failed: {rc} {text.value.decode() if text.value else ''}")

    def compile(self, source: str, name: str, arch: str) -> ctypes.c_void_p:
        prog = ctypes.c_void_p()
        rc = self.nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"gather.cu", 0, None, None)
        if rc:
            raise RuntimeError(f"nvrtcCreateProgram: {rc}")
        options = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        rc = self.nvrtc.nvrtcCompileProgram(prog, 1, options)
        size = ctypes.c_size_t()
        self.nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.nvrtc.nvrtcGetProgramLog(prog, log)
        if rc:
            raise RuntimeError(f"nvrtcCompileProgram: {rc}\n{log.value.decode()}")
        self.nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        self.nvrtc.nvrtcGetCUBIN(prog, cubin)
        self.nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.cuda.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        self.check(self.cuda.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), "cuModuleGetFunction")
        return function


class FusedGather:
    """One launch per plan: the kernel's arguments live in ctypes objects made once; a plan
    updates their values (the caller's indices, the slot's starts, the batch's sizes)."""

    THREADS = 128

    def __init__(self, driver: Driver, function: ctypes.c_void_p) -> None:
        self.driver, self.function = driver, function
        self.indices, self.starts, self.table = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self.nnz, self.rows, self.width = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        args = (self.indices, self.starts, self.nnz, self.rows, self.width, self.table)
        self.params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))

    def __call__(self, indices: int, starts: int, nnz: int, rows: int, width: int, table: int, stream: int) -> None:
        self.indices.value, self.starts.value, self.table.value = indices, starts, table
        self.nnz.value, self.rows.value, self.width.value = nnz, rows, width
        blocks_x = max(1, min(8, -(-width // self.THREADS)))
        rc = self.driver.launch(self.function, blocks_x, rows, 1, self.THREADS, 1, 1, 0, stream, self.params, None)
        if rc:
            self.driver.check(rc, "cuLaunchKernel")


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median host time of ``fn()`` over blocks of 30 back-to-back calls, a device sync between
    blocks (the launch queue stays short)."""
    samples: list[float] = []
    done = 0
    while done < calls:
        torch.cuda.synchronize()
        for _ in range(min(30, calls - done)):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        done += 30
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gather_probe: needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()  # type: ignore[no-untyped-call]
    rng = random.Random(0)
    lengths = [rng.randint(1024, 8192) for _ in range(args.batch)]
    pages = [-(-n // args.page_size) for n in lengths]
    starts = [0]
    for p in pages:
        starts.append(starts[-1] + p)
    nnz, rows, width = starts[-1], args.batch, max(pages)
    perm = torch.randperm(nnz + 100, generator=torch.Generator().manual_seed(1))[:nnz].to(torch.int32)
    indices = perm.to(device)  # the caller's device indices (vLLM's)

    # today's path, as trtllm's plan takes it: row starts sent with the metadata, the indices
    # copied after them (copy_in), the table gathered (gather)
    layout = sections(("row_starts", rows), ("pages", nnz + width))
    staging = Staging(device, layout.total, rows * width)
    slot = staging.slot(False)

    # the metadata transfer (the row starts; the pages section's zeros), sent once
    base = staging.send(slot, layout.total, lambda dst: layout.write(dst, [starts[:-1], []]))
    pages_at, starts_at = layout.offset("pages"), layout.offset("row_starts")

    def today() -> None:
        staging.copy_in(slot, pages_at, indices)
        staging.gather(slot, pages_at, rows, width, starts_at)

    def copy_only() -> None:
        staging.copy_in(slot, pages_at, indices)

    def gather_only() -> None:
        staging.gather(slot, pages_at, rows, width, starts_at)

    driver = Driver()
    major, minor = torch.cuda.get_device_capability(device)
    t0 = time.perf_counter()
    function = driver.compile(SOURCE, "tx_csr_to_table", f"sm_{major}{minor}")
    compile_ms = (time.perf_counter() - t0) * 1e3
    fused = FusedGather(driver, function)
    table = torch.empty(rows, width, dtype=torch.int32, device=device)
    stream = cudart.raw_stream(device.index)

    def one_launch() -> None:
        fused(indices.data_ptr(), base + 4 * starts_at, nnz, rows, width, table.data_ptr(), stream)

    # the same table, row by row (today's rows hold the next request's pages past their own)
    today()
    one_launch()
    torch.cuda.synchronize()
    expected = staging.gathered(slot, rows, width).cpu()
    got = table.cpu()
    same = all(
        torch.equal(got[r, : pages[r]], expected[r, : pages[r]]) and not got[r, pages[r] :].any() for r in range(rows)
    )
    # device time of the kernel (events around 20 launches)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(20):
        one_launch()
    end.record()
    end.synchronize()
    kernel_us = start.elapsed_time(end) * 1e3 / 20

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "nvrtc": driver.nvrtc_path,
        "batch": rows,
        "width": width,
        "page_entries": nnz,
        "compile_ms": round(compile_ms, 1),
        "same_table": same,
        "kernel_device_us": round(kernel_us, 2),
    }
    for _ in range(2):  # two rounds, the second kept (the first warms caches and the allocator)
        for name, fn in (("copy_in+gather", today), ("copy_in", copy_only), ("gather", gather_only),
                         ("fused launch", one_launch)):  # fmt: skip
            results[f"host_us {name}"] = round(host_us(fn, args.calls), 2)
    width_col = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:{width_col}s}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if not same:
        sys.exit("gather_probe: the kernel's table differs from today's")


if __name__ == "__main__":
    main()
