// Rules and numerics shared by the kernels of both platforms and by the FFI
// handlers; no XLA include, so kernels and benchmarks can use it alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Host-and-device functions; JAX_MOE_INLINE: inlined into every kernel that
// calls it (as the kernels' own __forceinline__ helpers), plain inline on the host.
#if defined(__CUDACC__)
#define JAX_MOE_HOST_DEVICE __host__ __device__
#define JAX_MOE_INLINE __forceinline__
#else
#define JAX_MOE_HOST_DEVICE
#define JAX_MOE_INLINE inline
#endif

namespace jax_moe {

// The float element types the kernels take. The values are XLA's
// (xla::ffi::DataType), so a handler converts by a cast (ffi/ffi_common.h).
enum class DType : uint8_t { F16 = 10, F32 = 11, BF16 = 16 };

// Step 3's rule, shared by expand and the gathering GEMM on both platforms:
// the token row that a dst_to_src entry s names (s / topk), or -1 (a zero
// row) when s is outside [0, limit), limit = tokens * topk.
JAX_MOE_HOST_DEVICE inline int64_t ExpandSourceRow(int64_t s, int64_t topk, int64_t limit) {
  return s >= 0 && s < limit ? s / topk : -1;
}

// Activation codes shared by Python (jax_moe.ops) and both backends.
enum Activation : int64_t { kSilu = 0, kGeluExact = 1, kGeluTanh = 2 };

// Number of flat (token, slot) entries each block of the token-index kernels
// owns. Python sizes the scratch output with the same constant (exported by
// the module as INDEX_CHUNK).
constexpr int64_t kIndexChunk = 256;

// The CUDA kernels' per-chunk counts, plus one unused element that keeps the
// buffer non-empty when there are no entries.
inline int64_t IndexScratchSize(int64_t num_entries, int64_t num_local) {
  int64_t chunks = (num_entries + kIndexChunk - 1) / kIndexChunk;
  return chunks * num_local + 1;
}

// Calls fn.template operator()<DT>() for a float DType: a kernel's entry
// point (runtime dtype) into its template. The handlers have checked the
// dtype; anything else is taken as F32.
template <typename Fn>
decltype(auto) WithDType(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::BF16: return fn.template operator()<DType::BF16>();
    case DType::F16: return fn.template operator()<DType::F16>();
    default: return fn.template operator()<DType::F32>();
  }
}

// ---- host-side 16-bit float conversions (round to nearest even) ----------
inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u)  // NaN: a quiet one
    return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {
    // Subnormal or zero: the value in units of 2^-24, rounded to nearest even
    // (1024 lands on the smallest normal's encoding, as it should).
    float mag;
    std::memcpy(&mag, &abs, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(mag * 16777216.0f)));
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
}

// Load/store one element of a float buffer of any supported type as f32.
template <DType T> struct HostScalar;
template <> struct HostScalar<DType::F32> {
  using Storage = float;
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
template <> struct HostScalar<DType::BF16> {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return Bf16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBf16(v); }
};
template <> struct HostScalar<DType::F16> {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Store(float v) { return FloatToHalf(v); }
};

}  // namespace jax_moe
