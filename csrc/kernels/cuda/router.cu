// Step 1 on the GPU: the router, one warp per token row. Scores (softmax or
// sigmoid of the f32 logits, softmax statistics by warp reductions), an
// optional correction bias and group limit for the choice, then k rounds of a
// warp arg-max over the choice (ties to the lower expert id). The warp's row
// of choice values lives in shared memory as int32 order keys (the order of
// lax.top_k), so selection is exact integer comparison. Same semantics as
// csrc/cpu/router.cc and jax_moe.reference.route.
#include <algorithm>
#include <climits>

#include "kernels/cuda/cuda_common.cuh"
#include "ffi/layer_steps.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {
namespace {

constexpr int kMaxWarpsPerBlock = 4;
constexpr int64_t kMaxExperts = 3072;  // _checks.MAX_EXPERTS
constexpr int64_t kSmemBudget = 48 * 1024;  // no opt-in needed
// No float's key (NaN is folded onto one key above it): marks a taken entry.
constexpr int32_t kTaken = INT_MIN;

// -inf < ... < -0 < +0 < ... < +inf, as lax.top_k orders floats; every NaN
// (only a NaN bias or an all -inf softmax row makes one) as the negative quiet
// NaN, below -inf.
__device__ __forceinline__ int32_t OrderKey(float v) {
  const int32_t s = isnan(v) ? static_cast<int32_t>(0xffc00000u) : __float_as_int(v);
  return s ^ ((s >> 31) & 0x7fffffff);
}

__device__ __forceinline__ float KeyValue(int32_t key) {
  return __int_as_float(key ^ ((key >> 31) & 0x7fffffff));
}

// Index of the largest untaken key of keys[0, n) (ties: the lower index), the
// same in every lane; n when all are taken. Taken entries (kTaken) never beat
// the start value, every real key does.
__device__ __forceinline__ int WarpArgMax(const int32_t* keys, int n, int lane) {
  int32_t best = kTaken;
  int best_i = n;
  for (int i = lane; i < n; i += 32) {
    const int32_t v = keys[i];
    if (v > best) { best = v; best_i = i; }
  }
  for (int o = 16; o > 0; o /= 2) {
    const int32_t ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
  }
  return best_i;
}

struct RouteParams {
  int experts, k, groups, topk_group;
  int warp_ints;  // one warp's shared memory: choice keys, group keys, picks
  int64_t tokens_per_batch;  // logits rows per bias row
  bool softmax, has_bias, renormalize;
  float scale;
};

__device__ __forceinline__ float Score(float x, const RouteParams& p, float mx, float sum) {
  return p.softmax ? expf(x - mx) / sum : 1.f / (1.f + expf(-x));
}

template <typename T, typename Load>
__global__ void RouteKernel(const T* __restrict__ logits, const float* __restrict__ bias,
                            int64_t rows, RouteParams p, float* __restrict__ weights,
                            int32_t* __restrict__ ids, Load load) {
  PdlTrigger();  // in moe_layer's call the token index may start (it waits for this grid)
  // Per warp: `experts` choice keys, (grouped) `groups` group keys, k picks.
  extern __shared__ int32_t smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int experts = p.experts, k = p.k, groups = p.groups;
  const int per = experts / groups;
  int32_t* key = smem + static_cast<int64_t>(warp) * p.warp_ints;
  int32_t* group_key = key + experts;
  const bool on_logits = !p.has_bias && groups == 1;  // choose on the logits themselves
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < rows;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const T* src = logits + t * experts;
    const float* b = bias + (t / p.tokens_per_batch) * experts;
    // Each lane owns entries e = lane (mod 32) until the first __syncwarp.
    float mx = -INFINITY;
    for (int e = lane; e < experts; e += 32) {
      float v = load(src[e]);
      v = isnan(v) ? -INFINITY : v;  // NaN is never preferred (as on the CPU)
      key[e] = __float_as_int(v);
      mx = fmaxf(mx, v);
    }
    float sum = 0.f;
    if (p.softmax) {
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      for (int e = lane; e < experts; e += 32) sum += expf(__int_as_float(key[e]) - mx);
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    for (int e = lane; e < experts; e += 32) {
      const float v = __int_as_float(key[e]);
      float c = v;
      if (!on_logits) {
        c = Score(v, p, mx, sum);
        if (p.has_bias) c += b[e];
      }
      key[e] = OrderKey(c);
    }
    __syncwarp();

    if (groups > 1) {
      // Group score: the sum of the group's top-min(2, per) choice values.
      for (int g = lane; g < groups; g += 32) {
        int32_t k1 = kTaken, k2 = kTaken;
        for (int i = g * per; i < (g + 1) * per; ++i) {
          const int32_t v = key[i];
          if (v > k1) { k2 = k1; k1 = v; }
          else if (v > k2) { k2 = v; }
        }
        group_key[g] = OrderKey(per >= 2 ? KeyValue(k1) + KeyValue(k2) : KeyValue(k1));
      }
      __syncwarp();
      // Keep the topk_group best groups (ties: the lower group): marked taken.
      for (int j = 0; j < p.topk_group; ++j) {
        const int g = WarpArgMax(group_key, groups, lane);
        if (lane == 0 && g < groups) group_key[g] = kTaken;
        __syncwarp();
      }
      const int32_t minus_inf = OrderKey(-INFINITY);
      for (int e = lane; e < experts; e += 32)
        if (group_key[e / per] != kTaken) key[e] = minus_inf;
      __syncwarp();
    }

    // k picks. Each lane keeps its best untaken entry among e = lane (mod 32);
    // a pick is the warp's best of those (ties: the lower expert), and only
    // the lane that owned it rescans. No global memory in this loop: it is
    // the router's serial part (one token is one warp's work at decode).
    int32_t* pick = group_key + (groups > 1 ? groups : 0);
    int32_t best;
    int best_i;
    auto lane_best = [&] {
      best = kTaken;
      best_i = experts;
      for (int e = lane; e < experts; e += 32) {
        const int32_t v = key[e];
        if (v > best) { best = v; best_i = e; }
      }
    };
    lane_best();
    for (int j = 0; j < k; ++j) {
      // The largest key, then the lowest expert holding it (sm_80 warp
      // reductions: two instructions instead of five shuffle rounds).
      const int32_t top = __reduce_max_sync(0xffffffffu, best);
      const int i = __reduce_min_sync(0xffffffffu, best == top ? best_i : experts);
      if (lane == 0) pick[j] = i < experts ? i : 0;  // i < experts: k <= experts
      if (i < experts && i % 32 == lane) {
        key[i] = kTaken;
        lane_best();
      }
    }
    __syncwarp();

    // The weight is the expert's score (never its bias): recomputed from its
    // logit by the same expression as above, picks j = lane (mod 32) per lane.
    float picked = 0.f;
    for (int j = lane; j < k; j += 32) {
      float x = load(src[pick[j]]);
      picked += Score(isnan(x) ? -INFINITY : x, p, mx, sum);
    }
    for (int o = 16; o > 0; o /= 2) picked += __shfl_xor_sync(0xffffffffu, picked, o);
    for (int j = lane; j < k; j += 32) {
      const int e = pick[j];
      float x = load(src[e]);
      float w = Score(isnan(x) ? -INFINITY : x, p, mx, sum);
      if (p.renormalize) w /= picked;
      ids[t * k + j] = e;
      weights[t * k + j] = w * p.scale;
    }
    __syncwarp();  // key and pick are rewritten for the next row
  }
}

struct LoadF32 { __device__ float operator()(float v) const { return v; } };
struct LoadBf16 { __device__ float operator()(__nv_bfloat16 v) const { return __bfloat162float(v); } };
struct LoadF16 { __device__ float operator()(__half v) const { return __half2float(v); } };

}  // namespace

ffi::Error TopkSoftmaxCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias,
                           bool renormalize, int64_t scoring, int64_t num_expert_group,
                           int64_t topk_group, bool has_bias, float routed_scaling_factor,
                           ffi::Result<ffi::Buffer<ffi::F32>> weights,
                           ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  RouteDims d;
  if (auto err = CheckRoute(logits, bias, scoring, num_expert_group, topk_group, *weights, *ids, &d);
      err.failure())
    return err;
  const int64_t experts = d.experts, rows = d.rows, tokens = d.tokens, k = d.k;
  if (experts > kMaxExperts) return InvalidArg("route: at most 3072 experts on CUDA");
  // experts + groups + k <= 9216 ints: 36 KiB a warp, so 1 to 4 warps a block.
  // Computed here only: the kernel strides by p.warp_ints.
  const int64_t warp_ints = experts + (num_expert_group > 1 ? num_expert_group : 0) + k;
  const int64_t warp_bytes = static_cast<int64_t>(sizeof(int32_t)) * warp_ints;
  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarpsPerBlock, kSmemBudget / warp_bytes));
  if (rows == 0) return ffi::Error::Success();
  const size_t smem = static_cast<size_t>(warps * warp_bytes);
  const unsigned grid = GridFor(rows, warps);
  const RouteParams p{static_cast<int>(experts), static_cast<int>(k),
                      static_cast<int>(num_expert_group), static_cast<int>(topk_group),
                      static_cast<int>(warp_ints), tokens,
                      scoring == 0, has_bias, renormalize, routed_scaling_factor};
  return DispatchFloat(logits.element_type(), "router_logits", [&]<DType DT>() {
    using T = typename DevScalar<DT>::T;
    auto launch = [&](auto load) {
      RouteKernel<<<grid, 32 * warps, smem, stream>>>(
          static_cast<const T*>(logits.untyped_data()), bias.typed_data(), rows, p,
          weights->typed_data(), ids->typed_data(), load);
    };
    if constexpr (DT == DType::F32) launch(LoadF32{});
    else if constexpr (DT == DType::BF16) launch(LoadBf16{});
    else launch(LoadF16{});
    return LastCudaError("route launch");
  });
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kTopkSoftmaxCuda, TopkSoftmaxCuda,
    TopkSoftmaxSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
