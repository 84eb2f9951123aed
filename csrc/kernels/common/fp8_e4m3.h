// The block-scaled fp8 (e4m3fn) recipe of jax_moe.fp8, shared by the CPU and
// CUDA kernels so that both quantise exactly as the reference twin:
//   scale = amax * (1/448) over a block's finite magnitudes (1 for an
//           all-zero block, NaN for a block holding a NaN or an infinity);
//   value = e4m3(clip(v * (1 / scale), -448, 448)), round to nearest even.
// Plain integer and float arithmetic (no intrinsics), so host and device
// give the same bits. No XLA include.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common/numeric.h"

namespace jax_moe {

constexpr int kFp8Block = 128;                 // channels per scale, both operands
constexpr float kFp8Max = 448.0f;              // e4m3fn's largest finite value
constexpr float kInvFp8Max = 1.0f / 448.0f;    // the same f32 constant as fp8.INV_FP8_MAX

JAX_MOE_HOST_DEVICE JAX_MOE_INLINE uint32_t Fp8FloatBits(float v) {
  uint32_t b;
  memcpy(&b, &v, 4);
  return b;
}

JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float Fp8BitsFloat(uint32_t b) {
  float v;
  memcpy(&v, &b, 4);
  return v;
}

// e4m3fn code -> float (exact). 0x7f / 0xff are NaN; there is no infinity.
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float Fp8ToFloat(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  const uint32_t e = (c >> 3) & 0xf, m = c & 7;
  if (e == 0xf && m == 7) return Fp8BitsFloat(0x7fc00000u | sign);
  if (e == 0) {  // subnormal: m * 2^-9
    const float mag = static_cast<float>(m) * (1.0f / 512.0f);
    return sign ? -mag : mag;
  }
  return Fp8BitsFloat(sign | ((e + 120) << 23) | (m << 20));  // 2^(e-7) * (1 + m/8)
}

// float -> e4m3fn, round to nearest even; |v| must be <= 448 or NaN (the
// recipe clips first). NaN -> 0x7f (with v's sign).
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE uint8_t FloatToFp8(float v) {
  const uint32_t bits = Fp8FloatBits(v);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7f;
  const int exp = static_cast<int>(mag >> 23) - 127;
  if (exp < -6) {
    // Subnormal range (and zero): a multiple of 2^-9, ties to even. The
    // product by 512 is exact; 8 rounds up into the smallest normal (code 8).
    const float q = Fp8BitsFloat(mag) * 512.0f;  // < 8
    uint32_t n = static_cast<uint32_t>(q);       // floor
    const float rest = q - static_cast<float>(n);
    if (rest > 0.5f || (rest == 0.5f && (n & 1))) ++n;
    return sign | static_cast<uint8_t>(n);
  }
  const uint32_t mant = mag & 0x7fffffu;
  uint32_t code = (static_cast<uint32_t>(exp + 7) << 3) | (mant >> 20);
  const uint32_t low = mant & 0xfffffu;
  if (low > 0x80000u || (low == 0x80000u && (code & 1))) ++code;  // carries into the exponent
  return sign | static_cast<uint8_t>(code);
}

// The scale of a block from its largest finite magnitude and whether it held
// a non-finite value.
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float Fp8BlockScale(float amax, bool bad) {
  if (bad) return Fp8BitsFloat(0x7fc00000u);
  return amax > 0.0f ? amax * kInvFp8Max : 1.0f;
}

// One element of a block with scale reciprocal `inv` (= 1 / scale, one f32
// division per block): the e4m3 code of clip(v * inv).
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE uint8_t Fp8Quantize(float v, float inv) {
  float q = v * inv;
  if (q == q) q = q > kFp8Max ? kFp8Max : (q < -kFp8Max ? -kFp8Max : q);  // NaN stays NaN
  return FloatToFp8(q);
}

// Whether |v| counts toward a block's amax (finite) or makes it bad.
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE bool Fp8Finite(float v) {
  return (Fp8FloatBits(v) & 0x7f800000u) != 0x7f800000u;
}

}  // namespace jax_moe
