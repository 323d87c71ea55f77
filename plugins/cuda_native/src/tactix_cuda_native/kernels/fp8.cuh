// KV caches of fp8 (TX_KV_FP8 = 1: e4m3fn, 2: e5m2) or 16-bit elements (0): the cache element
// type kv_t and the exact conversion of fp8 codes into the 16-bit operands of the kernels' mma
// (TX_BF16: bfloat16, else float16), shared by decode.cu and prefill.cu. TX_FP8_CVT picks how:
//   0  bit arithmetic through float (any GPU, and the reference the others are checked against);
//   1  the hardware conversion (sm_89 and later, else mode 0; bfloat16 goes through float32,
//      four conversions a pair: decode.cu's fp8 variants convert V to float16 instead);
//   2  integer placement and one 16-bit multiply by a power of two (sm_80 and later): the code's
//      bits moved into a 16-bit value, scaled by 2^(bias difference), NaN (and e5m2's infinities)
//      patched in; float16 from e5m2 is the code itself, one byte permutation a pair.
// Every mode gives the same values bit for bit for all 256 codes (NaN for NaN codes, infinities,
// signed zeros, subnormals): tests/emulator/emu_fp8.cpp checks modes 0 and 2, and the GPU test of
// every code checks the plugin's mode on the device. The plugin picks mode 1 (paged.fp8_cvt):
// mode 2 was slower on the H200 (D1-fp8 245 against 201 us).
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
template <int FORMAT, bool BF>
TX_DEVICE u32 tx_fp8x2_cvt(u32 pair) {
  u32 h;
  const unsigned short p = (unsigned short)(pair & 0xffffu);
  if (FORMAT == 2) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(h) : "h"(p));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(p));
  }
  if (!BF) return h;
  u32 b;
  asm("{\n .reg .f16 lo, hi;\n .reg .f32 flo, fhi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 flo, lo;\n"
      " cvt.f32.f16 fhi, hi;\n cvt.rn.bf16x2.f32 %0, fhi, flo;\n}\n"
      : "=r"(b)
      : "r"(h));
  return b;
}
#endif

// TX_FP8_CVT = 2: two fp8 codes -> a pair of 16-bit values, by integer operations and a multiply.
// `sel` is the byte permutation that places the two codes of `w` in the high bytes of the two
// halves of a word x (0x1404: bytes 0 and 1 of w; 0x3424: bytes 2 and 3). In each half: the sign
// stays at bit 15, the magnitude (exponent and mantissa) shifts right until its exponent field is
// the low bits of the 16-bit format's (e4m3 -> bfloat16: 4, -> float16: 1; e5m2 -> bfloat16: 3),
// which reads as the code's value times 2^-(bias difference) (subnormals included: they become
// the 16-bit format's subnormals or normals), so one exact multiply by 2^(bias difference)
// (2^120, 2^8; 2^112) gives the value. Codes whose exponent field is all ones (e4m3fn's NaN
// 0x7f/0xff; e5m2's infinities and NaN) come out finite; adding one (e5m2: 4) to their
// magnitude carries into bit 15, which a sign-replicating byte permutation spreads into a mask
// of the 16-bit exponent field: OR-ed in, it makes the infinities and NaN (the mantissa, zero
// for infinities, is kept).
TX_DEVICE u32 tx_prmt(u32 a, u32 b, u32 sel) {
#if defined(__CUDA_ARCH__)
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
#else
  u32 r = 0;
  const unsigned long long ab = (unsigned long long)a | ((unsigned long long)b << 32);
  for (int i = 0; i < 4; ++i) {
    const u32 s = (sel >> (4 * i)) & 0xfu;
    u32 byte = (u32)(ab >> (8 * (s & 7u))) & 0xffu;
    if (s & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;  // sign-replicate
    r |= byte << (8 * i);
  }
  return r;
#endif
}
template <int FORMAT, bool BF>
TX_DEVICE u32 tx_fp8x2_int(u32 w, u32 sel) {
  const u32 x = tx_prmt(w, 0u, sel);
  if (FORMAT == 2 && !BF) return x;  // e5m2 is float16's top byte
  constexpr int SHIFT = FORMAT == 2 ? 3 : (BF ? 4 : 1);
  // 2^(bias difference) as a 16-bit pair: bfloat16 2^120 (0x7b80), 2^112 (0x7780); float16 2^8 (0x5c00)
  constexpr u32 SCALE = FORMAT == 2 ? 0x77807780u : (BF ? 0x7b807b80u : 0x5c005c00u);
  constexpr u32 INC = FORMAT == 2 ? 0x04000400u : 0x01000100u;  // carries into bit 15 for all-ones exponents
  constexpr u32 EXP = BF ? 0x7f807f80u : 0x7c007c00u;           // the 16-bit exponent fields
  const u32 mag = x & 0x7f007f00u;
  const u32 y = (mag >> SHIFT) | (x & 0x80008000u);
  u32 r;
#if defined(__CUDA_ARCH__)
  if (BF) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(y), "r"(SCALE), "r"(0x80008000u));  // + -0: exact
  } else {
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(y), "r"(SCALE));
  }
#else
  const float f = __uint_as_float((u32)(127 + (FORMAT == 2 ? 112 : (BF ? 120 : 8))) << 23);  // the scale
  const u16 y0 = (u16)(y & 0xffffu), y1 = (u16)(y >> 16);
  r = BF ? tx_pack2(tx_to_float(y0) * f, tx_to_float(y1) * f)
         : tx_pack2_f16(tx_f16_to_float(y0) * f, tx_f16_to_float(y1) * f);
#endif
  const u32 special = tx_prmt(mag + INC, 0u, 0xbb99u);  // 0xffff in each half whose exponent was all ones
  return r | (special & EXP);
}

// Four fp8 values (one 32-bit word, the first in the low byte) -> four 16-bit values in two words
// (BF: bfloat16, else float16); e5m2: format 2, else e4m3fn.
template <int FORMAT, bool BF>
TX_DEVICE void tx_fp8x4_to(u32 w, u32& lo, u32& hi) {
#if TX_FP8_CVT == 2
  lo = tx_fp8x2_int<FORMAT, BF>(w, 0x1404u);
  hi = tx_fp8x2_int<FORMAT, BF>(w, 0x3424u);
#elif TX_FP8_CVT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  lo = tx_fp8x2_cvt<FORMAT, BF>(w);
  hi = tx_fp8x2_cvt<FORMAT, BF>(w >> 16);
#else
  float f[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 b = (w >> (8 * j)) & 0xffu;
    f[j] = FORMAT == 2 ? tx_e5m2_to_float(b) : tx_e4m3_to_float(b);
  }
  lo = BF ? tx_pack2(f[0], f[1]) : tx_pack2_f16(f[0], f[1]);
  hi = BF ? tx_pack2(f[2], f[3]) : tx_pack2_f16(f[2], f[3]);
#endif
}
// ... into the kernel's 16-bit type (TX_BF16), and into float16
template <int FORMAT>
TX_DEVICE void tx_fp8x4_to_16(u32 w, u32& lo, u32& hi) {
  tx_fp8x4_to<FORMAT, TX_BF16 != 0>(w, lo, hi);
}
template <int FORMAT>
TX_DEVICE void tx_fp8x4_to_f16(u32 w, u32& lo, u32& hi) {
  tx_fp8x4_to<FORMAT, false>(w, lo, hi);
}

// bfloat16 q against an fp8 cache: Q K^T runs in float16, where K's codes take one conversion a
// pair (bfloat16 takes four, through float32: on the H200 D1-fp8 went from 200 to 193 us).
// A bfloat16 row of q is scaled by 2^e first, e the exponent that brings its largest magnitude into
// [2^14, 2^15): every element within 2^-31 of that largest is then a float16 value exactly (float16
// keeps bfloat16's 8 significant bits from 2^-17 up), and the rest, which move the row's dot
// products by less than 2^-40 of their largest term, round; the logits are scaled back by 2^-e in
// fp32, exactly. e is 0 for a row of zeros, an infinity or NaN (which the float16 value keeps).
TX_DEVICE int tx_f16_row_exponent(float largest) {
  if (!(largest > 0.f && largest < __int_as_float(0x7f800000))) return 0;
  u32 b = __float_as_uint(largest);
  int below = 0;
  if (b < 0x00800000u) {  // a subnormal float (and bfloat16): 2^64 times it is normal, exactly
    b = __float_as_uint(largest * 18446744073709551616.0f);
    below = 64;
  }
  return 14 - ((int)(b >> 23) - 127 - below);
}
// x 2^e, exact where the result is a normal float, for e in [-260, 254] (two factors in range)
TX_DEVICE float tx_ldexp2(float x, int e) {
  const int a = e / 2;
  return x * __uint_as_float((u32)(a + 127) << 23) * __uint_as_float((u32)(e - a + 127) << 23);
}
