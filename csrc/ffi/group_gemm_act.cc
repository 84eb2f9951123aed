// The group_gemm_act handlers: steps 3-5 in one kernel on the GPU, out (M, I)
// = act(h[:, :I]) * h[:, I:] for h = group_gemm_gather(x, w13) rounded to the
// element type: the bits of group_gemm_gather then gated_activation. The
// forward-only layer's w13 GEMM where the own Hopper kernel runs it
// (csrc/kernels/cuda/group_gemm/wgmma_sm90a.cu, which never writes h); on the
// CPU the two steps' kernels one after the other.
#include <cstdint>
#include <vector>

#include "ffi/ffi_common.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/group_gemm.h"
#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef JAX_MOE_WITH_SM90
#include "ffi/wgmma_call.h"
#endif

namespace jax_moe {
namespace {

// x (T, K) tokens, w (E, 2I, K), rows (M,) dst_to_src; out (M, I).
ffi::Error CheckGroupGemmAct(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                             const ffi::Buffer<ffi::S32>& sizes,
                             const ffi::Buffer<ffi::S32>& rows, int64_t topk,
                             int64_t activation, const ffi::AnyBuffer& out, GemmDims* d) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return InvalidArg("group_gemm_act: x must be (T, K) and w (E, 2*I, K)");
  *d = {static_cast<int64_t>(rows.element_count()), xd[1], wd[0], wd[1], xd[0]};
  if (wd[2] != d->k) return InvalidArg("group_gemm_act: K of x and w differ");
  if (d->n % 2 != 0) return InvalidArg("group_gemm_act: w must be (E, 2*I, K)");
  if (static_cast<int64_t>(sizes.element_count()) != d->groups)
    return InvalidArg("group_gemm_act: expert_sizes must have E entries");
  if (x.element_type() != w.element_type() || out.element_type() != x.element_type())
    return InvalidArg("group_gemm_act: x, w and the output must share a dtype");
  if (out.element_count() != static_cast<size_t>(d->m * (d->n / 2)))
    return InvalidArg("group_gemm_act: output must be (M, I)");
  if (activation < kSilu || activation > kGeluTanh)
    return InvalidArg("group_gemm_act: unknown activation code");
  return CheckGatherTopk("group_gemm_act", topk);
}

ffi::Error GroupGemmActCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> expert_sizes, ffi::Buffer<ffi::S32> rows,
                           int64_t topk, int64_t activation, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> /*counter*/) {
  GemmDims d;
  if (auto err = CheckGroupGemmAct(x, w, expert_sizes, rows, topk, activation, *out, &d);
      err.failure())
    return err;
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() {
    std::vector<unsigned char> h(static_cast<size_t>(d.m * d.n) * ffi::ByteWidth(x.element_type()));
    GroupGemm<DT>(PoolOf(pool), x.untyped_data(), w.untyped_data(), expert_sizes.typed_data(), d,
                  rows.typed_data(), topk, h.data());
    ActivationRows(DT, h.data(), d.m, d.n, d.n / 2, activation, true, out->untyped_data());
    return ffi::Error::Success();
  });
}

#ifdef JAX_MOE_WITH_CUDA
// `counter` (4 bytes) is the kernel's tile counter. Python calls this target
// only where tuning.group_gemm_act_runs holds; a call the kernel still
// cannot take fails with an error (there is no h to fall back on).
ffi::Error GroupGemmActCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> expert_sizes, ffi::Buffer<ffi::S32> rows,
                            int64_t topk, int64_t activation, ffi::Result<ffi::AnyBuffer> out,
                            [[maybe_unused]] ffi::Result<ffi::AnyBuffer> counter) {
  GemmDims d;
  if (auto err = CheckGroupGemmAct(x, w, expert_sizes, rows, topk, activation, *out, &d);
      err.failure())
    return err;
  if (d.m == 0 || d.n == 0) return ffi::Error::Success();  // nothing to write
#ifdef JAX_MOE_WITH_SM90
  const ffi::DataType t = x.element_type();
  if ((t == ffi::DataType::BF16 || t == ffi::DataType::F16) && counter->size_bytes() >= 4) {
    bool ran = false;
    if (auto err = RunGroupGemmWgmma(stream, x, w, expert_sizes, rows.typed_data(), topk,
                                     activation, d, *out,
                                     static_cast<int*>(counter->untyped_data()),
                                     "group_gemm_act launch failed", &ran);
        err.failure() || ran)
      return err;
  }
#endif
  return InvalidArg(
      "group_gemm_act: needs the Hopper kernel (compute capability 9.0, bf16/f16, 2*I a "
      "multiple of 16, K of 8, at most 1024 experts), which cannot run this call");
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGroupGemmActCpu, GroupGemmActCpu,
                              GroupGemmActSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGroupGemmActCuda, GroupGemmActCuda,
    GroupGemmActSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
