// The activation targets (ops.gated_activation, ops.activation): step 5,
// gated act(h[..., :I]) * h[..., I:] or plain act(h) in f32, its backward
// (activation_grad) and the routed layer's form of that backward, with each
// row's top-k weight applied and the weight's gradient returned
// (activation_scaled_grad); on the CPU (kernels/cpu/activation.h) and the GPU
// (kernels/cuda/activation.h).
#include "ffi/ffi_common.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/activation.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/activation.h"
#endif

namespace jax_moe {
namespace {

ffi::Error ActivationCpu(ffi::AnyBuffer h, int64_t activation, bool gated,
                         ffi::Result<ffi::AnyBuffer> out) {
  ActDims d;
  if (auto err = CheckActivation(h, activation, gated, *out, &d); err.failure()) return err;
  ActivationRows(ToDType(h.element_type()), h.untyped_data(), d.rows, d.width, d.inter,
                 activation, gated, out->untyped_data());
  return ffi::Error::Success();
}

ffi::Error ActivationGradCpu(ffi::AnyBuffer h, ffi::AnyBuffer d, int64_t activation, bool gated,
                             ffi::Result<ffi::AnyBuffer> out) {
  ActDims dims;
  if (auto err = CheckActivationGrad(h, d, activation, gated, *out, &dims); err.failure())
    return err;
  ActivationGradRows(ToDType(h.element_type()), h.untyped_data(), d.untyped_data(), dims.rows,
                     dims.width, dims.inter, activation, gated, out->untyped_data());
  return ffi::Error::Success();
}

ffi::Error ActivationScaledGradCpu(ffi::AnyBuffer h, ffi::AnyBuffer d, ffi::Buffer<ffi::F32> scale,
                                   int64_t activation, bool gated,
                                   ffi::Result<ffi::AnyBuffer> dh,
                                   ffi::Result<ffi::AnyBuffer> as,
                                   ffi::Result<ffi::Buffer<ffi::F32>> dot) {
  ActDims dims;
  if (auto err = CheckActivationScaledGrad(h, d, scale, activation, gated, *dh, *as, *dot, &dims);
      err.failure())
    return err;
  ActivationScaledGradRows(ToDType(h.element_type()), h.untyped_data(), d.untyped_data(),
                           scale.typed_data(), dims.rows, dims.width, dims.inter, activation,
                           gated, dh->untyped_data(), as->untyped_data(), dot->typed_data());
  return ffi::Error::Success();
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error ActivationGradCuda(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer d,
                              int64_t activation, bool gated, ffi::Result<ffi::AnyBuffer> out) {
  ActDims dims;
  if (auto err = CheckActivationGrad(h, d, activation, gated, *out, &dims); err.failure())
    return err;
  return CudaError(LaunchActivationGrad(stream, ToDType(h.element_type()), activation, gated,
                                        h.untyped_data(), d.untyped_data(), dims.rows,
                                        dims.inter, out->untyped_data()),
                   "activation grad launch");
}

ffi::Error ActivationScaledGradCuda(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer d,
                                    ffi::Buffer<ffi::F32> scale, int64_t activation, bool gated,
                                    ffi::Result<ffi::AnyBuffer> dh,
                                    ffi::Result<ffi::AnyBuffer> as,
                                    ffi::Result<ffi::Buffer<ffi::F32>> dot) {
  ActDims dims;
  if (auto err = CheckActivationScaledGrad(h, d, scale, activation, gated, *dh, *as, *dot, &dims);
      err.failure())
    return err;
  return CudaError(LaunchActivationScaledGrad(stream, ToDType(h.element_type()), activation, gated,
                                              h.untyped_data(), d.untyped_data(),
                                              scale.typed_data(), dims.rows, dims.inter,
                                              dh->untyped_data(), as->untyped_data(),
                                              dot->typed_data()),
                   "activation scaled grad launch");
}

ffi::Error ActivationCuda(cudaStream_t stream, ffi::AnyBuffer h, int64_t activation, bool gated,
                          ffi::Result<ffi::AnyBuffer> out) {
  ActDims d;
  if (auto err = CheckActivation(h, activation, gated, *out, &d); err.failure()) return err;
  return CudaError(LaunchActivation(stream, ToDType(h.element_type()), activation, gated,
                                    h.untyped_data(), d.rows, d.inter, out->untyped_data(),
                                    false),
                   "activation launch");
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kActivationCpu, ActivationCpu, ActivationSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kActivationGradCpu, ActivationGradCpu,
                              ActivationGradSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kActivationScaledGradCpu, ActivationScaledGradCpu,
                              ActivationScaledGradSignature(ffi::Ffi::Bind()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kActivationCuda, ActivationCuda,
    ActivationSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kActivationGradCuda, ActivationGradCuda,
    ActivationGradSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kActivationScaledGradCuda, ActivationScaledGradCuda,
    ActivationScaledGradSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
