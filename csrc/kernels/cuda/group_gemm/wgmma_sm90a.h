// The grouped GEMM's own Hopper kernel (wgmma_sm90a.cu): out (m, n) = rows of
// x grouped by expert times w[e]^T, w as (groups, n, k), bf16 or f16, f32
// accumulation. Defined only when the build has the sm90 objects
// (JAX_MOE_WITH_SM90). Plain C++: no XLA include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_moe {

struct WgmmaGemmCall {
  cudaStream_t stream;
  bool bf16;             // else f16
  const void* x;         // (m, k), or (x_rows, k) with a gather
  const void* w;         // (groups, n, k)
  const int32_t* sizes;  // (groups,) rows per expert (device)
  const int32_t* rows;   // (m,) dst_to_src of the gather (device), or null
  int64_t topk;
  void* out;             // (m, n)
  int64_t m, n, k, groups, x_rows;
  bool pdl = false;         // launched with programmatic dependent launch
  bool wait_first = false;  // with pdl: sizes and rows are the previous kernel's output
  int max_ctas = 0;         // at most this many CTAs (0: one an SM)
  // A device int the call zeroes and the CTAs take their tiles from (each
  // next tile goes to the first CTA free: sharers of a weight tile stay in
  // step); null: a static stride over the tiles.
  int* counter = nullptr;
  // The caller zeroed *counter earlier on the stream (moe_layer, before its
  // chain of kernels: a memset between two kernels would break their
  // programmatic dependent launch); else the call zeroes it.
  bool counter_zeroed = false;
  // An Activation code (needs the gather and n % 16 == 0): out (m, n / 2) =
  // act(h[:, :n/2]) * h[:, n/2:] for h the product rounded to the element
  // type, the bits of the GEMM then the activation kernel. -1: out = h.
  int64_t act = -1;
};

// Same semantics as every grouped GEMM here: expert e owns rows
// [min(P_e, m), min(P_{e+1}, m)) with P the prefix sum of max(size, 0); rows
// [min(P_E, m), m) of out are zero; a gather entry outside [0, x_rows * topk)
// reads a zero row. Runs when it applies (a compute capability 9.0 device, n
// and k multiples of 8, k > 0, 16-byte aligned operands, groups <= 1024,
// m, n, k, groups * n < 2^31; with act, a gather and
// n % 16 == 0) and sets *ran; otherwise launches nothing and
// leaves *ran false. On c.stream only: zeroes c.counter (when given and
// not counter_zeroed), then one kernel; no sync, no allocation. Returns the CUDA error of a failed
// launch.
cudaError_t GroupGemmWgmma(const WgmmaGemmCall& c, bool* ran);

}  // namespace jax_moe
