// The activation functions of step 5 on the CPU, shared by the activation
// kernel (kernels/cpu/activation.cc) and expert_mlp (kernels/cpu/
// group_gemm.cc): one definition, so both give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

inline float ActHost(float g, int64_t act) {
  switch (act) {
    case kGeluExact: return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case kGeluTanh: {
      float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return 0.5f * g * (1.f + std::tanh(inner));
    }
    default: return g / (1.f + std::exp(-g));
  }
}

// act(g) and act'(g) (into *slope), in f32.
inline float ActSlopeHost(float g, int64_t act, float* slope) {
  switch (act) {
    case kGeluExact: {
      const float cdf = 0.5f * (1.f + std::erf(g * 0.70710678118654752f));
      *slope = cdf + g * 0.3989422804014327f * std::exp(-0.5f * g * g);
      return g * cdf;
    }
    case kGeluTanh: {
      const float c = 0.7978845608028654f;
      const float t = std::tanh(c * (g + 0.044715f * g * g * g));
      *slope = 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * c * (1.f + 3.f * 0.044715f * g * g);
      return 0.5f * g * (1.f + t);
    }
    default: {
      const float s = 1.f / (1.f + std::exp(-g));
      *slope = s * (1.f + g * (1.f - s));
      return g * s;
    }
  }
}

// act(in[r, :inter]) * in[r, inter:] (gated) or act(in[r, :]) for `rows` rows
// of width `width`, computed in f32, into out (rows x inter).
template <typename S>
void ActRows(const typename S::Storage* in, int64_t rows, int64_t width, int64_t inter,
             int64_t act, bool gated, typename S::Storage* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inter; ++c) {
      float a = ActHost(S::Load(in[r * width + c]), act);
      if (gated) a *= S::Load(in[r * width + inter + c]);
      out[r * inter + c] = S::Store(a);
    }
}

// The activation's backward for `rows` rows: for the output cotangent d
// (rows x inter), out (rows x width) = d * up * act'(gate) and d * act(gate)
// (gated; gate = in[r, :inter], up = in[r, inter:]) or d * act'(in), in f32.
template <typename S>
void ActGradRows(const typename S::Storage* in, const typename S::Storage* d, int64_t rows,
                 int64_t width, int64_t inter, int64_t act, bool gated,
                 typename S::Storage* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inter; ++c) {
      float slope;
      const float a = ActSlopeHost(S::Load(in[r * width + c]), act, &slope);
      const float dv = S::Load(d[r * inter + c]);
      if (gated) {
        out[r * width + c] = S::Store(dv * S::Load(in[r * width + inter + c]) * slope);
        out[r * width + inter + c] = S::Store(dv * a);
      } else {
        out[r * width + c] = S::Store(dv * slope);
      }
    }
}

// The activation's backward in the routed layer, where the cotangent of row r
// is scale[r] * d[r] (d: the gradient of the unweighted expert output, pulled
// back through w2; scale: the row's top-k weight): dh (rows x width) as
// ActGradRows for that cotangent, as (rows x inter) = scale[r] * a[r] (a the
// forward's activation; w2's weight-gradient operand) and dot[r] = sum_c
// a[r, c] * d[r, c] (the top-k weight's gradient), with a rounded to the
// dtype as the forward stores it; in f32, columns in order. dh may be `in`
// (in place): each column's elements are read before they are written.
template <typename S>
void ActScaledGradRows(const typename S::Storage* in, const typename S::Storage* d,
                       const float* scale, int64_t rows, int64_t width, int64_t inter,
                       int64_t act, bool gated, typename S::Storage* dh,
                       typename S::Storage* as, float* dot) {
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f;
    for (int64_t c = 0; c < inter; ++c) {
      float slope;
      const float gate = S::Load(in[r * width + c]);
      const float ag = ActSlopeHost(gate, act, &slope);  // as ActGradRows'
      const float up = gated ? S::Load(in[r * width + inter + c]) : 1.f;
      const float a = ActHost(gate, act);  // as ActRows'
      const float dv = S::Load(d[r * inter + c]);
      const float dd = scale[r] * dv;
      sum += S::Load(S::Store(a * up)) * dv;
      as[r * inter + c] = S::Store(scale[r] * (a * up));
      if (gated) {
        dh[r * width + c] = S::Store(dd * up * slope);
        dh[r * width + inter + c] = S::Store(dd * ag);
      } else {
        dh[r * width + c] = S::Store(dd * slope);
      }
    }
    dot[r] = sum;
  }
}

}  // namespace jax_moe
