// The launchers of the paged attention kernels on the GPU (this folder):
// write_kv, paged decode (split kernel, then combine; see paged_decode.cu)
// and fill_rows. A plain C++ header for the handlers (ffi/attention.cc):
// raw device pointers, DType, the dims of kernels/common/attention.h and a
// stream; each launcher enqueues its kernels on `stream` and returns the
// launch's error (cudaSuccess when nothing was to be done).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/attention.h"
#include "kernels/common/numeric.h"

namespace jax_moe {

// write_kv: row i of k (n rows of k_row_bytes bytes) and of v (v_row_bytes)
// into slot slots[i] of k_out / v_out (num_slots slots of those rows); slots
// outside [0, num_slots) are skipped. Duplicate slots race (Python rejects
// them).
cudaError_t LaunchWriteKv(cudaStream_t stream, const void* k, const void* v,
                          const int32_t* slots, int64_t n, int64_t k_row_bytes,
                          int64_t v_row_bytes, int64_t num_slots, void* k_out, void* v_out);

// paged decode, step 1: the split kernel of `dtype` writes each split's
// partial output (part_out, (B, Hq, S, Dv) f32) and (max, sum) (part_stats,
// (B, Hq, S, 2) f32). Needs d.k_dim and d.v_dim multiples of 8 in [8, 256]
// (DecodeHeadDimOk), d.num_splits <= 65535, fewer than 2^31 cache slots and
// batch * hq < 2^31 (the handler's checks).
cudaError_t LaunchDecodeSplit(cudaStream_t stream, DType dtype, const DecodeDims& d,
                              const void* q, const void* k_pages, const void* v_pages,
                              const int32_t* page_table, const int32_t* lengths, float scale,
                              float* part_out, float* part_stats);

// paged decode, step 2: merges the splits into out (B, Hq, Dv) of `dtype`.
// On sm_90+ launched with programmatic dependent launch unless allow_pdl is
// false (it then starts only once the split kernel has finished).
cudaError_t LaunchDecodeCombine(cudaStream_t stream, DType dtype, const DecodeDims& d,
                                const float* part_out, const float* part_stats,
                                const int32_t* lengths, void* out, bool allow_pdl = true);

// fill_rows: rows >= ctrl[0] of x (rows x row_bytes bytes of `dtype`) become
// 0, or with ctrl[1] != 0 every element becomes NaN; ctrl is read on the
// device (no host sync).
cudaError_t LaunchFillRows(cudaStream_t stream, DType dtype, void* x, const int32_t* ctrl,
                           int64_t rows, int64_t row_bytes);

}  // namespace jax_moe
