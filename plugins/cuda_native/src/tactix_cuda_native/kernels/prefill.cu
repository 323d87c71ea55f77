// Paged prefill attention: ragged query rows over a paged K/V cache (FA2-style, mma.sync).
//
// Work item = (request, first query token of a q tile); grid x = item x head group, heads
// fastest, so the CTAs of one item (and the query heads sharing a KV head) are dispatched
// together; where one request's keys and values over every head outgrow L2, the head groups go
// in sections of `head_section`, each section's items before the next's (common.cuh,
// tx_item_head). Items are planned on the host, longest first (see prefill.prefill_work); in
// CUDA-graph mode the grid is the capacity and CTAs past `num_items` exit at once.
//
// A CTA owns TX_QTILE query rows. Row r is (token t0 + r / pack, query head head0 + r % pack):
// pack = 1 gives TX_QTILE tokens of one head; pack = g packs g heads of one GQA group (which
// share their KV head), so a short request fills the tile with heads instead of padding. Warp
// w owns rows [w * 16 * MT, (w + 1) * 16 * MT) as MT m16 tiles.
//
// The CTA walks its key range [kv_lo, kv_hi) (the union of its rows' causal/window ranges) in
// tiles of TX_KVTILE keys: K and V rows are gathered through the page table with cp.async into a
// TX_STAGES-deep ring of XOR-swizzled shared-memory tiles (page offsets of a tile are looked up
// one tile ahead, by one thread per key, into shared memory). Per tile each warp computes
// S = Q K^T (ldmatrix + mma.sync m16n8k16, fp32), applies the soft-cap, masks only when the
// tile crosses one of its rows' bounds (diagonal / window edge / end of kv), skips the tile
// altogether when it lies outside all of its rows' ranges, runs the online softmax in fp32
// registers (base-2 exponentials, the scale folded into one FMA), and accumulates O += P V
// with P rounded to 16 bits. Epilogue: O / l staged through the warp's own Q rows in shared
// memory and written with 16-byte stores; LSE (natural log) per row. Every output element is
// computed by one CTA in a fixed order: bitwise deterministic, no atomics.
//
// TX_MASK (1): a custom mask decides which keys each row attends, besides the window (causal is
// off): `mask` holds one byte per (query token, key) of each request, row-major from the element
// `mask_off[req]` on (FlashInfer's flat layout; the plan unpacks bit-packed masks), read straight
// from global memory (L1/L2 serve the reuse across heads) for every tile, whose rows are then all
// masked. A row that attends no key at all gets zeros and an LSE of -inf.
//
// Dequantization scales (every variant, as in prefill_sm90.cu and decode.cu): logits
// (q . k) k_scale sm_scale (k_scale folded into the base-2 scale, so the soft cap and the LSE see
// the scaled logits), output (sum p v) / l * v_scale; each scale a float argument or, where its
// pointer is not null, the float32 at that address (a CUDA graph replays with whatever it holds).
// Attention sinks (`sinks` not null: a float32 logit per query head, in the units of the scaled and
// soft-capped logits): folded into each row's (max, sum) in the epilogue, where a warp holds its
// rows' whole key range; the LSE includes it (a row the mask empties: zeros, the LSE the sink).
// TX_KV_FP8 (1: e4m3fn, 2: e5m2): an fp8 KV cache under 16-bit q and out. The ring holds the
// fp8 rows as copied (16-byte chunks, unswizzled); once a tile has landed the CTA's threads
// convert it exactly (fp8.cuh) into one pair of 16-bit K and V tiles after the ring, swizzled
// as the 16-bit path's, and a barrier later the mma.sync code reads those, as it reads the ring
// otherwise.
//
// TX_DQK / TX_DVO (default TX_D): a problem whose q/k and v/o head dims differ (DeepSeek's
// 192/128) or are not a kernel dim runs the kernel of the next dim D >= both: Q, K and V rows are
// copied up to their own dims and zero-filled to D (cp.async with no source bytes), so S = Q K^T
// over D columns is the DQK-column product and P V's columns past DVO are zeros, never written.
//
// Compile-time parameters: TX_BF16, TX_D (64, 128, 256), TX_DQK, TX_DVO, TX_QTILE, TX_KVTILE,
// TX_WARPS, TX_STAGES, TX_MASK, TX_KV_FP8, TX_FP8_CVT (see fp8.cuh).
#include "common.cuh"
#include "fp8.cuh"

#ifndef TX_D
#error "TX_D must be defined"
#endif
#ifndef TX_QTILE
#define TX_QTILE 128
#endif
#ifndef TX_KVTILE
#define TX_KVTILE 64
#endif
#ifndef TX_WARPS
#define TX_WARPS 4
#endif
#ifndef TX_STAGES
#define TX_STAGES 2
#endif
#ifndef TX_MIN_CTAS
#define TX_MIN_CTAS 1
#endif
#ifndef TX_MASK
#define TX_MASK 0
#endif
#ifndef TX_DQK
#define TX_DQK TX_D
#endif
#ifndef TX_DVO
#define TX_DVO TX_D
#endif

constexpr int D = TX_D;      // the kernel's head dim: Q, K and V rows in shared memory, O columns
constexpr int DQK = TX_DQK;  // the problem's q/k head dim (<= D: the rest of each row is zeros)
constexpr int DVO = TX_DVO;  // the problem's v/out head dim (<= D: the rest is zeros, never written)
constexpr int BQ = TX_QTILE;
constexpr int BK = TX_KVTILE;
constexpr int WARPS = TX_WARPS;
constexpr int STAGES = TX_STAGES;
constexpr int MIN_CTAS = TX_MIN_CTAS;  // CTAs per SM the register allocation must allow
constexpr int NT = WARPS * 32;
constexpr int MT = BQ / (16 * WARPS);  // m16 tiles per warp
constexpr int WROWS = 16 * MT;         // query rows per warp
constexpr int NNT = BK / 8;            // n8 tiles of S per m tile
constexpr int NKS = BK / 16;           // k16 steps of P V
constexpr int DCH = D / 8;             // 16-byte chunks per row
constexpr int ROW_BYTES = D * 2;
constexpr int Q_BYTES = BQ * ROW_BYTES;
constexpr int TILE_BYTES = BK * ROW_BYTES;              // a 16-bit K (or V) tile: what ldmatrix reads
constexpr bool FP8 = TX_KV_FP8 != 0;
constexpr int KV_ROW_BYTES = FP8 ? D : ROW_BYTES;         // a cache row
constexpr int KCH = KV_ROW_BYTES / 16;                    // 16-byte chunks per cache row
constexpr int CH_ELEMS = 16 / (int)sizeof(kv_t);          // cache elements per chunk
constexpr int RING_TILE_BYTES = BK * KV_ROW_BYTES;        // a K (or V) tile as copied
constexpr int STAGE_BYTES = 2 * RING_TILE_BYTES;
constexpr int CONV_BYTES = FP8 ? 2 * TILE_BYTES : 0;      // fp8: the converted K and V tiles, after the ring
constexpr int KV_AREA = STAGES * STAGE_BYTES + CONV_BYTES;
constexpr bool Q_IN_REGS = D * MT <= 128;
constexpr int QKK = Q_IN_REGS ? D / 16 : 1;  // Q fragments held in registers
constexpr int QMT = Q_IN_REGS ? MT : 1;
constexpr float LN2 = 0.6931471805599453f;
constexpr float LOG2E = 1.4426950408889634f;
constexpr int NO_LOWER = -(1 << 30);
constexpr int LD_STEP = NT / KCH;                      // rows between one thread's chunks of a tile
constexpr int LD_ITERS = (BK + LD_STEP - 1) / LD_STEP;  // chunks per thread per K (or V) tile
constexpr bool LD_EXACT = BK % LD_STEP == 0;
constexpr bool LD_SAME_SWZ = LD_STEP % 8 == 0;

// Swizzled byte offset of 16-byte chunk `even + b` (even a compile-time even number, b = 0 or 1)
// of a row whose `row & 7` and b combine into c = b ^ (row & 7): the XOR only touches the low
// three bits, so per thread this is a constant XOR with c, never a table of hoisted offsets.
TX_DEVICE u32 chunk_off(int even, int c) { return (u32)(((even & ~7) + ((even & 7) ^ c)) << 4); }

static_assert(D == 64 || D == 128 || D == 256, "head dim must be 64, 128 or 256");
static_assert(DQK % 16 == 0 && DVO % 16 == 0 && DQK <= D && DVO <= D, "q/k and v/o dims: multiples of 16 up to D");
static_assert(WARPS == 2 || WARPS == 4 || WARPS == 8, "2, 4 or 8 warps");
static_assert(BQ % (16 * WARPS) == 0 && (MT == 1 || MT == 2), "TX_QTILE must be 16 or 32 rows per warp");
static_assert(BK == 32 || BK == 64 || BK == 128, "TX_KVTILE must be 32, 64 or 128");
static_assert(BK <= NT, "one thread per key of a tile looks up its page");
static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 stages");
static_assert(NT % KCH == 0, "whole rows per pass of the K/V loads");
static_assert(TX_KV_FP8 >= 0 && TX_KV_FP8 <= 2, "TX_KV_FP8: 0 (16-bit cache), 1 (e4m3fn) or 2 (e5m2)");
static_assert(MT * (D + BK) / 2 <= 192, "O and S accumulators must fit in registers");

// Dynamic shared memory: [Q: BQ rows] [stages x (K tile, V tile)] [TX_KV_FP8: the converted K
// tile, V tile] [row pointers: stages x (K, V) x BK] [row bounds: BQ x (lo, hi)] [8 ints for the epilogue]
extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS) tactix_prefill(
    const u16* __restrict__ q, i64 q_st, i64 q_sh, const kv_t* __restrict__ k, const kv_t* __restrict__ v, i64 k_sp,
    i64 k_st, i64 k_sh, i64 v_sp, i64 v_st, i64 v_sh, u16* __restrict__ out, float* __restrict__ lse,
    const int* __restrict__ items, const int* __restrict__ num_items, const int* __restrict__ reqs,
    const int* __restrict__ kv_indices, i64 num_qo_heads, i64 gqa, i64 pack, i64 head_groups, i64 head_section,
    i64 page_shift,
    i64 causal, i64 window_left, double scale_log2_d, double cap_d, double k_scale_d, double v_scale_d,
    const float* __restrict__ k_scale_p, const float* __restrict__ v_scale_p, const float* __restrict__ sinks
#if TX_MASK
    , const unsigned char* __restrict__ mask, const int* __restrict__ mask_off
#endif
) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int hgs = (int)head_groups;
  const int n_items = __ldg(num_items);
  if ((int)blockIdx.x >= n_items * hgs) return;  // (CUDA-graph capacity past the work list)
  int item, hg;
  tx_item_head((int)blockIdx.x, hgs, (int)head_section, n_items, item, hg);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;

  const int req = __ldg(items + 2 * item), t0 = __ldg(items + 2 * item + 1);
  const int q_start = __ldg(reqs + 4 * req), q_len = __ldg(reqs + 4 * req + 1);
  const int kv_len = __ldg(reqs + 4 * req + 2), page_base = __ldg(reqs + 4 * req + 3);
  const int P = (int)pack;
  const int nt = min(BQ / P, q_len - t0);  // valid tokens of this tile (>= 1)
  const int H = (int)num_qo_heads;
  const int head0 = hg * P;
  const int kvh = head0 / (int)gqa;
  const int delta = kv_len - q_len;  // the token at index t of the request sits at position delta + t
  const int win = (int)window_left;
  const bool is_causal = causal != 0;
  // keys [lo, hi] attended by the token at local index tl of this tile (0 <= tl < nt)
  auto lo_of = [&](int tl) { return win >= 0 ? delta + t0 + tl - win : NO_LOWER; };
  auto hi_of = [&](int tl) { return is_causal ? delta + t0 + tl : kv_len - 1; };
  const int kv_lo = max(0, lo_of(0));
  const int kv_hi = min(kv_len, hi_of(nt - 1) + 1);
  const int ntiles = (kv_hi - kv_lo + BK - 1) / BK;
#if TX_MASK
  const unsigned char* mask_req = mask + __ldg(mask_off + req) + (i64)t0 * kv_len;  // the tile's first row
#endif

  const int wrow0 = warp * WROWS;  // this warp's first row

  const kv_t* kh = k + kvh * k_sh;
  const kv_t* vh = v + kvh * v_sh;
  const int* pages = kv_indices + page_base;
  const int pshift = (int)page_shift, pmask = (1 << pshift) - 1;

  unsigned char* q_s = smem;
  // row pointers of the K and V tiles in flight: [STAGES][2][BK]
  const kv_t** rows = reinterpret_cast<const kv_t**>(smem + Q_BYTES + KV_AREA);
  // per query row: the keys [lo, hi] it attends (rows past the valid tokens are clamped to the
  // last one, so they compute harmlessly and are never written); kept in shared memory, not in
  // registers, which the accumulators need
  int* rowb = reinterpret_cast<int*>(rows + STAGES * 2 * BK);  // [BQ][2]
  int* scal = rowb + 2 * BQ;                                   // what the epilogue needs
  const u32 qbase = tx_smem_addr(q_s);
  const u32 sbase = qbase + Q_BYTES;

  for (int r = tid; r < BQ; r += NT) {
    const int tl = min(r / P, nt - 1);
    rowb[2 * r] = lo_of(tl);
    rowb[2 * r + 1] = hi_of(tl);
  }
  if (tid == 0) {
    scal[0] = q_start + t0;
    scal[1] = nt;
    scal[2] = P;
    scal[3] = head0;
    scal[4] = __float_as_int(v_scale_p != nullptr ? __ldg(v_scale_p) : (float)v_scale_d);
    scal[5] = __float_as_int(k_scale_p != nullptr ? __ldg(k_scale_p) : (float)k_scale_d);
  }

  // K/V row pointers of the first STAGES tiles. Keys past kv_hi read the row of key kv_hi - 1
  // instead (real data, so finite; masked out of every row), so every copy is a whole 16 bytes.
  if (tid < BK) {
#pragma unroll
    for (int t = 0; t < STAGES; ++t) {
      const int tok = min(kv_lo + t * BK + tid, kv_hi - 1);
      const i64 page = __ldg(pages + (tok >> pshift));
      const i64 in = tok & pmask;
      rows[(t * 2) * BK + tid] = kh + page * k_sp + in * k_st;
      rows[(t * 2 + 1) * BK + tid] = vh + page * v_sp + in * v_st;
    }
  }
  // Q rows of the tile (rows past the valid tokens are zero)
  for (int c = tid; c < BQ * DCH; c += NT) {
    const int row = c / DCH, ch = c % DCH;
    const int tl = row / P;
    const bool ok = tl < nt && (DQK == D || ch * 8 < DQK);  // (columns past DQK: zeros)
    const u16* src = q + (i64)(q_start + t0 + tl) * q_st + (i64)(head0 + row % P) * q_sh + ch * 8;
    tx_cp_async16(qbase + tx_swz(row, ch, ROW_BYTES), ok ? (const void*)src : (const void*)q, ok ? 16 : 0);
  }
  tx_cp_async_commit();
  __syncthreads();
  // k_scale (read by thread 0 into shared memory, as v_scale for the epilogue): read after this
  // barrier, the scale takes no register through the prologue (loaded at the top, it pushed the
  // d128 mma.sync default past 255 registers: ptxas spilled 20 words)
  const float cap = (float)cap_d;
  const float scale_log2 = (float)scale_log2_d * __int_as_float(scal[5]);     // k_scale * sm_scale * log2(e)
  const float scale_over_cap = cap > 0.f ? scale_log2 / (cap * LOG2E) : 0.f;  // k_scale sm_scale / cap
  const float cap_log2 = cap * LOG2E;
  const float mul = cap > 0.f ? 1.f : scale_log2;  // logits (capped or not) -> base-2 exponent

  // A thread copies chunk `ld_ch` of rows ld_row0 + j * LD_STEP of each K and V tile; with
  // LD_STEP a multiple of 8 the swizzle of all its chunks is the same, so the destination of the
  // j-th is a base plus a constant.
  // (fp8 rows land unswizzled, each where the conversion reads it)
  const int ld_row0 = tid / KCH, ld_ch = tid % KCH;
  // bytes this thread copies of each K and V row: its chunk's, or none past the row's DQK / DVO
  // elements (zero-filled: S and P V over D columns then give the DQK / DVO-column results)
  // (compile-time 16 where the dims are D: those kernels are what they were)
  const int k_bytes = DQK == D || ld_ch * CH_ELEMS < DQK ? 16 : 0;
  const int v_bytes = DVO == D || ld_ch * CH_ELEMS < DVO ? 16 : 0;
  auto ring_off = [&](int row) -> u32 {
    return FP8 ? (u32)(row * KV_ROW_BYTES + ld_ch * 16) : tx_swz(row, ld_ch, ROW_BYTES);
  };
  const u32 ld_dst = ring_off(ld_row0);
  auto issue = [&](int tile) {
    if (tile < ntiles) {
      const int s = tile % STAGES;
      const u32 kb = sbase + s * STAGE_BYTES + ld_dst, vb = kb + RING_TILE_BYTES;
      const kv_t* const* kr = rows + (s * 2) * BK + ld_row0;
      const kv_t* const* vr = kr + BK;
#pragma unroll
      for (int j = 0; j < LD_ITERS; ++j) {
        if (LD_EXACT || ld_row0 + j * LD_STEP < BK) {
          const u32 dst = FP8 || LD_SAME_SWZ ? kb + j * LD_STEP * KV_ROW_BYTES
                                             : sbase + s * STAGE_BYTES + ring_off(ld_row0 + j * LD_STEP);
          tx_cp_async16(dst, kr[j * LD_STEP] + (k_bytes ? ld_ch * CH_ELEMS : 0), k_bytes);
        }
      }
#pragma unroll
      for (int j = 0; j < LD_ITERS; ++j) {
        if (LD_EXACT || ld_row0 + j * LD_STEP < BK) {
          const u32 dst = FP8 || LD_SAME_SWZ ? vb + j * LD_STEP * KV_ROW_BYTES
                                             : sbase + s * STAGE_BYTES + RING_TILE_BYTES +
                                                   ring_off(ld_row0 + j * LD_STEP);
          tx_cp_async16(dst, vr[j * LD_STEP] + (v_bytes ? ld_ch * CH_ELEMS : 0), v_bytes);
        }
      }
    }
    tx_cp_async_commit();  // always, so that group counting stays uniform
  };

#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) issue(t);

  // per-thread fragment addresses: A (Q) and trans-B (V) rows (lane & 7) + 8 * ((lane >> 3) & 1),
  // column half lane >> 4; B (K) rows (lane & 7) + 8 * (lane >> 4), column half (lane >> 3) & 1
  const int a_c = (lane >> 4) ^ (lane & 7);
  const int k_c = ((lane >> 3) & 1) ^ (lane & 7);
  const u32 q_frag = qbase + (u32)((wrow0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * ROW_BYTES);
  const u32 k_frag = (u32)(((lane & 7) + ((lane >> 4) << 3)) * ROW_BYTES);
  const u32 v_frag = (u32)(((lane & 7) + (((lane >> 3) & 1) << 3)) * ROW_BYTES);

  u32 qf[QMT][QKK][4];
  if (Q_IN_REGS) {
    tx_cp_async_wait<STAGES - 1>();  // the Q group (the oldest) has landed
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < QMT; ++mt) {
#pragma unroll
      for (int kk = 0; kk < QKK; ++kk) {
        tx_ldmatrix_x4(q_frag + mt * 16 * ROW_BYTES + chunk_off(kk * 2, a_c), qf[mt][kk][0], qf[mt][kk][1],
                       qf[mt][kk][2], qf[mt][kk][3]);
      }
    }
  }

  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int t = 0; t < D / 8; ++t) o[mt][t][0] = o[mt][t][1] = o[mt][t][2] = o[mt][t][3] = 0.f;
  }
  float m[MT][2], l[MT][2];  // running max (base-2 exponent units) and this thread's partial row sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = tx_neg_inf();
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int i = 0; i < ntiles; ++i) {
    tx_cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue(i + STAGES - 1);
    // page of this thread's key of tile i + STAGES (its row pointers are stored after the compute)
    const int pt = i + STAGES;
    const int ptok = min(kv_lo + pt * BK + tid, kv_hi - 1);
    int ppage = 0;
    if (tid < BK && pt < ntiles) ppage = __ldg(pages + (ptok >> pshift));

    const int s = i % STAGES;
#if TX_KV_FP8
    // tile i has landed (every thread's copies: the barrier above): convert it into the 16-bit
    // pair, which every warp is done reading for tile i - 1 (also that barrier)
    for (int c = tid; c < 2 * BK * KCH; c += NT) {
      const int half = c / (BK * KCH), rem = c % (BK * KCH), row = rem / KCH, ch = rem % KCH;
      const tx_u4 in = *reinterpret_cast<const tx_u4*>(smem + Q_BYTES + s * STAGE_BYTES + half * RING_TILE_BYTES +
                                                        row * KV_ROW_BYTES + ch * 16);
      tx_u4 lo, hi;
      tx_fp8x4_to_16<TX_KV_FP8>(in.x, lo.x, lo.y);
      tx_fp8x4_to_16<TX_KV_FP8>(in.y, lo.z, lo.w);
      tx_fp8x4_to_16<TX_KV_FP8>(in.z, hi.x, hi.y);
      tx_fp8x4_to_16<TX_KV_FP8>(in.w, hi.z, hi.w);
      unsigned char* dst = smem + Q_BYTES + STAGES * STAGE_BYTES + half * TILE_BYTES;
      *reinterpret_cast<tx_u4*>(dst + tx_swz(row, 2 * ch, ROW_BYTES)) = lo;
      *reinterpret_cast<tx_u4*>(dst + tx_swz(row, 2 * ch + 1, ROW_BYTES)) = hi;
    }
    __syncthreads();
    const u32 kb = sbase + STAGES * STAGE_BYTES, vb = kb + TILE_BYTES;
#else
    const u32 kb = sbase + s * STAGE_BYTES, vb = kb + TILE_BYTES;
#endif
    const int kv0 = kv_lo + i * BK;
    const int kv_last = kv0 + BK - 1;

    // the warp's rows are in order, so its first and last row bound the keys any of them attend
    const int lo_min_w = rowb[2 * wrow0], hi_min_w = rowb[2 * wrow0 + 1];
    const int lo_max_w = rowb[2 * (wrow0 + WROWS - 1)], hi_max_w = rowb[2 * (wrow0 + WROWS - 1) + 1];
    if (wrow0 / P < nt && kv0 <= hi_max_w && kv_last >= lo_min_w) {
      const bool need_mask = TX_MASK || kv0 < lo_max_w || kv_last > hi_min_w;
      float sc[MT][NNT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < NNT; ++j) sc[mt][j][0] = sc[mt][j][1] = sc[mt][j][2] = sc[mt][j][3] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (Q_IN_REGS) {
            a[mt][0] = qf[Q_IN_REGS ? mt : 0][Q_IN_REGS ? kk : 0][0];
            a[mt][1] = qf[Q_IN_REGS ? mt : 0][Q_IN_REGS ? kk : 0][1];
            a[mt][2] = qf[Q_IN_REGS ? mt : 0][Q_IN_REGS ? kk : 0][2];
            a[mt][3] = qf[Q_IN_REGS ? mt : 0][Q_IN_REGS ? kk : 0][3];
          } else {
            tx_ldmatrix_x4(q_frag + mt * 16 * ROW_BYTES + chunk_off(kk * 2, a_c), a[mt][0], a[mt][1], a[mt][2],
                           a[mt][3]);
          }
        }
#pragma unroll
        for (int np = 0; np < NNT / 2; ++np) {
          u32 b0, b1, b2, b3;
          tx_ldmatrix_x4(kb + k_frag + np * 16 * ROW_BYTES + chunk_off(kk * 2, k_c), b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            tx_mma(sc[mt][2 * np], a[mt], b0, b1);
            tx_mma(sc[mt][2 * np + 1], a[mt], b2, b3);
          }
        }
      }

#ifndef EXP_NOCAP
      if (cap > 0.f) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int j = 0; j < NNT; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) sc[mt][j][c] = cap_log2 * tx_tanh(sc[mt][j][c] * scale_over_cap);
          }
        }
      }
#endif
#ifndef EXP_NOMASK
      if (need_mask) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int r = wrow0 + mt * 16 + grp;
          const int lo0 = rowb[2 * r], hi0 = rowb[2 * r + 1];
          const int lo1 = rowb[2 * (r + 8)], hi1 = rowb[2 * (r + 8) + 1];
#if TX_MASK
          // the mask rows of this thread's two rows (rows past the valid tokens: the last one's)
          const unsigned char* m0 = mask_req + (i64)min(r / P, nt - 1) * kv_len;
          const unsigned char* m1 = mask_req + (i64)min((r + 8) / P, nt - 1) * kv_len;
#endif
#pragma unroll
          for (int j = 0; j < NNT; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int key = kv0 + j * 8 + tig * 2 + (c & 1);
              bool ok = c < 2 ? key >= lo0 && key <= hi0 : key >= lo1 && key <= hi1;
#if TX_MASK
              ok = ok && __ldg((c < 2 ? m0 : m1) + key) != 0;  // (the bounds first: key < kv_len)
#endif
              sc[mt][j][c] = ok ? sc[mt][j][c] : tx_neg_inf();
            }
          }
        }
      }

#endif
      // online softmax, per m tile and row half
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx0 = tx_neg_inf(), mx1 = tx_neg_inf();
#pragma unroll
        for (int j = 0; j < NNT; ++j) {
          mx0 = fmaxf(mx0, fmaxf(sc[mt][j][0], sc[mt][j][1]));
          mx1 = fmaxf(mx1, fmaxf(sc[mt][j][2], sc[mt][j][3]));
        }
        mx0 = tx_warp_max4(mx0) * mul;
        mx1 = tx_warp_max4(mx1) * mul;
        const float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
        const float mu0 = mn0 == tx_neg_inf() ? 0.f : mn0;
        const float mu1 = mn1 == tx_neg_inf() ? 0.f : mn1;
        const float al0 = tx_exp2(m[mt][0] - mu0), al1 = tx_exp2(m[mt][1] - mu1);
        m[mt][0] = mn0;
        m[mt][1] = mn1;
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int j = 0; j < NNT; ++j) {
          sc[mt][j][0] = tx_exp2(fmaf(sc[mt][j][0], mul, -mu0));
          sc[mt][j][1] = tx_exp2(fmaf(sc[mt][j][1], mul, -mu0));
          sc[mt][j][2] = tx_exp2(fmaf(sc[mt][j][2], mul, -mu1));
          sc[mt][j][3] = tx_exp2(fmaf(sc[mt][j][3], mul, -mu1));
          rs0 += sc[mt][j][0] + sc[mt][j][1];
          rs1 += sc[mt][j][2] + sc[mt][j][3];
        }
        l[mt][0] = l[mt][0] * al0 + rs0;
        l[mt][1] = l[mt][1] * al1 + rs1;
#pragma unroll
        for (int t = 0; t < D / 8; ++t) {
          o[mt][t][0] *= al0;
          o[mt][t][1] *= al0;
          o[mt][t][2] *= al1;
          o[mt][t][3] *= al1;
        }
      }

      // O += P V
#pragma unroll
      for (int ks = 0; ks < NKS; ++ks) {
        u32 pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = tx_pack2(sc[mt][2 * ks][0], sc[mt][2 * ks][1]);
          pa[mt][1] = tx_pack2(sc[mt][2 * ks][2], sc[mt][2 * ks][3]);
          pa[mt][2] = tx_pack2(sc[mt][2 * ks + 1][0], sc[mt][2 * ks + 1][1]);
          pa[mt][3] = tx_pack2(sc[mt][2 * ks + 1][2], sc[mt][2 * ks + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          u32 b0, b1, b2, b3;
          tx_ldmatrix_x4_trans(vb + v_frag + ks * 16 * ROW_BYTES + chunk_off(dp * 2, a_c), b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            tx_mma(o[mt][2 * dp], pa[mt], b0, b1);
            tx_mma(o[mt][2 * dp + 1], pa[mt], b2, b3);
          }
        }
      }
    }

    // row pointers of tile i + STAGES into the ring slot of tile i (read when it is issued, next iteration)
    if (tid < BK && pt < ntiles) {
      const i64 in = ptok & pmask;
      rows[(s * 2) * BK + tid] = kh + (i64)ppage * k_sp + in * k_st;
      rows[(s * 2 + 1) * BK + tid] = vh + (i64)ppage * v_sp + in * v_st;
    }
  }
  tx_cp_async_wait<0>();
  // what the epilogue needs, read back from shared memory (registers were the accumulators')
  const int tok_base = scal[0], ntv = scal[1], Pv = scal[2], head0v = scal[3];
  const float v_scale = __int_as_float(scal[4]);
  if (wrow0 / Pv >= ntv) return;  // no valid row in this warp; no barrier follows

  // ---- epilogue: O / l staged through this warp's own Q rows, then 16-byte stores ----------
  float inv[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[mt][h] = tx_warp_sum4(l[mt][h]);
      // a row that attends no key (the mask empties it, or causal: before its request's first
      // key) has l 0: zeros (and an LSE of the sink, or -inf)
      const bool empty = l[mt][h] == 0.f;
      float f = 1.f;
      if (sinks != nullptr) {  // the row's sink joins its denominator (its weight rescaled to the new max)
        const float before = m[mt][h];
        tx_fold_sink(m[mt][h], l[mt][h], __ldg(sinks + head0v + (wrow0 + mt * 16 + grp + 8 * h) % Pv) * LOG2E);
        f = tx_exp2(before - m[mt][h]);
      }
      inv[mt][h] = empty ? 0.f : v_scale * f / l[mt][h];
    }
  }
  __syncwarp();  // every lane is done reading its Q rows (ldmatrix) before they are overwritten
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r0 = wrow0 + mt * 16 + grp;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      *reinterpret_cast<u32*>(q_s + tx_swz(r0, t, ROW_BYTES) + tig * 4) =
          tx_pack2(o[mt][t][0] * inv[mt][0], o[mt][t][1] * inv[mt][0]);
      *reinterpret_cast<u32*>(q_s + tx_swz(r0 + 8, t, ROW_BYTES) + tig * 4) =
          tx_pack2(o[mt][t][2] * inv[mt][1], o[mt][t][3] * inv[mt][1]);
    }
  }
  __syncwarp();
#pragma unroll
  for (int c = lane; c < WROWS * DCH; c += 32) {
    const int r = wrow0 + c / DCH, ch = c % DCH;
    const int tl = r / Pv;
    if (tl < ntv && (DVO == D || ch * 8 < DVO)) {
      const tx_u4 val = *reinterpret_cast<const tx_u4*>(q_s + tx_swz(r, ch, ROW_BYTES));
      *reinterpret_cast<tx_u4*>(out + ((i64)(tok_base + tl) * H + head0v + r % Pv) * DVO + ch * 8) = val;
    }
  }
  if (lse != nullptr && tig == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wrow0 + mt * 16 + grp + 8 * h;
        const int tl = r / Pv;
        if (tl < ntv) lse[(i64)(tok_base + tl) * H + head0v + r % Pv] = (m[mt][h] + tx_log2(l[mt][h])) * LN2;
      }
    }
  }
}
