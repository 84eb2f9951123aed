// The group_gemm_fp8 handlers (ops.group_gemm_fp8): the grouped GEMM with
// block-scaled e4m3 weights, x quantised per 128 channels inside the kernel;
// with a gather, row r of x is the token row x[dst_to_src[r] / topk] (zero
// for an entry outside the tokens), read where each kernel reads its rows.
// CPU: csrc/kernels/cpu/group_gemm_fp8.cc (one path: tile_m is only checked).
// CUDA, by tile_m: 8, the decode form (fp8_skinny.cuh); 64 or 128,
// CUTLASS's blockwise-scaled fp8 grouped GEMM on Hopper for bf16 x
// (kernels/cuda/group_gemm/fp8_sm90a.cu) in tiles of that many rows; 0, the
// decode form for at most 2 rows an expert on average, else CUTLASS's with
// its own tile rule. Where the chosen kernel does not apply: CUTLASS's (own
// rule), then the portable kernel (fp8_simt.cuh).
// With an activation, x holds the previous GEMM's rows (M, 2K gated, else
// (M, K)) and the Hopper path's prep kernel applies step 5 to each row as it
// quantises it (the rounding of the activation kernel, so the bits of that
// kernel then this GEMM); no other path takes it (an error there: Python
// fuses only where the Hopper kernel runs).
// The scratch output is the Hopper path's, unused elsewhere.
#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/common/fp8_e4m3.h"
#include "kernels/cpu/group_gemm_fp8.h"
#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/group_gemm/launch.h"
#endif
#ifdef JAX_MOE_WITH_SM90
#include "kernels/cuda/group_gemm/fp8_sm90a.h"
#endif

namespace jax_moe {
namespace {

ffi::Error CheckGroupGemmFp8(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                             const ffi::Buffer<ffi::F32>& w_scale,
                             const ffi::Buffer<ffi::S32>& sizes, const ffi::Buffer<ffi::S32>& rows,
                             bool gather, int64_t topk, int64_t activation, bool gated,
                             const ffi::AnyBuffer& out, GemmDims* d) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = w_scale.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3)
    return InvalidArg("group_gemm_fp8: x must be (M, K), w (E, N, K) and w_scale rank 3");
  const int64_t m = gather ? static_cast<int64_t>(rows.element_count()) : xd[0];
  *d = {m, wd[2], wd[0], wd[1], xd[0]};
  if (activation >= 0) {
    if (activation > kGeluTanh) return InvalidArg("group_gemm_fp8: unknown activation code");
    if (gather) return InvalidArg("group_gemm_fp8: an activation takes no gather");
    if (xd[1] != (gated ? 2 : 1) * wd[2])
      return InvalidArg(
          "group_gemm_fp8: with an activation x must be (M, 2K) if gated, else (M, K)");
  } else if (activation != -1) {
    return InvalidArg("group_gemm_fp8: activation must be -1 or an activation code");
  } else if (xd[1] != wd[2]) {
    return InvalidArg("group_gemm_fp8: K of x and w differ");
  }
  if (w.element_type() != ffi::DataType::F8E4M3FN)
    return InvalidArg("group_gemm_fp8: w must be float8_e4m3fn");
  const int64_t nb = (d->n + kFp8Block - 1) / kFp8Block, kb = (d->k + kFp8Block - 1) / kFp8Block;
  if (sd[0] != d->groups || sd[1] != nb || sd[2] != kb)
    return InvalidArg("group_gemm_fp8: w_scale must be (E, ceil(N/128), ceil(K/128))");
  if (static_cast<int64_t>(sizes.element_count()) != d->groups)
    return InvalidArg("group_gemm_fp8: expert_sizes must have E entries");
  if (out.element_type() != x.element_type())
    return InvalidArg("group_gemm_fp8: the output must have x's dtype");
  if (out.element_count() != static_cast<size_t>(d->m * d->n))
    return InvalidArg("group_gemm_fp8: output must be (M, N)");
  if (gather) {
    if (auto err = CheckGatherTopk("group_gemm_fp8", topk); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error CheckFp8TileM(int64_t tile_m) {
  if (tile_m == 0 || tile_m == 8 || tile_m == 64 || tile_m == 128) return ffi::Error::Success();
  return InvalidArg("group_gemm_fp8: tile_m must be 0, 8, 64 or 128");
}

ffi::Error GroupGemmFp8Cpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> expert_sizes,
                           ffi::Buffer<ffi::S32> rows, bool gather, int64_t topk, int64_t tile_m,
                           int64_t activation, bool gated, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> /*scratch*/) {
  if (auto err = CheckFp8TileM(tile_m); err.failure()) return err;
  GemmDims d;
  if (auto err = CheckGroupGemmFp8(x, w, w_scale, expert_sizes, rows, gather, topk, activation,
                                   gated, *out, &d);
      err.failure())
    return err;
  if (activation >= 0) return InvalidArg("group_gemm_fp8: the fused activation is CUDA-only");
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() {
    GroupGemmFp8<DT>(PoolOf(pool), x.untyped_data(), static_cast<const uint8_t*>(w.untyped_data()),
                     w_scale.typed_data(), expert_sizes.typed_data(),
                     gather ? rows.typed_data() : nullptr, topk, d, out->untyped_data());
    return ffi::Error::Success();
  });
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error GroupGemmFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> expert_sizes,
                            ffi::Buffer<ffi::S32> rows, bool gather, int64_t topk, int64_t tile_m,
                            int64_t activation, bool gated, ffi::Result<ffi::AnyBuffer> out,
                            [[maybe_unused]] ffi::Result<ffi::AnyBuffer> scratch) {
  if (auto err = CheckFp8TileM(tile_m); err.failure()) return err;
  GemmDims d;
  if (auto err = CheckGroupGemmFp8(x, w, w_scale, expert_sizes, rows, gather, topk, activation,
                                   gated, *out, &d);
      err.failure())
    return err;
  const bool act = activation >= 0;
  const int32_t* row_src = gather ? rows.typed_data() : nullptr;
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() -> ffi::Error {
    if (d.m == 0 || d.n == 0) return ffi::Error::Success();  // nothing to write
    // A few rows an expert: the decode form streams the weights once.
    if (!act && (tile_m == 0 || tile_m == 8)) {
      bool ran_skinny = false;
      const cudaError_t skinny_err = LaunchGroupGemmFp8Skinny(
          stream, DT, x.untyped_data(), static_cast<const uint8_t*>(w.untyped_data()),
          w_scale.typed_data(), expert_sizes.typed_data(), row_src, topk, out->untyped_data(), d,
          tile_m == 8, &ran_skinny);
      if (skinny_err != cudaSuccess) return CudaError(skinny_err, "group_gemm_fp8 launch failed");
      if (ran_skinny) return ffi::Error::Success();
    }
#ifdef JAX_MOE_WITH_SM90
    if constexpr (DT == DType::BF16) {
      Sm90Fp8Call call{};
      call.stream = stream;
      call.x = x.untyped_data();
      call.w = static_cast<const uint8_t*>(w.untyped_data());
      call.w_scale = w_scale.typed_data();
      call.sizes = expert_sizes.typed_data();
      call.rows = row_src;
      call.topk = topk;
      call.x_rows = d.x_rows;
      call.out = out->untyped_data();
      call.m = d.m;
      call.n = d.n;
      call.k = d.k;
      call.groups = d.groups;
      call.scratch = scratch->untyped_data();
      call.scratch_bytes = scratch->size_bytes();
      call.tile_m = tile_m == 64 || tile_m == 128 ? static_cast<int>(tile_m) : 0;
      call.activation = static_cast<int>(activation);
      call.gated = gated;
      bool ran = false;
      const cudaError_t err = GroupGemmFp8Sm90(call, &ran);
      if (err != cudaSuccess) return CudaError(err, "group_gemm_fp8 (sm90) launch failed");
      if (ran) return ffi::Error::Success();
    }
#endif
    if (act)
      return InvalidArg(
          "group_gemm_fp8: the fused activation needs the Hopper kernel (a compute capability "
          "9.0 device, bf16 x, N a multiple of 8, K of 16), which does not apply to this call");
    return CudaError(
        LaunchGroupGemmFp8For(stream, DT, x.untyped_data(),
                              static_cast<const uint8_t*>(w.untyped_data()), w_scale.typed_data(),
                              expert_sizes.typed_data(), row_src, topk, out->untyped_data(), d),
        "group_gemm_fp8 launch failed");
  });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGroupGemmFp8Cpu, GroupGemmFp8Cpu,
                              GroupGemmFp8Signature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGroupGemmFp8Cuda, GroupGemmFp8Cuda,
    GroupGemmFp8Signature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
