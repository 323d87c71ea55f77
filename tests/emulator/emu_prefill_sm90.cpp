// tactix_prefill (kernels/prefill_sm90.cu, the Hopper wgmma kernel) on the CPU emulation:
// compiled with g++ -include tx_emulate.h -I <kernels> -DTX_BF16=.. -DTX_D=.. ... (see emulate.py).
// The same entry point as emu_prefill.cpp; `threads` includes the producer warpgroup and
// `smem_bytes` is the plan's (prefill.prefill_smem_bytes with mma "wgmma", mbarriers included).
// With TX_KV_TMA the ragged K and V tensor maps come first, by address, in the emulation's layout
// (emulate.tensor_map); with TX_DYN the turn counters come last.
#include "prefill_sm90.cu"

extern "C" const char* emu_prefill(unsigned grid, int threads, i64 smem_bytes, int resident, int order,
                                   unsigned seed, int park,
#if TX_KV_TMA
                                   const u64* kmap_bytes, const u64* vmap_bytes,
#endif
                                   const u16* q, i64 q_st, i64 q_sh, const kv_t* k,
                                   const kv_t* v, i64 k_sp, i64 k_st, i64 k_sh, i64 v_sp, i64 v_st, i64 v_sh,
                                   u16* out, float* lse, const int* items, const int* num_items, const int* reqs,
                                   const int* kv_indices, i64 num_qo_heads, i64 gqa, i64 pack, i64 head_groups, i64 head_section,
                                   i64 page_shift, i64 causal, i64 window_left, double scale_log2, double cap,
                                   double k_scale, double v_scale, const float* k_scale_p, const float* v_scale_p,
                                   const float* sinks
#if TX_DYN
                                   , int* turns
#endif
) {
  if (threads != NT) return "launch: thread count differs from the kernel's (consumer and producer warpgroups)";
  const txe::Schedule schedule{resident, order, seed, park != 0, (size_t)smem_bytes};
#if TX_KV_TMA
  TxTensorMap kmap, vmap;
  std::memcpy(&kmap, kmap_bytes, sizeof kmap);
  std::memcpy(&vmap, vmap_bytes, sizeof vmap);
#endif
  return txe::launch({grid, 1, 1}, threads, [=] {
    tactix_prefill(
#if TX_KV_TMA
        kmap, vmap,
#endif
        q, q_st, q_sh, k, v, k_sp, k_st, k_sh, v_sp, v_st, v_sh, out, lse, items, num_items, reqs,
                   kv_indices, num_qo_heads, gqa, pack, head_groups, head_section, page_shift, causal, window_left, scale_log2,
                   cap, k_scale, v_scale, k_scale_p, v_scale_p, sinks
#if TX_DYN
                   , turns
#endif
    );
  }, schedule);
}
