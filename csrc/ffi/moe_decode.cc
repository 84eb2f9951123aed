// The moe_decode target (ops.moe_decode): the routed layer for one token in
// one call, on the CPU (kernels/cpu/moe_decode.h) and in one kernel on the
// GPU (kernels/cuda/moe_decode.h). Both take the same calls (CheckMoeDecode).
#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/common/moe_decode.h"
#include "kernels/cpu/moe_decode.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/moe_decode.h"
#endif

namespace jax_moe {
namespace {

MoeDecodeProblem ProblemOf(const ffi::AnyBuffer& x, const ffi::AnyBuffer& logits,
                           const ffi::AnyBuffer& w13, const ffi::AnyBuffer& w2,
                           const MoeDecodeDims& d, bool renormalize, float routed_scaling_factor,
                           AnyOut& out, F32Out& act) {
  return MoeDecodeProblem{x.untyped_data(),  logits.untyped_data(), w13.untyped_data(),
                          w2.untyped_data(), act->typed_data(),    out->untyped_data(),
                          ToDType(logits.element_type()), d.experts, d.hidden, d.inter, d.k,
                          renormalize, routed_scaling_factor};
}

ffi::Error MoeDecodeCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer logits,
                        ffi::AnyBuffer w13, ffi::AnyBuffer w2, int64_t topk, bool renormalize,
                        float routed_scaling_factor, AnyOut out, F32Out act) {
  MoeDecodeDims d;
  if (auto e = CheckMoeDecode(x, logits, w13, w2, topk, *out, *act, &d); e.failure()) return e;
  MoeDecode(PoolOf(pool), ToDType(x.element_type()),
            ProblemOf(x, logits, w13, w2, d, renormalize, routed_scaling_factor, out, act));
  return ffi::Error::Success();
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error MoeDecodeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer logits,
                         ffi::AnyBuffer w13, ffi::AnyBuffer w2, int64_t topk, bool renormalize,
                         float routed_scaling_factor, AnyOut out, F32Out act) {
  MoeDecodeDims d;
  if (auto e = CheckMoeDecode(x, logits, w13, w2, topk, *out, *act, &d); e.failure()) return e;
  return CudaError(
      LaunchMoeDecode(stream, ToDType(x.element_type()),
                      ProblemOf(x, logits, w13, w2, d, renormalize, routed_scaling_factor, out,
                                act)),
      "moe_decode launch");
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMoeDecodeCpu, MoeDecodeCpu,
                              MoeDecodeSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kMoeDecodeCuda, MoeDecodeCuda,
    MoeDecodeSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
