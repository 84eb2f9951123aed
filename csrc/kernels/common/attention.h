// Paged attention's shapes and limits, shared by the CPU and CUDA kernels and
// by the handlers' checks (ffi/attention_checks.h); no XLA include.
#pragma once

#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

// Tokens per split of the decode kernel (flash-decoding): the call's
// split_tokens attribute, a multiple of kDecodeSplitUnit (the CUDA kernel's 4
// warps x 16-token tiles) and at most kDecodeMaxSplitTokens (its page slots
// are staged in shared memory). Python picks it and sizes the scratch outputs
// (module attributes DECODE_SPLIT_UNIT, DECODE_MAX_SPLIT_TOKENS).
constexpr int64_t kDecodeSplitUnit = 64;
constexpr int64_t kDecodeMaxSplitTokens = 2048;

inline int64_t DecodeNumSplits(int64_t max_tokens, int64_t split_tokens) {
  int64_t s = (max_tokens + split_tokens - 1) / split_tokens;
  return s < 1 ? 1 : s;
}

// Head dims of paged decode: K's (= q's) and V's (the output's) may differ;
// each is a multiple of kDecodeHeadDimUnit (a 16-byte chunk of bf16 / f16,
// two of f32) up to kDecodeMaxHeadDim. The CUDA kernels are compiled for
// 64, 128 and 256 and run smaller dims on the next larger one.
constexpr int64_t kDecodeHeadDimUnit = 8;
constexpr int64_t kDecodeMaxHeadDim = 256;

inline bool DecodeHeadDimOk(int64_t d) {
  return d >= kDecodeHeadDimUnit && d <= kDecodeMaxHeadDim && d % kDecodeHeadDimUnit == 0;
}

// write_kv: caches of num_pages pages of page_size slots (num_slots in all),
// a slot holding k_row_elems = Hkv * Dk elements of K and v_row_elems = Hkv *
// Dv of V; n new rows.
struct WriteKvDims {
  int64_t num_pages, page_size, k_row_elems, v_row_elems, n, num_slots;
};

// paged_decode: q (batch, hq, k_dim), k_pages (num_pages, page_size, hkv,
// k_dim), v_pages (num_pages, page_size, hkv, v_dim), page_table (batch,
// max_pages), output (batch, hq, v_dim); group = hq / hkv query heads per kv
// head, max_tokens = max_pages * page_size, and num_splits splits of
// split_tokens tokens.
struct DecodeDims {
  int64_t batch, hq, hkv, group, k_dim, v_dim, num_pages, page_size, max_pages, max_tokens,
      split_tokens, num_splits;
};

// The bit pattern of a quiet NaN of a float dtype (2 or 4 bytes).
inline uint32_t NanBits(DType t) {
  switch (t) {
    case DType::BF16: return 0x7FC0u;
    case DType::F16: return 0x7E00u;
    default: return 0x7FC00000u;
  }
}

}  // namespace jax_moe
