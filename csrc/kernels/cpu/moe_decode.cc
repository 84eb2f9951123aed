// The routed layer for one token in one call on the CPU (ops.moe_decode):
// the same steps and rounding points as the CUDA kernel (kernels/cuda/
// moe_decode.cu), in plain loops with f32 sums.
#include "kernels/cpu/moe_decode.h"

#include <cmath>
#include <vector>

#include "kernels/common/routing.h"

namespace jax_moe {
namespace {

// Softmax top-k of one row of logits: ids in rank order (RouteBeats: larger
// logit first, ties to the lower id; NaN is -inf, RouteLogit), weights the
// softmax with the picks' terms as the sum (renormalize) or all experts'
// terms, times `scale`.
template <DType LT>
void DecodeRoute(const void* raw, int64_t experts, int64_t k, bool renormalize, float scale,
                 int* ids, float* wts) {
  using L = HostScalar<LT>;
  const auto* row = static_cast<const typename L::Storage*>(raw);
  std::vector<float> lg(experts);
  for (int64_t e = 0; e < experts; ++e) {
    const float v = L::Load(row[e]);
    lg[e] = RouteLogit(v);
  }
  for (int64_t e = 0; e < experts; ++e) {  // rank: the experts ahead of e
    int64_t rank = 0;
    for (int64_t o = 0; o < experts; ++o) rank += RouteBeats(lg[o], o, lg[e], e);
    if (rank < k) ids[rank] = static_cast<int>(e);
  }
  const float mx = lg[ids[0]];
  float sum = 0.f;
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) sum += SoftmaxTerm(lg[ids[j]], mx);
  else
    for (int64_t e = 0; e < experts; ++e) sum += SoftmaxTerm(lg[e], mx);
  for (int64_t j = 0; j < k; ++j) wts[j] = SoftmaxScore(lg[ids[j]], mx, sum) * scale;
}

template <DType DT>
void DecodeLayer(const TaskPool& pool, const void* x_raw, const void* w13_raw,
                 const void* w2_raw, const MoeDecodeProblem& d, const int* ids, const float* wts,
                 float* act, void* out_raw) {
  using S = HostScalar<DT>;
  using T = typename S::Storage;
  const T* x = static_cast<const T*>(x_raw);
  const T* w13 = static_cast<const T*>(w13_raw);
  const T* w2 = static_cast<const T*>(w2_raw);
  const int64_t hidden = d.hidden, inter = d.inter, k = d.topk;
  std::vector<float> xf(hidden);
  for (int64_t h = 0; h < hidden; ++h) xf[h] = S::Load(x[h]);
  auto round = [](float v) { return S::Load(S::Store(v)); };
  // act[j, i] = round(silu(round(gate . x)) * round(up . x)), j a slot.
  ParallelFor(pool, k * inter, [&](int64_t p) {
    const int64_t j = p / inter, i = p % inter;
    const T* g_row = w13 + (static_cast<int64_t>(ids[j]) * 2 * inter + i) * hidden;
    const T* u_row = g_row + inter * hidden;
    float g = 0.f, u = 0.f;
    for (int64_t h = 0; h < hidden; ++h) {
      g += S::Load(g_row[h]) * xf[h];
      u += S::Load(u_row[h]) * xf[h];
    }
    g = round(g);
    act[p] = round(g / (1.f + std::exp(-g)) * round(u));
  });
  // out[h] = sum over slots (in order) of weight * round(w2[ids[j], h] . act[j]).
  T* out = static_cast<T*>(out_raw);
  ParallelFor(pool, hidden, [&](int64_t h) {
    float o = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const T* row = w2 + (static_cast<int64_t>(ids[j]) * hidden + h) * inter;
      float y = 0.f;
      for (int64_t i = 0; i < inter; ++i) y += S::Load(row[i]) * act[j * inter + i];
      o += wts[j] * round(y);
    }
    out[h] = S::Store(o);
  });
}

}  // namespace

void MoeDecode(const TaskPool& pool, DType dtype, const MoeDecodeProblem& p) {
  int ids[kDecodeMaxTopk];
  float wts[kDecodeMaxTopk];
  WithDType(p.logit_dtype, [&]<DType LT>() {
    DecodeRoute<LT>(p.logits, p.experts, p.topk, p.renormalize, p.scale, ids, wts);
  });
  WithDType(dtype, [&]<DType DT>() {
    DecodeLayer<DT>(pool, p.x, p.w13, p.w2, p, ids, wts, p.act, p.out);
  });
}

}  // namespace jax_moe
