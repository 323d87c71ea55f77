// Skinny GEMM for Hopper (sm_90a) with warpgroup MMA: out[z, m, n] = a[z, m, k] @ W[z, n, k]^T
// (+ bias[n]), m <= 64. Same argument list as kernels/gemm.cu (the mma.sync kernel), so the plan
// launches either one; the workspace and counters are not used here.
//
// Why a second kernel: at m = 64 the mma.sync kernel's narrow column blocks re-read the whole
// [64 x k] a for every 32 or 64 columns of W (a is then half or more of every stage's bytes), its
// warps each re-load a's fragments from shared memory, and its split-k partial sums go through
// global memory to the one CTA per column block that adds them up (64 rows x the block's columns
// x splits, read by 128 threads: the launch's tail). Here one warpgroup multiplies the CTA's
// whole tile with one wgmma.m64nNk16 per 16 of k (N = TX_BW columns of W), a and W straight from
// shared memory, and the k splits of a column block are one thread block cluster whose CTAs add
// their partial tiles up through distributed shared memory, each CTA a slice of the columns.
//
// Grid: x = block of TX_BW output columns, y = split of k (TX_CLUSTER of them: the cluster),
// z = batch; 128 threads (one warpgroup). Each CTA streams its [TX_BW x k-range] slice of W
// exactly once and the matching [m x k-range] slice of a through a TX_STAGES-deep cp.async
// ring, TX_BK of k per stage. Tiles use the 128-byte swizzle wgmma's descriptors read (sm90.cuh:
// a tile of R rows and TX_BK columns is TX_BK / 64 column blocks of R x 128 bytes). Rows of a
// past m and rows of W past n are not loaded: they only feed accumulator rows and columns that
// are never stored. Chunks past the split's k range are zero-filled in both operands, so they
// add nothing (a split with no k at all adds zeros).
//
// Per k tile: wait for this thread's copies of the tile, make them visible to the async proxy,
// meet the warpgroup, issue the tile's TX_BK / 16 wgmmas as one group, then wait until at most
// that group is pending (the previous tile's wgmmas are complete, so its stage is free) and
// issue the copies of the tile TX_STAGES - 1 ahead into it.
//
// With TX_TMA (1: W, 2: W and a) those operands arrive through the tensor memory accelerator
// instead: thread 0 arms the stage's mbarrier with the tile's bytes and issues one 3-D tensor-map
// copy per 64 of k (a box of 64 k x TX_BW rows of W, or 64 x 64 of a) that lands already in the
// 128-byte swizzle; every thread waits on the mbarrier (parity: the tile's round of the ring).
// The maps (host: plugin.CudaNativeGemmPlan, `gemm_tensor_map`) are 3-D [batch][rows][k]; rows
// past n or m and k past k_ read as zeros. Splits start on multiples of TX_BK
// (gemm.gemm_wgmma_k_per_split), so a box never reaches into the next split's k.
//
// Epilogue: thread t of warp w holds rows 16 w + t / 4 and + 8, columns 8 j + 2 (t % 4) and + 1
// of the 64 x TX_BW tile. With one split it writes `out` (+ bias) from registers. With several,
// each CTA writes its fp32 partial tile into its own (now idle) ring, the cluster meets, and CTA
// r adds up columns [r, r + 1) x TX_BW / TX_CLUSTER of every CTA's tile in rank order (bitwise
// deterministic), adds the bias and writes `out`; the cluster meets again before any CTA exits,
// so no partial tile is read after its CTA is gone.
//
// Compile-time parameters: TX_BF16, TX_BW (64, 128, 256), TX_BK (64, 128), TX_STAGES (2..8),
// TX_CLUSTER (1, 2, 4, 8), TX_TMA (0, 1, 2), TX_SMEM (optional: the size the host computed,
// checked against the layout).
#include "common.cuh"

#ifndef TX_BW
#error "TX_BW must be defined"
#endif
#ifndef TX_CLUSTER
#define TX_CLUSTER 1
#endif
#ifndef TX_TMA
#define TX_TMA 0
#endif

constexpr int BW = TX_BW;
constexpr int BK = TX_BK;
constexpr int STAGES = TX_STAGES;
constexpr int NT = 128;
constexpr int KCH = BK / 8;               // 16-byte chunks per tile row
constexpr int A_BYTES = 64 * BK * 2;      // a tile: 64 rows (m, padded)
constexpr int W_BYTES = BW * BK * 2;      // W tile: BW rows (n)
constexpr int STAGE_BYTES = A_BYTES + W_BYTES;
constexpr int RING = STAGES * STAGE_BYTES;
constexpr int TMA = TX_TMA;                // 0: cp.async; 1: W through tensor maps; 2: W and a
constexpr int BARS = RING;                 // TMA: an mbarrier per stage ("the tile landed") after the ring
constexpr int SMEM = RING + (TMA ? 8 * STAGES : 0);  // the dynamic shared memory
constexpr int KCB = BK / 64;               // 64-wide column blocks (tensor-map boxes) per tile
constexpr int A_PASSES = 64 * KCH / NT, W_PASSES = BW * KCH / NT;
constexpr int CL = TX_CLUSTER;            // k splits: the CTAs of a cluster (grid y)
constexpr int COLS = BW / CL;             // columns of the tile each CTA of a cluster adds up
constexpr int PART_LD = BW + 4;           // floats per row of a partial tile (padded: no bank conflicts)

static_assert(BW == 64 || BW == 128 || BW == 256, "TX_BW must be 64, 128 or 256");
static_assert(BK == 64 || BK == 128, "TX_BK must be 64 or 128");
static_assert(STAGES >= 2 && STAGES <= 8, "2 to 8 stages");
static_assert(64 * KCH % NT == 0 && BW * KCH % NT == 0, "whole passes of 16-byte copies");
static_assert(CL == 1 || CL == 2 || CL == 4 || CL == 8, "TX_CLUSTER must be 1, 2, 4 or 8");
static_assert(64 * PART_LD * 4 <= RING, "the partial tile must fit in the ring");
static_assert(TMA >= 0 && TMA <= 2, "TX_TMA must be 0, 1 or 2");
#ifdef TX_SMEM  // the dynamic shared memory the plan launches with (gemm.GemmWgmmaParams.smem_bytes)
static_assert(SMEM == TX_SMEM, "GemmWgmmaParams.smem_bytes disagrees with this kernel's layout");
#endif

#include "sm90.cuh"

extern "C" __global__ void __cluster_dims__(1, CL, 1) __launch_bounds__(NT, 1)
    tactix_gemm(
#if TX_TMA
        // W as [batch][n][k], boxes of 64 (k) x TX_BW rows; with TX_TMA 2 also a as [batch][m][k],
        // boxes of 64 x 64 (the map of TX_TMA 1 is not read)
        const __grid_constant__ TxTensorMap wmap, const __grid_constant__ TxTensorMap amap,
#endif
        const u16* __restrict__ a, i64 lda, i64 a_sb, const u16* __restrict__ b, i64 ldb, i64 b_sb,
                u16* __restrict__ out, i64 o_sb, const u16* __restrict__ bias, float* __restrict__ ws,
                int* __restrict__ counters, i64 m_, i64 n_, i64 k_, i64 kps) {
  extern __shared__ __align__(1024) unsigned char smem[];  // [stages: a tile, W tile]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m = (int)m_, n = (int)n_;
  const int n0 = blockIdx.x * BW;
  const int split = blockIdx.y, z = blockIdx.z;
  const i64 kbeg = (i64)split * kps;
  const i64 kend = kbeg + kps < k_ ? kbeg + kps : k_;
  const int ntiles = kend > kbeg ? (int)((kend - kbeg + BK - 1) / BK) : 0;
  const u16* az = a + z * a_sb;
  const u16* bz = b + z * b_sb;
  const u32 sbase = tx_smem_addr(smem);
#if TX_TMA
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) tx_mbar_init(sbase + BARS + 8 * s, 1);
    tx_mbar_init_fence();
  }
  __syncthreads();
#endif

  // Copy c of a tile: row c / KCH, 16-byte chunk c % KCH of the row.
  auto issue = [&](int tile) {
    if (tile < ntiles) {
      const u32 sa = sbase + (tile % STAGES) * STAGE_BYTES, sw = sa + A_BYTES;
      const i64 kt = kbeg + (i64)tile * BK;
#if TX_TMA
      if (tid == 0) {
        const u32 bar = sbase + BARS + 8 * (tile % STAGES);
        tx_mbar_arrive_expect_tx(bar, TMA == 2 ? W_BYTES + A_BYTES : W_BYTES);
#pragma unroll
        for (int cb = 0; cb < KCB; ++cb) tx_tma_load_3d(sw + cb * BW * 128, &wmap, (int)kt + 64 * cb, n0, z, bar);
#if TX_TMA == 2
#pragma unroll
        for (int cb = 0; cb < KCB; ++cb) tx_tma_load_3d(sa + cb * 64 * 128, &amap, (int)kt + 64 * cb, 0, z, bar);
#endif
      }
#else
#pragma unroll
      for (int p = 0; p < W_PASSES; ++p) {
        const int c = tid + p * NT;
        const int row = c / KCH, ch = c % KCH;
        const i64 kk = kt + ch * 8;
        if (n0 + row < n) {
          const bool ok = kk < kend;
          tx_cp_async16_stream(sw + sw128(row, ch, BW),
                               ok ? (const void*)(bz + (i64)(n0 + row) * ldb + kk) : (const void*)bz, ok ? 16 : 0);
        }
      }
#endif
#if TX_TMA != 2
#pragma unroll
      for (int p = 0; p < A_PASSES; ++p) {
        const int c = tid + p * NT;
        const int row = c / KCH, ch = c % KCH;
        const i64 kk = kt + ch * 8;
        if (row < m) {
          const bool ok = kk < kend;
          tx_cp_async16(sa + sw128(row, ch, 64), ok ? (const void*)(az + row * lda + kk) : (const void*)az,
                        ok ? 16 : 0);
        }
      }
#endif
    }
    tx_cp_async_commit();
  };

#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) issue(t);

  float acc[BW / 2];
#pragma unroll
  for (int j = 0; j < BW / 2; ++j) acc[j] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    tx_cp_async_wait<STAGES - 2>();  // this thread's copies of tile i have landed
    tx_fence_proxy_async();          // ... and are visible to the wgmma (async proxy) reads
#if TX_TMA
    tx_mbar_wait(sbase + BARS + 8 * (i % STAGES), (u32)(i / STAGES) & 1);  // tile i's tensor-map copies
#endif
    tx_bar_sync(0, NT);              // every thread's copies of tile i
    const u32 sa = sbase + (i % STAGES) * STAGE_BYTES, sw = sa + A_BYTES;
#pragma unroll
    for (int j = 0; j < BW / 2; ++j) tx_reg_fence(acc[j]);
    tx_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      tx_wgmma_ss<BW>(acc, desc_k_major(sa + (kk >> 2) * (64 * 128) + (kk & 3) * 32),
                      desc_k_major(sw + (kk >> 2) * (BW * 128) + (kk & 3) * 32), 1);
    }
    tx_wgmma_commit();
    tx_wgmma_wait<1>();  // tile i - 1's wgmmas are complete: its stage takes tile i + STAGES - 1
#pragma unroll
    for (int j = 0; j < BW / 2; ++j) tx_reg_fence(acc[j]);
    issue(i + STAGES - 1);
  }
  tx_wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < BW / 2; ++j) tx_reg_fence(acc[j]);
  tx_cp_async_wait<0>();  // the ring's trailing (empty) groups

  const int r0 = 16 * warp + (lane >> 2), c0 = 2 * (lane & 3);
  if constexpr (CL == 1) {  // the whole k range: out (+ bias) from the accumulators
    const bool out_pairs = (n & 1) == 0 && ((u64)out & 3) == 0;  // 4-byte stores of column pairs
#pragma unroll
    for (int j = 0; j < BW / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = r0 + 8 * h, col = n0 + 8 * j + c0;
        if (row >= m || col >= n) continue;
        float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        const bool two = col + 1 < n;
        if (bias != nullptr) {
          v0 += tx_to_float(bias[col]);
          if (two) v1 += tx_to_float(bias[col + 1]);
        }
        u16* o = out + z * o_sb + (i64)row * n + col;
        const u32 packed = tx_pack2(v0, v1);
        if (two && out_pairs) {
          *reinterpret_cast<u32*>(o) = packed;
        } else {
          o[0] = (u16)(packed & 0xffffu);
          if (two) o[1] = (u16)(packed >> 16);
        }
      }
    }
    return;
  } else {
    // ---- split k across the cluster: partial tiles meet in distributed shared memory ----------
    __syncthreads();  // the ring is idle (every wgmma waited for, every copy landed): reuse it
    float* part = reinterpret_cast<float*>(smem);  // [64][PART_LD] fp32
#pragma unroll
    for (int j = 0; j < BW / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<float2*>(part + (r0 + 8 * h) * PART_LD + 8 * j + c0) =
            make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
    tx_cluster_sync();  // every CTA's partial tile is in its shared memory
    // CTA `rank` adds up columns [rank * COLS, rank * COLS + COLS) of the tile over the cluster's
    // CTAs in rank order (= split order: bitwise deterministic), four columns per thread.
    const u32 rank = tx_cluster_rank();
    const bool quads = (n & 3) == 0 && ((u64)out & 7) == 0;  // 8-byte stores of column quads
    for (int e = tid; e < m * (COLS / 4); e += NT) {
      const int row = e / (COLS / 4), col = (int)rank * COLS + (e % (COLS / 4)) * 4;
      const int j = n0 + col;
      if (j >= n) continue;
      const u32 addr = sbase + (u32)(row * PART_LD + col) * 4;
      float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < CL; ++r) {
        const float4 x = tx_ld_cluster_f4(addr, (u32)r);
        v[0] += x.x;
        v[1] += x.y;
        v[2] += x.z;
        v[3] += x.w;
      }
      if (bias != nullptr) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (j + c < n) v[c] += tx_to_float(bias[j + c]);
        }
      }
      u16* o = out + z * o_sb + (i64)row * n + j;
      const u32 lo = tx_pack2(v[0], v[1]), hi = tx_pack2(v[2], v[3]);
      if (quads) {  // j and n are multiples of 4
        *reinterpret_cast<uint2*>(o) = make_uint2(lo, hi);
      } else {
        const u16 h4[4] = {(u16)(lo & 0xffffu), (u16)(lo >> 16), (u16)(hi & 0xffffu), (u16)(hi >> 16)};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (j + c < n) o[c] = h4[c];
        }
      }
    }
    tx_cluster_sync();  // the other CTAs are done reading this one's partial tile
  }
}
