// The expert_mlp handlers (ops.expert_mlp): steps 3-6 in one call, the w13
// GEMM of the gathered rows, the activation and the w2 GEMM, each through
// its own kernel (csrc/kernels/cpu/group_gemm.cc and act_math.h on the CPU;
// the grouped GEMM's and the activation's launchers on the GPU) one after
// the other, so the bits are those of group_gemm, the activation and
// group_gemm.
#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/act_math.h"
#include "kernels/cpu/group_gemm.h"
#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/activation.h"
#include "kernels/cuda/group_gemm/launch.h"
#endif
#ifdef JAX_MOE_WITH_SM90
#include "ffi/wgmma_call.h"
#include "kernels/common/wgmma_rule.h"
#endif

namespace jax_moe {

ffi::Error ExpertMlpCpu(const TaskPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                        ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                        int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                        AnyOut out, AnyOut h, AnyOut a) {
  GemmDims d1, d2;
  if (auto err = CheckExpertMlp(x, w13, w2, expert_sizes, rows, topk, activation, gated, tile_m1,
                                tile_m2, *out, *h, *a, &d1, &d2);
      err.failure())
    return err;
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() {
    using S = HostScalar<DT>;
    const int32_t* sizes = expert_sizes.typed_data();
    GroupGemm<DT>(pool, x.untyped_data(), w13.untyped_data(), sizes, d1, rows.typed_data(), topk,
                  h->untyped_data());
    ActRows<S>(static_cast<const typename S::Storage*>(h->untyped_data()), d1.m, d1.n, d2.k,
               activation, gated, static_cast<typename S::Storage*>(a->untyped_data()));
    GroupGemm<DT>(pool, a->untyped_data(), w2.untyped_data(), sizes, d2, nullptr, 1,
                  out->untyped_data());
    return ffi::Error::Success();
  });
}

#ifdef JAX_MOE_WITH_CUDA
// On sm_90+ the second and third kernels are launched with programmatic
// dependent launch: each may start (its launch, tile schedule) while the
// previous one finishes, and waits for it before reading its output. Under
// XLA's command buffers that edge only exists inside one call
// (docs/performance.md). Chained
// (moe_layer), the first kernel is launched so too, after the token index,
// and waits for it before its tile schedule.
//
// With `counters` (moe_layer: two ints it zeroed before its first kernel)
// a GEMM whose tile is 256 runs the own Hopper kernel where its rule prefers
// it (kernels/common/wgmma_rule.h), chained like the others, with counters[0]
// and counters[1] as the two GEMMs' tile counters; the w13 GEMM then applies
// the gated activation in its epilogue and writes `a` (the bits of the GEMM
// then the activation kernel; h is not written). Elsewhere, and without
// counters, a 256 tile runs as 128 (the ops' own handlers run the Hopper
// kernels with their scratch).
ffi::Error ExpertMlpSteps(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                          ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                          int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                          AnyOut out, AnyOut h, AnyOut a, bool chained,
                          [[maybe_unused]] int* counters) {
  GemmDims d1, d2;
  if (auto err = CheckExpertMlp(x, w13, w2, expert_sizes, rows, topk, activation, gated, tile_m1,
                                tile_m2, *out, *h, *a, &d1, &d2);
      err.failure())
    return err;
  if (d1.m == 0 || d2.n == 0) return ffi::Error::Success();  // nothing to write
  const bool pdl = DeviceSupportsPdl();
  const int32_t* sizes = expert_sizes.typed_data();
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() -> ffi::Error {
    bool w13_ran = false, act_ran = false;
#ifdef JAX_MOE_WITH_SM90
    if constexpr (DT != DType::F32) {
      if (counters != nullptr && d1.n > 0 && tile_m1 == 256 && WgmmaPreferred(d1.m, d1.groups)) {
        const WgmmaChain chain{pdl && chained, chained, true};
        if (gated) {  // the activation in the epilogue: a directly
          if (auto e = RunGroupGemmWgmma(stream, x, w13, expert_sizes, rows.typed_data(), topk,
                                         activation, d1, *a, counters,
                                         "expert_mlp w13 (wgmma) launch", &w13_ran, chain);
              e.failure())
            return e;
          act_ran = w13_ran;
        }
        if (!w13_ran) {  // declined (nothing launched, the counter still zero): the plain form
          if (auto e = RunGroupGemmWgmma(stream, x, w13, expert_sizes, rows.typed_data(), topk,
                                         -1, d1, *h, counters, "expert_mlp w13 (wgmma) launch",
                                         &w13_ran, chain);
              e.failure())
            return e;
        }
      }
    }
#endif
    if (d1.n > 0) {
      if (!w13_ran) {
        if (auto e = CudaError(LaunchGroupGemmFor(stream, DT, x.untyped_data(),
                                                  w13.untyped_data(), sizes, h->untyped_data(),
                                                  d1, rows.typed_data(), topk, tile_m1,
                                                  pdl && chained, chained),
                               "expert_mlp w13 launch");
            e.failure())
          return e;
      }
      if (!act_ran) {
        if (auto e = CudaError(LaunchActivation(stream, DT, activation, gated, h->untyped_data(),
                                                d1.m, d2.k, a->untyped_data(), pdl),
                               "expert_mlp activation launch");
            e.failure())
          return e;
      }
    }
#ifdef JAX_MOE_WITH_SM90
    if constexpr (DT != DType::F32) {
      if (counters != nullptr && d1.n > 0 && tile_m2 == 256 && WgmmaPreferred(d2.m, d2.groups)) {
        bool w2_ran = false;
        if (auto e = RunGroupGemmWgmma(stream, *a, w2, expert_sizes, nullptr, 1, -1, d2, *out,
                                       counters + 1, "expert_mlp w2 (wgmma) launch", &w2_ran,
                                       WgmmaChain{pdl, false, true});
            e.failure() || w2_ran)
          return e;
      }
    }
#endif
    // With I = 0 the w2 GEMM sums nothing: out is zero (K = 0 in every kernel).
    return CudaError(LaunchGroupGemmFor(stream, DT, a->untyped_data(), w2.untyped_data(), sizes,
                                        out->untyped_data(), d2, nullptr, 1, tile_m2,
                                        pdl && d1.n > 0),
                     "expert_mlp w2 launch");
  });
}
#endif

namespace {

// The bound handlers: the steps above on XLA's pool, or unchained.
ffi::Error ExpertMlpCpuHandler(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                               ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                               int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                               AnyOut out, AnyOut h, AnyOut a) {
  return ExpertMlpCpu(PoolOf(pool), x, w13, w2, expert_sizes, rows, topk, activation, gated,
                      tile_m1, tile_m2, out, h, a);
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error ExpertMlpCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                         ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                         int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                         AnyOut out, AnyOut h, AnyOut a) {
  return ExpertMlpSteps(stream, x, w13, w2, expert_sizes, rows, topk, activation, gated, tile_m1,
                        tile_m2, out, h, a, false, nullptr);
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kExpertMlpCpu, ExpertMlpCpuHandler,
                              ExpertMlpSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kExpertMlpCuda, ExpertMlpCuda,
    ExpertMlpSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
