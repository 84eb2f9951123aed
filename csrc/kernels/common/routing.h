// The top-k routing rule, once for both platforms: the router (CPU
// kernels/cpu/route.cc, CUDA kernels/cuda/route.cu) and the one-token layer
// (kernels/{cpu,cuda}/moe_decode.*) build their loops and reductions from
// these pieces, so that every path orders, scores and weights experts alike.
// The same rule as jax_moe.reference.route:
//   - a NaN logit counts as -inf (never preferred);
//   - scores: softmax over the row (exp(x - max) / sum) or sigmoid;
//   - the choice is made on the logits themselves without bias or groups
//     (softmax and sigmoid keep their order), else on score (+ bias);
//   - group-limited top-k: a group's score is the sum of its top min(2, per)
//     choice values; the topk_group best groups stay eligible;
//   - top-k in the order of lax.top_k: the larger value first, ties to the
//     lower expert id (or group);
//   - the weight of a pick is its score (never its bias), divided by the
//     picks' score sum with renormalize, times routed_scaling_factor.
// Each function is the expression the kernels used inline, so moving it here
// kept their bits and the CUDA kernels' machine code.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/common/numeric.h"

namespace jax_moe {

// The router's attributes (the route target's and moe_layer's).
struct RouteOptions {
  int64_t experts, k;
  int64_t tokens_per_batch;  // logits rows per bias row
  int64_t groups, topk_group;
  bool softmax, has_bias, renormalize;  // softmax: else sigmoid
  float scale;                          // routed_scaling_factor
};

// ---- float bits on either side ------------------------------------------
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE bool RouteIsNan(float v) {
#ifdef __CUDA_ARCH__
  return isnan(v);
#else
  return std::isnan(v);
#endif
}

JAX_MOE_HOST_DEVICE JAX_MOE_INLINE int32_t FloatBits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_int(v);
#else
  int32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits;
#endif
}

JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float BitsFloat(int32_t bits) {
#ifdef __CUDA_ARCH__
  return __int_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
#endif
}

JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float RouteExp(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return std::exp(x);
#endif
}

// ---- the rule -----------------------------------------------------------

// A logit as the rule reads it: NaN is -inf (never preferred; it also keeps
// a rank-based top-k a permutation).
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float RouteLogit(float v) {
  return RouteIsNan(v) ? -INFINITY : v;
}

// Without bias or groups the choice is made on the logits themselves.
template <typename I>
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE bool ChooseOnLogits(bool has_bias, I groups) {
  return !has_bias && groups == 1;
}

// Softmax: a logit's term exp(x - mx) (mx the row's max, the sum is over the
// terms) and its score; sigmoid: its score.
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float SoftmaxTerm(float x, float mx) {
  return RouteExp(x - mx);
}
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float SoftmaxScore(float x, float mx, float sum) {
  return SoftmaxTerm(x, mx) / sum;
}
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float SigmoidScore(float x) {
  return 1.f / (1.f + RouteExp(-x));
}

// The weight of a pick of score `score`: divided by the picks' score sum
// with renormalize, then times routed_scaling_factor.
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float RouteWeight(float score, bool renormalize,
                                                     float picked_sum, float scale) {
  float w = score;
  if (renormalize) w /= picked_sum;
  return w * scale;
}

// Does (a, ia) come before (b, ib) in the top-k order: a larger value, or an
// equal one with a lower id. Branch-free (both sides are evaluated).
template <typename V, typename I>
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE bool RouteBeats(V a, I ia, V b, I ib) {
  return (a > b) | ((a == b) & (ia < ib));
}

// Choice values as int32 keys in the order of lax.top_k: -inf < ... < -0 <
// +0 < ... < +inf, so that selection is exact integer comparison. Every NaN
// (only a NaN bias or a softmax row of nothing but -inf makes one; logits are
// RouteLogit'ed) is the negative quiet NaN, below -inf, as the x86 default
// NaN ranks in lax.top_k. kRouteTaken is no float's key: it marks an entry
// already taken (or out of the running).
constexpr int32_t kRouteTaken = INT_MIN;

JAX_MOE_HOST_DEVICE JAX_MOE_INLINE int32_t RouteKey(float v) {
  const int32_t s = RouteIsNan(v) ? static_cast<int32_t>(0xffc00000u) : FloatBits(v);
  return s ^ ((s >> 31) & 0x7fffffff);
}

JAX_MOE_HOST_DEVICE JAX_MOE_INLINE float RouteKeyValue(int32_t key) {
  return BitsFloat(key ^ ((key >> 31) & 0x7fffffff));
}

// Group-limited top-k: a group's score key from the two largest choice keys
// of the group (k1 >= k2; per: experts a group, so k2 is unused when per = 1).
// The scan for k1 and k2 is written out in each router (a shared helper
// compiled the CUDA kernel to other machine code).
template <typename I>
JAX_MOE_HOST_DEVICE JAX_MOE_INLINE int32_t GroupKey(int32_t k1, int32_t k2, I per) {
  return RouteKey(per >= 2 ? RouteKeyValue(k1) + RouteKeyValue(k2) : RouteKeyValue(k1));
}

}  // namespace jax_moe
