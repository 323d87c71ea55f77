// tactix_decode_plan (kernels/decode_plan.cu) on the CPU emulation: one CTA, with the arguments in
// the order the plugin launches it (decode.CudaNativeDecodePlan._plan_on_device).
#include "decode_plan.cu"

extern "C" const char* emu_decode_plan(int threads, i64 smem_bytes, const int* kv_indptr, const int* kv_lens,
                                       int* items, i64 batch, i64 chunk, i64 window_left) {
  txe::Schedule schedule;
  schedule.smem_bytes = (size_t)smem_bytes;
  return txe::launch({1, 1, 1}, threads, [=] { tactix_decode_plan(kv_indptr, kv_lens, items, batch, chunk, window_left); },
                     schedule);
}
