// The Hopper grouped GEMM (gemm_sm90a.cu), which the group_gemm CUDA handler
// (csrc/ffi/group_gemm.cc) runs for tile_m = 256. Defined only when the build
// has it (JAX_MOE_WITH_SM90); callers use it under that macro. Plain C++: no
// XLA include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace jax_moe {

// One group_gemm call: out (m, n) = rows of x grouped by expert times w[e]^T
// (w_kn: times w[e]).
struct Sm90GemmCall {
  cudaStream_t stream;
  bool bf16;              // else f16
  bool w_kn;              // w is (groups, k, n): the dgrad against the forward's weights
  const void* x;          // (m, k), or (x_rows, k) with a gather
  const void* w;          // (groups, n, k), or (groups, k, n) with w_kn
  const int32_t* sizes;   // (groups,) rows per expert (device)
  const int32_t* rows;    // (m,) dst_to_src of the gather (device), or null
  int64_t topk;
  void* out;              // (m, n)
  int64_t m, n, k, groups, x_rows;
  void* scratch;          // the call's scratch output (device)
  size_t scratch_bytes;
  int max_ctas = 0;       // at most this many CTAs in the persistent grid (0: one an SM)
};

// Runs `c` on the CUTLASS sm90 path when it applies (a compute capability 9.0
// device whose kernels load, bf16/f16, 16-byte aligned operands, n and k
// multiples of 8, k > 0, groups > 0, sizes below 2^31, scratch large enough)
// and sets *ran. Otherwise it launches nothing, leaves *ran false and the
// caller runs another kernel. Launches only on c.stream: no sync, no
// allocation, no host copy. Returns the CUDA error of a failed launch.
cudaError_t GroupGemmSm90(const Sm90GemmCall& c, bool* ran);

// Bytes of the scratch output that group_gemm needs for the sm90 path
// (tile_m = 256), either layout of w: group arrays, the CUTLASS workspace for
// up to 144 SMs and, with a gather, the expanded rows (m x k 16-bit
// elements). A pure function of its arguments: no device query.
int64_t GroupGemmSm90ScratchBytes(int64_t m, int64_t k, int64_t groups, bool gather);

// The w_kn halves of the two above (gemm_kn_sm90a.cu); callers use those.
cudaError_t GroupGemmSm90Kn(const Sm90GemmCall& c, bool* ran);
int64_t GroupGemmSm90KnScratchBytes(int64_t m, int64_t k, int64_t groups, bool gather);

}  // namespace jax_moe
