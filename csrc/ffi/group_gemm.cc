// The group_gemm handlers (ops.group_gemm, group_gemm_gather): steps 4 and 6,
// with `gather` step 3 fused into the GEMM's input. The CPU kernel is
// csrc/kernels/cpu/group_gemm.cc, the CUDA ones csrc/kernels/cuda/group_gemm/.
// tile_m is a CUDA tuning knob: checked on both platforms, otherwise unused
// on the CPU, and so is the scratch output (the CUDA sm90 path's workspace).
#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/group_gemm.h"
#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/group_gemm/launch.h"
#endif
#ifdef JAX_MOE_WITH_SM90
#include "ffi/gemm_call.h"
#include "ffi/wgmma_call.h"
#include "kernels/common/wgmma_rule.h"
#endif

namespace jax_moe {
namespace {

ffi::Error GroupGemmCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::S32> expert_sizes, ffi::Buffer<ffi::S32> rows,
                        bool gather, int64_t topk, int64_t tile_m, bool w_kn,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*scratch*/) {
  GemmDims d;
  if (auto err = CheckGroupGemm(x, w, expert_sizes, rows, gather, topk, tile_m, w_kn, *out, &d);
      err.failure())
    return err;
  if (w_kn) return InvalidArg("group_gemm: w_kn runs on the CUDA sm90 path only");
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() {
    GroupGemm<DT>(PoolOf(pool), x.untyped_data(), w.untyped_data(), expert_sizes.typed_data(), d,
                  gather ? rows.typed_data() : nullptr, topk, out->untyped_data());
    return ffi::Error::Success();
  });
}

#ifdef JAX_MOE_WITH_CUDA
// `scratch` (bytes) is only used by the sm90 paths (tile_m = 256): CUTLASS's
// group arrays and workspace, or the own kernel's tile counter. w_kn (w as
// (E, K, N), the dgrad's layout) exists on that path only: Python asks for
// it only where tuning.sm90_usable holds, and a call that still cannot take
// the path fails with an error rather than reading w in the wrong layout.
ffi::Error GroupGemmCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> expert_sizes, ffi::Buffer<ffi::S32> rows,
                         bool gather, int64_t topk, int64_t tile_m, bool w_kn,
                         ffi::Result<ffi::AnyBuffer> out,
                         [[maybe_unused]] ffi::Result<ffi::AnyBuffer> scratch) {
  GemmDims d;
  if (auto err = CheckGroupGemm(x, w, expert_sizes, rows, gather, topk, tile_m, w_kn, *out, &d);
      err.failure())
    return err;
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() -> ffi::Error {
    if (d.m == 0 || d.n == 0) return ffi::Error::Success();  // nothing to write
    const int32_t* row_src = gather ? rows.typed_data() : nullptr;
#ifdef JAX_MOE_WITH_SM90
    if constexpr (DT != DType::F32) {
      // The own Hopper kernel where the rule prefers it; its tile counter
      // takes the scratch's first 4 bytes (the CUTLASS path then runs not).
      if (tile_m == 256 && !w_kn && WgmmaPreferred(d.m, d.groups) &&
          scratch->size_bytes() >= 4) {
        bool ran = false;
        if (auto err = RunGroupGemmWgmma(stream, x, w, expert_sizes, row_src, topk, -1, d, *out,
                                         static_cast<int*>(scratch->untyped_data()),
                                         "group_gemm (wgmma) launch failed", &ran);
            err.failure() || ran)
          return err;
      }
      if (tile_m == 256) {
        Sm90GemmCall call{};
        FillGemmOperands(call, stream, x, w, expert_sizes, row_src, topk, d, *out);
        call.w_kn = w_kn;
        call.scratch = scratch->untyped_data();
        call.scratch_bytes = scratch->size_bytes();
        bool ran = false;
        const cudaError_t err = GroupGemmSm90(call, &ran);
        if (err != cudaSuccess) return CudaError(err, "group_gemm (sm90) launch failed");
        if (ran) return ffi::Error::Success();
      }
    }
#endif
    if (w_kn) return InvalidArg("group_gemm: w_kn needs the sm90 path, which cannot run this call");
    return CudaError(LaunchGroupGemmFor(stream, DT, x.untyped_data(), w.untyped_data(),
                                        expert_sizes.typed_data(), out->untyped_data(), d,
                                        row_src, topk, tile_m == 256 ? 128 : tile_m, false),
                     "group_gemm launch failed");
  });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGroupGemmCpu, GroupGemmCpu,
                              GroupGemmSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGroupGemmCuda, GroupGemmCuda,
    GroupGemmSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
