// The moe_decode_fp8 target: one token's routed experts with block-scaled
// e4m3 weights in one kernel (kernels/cuda/moe_decode_fp8.h). CUDA only:
// the layer takes it on the GPU and the step chain elsewhere, so the CPU
// handler only reports that.
#include <cstdint>
#include <string>

#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "kernels/common/fp8_e4m3.h"
#include "kernels/common/moe_decode.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/moe_decode_fp8.h"
#endif

namespace jax_moe {
namespace {

int64_t Blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// The problem's sizes from the buffers, or the error that names the bad one.
ffi::Error CheckMoeDecodeFp8(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& ids,
                             const ffi::Buffer<ffi::F32>& weights, const ffi::AnyBuffer& w13,
                             const ffi::Buffer<ffi::F32>& w13_scale, const ffi::AnyBuffer& w2,
                             const ffi::Buffer<ffi::F32>& w2_scale, int64_t activation,
                             bool gated, const ffi::AnyBuffer& out,
                             const ffi::Buffer<ffi::F32>& act, const ffi::Buffer<ffi::F32>& y,
                             MoeDecodeFp8Problem* p) {
  auto xd = x.dimensions();
  auto d13 = w13.dimensions();
  auto d2 = w2.dimensions();
  if (xd.size() != 2 || xd[0] != 1) return InvalidArg("moe_decode_fp8: x must be (1, H)");
  if (auto e = CheckFloat(x.element_type(), "moe_decode_fp8: x"); e.failure()) return e;
  if (d13.size() != 3 || d2.size() != 3)
    return InvalidArg("moe_decode_fp8: w13 must be (E, N13, H) and w2 (E, H, I)");
  if (w13.element_type() != ffi::DataType::F8E4M3FN ||
      w2.element_type() != ffi::DataType::F8E4M3FN)
    return InvalidArg("moe_decode_fp8: w13 and w2 must be float8_e4m3fn");
  const int64_t e = d13[0], h = xd[1], i = d2[2], k = static_cast<int64_t>(ids.element_count());
  if (d13[2] != h || d2[0] != e || d2[1] != h || d13[1] != (gated ? 2 * i : i))
    return InvalidArg("moe_decode_fp8: w13 must be (E, 2I or I, H) and w2 (E, H, I)");
  auto s13 = w13_scale.dimensions();
  auto s2 = w2_scale.dimensions();
  if (s13.size() != 3 || s13[0] != e || s13[1] != Blocks(d13[1]) || s13[2] != Blocks(h))
    return InvalidArg("moe_decode_fp8: w13_scale must be (E, ceil(N13/128), ceil(H/128))");
  if (s2.size() != 3 || s2[0] != e || s2[1] != Blocks(h) || s2[2] != Blocks(i))
    return InvalidArg("moe_decode_fp8: w2_scale must be (E, ceil(H/128), ceil(I/128))");
  if (static_cast<int64_t>(weights.element_count()) != k)
    return InvalidArg("moe_decode_fp8: topk_weights and topk_ids must have k entries");
  if (k < 1 || k > kDecodeFp8MaxTopk || h % kDecodeFp8Multiple || i % kDecodeFp8Multiple ||
      h < kDecodeFp8Multiple || i < kDecodeFp8Multiple || h > kDecodeFp8MaxHidden ||
      i > kDecodeFp8MaxInter)
    return InvalidArg("moe_decode_fp8: outside the kernel's limits (DECODE_FP8_LIMITS)");
  if (activation < kSilu || activation > kGeluTanh)
    return InvalidArg("moe_decode_fp8: unknown activation");
  if (out.element_type() != x.element_type() || out.element_count() != static_cast<size_t>(h))
    return InvalidArg("moe_decode_fp8: out must be (1, H) of x's dtype");
  if (act.element_count() != static_cast<size_t>(k * i) ||
      y.element_count() != static_cast<size_t>(k * h))
    return InvalidArg("moe_decode_fp8: scratch must be (k, I) and (k, H)");
  *p = MoeDecodeFp8Problem{x.untyped_data(),
                           ids.typed_data(),
                           weights.typed_data(),
                           static_cast<const uint8_t*>(w13.untyped_data()),
                           w13_scale.typed_data(),
                           static_cast<const uint8_t*>(w2.untyped_data()),
                           w2_scale.typed_data(),
                           const_cast<float*>(act.typed_data()),
                           const_cast<float*>(y.typed_data()),
                           const_cast<void*>(out.untyped_data()),
                           e,
                           h,
                           i,
                           k,
                           activation,
                           gated};
  return ffi::Error::Success();
}

ffi::Error MoeDecodeFp8Cpu(ffi::AnyBuffer, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>,
                           ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::AnyBuffer,
                           ffi::Buffer<ffi::F32>, int64_t, bool, ffi::Result<ffi::AnyBuffer>,
                           ffi::Result<ffi::Buffer<ffi::F32>>,
                           ffi::Result<ffi::Buffer<ffi::F32>>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "jax_moe: moe_decode_fp8 runs on CUDA GPUs only (moe_forward takes the "
                    "step chain on other platforms)");
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error MoeDecodeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                            ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer w13,
                            ffi::Buffer<ffi::F32> w13_scale, ffi::AnyBuffer w2,
                            ffi::Buffer<ffi::F32> w2_scale, int64_t activation, bool gated,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> act,
                            ffi::Result<ffi::Buffer<ffi::F32>> y) {
  MoeDecodeFp8Problem p;
  if (auto e = CheckMoeDecodeFp8(x, ids, weights, w13, w13_scale, w2, w2_scale, activation,
                                 gated, *out, *act, *y, &p);
      e.failure())
    return e;
  return CudaError(LaunchMoeDecodeFp8(stream, ToDType(x.element_type()), p),
                   "moe_decode_fp8 launch");
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMoeDecodeFp8Cpu, MoeDecodeFp8Cpu,
                              MoeDecodeFp8Signature(ffi::Ffi::Bind()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kMoeDecodeFp8Cuda, MoeDecodeFp8Cuda,
    MoeDecodeFp8Signature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
