// tactix_gemm (kernels/gemm_sm90.cu, the Hopper wgmma skinny GEMM) on the CPU emulation, with the
// arguments in the order the plugin launches it (plugin.CudaNativeGemmPlan.run). The k splits of a
// column block are one cluster (TX_CLUSTER CTAs along y) that adds its partial tiles up through
// distributed shared memory. With TX_TMA the two tensor maps come first, in the emulation's own
// layout (emulate.tensor_map), by address (ctypes cannot pass a 64-byte-aligned struct by value).
#include "gemm_sm90.cu"

extern "C" const char* emu_gemm(unsigned gx, unsigned gy, unsigned gz, int threads, i64 smem_bytes, int resident,
                                int order, unsigned seed, int park,
#if TX_TMA
                                const u64* wmap_bytes, const u64* amap_bytes,
#endif
                                const u16* a, i64 lda, i64 a_sb, const u16* b, i64 ldb, i64 b_sb, u16* out, i64 o_sb,
                                const u16* bias, float* ws, int* counters, i64 m, i64 n, i64 k, i64 kps) {
  if (threads != NT) return "launch: thread count differs from the kernel's (one warpgroup)";
  const txe::Schedule schedule{resident, order, seed, park != 0, (size_t)smem_bytes};
#if TX_TMA
  TxTensorMap wmap, amap;
  std::memcpy(&wmap, wmap_bytes, sizeof wmap);
  std::memcpy(&amap, amap_bytes, sizeof amap);
#endif
  return txe::launch({gx, gy, gz}, threads, [=] {
    tactix_gemm(
#if TX_TMA
        wmap, amap,
#endif
        a, lda, a_sb, b, ldb, b_sb, out, o_sb, bias, ws, counters, m, n, k, kps);
  }, schedule, {1, (unsigned)CL, 1});
}
