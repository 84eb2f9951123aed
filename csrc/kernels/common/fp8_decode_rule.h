// Where group_gemm_fp8's decode form (tile_m = 8, kernels/cuda/group_gemm/
// fp8_skinny.cuh) takes a problem, by its shape alone. Plain C++: the CUDA
// dispatch and Python's tile choice (through the extension) read this one
// rule. The dispatch also checks what needs the device (its shared memory
// limit) or the call's pointers (16-byte alignment).
#pragma once

#include <cstdint>

#include "kernels/common/fp8_e4m3.h"

namespace jax_moe {

constexpr int kFp8DecodeRows = 8;                   // token rows a pass: the mma's N
constexpr int64_t kFp8DecodeMaxSmem = 160 * 1024;  // bytes of shared memory a block

// Shared memory of a call: row starts S and pass prefix Q (groups + 1 int32
// each), a pass's quantised rows (codes, rows of kb * 128) and their block
// scales.
inline int64_t Fp8DecodeSmem(int64_t groups, int64_t k) {
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block;
  return 2 * (groups + 1) * 4 + kFp8DecodeRows * kb * (kFp8Block + 4);
}

// K a positive multiple of 16 (each lane loads 8 channels at once, all in K
// or all past it) and the shared memory within kFp8DecodeMaxSmem.
inline bool Fp8DecodeShapeOk(int64_t groups, int64_t k) {
  return groups > 0 && k > 0 && k % 16 == 0 && Fp8DecodeSmem(groups, k) <= kFp8DecodeMaxSmem;
}

}  // namespace jax_moe
