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
//
// Hopper (kernels/prefill_sm90.cu): mbarriers (init, arrive, try_wait.parity, and
// cp.async.mbarrier.arrive.noinc, whose arrival waits for the thread's copies: they land when a
// thread waits on that barrier, or at once with TXE_EAGER_COPIES=1), named barriers (bar.sync id,
// count), and wgmma.mma_async m64nNk16 with fp32 accumulators: A from shared memory (K-major) or
// from registers, B from shared memory K-major or MN-major, through 64-bit matrix descriptors
// with the 128-byte swizzle (address bits [4:6] ^= bits [7:9]), decoded as the PTX ISA defines
// them. A wgmma runs when its warpgroup waits for its group (wgmma.wait_group: the latest moment
// the hardware allows), reading the A registers and shared memory as they are then: a kernel that
// touches them before the wait, or lets the producer overwrite a stage too early, computes garbage.
// Proxy fences, wgmma.fence and setmaxnreg have nothing to emulate.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
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
typedef unsigned long long u64;

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

struct WgOp {  // one wgmma.mma_async as a thread issued it
  int n;                     // N of m64nNk16
  float* d;                  // this thread's N / 2 accumulators
  const u32* a;              // this thread's 4 A registers, or null: A from shared memory (desc_a)
  u64 desc_a, desc_b;
  int scale_d, trans_b;
};

struct Thread {
  ucontext_t ctx;
  std::vector<char> stack;
  Dim3 tid;
  bool done = false;
  std::vector<Copy> open;               // issued, not yet committed
  std::deque<std::vector<Copy>> groups;  // committed, not yet landed
  std::vector<WgOp> wg_open;             // wgmma issued, not yet committed
  std::deque<std::vector<WgOp>> wg_groups;
};

struct MBar {
  bool init = false;
  int expected = 0, pending = 0;
  unsigned phase = 0;
  std::deque<std::pair<int, std::vector<Copy>>> async;  // cp.async.mbarrier.arrive: (thread, its copies)
  std::vector<int> arrived;                             // threads that arrived in this phase
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
inline std::vector<Barrier> wg_bars;     // one per warpgroup (wgmma.wait_group)
inline std::vector<Barrier> named_bars;  // bar.sync ids
inline std::map<u32, MBar> mbars;        // by shared-memory address
constexpr long SPIN_LIMIT = 200000;      // scheduler passes one wait may take before it is a deadlock
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
  long spins = 0;
  while (b.gen == gen && error == nullptr) {
    if (++spins > SPIN_LIMIT) return fail("deadlock: a barrier never completes");
    yield();
  }
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
      wg_bars.assign((nthreads + 127) / 128, Barrier{});
      named_bars.assign(16, Barrier{});
      mbars.clear();
      threads.clear();
      for (int i = 0; i < nthreads; ++i) {
        Thread& t = pool[i];
        t.tid = {(unsigned)i, 0, 0};
        t.done = false;
        t.open.clear();
        t.groups.clear();
        t.wg_open.clear();
        t.wg_groups.clear();
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

// ---- Hopper: the PTX wrappers of kernels/prefill_sm90.cu -----------------------------------

TX_DEVICE void tx_trap() { txe::fail("trap"); }

namespace txe {

inline MBar& mbar(u32 addr) {
  MBar& b = mbars[addr];
  if (!b.init) fail("mbarrier: used before mbarrier.init");
  return b;
}

// The kernels' protocol: a thread arrives at most once per phase (a second arrival would count
// towards a phase other threads have not finished, e.g. a warpgroup racing over skipped tiles).
inline void mbar_arrive(MBar& b, int thread) {
  if (b.pending <= 0) return fail("mbarrier: more arrivals than its count in one phase");
  for (int t : b.arrived) {
    if (t == thread) return fail("mbarrier: a thread arrived twice in one phase");
  }
  b.arrived.push_back(thread);
  if (--b.pending == 0) {
    b.phase ^= 1;
    b.pending = b.expected;
    b.arrived.clear();
  }
}

// the copies of pending cp.async arrivals land, then those arrivals count
inline void mbar_settle(MBar& b) {
  while (!b.async.empty()) {
    for (const Copy& c : b.async.front().second) land(c);
    const int thread = b.async.front().first;
    b.async.pop_front();
    mbar_arrive(b, thread);
  }
}

// d (+)= A * B for the 128 threads of a warpgroup: ops[t] is thread t's record of the same wgmma
inline u32 swizzle128(u32 addr) { return addr ^ (((addr >> 7) & 7) << 4); }

inline float smem_elem(u32 addr) {
  if (addr + 2 > sizeof(smem)) {
    fail("wgmma: operand outside shared memory");
    return 0.f;
  }
  u16 h;
  std::memcpy(&h, smem + addr, 2);
#if TX_BF16
  return from_bits(((u32)h) << 16);
#else
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
#endif
}

struct Desc {
  u32 start, lbo, sbo;
};

inline Desc decode(u64 desc) {
  if ((desc >> 62) != 1) fail("wgmma: descriptor swizzle mode is not 128B (1)");
  if (((desc >> 49) & 7) != 0) fail("wgmma: descriptor base offset is not 0");
  return {(u32)(desc & 0x3FFF) << 4, (u32)((desc >> 16) & 0x3FFF) << 4, (u32)((desc >> 32) & 0x3FFF) << 4};
}

// element (mn, k) of a K-major operand: 8-row groups SBO apart, rows 128 bytes apart, k contiguous
inline float k_major(const Desc& d, int mn, int k) {
  return smem_elem(swizzle128(d.start + (mn / 8) * d.sbo + (mn % 8) * 128 + 2 * k));
}
// element (k, n) of an MN-major operand: 64-element column blocks LBO apart, 8-row k groups SBO
// apart, k rows 128 bytes apart, n contiguous
inline float mn_major(const Desc& d, int k, int n) {
  return smem_elem(swizzle128(d.start + (n / 64) * d.lbo + (k / 8) * d.sbo + (k % 8) * 128 + 2 * (n % 64)));
}

inline float half_lo(u32 v) { return tx_emu_half_to_float((u16)(v & 0xffff)); }
inline float half_hi(u32 v) { return tx_emu_half_to_float((u16)(v >> 16)); }

inline void wgmma_run(const WgOp* ops) {
  const WgOp& op = ops[0];
  for (int t = 1; t < 128; ++t) {
    const WgOp& o = ops[t];
    if (o.n != op.n || (o.a == nullptr) != (op.a == nullptr) || o.desc_b != op.desc_b || o.trans_b != op.trans_b ||
        (op.a == nullptr && o.desc_a != op.desc_a) || o.scale_d != op.scale_d)
      return fail("wgmma: the threads of a warpgroup issued different operations");
  }
  static float A[64][16], B[16][256];
  if (op.a == nullptr) {
    const Desc da = decode(op.desc_a);
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) A[m][k] = k_major(da, m, k);
  } else {
    for (int t = 0; t < 128; ++t) {  // the A fragment: the accumulator layout of a 64 x 16 tile
      const int row = 16 * (t / 32) + (t % 32) / 4, col = 2 * (t % 4);
      const u32* a = ops[t].a;
      A[row][col] = half_lo(a[0]), A[row][col + 1] = half_hi(a[0]);
      A[row + 8][col] = half_lo(a[1]), A[row + 8][col + 1] = half_hi(a[1]);
      A[row][col + 8] = half_lo(a[2]), A[row][col + 9] = half_hi(a[2]);
      A[row + 8][col + 8] = half_lo(a[3]), A[row + 8][col + 9] = half_hi(a[3]);
    }
  }
  const Desc db = decode(op.desc_b);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < op.n; ++n) B[k][n] = op.trans_b ? mn_major(db, k, n) : k_major(db, n, k);
  for (int t = 0; t < 128; ++t) {
    float* d = ops[t].d;
    for (int i = 0; i < op.n / 2; ++i) {  // register i: row 16 warp + lane / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (lane % 4) + i % 2
      const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1);
      const int col = 8 * (i >> 2) + 2 * (t % 4) + (i & 1);
      float acc = op.scale_d ? d[i] : 0.f;
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      d[i] = acc;
    }
  }
}

}  // namespace txe

TX_DEVICE void tx_mbar_init(u32 bar, u32 count) {
  if (bar % 8) return txe::fail("mbarrier: not 8-byte aligned");
  txe::MBar& b = txe::mbars[bar];
  b = txe::MBar{};
  b.init = true;
  b.expected = b.pending = (int)count;
}
TX_DEVICE void tx_mbar_init_fence() {}
TX_DEVICE void tx_mbar_arrive(u32 bar) { txe::mbar_arrive(txe::mbar(bar), txe::tid()); }
TX_DEVICE void tx_mbar_wait(u32 bar, u32 parity) {
  txe::MBar& b = txe::mbar(bar);
  long spins = 0;
  for (;;) {
    txe::mbar_settle(b);
    if ((b.phase & 1) != (parity & 1) || txe::error != nullptr) return;  // the phase of that parity completed
    if (++spins > txe::SPIN_LIMIT) return txe::fail("deadlock: an mbarrier phase never completes");
    txe::yield();
  }
}
TX_DEVICE void tx_cp_async_mbar_arrive(u32 bar) {
  txe::MBar& b = txe::mbar(bar);
  std::vector<txe::Copy> mine;  // every copy this thread issued and that has not landed
  for (auto& g : txe::cur->groups) mine.insert(mine.end(), g.begin(), g.end());
  mine.insert(mine.end(), txe::cur->open.begin(), txe::cur->open.end());
  txe::cur->groups.clear();
  txe::cur->open.clear();
  b.async.emplace_back(txe::tid(), std::move(mine));
  if (txe::eager) txe::mbar_settle(b);
}
TX_DEVICE void tx_fence_proxy_async() {}
TX_DEVICE void tx_bar_sync(int id, int count) {
  if (id < 0 || id >= 16 || count % 32) return txe::fail("bar.sync: bad barrier id or count");
  txe::wait(txe::named_bars[id], count);
}
template <int N>
TX_DEVICE void tx_setmaxnreg_dec() {}
template <int N>
TX_DEVICE void tx_setmaxnreg_inc() {}
TX_DEVICE void tx_reg_fence(float&) {}
TX_DEVICE void tx_reg_fence(u32&) {}
TX_DEVICE void tx_wgmma_fence() {}
template <int N>
TX_DEVICE void tx_wgmma_ss(float* d, u64 desc_a, u64 desc_b, int scale_d) {
  txe::cur->wg_open.push_back({N, d, nullptr, desc_a, desc_b, scale_d, 0});
}
template <int N>
TX_DEVICE void tx_wgmma_rs_t(float* d, const u32* a, u64 desc_b, int scale_d) {
  txe::cur->wg_open.push_back({N, d, a, 0, desc_b, scale_d, 1});
}
TX_DEVICE void tx_wgmma_commit() {
  txe::cur->wg_groups.push_back(std::move(txe::cur->wg_open));
  txe::cur->wg_open.clear();
}
// the warpgroup meets; its first thread runs every group but the newest N of all 128 threads
template <int N>
TX_DEVICE void tx_wgmma_wait() {
  if (!txe::cur->wg_open.empty()) txe::fail("wgmma: wait_group with wgmma not yet committed");
  const int wg = txe::tid() / 128;
  txe::wait(txe::wg_bars[wg], 128);
  if (txe::tid() % 128 == 0) {
    std::vector<txe::Thread*> members(txe::threads.begin() + 128 * wg, txe::threads.begin() + 128 * wg + 128);
    for (txe::Thread* t : members) {
      if (t->wg_groups.size() != members[0]->wg_groups.size()) txe::fail("wgmma: warpgroup threads disagree on groups");
    }
    std::vector<txe::WgOp> ops(128);
    while (txe::error == nullptr && members[0]->wg_groups.size() > (size_t)N) {
      const size_t count = members[0]->wg_groups.front().size();
      for (size_t j = 0; j < count && txe::error == nullptr; ++j) {
        for (int t = 0; t < 128; ++t) {
          if (members[t]->wg_groups.front().size() != count) return txe::fail("wgmma: warpgroup groups differ");
          ops[t] = members[t]->wg_groups.front()[j];
        }
        txe::wgmma_run(ops.data());
      }
      for (txe::Thread* t : members) t->wg_groups.pop_front();
    }
  }
  txe::wait(txe::wg_bars[wg], 128);
}
