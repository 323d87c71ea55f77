// Skinny GEMM (m <= 64): out[z, m, n] = a[z, m, k] @ W[z, n, k]^T (+ bias[n]), where W is the
// k-major b operand (the nn.Linear [n, k] weight that b = W.t() views).
//
// Grid: x = block of TX_BN output columns, y = split of k, z = batch. Each CTA streams its
// [TX_BN x k-range] slice of W exactly once (cp.async ring of TX_STAGES stages, TX_BK of k per
// stage, swizzled shared memory) together with the matching [m x k-range] slice of a (small,
// served from L2), and multiplies on the tensor cores (mma.sync m16n8k16, the m rows padded to
// 16 * TX_MT). Warps split the tile TX_WN ways along n and TX_WK ways along k; their partial
// sums meet in shared memory. With one split the CTA writes `out` (+ bias). With several, each
// CTA writes its fp32 partial tile to the workspace and takes a ticket from its column block's
// counter; the CTA with the last ticket adds the partials up in split order (bitwise
// deterministic), writes `out` (+ bias) and resets the counter to zero for the next launch.
//
// Compile-time parameters: TX_BF16, TX_MT, TX_BN, TX_BK, TX_WN, TX_WK, TX_STAGES,
// TX_L2_PREFETCH_256 (1: W read in 256-byte L2 blocks). No L2 cache policy for W: ptxas
// miscompiles this kernel's cp.async with one for some shapes (see tx_cp_async16_hint);
// TX_W_POLICY = 1 brings the evict_first policy back, for the test that checks the SASS for
// that miscompile and for trying a newer ptxas (the plugin never sets it).
#include "common.cuh"

#ifndef TX_MT
#error "TX_MT must be defined"
#endif

#ifndef TX_W_POLICY
#define TX_W_POLICY 0
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
constexpr int A_CHUNKS = AROWS * KCH, B_CHUNKS = BN * KCH;  // 16-byte chunks per stage
constexpr int A_PASSES = (A_CHUNKS + NT - 1) / NT, B_PASSES = (B_CHUNKS + NT - 1) / NT;

static_assert(MT >= 1 && MT <= 4, "TX_MT in 1..4");
static_assert(BK == 64 || BK == 128, "TX_BK must be 64 or 128");
static_assert(WCOLS % 16 == 0, "each warp takes a multiple of 16 columns");
static_assert((BK / 16) % WK == 0, "k16 steps of a stage divide among the k warps");
static_assert(STAGES >= 2, "at least two stages");
static_assert(WK * AROWS * BN * 4 <= STAGES * STAGE_BYTES, "warp reduction buffer must fit in the stage area");

extern "C" __global__ void __launch_bounds__(NT)
    tactix_gemm(const u16* __restrict__ a, i64 lda, i64 a_sb, const u16* __restrict__ b, i64 ldb, i64 b_sb,
                u16* __restrict__ out, i64 o_sb, const u16* __restrict__ bias, float* __restrict__ ws,
                int* __restrict__ counters, i64 m_, i64 n_, i64 k_, i64 kps) {
  extern __shared__ __align__(128) unsigned char smem[];  // [stages: a tile, W tile] [flag: 4 ints]
  int& last_flag = *reinterpret_cast<int*>(smem + STAGES * STAGE_BYTES);
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
#if TX_W_POLICY
  const u64 policy = tx_l2_policy(true);
#endif

  // Chunk c of a stage: row c / KCH, 16-byte column c % KCH. Chunks past k are zero-filled (in
  // both operands, so they add nothing); rows past m (a) or n (W) are left as they are: they
  // only feed output rows or columns that are never stored.
  auto issue = [&](int tile) {
    if (tile < ntiles) {
      const u32 sa = sbase + (tile % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
      const i64 kt = kbeg + (i64)tile * BK;
#pragma unroll
      for (int p = 0; p < A_PASSES; ++p) {
        const int c = tid + p * NT;
        const int row = c / KCH, ch = c % KCH;
        const i64 kk = kt + ch * 8;
        if ((A_CHUNKS % NT == 0 || c < A_CHUNKS) && row < m) {
          const bool ok = kk < kend;
          tx_cp_async16(sa + tx_swz(row, ch, ROWB), ok ? (const void*)(az + row * lda + kk) : (const void*)az,
                        ok ? 16 : 0);
        }
      }
#pragma unroll
      for (int p = 0; p < B_PASSES; ++p) {
        const int c = tid + p * NT;
        const int row = c / KCH, ch = c % KCH;
        const i64 kk = kt + ch * 8;
        if ((B_CHUNKS % NT == 0 || c < B_CHUNKS) && n0 + row < n) {
          const bool ok = kk < kend;
#if TX_W_POLICY
          tx_cp_async16_hint(sb + tx_swz(row, ch, ROWB),
                             ok ? (const void*)(bz + (i64)(n0 + row) * ldb + kk) : (const void*)bz, ok ? 16 : 0,
                             policy);
#else
          tx_cp_async16_stream(sb + tx_swz(row, ch, ROWB),
                               ok ? (const void*)(bz + (i64)(n0 + row) * ldb + kk) : (const void*)bz, ok ? 16 : 0);
#endif
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
  const int splits = gridDim.y;
  for (int e = tid; e < m * BN; e += NT) {
    const int row = e / BN, col = e % BN;
    const int j = n0 + col;
    if (j >= n) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WK; ++w) v += red[(w * AROWS + row) * BN + col];
    if (splits == 1) {
      if (bias != nullptr) v += tx_to_float(bias[j]);
      out[z * o_sb + (i64)row * n + j] = (u16)(tx_pack2(v, 0.f) & 0xffffu);
    } else {
      ws[(((i64)split * gridDim.z + z) * m + row) * n + j] = v;
    }
  }
  if (splits == 1) return;

  // ---- split k: the CTA with the last ticket of this column block adds the partials up ------
  __threadfence();  // this CTA's partial is visible device-wide before its ticket is taken
  __syncthreads();
  int* counter = counters + (i64)z * gridDim.x + blockIdx.x;
  if (tid == 0) last_flag = atomicAdd(counter, 1) == splits - 1;
  __syncthreads();
  if (!last_flag) return;
  __threadfence();  // the other splits' partials (their tickets came before ours)
  // Each thread adds up 4 adjacent columns of a row (one 16-byte ld.global.cg per split where n
  // is a multiple of 4); the passes over the tile have a compile-time count, so the loads of
  // several passes and splits are in flight together.
  const i64 split_stride = (i64)gridDim.z * m * n;
  const float* base = ws + (i64)z * m * n;
  const bool vec = (n & 3) == 0;
  constexpr int QUADS = AROWS * BN / 4, QPASSES = (QUADS + NT - 1) / NT;
#pragma unroll
  for (int qp = 0; qp < QPASSES; ++qp) {
    const int qd = tid + qp * NT;
    const int row = qd / (BN / 4), col = (qd % (BN / 4)) * 4;
    const int j = n0 + col;
    if ((QUADS % NT != 0 && qd >= QUADS) || row >= m || j >= n) continue;
    const float* p = base + (i64)row * n + j;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (vec) {  // j and n are multiples of 4: the quad is whole and 16-byte aligned
#pragma unroll 4
      for (int s = 0; s < splits; ++s) {
        const float4 x = __ldcg(reinterpret_cast<const float4*>(p + s * split_stride));
        v[0] += x.x;
        v[1] += x.y;
        v[2] += x.z;
        v[3] += x.w;
      }
    } else {
#pragma unroll 4
      for (int s = 0; s < splits; ++s) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (j + c < n) v[c] += __ldcg(p + s * split_stride + c);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (j + c >= n) break;
      float r = v[c];
      if (bias != nullptr) r += tx_to_float(bias[j + c]);
      out[z * o_sb + (i64)row * n + j + c] = (u16)(tx_pack2(r, 0.f) & 0xffffu);
    }
  }
  if (tid == 0) *counter = 0;  // every ticket of this launch is drawn: ready for the next one
}
