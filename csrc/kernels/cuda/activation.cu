// Step 5 on the GPU: act(h[r, :I]) * h[r, I:] (gated) or act(h[r, :]) in f32,
// and its backward; 16-byte accesses when I allows, grid-stride over rows x I.
#include "kernels/cuda/activation.h"

#include "kernels/cuda/act_math.cuh"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

// VEC consecutive elements: 16 bytes at once when VEC > 1.
template <int VEC, typename T>
__device__ __forceinline__ void LoadVec(const T* p, T* v) {
  if constexpr (VEC == 1) {
    v[0] = p[0];
  } else {
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(p);
  }
}

template <int VEC, typename T>
__device__ __forceinline__ void StoreVec(T* p, const T* v) {
  if constexpr (VEC == 1) {
    p[0] = v[0];
  } else {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
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

// The backward: for the cotangent d (rows x inter), out (in's shape) = d * up *
// act'(gate) and d * act(gate) (gated) or d * act'(in).
template <DType DT, int ACT, bool GATED, int VEC>
__global__ void GatedActGradKernel(const typename DevScalar<DT>::T* __restrict__ in,
                                   const typename DevScalar<DT>::T* __restrict__ d,
                                   int64_t rows, int64_t inter,
                                   typename DevScalar<DT>::T* __restrict__ out) {
  constexpr int kWidth = GATED ? 2 : 1;
  using S = DevScalar<DT>;
  using T = typename S::T;
  const int64_t per_row = inter / VEC;
  const int64_t total = rows * per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / per_row;
    const int64_t c = (idx - r * per_row) * VEC;
    const int64_t at = r * kWidth * inter + c;
    T g[VEC], u[VEC], dv[VEC], dg[VEC], du[VEC];
    LoadVec<VEC>(in + at, g);
    if constexpr (GATED) LoadVec<VEC>(in + at + inter, u);
    LoadVec<VEC>(d + r * inter + c, dv);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float slope;
      const float a = ActSlope<ACT>(S::Load(g[v]), &slope);
      const float dd = S::Load(dv[v]);
      if constexpr (GATED) {
        dg[v] = S::Store(dd * S::Load(u[v]) * slope);
        du[v] = S::Store(dd * a);
      } else {
        dg[v] = S::Store(dd * slope);
      }
    }
    StoreVec<VEC>(out + at, dg);
    if constexpr (GATED) StoreVec<VEC>(out + at + inter, du);
  }
}

template <DType DT, int ACT, bool GATED>
cudaError_t LaunchActGrad(cudaStream_t stream, const void* in, const void* d, int64_t rows,
                          int64_t inter, void* out) {
  using T = typename DevScalar<DT>::T;
  constexpr int kVec = 16 / sizeof(T);
  const auto* ip = static_cast<const T*>(in);
  const auto* dp = static_cast<const T*>(d);
  auto* op = static_cast<T*>(out);
  if (inter % kVec == 0)
    return LaunchKernel(GatedActGradKernel<DT, ACT, GATED, kVec>,
                        GridFor(rows * inter / kVec, 256), 256, 0, stream, false, ip, dp, rows,
                        inter, op);
  return LaunchKernel(GatedActGradKernel<DT, ACT, GATED, 1>, GridFor(rows * inter, 256), 256, 0,
                      stream, false, ip, dp, rows, inter, op);
}

template <DType DT, int ACT>
cudaError_t LaunchGatedGrad(cudaStream_t stream, bool gated, const void* in, const void* d,
                            int64_t rows, int64_t inter, void* out) {
  if (gated) return LaunchActGrad<DT, ACT, true>(stream, in, d, rows, inter, out);
  return LaunchActGrad<DT, ACT, false>(stream, in, d, rows, inter, out);
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

template <DType DT>
cudaError_t LaunchActivationGradT(cudaStream_t stream, int64_t activation, bool gated,
                                  const void* in, const void* d, int64_t rows, int64_t inter,
                                  void* out) {
  switch (activation) {
    case kGeluExact: return LaunchGatedGrad<DT, kGeluExact>(stream, gated, in, d, rows, inter, out);
    case kGeluTanh: return LaunchGatedGrad<DT, kGeluTanh>(stream, gated, in, d, rows, inter, out);
    default: return LaunchGatedGrad<DT, kSilu>(stream, gated, in, d, rows, inter, out);
  }
}

// The routed layer's backward (activation.h's LaunchActivationScaledGrad):
// one warp a row, so that the row's dot product is a warp reduction; each lane
// sums its columns in order and the warp adds the lanes in a fixed tree, so
// the bits do not depend on the grid. dh may be `in` itself (the layer's
// backward overwrites h): each thread reads its elements before it writes
// the same ones, and no other thread touches them.
template <DType DT, int ACT, bool GATED, int VEC>
__global__ void ScaledActGradKernel(const typename DevScalar<DT>::T* in,
                                    const typename DevScalar<DT>::T* __restrict__ d,
                                    const float* __restrict__ scale, int64_t rows,
                                    int64_t inter, typename DevScalar<DT>::T* dh,
                                    typename DevScalar<DT>::T* __restrict__ as,
                                    float* __restrict__ dot) {
  constexpr int kWidth = GATED ? 2 : 1;
  using S = DevScalar<DT>;
  using T = typename S::T;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       r < rows; r += warps) {
    const float sc = scale[r];
    float sum = 0.f;
    for (int64_t c = static_cast<int64_t>(lane) * VEC; c < inter; c += 32 * VEC) {
      const int64_t at = r * kWidth * inter + c;
      T g[VEC], u[VEC], dv[VEC], dg[VEC], du[VEC], o[VEC];
      LoadVec<VEC>(in + at, g);
      if constexpr (GATED) LoadVec<VEC>(in + at + inter, u);
      LoadVec<VEC>(d + r * inter + c, dv);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float slope;
        const float x = S::Load(g[v]);
        const float ag = ActSlope<ACT>(x, &slope);  // as the plain backward's
        const float a = Act<ACT>(x);  // as the forward's
        const float up = GATED ? S::Load(u[v]) : 1.f;
        const float gd = S::Load(dv[v]);
        const float dd = sc * gd;
        sum += S::Load(S::Store(a * up)) * gd;
        o[v] = S::Store(sc * (a * up));
        dg[v] = S::Store(GATED ? dd * up * slope : dd * slope);
        if constexpr (GATED) du[v] = S::Store(dd * ag);
      }
      StoreVec<VEC>(dh + at, dg);
      if constexpr (GATED) StoreVec<VEC>(dh + at + inter, du);
      StoreVec<VEC>(as + r * inter + c, o);
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) dot[r] = sum;
  }
}

template <DType DT, int ACT, bool GATED>
cudaError_t LaunchScaledGrad(cudaStream_t stream, const void* in, const void* d,
                             const float* scale, int64_t rows, int64_t inter, void* dh, void* as,
                             float* dot) {
  using T = typename DevScalar<DT>::T;
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kThreads = 256;  // 8 rows a block at once
  const auto* ip = static_cast<const T*>(in);
  const auto* dp = static_cast<const T*>(d);
  const unsigned grid = GridFor(rows, kThreads / 32);
  if (inter % kVec == 0)
    return LaunchKernel(ScaledActGradKernel<DT, ACT, GATED, kVec>, grid, kThreads, 0, stream,
                        false, ip, dp, scale, rows, inter, static_cast<T*>(dh),
                        static_cast<T*>(as), dot);
  return LaunchKernel(ScaledActGradKernel<DT, ACT, GATED, 1>, grid, kThreads, 0, stream, false,
                      ip, dp, scale, rows, inter, static_cast<T*>(dh), static_cast<T*>(as), dot);
}

template <DType DT>
cudaError_t LaunchActivationScaledGradT(cudaStream_t stream, int64_t activation, bool gated,
                                        const void* in, const void* d, const float* scale,
                                        int64_t rows, int64_t inter, void* dh, void* as,
                                        float* dot) {
  auto run = [&]<int ACT>() {
    if (gated) return LaunchScaledGrad<DT, ACT, true>(stream, in, d, scale, rows, inter, dh, as,
                                                      dot);
    return LaunchScaledGrad<DT, ACT, false>(stream, in, d, scale, rows, inter, dh, as, dot);
  };
  switch (activation) {
    case kGeluExact: return run.template operator()<kGeluExact>();
    case kGeluTanh: return run.template operator()<kGeluTanh>();
    default: return run.template operator()<kSilu>();
  }
}

}  // namespace

cudaError_t LaunchActivationGrad(cudaStream_t stream, DType dtype, int64_t activation, bool gated,
                                 const void* in, const void* d, int64_t rows, int64_t inter,
                                 void* out) {
  if (rows * inter == 0) return cudaSuccess;
  return WithDType(dtype, [&]<DType DT>() {
    return LaunchActivationGradT<DT>(stream, activation, gated, in, d, rows, inter, out);
  });
}

cudaError_t LaunchActivation(cudaStream_t stream, DType dtype, int64_t activation,
                             bool gated, const void* in, int64_t rows, int64_t inter, void* out,
                             bool pdl) {
  if (rows * inter == 0) return cudaSuccess;
  return WithDType(dtype, [&]<DType DT>() {
    return LaunchActivationT<DT>(stream, activation, gated, in, rows, inter, out, pdl);
  });
}

cudaError_t LaunchActivationScaledGrad(cudaStream_t stream, DType dtype, int64_t activation,
                                       bool gated, const void* in, const void* d,
                                       const float* scale, int64_t rows, int64_t inter, void* dh,
                                       void* as, float* dot) {
  if (rows == 0) return cudaSuccess;
  return WithDType(dtype, [&]<DType DT>() {
    return LaunchActivationScaledGradT<DT>(stream, activation, gated, in, d, scale, rows, inter,
                                           dh, as, dot);
  });
}

}  // namespace jax_moe
