// Steps 3-6 on the GPU in one call (ops.expert_mlp): the w13 GEMM of the
// gathered rows, the activation and the w2 GEMM, the grouped GEMM's and the
// activation's own launchers one after the other.
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm.cuh"
#include "ffi/layer_steps.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {

// Steps 3-6 in one call: the w13 GEMM (gathered rows) into h, the
// activation into a, the w2 GEMM into out. On sm_90+ the second and third
// kernels are launched with programmatic dependent launch: each may start
// (its launch, tile schedule) while the previous one finishes, and waits for
// it before reading its output. Under XLA's command buffers that edge only
// exists inside one call (scripts/pdl_bench.cu). Chained (moe_layer), the
// first kernel is launched so too, after the token index, and waits for it
// before its tile schedule.
ffi::Error ExpertMlpSteps(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                          ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                          int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                          AnyOut out, AnyOut h, AnyOut a, bool chained) {
  GemmDims d1, d2;
  if (auto err = CheckExpertMlp(x, w13, w2, expert_sizes, rows, topk, activation, gated, tile_m1,
                                tile_m2, *out, *h, *a, &d1, &d2);
      err.failure())
    return err;
  if (d1.m == 0 || d2.n == 0) return ffi::Error::Success();  // nothing to write
  const bool pdl = DeviceMajor() >= 9;
  const int32_t* sizes = expert_sizes.typed_data();
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() -> ffi::Error {
    if (d1.n > 0) {
      if (auto e = CudaError(LaunchGroupGemmFor(stream, DT, x.untyped_data(), w13.untyped_data(),
                                                sizes, h->untyped_data(), d1, rows.typed_data(),
                                                topk, tile_m1, pdl && chained, chained),
                             "expert_mlp w13 launch");
          e.failure())
        return e;
      if (auto e = CudaError(LaunchActivation(stream, DT, activation, gated, h->untyped_data(),
                                              d1.m, d2.k, a->untyped_data(), pdl),
                             "expert_mlp activation launch");
          e.failure())
        return e;
    }
    // With I = 0 the w2 GEMM sums nothing: out is zero (K = 0 in every kernel).
    return CudaError(LaunchGroupGemmFor(stream, DT, a->untyped_data(), w2.untyped_data(), sizes,
                                        out->untyped_data(), d2, nullptr, 1, tile_m2,
                                        pdl && d1.n > 0),
                     "expert_mlp w2 launch");
  });
}

namespace {

ffi::Error ExpertMlpCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                         ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                         int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                         AnyOut out, AnyOut h, AnyOut a) {
  return ExpertMlpSteps(stream, x, w13, w2, expert_sizes, rows, topk, activation, gated, tile_m1,
                        tile_m2, out, h, a, false);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kExpertMlpCuda, ExpertMlpCuda,
    ExpertMlpSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
