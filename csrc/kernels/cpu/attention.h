// Paged KV cache on the CPU, on raw pointers (the handlers are
// ffi/attention.cc): write_kv, single-token decode attention over the pages
// of each sequence, and fill_rows. Single-threaded.
#pragma once

#include <cstdint>

#include "kernels/common/attention.h"
#include "kernels/common/numeric.h"

namespace jax_moe {

// Row i of k (n rows of k_row_bytes bytes) and of v (v_row_bytes) into slot
// slots[i] of k_out / v_out (num_slots slots of those rows); slots outside
// [0, num_slots) are skipped (negative = padding). Duplicate slots: the last
// token wins (Python rejects them eagerly).
void WriteKvSlots(const void* k, const void* v, const int32_t* slots, int64_t n,
                  int64_t k_row_bytes, int64_t v_row_bytes, int64_t num_slots, void* k_out,
                  void* v_out);

// out[b, h] (v_dim) = softmax(scale * q[b, h] . K[b, :L]) V[b, :L] over the tokens of
// sequence b, L = clamp(lengths[b], 0, max_pages * page_size); tokens on a
// page id outside [0, num_pages) are skipped (masked out). No valid token:
// the output is 0. Scores, softmax and accumulation in f32, in token order.
void PagedDecode(DType dtype, const void* q, const void* k_pages, const void* v_pages,
                 const int32_t* page_table, const int32_t* lengths, const DecodeDims& d,
                 float scale, void* out);

// Rows >= ctrl[0] of x (rows x row_bytes bytes of `dtype`) become 0, or with
// ctrl[1] != 0 every element becomes NaN.
void FillRows(DType dtype, void* x, const int32_t* ctrl, int64_t rows, int64_t row_bytes);

}  // namespace jax_moe
