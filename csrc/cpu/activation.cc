// Step 5 on the CPU: gated act(h[..., :I]) * h[..., I:] or plain act(h), in f32.
#include <cmath>

#include "ffi_common.h"
#include "ops.h"
#include "shape_checks.h"

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

ffi::Error GatedActCpu(ffi::AnyBuffer h, int64_t activation, bool gated,
                       ffi::Result<ffi::AnyBuffer> out) {
  ActDims d;
  if (auto err = CheckActivation(h, activation, gated, *out, &d); err.failure()) return err;
  const int64_t rows = d.rows, width = d.width, inter = d.inter;
  return DispatchFloat(h.element_type(), "h", [&]<ffi::DataType DT>() {
    using S = HostScalar<DT>;
    const auto* in = static_cast<const typename S::Storage*>(h.untyped_data());
    auto* o = static_cast<typename S::Storage*>(out->untyped_data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inter; ++c) {
        float a = ActHost(S::Load(in[r * width + c]), activation);
        if (gated) a *= S::Load(in[r * width + inter + c]);
        o[r * inter + c] = S::Store(a);
      }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGatedActCpu, GatedActCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("activation")
                                  .Attr<bool>("gated")
                                  .Ret<ffi::AnyBuffer>());

}  // namespace jax_moe
