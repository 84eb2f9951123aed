// The Hopper k-grouped weight-gradient GEMM (wgrad_sm90a.cu). Defined only
// when the build has it (JAX_MOE_WITH_SM90); callers use it under that macro.
// Plain C++: no XLA include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace jax_moe {

// One weight-gradient call: out[e] (n, k) = sum over the rows r of expert e
// of outer(dy[r], x_r), f32 accumulation, stored in bf16/f16. Expert e owns
// rows [min(P_e, m), min(P_{e+1}, m)), P the prefix sum of max(sizes, 0);
// x_r = x[r], or with a gather x[rows[r] / topk] (a zero row where rows[r] is
// outside [0, x_rows * topk)). Experts with no rows get exactly zero.
struct Sm90WgradCall {
  cudaStream_t stream;
  bool bf16;              // else f16
  const void* dy;         // (m, n)
  const void* x;          // (m, k), or (x_rows, k) with a gather
  const int32_t* sizes;   // (groups,) rows per expert (device)
  const int32_t* rows;    // (m,) dst_to_src of the gather (device), or null
  int64_t topk;
  void* out;              // (groups, n, k)
  int64_t m, n, k, groups, x_rows;
  void* scratch;          // the call's scratch output (device)
  size_t scratch_bytes;
  int max_ctas = 0;       // at most this many CTAs in the persistent grid (0: one an SM)
};

// Runs `c` on the CUTLASS sm90 path when it applies (a compute capability 9.0
// device whose kernels load, bf16/f16, 16-byte aligned dy, x and out, n and k
// positive multiples of 8, m, n, k and groups below 2^31, groups > 0, scratch
// large enough) and sets *ran. Otherwise it launches nothing, leaves *ran
// false and the caller runs another kernel. Launches only on c.stream: no
// sync, no allocation, no host copy. Deterministic: each output tile is
// summed by one CTA in a fixed order. Returns the CUDA error of a failed launch.
cudaError_t GroupGemmWgradSm90(const Sm90WgradCall& c, bool* ran);

// Bytes of the scratch output that GroupGemmWgradSm90 needs: group arrays,
// the list of empty experts, the CUTLASS workspace for up to 144 SMs and,
// with a gather, the expanded rows (m x k 16-bit elements). A pure function
// of its arguments: no device query.
int64_t GroupGemmWgradSm90ScratchBytes(int64_t m, int64_t k, int64_t groups, bool gather);

}  // namespace jax_moe
