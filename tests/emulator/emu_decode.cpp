// tactix_decode and tactix_decode_merge (kernels/decode.cu) on the CPU emulation. The decode
// kernel is the one proven on the H200, so running it here checks the emulation itself.
#include "decode.cu"

extern "C" const char* emu_decode(unsigned gx, unsigned gy, int threads, const u16* q, i64 q_sb, i64 q_sh,
                                  const u16* k, const u16* v, i64 k_sp, i64 k_st, i64 k_sh, i64 v_sp, i64 v_st,
                                  i64 v_sh, u16* out, float* lse, const int* items, const int* num_items,
                                  const int* page_base, const int* kv_indices, float* part_o, float* part_lse,
                                  i64 num_qo_heads, i64 gqa, i64 q_tiles, i64 page_shift, double scale_log2,
                                  double cap) {
  return txe::launch(gx, gy, threads, [=] {
    tactix_decode(q, q_sb, q_sh, k, v, k_sp, k_st, k_sh, v_sp, v_st, v_sh, out, lse, items, num_items, page_base,
                  kv_indices, part_o, part_lse, num_qo_heads, gqa, q_tiles, page_shift, scale_log2, cap);
  });
}

extern "C" const char* emu_decode_merge(unsigned gx, unsigned gy, const float* part_o, const float* part_lse,
                                        const int* req_split, u16* out, float* lse, i64 num_qo_heads) {
  return txe::launch(gx, gy, MERGE_THREADS,
                     [=] { tactix_decode_merge(part_o, part_lse, req_split, out, lse, num_qo_heads); });
}
