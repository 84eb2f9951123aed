// Step 1 on the CPU: the router. Scores (softmax or sigmoid of the f32 logits),
// an optional correction bias and group limit for the choice, top-k, optional
// renormalize, scaling factor. Same semantics as jax_moe.reference.route.
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {
namespace {

// The order of lax.top_k, as an int32 key: -inf < ... < -0 < +0 < ... < +inf.
// NaN (only a NaN bias or a softmax row of nothing but -inf/NaN makes one)
// ranks below -inf, as the x86 default NaN does in lax.top_k. INT32_MIN is no
// key of any float here, and marks an entry as taken.
constexpr int32_t kTaken = INT32_MIN;

inline int32_t OrderKey(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (std::isnan(v)) bits = 0xffc00000u;
  const int32_t s = static_cast<int32_t>(bits);
  return s ^ ((s >> 31) & 0x7fffffff);
}

inline float KeyValue(int32_t key) {
  const uint32_t bits = static_cast<uint32_t>(key ^ ((key >> 31) & 0x7fffffff));
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Index of the largest untaken key of keys[0, n) (ties: the lower index), or
// -1 when every entry is taken.
inline int64_t ArgMax(const int32_t* keys, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] == kTaken) continue;
    if (best < 0 || keys[i] > keys[best]) best = i;
  }
  return best;
}

struct RouteParams {
  int64_t experts, k, tokens_per_batch;
  bool softmax, has_bias, renormalize;
  int64_t groups, topk_group;
  float scale;
};

template <DType DT>
void RouteRows(const void* logits_raw, const float* bias, int64_t rows, const RouteParams& p,
               float* weights, int32_t* ids) {
  using S = HostScalar<DT>;
  const auto* logits = static_cast<const typename S::Storage*>(logits_raw);
  const int64_t experts = p.experts, k = p.k;
  const int64_t per = experts / p.groups;
  // Without bias or groups the choice is made on the logits themselves.
  const bool on_logits = !p.has_bias && p.groups == 1;
  std::vector<float> x(experts), score(experts);
  std::vector<int32_t> key(experts), group_key(p.groups);
  for (int64_t t = 0; t < rows; ++t) {
    const float* b = bias + (t / p.tokens_per_batch) * experts;
    float mx = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) {
      x[e] = S::Load(logits[t * experts + e]);
      if (std::isnan(x[e])) x[e] = -INFINITY;  // NaN is never preferred
      mx = std::fmax(mx, x[e]);
    }
    if (p.softmax) {
      float sum = 0.f;
      for (int64_t e = 0; e < experts; ++e) sum += std::exp(x[e] - mx);
      for (int64_t e = 0; e < experts; ++e) score[e] = std::exp(x[e] - mx) / sum;
    } else {
      for (int64_t e = 0; e < experts; ++e) score[e] = 1.f / (1.f + std::exp(-x[e]));
    }
    for (int64_t e = 0; e < experts; ++e) {
      const float c = on_logits ? x[e] : p.has_bias ? score[e] + b[e] : score[e];
      key[e] = OrderKey(c);
    }
    if (p.groups > 1) {
      // Group score: the sum of the group's top-min(2, per) choice values.
      for (int64_t g = 0; g < p.groups; ++g) {
        int32_t k1 = kTaken, k2 = kTaken;
        for (int64_t i = g * per; i < (g + 1) * per; ++i) {
          if (key[i] > k1) { k2 = k1; k1 = key[i]; }
          else if (key[i] > k2) { k2 = key[i]; }
        }
        group_key[g] = OrderKey(per >= 2 ? KeyValue(k1) + KeyValue(k2) : KeyValue(k1));
      }
      // Keep the topk_group best groups (ties: the lower group), marked taken.
      for (int64_t j = 0; j < p.topk_group; ++j) {
        const int64_t g = ArgMax(group_key.data(), p.groups);
        if (g >= 0) group_key[g] = kTaken;
      }
      const int32_t minus_inf = OrderKey(-INFINITY);
      for (int64_t e = 0; e < experts; ++e)
        if (group_key[e / per] != kTaken) key[e] = minus_inf;
    }
    float picked_sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = ArgMax(key.data(), experts);
      if (best < 0) best = 0;  // unreachable: k <= experts
      key[best] = kTaken;
      const float w = score[best];
      weights[t * k + j] = w;
      ids[t * k + j] = static_cast<int32_t>(best);
      picked_sum += w;
    }
    for (int64_t j = 0; j < k; ++j) {
      float w = weights[t * k + j];
      if (p.renormalize) w /= picked_sum;
      weights[t * k + j] = w * p.scale;
    }
  }
}

}  // namespace

ffi::Error TopkSoftmaxCpu(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias, bool renormalize,
                          int64_t scoring, int64_t num_expert_group, int64_t topk_group,
                          bool has_bias, float routed_scaling_factor,
                          ffi::Result<ffi::Buffer<ffi::F32>> weights,
                          ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  RouteDims d;
  if (auto err = CheckRoute(logits, bias, scoring, num_expert_group, topk_group, *weights, *ids, &d);
      err.failure())
    return err;
  const int64_t experts = d.experts, rows = d.rows, tokens = d.tokens, k = d.k;
  const RouteParams p{experts, k, tokens, scoring == 0, has_bias, renormalize,
                      num_expert_group, topk_group, routed_scaling_factor};
  return DispatchFloat(logits.element_type(), "router_logits", [&]<DType DT>() {
    RouteRows<DT>(logits.untyped_data(), bias.typed_data(), rows, p, weights->typed_data(),
                  ids->typed_data());
    return ffi::Error::Success();
  });
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kTopkSoftmaxCpu, TopkSoftmaxCpu,
                              TopkSoftmaxSignature(ffi::Ffi::Bind()));

}  // namespace jax_moe
