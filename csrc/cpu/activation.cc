// Step 5 on the CPU: gated activations act(h[..., :I]) * h[..., I:], in f32.
#include <cmath>

#include "ffi_common.h"
#include "ops.h"

namespace jax_moe {
namespace {

inline float ActHost(float g, int64_t act) {
  switch (act) {
    case kGeluExact: return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case kGeluTanh: {
      float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return 0.5f * g * (1.f + std::tanh(inner));
    }
    default: return g / (1.f + std::exp(-g));
  }
}

ffi::Error GatedActCpu(ffi::AnyBuffer h, int64_t activation,
                       ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rows = LeadingRows(h.dimensions());
  const int64_t two_i = LastDim(h.dimensions());
  if (two_i % 2 != 0) return InvalidArg("gated activation: last dim must be even");
  if (activation < kSilu || activation > kGeluTanh) return InvalidArg("unknown activation code");
  const int64_t inter = two_i / 2;
  if (out->element_count() != static_cast<size_t>(rows * inter) ||
      out->element_type() != h.element_type())
    return InvalidArg("gated activation: output must be (..., I) of h's dtype");
  return DispatchFloat(h.element_type(), "h", [&]<ffi::DataType DT>() {
    using S = HostScalar<DT>;
    const auto* in = static_cast<const typename S::Storage*>(h.untyped_data());
    auto* o = static_cast<typename S::Storage*>(out->untyped_data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inter; ++c) {
        float g = S::Load(in[r * two_i + c]);
        float u = S::Load(in[r * two_i + inter + c]);
        o[r * inter + c] = S::Store(ActHost(g, activation) * u);
      }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGatedActCpu, GatedActCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("activation")
                                  .Ret<ffi::AnyBuffer>());

}  // namespace jax_moe
