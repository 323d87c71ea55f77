// A CPU emulation of the few CUDA features the cuda_native kernels use, so that the kernel
// sources themselves (kernels/*.cu, compiled with g++ and TX_EMULATE) run on a machine without
// a GPU. Tests only: it checks indexing, fragment layouts, masking, pipelining and epilogues,
// not speed.
//
// Every CUDA thread of a CTA is a fiber (ucontext) on one OS thread, scheduled round-robin; a
// fiber yields only at synchronisation points: __syncthreads, __syncwarp and the warp-collective
// operations (ldmatrix, mma.sync, shuffles), which exchange their operands through per-warp
// slots between two warp barriers. cp.async copies are queued per thread and land when that
// thread waits for their group (the latest moment the hardware allows), or at once with
// TXE_EAGER_COPIES=1; shared memory is filled with 0xFF (NaN in bf16 and fp16) before each CTA,
// so reading a tile before its copies have landed, or a row never written, shows up as NaN.
//
// Fragment layouts follow the PTX ISA (mma.m16n8k16 with .row.col and 16-bit operands, fp32
// accumulators; ldmatrix .m8n8.x4 .b16 with and without .trans).
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <vector>

#define TX_EMULATE 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__
#define TX_DEVICE static inline

typedef unsigned int u32;
typedef unsigned short u16;

alignas(1024) unsigned char smem[256 * 1024];

namespace txe {

struct Dim3 {
  unsigned x, y, z;
};

struct Copy {
  u32 dst;
  const void* src;
  int bytes;
};

struct Thread {
  ucontext_t ctx;
  std::vector<char> stack;
  Dim3 tid;
  bool done = false;
  std::vector<Copy> open;               // issued, not yet committed
  std::deque<std::vector<Copy>> groups;  // committed, not yet landed
};

struct Barrier {
  int arrived = 0;
  unsigned gen = 0;
};

struct Slots {
  u32 u[16];
  float f[4];
  const void* p;
};

inline Thread* cur = nullptr;
inline Dim3 block_idx{0, 0, 0};
inline ucontext_t sched_ctx;
inline std::vector<Thread*> threads;
inline Barrier block_bar;
inline std::vector<Barrier> warp_bars;
inline std::vector<Slots> slots;  // one per thread
inline std::function<void()> body;
inline bool eager = false;
inline int live = 0;
inline const char* error = nullptr;  // the first misuse seen (the launch returns it)

inline void fail(const char* what) {
  if (error == nullptr) error = what;
}

inline void yield() { swapcontext(&cur->ctx, &sched_ctx); }

inline void land(const Copy& c) {
  if (c.bytes == 16) {
    std::memcpy(smem + c.dst, c.src, 16);
  } else {
    std::memset(smem + c.dst, 0, 16);
    if (c.bytes > 0) std::memcpy(smem + c.dst, c.src, c.bytes);
  }
}

inline void wait(Barrier& b, int count) {
  const unsigned gen = b.gen;
  if (++b.arrived == count) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  while (b.gen == gen) yield();
}

inline int tid() { return (int)cur->tid.x; }
inline int lane() { return tid() & 31; }
inline void warp_barrier() { wait(warp_bars[tid() >> 5], 32); }
inline Slots& my_slot() { return slots[tid()]; }
inline Slots& lane_slot(int l) { return slots[(tid() & ~31) + l]; }

inline void entry() {
  body();
  cur->done = true;
  --live;
  swapcontext(&cur->ctx, &sched_ctx);
}

// Run `kernel` once per CTA of the grid, with `nthreads` threads each.
inline const char* launch(unsigned gx, unsigned gy, int nthreads, std::function<void()> kernel) {
  error = nullptr;
  const char* env = std::getenv("TXE_EAGER_COPIES");
  eager = env != nullptr && env[0] == '1';
  body = std::move(kernel);
  std::vector<Thread> pool(nthreads);
  for (auto& t : pool) t.stack.resize(256 * 1024);
  slots.assign(nthreads, Slots{});
  for (unsigned by = 0; by < gy; ++by) {
    for (unsigned bx = 0; bx < gx; ++bx) {
      block_idx = {bx, by, 0};
      std::memset(smem, 0xFF, sizeof(smem));
      block_bar = Barrier{};
      warp_bars.assign((nthreads + 31) / 32, Barrier{});
      threads.clear();
      for (int i = 0; i < nthreads; ++i) {
        Thread& t = pool[i];
        t.tid = {(unsigned)i, 0, 0};
        t.done = false;
        t.open.clear();
        t.groups.clear();
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = t.stack.data();
        t.ctx.uc_stack.ss_size = t.stack.size();
        t.ctx.uc_link = nullptr;
        makecontext(&t.ctx, entry, 0);
        threads.push_back(&t);
      }
      live = nthreads;
      while (live > 0) {
        for (Thread* t : threads) {
          if (t->done) continue;
          cur = t;
          swapcontext(&sched_ctx, &t->ctx);
        }
      }
    }
  }
  return error;
}

inline u32 bits(float f) {
  u32 u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(u32 u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace txe

#define threadIdx (txe::cur->tid)
#define blockIdx (txe::block_idx)

static inline float __int_as_float(int i) { return txe::from_bits((u32)i); }
static inline float __uint_as_float(u32 u) { return txe::from_bits(u); }
static inline u32 __float_as_uint(float f) { return txe::bits(f); }
template <class T>
static inline T __ldg(const T* p) {
  return *p;
}
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
using std::fmaf;
using std::fmaxf;

// threads that have exited no longer count (as on the GPU); the kernels exit only past their last barrier
static inline void __syncthreads() { txe::wait(txe::block_bar, txe::live); }
static inline void __syncwarp() { txe::warp_barrier(); }

static inline float __shfl_xor_sync(unsigned, float v, int mask) {
  txe::my_slot().f[0] = v;
  txe::warp_barrier();
  const float r = txe::lane_slot(txe::lane() ^ mask).f[0];
  txe::warp_barrier();
  return r;
}

// ---- the PTX wrappers of common.cuh -------------------------------------------------------

TX_DEVICE u32 tx_smem_addr(const void* p) { return (u32)((const unsigned char*)p - smem); }

TX_DEVICE void tx_cp_async16(u32 dst, const void* src, int src_bytes) {
  if (dst % 16 != 0 || dst + 16 > sizeof(smem)) return txe::fail("cp.async: bad shared address");
  if (src_bytes > 0 && ((uintptr_t)src % 16) != 0) return txe::fail("cp.async: unaligned global address");
  const txe::Copy c{dst, src, src_bytes};
  if (txe::eager) {
    txe::land(c);
  } else {
    txe::cur->open.push_back(c);
  }
}
TX_DEVICE void tx_cp_async_commit() {
  txe::cur->groups.push_back(std::move(txe::cur->open));
  txe::cur->open.clear();
}
template <int N>
TX_DEVICE void tx_cp_async_wait() {
  auto& g = txe::cur->groups;
  while ((int)g.size() > N) {
    for (const auto& c : g.front()) txe::land(c);
    g.pop_front();
  }
}

static inline u16 tx_emu_load16(u32 addr) {
  u16 h;
  std::memcpy(&h, smem + addr, 2);
  return h;
}

// lane l gets, from matrix i (rows at the addresses of lanes 8i..8i+7): row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1 (.trans: column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1)
static inline void tx_emu_ldmatrix(u32 addr, u32* r, bool trans) {
  if (addr % 16 != 0 || addr + 16 > sizeof(smem)) txe::fail("ldmatrix: bad row address");
  txe::my_slot().u[0] = addr;
  txe::warp_barrier();
  const int l = txe::lane();
  for (int i = 0; i < 4; ++i) {
    u16 lo, hi;
    if (!trans) {
      const u32 row = txe::lane_slot(8 * i + l / 4).u[0];
      lo = tx_emu_load16(row + 2 * (2 * (l % 4)));
      hi = tx_emu_load16(row + 2 * (2 * (l % 4) + 1));
    } else {
      const u32 row0 = txe::lane_slot(8 * i + 2 * (l % 4)).u[0];
      const u32 row1 = txe::lane_slot(8 * i + 2 * (l % 4) + 1).u[0];
      lo = tx_emu_load16(row0 + 2 * (l / 4));
      hi = tx_emu_load16(row1 + 2 * (l / 4));
    }
    r[i] = (u32)lo | ((u32)hi << 16);
  }
  txe::warp_barrier();
}
TX_DEVICE void tx_ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  u32 r[4];
  tx_emu_ldmatrix(addr, r, false);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
TX_DEVICE void tx_ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  u32 r[4];
  tx_emu_ldmatrix(addr, r, true);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}

static inline float tx_emu_half_to_float(u16 h) {
#if TX_BF16
  return txe::from_bits(((u32)h) << 16);
#else
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
#endif
}

static inline u16 tx_emu_float_to_half(float f) {
#if TX_BF16
  u32 u = txe::bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1);                                        // round to nearest even
  return (u16)(u >> 16);
#else
  _Float16 x = (_Float16)f;
  u16 h;
  std::memcpy(&h, &x, 2);
  return h;
#endif
}

// d[4] += A (16 x 16, row) * B (16 x 8, col): lane l = 4 g + t holds a0 = A[g][2t, 2t+1],
// a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]; b0 = B[2t, 2t+1][g],
// b1 = B[2t+8, 2t+9][g]; d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1].
TX_DEVICE void tx_mma(float* d, const u32* a, u32 b0, u32 b1) {
  txe::Slots& me = txe::my_slot();
  for (int i = 0; i < 4; ++i) me.u[i] = a[i];
  me.u[4] = b0;
  me.u[5] = b1;
  txe::warp_barrier();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const txe::Slots& s = txe::lane_slot(l);
    const int g = l / 4, t = l % 4;
    auto lo = [](u32 v) { return tx_emu_half_to_float((u16)(v & 0xffff)); };
    auto hi = [](u32 v) { return tx_emu_half_to_float((u16)(v >> 16)); };
    A[g][2 * t] = lo(s.u[0]), A[g][2 * t + 1] = hi(s.u[0]);
    A[g + 8][2 * t] = lo(s.u[1]), A[g + 8][2 * t + 1] = hi(s.u[1]);
    A[g][2 * t + 8] = lo(s.u[2]), A[g][2 * t + 9] = hi(s.u[2]);
    A[g + 8][2 * t + 8] = lo(s.u[3]), A[g + 8][2 * t + 9] = hi(s.u[3]);
    B[2 * t][g] = lo(s.u[4]), B[2 * t + 1][g] = hi(s.u[4]);
    B[2 * t + 8][g] = lo(s.u[5]), B[2 * t + 9][g] = hi(s.u[5]);
  }
  txe::warp_barrier();
  const int l = txe::lane(), g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[i] = acc;
  }
}

TX_DEVICE u32 tx_pack2(float lo, float hi) {
  return (u32)tx_emu_float_to_half(lo) | ((u32)tx_emu_float_to_half(hi) << 16);
}
TX_DEVICE float tx_to_float(u16 h) { return tx_emu_half_to_float(h); }
TX_DEVICE float tx_exp2(float x) { return std::exp2(x); }
TX_DEVICE float tx_log2(float x) { return std::log2(x); }
TX_DEVICE float tx_rcp(float x) { return 1.0f / x; }
