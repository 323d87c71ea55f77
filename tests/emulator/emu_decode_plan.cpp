// tactix_decode_plan (kernels/decode_plan.cu) on the CPU emulation: one CTA, with the arguments in
// the order the plugin launches it (decode.CudaNativeDecodePlan._plan_batch).
#include "decode_plan.cu"

extern "C" const char* emu_decode_plan(int threads, i64 smem_bytes, const int* kv_indptr, const int* kv_lens,
                                       int* items, int* num_items, i64 batch, i64 chunk, i64 window_left,
                                       i64 units, i64 slots, i64 tile, i64 min_chunk) {
  txe::Schedule schedule;
  schedule.smem_bytes = (size_t)smem_bytes;
  return txe::launch(
      {1, 1, 1}, threads,
      [=] {
        tactix_decode_plan(kv_indptr, kv_lens, items, num_items, batch, chunk, window_left, units, slots, tile,
                           min_chunk);
      },
      schedule);
}
