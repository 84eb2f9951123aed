// The expand target (ops.moe_expand): step 3, token rows gathered into
// expert order, on the CPU (kernels/cpu/expand.h) and the GPU
// (kernels/cuda/expand.h).
#include "ffi/ffi_common.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/expand.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/expand.h"
#endif

namespace jax_moe {
namespace {

// out[i] = x[dst_to_src[i] / topk]; rows with no valid source are zero.
ffi::Error ExpandCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> dst_to_src, int64_t topk,
                     ffi::Result<ffi::AnyBuffer> out) {
  if (auto err = CheckExpand(x, dst_to_src, topk, *out); err.failure()) return err;
  const int64_t row_bytes = LastDim(x.dimensions()) * ffi::ByteWidth(x.element_type());
  ExpandRows(x.untyped_data(), LeadingRows(x.dimensions()), row_bytes, dst_to_src.typed_data(),
             dst_to_src.element_count(), topk, out->untyped_data());
  return ffi::Error::Success();
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error ExpandCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> dst_to_src,
                      int64_t topk, ffi::Result<ffi::AnyBuffer> out) {
  if (auto err = CheckExpand(x, dst_to_src, topk, *out); err.failure()) return err;
  const int64_t row_bytes = LastDim(x.dimensions()) * ffi::ByteWidth(x.element_type());
  return CudaError(LaunchExpand(stream, x.untyped_data(), LeadingRows(x.dimensions()), row_bytes,
                                dst_to_src.typed_data(), dst_to_src.element_count(), topk,
                                out->untyped_data()),
                   "moe_expand_input launch");
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kExpandCpu, ExpandCpu, ExpandSignature(ffi::Ffi::Bind()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kExpandCuda, ExpandCuda,
    ExpandSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
