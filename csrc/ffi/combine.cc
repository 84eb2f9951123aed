// The combine target (ops.moe_combine): step 7, the weighted sum of each
// token's expert rows back in token order, on the CPU (kernels/cpu/combine.h)
// and the GPU (kernels/cuda/combine.h).
#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/combine.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/combine.h"
#endif

namespace jax_moe {

ffi::Error CombineCpu(ffi::AnyBuffer y, F32In weights, S32In src_to_dst, AnyOut out) {
  CombineDims d;
  if (auto err = CheckCombine(y, weights, src_to_dst, *out, &d); err.failure()) return err;
  CombineRows(ToDType(y.element_type()), y.untyped_data(), weights.typed_data(),
              src_to_dst.typed_data(), d.tokens, d.k, d.m, d.hidden, out->untyped_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCombineCpu, CombineCpu, CombineSignature(ffi::Ffi::Bind()));

#ifdef JAX_MOE_WITH_CUDA
ffi::Error CombineSteps(cudaStream_t stream, ffi::AnyBuffer y, F32In weights, S32In src_to_dst,
                        AnyOut out, bool chained) {
  CombineDims d;
  if (auto err = CheckCombine(y, weights, src_to_dst, *out, &d); err.failure()) return err;
  return CudaError(LaunchCombine(stream, ToDType(y.element_type()), y.untyped_data(),
                                 weights.typed_data(), src_to_dst.typed_data(), d.tokens, d.k,
                                 d.m, d.hidden, out->untyped_data(), chained),
                   "moe_combine launch");
}

namespace {

ffi::Error CombineCuda(cudaStream_t stream, ffi::AnyBuffer y, F32In weights, S32In src_to_dst,
                       AnyOut out) {
  return CombineSteps(stream, y, weights, src_to_dst, out, false);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCombineCuda, CombineCuda,
    CombineSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
