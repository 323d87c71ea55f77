// Skinny GEMM (m <= 64): out[z, m, n] = a[z, m, k] @ W[z, n, k]^T (+ bias[n]), where W is the
// k-major b operand (the nn.Linear [n, k] weight that b = W.t() views).
//
// Grid: x = block of TX_BN output columns, y = split of k, z = batch. Each CTA streams its
// [TX_BN x k-range] slice of W exactly once (cp.async ring of TX_STAGES stages, TX_BK of k per
// stage, swizzled shared memory) together with the matching [m x k-range] slice of a (small,
// served from L2), and multiplies on the tensor cores (mma.sync m16n8k16, the m rows padded to
// 16 * TX_MT). Warps split the tile TX_WN ways along n and TX_WK ways along k; their partial
// sums meet in shared memory. With one split the CTA writes `out` (+ bias); with several it
// writes fp32 partial sums and `tactix_gemm_reduce` adds them up.
//
// Compile-time parameters: TX_BF16, TX_MT, TX_BN, TX_BK, TX_WN, TX_WK, TX_STAGES.
#include "common.cuh"

#ifndef TX_MT
#error "TX_MT must be defined"
#endif

constexpr int MT = TX_MT;
constexpr int BN = TX_BN;
constexpr int BK = TX_BK;
constexpr int WN = TX_WN;
constexpr int WK = TX_WK;
constexpr int STAGES = TX_STAGES;
constexpr int NT = WN * WK * 32;
constexpr int AROWS = MT * 16;
constexpr int KCH = BK / 8;  // 16-byte chunks per row of a stage
constexpr int ROWB = BK * 2;
constexpr int A_BYTES = AROWS * ROWB;
constexpr int B_BYTES = BN * ROWB;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int WCOLS = BN / WN;
constexpr int NTL = WCOLS / 8;
constexpr int KSTEPS = BK / 16 / WK;

static_assert(MT >= 1 && MT <= 4, "TX_MT in 1..4");
static_assert(BK == 64 || BK == 128, "TX_BK must be 64 or 128");
static_assert(WCOLS % 16 == 0, "each warp takes a multiple of 16 columns");
static_assert((BK / 16) % WK == 0, "k16 steps of a stage divide among the k warps");
static_assert(STAGES >= 2, "at least two stages");
static_assert(WK * AROWS * BN * 4 <= STAGES * STAGE_BYTES, "warp reduction buffer must fit in the stage area");

extern "C" __global__ void __launch_bounds__(NT)
    tactix_gemm(const u16* __restrict__ a, i64 lda, i64 a_sb, const u16* __restrict__ b, i64 ldb, i64 b_sb,
                u16* __restrict__ out, i64 o_sb, const u16* __restrict__ bias, float* __restrict__ ws, i64 m_, i64 n_,
                i64 k_, i64 kps) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int wn = warp % WN, wk = warp / WN;
  const int m = (int)m_, n = (int)n_;
  const int n0 = blockIdx.x * BN;
  const int split = blockIdx.y, z = blockIdx.z;
  const i64 kbeg = (i64)split * kps;
  const i64 kend = kbeg + kps < k_ ? kbeg + kps : k_;
  const int ntiles = kend > kbeg ? (int)((kend - kbeg + BK - 1) / BK) : 0;
  const u16* az = a + z * a_sb;
  const u16* bz = b + z * b_sb;
  const u32 sbase = tx_smem_addr(smem);

  auto issue = [&](int tile) {
    if (tile < ntiles) {
      const u32 sa = sbase + (tile % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
      const i64 kt = kbeg + (i64)tile * BK;
#pragma unroll
      for (int c = tid; c < AROWS * KCH; c += NT) {
        const int row = c / KCH, ch = c % KCH;
        const i64 kk = kt + ch * 8;
        if (row < m) {  // rows past m only feed output rows that are never stored
          const bool ok = kk < kend;
          tx_cp_async16(sa + tx_swz(row, ch, ROWB), ok ? (const void*)(az + row * lda + kk) : (const void*)az,
                        ok ? 16 : 0);
        }
      }
#pragma unroll
      for (int c = tid; c < BN * KCH; c += NT) {
        const int row = c / KCH, ch = c % KCH;
        const i64 kk = kt + ch * 8;
        if (n0 + row < n) {  // columns past n likewise
          const bool ok = kk < kend;
          tx_cp_async16(sb + tx_swz(row, ch, ROWB), ok ? (const void*)(bz + (i64)(n0 + row) * ldb + kk) : (const void*)bz,
                        ok ? 16 : 0);
        }
      }
    }
    tx_cp_async_commit();
  };

#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) issue(t);

  float acc[MT][NTL][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NTL; ++t) acc[mt][t][0] = acc[mt][t][1] = acc[mt][t][2] = acc[mt][t][3] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    tx_cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue(i + STAGES - 1);
    const u32 sa = sbase + (i % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int kk = wk * KSTEPS + ks;
      u32 af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row = mt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int ch = kk * 2 + (lane >> 4);
        tx_ldmatrix_x4(sa + tx_swz(row, ch, ROWB), af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
      }
#pragma unroll
      for (int np = 0; np < NTL / 2; ++np) {
        const int row = wn * WCOLS + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int ch = kk * 2 + ((lane >> 3) & 1);
        u32 b0, b1, b2, b3;
        tx_ldmatrix_x4(sb + tx_swz(row, ch, ROWB), b0, b1, b2, b3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          tx_mma(acc[mt][2 * np], af[mt], b0, b1);
          tx_mma(acc[mt][2 * np + 1], af[mt], b2, b3);
        }
      }
    }
  }

  tx_cp_async_wait<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [WK][AROWS][BN]
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NTL; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = mt * 16 + grp + ((c >> 1) << 3);
        const int col = wn * WCOLS + t * 8 + tig * 2 + (c & 1);
        red[(wk * AROWS + row) * BN + col] = acc[mt][t][c];
      }
  __syncthreads();
  for (int e = tid; e < m * BN; e += NT) {
    const int row = e / BN, col = e % BN;
    const int j = n0 + col;
    if (j >= n) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WK; ++w) v += red[(w * AROWS + row) * BN + col];
    if (ws == nullptr) {
      if (bias != nullptr) v += tx_to_float(bias[j]);
      out[z * o_sb + (i64)row * n + j] = (u16)(tx_pack2(v, 0.f) & 0xffffu);
    } else {
      ws[(((i64)split * gridDim.z + z) * m + row) * n + j] = v;
    }
  }
}

// out[i] = sum over splits of ws[s, i] (+ bias[i % n]), i over batch * m * n.
extern "C" __global__ void __launch_bounds__(256)
    tactix_gemm_reduce(const float* __restrict__ ws, const u16* __restrict__ bias, u16* __restrict__ out,
                       i64 splits, i64 total, i64 n) {
  const i64 i = (i64)blockIdx.x * 256 + threadIdx.x;
  if (i >= total) return;
  float v = 0.f;
  for (i64 s = 0; s < splits; ++s) v += __ldg(ws + s * total + i);
  if (bias != nullptr) v += tx_to_float(bias[i % n]);
  out[i] = (u16)(tx_pack2(v, 0.f) & 0xffffu);
}
