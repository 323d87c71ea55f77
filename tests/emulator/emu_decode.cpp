// tactix_decode (kernels/decode.cu) on the CPU emulation, with the arguments in the order the
// plugin launches it (plugin.CudaNativeDecodePlan.run). The kernel is the one proven on the H200,
// so running it here checks the emulation itself; split requests are merged inside it by the CTA
// that draws the last ticket, so the schedule (which CTAs overlap, in which order) matters. With
// TX_TMA the K and V tensor maps come first, by address, in the emulation's layout (emulate.tensor_map).
// With TX_KV_FP8 the caches are one byte an element (kv_t); the scale and sink pointers are host addresses here.
#include "decode.cu"

extern "C" const char* emu_decode(unsigned gx, unsigned gy, unsigned gz, int threads, i64 smem_bytes, int resident,
                                  int order, unsigned seed, int park,
#if TX_TMA
                                  const u64* kmap_bytes, const u64* vmap_bytes,
#endif
                                  const u16* q, i64 q_sb, i64 q_sh, const kv_t* k,
                                  const kv_t* v, i64 k_sp, i64 k_st, i64 k_sh, i64 v_sp, i64 v_st, i64 v_sh, u16* out,
                                  float* lse, const int* items, const int* num_items, const int* kv_indices,
                                  float* part_o, float* part_lse, int* counters, i64 num_qo_heads, i64 gqa,
                                  i64 q_tiles, i64 page_shift, double scale_log2, double cap, double k_scale,
                                  double v_scale, const float* k_scale_p, const float* v_scale_p,
                                  const float* sinks) {
  const txe::Schedule schedule{resident, order, seed, park != 0, (size_t)smem_bytes};
#if TX_TMA
  TxTensorMap kmap, vmap;
  std::memcpy(&kmap, kmap_bytes, sizeof kmap);
  std::memcpy(&vmap, vmap_bytes, sizeof vmap);
#endif
  return txe::launch({gx, gy, gz}, threads, [=] {
    tactix_decode(
#if TX_TMA
        kmap, vmap,
#endif
        q, q_sb, q_sh, k, v, k_sp, k_st, k_sh, v_sp, v_st, v_sh, out, lse, items, num_items, kv_indices,
                  part_o, part_lse, counters, num_qo_heads, gqa, q_tiles, page_shift, scale_log2, cap, k_scale,
                  v_scale, k_scale_p, v_scale_p, sinks);
  }, schedule);
}
