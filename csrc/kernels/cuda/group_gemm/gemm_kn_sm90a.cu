// The Hopper grouped GEMM with w[e] stored as (K, N) row-major (CUTLASS's
// RowMajor B: N-major, which wgmma reads for 16-bit types as it reads
// K-major): out[rows of e] = x[rows of e] @ w[e]. The backward's dgrad runs
// it against the forward's weights (E, N, K) read as (E, K', N'), so no
// transposed copy of the weights is written each step. The machinery is
// gemm_sm90a.cuh's; this translation unit holds its six kernels.
#include "kernels/cuda/group_gemm/gemm_sm90a.cuh"

namespace jax_moe {

int64_t GroupGemmSm90KnScratchBytes(int64_t m, int64_t k, int64_t groups, bool gather) {
  return ScratchBytesSm90<cutlass::layout::RowMajor>(m, k, groups, gather);
}

cudaError_t GroupGemmSm90Kn(const Sm90GemmCall& c, bool* ran) {
  return DispatchSm90<cutlass::layout::RowMajor>(c, ran);
}

}  // namespace jax_moe
