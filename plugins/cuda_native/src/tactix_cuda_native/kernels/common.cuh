// Shared device helpers for the cuda_native kernels: PTX wrappers for cp.async, ldmatrix,
// mma.sync (m16n8k16, fp32 accumulation) and 16-bit conversions. Self-contained on purpose
// (no CUDA headers), so NVRTC compiles it anywhere, with no toolkit include path.
//
// With TX_EMULATE defined (tests only: tests/emulator/), the PTX wrappers below are left out
// and a host emulation provides the same functions, so the kernels run on a CPU.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

struct alignas(16) tx_u4 {  // one 16-byte vector access
  u32 x, y, z, w;
};

// TX_BF16 = 1: bfloat16 operands, 0: float16.
#ifndef TX_BF16
#error "TX_BF16 must be defined (1: bfloat16, 0: float16)"
#endif

#ifndef TX_EMULATE
#define TX_DEVICE __device__ __forceinline__

TX_DEVICE u32 tx_smem_addr(const void* p) {
  u32 r;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global -> shared copy; src_bytes 0 writes zeros and reads nothing.
TX_DEVICE void tx_cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
#ifndef TX_L2_PREFETCH_256
#define TX_L2_PREFETCH_256 0
#endif
// The same copy, TX_L2_PREFETCH_256 = 1 also asking L2 to fetch 256-byte blocks (the rows these
// kernels stream are at least 128 bytes long and read whole). No cache-policy operand.
TX_DEVICE void tx_cp_async16_stream(u32 dst, const void* src, int src_bytes) {
#if TX_L2_PREFETCH_256
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
#else
  tx_cp_async16(dst, src, src_bytes);
#endif
}
// The same copy with an L2 cache-policy hint (a `createpolicy` value, see tx_l2_policy).
//
// Careful: on sm_90, ptxas (seen with CUDA 13.0's and NVRTC 13.5's) miscompiles some kernels
// that use it. Where the shared address is a per-thread register plus a warp-uniform base, it
// may emit the LDGSTS form `[Rx+URn+imm], desc[URn+1]` (base and policy sharing a uniform
// register pair) and then overwrite URn with that base while other LDGSTS still read URn:URn+1
// as their policy. Every GEMM variant that ran into "an illegal instruction was encountered" on
// the H200 has this, and no variant that ran clean does: bk = 64 with one 16-row m-tile (each
// warp layout and stage count; also bn 128, bk 64, 4 x 2 warps with two m-tiles). The GEMM
// therefore streams W without a policy (tx_cp_async16_stream); decode.cu keeps it (none of its
// variants get that form). tests/plugins/test_cuda_native_cpu.py compiles every enumerated
// variant for sm_90 and fails on any `[R+UR]` LDGSTS.
TX_DEVICE void tx_cp_async16_hint(u32 dst, const void* src, int src_bytes, u64 policy) {
#if TX_L2_PREFETCH_256
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
#else
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
#endif
}

// L2 policies: evict_first for bytes a kernel reads exactly once (a KV cache, a weight matrix),
// so that streaming them through L2 replaces each other instead of lines that have reuse (or are
// dirty and would have to be written back first); evict_normal is the default behaviour.
TX_DEVICE u64 tx_l2_policy(bool evict_first) {
  u64 p;
  if (evict_first) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
  }
  return p;
}

// Four ints of read-only metadata (16-byte aligned).
TX_DEVICE void tx_ldg4(const int* p, int& a, int& b, int& c, int& d) {
  asm("ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%4];\n" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

TX_DEVICE void tx_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
TX_DEVICE void tx_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

TX_DEVICE void tx_ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
TX_DEVICE void tx_ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// d[4] += a[16x16] (row) * b[16x8] (col), 16-bit operands, fp32 accumulators.
TX_DEVICE void tx_mma(float* d, const u32* a, u32 b0, u32 b1) {
#if TX_BF16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The same with float16 operands whatever TX_BF16 says (decode.cu's fp8 variants compute P V in
// float16: P in [0, 1] and fp8 values are float16 values, and fp8 -> float16 is one conversion).
TX_DEVICE void tx_mma_f16(float* d, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
TX_DEVICE u32 tx_pack2_f16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
TX_DEVICE float tx_f16_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}

// Two floats -> one register of two 16-bit values (lo in the low half), round to nearest.
TX_DEVICE u32 tx_pack2(float lo, float hi) {
  u32 r;
#if TX_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

TX_DEVICE float tx_to_float(u16 h) {
#if TX_BF16
  return __uint_as_float(((u32)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
#endif
}

TX_DEVICE float tx_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
TX_DEVICE float tx_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
TX_DEVICE float tx_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// A work counter's fetch-and-add: relaxed (it hands out work, it publishes nothing), so it needs
// no __threadfence before it as a ticket does.
TX_DEVICE int tx_atomic_add_relaxed(int* p, int v) {
  int old;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
#endif  // TX_EMULATE

TX_DEVICE float tx_neg_inf() { return __int_as_float(0xff800000); }

// Fold an attention sink `s` (base-2 units, -inf: none) into a row's softmax state: running max
// `m` and sum `l` of exp2(x - m); the row's weights keep exp2(x - m) relative to the new max.
TX_DEVICE void tx_fold_sink(float& m, float& l, float s) {
  if (s == tx_neg_inf()) return;
  if (s > m) {
    l *= tx_exp2(m - s);
    m = s;
  }
  l += tx_exp2(s - m);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, absolute error ~1e-7 near 0.
TX_DEVICE float tx_tanh(float x) {
  float e = tx_exp2(x * 2.8853900817779268f);  // 2 * log2(e)
  return 1.0f - 2.0f * tx_rcp(e + 1.0f);
}

TX_DEVICE float tx_warp_max4(float v) {  // max over the 4 lanes of an mma row group
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return v;
}
TX_DEVICE float tx_warp_sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// The prefill kernels' virtual CTAs: v = 0 .. n_items x hgs - 1 over (work item, head group)
// pairs, in sections of `section` head groups (the last one may be narrower): section by section,
// within one item by item, within one head group fastest. One section (section >= hgs) is item
// major, heads fastest; narrower ones keep the CTAs in flight on few heads, whose keys and values
// stay in L2 while every query tile of those heads reads them (prefill.prefill_head_section).
TX_DEVICE void tx_item_head(int v, int hgs, int section, int n_items, int& item, int& hg) {
  const int per = section * n_items;  // virtual CTAs of a full section
  const int sec = v / per;
  const int r = v - sec * per;
  const int width = min(section, hgs - sec * section);
  item = r / width;
  hg = sec * section + r % width;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows are `row_bytes` long,
// XOR-swizzled so that the 8 rows an ldmatrix reads at one column hit 8 different bank groups.
TX_DEVICE u32 tx_swz(int row, int chunk, int row_bytes) {
  return (u32)(row * row_bytes + ((chunk ^ (row & 7)) << 4));
}
