// Paged prefill attention for Hopper (sm_90a): wgmma (warpgroup MMA) with a warp-specialised
// cp.async pipeline. Same arguments, work list and semantics as kernels/prefill.cu (the
// mma.sync kernel), so the plan launches either one.
//
// Work item = (request, first query token of a q tile); grid x = item x head group, heads
// fastest, in sections of `head_section` head groups as in prefill.cu (or fewer CTAs with
// TX_PERSIST, see below); CTAs past `num_items` exit at once (CUDA-graph capacity). Row r of the CTA's
// TX_QTILE rows is (token t0 + r / pack, query head head0 + r % pack), as in prefill.cu.
//
// Warps: TX_QTILE / 64 consumer warpgroups (4 warps each; warpgroup w owns rows
// [64 w, 64 w + 64)) and a producer warpgroup after them. With two consumer warpgroups the 384
// threads launch with 168 registers each; setmaxnreg then moves registers from the producer (40)
// to the consumers (232), which hold O, S and P. With one (up to d128), 256 threads launch with
// 128 (two CTAs fit an SM where shared memory allows: one's prologue and epilogue overlap the
// other's loop) and the consumers get 216. The producer walks the CTA's key range
// [kv_lo, kv_hi) in tiles of TX_KVTILE keys, each of its warps a quarter of every tile: a lane
// looks up its key's page (one tile ahead) and writes the key's K and V row pointers to shared
// memory; then the warp gathers the rows with cp.async (16-byte chunks; at d128 a half-warp per
// 256-byte row, so every warp instruction reads whole rows) into a TX_STAGES-deep ring. Each K
// and each V tile has a "full" mbarrier (128 arrivals: every producer thread's
// cp.async.mbarrier.arrive.noinc, which fires once that thread's copies have landed) and an
// "empty" mbarrier (one arrival per consumer warp), so K of tile i + 1 streams in while V of
// tile i is still in use. Keys past kv_hi read the row of key kv_hi - 1 (real data, masked
// later), so every copy is a whole 16 bytes.
//
// Shared-memory tiles use the 128-byte swizzle wgmma descriptors read: a tile of R rows of D
// 16-bit elements is D / 64 column blocks of R x 128 bytes; 16-byte chunk c of row r of a block
// sits at r * 128 + ((c ^ (r % 8)) * 16). Every tile starts 1024-byte aligned (the swizzle is a
// function of address bits [4:6] ^ [7:9]).
//
// Per consumer warpgroup and tile (the warpgroup skips the math of a tile outside all of its
// rows' key ranges but still takes part in the barrier protocol):
//   S = Q K^T: D / 16 wgmma.m64nNk16 (N = TX_KVTILE), A = Q and B = K from shared memory, both
//     K-major (descriptor: SBO = 1024 bytes between 8-row groups; the k16 step advances the
//     start address by 32 bytes inside a 128-byte row, or to the next column block);
//   wait for S (and for the previous tile's P V), release K (and the previous V);
//   soft-cap, masking only where the tile crosses a row bound, online softmax in fp32 registers
//   (thread t of warp w holds rows 16 w + t / 4 and + 8 of the warpgroup's 64; a row's columns
//   are spread over the 4 threads of a quad, so row reductions are two shuffles, as in
//   prefill.cu), O rescaled;
//   O += P V: TX_KVTILE / 16 wgmma.m64nDk16 with P from registers (the accumulator layout of S,
//     packed to 16 bits pairwise, is the A-fragment layout) and V from shared memory MN-major
//     (imm-trans-b = 1; LBO = the distance between 64-column blocks of d, SBO = 1024 bytes
//     between 8-key groups). It is left running: the next tile's S is issued before waiting.
// Epilogue: O / l written through the warpgroup's own Q rows (same swizzle, no bank conflicts)
// and stored with 16-byte writes (TX_PERSIST: from registers, see below); LSE = (m + log2 l) ln 2.
// Deterministic: every output element is computed by one CTA in a fixed order.
//
// Shared memory (dynamic, 1024-byte aligned): [Q: TX_QTILE rows] [stages x (K tile, V tile)]
// [TX_KV_FP8: TX_STAGED staged fp8 (K, V) pairs] [row pointers: TX_KVTILE x (K, V)]
// [mbarriers: 4 x stages] [TX_DYN: 4 mbarriers, 2 turns, 8 bytes of padding] (prefill.prefill_smem_bytes).
//
// TX_KV_FP8 (1: e4m3fn, 2: e5m2): an fp8 KV cache under 16-bit q and out. wgmma reads 16-bit
// operands from shared memory, so the producer converts: each producer thread copies its own
// 16-byte chunks of a tile's fp8 rows (16 keys' values of one row, unswizzled) into the staging
// pair with cp.async, waits for its own copies (cp.async.wait_group: no other thread reads them),
// converts them exactly (kernels/fp8.cuh) into the two 16-bit chunks of the ring's swizzled tile
// once the consumers have released that slot, fences the stores for the async proxy and arrives
// on the slot's "full" mbarrier. The staged pairs are a ring of their own (TX_STAGED deep, 1 or
// 2: as many as shared memory holds beside the 16-bit ring): K of tile i + TX_STAGED is copied
// into K's staged slot as soon as K of tile i is converted out of it (and V likewise), so the
// copies of the next tiles are in flight while the 16-bit slots wait for the consumers (with one
// staged pair the copy's latency added to each tile's conversion: on the H200 P1 ran 1.3x the
// 16-bit cache's time). The consumers are unchanged but for P V, which runs in float16 over an
// fp8 cache (`pv_wgmma`; the producer converts V to float16); the scales are folded into the
// softmax scale and the output's 1 / l. The two 16-bit chunks of a thread go out in an order
// that keeps every quarter-warp's stores on distinct bank groups.
// TX_QK16=1 (an fp8 cache under bfloat16 q; opt-in, paged.fp8_qk16): Q K^T runs in float16 too,
// so K's conversion is the one-instruction-a-pair float16 one (to bfloat16 it is four). On the
// H200 it did not pay: P1 over an e4m3 cache took 779 us with it and 774 without, against 744
// with float16 q, same tactic and process (session 34's probe); the rescale below is on the
// consumers' path at every item, the conversion it saves was not. Each consumer warp rewrites its own 16 Q rows in shared memory as
// float16 times 2^e, e from the rows' largest magnitude (`qk16_convert_q` with fp8.cuh's
// `tx_f16_row_exponent`, as decode.cu scales its Q rows): every bfloat16
// value within 31 binades of it is exact in float16, smaller ones move the dot products by less
// than 2^-40 of their largest term, and nothing overflows; the warp's logits (its accumulator rows
// are its Q rows) take 2^-e back with the softmax scale.
//
// TX_DVO (v's and out's head dim, where it differs from q's and k's TX_D: DeepSeek's 192 / 128,
// 128 / 64): K and V tiles have their own widths, S = Q K^T runs over TX_D (three 64-column
// blocks at 192), P V over TX_DVO (N = TX_DVO), O holds TX_DVO columns and goes out through Q's
// rows (so TX_DVO <= TX_D). A K row of d192 is 24 chunks: 8 lanes of each producer warp copy none.
//
// TX_KV_TMA=1 (ragged-KV prefill over 16-bit K and V, `prefill.ragged_tma`): the batch is one-token
// pages over the identity table, so key j of a request is row page_base + j of the packed K and V.
// The kernel takes tensor maps of them ([tokens][heads][dim], boxes of 64 x 1 x TX_KVTILE, the
// 128-byte swizzle above) and one producer thread issues each tile's D / 64 (K) and DV / 64 (V)
// boxes against the stage's "full" mbarrier (initialised for one arrival: arrive.expect_tx with
// the tile's bytes); the page lookups, row pointers and cp.async gather are skipped. Rows past
// kv_hi hold the next request's keys or, past the tensors' end, zeros: masked, so the output is
// the gather's bit for bit.
// TX_PERSIST=1 (tactic param persist): persistent CTAs. The grid is what the GPU holds at once;
// CTA b walks virtual CTAs (item x head group) b, b + gridDim.x, ... with the K/V ring, its
// mbarrier phases and the tile count running on across them: each consumer warpgroup releases
// the item's last V tile before its epilogue, so the producer gathers the next item's keys
// meanwhile, and copies the next item's Q rows into its own before the epilogue, which writes O
// from registers (without TX_PERSIST it goes through the Q rows). Every consumer warpgroup keeps
// the protocol for every item.
// TX_DYN=1 (tactic param sched 3, with persist): after the first round the persistent CTAs take
// their turns from a counter in global memory (`turns`, two ints of the plan's metadata) rather
// than in a fixed order (see the kernel).
// TX_PINGPONG=1 (tactic param pingpong, two consumer warpgroups): FlashAttention-3's ping-pong.
// Named barriers PP_BAR + wg are the warpgroups' turns at the tensor cores; in its turn a
// warpgroup issues S of tile i and P V of tile i - 1, then passes the turn and computes the
// softmax of S while the other's GEMMs run (see the loop).
//
// Compile-time parameters: TX_BF16, TX_D (64, 128, 192, 256), TX_DVO (64, 128, 256; default TX_D),
// TX_QTILE (64, 128), TX_KVTILE (64, 128), TX_STAGES (2..4), TX_PERSIST, TX_PINGPONG, TX_SNAKE, TX_DYN,
// TX_KV_FP8, TX_FP8_CVT (see fp8.cuh), TX_STAGED (1, 2), TX_QK16, TX_SMEM (optional: the size the host
// computed, checked against the layout). One kernel serves every combination of the options: a second copy
// once kept for the case of neither was measured on the H200 to be no faster (B/A 0.992-0.997 on
// P1 and P3, identical outputs: benchmarks/results/h200-prefill-kernel-ab.json) and removed.
// Needs sm_90a (wgmma); kernels/prefill.cu serves other GPUs.
#include "common.cuh"
#include "fp8.cuh"

#ifndef TX_D
#error "TX_D must be defined"
#endif
#ifndef TX_QTILE
#define TX_QTILE 128
#endif
#ifndef TX_KVTILE
#define TX_KVTILE 128
#endif
#ifndef TX_STAGES
#define TX_STAGES 2
#endif
#ifndef TX_PERSIST
#define TX_PERSIST 0
#endif
#ifndef TX_SNAKE
#define TX_SNAKE 0
#endif
#ifndef TX_PINGPONG
#define TX_PINGPONG 0
#endif
#ifndef TX_STAGED
#define TX_STAGED 1
#endif
#ifndef TX_KV_TMA
#define TX_KV_TMA 0
#endif
#ifndef TX_DYN
#define TX_DYN 0
#endif

constexpr int D = TX_D;      // q's and k's head dim
#ifndef TX_DVO
#define TX_DVO TX_D
#endif
constexpr int DV = TX_DVO;   // v's and out's head dim (TX_DVO: DeepSeek's 192 / 128)
constexpr int BQ = TX_QTILE;
constexpr int BK = TX_KVTILE;
constexpr int STAGES = TX_STAGES;
constexpr bool PERSIST = TX_PERSIST != 0;  // each CTA loops over work items (see the top)
constexpr bool SNAKE = PERSIST && TX_SNAKE != 0;  // rounds of persistent CTAs back and forth (see the kernel)
constexpr bool DYN = PERSIST && TX_DYN != 0;       // persistent CTAs take turns from a counter (see the top)
constexpr int CWG = BQ / 64;            // consumer warpgroups
constexpr bool PINGPONG = TX_PINGPONG != 0;  // the two consumer warpgroups take turns (see the top)
constexpr int PRODUCER = 128 * CWG;     // first thread of the producer warpgroup (the last one)
constexpr int NT = PRODUCER + 128;
constexpr int ROW_BYTES = D * 2;         // a Q or K row
constexpr int CH = D / 8;                // 16-byte chunks per Q or K row
constexpr int CHV = DV / 8;              // ... per V or out row
constexpr int WG_Q_BYTES = 64 * ROW_BYTES;
constexpr int Q_BYTES = BQ * ROW_BYTES;
constexpr int TILE_BYTES = BK * ROW_BYTES;    // a K tile
constexpr int V_TILE_BYTES = BK * DV * 2;     // a V tile
constexpr int STAGE_BYTES = TILE_BYTES + V_TILE_BYTES;
constexpr bool FP8 = TX_KV_FP8 != 0;
constexpr bool KV_TMA = TX_KV_TMA != 0;  // ragged K/V tiles through tensor maps (see the top)
#ifndef TX_QK16
#define TX_QK16 0
#endif
// fp8 cache under bfloat16 q (TX_QK16, see the top): Q K^T in float16, Q scaled by a power of two per warp
constexpr bool QK16 = FP8 && TX_BF16 && TX_QK16 != 0;
constexpr int CH8 = D / 16;                  // fp8: 16-byte chunks per cache row
constexpr int RPI8 = 32 / CH8;               // fp8: rows per producer warp instruction
constexpr int STG_TILE = BK * D;             // fp8: a staged tile, rows as copied
constexpr int NSTG = TX_STAGED;              // fp8: staged (K, V) pairs
constexpr int RING = Q_BYTES;                           // offsets in dynamic shared memory
constexpr int STG = RING + STAGES * STAGE_BYTES;        // fp8: the staged (K, V) pairs
constexpr int ROWP = STG + (FP8 ? NSTG * 2 * STG_TILE : 0);  // [BK][2] row pointers (K, V)
constexpr int BARS = ROWP + BK * 16;                    // [4][STAGES] mbarriers
constexpr int TURNS = BARS + 4 * STAGES * 8;            // TX_DYN: [2] "full", [2] "empty" mbarriers, [2] turns
constexpr int SMEM_END = TURNS + (DYN ? 48 : 0);
constexpr int FULL_K = 0, FULL_V = 1, EMPTY_K = 2, EMPTY_V = 3;
constexpr int RW = BK / 4;                   // rows of a tile per producer warp
constexpr int RPI = CH >= 32 ? 1 : 32 / CH;  // K rows per producer warp instruction (CH lanes a row)
constexpr int RPIV = CHV >= 32 ? 1 : 32 / CHV;  // V rows likewise
// the producer's gather loops unrolled whole, but by 8 with unequal head dims: whole, the row
// pointers of 32 (d192) or 16 rows spill past the producer's 40 registers
constexpr int K_UNROLL = D == DV ? RW / RPI : 8;
constexpr int V_UNROLL = D == DV ? RW / RPIV : 8;
// Registers per thread after setmaxnreg. Two consumer warpgroups (384 threads, launched with 168
// each): the producer gives back 128, the consumers take 64 each. One consumer warpgroup up to
// d128 (256 threads, launched with 128 each so that two CTAs fit an SM): the producer gives 88 to
// it. One consumer warpgroup at d256 (its m64n256k16 needs more than 128 at launch): no exchange.
constexpr bool TWO_CTAS = CWG == 1 && D <= 128 && DV <= 128;
constexpr bool REBALANCE = CWG == 2 || TWO_CTAS;
constexpr int LAUNCH_REGS = CWG == 2 ? 168 : 128;
constexpr int MIN_CTAS = TWO_CTAS ? 2 : 1;
// TX_PERSIST with 128-key tiles at d128 (a producer warp gathers 32 rows of 256 bytes a tile): the
// producer's loop over items needs 16 more (56); the two consumer warpgroups give 8 each (224).
// (With one consumer warpgroup that leaves it too few: PrefillParams.reasons refuses q_tile 64 there.)
// TX_DYN over the gather needs 56 too (the turn hand-over beside the gather's row pointers), and
// 72 at d128 with 128-key tiles (the consumers keep 216).
constexpr int PRODUCER_REGS = (TX_DYN && !KV_TMA && BK == 128 && D == 128) ? 72
                              : ((PERSIST && BK == 128 && D == 128) || (TX_DYN && !KV_TMA)) ? 56 : 40;
constexpr int CONSUMER_REGS = (CWG == 2 ? 232 : 216) - (PRODUCER_REGS - 40) / CWG;
constexpr float LN2 = 0.6931471805599453f;
constexpr float LOG2E = 1.4426950408889634f;
constexpr int NO_LOWER = -(1 << 30);

static_assert(D == 64 || D == 128 || D == 192 || D == 256, "q/k head dim must be 64, 128, 192 or 256");
static_assert(DV == 64 || DV == 128 || DV == 256, "v/o head dim must be 64, 128 or 256 (a wgmma N of P V)");
static_assert(DV == D || !(TX_KV_FP8), "an fp8 cache needs equal head dims");
static_assert(BQ == 64 || BQ == 128, "TX_QTILE must be 64 or 128 (one or two consumer warpgroups)");
static_assert(BK == 64 || BK == 128, "TX_KVTILE must be 64 or 128");
static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 stages");
static_assert(!PINGPONG || CWG == 2, "TX_PINGPONG needs two consumer warpgroups (TX_QTILE 128)");
static_assert(CH <= 32 && CHV <= 32 && RW % RPI == 0 && RW % RPIV == 0 && RW <= 32,
              "whole rows per producer warp pass, one key per lane");
static_assert(TX_KV_FP8 >= 0 && TX_KV_FP8 <= 2, "TX_KV_FP8: 0 (16-bit cache), 1 (e4m3fn) or 2 (e5m2)");
static_assert(!FP8 || RW % RPI8 == 0, "fp8: whole rows per producer warp pass");
static_assert(NSTG == 1 || NSTG == 2, "TX_STAGED: 1 or 2 staged fp8 pairs");
static_assert(!KV_TMA || !FP8, "TX_KV_TMA: 16-bit K and V only (an fp8 cache is converted by the producer)");
static_assert(!(TX_DYN) || (PERSIST && !SNAKE && !FP8),
              "TX_DYN: persistent CTAs over a 16-bit cache, without TX_SNAKE");
static_assert(!REBALANCE || PRODUCER_REGS + CWG * CONSUMER_REGS <= (CWG + 1) * LAUNCH_REGS,
              "the register hand-over must balance");
#ifdef TX_SMEM  // the dynamic shared memory the plan launches with (prefill.prefill_smem_bytes)
static_assert(SMEM_END == TX_SMEM, "prefill.prefill_smem_bytes disagrees with this kernel's layout");
#endif

#include "sm90.cuh"

constexpr int PP_BAR = 3;  // named barriers PP_BAR + wg: warpgroup wg's turn (TX_PINGPONG)

// A K or V tile whose "full" mbarrier this thread has seen complete, made visible to its wgmma:
// the producer's cp.async writes are generic-proxy stores, which the async proxy (wgmma) sees only
// after a proxy fence; tiles the tensor memory accelerator wrote (TX_KV_TMA) are async-proxy
// writes already, so there the fence (one a tile per consumer thread) is left out.
TX_DEVICE void kv_for_wgmma() {
  if constexpr (!KV_TMA) tx_fence_proxy_async();
}

// O += P V in the kernel's 16-bit type, or over an fp8 cache in float16 whatever q's type: V's
// conversion to float16 is one instruction a pair (to bfloat16 four), every fp8 value is a
// float16 value, and P (in [0, 1]) keeps more bits in float16 than in bfloat16.
TX_DEVICE u32 pv_pack2(float lo, float hi) { return FP8 ? tx_pack2_f16(lo, hi) : tx_pack2(lo, hi); }
template <int N>
TX_DEVICE void pv_wgmma(float* d, const u32* a, u64 desc_b, int scale_d) {
  if constexpr (FP8) {
    tx_wgmma_rs_t_f16<N>(d, a, desc_b, scale_d);
  } else {
    tx_wgmma_rs_t<N>(d, a, desc_b, scale_d);
  }
}

// S = Q K^T: in float16 with TX_QK16 (Q converted in shared memory, K converted to float16 by the
// producer), else in the kernel's 16-bit type.
template <int N>
TX_DEVICE void qk_wgmma(float* d, u64 desc_a, u64 desc_b, int scale_d) {
  if constexpr (QK16) {
    tx_wgmma_ss_f16<N>(d, desc_a, desc_b, scale_d);
  } else {
    tx_wgmma_ss<N>(d, desc_a, desc_b, scale_d);
  }
}

// TX_QK16: this warp's 16 Q rows of the warpgroup's tile at `qoff` (bfloat16, swizzled, landed
// and visible to the warp) rewritten in place as float16 times 2^e, e from the rows' largest
// magnitude (`tx_f16_row_exponent`, fp8.cuh: it lands in [2^14, 2^15), so every bfloat16 value
// within 31 binades of it converts exactly and none overflows). Returns e: the warp's logits (its
// accumulator rows 16 warp + grp and + 8 are these rows) take 2^-e back. Zero rows give e = 0.
TX_DEVICE int qk16_convert_q(unsigned char* smem, u32 qoff, int warp, int lane) {
  float mx = 0.f;
  for (int c = lane; c < 16 * CH; c += 32) {
    const tx_u4 in = *reinterpret_cast<const tx_u4*>(smem + qoff + sw128(16 * warp + c / CH, c % CH, 64));
    const u32 w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mx = fmaxf(mx, fabsf(tx_to_float((u16)(w[j] & 0xffffu))));
      mx = fmaxf(mx, fabsf(tx_to_float((u16)(w[j] >> 16))));
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
  const int e = tx_f16_row_exponent(mx);
  for (int c = lane; c < 16 * CH; c += 32) {
    const u32 at = qoff + sw128(16 * warp + c / CH, c % CH, 64);
    const tx_u4 in = *reinterpret_cast<const tx_u4*>(smem + at);
    const u32 w[4] = {in.x, in.y, in.z, in.w};
    u32 h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      h[j] = tx_pack2_f16(tx_ldexp2(tx_to_float((u16)(w[j] & 0xffffu)), e),
                          tx_ldexp2(tx_to_float((u16)(w[j] >> 16)), e));
    *reinterpret_cast<tx_u4*>(smem + at) = tx_u4{h[0], h[1], h[2], h[3]};
  }
  return e;
}

// One work item as the producer and the consumers both see it: virtual CTA v = (item, head group),
// heads fastest. The token at index t of the request sits at position delta + t.
struct Item {
  int t0, q_start, kv_len, page_base, nt, head0, delta, kv_lo, kv_hi, ntiles;
};
// keys [lo, hi] attended by the token at local index tl of the item (0 <= tl < nt)
TX_DEVICE int key_lo(const Item& it, int tl, int win) { return win >= 0 ? it.delta + it.t0 + tl - win : NO_LOWER; }
TX_DEVICE int key_hi(const Item& it, int tl, bool is_causal) {
  return is_causal ? it.delta + it.t0 + tl : it.kv_len - 1;
}
// Logits of keys outside their row's [lo, hi] to -inf: register j of a thread holds key
// `key0` + 8 (j / 4) + j % 2 (key0 = the tile's first key + 2 x the thread's place in its quad)
// of row r0 (j & 2 clear) or r1. The bounds are moved to offsets from key0, so each test is one
// compare with a constant; LO false: every key of the tile is at or past both rows' lower bounds
// (a causal tile on the diagonal), so only the upper bounds are tested.
template <bool LO>
TX_DEVICE void mask_tile(float (&sc)[BK / 2], int key0, int lo0, int hi0, int lo1, int hi1) {
  const int l0 = lo0 - key0, h0 = hi0 - key0, l1 = lo1 - key0, h1 = hi1 - key0;
#pragma unroll
  for (int j = 0; j < BK / 2; ++j) {
    const int c = 8 * (j >> 2) + (j & 1);
    const bool ok = (j & 2) ? (!LO || c >= l1) && c <= h1 : (!LO || c >= l0) && c <= h0;
    sc[j] = ok ? sc[j] : tx_neg_inf();
  }
}

// the virtual CTA of turn u (= round r x G + CTA b): r G + b in even rounds, r G + G - 1 - b in odd ones
TX_DEVICE int snake_turn(int u, int G) {
  const int r = u / G;
  return (r & 1) ? 2 * r * G + G - 1 - u : u;
}
// the work item and head group of virtual CTA v
TX_DEVICE void item_head(int v, int hgs, int section, int n_items, int& item, int& hg) {
  if constexpr (PERSIST) {  // heads fastest, one section (the plan passes hgs): the persistent
    item = v / hgs;         // producer's 40 registers hold no more live values (fp8 spilled)
    hg = v % hgs;
  } else {
    tx_item_head(v, hgs, section, n_items, item, hg);
  }
}
// the Item of work item (req, t0) in head group hg (the work list's two ints already loaded)
TX_DEVICE Item item_of(int req, int t0, int hg, const int* __restrict__ reqs, int P, int win, bool is_causal) {
  Item it;
  it.t0 = t0;
  it.q_start = __ldg(reqs + 4 * req);
  const int q_len = __ldg(reqs + 4 * req + 1);
  it.kv_len = __ldg(reqs + 4 * req + 2);
  it.page_base = __ldg(reqs + 4 * req + 3);
  it.nt = min(BQ / P, q_len - it.t0);  // valid tokens of this tile (>= 1)
  it.head0 = hg * P;
  it.delta = it.kv_len - q_len;
  it.kv_lo = max(0, key_lo(it, 0, win));
  it.kv_hi = min(it.kv_len, key_hi(it, it.nt - 1, is_causal) + 1);
  it.ntiles = (it.kv_hi - it.kv_lo + BK - 1) / BK;
  if (PERSIST) it.ntiles = max(0, it.ntiles);  // (the ring position adds them up)
  return it;
}
TX_DEVICE Item load_item(int v, int hgs, int section, int n_items, const int* __restrict__ items,
                         const int* __restrict__ reqs, int P, int win, bool is_causal) {
  int item, hg;
  item_head(v, hgs, section, n_items, item, hg);
  return item_of(__ldg(items + 2 * item), __ldg(items + 2 * item + 1), hg, reqs, P, win, is_causal);
}

extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS) tactix_prefill(
#if TX_KV_TMA
    // ragged K and V as [tokens][heads][dim] (dims innermost first: dim, head, token), boxes of
    // 64 x 1 x TX_KVTILE, the 128-byte swizzle
    const __grid_constant__ TxTensorMap kmap, const __grid_constant__ TxTensorMap vmap,
#endif
    const u16* __restrict__ q, i64 q_st, i64 q_sh, const kv_t* __restrict__ k, const kv_t* __restrict__ v, i64 k_sp,
    i64 k_st, i64 k_sh, i64 v_sp, i64 v_st, i64 v_sh, u16* __restrict__ out, float* __restrict__ lse,
    const int* __restrict__ items, const int* __restrict__ num_items, const int* __restrict__ reqs,
    const int* __restrict__ kv_indices, i64 num_qo_heads, i64 gqa, i64 pack, i64 head_groups, i64 head_section,
    i64 page_shift,
    i64 causal, i64 window_left, double scale_log2_d, double cap_d, double k_scale_d, double v_scale_d,
    const float* __restrict__ k_scale_p, const float* __restrict__ v_scale_p, const float* __restrict__ sinks
#if TX_DYN
    , int* __restrict__ turns  // [next turn past the first round, CTAs done]: zero at launch, zeroed again at the end
#endif
) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int hgs = (int)head_groups;
  // Virtual CTAs vc = (item, head group) in tx_item_head's order (heads fastest with TX_PERSIST).
  // Without TX_PERSIST one per CTA (CTAs past the work list exit at once); with it the virtual CTAs go out in rounds of G = gridDim.x: in round r CTA b
  // takes vc = r G + b, or with TX_SNAKE (the plan sets it for sched 2, items longest first over
  // the whole batch) r G + G - 1 - b in odd rounds, so a CTA that took one of the longest of a
  // round takes one of the shortest of the next (round robin over a sorted list gives CTA 0 the
  // longest of every round). The K/V ring, its mbarrier phases and the tile count run on across
  // a CTA's items.
  // With TX_DYN (sched 3: items longest first over the batch) the first round is the same, and
  // every later turn is handed out by `turns`: the producer's first thread, done issuing a turn's
  // tiles, takes the next (vc = G + a fetch-and-add) and publishes it to the CTA in a ring of two
  // shared-memory slots, each with a "full" mbarrier (its one arrival) and an "empty" one (every
  // other warp's, once read); so a CTA that drew short items takes more of them, as a GPU hands
  // out the CTAs of a non-persistent grid, with no CTA launched anew. The CTA that draws a turn
  // past the work list is done; the last CTA done zeroes the counters for the next launch.
  const int hsec = (int)head_section;  // head groups per section (common.cuh, tx_item_head)
#if !TX_DYN
  int* const turns = nullptr;
#endif
  const int vc0 = (int)blockIdx.x;
  // Without TX_PERSIST and in one section (the default) this CTA's work-list entry is at vc0 / hgs
  // whatever the item count, and inside the list's capacity (the grid is never larger): it is
  // loaded beside the count, not after it, one dependent load fewer before the Q copy (a CTA past
  // the list reads a stale entry and exits without using it)
  const bool early = !PERSIST && hsec >= hgs;
  int early_req = 0, early_t0 = 0;
  if (early) {
    early_req = __ldg(items + 2 * (vc0 / hgs));
    early_t0 = __ldg(items + 2 * (vc0 / hgs) + 1);
  }
  const int n_items = __ldg(num_items);
  const int total = n_items * hgs;
  if (!PERSIST && vc0 >= total) return;
  const int vstep = PERSIST ? (int)gridDim.x : 1;  // without TX_PERSIST the loops below make one pass
  // the turns u = vc0, vc0 + G, ... run to the end of the last (partial) round; turns whose
  // virtual CTA is past the work list are skipped by producer and consumers alike
  const int uend = SNAKE ? (total + vstep - 1) / vstep * vstep : total;
  const int tid = threadIdx.x;
  const int P = (int)pack;
  const int win = (int)window_left;
  const bool is_causal = causal != 0;
  // the CTA's item without TX_PERSIST (the loops below load each item at its turn with it)
  Item it0{};
  if (!PERSIST) {
    it0 = early ? item_of(early_req, early_t0, vc0 % hgs, reqs, P, win, is_causal)
                : load_item(vc0, hgs, hsec, n_items, items, reqs, P, win, is_causal);
  }
  // consumer warpgroups taking part in the barrier protocol: without TX_PERSIST those with at
  // least one valid row (the others exit); with it all of them for every item (a warpgroup
  // without valid rows in an item computes and writes nothing but keeps the protocol)
  const int nwg = PERSIST ? CWG : min(CWG, (it0.nt * P + 63) / 64);

  const u32 base = tx_smem_addr(smem);
  if (base & 1023) tx_trap();  // the swizzle needs 1024-byte aligned tiles
  const u32 bars = base + BARS;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      tx_mbar_init(bars + 8 * (FULL_K * STAGES + s), KV_TMA ? 1 : 128);  // (TMA: one arrival and the bytes)
      tx_mbar_init(bars + 8 * (FULL_V * STAGES + s), KV_TMA ? 1 : 128);
      tx_mbar_init(bars + 8 * (EMPTY_K * STAGES + s), 4 * nwg);
      tx_mbar_init(bars + 8 * (EMPTY_V * STAGES + s), 4 * nwg);
    }
    if (DYN) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        tx_mbar_init(base + TURNS + 8 * s, 1);                 // full: the publishing thread
        tx_mbar_init(base + TURNS + 16 + 8 * s, 4 * CWG + 3);  // empty: every warp but the publisher's
      }
    }
    tx_mbar_init_fence();
  }
  __syncthreads();
  // TX_DYN: turn t >= 1 as published in slot (t - 1) % 2, read by a whole warp (which then frees the slot)
  volatile int* const turn_slot = reinterpret_cast<volatile int*>(smem + TURNS + 32);
  auto read_turn = [&](int t) -> int {
    const int p = t - 1, slot = p & 1;
    tx_mbar_wait(base + TURNS + 8 * slot, (u32)(p >> 1) & 1);
    const int vc = turn_slot[slot];
    __syncwarp();
    if ((tid & 31) == 0) tx_mbar_arrive(base + TURNS + 16 + 8 * slot);
    return vc;
  };

  if (tid >= PRODUCER) {
    // ---- producer warpgroup: page lookups, row pointers, cp.async gathers --------------------
    if (REBALANCE) tx_setmaxnreg_dec<PRODUCER_REGS>();
    const int pw = (tid - PRODUCER) >> 5, lane = tid & 31;
    const int pshift = (int)page_shift, pmask = (1 << pshift) - 1;
    // warp pw gathers rows [pw RW, (pw + 1) RW) of every tile (lane pw RW + lane looks up its
    // page); lane copies chunk `ch` of rows it * RPI + h of them
    const kv_t** rowp = reinterpret_cast<const kv_t**>(smem + ROWP) + 2 * pw * RW;
    const int h = lane / CH, ch = lane % CH, hv = lane / CHV, chv = lane % CHV;
    const bool k_lane = lane < RPI * CH;  // (d192: lanes 24..31 copy no K chunk)
    int g = 0;  // tiles issued so far (over every item of this CTA): the ring position
    // TX_DYN: the next turn t, taken and published by the producer's first thread, once every
    // warp has read the turn that slot held before; its warp gets it by a shuffle
    auto next_turn = [&](int t) -> int {
      if (pw != 0) return read_turn(t);
      int vc = 0;
      if (lane == 0) {
        const int p = t - 1, slot = p & 1;
        tx_mbar_wait(base + TURNS + 16 + 8 * slot, ((u32)(p >> 1) & 1) ^ 1);
        vc = (int)gridDim.x + tx_atomic_add_relaxed(turns, 1);
        turn_slot[slot] = vc;
        tx_mbar_arrive(base + TURNS + 8 * slot);  // (release: the slot's value is seen by the readers' wait)
      }
      return __shfl_sync(0xffffffffu, vc, 0);
    };
    for (int u = vc0, t = 1; u < (DYN ? total : uend); u = DYN ? next_turn(t++) : u + vstep) {
      const int vc = SNAKE ? snake_turn(u, vstep) : u;
      if (SNAKE && vc >= total) continue;
      const Item it = PERSIST ? load_item(vc, hgs, hsec, n_items, items, reqs, P, win, is_causal) : it0;
      // (persistent: as 32-bit offsets, the producer's registers are few and the loop over items needs some)
      const int hk = it.head0 / (int)gqa, page_base = it.page_base;
      const kv_t* kh = k + (PERSIST ? 0 : hk * k_sh);
      const kv_t* vh = v + (PERSIST ? 0 : hk * v_sh);
      const int* pages = kv_indices + (PERSIST ? 0 : page_base);
      const int pbase = PERSIST ? page_base : 0;
      const i64 hk_k = PERSIST ? hk * k_sh : 0, hk_v = PERSIST ? hk * v_sh : 0;
      const int kv_hi = it.kv_hi, ntiles = it.ntiles;
      const int key0 = it.kv_lo + pw * RW + lane;  // this lane's key in tile 0
      int pg = 0;
      if (!KV_TMA && ntiles > 0 && lane < RW) pg = __ldg(pages + pbase + (min(key0, kv_hi - 1) >> pshift));
      if constexpr (FP8) {
        // lane copies and converts chunk c8 of rows it2 * RPI8 + h8 of the warp's RW rows
        const int h8 = lane / CH8, c8 = lane % CH8;
        const int flip = (c8 >> 2) & 1;  // the 16-bit chunk stored first: 2 c8 + flip
        // the row pointers of tile i (the page of its key in pg, the next tile's page loaded)
        auto set_rows = [&](int i) {
          __syncwarp();  // every lane is done reading the previous tile's row pointers
          if (lane < RW) {
            const int in = min(key0 + i * BK, kv_hi - 1) & pmask;
            rowp[2 * lane] = kh + hk_k + (i64)pg * k_sp + in * k_st;
            rowp[2 * lane + 1] = vh + hk_v + (i64)pg * v_sp + in * v_st;
            if (i + 1 < ntiles) pg = __ldg(pages + pbase + (min(key0 + (i + 1) * BK, kv_hi - 1) >> pshift));
          }
          __syncwarp();
        };
        // this thread's chunks of the K (half 0) or V (1) rows of the tile set_rows set, into
        // staged pair `slot`: one cp.async group
        auto stage = [&](int slot, int half) {
#pragma unroll
          for (int it2 = 0; it2 < RW / RPI8; ++it2) {
            const int r = it2 * RPI8 + h8;
            tx_cp_async16(base + STG + (2 * slot + half) * STG_TILE + (pw * RW + r) * D + c8 * 16,
                          rowp[2 * r + half] + c8 * 16, 16);
          }
          tx_cp_async_commit();
        };
        // this thread's chunks of `half` in staged pair `slot`, converted into the ring's tile at
        // `dst`, fenced for wgmma
        auto convert = [&](int slot, int half, int dst) {
#pragma unroll 2  // (unrolled further, the conversion needs more registers than the producer keeps)
          for (int it2 = 0; it2 < RW / RPI8; ++it2) {
            const int r = pw * RW + it2 * RPI8 + h8;
            const tx_u4 in = *reinterpret_cast<const tx_u4*>(smem + STG + (2 * slot + half) * STG_TILE + r * D + c8 * 16);
            tx_u4 lo, hi;
            if (half == 0 && !QK16) {  // K: the kernel's 16-bit type (Q K^T)
              tx_fp8x4_to_16<TX_KV_FP8>(in.x, lo.x, lo.y);
              tx_fp8x4_to_16<TX_KV_FP8>(in.y, lo.z, lo.w);
              tx_fp8x4_to_16<TX_KV_FP8>(in.z, hi.x, hi.y);
              tx_fp8x4_to_16<TX_KV_FP8>(in.w, hi.z, hi.w);
            } else {  // V (P V in float16, `pv_wgmma`), and K with TX_QK16: float16
              tx_fp8x4_to_f16<TX_KV_FP8>(in.x, lo.x, lo.y);
              tx_fp8x4_to_f16<TX_KV_FP8>(in.y, lo.z, lo.w);
              tx_fp8x4_to_f16<TX_KV_FP8>(in.z, hi.x, hi.y);
              tx_fp8x4_to_f16<TX_KV_FP8>(in.w, hi.z, hi.w);
            }
            *reinterpret_cast<tx_u4*>(smem + dst + sw128(r, 2 * c8 + flip, BK)) = flip ? hi : lo;
            *reinterpret_cast<tx_u4*>(smem + dst + sw128(r, 2 * c8 + 1 - flip, BK)) = flip ? lo : hi;
          }
          tx_fence_proxy_async();
        };
        // one cp.async group per half and tile, in the order K(0), V(0), K(1), ... (empty groups
        // past the item's tiles), so the 2 NSTG - 1 groups after a half's own are the other half
        // of its tile and the NSTG - 1 tiles after it (and the next K, issued before V's wait)
#pragma unroll
        for (int t = 0; t < NSTG; ++t) {
          if (t < ntiles) {
            set_rows(t);
            stage(t, 0);
            stage(t, 1);
          } else {
            tx_cp_async_commit();
            tx_cp_async_commit();
          }
        }
        for (int i = 0; i < ntiles; ++i, ++g) {
          const int s = g % STAGES, slot = NSTG == 1 ? 0 : i % NSTG;
          const u32 parity = ((g / STAGES) & 1) ^ 1;  // the consumers' release of this slot's previous tile
          const bool more = i + NSTG < ntiles;
          tx_cp_async_wait<2 * NSTG - 1>();  // K of tile i has landed
          tx_mbar_wait(bars + 8 * (EMPTY_K * STAGES + s), parity);
          convert(slot, 0, RING + s * STAGE_BYTES);
          tx_mbar_arrive(bars + 8 * (FULL_K * STAGES + s));
          if (more) {
            set_rows(i + NSTG);
            stage(slot, 0);
          } else {
            tx_cp_async_commit();
          }
          tx_cp_async_wait<2 * NSTG - 1>();  // V of tile i
          tx_mbar_wait(bars + 8 * (EMPTY_V * STAGES + s), parity);
          convert(slot, 1, RING + s * STAGE_BYTES + TILE_BYTES);
          tx_mbar_arrive(bars + 8 * (FULL_V * STAGES + s));
          if (more) {
            stage(slot, 1);
          } else {
            tx_cp_async_commit();
          }
        }
        if (!PERSIST) break;
        continue;
      }
#if TX_KV_TMA
      // one thread issues every tile's boxes: key j of the request is row page_base + j of K and V
      // (the identity page table of a ragged batch); rows past kv_hi are other requests' keys or,
      // past the tensor's end, zeros: masked like the gather's repeated row
      if (tid == PRODUCER) {
        const int row0 = page_base + it.kv_lo;
        for (int i = 0; i < ntiles; ++i, ++g) {
          const int s = g % STAGES;
          const u32 parity = ((g / STAGES) & 1) ^ 1;
          const u32 kdst = base + RING + s * STAGE_BYTES, vdst = kdst + TILE_BYTES;
          const u32 fk = bars + 8 * (FULL_K * STAGES + s), fv = bars + 8 * (FULL_V * STAGES + s);
          tx_mbar_wait(bars + 8 * (EMPTY_K * STAGES + s), parity);
          tx_mbar_arrive_expect_tx(fk, (u32)TILE_BYTES);
#pragma unroll
          for (int hb = 0; hb < D / 64; ++hb) tx_tma_load_3d(kdst + hb * BK * 128, &kmap, 64 * hb, hk, row0 + i * BK, fk);
          tx_mbar_wait(bars + 8 * (EMPTY_V * STAGES + s), parity);
          tx_mbar_arrive_expect_tx(fv, (u32)V_TILE_BYTES);
#pragma unroll
          for (int hb = 0; hb < DV / 64; ++hb) tx_tma_load_3d(vdst + hb * BK * 128, &vmap, 64 * hb, hk, row0 + i * BK, fv);
        }
      }
      if (!PERSIST) break;
      continue;
#endif
      for (int i = 0; i < ntiles; ++i, ++g) {
        const int s = g % STAGES;
        const u32 parity = ((g / STAGES) & 1) ^ 1;  // the consumers' release of this slot's previous tile
        __syncwarp();  // every lane is done reading the previous tile's row pointers
        if (lane < RW) {
          const int in = min(key0 + i * BK, kv_hi - 1) & pmask;
          rowp[2 * lane] = kh + hk_k + (i64)pg * k_sp + in * k_st;
          rowp[2 * lane + 1] = vh + hk_v + (i64)pg * v_sp + in * v_st;
          // the next tile's page, in flight while this tile is issued
          if (i + 1 < ntiles) pg = __ldg(pages + pbase + (min(key0 + (i + 1) * BK, kv_hi - 1) >> pshift));
        }
        __syncwarp();
        const u32 kdst = base + RING + s * STAGE_BYTES, vdst = kdst + TILE_BYTES;
        tx_mbar_wait(bars + 8 * (EMPTY_K * STAGES + s), parity);
#pragma unroll(K_UNROLL)
        for (int it2 = 0; it2 < RW / RPI; ++it2) {
          const int r = it2 * RPI + h;
          if (k_lane) tx_cp_async16(kdst + sw128(pw * RW + r, ch, BK), rowp[2 * r] + ch * 8, 16);
        }
        tx_cp_async_mbar_arrive(bars + 8 * (FULL_K * STAGES + s));
        tx_mbar_wait(bars + 8 * (EMPTY_V * STAGES + s), parity);
#pragma unroll(V_UNROLL)
        for (int it2 = 0; it2 < RW / RPIV; ++it2) {
          const int r = it2 * RPIV + hv;
          tx_cp_async16(vdst + sw128(pw * RW + r, chv, BK), rowp[2 * r + 1] + chv * 8, 16);
        }
        tx_cp_async_mbar_arrive(bars + 8 * (FULL_V * STAGES + s));
      }
      if (!PERSIST) break;
    }
    tx_cp_async_commit();
    tx_cp_async_wait<0>();  // nothing of this thread in flight when it exits
    if (DYN && tid == PRODUCER) {  // this CTA draws no more turns; the last one done zeroes the counters
      __threadfence();
      if (atomicAdd(turns + 1, 1) == (int)gridDim.x - 1) {
        atomicExch(turns, 0);
        atomicExch(turns + 1, 0);
      }
    }
    return;
  }

  // ---- consumer warpgroups --------------------------------------------------------------
  if (REBALANCE) tx_setmaxnreg_inc<CONSUMER_REGS>();
  const int wg = tid >> 7;
  if (wg >= nwg) return;  // no valid row: computes nothing, counted by no barrier
  const int wtid = tid & 127, warp = wtid >> 5, lane = tid & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const int wrow0 = wg * 64;
  const u32 qw = base + wg * WG_Q_BYTES;  // this warpgroup's Q rows
  const u32 qoff = qw - base;
  const int H = (int)num_qo_heads;

  const float cap = (float)cap_d;
  const float k_scale = k_scale_p != nullptr ? __ldg(k_scale_p) : (float)k_scale_d;
  const float scale_log2 = (float)scale_log2_d * k_scale;                     // k_scale * sm_scale * log2(e)
  const float scale_over_cap = cap > 0.f ? scale_log2 / (cap * LOG2E) : 0.f;  // sm_scale / cap
  const float cap_log2 = cap * LOG2E;
  const float mul = cap > 0.f ? 1.f : scale_log2;  // logits (capped or not) -> base-2 exponent

  // TX_PINGPONG with both warpgroups computing: warpgroup 1 hands warpgroup 0 the first turn
  const bool pp = PINGPONG && nwg == 2;
  if (pp && wg == 1) tx_bar_arrive(PP_BAR + 0, 256);

  // A thread's share of the 16-byte chunks of the warpgroup's 64 rows (Q in, O out): chunk c8 =
  // wtid % 8 of every 64-column block of rows wtid / 8 + 16 k, k < 4. Four rows a thread, so the
  // row's token and head (a division by the runtime pack) are computed four times, not once a
  // chunk (a loop over chunks in row order took 58 instructions a chunk at d192, more than the
  // softmax of a tile in all); a warp instruction moves four whole 128-byte row segments.
  const int c8 = wtid & 7, lr8 = wtid >> 3;
  // this warpgroup's Q rows of an item, copied into its shared memory (rows past the valid tokens
  // are zero): one cp.async group
  auto load_q = [&](const Item& it) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int lr = lr8 + 16 * k, row = wrow0 + lr, tl = row / P;
      const bool ok = tl < it.nt;
      const u16* src = q + (i64)(it.q_start + it.t0 + tl) * q_st + (i64)(it.head0 + row % P) * q_sh + c8 * 8;
#pragma unroll
      for (int b = 0; b < D / 64; ++b)
        tx_cp_async16(qw + sw128(lr, 8 * b + c8, 64), ok ? (const void*)(src + 64 * b) : (const void*)q, ok ? 16 : 0);
    }
    tx_cp_async_commit();
  };
  // (persistent) the turns: u = vc0, then the next in this CTA's order whose virtual CTA is on the
  // work list (TX_SNAKE's last round may hold some past it), or with TX_DYN the published ones
  const int uend_all = DYN ? total : uend;
  auto vc_of = [&](int u) { return SNAKE ? snake_turn(u, vstep) : u; };
  auto skip_past_list = [&](int u) {
    while (SNAKE && u < uend && snake_turn(u, vstep) >= total) u += vstep;
    return u;
  };
  int u = skip_past_list(vc0), t = 1;
  // persistent CTAs copy an item's Q rows before the loop for the first and, for every later one,
  // during the epilogue of the one before (its Q rows are read by then: O goes out from registers)
  if (PERSIST && u < uend_all) load_q(load_item(vc_of(u), hgs, hsec, n_items, items, reqs, P, win, is_causal));
  int g = 0;  // tiles consumed so far (over every item of this CTA): the ring position
  while (u < uend_all) {
    const int vc = vc_of(u);
    const Item it = PERSIST ? load_item(vc, hgs, hsec, n_items, items, reqs, P, win, is_causal) : it0;
    const int nt = it.nt, kv_lo = it.kv_lo, ntiles = it.ntiles;
    const bool wg_rows = !PERSIST || wrow0 < nt * P;  // a valid row in this warpgroup
    // (persistent, turns in a fixed order) the next turn's work item (request, first token),
    // loaded now so the loads land during this item's tiles: the next item's Q rows, copied
    // before this item's epilogue, then wait for one load (its request's), not for two in a chain
    const int u_ahead = PERSIST && !DYN ? skip_past_list(u + vstep) : uend_all;
    int ahead_req = 0, ahead_t0 = 0, ahead_hg = 0;
    if (u_ahead < uend_all) {
      int item;
      item_head(vc_of(u_ahead), hgs, hsec, n_items, item, ahead_hg);
      ahead_req = __ldg(items + 2 * item);
      ahead_t0 = __ldg(items + 2 * item + 1);
    }

    if (!PERSIST) load_q(it);
    tx_cp_async_wait<0>();
    tx_fence_proxy_async();
    tx_bar_sync(1 + wg, 128);
    // TX_QK16: each warp rewrites its own 16 rows in float16 (scaled), then the warpgroup meets
    // again before its wgmma read them; the warp's logits take 2^-qe back
    int qe = 0;
    if constexpr (QK16) {
      qe = qk16_convert_q(smem, qoff, warp, lane);
      tx_fence_proxy_async();
      tx_bar_sync(1 + wg, 128);
    }
    const float mul_q = QK16 && cap <= 0.f ? tx_ldexp2(mul, -qe) : mul;  // logits (capped or not) -> base-2 exponent
    const float soc_q = QK16 ? tx_ldexp2(scale_over_cap, -qe) : scale_over_cap;

    // this thread's rows (16 warp + grp and + 8 of the warpgroup) and the warpgroup's bounds; rows
    // past the valid tokens take the last valid token's bounds (computed, never written)
    // this warpgroup's Q rows (the k16 steps: desc_at). qw is the same in every lane, but ptxas
    // only knows that of a broadcast: then it keeps the descriptor in uniform registers, where
    // each S wgmma needs 4 instructions beside it instead of 7 (broadcasting the warpgroup index
    // itself made an fp8 persistent variant spill)
    const u64 dq = desc_k_major(__shfl_sync(0xffffffffu, qw, 0));
    const int r0 = wrow0 + 16 * warp + grp, r1 = r0 + 8;
    const int lo0 = key_lo(it, min(r0 / P, nt - 1), win), hi0 = key_hi(it, min(r0 / P, nt - 1), is_causal);
    const int lo1 = key_lo(it, min(r1 / P, nt - 1), win), hi1 = key_hi(it, min(r1 / P, nt - 1), is_causal);
    const int lo_min_w = key_lo(it, min(wrow0 / P, nt - 1), win);
    const int hi_min_w = key_hi(it, min(wrow0 / P, nt - 1), is_causal);
    const int lo_max_w = key_lo(it, min((wrow0 + 63) / P, nt - 1), win);
    // (persistent) a warpgroup without valid rows in this item skips every tile
    const int hi_max_w = wg_rows ? key_hi(it, min((wrow0 + 63) / P, nt - 1), is_causal) : NO_LOWER;

    float o[DV / 2];
#pragma unroll
    for (int j = 0; j < DV / 2; ++j) o[j] = 0.f;
    float sc[BK / 2];
    u32 pa[BK / 4];
    float m0 = tx_neg_inf(), m1 = tx_neg_inf(), l0 = 0.f, l1 = 0.f;

    if constexpr (PINGPONG) {
      // FlashAttention-3's order: in this warpgroup's turn S of tile i and P V of tile i - 1 are
      // issued back to back; the turn passes to the other warpgroup, whose GEMMs run on the
      // tensor cores while this one computes the softmax of S (and P V of tile i - 1 finishes).
      // Every tile's GEMMs are issued (a wgmma under a branch in this order makes ptxas
      // serialize them all): a tile outside the warpgroup's rows is masked whole (P = 0).
      for (int i = 0; i < ntiles; ++i) {
        const int gi = g + i;
        const int s = gi % STAGES, sp = (gi + STAGES - 1) % STAGES;
        const u32 parity = (gi / STAGES) & 1, parity_p = ((gi + 2 * STAGES - 1) / STAGES) & 1;
        const u32 kst = base + RING + s * STAGE_BYTES, vprev = base + RING + sp * STAGE_BYTES + TILE_BYTES;
        const int kv0 = kv_lo + i * BK, kv_last = kv0 + BK - 1;
        const bool active = kv0 <= hi_max_w && kv_last >= lo_min_w;
        const bool prev = i > 0;  // P V of the previous tile to issue

        tx_mbar_wait(bars + 8 * (FULL_K * STAGES + s), parity);
        if (prev) tx_mbar_wait(bars + 8 * (FULL_V * STAGES + sp), parity_p);
        if (pp) tx_bar_sync(PP_BAR + wg, 256);  // this warpgroup's turn
        kv_for_wgmma();
#pragma unroll
        for (int j = 0; j < BK / 2; ++j) tx_reg_fence(sc[j]);
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
        tx_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {  // S = Q K^T
          qk_wgmma<BK>(sc, desc_at(dq, (kk >> 2) * (64 * 128) + (kk & 3) * 32),
                       desc_at(desc_k_major(kst), (kk >> 2) * (BK * 128) + (kk & 3) * 32), kk > 0);
        }
        tx_wgmma_commit();  // group 1: S
        if (prev) {  // O += P V of the previous tile
#pragma unroll
          for (int ks = 0; ks < BK / 16; ++ks)
            pv_wgmma<DV>(o, pa + 4 * ks, desc_at(desc_mn_major(vprev, BK * 128), ks * 2048), 1);
          tx_wgmma_commit();  // group 2: P V
        } else {  // (each branch commits its own group: one commit after the branch made ptxas add
                  // an empty group after P V at every tile, so the wait for S below waited for P V too)
          tx_wgmma_commit();  // group 2: empty for the first tile
        }
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
        if (pp) tx_bar_arrive(PP_BAR + (wg ^ 1), 256);  // the other warpgroup's turn
        tx_wgmma_wait<1>();                              // S
#pragma unroll
        for (int j = 0; j < BK / 2; ++j) tx_reg_fence(sc[j]);
        if (lane == 0) tx_mbar_arrive(bars + 8 * (EMPTY_K * STAGES + s));

        float al0, al1;
        {
          if (cap > 0.f) {
#pragma unroll
            for (int j = 0; j < BK / 2; ++j) sc[j] = cap_log2 * tx_tanh(sc[j] * soc_q);
          }
          if (!active || kv0 < lo_max_w) {
            mask_tile<true>(sc, kv0 + 2 * tig, lo0, hi0, lo1, hi1);
          } else if (kv_last > hi_min_w) {
            mask_tile<false>(sc, kv0 + 2 * tig, lo0, hi0, lo1, hi1);
          }
          float mx0 = tx_neg_inf(), mx1 = tx_neg_inf();
#pragma unroll
          for (int j = 0; j < BK / 2; j += 4) {
            mx0 = fmaxf(mx0, fmaxf(sc[j], sc[j + 1]));
            mx1 = fmaxf(mx1, fmaxf(sc[j + 2], sc[j + 3]));
          }
          mx0 = tx_warp_max4(mx0) * mul_q;
          mx1 = tx_warp_max4(mx1) * mul_q;
          const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
          const float mu0 = mn0 == tx_neg_inf() ? 0.f : mn0;
          const float mu1 = mn1 == tx_neg_inf() ? 0.f : mn1;
          al0 = tx_exp2(m0 - mu0);
          al1 = tx_exp2(m1 - mu1);
          m0 = mn0;
          m1 = mn1;
          float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
          for (int j = 0; j < BK / 2; j += 4) {
            sc[j] = tx_exp2(fmaf(sc[j], mul_q, -mu0));
            sc[j + 1] = tx_exp2(fmaf(sc[j + 1], mul_q, -mu0));
            sc[j + 2] = tx_exp2(fmaf(sc[j + 2], mul_q, -mu1));
            sc[j + 3] = tx_exp2(fmaf(sc[j + 3], mul_q, -mu1));
            rs0 += sc[j] + sc[j + 1];
            rs1 += sc[j + 2] + sc[j + 3];
          }
          l0 = l0 * al0 + rs0;
          l1 = l1 * al1 + rs1;
        }
        tx_wgmma_wait<0>();  // P V of the previous tile: O and P are free
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
        if (lane == 0 && i > 0) tx_mbar_arrive(bars + 8 * (EMPTY_V * STAGES + sp));
        {
#pragma unroll
          for (int j = 0; j < DV / 2; j += 4) {
            o[j] *= al0;
            o[j + 1] *= al0;
            o[j + 2] *= al1;
            o[j + 3] *= al1;
          }
#pragma unroll
          for (int j = 0; j < BK / 4; ++j) pa[j] = pv_pack2(sc[2 * j], sc[2 * j + 1]);
        }
      }
      if (ntiles > 0) {  // P V of the last tile (outside the turns: each warpgroup takes ntiles of them)
        const int gl = g + ntiles - 1, sl = gl % STAGES;
        tx_mbar_wait(bars + 8 * (FULL_V * STAGES + sl), (gl / STAGES) & 1);
        kv_for_wgmma();
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
        tx_wgmma_fence();
        const u32 vst = base + RING + sl * STAGE_BYTES + TILE_BYTES;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
          pv_wgmma<DV>(o, pa + 4 * ks, desc_at(desc_mn_major(vst, BK * 128), ks * 2048), 1);
        tx_wgmma_commit();
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
      }
      tx_wgmma_wait<0>();
    } else {
    for (int i = 0; i < ntiles; ++i) {
      const int gi = g + i;
      const int s = gi % STAGES;
      const u32 parity = (gi / STAGES) & 1;
      const u32 kst = base + RING + s * STAGE_BYTES, vst = kst + TILE_BYTES;
      const int kv0 = kv_lo + i * BK, kv_last = kv0 + BK - 1;
      // some row of the warpgroup attends a key of this tile
      const bool active = kv0 <= hi_max_w && kv_last >= lo_min_w;

      tx_mbar_wait(bars + 8 * (FULL_K * STAGES + s), parity);
      if (active) {  // S = Q K^T
        kv_for_wgmma();
#pragma unroll
        for (int j = 0; j < BK / 2; ++j) tx_reg_fence(sc[j]);
        tx_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          qk_wgmma<BK>(sc, desc_at(dq, (kk >> 2) * (64 * 128) + (kk & 3) * 32),
                       desc_at(desc_k_major(kst), (kk >> 2) * (BK * 128) + (kk & 3) * 32), kk > 0);
        }
        tx_wgmma_commit();
      }
      tx_wgmma_wait<0>();  // S of this tile, and P V of the previous one
#pragma unroll
      for (int j = 0; j < BK / 2; ++j) tx_reg_fence(sc[j]);
#pragma unroll
      for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
#pragma unroll
      for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
      if (lane == 0) {
        tx_mbar_arrive(bars + 8 * (EMPTY_K * STAGES + s));
        if (i > 0) tx_mbar_arrive(bars + 8 * (EMPTY_V * STAGES + (gi - 1) % STAGES));
      }

      if (active) {
        if (cap > 0.f) {
#pragma unroll
          for (int j = 0; j < BK / 2; ++j) sc[j] = cap_log2 * tx_tanh(sc[j] * soc_q);
        }
        if (kv0 < lo_max_w) {
          mask_tile<true>(sc, kv0 + 2 * tig, lo0, hi0, lo1, hi1);
        } else if (kv_last > hi_min_w) {
          mask_tile<false>(sc, kv0 + 2 * tig, lo0, hi0, lo1, hi1);
        }
        // online softmax: registers j with (j & 2) == 0 belong to row r0, the others to r1
        float mx0 = tx_neg_inf(), mx1 = tx_neg_inf();
#pragma unroll
        for (int j = 0; j < BK / 2; j += 4) {
          mx0 = fmaxf(mx0, fmaxf(sc[j], sc[j + 1]));
          mx1 = fmaxf(mx1, fmaxf(sc[j + 2], sc[j + 3]));
        }
        mx0 = tx_warp_max4(mx0) * mul_q;
        mx1 = tx_warp_max4(mx1) * mul_q;
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == tx_neg_inf() ? 0.f : mn0;
        const float mu1 = mn1 == tx_neg_inf() ? 0.f : mn1;
        const float al0 = tx_exp2(m0 - mu0), al1 = tx_exp2(m1 - mu1);
        m0 = mn0;
        m1 = mn1;
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int j = 0; j < BK / 2; j += 4) {
          sc[j] = tx_exp2(fmaf(sc[j], mul_q, -mu0));
          sc[j + 1] = tx_exp2(fmaf(sc[j + 1], mul_q, -mu0));
          sc[j + 2] = tx_exp2(fmaf(sc[j + 2], mul_q, -mu1));
          sc[j + 3] = tx_exp2(fmaf(sc[j + 3], mul_q, -mu1));
          rs0 += sc[j] + sc[j + 1];
          rs1 += sc[j + 2] + sc[j + 3];
        }
        l0 = l0 * al0 + rs0;
        l1 = l1 * al1 + rs1;
#pragma unroll
        for (int j = 0; j < DV / 2; j += 4) {
          o[j] *= al0;
          o[j + 1] *= al0;
          o[j + 2] *= al1;
          o[j + 3] *= al1;
        }
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) pa[j] = pv_pack2(sc[2 * j], sc[2 * j + 1]);
      }

      tx_mbar_wait(bars + 8 * (FULL_V * STAGES + s), parity);
      if (active) {  // O += P V, left running
        kv_for_wgmma();
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
        tx_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
          pv_wgmma<DV>(o, pa + 4 * ks, desc_at(desc_mn_major(vst, BK * 128), ks * 2048), 1);
        tx_wgmma_commit();
#pragma unroll
        for (int j = 0; j < BK / 4; ++j) tx_reg_fence(pa[j]);
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
      }
    }
    tx_wgmma_wait<0>();
    }  // PINGPONG
#pragma unroll
    for (int j = 0; j < DV / 2; ++j) tx_reg_fence(o[j]);
    // (persistent) the last V tile of the item is free once its P V is done: the producer fills
    // the slot with the next item's keys during this epilogue
    if (PERSIST && ntiles > 0 && lane == 0) tx_mbar_arrive(bars + 8 * (EMPTY_V * STAGES + (g + ntiles - 1) % STAGES));
    g += ntiles;
    // (persistent) the next turn, and its Q rows copied once every warp of the warpgroup is done
    // with this item's (its wgmma reads of them are complete)
    int u_next = uend_all;
    if constexpr (PERSIST) {
      u_next = DYN ? read_turn(t++) : u_ahead;
      tx_bar_sync(1 + wg, 128);
      tx_fence_proxy_async();
      if (u_next < uend_all) {
        load_q(DYN ? load_item(vc_of(u_next), hgs, hsec, n_items, items, reqs, P, win, is_causal)
                   : item_of(ahead_req, ahead_t0, ahead_hg, reqs, P, win, is_causal));
      }
    }
    // (a warpgroup without valid rows in this item goes through the epilogue writing nothing: a
    // branch around it makes ptxas serialize the wgmma of TX_PINGPONG)
    // (persistent) the item's rows, loaded again rather than kept in registers through the tiles
    u32 vc_again = (u32)vc;
    if (PERSIST) tx_reg_fence(vc_again);  // an opaque copy: the loads are not merged with the first ones
    const Item ie = PERSIST ? load_item((int)vc_again, hgs, hsec, n_items, items, reqs, P, win, is_causal) : it;
    const int t0 = ie.t0, q_start = ie.q_start, head0 = ie.head0;

    // ---- epilogue: O / l staged through this warpgroup's own Q rows, then 16-byte stores ----
    l0 = tx_warp_sum4(l0);
    l1 = tx_warp_sum4(l1);
    const float v_scale = v_scale_p != nullptr ? __ldg(v_scale_p) : (float)v_scale_d;
    float f0 = 1.f, f1 = 1.f;
    if (sinks != nullptr) {  // each row's sink joins its denominator (its weights rescaled to the new max)
      const float before0 = m0, before1 = m1;
      tx_fold_sink(m0, l0, __ldg(sinks + head0 + r0 % P) * LOG2E);
      tx_fold_sink(m1, l1, __ldg(sinks + head0 + r1 % P) * LOG2E);
      f0 = tx_exp2(before0 - m0);
      f1 = tx_exp2(before1 - m1);
    }
    // a row that attends no key (causal, before its request's first key) has l 0: zeros, LSE -inf
    const float inv0 = l0 > 0.f ? v_scale * f0 / l0 : 0.f, inv1 = l1 > 0.f ? v_scale * f1 / l1 : 0.f;
    if constexpr (PERSIST) {  // straight from registers: a quad writes 16 bytes of a row per store
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = h ? r1 : r0, tl = row / P;
        if (tl < nt) {
          u16* dst = out + ((i64)(q_start + t0 + tl) * H + head0 + row % P) * DV + 2 * tig;
          const float inv = h ? inv1 : inv0;
#pragma unroll
          for (int j = 0; j < DV / 8; ++j)
            *reinterpret_cast<u32*>(dst + 8 * j) = tx_pack2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
        }
      }
    } else {  // staged through the warpgroup's Q rows, then 16-byte stores
      tx_bar_sync(1 + wg, 128);  // every warp's wgmma reads of Q are complete before Q is overwritten
      tx_fence_proxy_async();
      const int lr0 = 16 * warp + grp;
#pragma unroll
      for (int j = 0; j < DV / 8; ++j) {
        *reinterpret_cast<u32*>(smem + qoff + sw128(lr0, j, 64) + tig * 4) =
            tx_pack2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
        *reinterpret_cast<u32*>(smem + qoff + sw128(lr0 + 8, j, 64) + tig * 4) =
            tx_pack2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
      }
      tx_bar_sync(1 + wg, 128);
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // the rows and chunks load_q takes
        const int lr = lr8 + 16 * k, row = wrow0 + lr, tl = row / P;
        if (tl < nt) {
          u16* dst = out + ((i64)(q_start + t0 + tl) * H + head0 + row % P) * DV + c8 * 8;
#pragma unroll
          for (int b = 0; b < DV / 64; ++b)
            *reinterpret_cast<tx_u4*>(dst + 64 * b) =
                *reinterpret_cast<const tx_u4*>(smem + qoff + sw128(lr, 8 * b + c8, 64));
        }
      }
    }
    if (lse != nullptr && tig == 0) {
      if (r0 / P < nt) lse[(i64)(q_start + t0 + r0 / P) * H + head0 + r0 % P] = (m0 + tx_log2(l0)) * LN2;
      if (r1 / P < nt) lse[(i64)(q_start + t0 + r1 / P) * H + head0 + r1 % P] = (m1 + tx_log2(l1)) * LN2;
    }
    if (!PERSIST) break;
    u = u_next;
  }
}
