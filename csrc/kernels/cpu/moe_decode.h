// The routed layer for one token in one call on the CPU (ops.moe_decode;
// kernels/cpu/moe_decode.cc).
#pragma once

#include "kernels/common/moe_decode.h"
#include "kernels/common/numeric.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {

// p (host memory) with `dtype` (x's) bf16 or f16, within the kDecode*
// limits: the same steps and rounding points as the CUDA kernel, the dot
// products shared over `pool`.
void MoeDecode(const TaskPool& pool, DType dtype, const MoeDecodeProblem& p);

}  // namespace jax_moe
