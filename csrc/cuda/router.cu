// Step 1 on the GPU: one warp per token row. Softmax statistics in f32 by warp
// reductions; k rounds of a warp arg-max over the logits (exact order, ties to
// the lower expert id), so selection never depends on exp's rounding.
#include <cfloat>

#include "cuda/cuda_common.cuh"
#include "ops.h"

namespace jax_moe {
namespace {

constexpr int kWarpsPerBlock = 4;

template <typename T, typename Load>
__global__ void TopkSoftmaxKernel(const T* __restrict__ logits, int64_t rows,
                                  int experts, int k, bool renormalize,
                                  float* __restrict__ weights,
                                  int32_t* __restrict__ ids, Load load) {
  extern __shared__ float smem[];  // kWarpsPerBlock rows of `experts` floats
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* row = smem + static_cast<int64_t>(warp) * experts;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; t < rows;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* src = logits + t * experts;
    float mx = -INFINITY;
    for (int e = lane; e < experts; e += 32) {
      float v = load(src[e]);
      v = isnan(v) ? -INFINITY : v;  // NaN is never preferred (as on the CPU)
      row[e] = v;
      mx = fmaxf(mx, v);
    }
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int e = lane; e < experts; e += 32) sum += expf(row[e] - mx);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);

    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
      // Taken entries hold NaN, which loses every comparison; an untaken -inf
      // still wins against the sentinel through the tie rule, so best_e is
      // always a valid, untaken id (k <= experts).
      float best = -INFINITY;
      int best_e = experts;
      for (int e = lane; e < experts; e += 32) {
        float v = row[e];
        if (v > best || (v == best && e < best_e)) { best = v; best_e = e; }
      }
      for (int o = 16; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
        if (ov > best || (ov == best && oe < best_e)) { best = ov; best_e = oe; }
      }
      float p = expf(best - mx) / sum;
      picked += p;
      if (lane == 0) {
        ids[t * k + j] = best_e;
        weights[t * k + j] = p;
        row[best_e] = __int_as_float(0x7fc00000);  // NaN: taken
      }
      __syncwarp();
    }
    if (renormalize && lane == 0) {
      for (int j = 0; j < k; ++j) weights[t * k + j] /= picked;
    }
    __syncwarp();
  }
}

struct LoadF32 { __device__ float operator()(float v) const { return v; } };
struct LoadBf16 { __device__ float operator()(__nv_bfloat16 v) const { return __bfloat162float(v); } };
struct LoadF16 { __device__ float operator()(__half v) const { return __half2float(v); } };

ffi::Error TopkSoftmaxCuda(cudaStream_t stream, ffi::AnyBuffer logits, bool renormalize,
                           ffi::Result<ffi::Buffer<ffi::F32>> weights,
                           ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  const int64_t experts = LastDim(logits.dimensions());
  const int64_t rows = LeadingRows(logits.dimensions());
  const int64_t k = LastDim(weights->dimensions());
  if (k < 1 || k > experts) return InvalidArg("topk must be in [1, num_experts]");
  if (static_cast<int64_t>(weights->element_count()) != rows * k ||
      static_cast<int64_t>(ids->element_count()) != rows * k)
    return InvalidArg("topk_softmax: output shapes do not match (rows, topk)");
  const size_t smem = sizeof(float) * kWarpsPerBlock * experts;
  if (smem > 48 * 1024) return InvalidArg("topk_softmax: at most 3072 experts on CUDA");
  if (rows == 0) return ffi::Error::Success();
  const unsigned grid = GridFor(rows, kWarpsPerBlock);
  return DispatchFloat(logits.element_type(), "router_logits", [&]<ffi::DataType DT>() {
    using T = typename DevScalar<DT>::T;
    auto launch = [&](auto load) {
      TopkSoftmaxKernel<<<grid, 32 * kWarpsPerBlock, smem, stream>>>(
          static_cast<const T*>(logits.untyped_data()), rows, static_cast<int>(experts),
          static_cast<int>(k), renormalize, weights->typed_data(), ids->typed_data(), load);
    };
    if constexpr (DT == ffi::DataType::F32) launch(LoadF32{});
    else if constexpr (DT == ffi::DataType::BF16) launch(LoadBf16{});
    else launch(LoadF16{});
    return LastCudaError("topk_softmax launch");
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kTopkSoftmaxCuda, TopkSoftmaxCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("renormalize")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
