// The fp8 -> 16-bit conversion of kernels/decode.cu (TX_KV_FP8 = 1: e4m3fn, 2: e5m2) on the CPU
// emulation: `n` codes in, their TX_BF16 (bfloat16, else float16) bits out, four at a time as the
// kernel converts them (tx_fp8x4_to_16).
#ifndef TX_D
#define TX_D 64
#endif
#include "decode.cu"

extern "C" void emu_fp8_convert(const unsigned char* in, u16* out, int n) {
  for (int i = 0; i + 4 <= n; i += 4) {
    u32 w = 0;
    for (int j = 0; j < 4; ++j) w |= (u32)in[i + j] << (8 * j);
    u32 lo, hi;
    tx_fp8x4_to_16<TX_KV_FP8>(w, lo, hi);
    out[i] = (u16)(lo & 0xffff), out[i + 1] = (u16)(lo >> 16);
    out[i + 2] = (u16)(hi & 0xffff), out[i + 3] = (u16)(hi >> 16);
  }
}
