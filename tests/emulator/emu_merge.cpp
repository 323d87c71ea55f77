// tactix_merge_states (kernels/merge.cu) on the CPU emulation, with the arguments in the order the
// plugin launches it (merge.CudaNativeMergePlan.run, merge.merge_args).
#include "merge.cu"

extern "C" const char* emu_merge(unsigned gx, int threads, const unsigned char* v0, i64 v_state, i64 v_row,
                                 i64 v_head, const unsigned char* s0, i64 s_state, i64 s_row, i64 s_head,
                                 unsigned char* out_v, i64 o_row, i64 o_head, unsigned char* out_s, i64 os_row,
                                 i64 os_head, const unsigned char* mask, i64 rows, i64 heads, i64 dim, i64 states) {
  return txe::launch({gx, 1, 1}, threads, [=] {
    tactix_merge_states(v0, v_state, v_row, v_head, s0, s_state, s_row, s_head, out_v, o_row, o_head, out_s, os_row,
                        os_head, mask, rows, heads, dim, states);
  });
}
