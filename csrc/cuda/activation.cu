// Step 5 on the GPU: act(h[r, :I]) * h[r, I:] in f32, 16-byte accesses when
// I allows, grid-stride over rows x I.
#include "cuda/cuda_common.cuh"
#include "ops.h"

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

template <ffi::DataType DT, int ACT, int VEC>
__global__ void GatedActKernel(const typename DevScalar<DT>::T* __restrict__ in,
                               int64_t rows, int64_t inter,
                               typename DevScalar<DT>::T* __restrict__ out) {
  using S = DevScalar<DT>;
  using T = typename S::T;
  const int64_t per_row = inter / VEC;
  const int64_t total = rows * per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / per_row;
    const int64_t c = (idx - r * per_row) * VEC;
    const T* gate = in + r * 2 * inter + c;
    const T* up = gate + inter;
    T g[VEC], u[VEC], o[VEC];
    if constexpr (VEC == 1) {
      g[0] = gate[0];
      u[0] = up[0];
    } else {
      *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(gate);
      *reinterpret_cast<uint4*>(u) = *reinterpret_cast<const uint4*>(up);
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) o[v] = S::Store(Act<ACT>(S::Load(g[v])) * S::Load(u[v]));
    if constexpr (VEC == 1) {
      out[r * inter + c] = o[0];
    } else {
      *reinterpret_cast<uint4*>(out + r * inter + c) = *reinterpret_cast<uint4*>(o);
    }
  }
}

template <ffi::DataType DT, int ACT>
void LaunchGated(cudaStream_t stream, const void* in, int64_t rows, int64_t inter, void* out) {
  using T = typename DevScalar<DT>::T;
  constexpr int kVec = 16 / sizeof(T);
  const auto* ip = static_cast<const T*>(in);
  auto* op = static_cast<T*>(out);
  if (inter % kVec == 0) {
    GatedActKernel<DT, ACT, kVec><<<GridFor(rows * inter / kVec, 256), 256, 0, stream>>>(
        ip, rows, inter, op);
  } else {
    GatedActKernel<DT, ACT, 1><<<GridFor(rows * inter, 256), 256, 0, stream>>>(ip, rows, inter,
                                                                               op);
  }
}

ffi::Error GatedActCuda(cudaStream_t stream, ffi::AnyBuffer h, int64_t activation,
                        ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rows = LeadingRows(h.dimensions());
  const int64_t two_i = LastDim(h.dimensions());
  if (two_i % 2 != 0) return InvalidArg("gated activation: last dim must be even");
  if (activation < kSilu || activation > kGeluTanh) return InvalidArg("unknown activation code");
  const int64_t inter = two_i / 2;
  if (out->element_count() != static_cast<size_t>(rows * inter) ||
      out->element_type() != h.element_type())
    return InvalidArg("gated activation: output must be (..., I) of h's dtype");
  if (rows * inter == 0) return ffi::Error::Success();
  return DispatchFloat(h.element_type(), "h", [&]<ffi::DataType DT>() {
    switch (activation) {
      case kGeluExact: LaunchGated<DT, kGeluExact>(stream, h.untyped_data(), rows, inter, out->untyped_data()); break;
      case kGeluTanh: LaunchGated<DT, kGeluTanh>(stream, h.untyped_data(), rows, inter, out->untyped_data()); break;
      default: LaunchGated<DT, kSilu>(stream, h.untyped_data(), rows, inter, out->untyped_data());
    }
    return LastCudaError("gated activation launch");
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGatedActCuda, GatedActCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("activation")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
