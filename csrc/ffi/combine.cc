// The combine targets (ops.moe_combine): step 7, the weighted sum of each
// token's expert rows back in token order, and its backward (combine_bwd),
// on the CPU (kernels/cpu/combine{,_bwd}.h) and the GPU
// (kernels/cuda/combine{,_bwd}.h).
#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/combine.h"
#include "kernels/cpu/combine_bwd.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/combine.h"
#include "kernels/cuda/combine_bwd.h"
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

namespace {

ffi::Error CombineBwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::AnyBuffer y, F32In weights,
                         S32In src_to_dst, S32In dst_to_src, AnyOut dy, F32Out dw) {
  CombineDims d;
  if (auto err = CheckCombineBwd(g, y, weights, src_to_dst, dst_to_src, *dy, *dw, &d);
      err.failure())
    return err;
  CombineBwdRows(PoolOf(pool), ToDType(y.element_type()), g.untyped_data(), y.untyped_data(),
                 weights.typed_data(), src_to_dst.typed_data(), dst_to_src.typed_data(),
                 d.tokens, d.k, d.m, d.hidden, dy->untyped_data(), dw->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCombineBwdCpu, CombineBwdCpu,
                              CombineBwdSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

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

namespace {

ffi::Error CombineBwdCuda(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer y,
                          F32In weights, S32In src_to_dst, S32In dst_to_src, AnyOut dy,
                          F32Out dw) {
  CombineDims d;
  if (auto err = CheckCombineBwd(g, y, weights, src_to_dst, dst_to_src, *dy, *dw, &d);
      err.failure())
    return err;
  return CudaError(LaunchCombineBwd(stream, ToDType(y.element_type()), g.untyped_data(),
                                    y.untyped_data(), weights.typed_data(),
                                    src_to_dst.typed_data(), dst_to_src.typed_data(), d.tokens,
                                    d.k, d.m, d.hidden, dy->untyped_data(), dw->typed_data()),
                   "moe_combine backward launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCombineBwdCuda, CombineBwdCuda,
    CombineBwdSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
