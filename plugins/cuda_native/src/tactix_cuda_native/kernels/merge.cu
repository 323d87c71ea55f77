// Merging attention states (tactix.ops.merge_states): for each row and head, with states
// (v_i, s_i), s_i a natural-log LSE: s = log(sum_i exp(s_i)), v = sum_i v_i exp(s_i - s); a state
// over no key (s_i = -inf) adds nothing; a row whose states are all empty gets zeros and -inf.
//
// One warp per (row, head), TX_MERGE_WARPS warps a CTA: the lanes take the states' LSEs (lane,
// lane + 32, ...) for the largest and the sum of the weights (warp shuffles, base-2 exponentials),
// then the head dim (d = lane, lane + 32, ...), every state's value read once, accumulated in
// fp32. State i lies at byte offset i * v_state (i * s_state for its LSE) from state 0: the
// plugin passes separate tensors by their address difference (merge.py), so one kernel serves
// two tensors, a stacked [rows, n, heads, dim] one, or the in-place form, whose outputs are
// state 0 itself (each lane reads its elements before it writes them; the LSE is written last,
// after the warp has read every state's). With a mask (bytes, one a row), rows it does not mark
// are left alone. Strides are in bytes; the last dim is contiguous.
//
// TX_MERGE_T: 0 float16, 1 bfloat16 (TX_BF16 says which to tx_to_float), 2 float32.
#include "common.cuh"

#ifndef TX_MERGE_T
#error "TX_MERGE_T must be defined (0 float16, 1 bfloat16, 2 float32)"
#endif
#ifndef TX_MERGE_WARPS
#define TX_MERGE_WARPS 8
#endif
#define MERGE_LOG2E 1.4426950408889634f

TX_DEVICE float tx_merge_load(const unsigned char* p) {
#if TX_MERGE_T == 2
  return *(const float*)p;
#else
  return tx_to_float(*(const u16*)p);
#endif
}

TX_DEVICE void tx_merge_store(unsigned char* p, float x) {
#if TX_MERGE_T == 2
  *(float*)p = x;
#elif TX_MERGE_T == 1
  *(u16*)p = (u16)(tx_pack2(x, 0.f) & 0xffffu);
#else
  *(u16*)p = (u16)(tx_pack2_f16(x, 0.f) & 0xffffu);
#endif
}

extern "C" __global__ void __launch_bounds__(32 * TX_MERGE_WARPS) tactix_merge_states(
    const unsigned char* v0, i64 v_state, i64 v_row, i64 v_head, const unsigned char* s0, i64 s_state, i64 s_row,
    i64 s_head, unsigned char* out_v, i64 o_row, i64 o_head, unsigned char* out_s, i64 os_row, i64 os_head,
    const unsigned char* mask, i64 rows, i64 heads, i64 dim, i64 states) {
  const int lane = threadIdx.x % 32;
  const i64 item = (i64)blockIdx.x * TX_MERGE_WARPS + threadIdx.x / 32;
  if (item >= rows * heads) return;
  const i64 row = item / heads, head = item % heads;
  if (mask != nullptr && mask[row] == 0) return;
  const unsigned char* s_base = s0 + row * s_row + head * s_head;
  const unsigned char* v_base = v0 + row * v_row + head * v_head;
  const int elem = TX_MERGE_T == 2 ? 4 : 2;

  float top = tx_neg_inf();
  for (i64 i = lane; i < states; i += 32) top = fmaxf(top, *(const float*)(s_base + i * s_state));
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  const bool empty = top == tx_neg_inf();  // every state over no key
  const float shift = empty ? 0.f : top * MERGE_LOG2E;
  float total = 0.f;
  for (i64 i = lane; i < states; i += 32) {
    const float s = *(const float*)(s_base + i * s_state);
    total += s == tx_neg_inf() ? 0.f : tx_exp2(s * MERGE_LOG2E - shift);
  }
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  const float inv = empty ? 0.f : 1.f / total;

  unsigned char* o_base = out_v + row * o_row + head * o_head;
  for (i64 d = lane; d < dim; d += 32) {
    float acc = 0.f;
    for (i64 i = 0; i < states; ++i) {
      const float s = *(const float*)(s_base + i * s_state);
      if (s == tx_neg_inf()) continue;
      acc += tx_exp2(s * MERGE_LOG2E - shift) * tx_merge_load(v_base + i * v_state + d * elem);
    }
    tx_merge_store(o_base + d * elem, acc * inv);
  }
  __syncwarp();  // every lane has read every state's LSE (the in-place form overwrites state 0's)
  if (lane == 0) {
    *(float*)(out_s + row * os_row + head * os_head) = empty ? tx_neg_inf() : top + tx_log2(total) / MERGE_LOG2E;
  }
}
