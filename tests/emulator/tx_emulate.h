// A CPU emulation of the few CUDA features the cuda_native kernels use, so that the kernel
// sources themselves (kernels/*.cu, compiled with g++ and TX_EMULATE) run on a machine without
// a GPU. Tests only: it checks indexing, fragment layouts, masking, pipelining, epilogues and
// the cross-CTA ticket protocol, not speed.
//
// Every CUDA thread of a CTA is a fiber (ucontext) on one OS thread; a fiber yields only at
// synchronisation points: __syncthreads, __syncwarp, the warp-collective operations (ldmatrix,
// mma.sync, shuffles), which exchange their operands through per-warp slots between two warp
// barriers, __threadfence and atomics (so that other CTAs may run in between), and the Hopper
// waits (mbarrier phases, bar.sync, wgmma.wait_group). A scheduling step ("round") resumes
// each unfinished thread of one CTA once. Several CTAs may be resident at once
// (Schedule::resident): each has its own barriers, warp slots and shared memory (swapped in
// and out of `smem` when the scheduler moves to another CTA), and the scheduler steps them in
// turn or, with a seed, at random, so CTAs overlap the way they do on a GPU and a CTA that
// draws the last ticket of a counter may do so early or late. CTAs start in grid order (x
// fastest), reversed, or shuffled. Global memory is plain host memory: sequentially consistent.
// What the memory model asks of the ticket protocol (kernels/decode.cu, gemm.cu) is checked
// instead: a thread's atomic must come after a __threadfence of that thread (its CTA's results
// are published), and a ld.global.cg after its CTA's atomic must come after a __threadfence
// following it (the other CTAs' results are acquired).
//
// cp.async copies are queued per thread and land when that thread waits for their group (the
// latest moment the hardware allows), or at once with TXE_EAGER_COPIES=1; a CTA's shared memory
// is filled with 0xFF (NaN in bf16 and fp16) when it starts, so reading a tile before its copies
// have landed, or a row never written, shows up as NaN. Shared memory past the launch's dynamic
// size must stay untouched (checked when each CTA ends).
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
// Tensor-map copies (cp.async.bulk.tensor, 3-D boxes, 128-byte swizzle) read a layout of the
// map's 128 bytes of the emulation's own (tx_tma_load_3d) and land like bulk copies.
// Proxy fences, wgmma.fence and setmaxnreg have nothing to emulate. Mbarriers (keyed by their
// shared-memory address), named barriers, warpgroup barriers and wgmma queues (per thread) are
// CTA state like the rest: each resident CTA has its own, kept across the scheduler's switches.
// Mbarriers and wgmma operands must lie inside the launch's dynamic shared memory, and a thread
// may not exit with wgmma not waited for. A wait that the scheduler resumes SPIN_LIMIT times
// without its barrier completing is reported as a deadlock.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <vector>

#define TX_EMULATE 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __grid_constant__
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

struct WgOp {    // one wgmma.mma_async as a thread issued it
  int n;         // N of m64nNk16
  float* d;      // this thread's N / 2 accumulators (on its fiber's stack)
  const u32* a;  // this thread's 4 A registers, or null: A from shared memory (desc_a)
  u64 desc_a, desc_b;
  int scale_d, trans_b;
  int f16;  // the operands are float16 whatever TX_BF16 says (tx_wgmma_rs_t_f16)
};

constexpr size_t STACK_BYTES = 256 * 1024;

struct Thread {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack{new char[STACK_BYTES]};  // untouched until used
  Dim3 tid;
  bool done = false;
  std::vector<Copy> open;                   // issued, not yet committed
  std::deque<std::vector<Copy>> groups;      // committed, not yet landed
  unsigned long long fenced = 0;             // event number of its last __threadfence
  std::vector<WgOp> wg_open;                 // wgmma issued, not yet committed
  std::deque<std::vector<WgOp>> wg_groups;  // committed, not yet run (at wgmma.wait_group)
};

struct MBar {
  bool init = false;
  int expected = 0, pending = 0;
  long tx = 0;            // bytes of bulk copies the phase still waits for (expect_tx adds, landing copies take)
  std::deque<Copy> bulk;  // bulk copies issued, not yet landed
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

struct Cta;

struct Cluster {  // the CTAs of one thread block cluster (started together, in rank order)
  std::vector<Cta*> members;
  Barrier bar;  // barrier.cluster: every thread of every member
  int done = 0;  // members that have exited
};

struct Cta {
  Dim3 idx{0, 0, 0};
  Cluster* cluster = nullptr;
  unsigned rank = 0;  // in its cluster
  std::vector<Thread> threads;
  Barrier bar;
  std::vector<Barrier> warp_bars;
  std::vector<Slots> slots;         // one per thread
  std::vector<Barrier> wg_bars;     // one per warpgroup (wgmma.wait_group)
  std::vector<Barrier> named_bars;  // bar.sync ids
  std::map<u32, MBar> mbars;        // by shared-memory address
  int live = 0;
  unsigned long long started = 0;    // event number when it started
  unsigned long long ticket = 0;     // event number of its last atomic (0: none)
  bool parked = false;               // held back after an atomic (Schedule::park)
  std::vector<unsigned char> saved;  // its shared memory while another CTA's is in `smem`
};

// How a launch runs its grid. order: 0 grid order (x fastest, as the GPU dispatches), 1 reversed,
// 2 shuffled with `seed`; resident: CTAs in flight at once; seed (with resident > 1): 0 steps the
// resident CTAs in turn, otherwise in a random order drawn from it; park: a CTA whose thread has
// just done an atomic waits while any other resident CTA can run, and when all wait, the one
// with the latest atomic goes on first (the longest delay the GPU allows between a ticket and
// what its CTA does next: the last ticket is drawn, and its merge done, before the CTAs that
// drew the others get past them).
struct Schedule {
  int resident = 1;
  int order = 0;
  unsigned seed = 0;
  bool park = false;
  size_t smem_bytes = sizeof(smem);  // the launch's dynamic shared memory
};

inline Thread* cur = nullptr;
inline Cta* cta = nullptr;  // the CTA being stepped
inline Cta* loaded = nullptr;  // the CTA whose shared memory is in `smem`
inline Dim3 grid_dim{0, 0, 0};
inline ucontext_t sched_ctx;
inline std::function<void()> body;
inline bool eager = false;
inline bool park = false;
inline size_t smem_size = sizeof(smem);
inline unsigned long long events = 0;  // fences, atomics and CTA starts, numbered in order
inline const char* error = nullptr;    // the first misuse seen (the launch returns it)
constexpr long SPIN_LIMIT = 200000;    // times one wait may be resumed before it is a deadlock

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
inline void warp_barrier() { wait(cta->warp_bars[tid() >> 5], 32); }
inline Slots& my_slot() { return cta->slots[tid()]; }
inline Slots& lane_slot(int l) { return cta->slots[(tid() & ~31) + l]; }

inline void entry() {
  body();
  if (!cur->wg_open.empty() || !cur->wg_groups.empty()) fail("wgmma: a thread exited with wgmma not waited for");
  cur->done = true;
  --cta->live;
  swapcontext(&cur->ctx, &sched_ctx);
}

inline void start(Cta& c, Dim3 idx) {
  c.idx = idx;
  c.bar = Barrier{};
  c.warp_bars.assign((c.threads.size() + 31) / 32, Barrier{});
  c.slots.assign(c.threads.size(), Slots{});
  c.wg_bars.assign((c.threads.size() + 127) / 128, Barrier{});
  c.named_bars.assign(16, Barrier{});
  c.mbars.clear();
  c.live = (int)c.threads.size();
  c.started = ++events;
  c.ticket = 0;
  c.parked = false;
  c.saved.assign(smem_size, 0xFF);
  for (size_t i = 0; i < c.threads.size(); ++i) {
    Thread& t = c.threads[i];
    t.tid = {(unsigned)i, 0, 0};
    t.done = false;
    t.open.clear();
    t.groups.clear();
    t.fenced = 0;
    t.wg_open.clear();
    t.wg_groups.clear();
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.get();
    t.ctx.uc_stack.ss_size = STACK_BYTES;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, entry, 0);
  }
}

// Run `kernel` once per CTA of the grid, with `nthreads` threads each, as `schedule` says. With a
// `cluster` of more than one CTA, the CTAs of a cluster start together (rank order inside it,
// x fastest) and the scheduler orders, and keeps resident, whole clusters (at least one).
inline const char* launch(Dim3 grid, int nthreads, std::function<void()> kernel, Schedule schedule = {},
                          Dim3 cluster = {1, 1, 1}) {
  error = nullptr;
  const char* env = std::getenv("TXE_EAGER_COPIES");
  eager = env != nullptr && env[0] == '1';
  if (schedule.smem_bytes > sizeof(smem)) return "launch: more dynamic shared memory than the emulation has";
  if (grid.x % cluster.x || grid.y % cluster.y || grid.z % cluster.z) return "launch: grid not a multiple of the cluster";
  body = std::move(kernel);
  park = schedule.park;
  grid_dim = grid;
  smem_size = schedule.smem_bytes;
  const size_t csize = (size_t)cluster.x * cluster.y * cluster.z;
  std::vector<std::vector<Dim3>> order;  // clusters (single CTAs without one), each in rank order
  for (unsigned z = 0; z < grid.z; z += cluster.z)
    for (unsigned y = 0; y < grid.y; y += cluster.y)
      for (unsigned x = 0; x < grid.x; x += cluster.x) {
        order.emplace_back();
        for (unsigned cz = 0; cz < cluster.z; ++cz)
          for (unsigned cy = 0; cy < cluster.y; ++cy)
            for (unsigned cx = 0; cx < cluster.x; ++cx) order.back().push_back({x + cx, y + cy, z + cz});
      }
  if (schedule.order == 1) std::reverse(order.begin(), order.end());
  if (schedule.order == 2) std::shuffle(order.begin(), order.end(), std::mt19937(schedule.seed));
  std::mt19937 pick(schedule.seed);
  const size_t units = std::max<size_t>(1, std::min<size_t>(schedule.resident / csize, order.size()));
  std::vector<std::unique_ptr<Cta>> pool;
  std::vector<std::unique_ptr<Cluster>> clusters;
  std::vector<Cta*> active;
  size_t next = 0;
  auto start_unit = [&](Cluster* cl) {
    const std::vector<Dim3>& ctas = order[next++];
    cl->bar = Barrier{};
    cl->done = 0;
    for (size_t r = 0; r < csize; ++r) {
      start(*cl->members[r], ctas[r]);
      active.push_back(cl->members[r]);
    }
  };
  for (size_t i = 0; i < units && next < order.size(); ++i) {
    clusters.push_back(std::make_unique<Cluster>());
    for (size_t r = 0; r < csize; ++r) {
      pool.push_back(std::make_unique<Cta>());
      pool.back()->threads = std::vector<Thread>(nthreads);
      pool.back()->cluster = clusters.back().get();
      pool.back()->rank = (unsigned)r;
      clusters.back()->members.push_back(pool.back().get());
    }
    start_unit(clusters.back().get());
  }
  std::memset(smem, 0xFF, sizeof(smem));
  loaded = nullptr;
  size_t turn = 0;
  std::vector<size_t> runnable;
  while (!active.empty()) {
    runnable.clear();
    for (size_t j = 0; j < active.size(); ++j)
      if (!active[j]->parked) runnable.push_back(j);
    if (runnable.empty()) {  // every resident CTA is parked: the latest ticket goes on first
      size_t last = 0;
      for (size_t j = 1; j < active.size(); ++j)
        if (active[j]->ticket > active[last]->ticket) last = j;
      active[last]->parked = false;
      runnable.push_back(last);
    }
    const size_t i = runnable[schedule.seed != 0 ? pick() % runnable.size() : turn++ % runnable.size()];
    Cta* c = active[i];
    if (loaded != c) {
      if (loaded != nullptr) std::memcpy(loaded->saved.data(), smem, smem_size);
      std::memcpy(smem, c->saved.data(), smem_size);
      loaded = c;
    }
    cta = c;
    for (Thread& t : c->threads) {
      if (t.done) continue;
      cur = &t;
      swapcontext(&sched_ctx, &t.ctx);
    }
    if (c->live > 0) continue;
    static const std::vector<unsigned char> unwritten(sizeof(smem), 0xFF);
    if (std::memcmp(smem + smem_size, unwritten.data(), sizeof(smem) - smem_size) != 0) {
      fail("shared memory written past the launch's dynamic size");
      std::memset(smem + smem_size, 0xFF, sizeof(smem) - smem_size);
    }
    std::memcpy(c->saved.data(), smem, smem_size);  // what the cluster's other CTAs may still read
    loaded = nullptr;
    active.erase(active.begin() + (long)i);
    if (++c->cluster->done == (int)csize && next < order.size()) start_unit(c->cluster);
  }
  cur = nullptr;
  cta = nullptr;
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

inline void check_aligned(const void* p, size_t n, const char* what) {
  if ((uintptr_t)p % n != 0) fail(what);
}

}  // namespace txe

#define threadIdx (txe::cur->tid)
#define blockIdx (txe::cta->idx)
#define gridDim (txe::grid_dim)

struct alignas(16) float4 {
  float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(8) float2 {
  float x, y;
};
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct alignas(8) uint2 {
  unsigned x, y;
};
static inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

static inline float __int_as_float(int i) { return txe::from_bits((u32)i); }
static inline float __uint_as_float(u32 u) { return txe::from_bits(u); }
static inline u32 __float_as_uint(float f) { return txe::bits(f); }
static inline int __float_as_int(float f) { return (int)txe::bits(f); }
template <class T>
static inline T __ldg(const T* p) {
  txe::check_aligned(p, alignof(T), "__ldg: unaligned address");
  return *p;
}
// ld.global.cg: reads L2, where other CTAs' results are; after this CTA's ticket it must follow a
// __threadfence of the reading thread
template <class T>
static inline T __ldcg(const T* p) {
  txe::check_aligned(p, alignof(T), "__ldcg: unaligned address");
  if (txe::cta->ticket != 0 && txe::cur->fenced < txe::cta->ticket)
    txe::fail("__ldcg after the CTA's atomic ticket with no __threadfence of this thread in between");
  return *p;
}
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
using std::fmaf;
using std::fmaxf;

// threads that have exited no longer count (as on the GPU); the kernels exit only past their last barrier
static inline void __syncthreads() { txe::wait(txe::cta->bar, txe::cta->live); }
static inline void __syncwarp() { txe::warp_barrier(); }

static inline void __threadfence() {
  txe::cur->fenced = ++txe::events;
  txe::yield();
}

// Atomics on global memory: other CTAs may run just before and just after. A ticket publishes
// the thread's CTA's results, so a __threadfence of the thread must come first.
template <class T, class F>
static inline T tx_emu_atomic(T* p, F f) {
  txe::check_aligned(p, sizeof(T), "atomic: unaligned address");
  if (txe::cur->fenced <= txe::cta->started) txe::fail("atomic with no __threadfence of this thread before it");
  txe::yield();
  const T old = *p;
  *p = f(old);
  txe::cta->ticket = ++txe::events;
  if (txe::park) txe::cta->parked = true;
  txe::yield();
  return old;
}
static inline int atomicAdd(int* p, int v) {
  return tx_emu_atomic(p, [v](int old) { return (int)((unsigned)old + (unsigned)v); });
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return tx_emu_atomic(p, [v](unsigned old) { return old + v; });
}
static inline int atomicExch(int* p, int v) {
  return tx_emu_atomic(p, [v](int) { return v; });
}
static inline unsigned atomicExch(unsigned* p, unsigned v) {
  return tx_emu_atomic(p, [v](unsigned) { return v; });
}
static inline int atomicCAS(int* p, int compare, int v) {
  return tx_emu_atomic(p, [compare, v](int old) { return old == compare ? v : old; });
}

// common.cuh's relaxed work-counter add: other CTAs may run just before and after, and it is no
// ticket (no __threadfence is asked for, nothing later is constrained)
static inline int tx_atomic_add_relaxed(int* p, int v) {
  txe::check_aligned(p, sizeof(int), "atomic: unaligned address");
  txe::yield();
  const int old = *p;
  *p = (int)((unsigned)old + (unsigned)v);
  txe::yield();
  return old;
}

static inline float __shfl_xor_sync(unsigned, float v, int mask) {
  txe::my_slot().f[0] = v;
  txe::warp_barrier();
  const float r = txe::lane_slot(txe::lane() ^ mask).f[0];
  txe::warp_barrier();
  return r;
}

static inline int __shfl_sync(unsigned, int v, int src) {
  txe::my_slot().u[0] = (u32)v;
  txe::warp_barrier();
  const int r = (int)txe::lane_slot(src & 31).u[0];
  txe::warp_barrier();
  return r;
}

// ---- the PTX wrappers of common.cuh -------------------------------------------------------

TX_DEVICE u32 tx_smem_addr(const void* p) { return (u32)((const unsigned char*)p - smem); }

TX_DEVICE void tx_cp_async16(u32 dst, const void* src, int src_bytes) {
  if (dst % 16 != 0 || dst + 16 > txe::smem_size) return txe::fail("cp.async: bad shared address");
  if (src_bytes > 0 && ((uintptr_t)src % 16) != 0) return txe::fail("cp.async: unaligned global address");
  const txe::Copy c{dst, src, src_bytes};
  if (txe::eager) {
    txe::land(c);
  } else {
    txe::cur->open.push_back(c);
  }
}
// L2 hints (256-byte prefetch, cache policies) change nothing a kernel can observe: the plain copy
TX_DEVICE void tx_cp_async16_stream(u32 dst, const void* src, int src_bytes) { tx_cp_async16(dst, src, src_bytes); }
TX_DEVICE void tx_cp_async16_hint(u32 dst, const void* src, int src_bytes, unsigned long long) {
  tx_cp_async16(dst, src, src_bytes);
}
TX_DEVICE unsigned long long tx_l2_policy(bool evict_first) { return evict_first ? 1 : 0; }
TX_DEVICE void tx_ldg4(const int* p, int& a, int& b, int& c, int& d) {
  txe::check_aligned(p, 16, "ld.global.nc.v4: unaligned address");
  a = p[0], b = p[1], c = p[2], d = p[3];
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
  if (addr % 16 != 0 || addr + 16 > txe::smem_size) txe::fail("ldmatrix: bad row address");
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
// b1 = B[2t+8, 2t+9][g]; d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1]. `value` reads one
// 16-bit operand (the kernel's TX_BF16 type, or float16 for tx_mma_f16).
static inline void tx_emu_mma(float* d, const u32* a, u32 b0, u32 b1, float (*value)(u16)) {
  txe::Slots& me = txe::my_slot();
  for (int i = 0; i < 4; ++i) me.u[i] = a[i];
  me.u[4] = b0;
  me.u[5] = b1;
  txe::warp_barrier();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const txe::Slots& s = txe::lane_slot(l);
    const int g = l / 4, t = l % 4;
    auto lo = [value](u32 v) { return value((u16)(v & 0xffff)); };
    auto hi = [value](u32 v) { return value((u16)(v >> 16)); };
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
TX_DEVICE void tx_mma(float* d, const u32* a, u32 b0, u32 b1) { tx_emu_mma(d, a, b0, b1, tx_emu_half_to_float); }

TX_DEVICE u32 tx_pack2(float lo, float hi) {
  return (u32)tx_emu_float_to_half(lo) | ((u32)tx_emu_float_to_half(hi) << 16);
}

// float16 whatever TX_BF16 says (decode.cu's fp8 variants: P V in float16)
static inline float tx_f16_to_float(u16 h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}
TX_DEVICE u32 tx_pack2_f16(float lo, float hi) {
  auto one = [](float f) {
    _Float16 x = (_Float16)f;
    u16 h;
    std::memcpy(&h, &x, 2);
    return (u32)h;
  };
  return one(lo) | (one(hi) << 16);
}
TX_DEVICE void tx_mma_f16(float* d, const u32* a, u32 b0, u32 b1) { tx_emu_mma(d, a, b0, b1, tx_f16_to_float); }
TX_DEVICE float tx_to_float(u16 h) { return tx_emu_half_to_float(h); }
TX_DEVICE float tx_exp2(float x) { return std::exp2(x); }
TX_DEVICE float tx_log2(float x) { return std::log2(x); }
TX_DEVICE float tx_rcp(float x) { return 1.0f / x; }

// ---- Hopper: the PTX wrappers of kernels/prefill_sm90.cu -----------------------------------

TX_DEVICE void tx_trap() { txe::fail("trap"); }

namespace txe {

// the current CTA's mbarrier at `addr`
inline MBar& mbar(u32 addr) {
  MBar& b = cta->mbars[addr];
  if (!b.init) fail("mbarrier: used before mbarrier.init");
  return b;
}

// a phase completes when every arrival is in and no bulk-copy byte is outstanding
inline void mbar_try_complete(MBar& b) {
  if (b.pending == 0 && b.tx == 0) {
    b.phase ^= 1;
    b.pending = b.expected;
    b.arrived.clear();
  }
}

// a bulk copy lands: its bytes in shared memory (zeros where src is null: a tensor-map copy's
// elements outside the tensor), and off the barrier's transaction count
inline void bulk_land(MBar& b, const Copy& c) {
  if (c.src != nullptr) {
    std::memcpy(smem + c.dst, c.src, (size_t)c.bytes);
  } else {
    std::memset(smem + c.dst, 0, (size_t)c.bytes);
  }
  b.tx -= c.bytes;
  if (b.tx < 0) fail("mbarrier: bulk copies landed past the bytes expected (expect_tx)");
  mbar_try_complete(b);
}

// The kernels' protocol: a thread arrives at most once per phase (a second arrival would count
// towards a phase other threads have not finished, e.g. a warpgroup racing over skipped tiles).
inline void mbar_arrive(MBar& b, int thread) {
  if (b.pending <= 0) return fail("mbarrier: more arrivals than its count in one phase");
  for (int t : b.arrived) {
    if (t == thread) return fail("mbarrier: a thread arrived twice in one phase");
  }
  b.arrived.push_back(thread);
  --b.pending;
  mbar_try_complete(b);
}

// bulk copies land; the copies of pending cp.async arrivals land, then those arrivals count
inline void mbar_settle(MBar& b) {
  while (!b.bulk.empty()) {
    const Copy c = b.bulk.front();
    b.bulk.pop_front();
    bulk_land(b, c);
  }
  while (!b.async.empty()) {
    for (const Copy& c : b.async.front().second) land(c);
    const int thread = b.async.front().first;
    b.async.pop_front();
    mbar_arrive(b, thread);
  }
}

// d (+)= A * B for the 128 threads of a warpgroup: ops[t] is thread t's record of the same wgmma
inline u32 swizzle128(u32 addr) { return addr ^ (((addr >> 7) & 7) << 4); }

inline bool wg_f16 = false;  // the wgmma being run reads float16 operands (tx_wgmma_rs_t_f16)

inline float smem_elem(u32 addr) {
  if (addr + 2 > smem_size) {
    fail("wgmma: operand outside the launch's dynamic shared memory");
    return 0.f;
  }
  u16 h;
  std::memcpy(&h, smem + addr, 2);
  return wg_f16 ? tx_f16_to_float(h) : tx_emu_half_to_float(h);
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

inline float half_lo(u32 v) { return wg_f16 ? tx_f16_to_float((u16)(v & 0xffff)) : tx_emu_half_to_float((u16)(v & 0xffff)); }
inline float half_hi(u32 v) { return wg_f16 ? tx_f16_to_float((u16)(v >> 16)) : tx_emu_half_to_float((u16)(v >> 16)); }

inline void wgmma_run(const WgOp* ops) {
  const WgOp& op = ops[0];
  for (int t = 1; t < 128; ++t) {
    const WgOp& o = ops[t];
    if (o.n != op.n || (o.a == nullptr) != (op.a == nullptr) || o.desc_b != op.desc_b || o.trans_b != op.trans_b ||
        (op.a == nullptr && o.desc_a != op.desc_a) || o.scale_d != op.scale_d || o.f16 != op.f16)
      return fail("wgmma: the threads of a warpgroup issued different operations");
  }
  wg_f16 = op.f16 != 0;
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
  if (bar + 8 > txe::smem_size) return txe::fail("mbarrier: outside the launch's dynamic shared memory");
  txe::MBar& b = txe::cta->mbars[bar];
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
  if (count > (int)txe::cta->threads.size()) return txe::fail("bar.sync: count exceeds the CTA's threads");
  txe::wait(txe::cta->named_bars[id], count);
}
// bar.arrive: counts towards the barrier's completion without waiting (per thread here; the
// hardware counts a warp's threads at once, and the kernels arrive with whole warps)
TX_DEVICE void tx_bar_arrive(int id, int count) {
  if (id < 0 || id >= 16 || count % 32) return txe::fail("bar.arrive: bad barrier id or count");
  if (count > (int)txe::cta->threads.size()) return txe::fail("bar.arrive: count exceeds the CTA's threads");
  txe::Barrier& b = txe::cta->named_bars[id];
  if (++b.arrived == count) {
    b.arrived = 0;
    ++b.gen;
  }
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
  txe::cur->wg_open.push_back({N, d, nullptr, desc_a, desc_b, scale_d, 0, 0});
}
template <int N>
TX_DEVICE void tx_wgmma_ss_f16(float* d, u64 desc_a, u64 desc_b, int scale_d) {
  txe::cur->wg_open.push_back({N, d, nullptr, desc_a, desc_b, scale_d, 0, 1});
}
template <int N>
TX_DEVICE void tx_wgmma_rs_t(float* d, const u32* a, u64 desc_b, int scale_d) {
  txe::cur->wg_open.push_back({N, d, a, 0, desc_b, scale_d, 1, 0});
}
template <int N>
TX_DEVICE void tx_wgmma_rs_t_f16(float* d, const u32* a, u64 desc_b, int scale_d) {
  txe::cur->wg_open.push_back({N, d, a, 0, desc_b, scale_d, 1, 1});
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
  std::vector<txe::Thread>& threads = txe::cta->threads;
  if (128 * (size_t)wg + 128 > threads.size()) return txe::fail("wgmma: a warpgroup of fewer than 128 threads");
  txe::wait(txe::cta->wg_bars[wg], 128);
  if (txe::tid() % 128 == 0) {
    std::vector<txe::Thread*> members;
    for (int t = 0; t < 128; ++t) members.push_back(&threads[128 * wg + t]);
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
  txe::wait(txe::cta->wg_bars[wg], 128);
}

// Thread block clusters (kernels/gemm_sm90.cu): rank, barrier.cluster (every thread of every CTA of
// the cluster), and 16-byte reads of a cluster peer's shared memory, which must be in the launch's
// dynamic shared memory and whose CTA must not have exited.
TX_DEVICE u32 tx_cluster_rank() { return txe::cta->rank; }
TX_DEVICE void tx_cluster_sync() {
  txe::Cluster& cl = *txe::cta->cluster;
  txe::wait(cl.bar, (int)(cl.members.size() * txe::cta->threads.size()));
}
TX_DEVICE float4 tx_ld_cluster_f4(u32 addr, u32 rank) {
  txe::Cluster& cl = *txe::cta->cluster;
  float4 v{0.f, 0.f, 0.f, 0.f};
  if (rank >= cl.members.size()) return txe::fail("ld.shared::cluster: rank outside the cluster"), v;
  if (addr % 16 || addr + 16 > txe::smem_size) return txe::fail("ld.shared::cluster: unaligned or outside"), v;
  const txe::Cta* peer = cl.members[rank];
  if (peer->live == 0) return txe::fail("ld.shared::cluster: the peer CTA has exited"), v;
  const unsigned char* mem = peer == txe::loaded ? smem : peer->saved.data();
  std::memcpy(&v, mem + addr, 16);
  return v;
}

// Bulk copies (kernels/decode.cu with TX_BULK): expect_tx adds to the barrier's transaction count
// and arrives; a copy is queued on its barrier and lands when a thread waits on the barrier (or
// at once with TXE_EAGER_COPIES=1), whatever the order of the two.
TX_DEVICE void tx_mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  txe::MBar& b = txe::mbar(bar);
  b.tx += bytes;
  txe::mbar_arrive(b, txe::tid());
}
TX_DEVICE void tx_bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  txe::MBar& b = txe::mbar(bar);
  if (dst % 16 || bytes % 16 || (uintptr_t)src % 16) return txe::fail("cp.async.bulk: unaligned address or size");
  if (dst + bytes > txe::smem_size) return txe::fail("cp.async.bulk: outside the launch's dynamic shared memory");
  b.bulk.push_back({dst, src, (int)bytes});
  if (txe::eager) txe::mbar_settle(b);
}
TX_DEVICE void tx_bulk_copy_hint(u32 dst, const void* src, u32 bytes, u32 bar, u64) { tx_bulk_copy(dst, src, bytes, bar); }
// A tensor map as the emulation reads it (tests/emulator/emulate.py `tensor_map` writes it):
// opaque[0] the base address, [1] TXE_MAP_MAGIC << 8 | rank, [2..6] the dims and [11..15] the
// box (elements, innermost first), [7..10] the strides of dims 1 to 4 in bytes; 16-bit elements.
// The box lands in the 128-byte swizzle (rows of exactly 128 bytes: the swizzle span), one
// 16-byte copy per chunk, zeros for elements outside the tensor; all of the box's bytes count
// against the barrier.
namespace txe {
constexpr u64 MAP_MAGIC = 0x5458454d4150ull;
inline void tma_load(u32 dst, const void* map, const int* coords, int rank, u32 bar) {
  const u64* f = static_cast<const u64*>(map);  // the kernel's TxTensorMap
  if (f[1] >> 8 != MAP_MAGIC) return fail("tensor map: not one the emulation encoded");
  if ((int)(f[1] & 0xff) != rank) return fail("tensor map: copied with a rank other than the map's");
  long long dim[5] = {1, 1, 1, 1, 1}, box[5] = {1, 1, 1, 1, 1}, stride[5] = {2, 0, 0, 0, 0}, c[5] = {0, 0, 0, 0, 0};
  for (int i = 0; i < rank; ++i) {
    dim[i] = (long long)f[2 + i];
    box[i] = (long long)f[11 + i];
    if (i) stride[i] = (long long)f[7 + i - 1];
    c[i] = coords[i];
  }
  if (box[0] * 2 != 128) return fail("tensor map: the 128-byte swizzle needs 128-byte box rows");
  if (dst % 1024) return fail("tensor map copy: the 128-byte swizzle needs a 1024-byte aligned destination");
  const long long rows = box[1] * box[2] * box[3] * box[4];
  if (dst + rows * 128 > smem_size) return fail("tensor map copy: outside shared memory");
  MBar& b = mbar(bar);
  const unsigned char* base = reinterpret_cast<const unsigned char*>(f[0]);
  for (long long row = 0; row < rows; ++row) {  // box rows, dimension 1 fastest
    long long rest = row, off = 0;
    bool in = true;
    for (int i = 1; i < 5; ++i) {
      const long long x = c[i] + rest % box[i];
      rest /= box[i];
      in = in && x >= 0 && x < dim[i];
      off += x * stride[i];
    }
    const u32 at = dst + (u32)(row * 128);
    for (int j = 0; j < 8; ++j) {
      const u32 to = swizzle128(at + 16 * j);
      const long long x0 = c[0] + 8LL * j;
      if (!in || x0 >= dim[0] || x0 + 8 <= 0) {
        b.bulk.push_back({to, nullptr, 16});  // wholly outside: zeros
      } else if (x0 >= 0 && x0 + 8 <= dim[0]) {
        b.bulk.push_back({to, base + off + x0 * 2, 16});
      } else {  // a chunk across the tensor's edge, element by element
        for (int e = 0; e < 8; ++e) {
          const long long x = x0 + e;
          const bool inside = x >= 0 && x < dim[0];
          b.bulk.push_back({to + (u32)(2 * e), inside ? base + off + x * 2 : nullptr, 2});
        }
      }
    }
  }
  if (eager) mbar_settle(b);
}
}  // namespace txe
TX_DEVICE void tx_tma_load_3d(u32 dst, const void* map, int c0, int c1, int c2, u32 bar) {
  const int c[3] = {c0, c1, c2};
  txe::tma_load(dst, map, c, 3, bar);
}
TX_DEVICE void tx_tma_load_4d(u32 dst, const void* map, int c0, int c1, int c2, int c3, u32 bar) {
  const int c[4] = {c0, c1, c2, c3};
  txe::tma_load(dst, map, c, 4, bar);
}
TX_DEVICE void tx_tma_load_4d_hint(u32 dst, const void* map, int c0, int c1, int c2, int c3, u32 bar, u64) {
  tx_tma_load_4d(dst, map, c0, c1, c2, c3, bar);
}
TX_DEVICE void tx_st_shared_zero16(u32 dst) {
  if (dst % 16 || dst + 16 > txe::smem_size) return txe::fail("st.shared: unaligned or outside");
  std::memset(smem + dst, 0, 16);
}
