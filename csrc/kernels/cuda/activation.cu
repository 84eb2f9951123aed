// Step 5 on the GPU: act(h[r, :I]) * h[r, I:] (gated) or act(h[r, :]) in f32,
// 16-byte accesses when I allows, grid-stride over rows x I.
#include "kernels/cuda/activation.h"

#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

template <int ACT>
__device__ __forceinline__ float Act(float g) {
  if constexpr (ACT == kGeluExact) {
    return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
  } else if constexpr (ACT == kGeluTanh) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  } else {
    return g / (1.f + expf(-g));
  }
}

template <DType DT, int ACT, bool GATED, int VEC>
__global__ void GatedActKernel(const typename DevScalar<DT>::T* __restrict__ in,
                               int64_t rows, int64_t inter,
                               typename DevScalar<DT>::T* __restrict__ out) {
  constexpr int kWidth = GATED ? 2 : 1;  // input row = kWidth * inter
  using S = DevScalar<DT>;
  using T = typename S::T;
  const int64_t per_row = inter / VEC;
  const int64_t total = rows * per_row;
  PdlTrigger();
  PdlWait();  // in may be the previous kernel's output
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / per_row;
    const int64_t c = (idx - r * per_row) * VEC;
    const T* gate = in + r * kWidth * inter + c;
    const T* up = gate + inter;  // read only when GATED
    T g[VEC], u[VEC], o[VEC];
    if constexpr (VEC == 1) {
      g[0] = gate[0];
      if constexpr (GATED) u[0] = up[0];
    } else {
      *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(gate);
      if constexpr (GATED) *reinterpret_cast<uint4*>(u) = *reinterpret_cast<const uint4*>(up);
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float a = Act<ACT>(S::Load(g[v]));
      if constexpr (GATED) a *= S::Load(u[v]);
      o[v] = S::Store(a);
    }
    if constexpr (VEC == 1) {
      out[r * inter + c] = o[0];
    } else {
      *reinterpret_cast<uint4*>(out + r * inter + c) = *reinterpret_cast<uint4*>(o);
    }
  }
}

template <DType DT, int ACT, bool GATED>
cudaError_t LaunchAct(cudaStream_t stream, const void* in, int64_t rows, int64_t inter, void* out,
                      bool pdl) {
  using T = typename DevScalar<DT>::T;
  constexpr int kVec = 16 / sizeof(T);
  const auto* ip = static_cast<const T*>(in);
  auto* op = static_cast<T*>(out);
  if (inter % kVec == 0)
    return LaunchKernel(GatedActKernel<DT, ACT, GATED, kVec>, GridFor(rows * inter / kVec, 256),
                        256, 0, stream, pdl, ip, rows, inter, op);
  return LaunchKernel(GatedActKernel<DT, ACT, GATED, 1>, GridFor(rows * inter, 256), 256, 0,
                      stream, pdl, ip, rows, inter, op);
}

template <DType DT, int ACT>
cudaError_t LaunchGated(cudaStream_t stream, bool gated, const void* in, int64_t rows,
                        int64_t inter, void* out, bool pdl) {
  if (gated) return LaunchAct<DT, ACT, true>(stream, in, rows, inter, out, pdl);
  return LaunchAct<DT, ACT, false>(stream, in, rows, inter, out, pdl);
}

template <DType DT>
cudaError_t LaunchActivationT(cudaStream_t stream, int64_t activation, bool gated, const void* in,
                              int64_t rows, int64_t inter, void* out, bool pdl) {
  switch (activation) {
    case kGeluExact: return LaunchGated<DT, kGeluExact>(stream, gated, in, rows, inter, out, pdl);
    case kGeluTanh: return LaunchGated<DT, kGeluTanh>(stream, gated, in, rows, inter, out, pdl);
    default: return LaunchGated<DT, kSilu>(stream, gated, in, rows, inter, out, pdl);
  }
}

}  // namespace

cudaError_t LaunchActivation(cudaStream_t stream, DType dtype, int64_t activation,
                             bool gated, const void* in, int64_t rows, int64_t inter, void* out,
                             bool pdl) {
  if (rows * inter == 0) return cudaSuccess;
  return WithDType(dtype, [&]<DType DT>() {
    return LaunchActivationT<DT>(stream, activation, gated, in, rows, inter, out, pdl);
  });
}

}  // namespace jax_moe
