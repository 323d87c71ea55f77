// Hopper (sm_90a) device helpers shared by the wgmma kernels (kernels/prefill_sm90.cu,
// kernels/gemm_sm90.cu): PTX wrappers for mbarriers, named barriers, setmaxnreg and
// wgmma.mma_async (fp32 accumulators, 16-bit operands of the kernel's TX_BF16 type), and the
// 128-byte-swizzle shared-memory layout and matrix descriptors wgmma reads. Like common.cuh it
// needs no CUDA header; with TX_EMULATE (tests/emulator/tx_emulate.h) the wrappers come from the
// CPU emulation instead, and only the layout helpers are compiled from here.
#pragma once

#include "common.cuh"

// A tensor map (CUtensorMap: 128 opaque bytes the driver encodes on the host), passed by value as
// a __grid_constant__ kernel parameter. The CPU emulation reads its own layout from it.
struct alignas(64) TxTensorMap {
  u64 opaque[16];
};

#ifndef TX_EMULATE
#if TX_BF16
#define TX_WG_TYPES ".f32.bf16.bf16"
#else
#define TX_WG_TYPES ".f32.f16.f16"
#endif

// ---- Hopper PTX wrappers (the CPU emulation in tests/emulator provides the same functions) ----

TX_DEVICE void tx_trap() { asm volatile("trap;"); }

// mbarrier: init (count arrivals per phase), arrive, wait for the phase of a given parity to complete
TX_DEVICE void tx_mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
TX_DEVICE void tx_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
TX_DEVICE void tx_mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
TX_DEVICE void tx_mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nTX_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra TX_MBAR_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// one arrival on `bar` once every cp.async this thread issued so far has landed
TX_DEVICE void tx_cp_async_mbar_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// the phase's transaction count grows by `bytes` (the bulk copies to come), then one arrival
TX_DEVICE void tx_mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// bulk copy (the TMA unit, no tensor map) of `bytes` (a multiple of 16, both ends 16-byte
// aligned) into this CTA's shared memory; its bytes count against `bar`'s transaction count
TX_DEVICE void tx_bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
TX_DEVICE void tx_bulk_copy_hint(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
// a box of a 3-D tensor map at coordinates (c0 innermost, c1, c2) into shared memory at `dst`
// (laid out as the map's swizzle says; elements outside the tensor are zeros); the box's bytes
// count against `bar`'s transaction count
TX_DEVICE void tx_tma_load_3d(u32 dst, const TxTensorMap* map, int c0, int c1, int c2, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// the same for a 4-D map (with an L2 cache policy: `_hint`)
TX_DEVICE void tx_tma_load_4d(u32 dst, const TxTensorMap* map, int c0, int c1, int c2, int c3, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
TX_DEVICE void tx_tma_load_4d_hint(u32 dst, const TxTensorMap* map, int c0, int c1, int c2, int c3, u32 bar,
                                   u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
      "{%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
      : "memory");
}
TX_DEVICE void tx_st_shared_zero16(u32 dst) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
}
// orders this thread's generic-proxy shared-memory accesses (cp.async, st.shared) with the
// async proxy (wgmma operand reads)
TX_DEVICE void tx_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
TX_DEVICE void tx_bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
// one arrival of this warp's threads on named barrier `id` of `count` threads, without waiting
TX_DEVICE void tx_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// registers per thread of this warpgroup from here on (all four warps execute it)
template <int N>
TX_DEVICE void tx_setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
TX_DEVICE void tx_setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Thread block clusters: this CTA's rank in its cluster; a barrier of every thread of every CTA
// of the cluster (release: this CTA's shared-memory writes before it are visible to the others
// after their wait; acquire: theirs to this one); a 16-byte read of another CTA's shared memory
// (distributed shared memory) at the offset `addr` has in this one.
TX_DEVICE u32 tx_cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
TX_DEVICE void tx_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
TX_DEVICE float4 tx_ld_cluster_f4(u32 addr, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

TX_DEVICE void tx_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
TX_DEVICE void tx_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
TX_DEVICE void tx_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins a register operand of an asynchronous wgmma at this point of the program (emits nothing):
// the compiler may not move reads or writes of it across the wgmma issue and wait.
TX_DEVICE void tx_reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }
TX_DEVICE void tx_reg_fence(u32& x) { asm volatile("" : "+r"(x)::"memory"); }

// Operand lists "%0, %1, ..." of the accumulator registers.
#define TX_R10(n) "%" #n "0, %" #n "1, %" #n "2, %" #n "3, %" #n "4, %" #n "5, %" #n "6, %" #n "7, %" #n "8, %" #n "9"
#define TX_R32 TX_R10() ", " TX_R10(1) ", " TX_R10(2) ", %30, %31"
#define TX_R64 TX_R10() ", " TX_R10(1) ", " TX_R10(2) ", " TX_R10(3) ", " TX_R10(4) ", " TX_R10(5) ", %60, %61, %62, %63"
#define TX_R128                                                                                                     \
  TX_R10() ", " TX_R10(1) ", " TX_R10(2) ", " TX_R10(3) ", " TX_R10(4) ", " TX_R10(5) ", " TX_R10(6) ", " TX_R10(7) \
           ", " TX_R10(8) ", " TX_R10(9) ", " TX_R10(10) ", " TX_R10(11) ", %120, %121, %122, %123, %124, %125, %126, %127"
#define TX_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define TX_F16(d, i) TX_F4(d, i), TX_F4(d, i + 4), TX_F4(d, i + 8), TX_F4(d, i + 12)
#define TX_F32(d) TX_F16(d, 0), TX_F16(d, 16)
#define TX_F64(d) TX_F16(d, 0), TX_F16(d, 16), TX_F16(d, 32), TX_F16(d, 48)
#define TX_F128(d) \
  TX_F16(d, 0), TX_F16(d, 16), TX_F16(d, 32), TX_F16(d, 48), TX_F16(d, 64), TX_F16(d, 80), TX_F16(d, 96), TX_F16(d, 112)

// d[N / 2] (+)= A (64 x 16, K-major, shared memory) * B (16 x N, K-major, shared memory);
// scale_d 0 ignores d's old value. tx_wgmma_ss in the kernel's 16-bit type, tx_wgmma_ss_f16 in
// float16 whatever TX_BF16 says (prefill_sm90.cu's fp8 variants under bfloat16 q: Q K^T in float16).
#define TX_WGMMA_SS(NAME, TYPES)                                                                         \
  template <int N>                                                                                       \
  TX_DEVICE void NAME(float* d, u64 desc_a, u64 desc_b, int scale_d);                                    \
  template <>                                                                                            \
  TX_DEVICE void NAME<64>(float* d, u64 desc_a, u64 desc_b, int scale_d) {                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16" TYPES  \
                 " {" TX_R32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                             \
                 : TX_F32(d)                                                                             \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                              \
  }                                                                                                      \
  template <>                                                                                            \
  TX_DEVICE void NAME<128>(float* d, u64 desc_a, u64 desc_b, int scale_d) {                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16" TYPES \
                 " {" TX_R64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                             \
                 : TX_F64(d)                                                                             \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                              \
  }                                                                                                      \
  template <>                                                                                            \
  TX_DEVICE void NAME<256>(float* d, u64 desc_a, u64 desc_b, int scale_d) {                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16" TYPES \
                 " {" TX_R128 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"                                          \
                 : TX_F128(d)                                                                            \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                              \
  }
TX_WGMMA_SS(tx_wgmma_ss, TX_WG_TYPES)
TX_WGMMA_SS(tx_wgmma_ss_f16, ".f32.f16.f16")
#undef TX_WGMMA_SS

// d[N / 2] (+)= A (64 x 16, registers: a[4] in the accumulator layout of a 64 x 16 tile, packed
// pairwise) * B (16 x N, shared memory, MN-major: imm-trans-b = 1): tx_wgmma_rs_t in the kernel's
// 16-bit type, tx_wgmma_rs_t_f16 in float16 whatever TX_BF16 says (prefill_sm90.cu's fp8 variants:
// P V in float16).
#define TX_WGMMA_RS_T(NAME, TYPES)                                                                       \
  template <int N>                                                                                       \
  TX_DEVICE void NAME(float* d, const u32* a, u64 desc_b, int scale_d);                                  \
  template <>                                                                                            \
  TX_DEVICE void NAME<64>(float* d, const u32* a, u64 desc_b, int scale_d) {                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16" TYPES  \
                 " {" TX_R32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                             \
                 : TX_F32(d)                                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));                \
  }                                                                                                      \
  template <>                                                                                            \
  TX_DEVICE void NAME<128>(float* d, const u32* a, u64 desc_b, int scale_d) {                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16" TYPES \
                 " {" TX_R64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                             \
                 : TX_F64(d)                                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));                \
  }                                                                                                      \
  template <>                                                                                            \
  TX_DEVICE void NAME<256>(float* d, const u32* a, u64 desc_b, int scale_d) {                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16" TYPES \
                 " {" TX_R128 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                       \
                 : TX_F128(d)                                                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));                \
  }
TX_WGMMA_RS_T(tx_wgmma_rs_t, TX_WG_TYPES)
TX_WGMMA_RS_T(tx_wgmma_rs_t_f16, ".f32.f16.f16")
#undef TX_WGMMA_RS_T
#endif  // TX_EMULATE

// Shared-memory matrix descriptors, 128-byte swizzle (mode 1 in bits 62-63), base offset 0
// (every tile is 1024-byte aligned). Addresses, LBO and SBO are in 16-byte units.
// K-major: 8-row groups SBO = 1024 bytes apart; LBO unused with this swizzle (1).
TX_DEVICE u64 desc_k_major(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
// MN-major: 64-element column blocks `lbo` bytes apart, 8-row (k) groups SBO = 1024 bytes apart.
TX_DEVICE u64 desc_mn_major(u32 addr, u32 lbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// The descriptor of the matrix `bytes` (a multiple of 16) past the one `d` describes: the start
// address sits in bits [0, 14) in 16-byte units and shared-memory addresses stay below 2^18, so
// the offset adds to the low word alone without a carry; the high word (SBO, swizzle) is kept.
// Computing a tile's descriptor once and stepping it so cut prefill's issue of a tile's 20 wgmma
// (DeepSeek 192/128, tensor maps, ping-pong) from 252 to 165 instructions a warp (cuobjdump -sass).
TX_DEVICE u64 desc_at(u64 d, u32 bytes) {
  return (d & 0xFFFFFFFF00000000ull) | (u32)((u32)d + (bytes >> 4));
}

// Byte offset of 16-byte chunk `ch` of row `row` in a swizzled tile of `rows` rows (see the top).
TX_DEVICE u32 sw128(int row, int ch, int rows) {
  return (u32)((ch >> 3) * rows * 128 + row * 128 + (((ch & 7) ^ (row & 7)) << 4));
}
