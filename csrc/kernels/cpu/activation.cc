// Step 5 on the CPU: gated act(h[..., :I]) * h[..., I:] or plain act(h), in f32.
#include "kernels/cpu/act_math.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {
namespace {

ffi::Error GatedActCpu(ffi::AnyBuffer h, int64_t activation, bool gated,
                       ffi::Result<ffi::AnyBuffer> out) {
  ActDims d;
  if (auto err = CheckActivation(h, activation, gated, *out, &d); err.failure()) return err;
  const int64_t rows = d.rows, width = d.width, inter = d.inter;
  return DispatchFloat(h.element_type(), "h", [&]<DType DT>() {
    using S = HostScalar<DT>;
    ActRows<S>(static_cast<const typename S::Storage*>(h.untyped_data()), rows, width, inter,
               activation, gated, static_cast<typename S::Storage*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGatedActCpu, GatedActCpu, GatedActSignature(ffi::Ffi::Bind()));

}  // namespace jax_moe
