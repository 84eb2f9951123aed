// Step 1 on the GPU: the router, one warp per token row. Scores (softmax or
// sigmoid of the f32 logits, softmax statistics by warp reductions), an
// optional correction bias and group limit for the choice, then k rounds of a
// warp arg-max over the choice (ties to the lower expert id). The warp's row
// of choice values lives in shared memory as int32 order keys (RouteKey), so
// selection is exact integer comparison. The rule is kernels/common/routing.h,
// shared with the CPU router (kernels/cpu/route.cc) and moe_decode.
#include "kernels/cuda/route.h"

#include <algorithm>

#include "kernels/common/routing.h"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

constexpr int kMaxWarpsPerBlock = 4;
constexpr int64_t kSmemBudget = 48 * 1024;  // no opt-in needed

// Index of the largest untaken key of keys[0, n) (ties: the lower index), the
// same in every lane; n when all are taken. Taken entries (kRouteTaken) never
// beat the start value, every real key does.
__device__ __forceinline__ int WarpArgMax(const int32_t* keys, int n, int lane) {
  int32_t best = kRouteTaken;
  int best_i = n;
  for (int i = lane; i < n; i += 32) {
    const int32_t v = keys[i];
    if (v > best) { best = v; best_i = i; }
  }
  for (int o = 16; o > 0; o /= 2) {
    const int32_t ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (RouteBeats(ov, oi, best, best_i)) { best = ov; best_i = oi; }
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
  return p.softmax ? SoftmaxScore(x, mx, sum) : SigmoidScore(x);
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
  const bool on_logits = ChooseOnLogits(p.has_bias, groups);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < rows;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const T* src = logits + t * experts;
    const float* b = bias + (t / p.tokens_per_batch) * experts;
    // Each lane owns entries e = lane (mod 32) until the first __syncwarp.
    float mx = -INFINITY;
    for (int e = lane; e < experts; e += 32) {
      float v = load(src[e]);
      v = RouteLogit(v);
      key[e] = __float_as_int(v);
      mx = fmaxf(mx, v);
    }
    float sum = 0.f;
    if (p.softmax) {
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      for (int e = lane; e < experts; e += 32) sum += SoftmaxTerm(__int_as_float(key[e]), mx);
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    for (int e = lane; e < experts; e += 32) {
      const float v = __int_as_float(key[e]);
      float c = v;
      if (!on_logits) {
        c = Score(v, p, mx, sum);
        if (p.has_bias) c += b[e];
      }
      key[e] = RouteKey(c);
    }
    __syncwarp();

    if (groups > 1) {
      // Group score: the sum of the group's top-min(2, per) choice values.
      for (int g = lane; g < groups; g += 32) {
        int32_t k1 = kRouteTaken, k2 = kRouteTaken;
        for (int i = g * per; i < (g + 1) * per; ++i) {
          const int32_t v = key[i];
          if (v > k1) { k2 = k1; k1 = v; }
          else if (v > k2) { k2 = v; }
        }
        group_key[g] = GroupKey(k1, k2, per);
      }
      __syncwarp();
      // Keep the topk_group best groups (ties: the lower group): marked taken.
      for (int j = 0; j < p.topk_group; ++j) {
        const int g = WarpArgMax(group_key, groups, lane);
        if (lane == 0 && g < groups) group_key[g] = kRouteTaken;
        __syncwarp();
      }
      const int32_t minus_inf = RouteKey(-INFINITY);
      for (int e = lane; e < experts; e += 32)
        if (group_key[e / per] != kRouteTaken) key[e] = minus_inf;
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
      best = kRouteTaken;
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
        key[i] = kRouteTaken;
        lane_best();
      }
    }
    __syncwarp();

    // The weight is the expert's score (never its bias): recomputed from its
    // logit by the same expression as above, picks j = lane (mod 32) per lane.
    float picked = 0.f;
    for (int j = lane; j < k; j += 32) {
      float x = load(src[pick[j]]);
      picked += Score(RouteLogit(x), p, mx, sum);
    }
    for (int o = 16; o > 0; o /= 2) picked += __shfl_xor_sync(0xffffffffu, picked, o);
    for (int j = lane; j < k; j += 32) {
      const int e = pick[j];
      float x = load(src[e]);
      const float w = RouteWeight(Score(RouteLogit(x), p, mx, sum), p.renormalize, picked, p.scale);
      ids[t * k + j] = e;
      weights[t * k + j] = w;
    }
    __syncwarp();  // key and pick are rewritten for the next row
  }
}

struct LoadF32 { __device__ float operator()(float v) const { return v; } };
struct LoadBf16 {
  __device__ float operator()(__nv_bfloat16 v) const { return __bfloat162float(v); }
};
struct LoadF16 { __device__ float operator()(__half v) const { return __half2float(v); } };

}  // namespace

cudaError_t LaunchRoute(cudaStream_t stream, DType dtype, const void* logits, const float* bias,
                        int64_t rows, const RouteOptions& o, float* weights, int32_t* ids) {
  if (rows == 0) return cudaSuccess;
  // experts + groups + k <= 9216 ints: 36 KiB a warp, so 1 to 4 warps a block.
  // Computed here only: the kernel strides by p.warp_ints.
  const int64_t warp_ints = o.experts + (o.groups > 1 ? o.groups : 0) + o.k;
  const int64_t warp_bytes = static_cast<int64_t>(sizeof(int32_t)) * warp_ints;
  const int warps =
      static_cast<int>(std::min<int64_t>(kMaxWarpsPerBlock, kSmemBudget / warp_bytes));
  const size_t smem = static_cast<size_t>(warps * warp_bytes);
  const unsigned grid = GridFor(rows, warps);
  const RouteParams p{static_cast<int>(o.experts), static_cast<int>(o.k),
                      static_cast<int>(o.groups), static_cast<int>(o.topk_group),
                      static_cast<int>(warp_ints), o.tokens_per_batch,
                      o.softmax, o.has_bias, o.renormalize, o.scale};
  return WithDType(dtype, [&]<DType DT>() {
    using T = typename DevScalar<DT>::T;
    auto launch = [&](auto load) {
      RouteKernel<<<grid, 32 * warps, smem, stream>>>(static_cast<const T*>(logits), bias, rows, p,
                                                     weights, ids, load);
    };
    if constexpr (DT == DType::F32) launch(LoadF32{});
    else if constexpr (DT == DType::BF16) launch(LoadBf16{});
    else launch(LoadF16{});
    return cudaGetLastError();
  });
}

}  // namespace jax_moe
