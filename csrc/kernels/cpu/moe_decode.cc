// The routed layer for one token in one call on the CPU (ops.moe_decode):
// the same steps and rounding points as the CUDA kernel (csrc/cuda/
// moe_decode.cu), in plain loops with f32 sums.
#include <cmath>
#include <vector>

#include "ffi/ffi_common.h"
#include "kernels/cpu/parallel_for.h"
#include "ffi/layer_steps.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {
namespace {

// Softmax top-k of one row of logits: ids in rank order (larger logit first,
// ties to the lower id; NaN is -inf, as in the router), weights renormalised
// over the picks or divided by the sum over all experts, times `scale`.
template <DType LT>
void DecodeRoute(const void* raw, int64_t experts, int64_t k, bool renormalize, float scale,
                 int* ids, float* wts) {
  using L = HostScalar<LT>;
  const auto* row = static_cast<const typename L::Storage*>(raw);
  std::vector<float> lg(experts);
  for (int64_t e = 0; e < experts; ++e) {
    const float v = L::Load(row[e]);
    lg[e] = std::isnan(v) ? -INFINITY : v;
  }
  for (int64_t e = 0; e < experts; ++e) {  // rank: the experts ahead of e
    int64_t rank = 0;
    for (int64_t o = 0; o < experts; ++o) rank += lg[o] > lg[e] || (lg[o] == lg[e] && o < e);
    if (rank < k) ids[rank] = static_cast<int>(e);
  }
  const float mx = lg[ids[0]];
  float sum = 0.f;
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) sum += std::exp(lg[ids[j]] - mx);
  else
    for (int64_t e = 0; e < experts; ++e) sum += std::exp(lg[e] - mx);
  for (int64_t j = 0; j < k; ++j) wts[j] = std::exp(lg[ids[j]] - mx) / sum * scale;
}

template <DType DT>
void DecodeLayer(ffi::ThreadPool& pool, const void* x_raw, const void* w13_raw,
                 const void* w2_raw, const MoeDecodeDims& d, const int* ids, const float* wts,
                 float* act, void* out_raw) {
  using S = HostScalar<DT>;
  using T = typename S::Storage;
  const T* x = static_cast<const T*>(x_raw);
  const T* w13 = static_cast<const T*>(w13_raw);
  const T* w2 = static_cast<const T*>(w2_raw);
  const int64_t hidden = d.hidden, inter = d.inter, k = d.k;
  std::vector<float> xf(hidden);
  for (int64_t h = 0; h < hidden; ++h) xf[h] = S::Load(x[h]);
  auto round = [](float v) { return S::Load(S::Store(v)); };
  // act[j, i] = round(silu(round(gate . x)) * round(up . x)), j a slot.
  ParallelFor(PoolOf(pool), k * inter, [&](int64_t p) {
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
  ParallelFor(PoolOf(pool), hidden, [&](int64_t h) {
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

ffi::Error MoeDecodeCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer logits,
                        ffi::AnyBuffer w13, ffi::AnyBuffer w2, int64_t topk, bool renormalize,
                        float routed_scaling_factor, AnyOut out, F32Out act) {
  MoeDecodeDims d;
  if (auto e = CheckMoeDecode(x, logits, w13, w2, topk, *out, *act, &d); e.failure()) return e;
  int ids[kDecodeMaxTopk];
  float wts[kDecodeMaxTopk];
  if (auto e = DispatchFloat(logits.element_type(), "logits", [&]<DType LT>() {
        DecodeRoute<LT>(logits.untyped_data(), d.experts, d.k, renormalize,
                        routed_scaling_factor, ids, wts);
        return ffi::Error::Success();
      });
      e.failure())
    return e;
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() {
    DecodeLayer<DT>(pool, x.untyped_data(), w13.untyped_data(), w2.untyped_data(), d, ids, wts,
                    act->typed_data(), out->untyped_data());
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMoeDecodeCpu, MoeDecodeCpu,
                              MoeDecodeSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace jax_moe
