// The group_gemm_wgrad handlers (ops.group_gemm_wgrad): the weight gradient of
// group_gemm / group_gemm_gather, dw[e] = dy_e^T @ x_e. The CPU kernel is
// csrc/kernels/cpu/group_gemm_wgrad.cc; on CUDA the Hopper kernel
// (kernels/cuda/group_gemm/wgrad_sm90a.cu) runs where it applies, else the
// portable one (wgrad.cu). The scratch output is the Hopper kernel's
// workspace, unused elsewhere.
#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/group_gemm_wgrad.h"
#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/group_gemm/wgrad.h"
#endif
#ifdef JAX_MOE_WITH_SM90
#include "kernels/cuda/group_gemm/wgrad_sm90a.h"
#endif

namespace jax_moe {
namespace {

ffi::Error GroupGemmWgradCpu(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> expert_sizes, ffi::Buffer<ffi::S32> rows,
                             bool gather, int64_t topk, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> /*scratch*/) {
  GemmDims d;
  if (auto err = CheckGroupGemmWgrad(dy, x, expert_sizes, rows, gather, topk, *out, &d);
      err.failure())
    return err;
  return DispatchFloat(dy.element_type(), "dy", [&]<DType DT>() {
    GroupGemmWgrad<DT>(PoolOf(pool), dy.untyped_data(), x.untyped_data(),
                       expert_sizes.typed_data(), d, gather ? rows.typed_data() : nullptr, topk,
                       out->untyped_data());
    return ffi::Error::Success();
  });
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error GroupGemmWgradCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32> expert_sizes, ffi::Buffer<ffi::S32> rows,
                              bool gather, int64_t topk, ffi::Result<ffi::AnyBuffer> out,
                              [[maybe_unused]] ffi::Result<ffi::AnyBuffer> scratch) {
  GemmDims d;
  if (auto err = CheckGroupGemmWgrad(dy, x, expert_sizes, rows, gather, topk, *out, &d);
      err.failure())
    return err;
  return DispatchFloat(dy.element_type(), "dy", [&]<DType DT>() -> ffi::Error {
    if (d.groups == 0 || d.n == 0 || d.k == 0) return ffi::Error::Success();  // nothing to write
    const int32_t* row_src = gather ? rows.typed_data() : nullptr;
#ifdef JAX_MOE_WITH_SM90
    if constexpr (DT != DType::F32) {
      Sm90WgradCall call{};
      call.stream = stream;
      call.bf16 = DT == DType::BF16;
      call.dy = dy.untyped_data();
      call.x = x.untyped_data();
      call.sizes = expert_sizes.typed_data();
      call.rows = row_src;
      call.topk = topk;
      call.out = out->untyped_data();
      call.m = d.m;
      call.n = d.n;
      call.k = d.k;
      call.groups = d.groups;
      call.x_rows = d.x_rows;
      call.scratch = scratch->untyped_data();
      call.scratch_bytes = scratch->size_bytes();
      bool ran = false;
      const cudaError_t err = GroupGemmWgradSm90(call, &ran);
      if (err != cudaSuccess) return CudaError(err, "group_gemm_wgrad (sm90) launch failed");
      if (ran) return ffi::Error::Success();
    }
#endif
    return CudaError(LaunchGroupGemmWgrad(stream, DT, dy.untyped_data(), x.untyped_data(),
                                          expert_sizes.typed_data(), row_src, topk,
                                          out->untyped_data(), d),
                     "group_gemm_wgrad launch failed");
  });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGroupGemmWgradCpu, GroupGemmWgradCpu,
                              GroupGemmWgradSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGroupGemmWgradCuda, GroupGemmWgradCuda,
    GroupGemmWgradSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
