// KV caches of fp8 (TX_KV_FP8 = 1: e4m3fn, 2: e5m2) or 16-bit elements (0): the cache element
// type kv_t and the exact conversion of fp8 codes into the 16-bit operands of the kernels' mma
// (TX_BF16: bfloat16, else float16), shared by decode.cu and prefill.cu. TX_FP8_CVT = 1 (the plugin's default) uses the hardware conversion on sm_89 and
// later; the bit arithmetic serves older GPUs, TX_FP8_CVT = 0 and the CPU emulation, with the
// same values bit for bit (tests/emulator/emu_fp8.cpp checks every code).
#pragma once

#ifndef TX_KV_FP8
#define TX_KV_FP8 0
#endif
#if TX_KV_FP8
typedef unsigned char kv_t;  // a cache element
#else
typedef u16 kv_t;
#endif

// fp8 -> float, exact (plain bit arithmetic, no CUDA headers: NVRTC and the emulation alike); every
// e4m3fn and e5m2 value is a float16 and a bfloat16 too, so tx_pack2 of the result is exact.
// e4m3fn: bias 7, no infinities, 0x7f / 0xff NaN, subnormals m 2^-9. e5m2: float16's top byte
// (bias 15, infinities, NaN), subnormals m 2^-16.
TX_DEVICE float tx_e4m3_to_float(u32 b) {
  const u32 sign = (b & 0x80u) << 24, mag = b & 0x7fu;
  if (mag == 0x7fu) return __uint_as_float(sign | 0x7fc00000u);
  if (mag < 0x08u) return __uint_as_float(sign | __float_as_uint((float)mag * 0.001953125f));
  return __uint_as_float(sign | ((mag << 20) + (120u << 23)));
}
TX_DEVICE float tx_e5m2_to_float(u32 b) {
  const u32 sign = (b & 0x80u) << 24, mag = b & 0x7fu;
  if (mag >= 0x7cu) return __uint_as_float(sign | (mag == 0x7cu ? 0x7f800000u : 0x7fc00000u));
  if (mag < 0x04u) return __uint_as_float(sign | __float_as_uint((float)mag * 1.52587890625e-05f));
  return __uint_as_float(sign | ((mag << 21) + (112u << 23)));
}
#ifndef TX_FP8_CVT
#define TX_FP8_CVT 0
#endif
#if TX_FP8_CVT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// TX_FP8_CVT (sm_89 and later): the hardware conversion of two fp8 values (the low 16 bits of
// `pair`, the first in the low byte) into a float16 pair, exact; for bfloat16 through float32
// (also exact). Two to three instructions a value instead of the bit arithmetic's ten or so.
template <int FORMAT>
TX_DEVICE u32 tx_fp8x2_cvt(u32 pair) {
  u32 h;
  const unsigned short p = (unsigned short)(pair & 0xffffu);
  if (FORMAT == 2) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(h) : "h"(p));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(p));
  }
#if TX_BF16
  u32 b;
  asm("{\n .reg .f16 lo, hi;\n .reg .f32 flo, fhi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 flo, lo;\n"
      " cvt.f32.f16 fhi, hi;\n cvt.rn.bf16x2.f32 %0, fhi, flo;\n}\n"
      : "=r"(b)
      : "r"(h));
  return b;
#else
  return h;
#endif
}
#endif

// Four fp8 values (one 32-bit word, the first in the low byte) -> four 16-bit values in two words;
// e5m2: format 2, else e4m3fn.
template <int FORMAT>
TX_DEVICE void tx_fp8x4_to_16(u32 w, u32& lo, u32& hi) {
#if TX_FP8_CVT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  lo = tx_fp8x2_cvt<FORMAT>(w);
  hi = tx_fp8x2_cvt<FORMAT>(w >> 16);
#else
  float f[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 b = (w >> (8 * j)) & 0xffu;
    f[j] = FORMAT == 2 ? tx_e5m2_to_float(b) : tx_e4m3_to_float(b);
  }
  lo = tx_pack2(f[0], f[1]);
  hi = tx_pack2(f[2], f[3]);
#endif
}
