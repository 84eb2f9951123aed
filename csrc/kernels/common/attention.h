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

// write_kv: caches of num_pages pages of page_size slots (num_slots in all),
// a slot holding row_elems = Hkv * D elements; n new rows.
struct WriteKvDims {
  int64_t num_pages, page_size, row_elems, n, num_slots;
};

// paged_decode: q (batch, hq, head_dim), caches (num_pages, page_size, hkv,
// head_dim), page_table (batch, max_pages); group = hq / hkv query heads per
// kv head, max_tokens = max_pages * page_size, and num_splits splits of
// split_tokens tokens.
struct DecodeDims {
  int64_t batch, hq, hkv, group, head_dim, num_pages, page_size, max_pages, max_tokens,
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
