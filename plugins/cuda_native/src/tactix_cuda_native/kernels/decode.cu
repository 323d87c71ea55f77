// Paged decode attention: one query row per request over a paged K/V cache.
//
// Grid: x = work item (a request and a contiguous range of its keys, planned on the host) x
//       unit (kv head x q tile; a q tile is up to 16 query heads of one GQA group), units
//       fastest: the CTAs of one item run together and read the heads of each page side by side,
//       and items are dispatched in the plan's order.
// A CTA reads each K/V row of its range once for all query heads of its tile: K/V tiles of
// TX_TILE tokens are gathered page by page with cp.async into a TX_STAGES-deep ring of
// swizzled shared-memory buffers; every warp takes TX_TILE / TX_WARPS tokens of each tile and
// computes S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k16, the query heads as
// the 16 rows), with an online softmax in fp32 (base-2 exponentials). Warps are merged in
// shared memory at the end. A work item that covers a whole request writes `out` (and `lse`);
// one that covers part of a request writes a normalised fp32 partial output and its
// natural-log LSE to the workspace, then takes a ticket from the request's counter: the CTA
// that draws the last ticket merges all the request's partials, in slot order (so the result
// does not depend on which CTA finished last: bitwise deterministic), writes `out` and `lse`,
// and resets the counter to zero for the next launch (CUDA-graph replays included).
//
// Work item record (8 ints, 32 bytes): request, first key, end key, partial slot (-1: whole
// request), the request's offset in kv_indices, its first partial slot, its partial count, 0.
//
// With TX_BULK = s (sm_90, HND caches whose rows are contiguous within a page and head) K/V
// tiles arrive by bulk copies (cp.async.bulk, the TMA unit without a tensor map) of s tokens
// each, one copy per segment of s tokens of a tile, counted on one mbarrier per stage. Lanes of
// warp 0 issue the copies, with the page index of each segment loaded one tile ahead. A copy
// lands its rows unswizzled, so segment j of a tile starts at j x (s rows + 16 bytes): tile row r
// is token (r mod NSEG) x s + r / NSEG (NSEG = tile / s segments), so that the eight rows an
// ldmatrix phase reads lie in eight different segments, i.e. different banks (with 4 segments,
// two-way conflicts). Tiles start at the item's first key rounded down to s; keys outside the
// item are masked in S, and their V rows (whatever the cache holds there) are zeroed before P V.
//
// With TX_TMA as well, the segments arrive through tensor maps of the K and V caches (4-D: head
// dim, token in page, head, page; boxes of 64 of the head dim x s tokens, the 128-byte swizzle)
// instead of linear copies: each segment is D / 64 boxes, rows in token order, and the swizzle
// keeps every ldmatrix phase conflict-free without padding. The maps are kernel parameters the
// plan encodes (plugin.CudaNativeDecodePlan: kept per cache tensor), any 16-byte strides.
//
// With TX_KV_FP8 (1: float8_e4m3fn, 2: float8_e5m2 caches; cp.async only, not TX_BULK) a K/V row
// is D bytes, copied into the ring as 16-byte chunks (for D >= 128 the two halves of each odd
// row's 64-byte groups swapped: fp8_off). K is read from the ring straight into registers and
// converted there (fp8.cuh): lane (grp, tig) of a warp loads 16 bytes of its token's row, dims
// 64 g + 16 tig .. + 15, which are the B fragments of k-steps 4g .. 4g + 3 when the head dims of
// Q and K are taken in the order phys() gives (a permutation of each 64 dims; Q's tile is loaded
// in that order, so S = Q K^T is unchanged). Q K^T runs in float16 whatever TX_BF16 says (K's
// codes take one conversion a pair into float16, four into bfloat16): a bfloat16 Q row is scaled
// by a power of two into float16's range, exactly, and its logits back (fp8.cuh,
// tx_f16_row_exponent). V's rows of each warp's tokens are converted by that
// warp into a float16 tile after the ring (whatever TX_BF16 says: fp8 -> float16 is one
// conversion, bfloat16 four), swizzled as the 16-bit path's (a warp barrier, no CTA barrier),
// which ldmatrix.trans reads for P V, computed in float16 (P in [0, 1] is finer in float16).
//
// Attention sinks (where `sinks` is not null: a float32 logit per query head, in the units of the
// scaled and soft-capped logits) join each row's softmax denominator as a key without a value:
// a whole request's CTA folds its row's sink into the merged (max, sum) before normalising, a
// split request's merging CTA after the partials (which leave it out); the LSE includes it.
//
// Dequantization scales (every variant): logits (q . k) k_scale sm_scale, output sum p v v_scale.
// Each scale is a float argument or, where its pointer is not null, the float32 at that address
// (read by every CTA: a CUDA graph replays with whatever it holds). k_scale multiplies the
// base-2 logit scale (so the LSE follows it, and the soft cap applies to the scaled logits);
// v_scale the final outputs (written whole or merged; the partials are unscaled).
//
// Compile-time parameters: TX_BF16, TX_D (64, 128, 256), TX_TILE, TX_WARPS, TX_STAGES,
// TX_L2 (1: K/V streamed with an L2 evict_first policy, 0: no hint), TX_L2_PREFETCH_256, TX_BULK,
// TX_TMA, TX_KV_FP8, TX_FP8_CVT (1, the plugin's default: the hardware fp8 conversion on sm_89+,
// see tx_fp8x2_cvt; 0: the bit arithmetic), TX_MIN_CTAS (registers bounded for that many CTAs an
// SM: __launch_bounds__' second argument; 1 when absent).
#ifndef TX_BULK
#define TX_BULK 0
#endif
#ifndef TX_TMA
#define TX_TMA 0
#endif
#include "common.cuh"
#include "fp8.cuh"
#if TX_BULK
#include "sm90.cuh"
#endif

#ifndef TX_D
#error "TX_D must be defined"
#endif

#ifndef TX_TILE
#define TX_TILE 64
#endif
#ifndef TX_WARPS
#define TX_WARPS 4
#endif
#ifndef TX_STAGES
#define TX_STAGES 3
#endif
#ifndef TX_L2
#define TX_L2 1
#endif

constexpr int D = TX_D;
constexpr int TILE = TX_TILE;
constexpr int WARPS = TX_WARPS;
constexpr int STAGES = TX_STAGES;
constexpr int NT = WARPS * 32;
constexpr int TPW = TILE / WARPS;  // tokens per warp per tile
constexpr int NNT = TPW / 8;       // n8 tiles of S per warp
constexpr int NKS = TPW / 16;      // k16 steps of P V per warp
constexpr int DCH = D / 8;         // 16-byte chunks per row
constexpr int ROW_BYTES = D * 2;           // a 16-bit K/V row in shared memory (what ldmatrix reads)
constexpr bool FP8 = TX_KV_FP8 != 0;
constexpr int KV_ROW_BYTES = FP8 ? D : ROW_BYTES;  // a cache row
constexpr int KCH = KV_ROW_BYTES / 16;             // 16-byte chunks per cache row
constexpr bool BULK = TX_BULK != 0;
constexpr int SEG = BULK ? TX_BULK : 1;      // tokens per bulk copy
constexpr int NSEG = TILE / SEG;             // bulk copies per K (or V) tile
constexpr int SEG_BYTES = SEG * ROW_BYTES;   // bytes of one bulk copy
constexpr bool TMA = TX_TMA != 0;            // segments through tensor maps, in the 128-byte swizzle
constexpr int SEG_PITCH = TMA ? SEG_BYTES : SEG_BYTES + 16;  // a segment's place (bulk: 16 bytes apart: banks)
constexpr int TILE_BYTES = BULK ? NSEG * SEG_PITCH : TILE * ROW_BYTES;
constexpr int RING_TILE_BYTES = FP8 ? TILE * KV_ROW_BYTES : TILE_BYTES;  // a K (or V) tile as copied
constexpr int STAGE_BYTES = 2 * RING_TILE_BYTES;
#ifndef TX_VREG
#define TX_VREG 0
#endif
// fp8 with TX_VREG: P V's B fragments come from the fp8 V rows in registers (below), no converted tile
constexpr bool VREG = FP8 && TX_VREG != 0;
constexpr int CONV_BYTES = FP8 && !VREG ? TILE_BYTES : 0;  // fp8: the converted V tile, after the ring
constexpr int FP8_SWZ = KCH >= 8 ? 4 : 0;  // fp8 rows of 128+ bytes: odd rows' 64-byte halves swapped
constexpr int KV_AREA = STAGES * STAGE_BYTES + CONV_BYTES;
// Q's fragments live in registers at d64 and d128, except at d128 over an fp8 cache, where the
// 32 registers they take are what keeps 4 CTAs an SM (TX_MIN_CTAS 4: 128 registers, no spill);
// ldmatrix re-reads them from the Q tile each k-step instead (as at d256)
constexpr bool Q_IN_REGS = D == 64 || (D == 128 && !FP8);
constexpr int ROWS_PER_PASS = NT / KCH;        // tile rows one pass of the CTA's threads copies
constexpr int PASSES = TILE / ROWS_PER_PASS;   // passes per K (or V) tile: a compile-time count
constexpr int ITEM_INTS = 8;
constexpr float LN2 = 0.6931471805599453f;
constexpr float LOG2E = 1.4426950408889634f;

static_assert(D == 64 || D == 128 || D == 256, "head dim must be 64, 128 or 256");
static_assert(TPW == 16 || TPW == 32, "TX_TILE / TX_WARPS must be 16 or 32");
static_assert(TILE <= NT, "one thread per token of a tile computes its offsets");
static_assert(STAGES >= 2, "at least two stages");
static_assert(NT % KCH == 0 && TILE % ROWS_PER_PASS == 0, "threads tile the rows of a K/V tile evenly");
static_assert(WARPS * 16 * D * 4 <= KV_AREA, "warp merge buffer must fit in the stage area");
static_assert(TX_KV_FP8 >= 0 && TX_KV_FP8 <= 2, "TX_KV_FP8: 0 (16-bit cache), 1 (e4m3fn) or 2 (e5m2)");
static_assert(!FP8 || !BULK, "fp8 caches: cp.async only");
static_assert(!TX_VREG || (FP8 && (D == 128 || D == 256)), "TX_VREG: fp8 caches, head dim 128 or 256");
static_assert(!FP8 || (TPW * KCH) % 32 == 0, "fp8: a warp's lanes convert its V rows evenly");
static_assert(!BULK || (TILE % SEG == 0 && NSEG >= 4 && 2 * NSEG <= 32), "bulk: 4 to 16 segments a tile");
static_assert(!TMA || (BULK && SEG % 8 == 0), "tensor maps: TX_BULK rows per box, 8 or more (1 KB swizzle atoms)");

// Byte offset of 16-byte chunk `ch` of row `row` of a K or V tile, and the row's token (from the
// tile's first key): swizzled rows in token order; with TX_BULK rows interleaved over segments;
// with TX_TMA rows in token order, segment by segment, each segment D / 64 boxes of SEG rows of
// 128 bytes in the 128-byte swizzle (chunk c of row r at c ^ (r mod 8)).
TX_DEVICE u32 kv_row(int row, int ch) {
  if (TMA) {
    const int r = row % SEG;
    return (u32)((row / SEG) * SEG_BYTES + (ch >> 3) * (SEG * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
  }
  if (BULK) return (u32)((row % NSEG) * SEG_PITCH + (row / NSEG) * ROW_BYTES + ch * 16);
  return tx_swz(row, ch, ROW_BYTES);
}
TX_DEVICE int row_token(int row) { return BULK && !TMA ? (row % NSEG) * SEG + row / NSEG : row; }

// fp8 ring: byte offset of 16-byte chunk `ch` of row `row` of a K or V tile (see TX_KV_FP8 above:
// the 16 bytes lane (grp, tig) reads for 4 k-steps are chunk 4 g + tig; with FP8_SWZ the eight
// lanes of one ldmatrix-sized phase, rows r and r + 1, then hit eight different bank groups).
TX_DEVICE u32 fp8_off(int row, int ch) { return (u32)(row * KV_ROW_BYTES + ((ch ^ ((row & 1) * FP8_SWZ)) << 4)); }
// TX_VREG: chunk `ch` of V row `row`. Lane (grp, tig) reads 4 bytes at dim 32 b + 4 grp of rows
// 2 tig (+ 1, + 8, + 9) of its k-step: the 16-byte chunks 2 b and 2 b + 1 of four rows whose
// (row / 2) % 4 differ, moved to four different pairs of the eight 16-byte bank groups.
TX_DEVICE u32 fp8_voff(int row, int ch) { return (u32)(row * KV_ROW_BYTES + ((ch ^ (((row >> 1) & 3) << 1)) << 4)); }
// fp8: the head dim of the cache row that logical dim L of the mma fragments reads. Within k-step
// kk = L / 16, fragment index i = L % 16 (tig = (i % 8) / 2; i / 8: the fragment's second register;
// i % 2: the half) maps to byte 4 (kk % 4) + 2 (i / 8) + i % 2 of lane tig's 16 bytes, which start
// at dim 64 (kk / 4) + 16 tig. Pairs (L even, L + 1) stay adjacent.
// P V's operands: the kernel's 16-bit type, float16 for fp8 caches (P in [0, 1] is finer in
// float16, and V's fp8 values are float16 values)
TX_DEVICE u32 pv_pack2(float lo, float hi) { return FP8 ? tx_pack2_f16(lo, hi) : tx_pack2(lo, hi); }
TX_DEVICE void pv_mma(float* d, const u32* a, u32 b0, u32 b1) {
  if (FP8) {
    tx_mma_f16(d, a, b0, b1);
  } else {
    tx_mma(d, a, b0, b1);
  }
}
TX_DEVICE int phys(int L) {
  const int kk = L >> 4, i = L & 15;
  return 64 * (kk >> 2) + 16 * ((i & 7) >> 1) + 4 * (kk & 3) + 2 * (i >> 3) + (i & 1);
}

// Dynamic shared memory: [stages: K tile, V tile] [TX_KV_FP8: the converted K tile, V tile] [Q 16 rows]
// [row addresses: stages x (K, V) x TILE; TX_BULK: an mbarrier per stage there instead]
// [per-warp row max/sum: WARPS x 16 x 2] [final row max/sum: 16 x 2] [flag: 4 ints]
#ifndef TX_MIN_CTAS
#define TX_MIN_CTAS 1
#endif
extern "C" __global__ void __launch_bounds__(NT, TX_MIN_CTAS) tactix_decode(
#if TX_TMA
    // the K and V caches as [pages][heads][tokens][D] (dims innermost first: D, token, head, page),
    // boxes of 64 x TX_BULK tokens, the 128-byte swizzle
    const __grid_constant__ TxTensorMap kmap, const __grid_constant__ TxTensorMap vmap,
#endif
    const u16* __restrict__ q, i64 q_sb, i64 q_sh, const kv_t* __restrict__ k, const kv_t* __restrict__ v,
    i64 k_sp, i64 k_st, i64 k_sh, i64 v_sp, i64 v_st, i64 v_sh, u16* __restrict__ out, float* __restrict__ lse,
    const int* __restrict__ items, const int* __restrict__ num_items, const int* __restrict__ kv_indices,
    float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ counters, i64 num_qo_heads, i64 gqa,
    i64 q_tiles, i64 page_shift, double scale_log2_d, double cap_d, double k_scale_d, double v_scale_d,
    const float* __restrict__ k_scale_p, const float* __restrict__ v_scale_p, const float* __restrict__ sinks) {
  extern __shared__ __align__(1024) unsigned char smem[];  // (the tensor maps' swizzle atoms: 1 KB)
  const int units = (int)(num_qo_heads / gqa * q_tiles);
  const int item = blockIdx.x / units, unit = blockIdx.x % units;
  // the item record and the item count are loaded together (items holds one record per CTA of
  // the grid, so the record is in bounds even for an idle CTA)
  int req, start, end, slot, page_base, first_slot, nsplit, unused;
  tx_ldg4(items + ITEM_INTS * item, req, start, end, slot);
  tx_ldg4(items + ITEM_INTS * item + 4, page_base, first_slot, nsplit, unused);
  if (item >= __ldg(num_items)) return;
  (void)unused;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;

  const int H = (int)num_qo_heads;
  const int kvh = unit / (int)q_tiles, qt = unit % (int)q_tiles;
  const int head0 = kvh * (int)gqa + qt * 16;
  const int nrows = min(16, (int)gqa - qt * 16);
  const kv_t* kh = k + kvh * k_sh;
  const kv_t* vh = v + kvh * v_sh;
  const int* pages = kv_indices + page_base;
  const int pshift = (int)page_shift, pmask = (1 << pshift) - 1;
  const int first = BULK ? start & ~(SEG - 1) : start;  // key of tile 0's first row
  const int ntiles = (end - first + TILE - 1) / TILE;
  const float cap = (float)cap_d;
  const float k_scale = k_scale_p != nullptr ? __ldg(k_scale_p) : (float)k_scale_d;
  const float v_scale = v_scale_p != nullptr ? __ldg(v_scale_p) : (float)v_scale_d;
  const float scale_log2 = (float)scale_log2_d * k_scale;  // k_scale * sm_scale * log2(e)
  const float cap_log2 = cap * LOG2E;
  // K/V rows are read once, unless several q tiles share a KV head (they read it in turn)
  const u64 policy = tx_l2_policy(TX_L2 != 0 && q_tiles == 1);

  unsigned char* q_s = smem + KV_AREA;
  u64* raddr = reinterpret_cast<u64*>(q_s + 16 * ROW_BYTES);  // [STAGES][2][TILE] byte addresses, 0: no row
  float* ml = reinterpret_cast<float*>(raddr + STAGES * 2 * TILE);
  float* fin = ml + WARPS * 32;
  int* flag = reinterpret_cast<int*>(fin + 32);
  const u32 sbase = tx_smem_addr(smem);
  const u32 qbase = tx_smem_addr(q_s);
  const u32 bars = tx_smem_addr(raddr);  // TX_BULK: "stage s landed" mbarriers, 8 bytes each

  // addresses of the K and V rows of the first STAGES tiles (one thread per token)
  if (!BULK && tid < TILE) {
#pragma unroll
    for (int t = 0; t < STAGES; ++t) {
      const int tok = start + t * TILE + tid;
      u64 ka = 0, va = 0;
      if (tok < end) {
        const i64 page = __ldg(pages + (tok >> pshift));
        const i64 in = tok & pmask;
        ka = reinterpret_cast<u64>(kh + page * k_sp + in * k_st);
        va = reinterpret_cast<u64>(vh + page * v_sp + in * v_st);
      }
      raddr[(t * 2) * TILE + tid] = ka;
      raddr[(t * 2 + 1) * TILE + tid] = va;
    }
  }
  // Q rows of this tile (rows past the group are zero)
  if (FP8) {
    // Q's tile in float16 (Q K^T runs in float16: fp8.cuh, tx_f16_row_exponent), NT / 16 lanes a
    // row; a bfloat16 row scaled by 2^e (its exponent goes to `fin`, free until the end). Logical
    // dim pair (L, L + 1) of the tile holds head dims phys(L), + 1 (plain loads: a permutation;
    // the empty group keeps the cp.async group count of the 16-bit path).
    constexpr int TPR = NT / 16, PPT = D / 2 / TPR;  // lanes a row, pairs a lane
    const int row = tid / TPR, part = tid % TPR;
    const bool ok = row < nrows;
    const u16* qrow = q + req * q_sb + (head0 + (ok ? row : 0)) * q_sh;
    int e = 0;
    if (TX_BF16) {
      float largest = 0.f;
#pragma unroll 4
      for (int i = 0; i < PPT; ++i) {
        const u32 val = ok ? *reinterpret_cast<const u32*>(qrow + 2 * (part + i * TPR)) : 0u;
        largest = fmaxf(largest, fmaxf(fabsf(tx_to_float((u16)(val & 0xffffu))), fabsf(tx_to_float((u16)(val >> 16)))));
      }
#pragma unroll
      for (int o = 1; o < TPR; o <<= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
      e = tx_f16_row_exponent(largest);
    }
#pragma unroll 4
    for (int i = 0; i < PPT; ++i) {
      const int L = 2 * (part + i * TPR);
      u32 val = ok ? *reinterpret_cast<const u32*>(qrow + phys(L)) : 0u;
      if (TX_BF16) {
        val = tx_pack2_f16(tx_ldexp2(tx_to_float((u16)(val & 0xffffu)), e), tx_ldexp2(tx_to_float((u16)(val >> 16)), e));
      }
      *reinterpret_cast<u32*>(q_s + tx_swz(row, L >> 3, ROW_BYTES) + (L & 7) * 2) = val;
    }
    if (part == 0) fin[row] = (float)e;
    tx_cp_async_commit();
  } else {
    const u16* qrow0 = q + req * q_sb + head0 * q_sh;
    for (int c = tid; c < 16 * DCH; c += NT) {
      const int row = c / DCH, ch = c % DCH;
      const bool ok = row < nrows;
      tx_cp_async16(qbase + tx_swz(row, ch, ROW_BYTES), ok ? (const void*)(qrow0 + row * q_sh + ch * 8) : (const void*)q,
                    ok ? 16 : 0);
    }
    tx_cp_async_commit();
  }
#if TX_BULK
  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st) tx_mbar_init(bars + st * 8, 1);
    tx_mbar_init_fence();
  }
#endif
  __syncthreads();

  // each thread copies 16-byte chunk `cch` of rows crow, crow + ROWS_PER_PASS, ... of a tile
  const int crow = tid / KCH, cch = tid % KCH;
  // where a copied chunk lands: 16-bit rows swizzled, fp8 rows as they are (converted afterwards)
  auto ring_off = [&](int row) -> u32 {
    return FP8 ? fp8_off(row, cch) : tx_swz(row, cch, ROW_BYTES);
  };
  auto issue = [&](int tile) {
    if (tile < ntiles) {
      const int s = tile % STAGES;
      const u32 kb = sbase + s * STAGE_BYTES, vb = kb + RING_TILE_BYTES;
      const u64* ka = raddr + (s * 2) * TILE;
      const u64* va = ka + TILE;
      // all row addresses first: the copies' memory clobbers would otherwise order each
      // shared-memory load after the previous copy
      u64 src[PASSES];
#pragma unroll
      for (int p = 0; p < PASSES; ++p) src[p] = ka[crow + p * ROWS_PER_PASS];
#pragma unroll
      for (int p = 0; p < PASSES; ++p) {
        tx_cp_async16_hint(kb + ring_off(crow + p * ROWS_PER_PASS),
                           src[p] ? reinterpret_cast<const void*>(src[p] + cch * 16) : (const void*)kh,
                           src[p] ? 16 : 0, policy);
      }
#pragma unroll
      for (int p = 0; p < PASSES; ++p) src[p] = va[crow + p * ROWS_PER_PASS];
#pragma unroll
      for (int p = 0; p < PASSES; ++p) {
        tx_cp_async16_hint(vb + (VREG ? fp8_voff(crow + p * ROWS_PER_PASS, cch) : ring_off(crow + p * ROWS_PER_PASS)),
                           src[p] ? reinterpret_cast<const void*>(src[p] + cch * 16) : (const void*)vh,
                           src[p] ? 16 : 0, policy);
      }
    }
    tx_cp_async_commit();  // always, so that group counting stays uniform
  };
#if TX_BULK
  // lane l < 2 NSEG of warp 0 copies segment l % NSEG of the K (l < NSEG) or V tile; `pg` holds
  // the page of its segment of the next tile to issue (-1: past the item's end, no copy)
  const bool issuer = warp == 0 && lane < 2 * NSEG;
  auto seg_page = [&](int tile) -> int {
    const int s0 = first + tile * TILE + (lane % NSEG) * SEG;
    return tile < ntiles && s0 < end ? __ldg(pages + (s0 >> pshift)) : -1;
  };
  int pg = issuer ? seg_page(0) : -1;
  auto issue_bulk = [&](int tile) {
    if (warp != 0 || tile >= ntiles) return;
    const int s = tile % STAGES;
    const u32 bar = bars + s * 8;
    const int t0 = first + tile * TILE;
    const int nvalid = min(NSEG, (end - t0 + SEG - 1) / SEG);
    if (lane == 0) tx_mbar_arrive_expect_tx(bar, (u32)(2 * nvalid * SEG_BYTES));
    __syncwarp();
    if (issuer) {
      if (pg >= 0) {
        const int sg = lane % NSEG;
        const bool is_v = lane >= NSEG;
        const u32 dst = sbase + s * STAGE_BYTES + (is_v ? TILE_BYTES : 0) + sg * SEG_PITCH;
        const i64 in = (t0 + sg * SEG) & pmask;
#if TX_TMA
        const TxTensorMap* map = is_v ? &vmap : &kmap;
#pragma unroll
        for (int h = 0; h < D / 64; ++h) {
          if (TX_L2) {
            tx_tma_load_4d_hint(dst + h * SEG * 128, map, 64 * h, (int)in, kvh, pg, bar, policy);
          } else {
            tx_tma_load_4d(dst + h * SEG * 128, map, 64 * h, (int)in, kvh, pg, bar);
          }
        }
#else
        const kv_t* src = is_v ? vh + (i64)pg * v_sp + in * v_st : kh + (i64)pg * k_sp + in * k_st;
        if (TX_L2) {
          tx_bulk_copy_hint(dst, src, (u32)SEG_BYTES, bar, policy);
        } else {
          tx_bulk_copy(dst, src, (u32)SEG_BYTES, bar);
        }
#endif
      }
      pg = seg_page(tile + 1);
    }
  };
#endif

#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) {
#if TX_BULK
    issue_bulk(t);
#else
    issue(t);
#endif
  }

  u32 qf[Q_IN_REGS ? D / 16 : 1][4];
  if (BULK || Q_IN_REGS) {
    if (BULK) {
      tx_cp_async_wait<0>();  // Q (the only cp.async group)
    } else {
      tx_cp_async_wait<STAGES - 1>();  // the Q group (the oldest) has landed
    }
    __syncthreads();
  }
  if (Q_IN_REGS) {
#pragma unroll
    for (int kk = 0; kk < (Q_IN_REGS ? D / 16 : 1); ++kk) {
      const int row = (lane & 7) + (((lane >> 3) & 1) << 3);
      const int ch = kk * 2 + (lane >> 4);
      tx_ldmatrix_x4(qbase + tx_swz(row, ch, ROW_BYTES), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
    }
  }

  // the logit scales of this thread's rows grp and grp + 8 (fp8 under bfloat16 q: times 2^-e of
  // the row's float16 Q; `fin` was written before the barrier after Q's loads)
  float row_scale[2] = {scale_log2, scale_log2};
  if (FP8 && TX_BF16) {
    row_scale[0] = tx_ldexp2(scale_log2, -(int)fin[grp]);
    row_scale[1] = tx_ldexp2(scale_log2, -(int)fin[grp + 8]);
  }
  const float row_over_cap[2] = {cap > 0.f ? row_scale[0] / (cap * LOG2E) : 0.f,  // k_scale sm_scale / cap
                                 cap > 0.f ? row_scale[1] / (cap * LOG2E) : 0.f};

  float o[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m0 = tx_neg_inf(), m1 = tx_neg_inf(), l0 = 0.f, l1 = 0.f;
  const int wrow = warp * TPW;

  for (int i = 0; i < ntiles; ++i) {
    const int s = i % STAGES;
    // the K and V tiles the mma.sync code reads (fp8: K from the ring, V converted after it)
    const u32 kb = sbase + s * STAGE_BYTES, vb = FP8 ? sbase + STAGES * STAGE_BYTES : kb + TILE_BYTES;
    const int t0 = first + i * TILE;
#if TX_BULK
    tx_mbar_wait(bars + s * 8, (u32)((i / STAGES) & 1));
    if (t0 < start || t0 + TILE > end) {
      // V rows of keys outside the item (never copied, or whatever the cache holds there) must
      // be finite for P V: zero them (S masks those keys)
      for (int c = tid; c < TILE * DCH; c += NT) {
        const int row = c / DCH, tok = t0 + row_token(row);
        if (tok < start || tok >= end) tx_st_shared_zero16(vb + kv_row(row, c % DCH));
      }
      tx_fence_proxy_async();  // before a later bulk copy into this stage
    }
    __syncthreads();
    issue_bulk(i + STAGES - 1);
    const int pt = i + STAGES, ptok = 0, ppage = -1;  // (row addresses: cp.async only)
#else
    tx_cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue(i + STAGES - 1);
    // page index of this thread's token of tile i + STAGES (used after the compute below)
    const int pt = i + STAGES;
    const int ptok = start + pt * TILE + tid;
    int ppage = -1;
    if (tid < TILE && pt < ntiles && ptok < end) ppage = __ldg(pages + (ptok >> pshift));
#endif

    float sc[NNT][4];
#pragma unroll
    for (int j = 0; j < NNT; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#if TX_KV_FP8
    // S from the fp8 ring: per 64 dims, one 16-byte load a token row, converted into the B
    // fragments of four k-steps
    const unsigned char* kring = smem + s * STAGE_BYTES;
#pragma unroll
    for (int g = 0; g < D / 64; ++g) {
      u32 a[4][4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int kk = 4 * g + jj;
        if (Q_IN_REGS) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[jj][r] = qf[Q_IN_REGS ? kk : 0][r];
        } else {
          const int row = (lane & 7) + (((lane >> 3) & 1) << 3);
          const int ch = kk * 2 + (lane >> 4);
          tx_ldmatrix_x4(qbase + tx_swz(row, ch, ROW_BYTES), a[jj][0], a[jj][1], a[jj][2], a[jj][3]);
        }
      }
#pragma unroll
      for (int j = 0; j < NNT; ++j) {
        const tx_u4 w = *reinterpret_cast<const tx_u4*>(kring + fp8_off(wrow + j * 8 + grp, 4 * g + tig));
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          u32 b0, b1;
          tx_fp8x4_to_f16<TX_KV_FP8>(words[jj], b0, b1);  // (float16 whatever TX_BF16: Q is float16)
          tx_mma_f16(sc[j], a[jj], b0, b1);
        }
      }
    }
#else
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 a[4];
      if (Q_IN_REGS) {
        a[0] = qf[Q_IN_REGS ? kk : 0][0];
        a[1] = qf[Q_IN_REGS ? kk : 0][1];
        a[2] = qf[Q_IN_REGS ? kk : 0][2];
        a[3] = qf[Q_IN_REGS ? kk : 0][3];
      } else {
        const int row = (lane & 7) + (((lane >> 3) & 1) << 3);
        const int ch = kk * 2 + (lane >> 4);
        tx_ldmatrix_x4(qbase + tx_swz(row, ch, ROW_BYTES), a[0], a[1], a[2], a[3]);
      }
#pragma unroll
      for (int np = 0; np < NNT / 2; ++np) {
        const int row = wrow + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int ch = kk * 2 + ((lane >> 3) & 1);
        u32 b0, b1, b2, b3;
        tx_ldmatrix_x4(kb + kv_row(row, ch), b0, b1, b2, b3);
        tx_mma(sc[2 * np], a, b0, b1);
        tx_mma(sc[2 * np + 1], a, b2, b3);
      }
    }
#endif

    // scale (and soft-cap) into the base-2 domain, mask keys past the range, online softmax
    float mx0 = tx_neg_inf(), mx1 = tx_neg_inf();
#pragma unroll
    for (int j = 0; j < NNT; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int tok = t0 + row_token(wrow + j * 8 + tig * 2 + (c & 1));
        float x = sc[j][c];
        x = cap > 0.f ? cap_log2 * tx_tanh(x * row_over_cap[c >> 1]) : x * row_scale[c >> 1];
        x = tok < end && (!BULK || tok >= start) ? x : tx_neg_inf();
        sc[j][c] = x;
        if (c < 2) {
          mx0 = fmaxf(mx0, x);
        } else {
          mx1 = fmaxf(mx1, x);
        }
      }
    }
    mx0 = tx_warp_max4(mx0);
    mx1 = tx_warp_max4(mx1);
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == tx_neg_inf() ? 0.f : mn0;
    const float mu1 = mn1 == tx_neg_inf() ? 0.f : mn1;
    const float al0 = tx_exp2(m0 - mu0), al1 = tx_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
    for (int j = 0; j < NNT; ++j) {
      sc[j][0] = tx_exp2(sc[j][0] - mu0);
      sc[j][1] = tx_exp2(sc[j][1] - mu0);
      sc[j][2] = tx_exp2(sc[j][2] - mu1);
      sc[j][3] = tx_exp2(sc[j][3] - mu1);
      rs0 += sc[j][0] + sc[j][1];
      rs1 += sc[j][2] + sc[j][3];
    }
    l0 = l0 * al0 + rs0;
    l1 = l1 * al1 + rs1;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      o[t][0] *= al0;
      o[t][1] *= al0;
    }
    if (nrows > 8) {  // rows 8..15 of the tile are padding for groups of up to 8 query heads
#pragma unroll
      for (int t = 0; t < D / 8; ++t) {
        o[t][2] *= al1;
        o[t][3] *= al1;
      }
    }

#if TX_KV_FP8 && !TX_VREG
    // this warp's V rows (its tokens of the tile), converted into the 16-bit V tile; only this
    // warp reads them (and it is done with the previous tile's: its ldmatrix calls came first)
    {
      const unsigned char* vring = smem + s * STAGE_BYTES + RING_TILE_BYTES;
      unsigned char* conv = smem + STAGES * STAGE_BYTES;
#pragma unroll
      for (int c = lane; c < TPW * KCH; c += 32) {
        const int row = wrow + c / KCH, ch = c % KCH;
        const tx_u4 in = *reinterpret_cast<const tx_u4*>(vring + fp8_off(row, ch));
        tx_u4 lo, hi;
        tx_fp8x4_to_f16<TX_KV_FP8>(in.x, lo.x, lo.y);  // (float16 whatever TX_BF16: P V is float16)
        tx_fp8x4_to_f16<TX_KV_FP8>(in.y, lo.z, lo.w);
        tx_fp8x4_to_f16<TX_KV_FP8>(in.z, hi.x, hi.y);
        tx_fp8x4_to_f16<TX_KV_FP8>(in.w, hi.z, hi.w);
        *reinterpret_cast<tx_u4*>(conv + tx_swz(row, 2 * ch, ROW_BYTES)) = lo;
        *reinterpret_cast<tx_u4*>(conv + tx_swz(row, 2 * ch + 1, ROW_BYTES)) = hi;
      }
      __syncwarp();
    }
#endif
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks) {
      u32 pa[4];
      pa[0] = pv_pack2(sc[2 * ks][0], sc[2 * ks][1]);
      pa[1] = pv_pack2(sc[2 * ks][2], sc[2 * ks][3]);
      pa[2] = pv_pack2(sc[2 * ks + 1][0], sc[2 * ks + 1][1]);
      pa[3] = pv_pack2(sc[2 * ks + 1][2], sc[2 * ks + 1][3]);
#if TX_VREG
      // B fragments from the fp8 ring: lane (grp, tig) needs keys 2 tig, 2 tig + 1 (b0) and
      // 2 tig + 8, 2 tig + 9 (b1) of the k-step at one dim per n8 tile. It loads 4 bytes (dims
      // 32 b + 4 grp .. + 3) of each of the four rows; a byte permutation pairs the two keys'
      // codes of one dim, and each pair converts into one float16x2 register. So n8 tile 4 b + e
      // holds, at fragment column grp, cache dim 32 b + 4 grp + e: the epilogue puts them back.
      {
        const unsigned char* vring = smem + s * STAGE_BYTES + RING_TILE_BYTES;
        const int r0 = wrow + ks * 16 + 2 * tig;
#pragma unroll
        for (int b = 0; b < D / 32; ++b) {
          const int ch = 2 * b + (grp >> 2), in = 4 * (grp & 3);
          const u32 w0 = *reinterpret_cast<const u32*>(vring + fp8_voff(r0, ch) + in);
          const u32 w1 = *reinterpret_cast<const u32*>(vring + fp8_voff(r0 + 1, ch) + in);
          const u32 w2 = *reinterpret_cast<const u32*>(vring + fp8_voff(r0 + 8, ch) + in);
          const u32 w3 = *reinterpret_cast<const u32*>(vring + fp8_voff(r0 + 9, ch) + in);
          u32 b0[4], b1[4];
          tx_fp8x4_to_f16<TX_KV_FP8>(tx_prmt(w0, w1, 0x5140u), b0[0], b0[1]);  // dims +0, +1
          tx_fp8x4_to_f16<TX_KV_FP8>(tx_prmt(w0, w1, 0x7362u), b0[2], b0[3]);  // dims +2, +3
          tx_fp8x4_to_f16<TX_KV_FP8>(tx_prmt(w2, w3, 0x5140u), b1[0], b1[1]);
          tx_fp8x4_to_f16<TX_KV_FP8>(tx_prmt(w2, w3, 0x7362u), b1[2], b1[3]);
#pragma unroll
          for (int e = 0; e < 4; ++e) pv_mma(o[4 * b + e], pa, b0[e], b1[e]);
        }
      }
      if (VREG) continue;
#endif
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int row = wrow + ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int ch = dp * 2 + (lane >> 4);
        u32 b0, b1, b2, b3;
        tx_ldmatrix_x4_trans(vb + kv_row(row, ch), b0, b1, b2, b3);
        pv_mma(o[2 * dp], pa, b0, b1);
        pv_mma(o[2 * dp + 1], pa, b2, b3);
      }
    }

    // row addresses of tile i + STAGES into the ring slot of tile i (read when it is issued, next iteration)
    if (!BULK && tid < TILE && pt < ntiles) {
      u64 ka = 0, va = 0;
      if (ppage >= 0) {
        const i64 in = ptok & pmask;
        ka = reinterpret_cast<u64>(kh + (i64)ppage * k_sp + in * k_st);
        va = reinterpret_cast<u64>(vh + (i64)ppage * v_sp + in * v_st);
      }
      raddr[(s * 2) * TILE + tid] = ka;
      raddr[(s * 2 + 1) * TILE + tid] = va;
    }
  }

  // ---- merge the warps' partial softmax states --------------------------------------------
  tx_cp_async_wait<0>();
  l0 = tx_warp_sum4(l0);
  l1 = tx_warp_sum4(l1);
  if (tig == 0) {
    ml[(warp * 16 + grp) * 2] = m0;
    ml[(warp * 16 + grp) * 2 + 1] = l0;
    ml[(warp * 16 + grp + 8) * 2] = m1;
    ml[(warp * 16 + grp + 8) * 2 + 1] = l1;
  }
  __syncthreads();  // also: every warp is done with the stage buffers, reused below
  float M0 = tx_neg_inf(), M1 = tx_neg_inf();
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    M0 = fmaxf(M0, ml[(w * 16 + grp) * 2]);
    M1 = fmaxf(M1, ml[(w * 16 + grp + 8) * 2]);
  }
  float L0 = 0.f, L1 = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    L0 += ml[(w * 16 + grp) * 2 + 1] * tx_exp2(ml[(w * 16 + grp) * 2] - M0);
    L1 += ml[(w * 16 + grp + 8) * 2 + 1] * tx_exp2(ml[(w * 16 + grp + 8) * 2] - M1);
  }
  if (sinks != nullptr && slot < 0) {
    // a whole request: each row's sink joins its denominator here (a split request's merge adds
    // it once, after the partials, which leave it out)
    tx_fold_sink(M0, L0, grp < nrows ? __ldg(sinks + head0 + grp) * LOG2E : tx_neg_inf());
    tx_fold_sink(M1, L1, grp + 8 < nrows ? __ldg(sinks + head0 + grp + 8) * LOG2E : tx_neg_inf());
  }
  const float f0 = tx_exp2(m0 - M0) / L0, f1 = tx_exp2(m1 - M1) / L1;
  float* red = reinterpret_cast<float*>(smem);  // [WARPS][16][D]
#pragma unroll
  for (int t = 0; t < D / 8; ++t) {
    // the dims of this thread's two accumulator columns (TX_VREG: n8 tile 4 b + e, column c is dim
    // 32 b + 4 c + e)
    const int dim = VREG ? 32 * (t >> 2) + 8 * tig + (t & 3) : t * 8 + tig * 2;
    const int dim1 = VREG ? dim + 4 : dim + 1;
    if (grp < nrows) {
      red[(warp * 16 + grp) * D + dim] = o[t][0] * f0;
      red[(warp * 16 + grp) * D + dim1] = o[t][1] * f0;
    }
    if (grp + 8 < nrows) {
      red[(warp * 16 + grp + 8) * D + dim] = o[t][2] * f1;
      red[(warp * 16 + grp + 8) * D + dim1] = o[t][3] * f1;
    }
  }
  if (warp == 0 && tig == 0) {
    fin[grp * 2] = M0;
    fin[grp * 2 + 1] = L0;
    fin[(grp + 8) * 2] = M1;
    fin[(grp + 8) * 2 + 1] = L1;
  }
  __syncthreads();
  for (int c = tid; c < nrows * (D / 4); c += NT) {
    const int r = c / (D / 4), d4 = (c % (D / 4)) * 4;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float* p = red + (w * 16 + r) * D + d4;
      a0 += p[0];
      a1 += p[1];
      a2 += p[2];
      a3 += p[3];
    }
    const i64 qh = head0 + r;
    if (slot < 0) {
      u32* dst = reinterpret_cast<u32*>(out + ((i64)req * H + qh) * D + d4);
      dst[0] = tx_pack2(a0 * v_scale, a1 * v_scale);
      dst[1] = tx_pack2(a2 * v_scale, a3 * v_scale);
    } else {
      float* dst = part_o + ((i64)slot * H + qh) * D + d4;
      dst[0] = a0;
      dst[1] = a1;
      dst[2] = a2;
      dst[3] = a3;
    }
  }
  if (tid < nrows) {
    const float value = (fin[tid * 2] + tx_log2(fin[tid * 2 + 1])) * LN2;
    if (slot < 0) {
      if (lse != nullptr) lse[(i64)req * H + head0 + tid] = value;
    } else {
      part_lse[(i64)slot * H + head0 + tid] = value;
    }
  }
  if (slot < 0) return;

  // ---- split request: the CTA that finishes last merges the partials ----------------------
  // out = sum_i w_i o_i / sum_i w_i with w_i = exp(lse_i - max lse), lse = max lse + log(sum_i w_i),
  // over the request's slots in order (the same operations whichever CTA merges: deterministic).
  __threadfence();  // this CTA's partial is visible device-wide before its ticket is taken
  __syncthreads();
  int* counter = counters + (i64)req * units + unit;
  if (tid == 0) flag[0] = atomicAdd(counter, 1) == nsplit - 1;
  __syncthreads();
  if (flag[0] == 0) return;
  __threadfence();  // the other CTAs' partials (their tickets came before ours)
  // One pass in slot order with a running max (rescaling when it grows), MERGE_BATCH slots'
  // loads in flight at a time (ld.global.cg: L2, where the other CTAs' partials are).
  constexpr int MERGE_BATCH = 8;
  for (int c = tid; c < nrows * (D / 4); c += NT) {
    const int r = c / (D / 4), d4 = (c % (D / 4)) * 4;
    const i64 qh = head0 + r;
    const float* lp = part_lse + (i64)first_slot * H + qh;
    const float* op = part_o + ((i64)first_slot * H + qh) * D + d4;
    float M = tx_neg_inf(), S = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int i0 = 0; i0 < nsplit; i0 += MERGE_BATCH) {
      float x[MERGE_BATCH];
      float4 p[MERGE_BATCH];
#pragma unroll
      for (int j = 0; j < MERGE_BATCH; ++j) {
        const bool ok = i0 + j < nsplit;
        x[j] = ok ? __ldcg(lp + (i64)(i0 + j) * H) : 0.f;
        p[j] = ok ? __ldcg(reinterpret_cast<const float4*>(op + (i64)(i0 + j) * H * D)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < MERGE_BATCH; ++j) {
        if (i0 + j < nsplit) {
          if (x[j] > M) {
            const float f = tx_exp2((M - x[j]) * LOG2E);  // 0 while M is -inf
            S *= f;
            a0 *= f;
            a1 *= f;
            a2 *= f;
            a3 *= f;
            M = x[j];
          }
          const float w = tx_exp2((x[j] - M) * LOG2E);
          S += w;
          a0 += w * p[j].x;
          a1 += w * p[j].y;
          a2 += w * p[j].z;
          a3 += w * p[j].w;
        }
      }
    }
    if (sinks != nullptr) {  // the sink joins the merged denominator once (natural-log units here)
      const float sk = __ldg(sinks + qh);
      if (sk > M) {
        const float f = tx_exp2((M - sk) * LOG2E);
        S *= f;
        a0 *= f;
        a1 *= f;
        a2 *= f;
        a3 *= f;
        M = sk;
      }
      S += tx_exp2((sk - M) * LOG2E);
    }
    const float inv = 1.0f / S;
    u32* dst = reinterpret_cast<u32*>(out + ((i64)req * H + qh) * D + d4);
    dst[0] = tx_pack2(a0 * inv * v_scale, a1 * inv * v_scale);
    dst[1] = tx_pack2(a2 * inv * v_scale, a3 * inv * v_scale);
    if (lse != nullptr && d4 == 0) lse[(i64)req * H + qh] = M + tx_log2(S) * LN2;
  }
  if (tid == 0) *counter = 0;  // every ticket of this launch is drawn: ready for the next one
}
