// moe_decode (one token, the whole routed layer in one call): its limits and
// its problem, shared by the CPU and CUDA kernels and the handlers' checks
// (ffi/shape_checks.h); no XLA include.
#pragma once

#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

// The limits of the CUDA kernel, which both handlers enforce so that both
// platforms accept the same calls (Python reads them as the module's
// DECODE_LIMITS).
constexpr int64_t kDecodeMaxTopk = 8;        // weights per slot in shared memory
constexpr int64_t kDecodeMaxExperts = 1024;  // logits in shared memory
constexpr int64_t kDecodeMaxHidden = 2048;   // x in registers: 8 x 16 bytes a lane
constexpr int64_t kDecodeMaxInter = 1024;    // act in registers: 4 x 8 floats a lane
constexpr int64_t kDecodeMultiple = 256;     // H and I: whole 256-column warp strides

// One token: pointers (device memory for the CUDA kernel) and sizes, within
// the limits above. Softmax top-k of the logits (the choice on the logits;
// kernels/common/routing.h), then act = round(silu(round(gate . x)) *
// round(up . x)) per pick, y = round(w2 . act) and out = sum over the picks,
// in rank order, of weight * y; x, the weights and out share one dtype (bf16
// or f16), sums in f32.
struct MoeDecodeProblem {
  const void* x;       // (H)
  const void* logits;  // (E), logit_dtype (f32, bf16 or f16)
  const void* w13;     // (E, 2I, H)
  const void* w2;      // (E, H, I)
  float* act;          // (k, I) scratch
  void* out;           // (H)
  DType logit_dtype;
  int64_t experts, hidden, inter, topk;
  bool renormalize;
  float scale;  // routed_scaling_factor
};

// moe_decode_fp8 (one token's routed experts with block-scaled e4m3 weights
// in one call, CUDA only): the limits both the handler and Python check.
// Shared memory holds x's codes and every slot's act codes.
constexpr int64_t kDecodeFp8MaxTopk = 16;
constexpr int64_t kDecodeFp8MaxHidden = 16384;
constexpr int64_t kDecodeFp8MaxInter = 4096;
constexpr int64_t kDecodeFp8Multiple = 16;  // H and I: whole 16-byte code loads

// One token's picks (ids, weights: the router's output) through their
// experts with fp8 weights: h = round(x_q . w13[e]) per 128-channel block
// scales (x quantised per 128 channels as the fp8 recipe), act = round(act(
// round(gate)) * round(up)) (gated) or round(act(round(h))), y =
// round(act_q . w2[e]), out = sum over the slots in order of weight * y.
// x and out share one dtype (f32, bf16 or f16), sums in f32. A slot whose
// id is outside [0, E) adds nothing.
struct MoeDecodeFp8Problem {
  const void* x;             // (H)
  const int32_t* ids;        // (k)
  const float* weights;      // (k)
  const uint8_t* w13;        // (E, N13, H), N13 = 2I (gated) or I
  const float* w13_scale;    // (E, ceil(N13 / 128), ceil(H / 128))
  const uint8_t* w2;         // (E, H, I)
  const float* w2_scale;     // (E, ceil(H / 128), ceil(I / 128))
  float* act;                // (k, I) scratch
  float* y;                  // (k, H) scratch
  void* out;                 // (H)
  int64_t experts, hidden, inter, topk;
  int64_t activation;        // numeric.h's Activation
  bool gated;
};

}  // namespace jax_moe
