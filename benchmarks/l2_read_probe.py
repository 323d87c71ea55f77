"""How fast one kernel can read N bytes from HBM right after the suite's L2 flush, and why.

    python benchmarks/l2_read_probe.py [--mib 32 2048] [--repeat 30] [--json PATH] [--pages 4 8 ...] [--only TEXT]

The suite flushes L2 with a 256 MB memset before every timed call, which leaves L2 full of
dirty lines. A kernel that then reads 32 MiB (G2's weight, D2's K/V) allocates 32 MiB of L2
lines, and an allocation may first write a dirty line back to HBM. This probe times pure-read
kernels after a dirty flush (the memset) and after a clean one (a 256 MB read): 16-byte loads
into registers, cp.async rings in shared memory (also over blocks in a random order, as a
paged cache with random page order is read: 4 KB blocks, or the ``--pages`` sizes in KB), and
bulk copies (``cp.async.bulk``) of whole chunks, 4 KB pieces or 256-byte rows, with and
without an L2 evict_first policy; beside torch's matmul at m = 1 (cuBLAS) and ``torch.sum``
under the same flushes. CUDA-event median of ``--repeat`` per row; every kernel's sum is
checked against torch's. The H200's figures (``benchmarks/results/h200-l2-read-probe*.log``)
bound what G2, D2 and D3 can reach.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
#ifndef STAGES
#define STAGES 2
#endif
#ifndef CHUNK
#define CHUNK 16384
#endif
#ifndef UNROLL
#define UNROLL 8
#endif
#ifndef PIECE
#define PIECE CHUNK
#endif
#ifndef PAGE_SHIFT
#define PAGE_SHIFT 12
#endif

__device__ __forceinline__ u64 policy_first() {
  u64 p; asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p)); return p;
}
__device__ __forceinline__ float sum8(uint4 v) {
  float s = 0.f;
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) s += __uint_as_float(w[i] << 16) + __uint_as_float(w[i] & 0xffff0000u);
  return s;
}

// byte `off` of the flat range, read from a randomly placed block of 1 << PAGE_SHIFT bytes
__device__ __forceinline__ long long paged(const int* perm, long long off) {
  return ((long long)__ldg(perm + (off >> PAGE_SHIFT)) << PAGE_SHIFT) + (off & ((1 << PAGE_SHIFT) - 1));
}

// 16-byte loads, UNROLL in flight per thread, grid-stride.
extern "C" __global__ void read_ld(const uint4* __restrict__ x, long long n16, float* out) {
  float s = 0.f;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
#if HINT
  const u64 pol = policy_first();
#endif
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint4* p = x + i + u * stride;
#if HINT
      asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p), "l"(pol));
#else
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p));
#endif
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) s += sum8(v[u]);
  }
  for (; i < n16; i += stride) s += sum8(x[i]);
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}

// Bulk copies of CHUNK bytes into a ring of STAGES stages; thread 0 issues, all threads sum.
extern "C" __global__ void read_bulk(const unsigned char* __restrict__ x, long long nchunks, float* out,
                                     const int* __restrict__ perm) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) u64 full[STAGES];
  const u32 sbase = (u32)__cvta_generic_to_shared(smem);
  const int tid = threadIdx.x;
#if HINT
  const u64 pol = policy_first();
#endif
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"((u32)__cvta_generic_to_shared(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const long long first = blockIdx.x, step = gridDim.x;
  // called by the 32 lanes of warp 0: lane 0 arms the barrier, the lanes share the pieces
  auto issue = [&](long long c, int s) {
    const u32 bar = (u32)__cvta_generic_to_shared(&full[s]);
    if (tid == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(CHUNK) : "memory");
    __syncwarp();
    for (int p = tid; p < CHUNK / PIECE; p += 32) {
      long long off = c * CHUNK + p * PIECE;
      if (perm != nullptr) off = paged(perm, off);
#if HINT
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
          :: "r"(sbase + s * CHUNK + p * PIECE), "l"(x + off), "r"(PIECE), "r"(bar), "l"(pol)
          : "memory");
#else
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(sbase + s * CHUNK + p * PIECE), "l"(x + off), "r"(PIECE), "r"(bar)
                   : "memory");
#endif
    }
  };
  if (tid < 32)
    for (int s = 0; s < STAGES; ++s)
      if (first + s * step < nchunks) issue(first + s * step, s);
  float acc = 0.f;
  int it = 0;
  for (long long c = first; c < nchunks; c += step, ++it) {
    const int s = it % STAGES;
    const u32 par = (it / STAGES) & 1;
    const u32 bar = (u32)__cvta_generic_to_shared(&full[s]);
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }"
                 :: "r"(bar), "r"(par) : "memory");
    const uint4* v = reinterpret_cast<const uint4*>(smem + s * CHUNK);
    for (int j = tid; j < CHUNK / 16; j += blockDim.x) acc += sum8(v[j]);
    __syncthreads();
    const long long nxt = c + (long long)STAGES * step;
    if (tid < 32 && nxt < nchunks) issue(nxt, s);
  }
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((tid & 31) == 0) atomicAdd(out, acc);
}

// cp.async 16-byte copies (cg, L2 only) into a ring of STAGES stages of CHUNK bytes.
// With perm != nullptr, block b (of 1 << PAGE_SHIFT bytes) of the flat range is read from block
// perm[b] (a paged cache's random page order).
extern "C" __global__ void read_cpasync(const unsigned char* __restrict__ x, long long nchunks, float* out,
                                        const int* __restrict__ perm) {
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sbase = (u32)__cvta_generic_to_shared(smem);
  const int tid = threadIdx.x;
  const long long first = blockIdx.x, step = gridDim.x;
  auto issue = [&](long long c, int s) {
    if (c < nchunks) {
      for (int j = tid; j < CHUNK / 16; j += blockDim.x)
      {
        long long off = c * CHUNK + j * 16;
        if (perm != nullptr) off = paged(perm, off);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                     :: "r"(sbase + s * CHUNK + j * 16), "l"(x + off) : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  for (int s = 0; s < STAGES - 1; ++s) issue(first + s * step, s);
  float acc = 0.f;
  int it = 0;
  for (long long c = first; c < nchunks; c += step, ++it) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");
    __syncthreads();
    issue(c + (long long)(STAGES - 1) * step, (it + STAGES - 1) % STAGES);
    const uint4* v = reinterpret_cast<const uint4*>(smem + (it % STAGES) * CHUNK);
    for (int j = tid; j < CHUNK / 16; j += blockDim.x) acc += sum8(v[j]);
  }
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((tid & 31) == 0) atomicAdd(out, acc);
}
"""


def compile_cubin(name: str, arch: str = "sm_90", **defines: int) -> object:
    from cuda.core import Program, ProgramOptions  # type: ignore[import-not-found]

    opts = ProgramOptions(arch=arch, std="c++17",
                          define_macro=[(k, str(v)) for k, v in defines.items()])  # fmt: skip
    return Program(SOURCE, "c++", opts).compile("cubin")


def compile_kernel(name: str, **defines: int):
    from cuda.core import Device, LaunchConfig, launch  # type: ignore[import-not-found]

    dev = Device(0)
    dev.set_current()
    cc = dev.compute_capability
    kernel = compile_cubin(name, f"sm_{cc.major}{cc.minor}", **defines).get_kernel(name)  # type: ignore[attr-defined]
    return kernel, LaunchConfig, launch, dev


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json")
    parser.add_argument("--pages", type=int, nargs="+", default=[4],
                        help="KB sizes of the randomly ordered blocks (powers of two; default: 4)")  # fmt: skip
    parser.add_argument("--only", help="run only the rows whose name contains this text")
    args = parser.parse_args()
    from cuda.bindings import driver  # type: ignore[import-not-found]

    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flush_src = torch.ones(256 << 20, dtype=torch.uint8, device=dev)
    out = torch.zeros(1, dtype=torch.float32, device=dev)
    torch_stream = torch.cuda.current_stream()

    class _S:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, torch_stream.cuda_stream)

    def do_flush(kind: str) -> None:
        if kind == "dirty":
            flush.zero_()
        else:  # a 256 MB read: L2 ends up full of clean lines
            torch.sum(flush_src, dtype=torch.int32)

    def time_it(fn, kind: str) -> float:
        for _ in range(3):
            do_flush(kind)
            fn()
        times = []
        for _ in range(args.repeat):
            do_flush(kind)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)

    rows = []

    def one_size(mib: int) -> None:
        nbytes = mib << 20
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
        want = float(x.float().sum())
        w = x.view(-1, 4096)
        vec = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
        perms = {kb: torch.randperm(nbytes // (kb << 10), device=dev).to(torch.int32) for kb in args.pages}

        def smem_kernel(name: str, chunk: int, stages: int, blocks: int, page_kb: int = 0, **defines: int):
            def make():
                shift = (page_kb << 10).bit_length() - 1 if page_kb else 12
                k, LaunchConfig, launch, cdev = compile_kernel(name, CHUNK=chunk, STAGES=stages, PAGE_SHIFT=shift,
                                                               **defines)  # fmt: skip
                smem = chunk * stages
                handle = k.handle if hasattr(k, "handle") else k._handle
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                if isinstance(handle, driver.CUkernel):
                    driver.cuKernelSetAttribute(attr, smem, handle, driver.CUdevice(0))
                else:
                    driver.cuFuncSetAttribute(handle, attr, smem)
                cfg = LaunchConfig(grid=(sms * blocks, 1, 1), block=(256, 1, 1), shmem_size=smem)
                stream = cdev.create_stream(_S())

                def run() -> None:
                    out.zero_()
                    pages = perms[page_kb].data_ptr() if page_kb else 0
                    launch(stream, cfg, k, x.data_ptr(), nbytes // chunk, out.data_ptr(), pages)

                return run

            return make

        def ld_kernel():
            k, LaunchConfig, launch, cdev = compile_kernel("read_ld", HINT=0, UNROLL=8)
            cfg = LaunchConfig(grid=(sms * 4, 1, 1), block=(512, 1, 1))
            stream = cdev.create_stream(_S())

            def run_ld() -> None:
                out.zero_()
                launch(stream, cfg, k, x.data_ptr(), nbytes // 16, out.data_ptr())

            return run_ld

        variants: list[tuple[str, object]] = [
            ("torch.matmul m=1 (cuBLAS)", lambda: lambda: torch.matmul(vec, w.t())),
            ("torch.sum", lambda: lambda: torch.sum(x, dtype=torch.float32)),
            ("ld16 unroll 8 x 512 thr x 4/SM", ld_kernel),
        ]
        for chunk, stages, blocks in ((16384, 4, 3), (32768, 3, 2)):
            variants.append((f"cp.async16 {chunk // 1024} KB x {stages} x {blocks}/SM",
                             smem_kernel("read_cpasync", chunk, stages, blocks)))  # fmt: skip
            for kb in args.pages:
                variants.append((f"cp.async16 {chunk // 1024} KB x {stages} x {blocks}/SM, random {kb} KB pages",
                                 smem_kernel("read_cpasync", chunk, stages, blocks, page_kb=kb)))  # fmt: skip
        for chunk, stages, blocks, piece, hint in ((32768, 3, 2, 32768, 0), (32768, 3, 2, 32768, 1),
                                                   (16384, 4, 3, 16384, 0), (32768, 3, 2, 4096, 0),
                                                   (32768, 3, 2, 256, 0), (16384, 4, 3, 256, 0)):  # fmt: skip
            variants.append((f"bulk {chunk // 1024} KB x {stages} x {blocks}/SM, {piece} B copies, hint {hint}",
                             smem_kernel("read_bulk", chunk, stages, blocks, HINT=hint, PIECE=piece)))  # fmt: skip
        for chunk, stages, blocks, hint in ((32768, 3, 2, 0), (32768, 3, 2, 1), (16384, 4, 3, 0), (16384, 4, 3, 1),
                                            (8192, 4, 6, 1), (32768, 2, 3, 1)):  # fmt: skip
            for kb in args.pages:
                name = f"bulk {chunk // 1024} KB x {stages} x {blocks}/SM, random {kb} KB pages, hint {hint}"
                piece = min(4096, kb << 10)
                variants.append(
                    (name, smem_kernel("read_bulk", chunk, stages, blocks, page_kb=kb, HINT=hint, PIECE=piece))
                )
        if args.only:
            variants = [(n, f) for n, f in variants if args.only in n]
        for name, make in variants:
            fn = make()  # type: ignore[operator]
            fn()
            torch.cuda.synchronize()
            err = None
            if not name.startswith("torch"):
                err = abs(float(out) - want) / max(1.0, abs(want))
            row = {"mib": mib, "kernel": name, "rel_err": err}
            for kind in ("dirty", "clean"):
                us = time_it(fn, kind)
                row[f"{kind}_us"] = round(us, 2)
                row[f"{kind}_tbs"] = round(nbytes / us / 1e6, 3)
            rows.append(row)
            print(f"{mib:4d} MiB  {name:48s} dirty {row['dirty_us']:8.2f} us {row['dirty_tbs']:5.2f} TB/s   "
                  f"clean {row['clean_us']:8.2f} us {row['clean_tbs']:5.2f} TB/s  err {err}", flush=True)  # fmt: skip

    for mib in args.mib:
        one_size(mib)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
