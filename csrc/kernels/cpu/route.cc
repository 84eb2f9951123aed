// Step 1 on the CPU: the router. Scores (softmax or sigmoid of the f32 logits),
// an optional correction bias and group limit for the choice, top-k, optional
// renormalize, scaling factor: the rule of kernels/common/routing.h, the same
// as the CUDA kernel's and jax_moe.reference.route.
#include "kernels/cpu/route.h"

#include <cmath>
#include <vector>

namespace jax_moe {
namespace {

// Index of the largest untaken key of keys[0, n) (ties: the lower index), or
// -1 when every entry is taken.
inline int64_t ArgMax(const int32_t* keys, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] == kRouteTaken) continue;
    if (best < 0 || RouteBeats(keys[i], i, keys[best], best)) best = i;
  }
  return best;
}

template <DType DT>
void RouteRowsT(const void* logits_raw, const float* bias, int64_t rows, const RouteOptions& p,
                float* weights, int32_t* ids) {
  using S = HostScalar<DT>;
  const auto* logits = static_cast<const typename S::Storage*>(logits_raw);
  const int64_t experts = p.experts, k = p.k;
  const int64_t per = experts / p.groups;
  const bool on_logits = ChooseOnLogits(p.has_bias, p.groups);
  std::vector<float> x(experts), score(experts);
  std::vector<int32_t> key(experts), group_key(p.groups);
  for (int64_t t = 0; t < rows; ++t) {
    const float* b = bias + (t / p.tokens_per_batch) * experts;
    float mx = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) {
      x[e] = RouteLogit(S::Load(logits[t * experts + e]));
      mx = std::fmax(mx, x[e]);
    }
    if (p.softmax) {
      float sum = 0.f;
      for (int64_t e = 0; e < experts; ++e) sum += SoftmaxTerm(x[e], mx);
      for (int64_t e = 0; e < experts; ++e) score[e] = SoftmaxScore(x[e], mx, sum);
    } else {
      for (int64_t e = 0; e < experts; ++e) score[e] = SigmoidScore(x[e]);
    }
    for (int64_t e = 0; e < experts; ++e) {
      const float c = on_logits ? x[e] : p.has_bias ? score[e] + b[e] : score[e];
      key[e] = RouteKey(c);
    }
    if (p.groups > 1) {
      // Group score: the sum of the group's top-min(2, per) choice values.
      for (int64_t g = 0; g < p.groups; ++g) {
        int32_t k1 = kRouteTaken, k2 = kRouteTaken;
        for (int64_t i = g * per; i < (g + 1) * per; ++i) {
          if (key[i] > k1) { k2 = k1; k1 = key[i]; }
          else if (key[i] > k2) { k2 = key[i]; }
        }
        group_key[g] = GroupKey(k1, k2, per);
      }
      // Keep the topk_group best groups (ties: the lower group), marked taken.
      for (int64_t j = 0; j < p.topk_group; ++j) {
        const int64_t g = ArgMax(group_key.data(), p.groups);
        if (g >= 0) group_key[g] = kRouteTaken;
      }
      const int32_t minus_inf = RouteKey(-INFINITY);
      for (int64_t e = 0; e < experts; ++e)
        if (group_key[e / per] != kRouteTaken) key[e] = minus_inf;
    }
    float picked_sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = ArgMax(key.data(), experts);
      if (best < 0) best = 0;  // unreachable: k <= experts
      key[best] = kRouteTaken;
      const float w = score[best];
      weights[t * k + j] = w;
      ids[t * k + j] = static_cast<int32_t>(best);
      picked_sum += w;
    }
    for (int64_t j = 0; j < k; ++j)
      weights[t * k + j] = RouteWeight(weights[t * k + j], p.renormalize, picked_sum, p.scale);
  }
}

}  // namespace

void RouteRows(DType dtype, const void* logits, const float* bias, int64_t rows,
               const RouteOptions& o, float* weights, int32_t* ids) {
  WithDType(dtype, [&]<DType DT>() { RouteRowsT<DT>(logits, bias, rows, o, weights, ids); });
}

}  // namespace jax_moe
