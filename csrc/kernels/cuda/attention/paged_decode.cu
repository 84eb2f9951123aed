// Flash-decoding attention over a paged KV cache, one query token per
// sequence: which split kernel runs for a dtype.
//
// Decode runs in two kernels, both with fixed reduction orders (bitwise
// reproducible run to run):
//  1. The split kernel: one block per (batch b, kv head, chunk of the query
//     heads of its GQA group, split of split_tokens tokens). Each warp
//     streams tiles of the split's K and V rows through a cp.async ring in
//     shared memory and keeps an online softmax for all the chunk's heads
//     (K/V read once, not once per head); the warps merge in order. bf16/f16:
//     DecodeSplitMmaKernel (tensor cores, 8 heads per block,
//     decode_split_mma.cu); f32: DecodeSplitKernel (SIMT, up to 8,
//     decode_split_simt.cu). Per head: the split's max m and sum l of
//     exp(score - m) and the unnormalised sum of exp(score - m) * V, written
//     to the scratch outputs part_stats (B, Hq, S, 2) and part_out
//     (B, Hq, S, Dv). No allocation: the scratch is an extra output of the
//     custom call.
//  2. DecodeCombineKernel (decode_combine.cu): one warp per (b, query head);
//     merges the splits holding tokens, in split order. On sm_90+ it is
//     launched with programmatic dependent launch, so its blocks are resident
//     when the split kernel's last blocks finish. Merging in the split
//     kernel's last block instead (an arrival counter per block column)
//     measured slower: every block's fence and atomic, and the merges in the
//     grid's tail, cost more than the combine launch (see docs/performance.md).
// Head dims: K's (q's) and V's may differ, each a multiple of 8 up to 256.
// The kernels are compiled for 64, 128 and 256 only (few instantiations) and
// serve a smaller dim with the next larger one: K and V rows are copied to
// shared memory zero-filled past their own dims (nothing past them is read),
// q likewise, so the scores and the first Dv outputs are exact.
// Semantics are those of the CPU kernel (kernels/cpu/attention.cc): lengths
// are clamped to [0, max_pages * page_size], tokens on a page id outside
// [0, num_pages) are skipped, and a sequence without valid tokens gives 0.
#include <cuda_runtime.h>

#include "kernels/cuda/attention/decode_common.cuh"
#include "kernels/cuda/attention/launch.h"

namespace jax_moe {

// bf16/f16 run the tensor-core kernel (8 heads per block), f32 the SIMT
// kernel.
cudaError_t LaunchDecodeSplit(cudaStream_t stream, DType dtype, const DecodeDims& d,
                              const void* q, const void* k_pages, const void* v_pages,
                              const int32_t* page_table, const int32_t* lengths, float scale,
                              float* part_out, float* part_stats) {
  if (dtype == DType::F32)
    return LaunchDecodeSplitSimt(stream, d, q, k_pages, v_pages, page_table, lengths, scale,
                                 part_out, part_stats);
  return LaunchDecodeSplitMma(stream, dtype, d, q, k_pages, v_pages, page_table, lengths, scale,
                              part_out, part_stats);
}

}  // namespace jax_moe
