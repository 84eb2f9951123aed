// The Hopper fp8 grouped GEMM (fp8_sm90a.cu), which the group_gemm_fp8 CUDA
// handler (csrc/ffi/group_gemm_fp8.cc) runs where it applies. Defined only
// when the build has it (JAX_MOE_WITH_SM90). Plain C++: no XLA include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace jax_moe {

// One group_gemm_fp8 call: out (m, n) bf16 = rows of x (m, k) bf16, quantised
// per 128 channels, grouped by expert times the block-scaled e4m3 w[e]^T.
// With a gather, row r of x is x[rows[r] / topk] (x (x_rows, k)), a zero row
// outside [0, x_rows * topk). With an activation (no gather), row r is
// act(x[r, :k]) * x[r, k:] rounded to bf16 (gated; x (m, 2k)) or act(x[r])
// (x (m, k)), as the activation kernel computes it.
struct Sm90Fp8Call {
  cudaStream_t stream;
  const void* x;          // (m, k) bf16, or (x_rows, k) with a gather
  const uint8_t* w;       // (groups, n, k) e4m3 codes
  const float* w_scale;   // (groups, ceil(n/128), ceil(k/128))
  const int32_t* sizes;   // (groups,) rows per expert (device)
  const int32_t* rows;    // (m,) dst_to_src of the gather (device), or null
  int64_t topk;
  int64_t x_rows;
  void* out;              // (m, n) bf16
  int64_t m, n, k, groups;
  void* scratch;          // the call's scratch output (device)
  size_t scratch_bytes;
  int tile_m;             // 64 or 128 rows a tile; 0: 64 where m < 128 * groups
  int activation = -1;    // -1 none, else an Activation (kernels/common/numeric.h)
  bool gated = false;     // with an activation: x's rows are (gate, up)
};

// Runs `c` on CUTLASS's sm90 blockwise-scaled fp8 grouped GEMM when it
// applies (a compute capability 9.0 device whose kernels load, 16-byte
// aligned operands, n % 8 == 0, k % 16 == 0, sizes below 2^31, scratch large
// enough) and sets *ran; otherwise it launches nothing and leaves *ran false.
// Launches only on c.stream: no sync, no allocation, no host copy.
cudaError_t GroupGemmFp8Sm90(const Sm90Fp8Call& c, bool* ran);

// Bytes of group_gemm_fp8's scratch output for that path: the group arrays,
// the CUTLASS workspace for up to 144 SMs, x quantised (m x k codes, m x
// ceil(k/128) scales) and w_scale transposed. A pure function of its
// arguments: no device query.
int64_t GroupGemmFp8Sm90ScratchBytes(int64_t m, int64_t n, int64_t k, int64_t groups);

}  // namespace jax_moe
