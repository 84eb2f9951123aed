// Shape and dtype checks shared by the CPU and CUDA handlers of each op, so
// both platforms reject exactly the same buffers (Python validates first; these
// keep a kernel from ever indexing past what it was given).
#pragma once

#include "ffi/ffi_common.h"
#include "kernels/common/gemm_dims.h"
#include "kernels/common/moe_decode.h"

namespace jax_moe {

struct RouteDims {
  int64_t experts, rows, tokens, k;  // logits (..., T, E) = rows x E; k slots a row
};

inline ffi::Error CheckRoute(const ffi::AnyBuffer& logits, const ffi::Buffer<ffi::F32>& bias,
                             int64_t scoring, int64_t num_expert_group, int64_t topk_group,
                             const ffi::Buffer<ffi::F32>& weights,
                             const ffi::Buffer<ffi::S32>& ids, RouteDims* d) {
  const auto dims = logits.dimensions();
  d->experts = LastDim(dims);
  d->rows = LeadingRows(dims);
  // Leading dims (..., T): vmap's broadcast_all gives bias (..., E) with the
  // same batch dims, one bias row per batch element.
  d->tokens = dims.size() >= 2 ? dims[dims.size() - 2] : 1;
  const int64_t batch = d->tokens > 0 ? d->rows / d->tokens : 0;
  d->k = LastDim(weights.dimensions());
  const int64_t experts = d->experts, rows = d->rows, k = d->k;
  if (k < 1 || k > experts) return InvalidArg("topk must be in [1, num_experts]");
  if (static_cast<int64_t>(weights.element_count()) != rows * k ||
      static_cast<int64_t>(ids.element_count()) != rows * k)
    return InvalidArg("route: output shapes do not match (rows, topk)");
  if (scoring != 0 && scoring != 1)
    return InvalidArg("route: scoring must be 0 (softmax) or 1 (sigmoid)");
  if (num_expert_group < 1 || experts % num_expert_group)
    return InvalidArg("route: num_expert_group must be >= 1 and divide num_experts");
  if (topk_group < 1 || topk_group > num_expert_group)
    return InvalidArg("route: topk_group must be in [1, num_expert_group]");
  if (k > topk_group * (experts / num_expert_group))
    return InvalidArg("route: topk exceeds the experts of topk_group groups");
  if (LastDim(bias.dimensions()) != experts ||
      (rows > 0 && static_cast<int64_t>(bias.element_count()) != batch * experts))
    return InvalidArg("route: bias must be (..., num_experts) with the batch dims of the logits");
  return CheckFloat(logits.element_type(), "router_logits");
}

// moe_decode: the limits (kDecode*) are its CUDA kernel's, enforced by both
// handlers so that both platforms accept the same calls.
struct MoeDecodeDims {
  int64_t experts, hidden, inter, k;
};

// x (1, H), logits (1, E) (f32, bf16 or f16), w13 (E, 2*I, H), w2 (E, H, I);
// out (1, H); act (k, I) f32 scratch.
inline ffi::Error CheckMoeDecode(const ffi::AnyBuffer& x, const ffi::AnyBuffer& logits,
                                 const ffi::AnyBuffer& w13, const ffi::AnyBuffer& w2,
                                 int64_t topk, const ffi::AnyBuffer& out,
                                 const ffi::Buffer<ffi::F32>& act, MoeDecodeDims* d) {
  auto xd = x.dimensions();
  auto ld = logits.dimensions();
  auto w1 = w13.dimensions();
  auto w2d = w2.dimensions();
  if (xd.size() != 2 || xd[0] != 1 || ld.size() != 2 || ld[0] != 1 || w1.size() != 3 ||
      w2d.size() != 3)
    return InvalidArg("moe_decode: x must be (1, H), logits (1, E), w13 (E, 2*I, H), w2 (E, H, I)");
  const int64_t experts = ld[1], hidden = xd[1], inter = w2d.size() == 3 ? w2d[2] : 0;
  if (w1[0] != experts || w1[1] != 2 * inter || w1[2] != hidden || w2d[0] != experts ||
      w2d[1] != hidden)
    return InvalidArg(
        "moe_decode: w13 must be (E, 2*I, H) and w2 (E, H, I) for x (1, H), logits (1, E)");
  const ffi::DataType t = x.element_type();
  if (t != ffi::DataType::BF16 && t != ffi::DataType::F16)
    return InvalidArg("moe_decode: x must be bfloat16 or float16");
  if (w13.element_type() != t || w2.element_type() != t || out.element_type() != t)
    return InvalidArg("moe_decode: x, the weights and the output must share a dtype");
  if (!IsFloatType(logits.element_type())) return InvalidArg("moe_decode: logits must be float");
  if (topk < 1 || topk > experts || topk > kDecodeMaxTopk)
    return InvalidArg("moe_decode: topk must be in [1, min(E, 8)]");
  if (experts > kDecodeMaxExperts) return InvalidArg("moe_decode: E must be <= 1024");
  if (hidden < kDecodeMultiple || hidden > kDecodeMaxHidden || hidden % kDecodeMultiple)
    return InvalidArg("moe_decode: H must be a multiple of 256 in [256, 2048]");
  if (inter < kDecodeMultiple || inter > kDecodeMaxInter || inter % kDecodeMultiple)
    return InvalidArg("moe_decode: I must be a multiple of 256 in [256, 1024]");
  if (out.element_count() != static_cast<size_t>(hidden) ||
      act.element_count() != static_cast<size_t>(topk * inter))
    return InvalidArg("moe_decode: out must be (1, H) and the scratch (topk, I)");
  *d = {experts, hidden, inter, topk};
  return ffi::Error::Success();
}

// A gather's topk (dst_to_src entries name token rows entry / topk): within
// [1, 2^20], as Python's checks bound it.
inline ffi::Error CheckGatherTopk(const char* op, int64_t topk) {
  if (topk < 1 || topk > (int64_t{1} << 20))
    return InvalidArg(std::string(op) + ": topk must be in [1, 2^20]");
  return ffi::Error::Success();
}

// x (M, K), or with `gather` x (T, K) and rows (M,) naming token rows (step 3
// fused into the GEMM); w (E, N, K); out (M, N).
inline ffi::Error CheckGroupGemm(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                 const ffi::Buffer<ffi::S32>& sizes,
                                 const ffi::Buffer<ffi::S32>& rows, bool gather, int64_t topk,
                                 int64_t tile_m, bool w_kn, const ffi::AnyBuffer& out,
                                 GemmDims* d) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return InvalidArg("group_gemm: x must be (M, K) and w (E, N, K)");
  const int64_t m = gather ? static_cast<int64_t>(rows.element_count()) : xd[0];
  *d = {m, xd[1], wd[0], w_kn ? wd[2] : wd[1], xd[0]};
  if ((w_kn ? wd[1] : wd[2]) != d->k) return InvalidArg("group_gemm: K of x and w differ");
  if (w_kn && (gather || tile_m != 256))
    return InvalidArg("group_gemm: w_kn (w as (E, K, N)) takes no gather and tile_m 256 only");
  if (static_cast<int64_t>(sizes.element_count()) != d->groups)
    return InvalidArg("group_gemm: expert_sizes must have E entries");
  if (x.element_type() != w.element_type() || out.element_type() != x.element_type())
    return InvalidArg("group_gemm: x, w and the output must share a dtype");
  if (out.element_count() != static_cast<size_t>(d->m * d->n))
    return InvalidArg("group_gemm: output must be (M, N)");
  if (gather) {
    if (auto err = CheckGatherTopk("group_gemm", topk); err.failure()) return err;
  }
  // 16: the TMA decode kernel where it applies (CUDA, compute capability 9.0+;
  // else 8). 256: the CUTLASS sm90 kernel where it applies (CUDA only; else 128).
  if (tile_m != 8 && tile_m != 16 && tile_m != 32 && tile_m != 64 && tile_m != 128 &&
      tile_m != 256)
    return InvalidArg("group_gemm: tile_m must be 8, 16, 32, 64, 128 or 256");
  return ffi::Error::Success();
}

// Steps 3-6 in one call (expert_mlp): h = gather(x) @ w13^T, a = act(h),
// out = a @ w2^T; d1 and d2 are the two GEMMs' dims.
inline ffi::Error CheckExpertMlp(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w13,
                                 const ffi::AnyBuffer& w2, const ffi::Buffer<ffi::S32>& sizes,
                                 const ffi::Buffer<ffi::S32>& rows, int64_t topk,
                                 int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                                 const ffi::AnyBuffer& out, const ffi::AnyBuffer& h,
                                 const ffi::AnyBuffer& a, GemmDims* d1, GemmDims* d2) {
  auto xd = x.dimensions();
  auto w1 = w13.dimensions();
  auto w2d = w2.dimensions();
  if (xd.size() != 2 || w1.size() != 3 || w2d.size() != 3)
    return InvalidArg("expert_mlp: x must be (T, H), w13 (E, N, H) and w2 (E, H, I)");
  const int64_t m = static_cast<int64_t>(rows.element_count());
  const int64_t experts = w1[0], n1 = w1[1], hidden = xd[1];
  if (gated && n1 % 2 != 0) return InvalidArg("expert_mlp: gated w13 must be (E, 2*I, H)");
  const int64_t inter = gated ? n1 / 2 : n1;
  if (w1[2] != hidden || w2d[0] != experts || w2d[1] != hidden || w2d[2] != inter)
    return InvalidArg("expert_mlp: w13 must be (E, N, H) and w2 (E, H, I) for x (T, H)");
  if (static_cast<int64_t>(sizes.element_count()) != experts)
    return InvalidArg("expert_mlp: expert_sizes must have E entries");
  const ffi::DataType t = x.element_type();
  if (w13.element_type() != t || w2.element_type() != t || out.element_type() != t ||
      h.element_type() != t || a.element_type() != t)
    return InvalidArg("expert_mlp: x, the weights, the output and the scratch must share a dtype");
  if (out.element_count() != static_cast<size_t>(m * hidden) ||
      h.element_count() != static_cast<size_t>(m * n1) ||
      a.element_count() != static_cast<size_t>(m * inter))
    return InvalidArg("expert_mlp: out must be (M, H), the scratch (M, N) and (M, I)");
  if (auto err = CheckGatherTopk("expert_mlp", topk); err.failure()) return err;
  if (activation < kSilu || activation > kGeluTanh) return InvalidArg("unknown activation code");
  // 256: the own Hopper kernel where moe_layer chains it, else run as 128
  for (int64_t tm : {tile_m1, tile_m2})
    if (tm != 8 && tm != 16 && tm != 32 && tm != 64 && tm != 128 && tm != 256)
      return InvalidArg("expert_mlp: tile_m must be 8, 16, 32, 64, 128 or 256");
  *d1 = {m, hidden, experts, n1, xd[0]};
  *d2 = {m, inter, experts, hidden, m};
  return ffi::Error::Success();
}

inline ffi::Error CheckTokenIndex(const ffi::Buffer<ffi::S32>& ids, int64_t num_experts,
                                  int64_t start_expert, const ffi::Buffer<ffi::S32>& src_to_dst,
                                  const ffi::Buffer<ffi::S32>& dst_to_src,
                                  const ffi::Buffer<ffi::S32>& sizes) {
  const int64_t n = ids.element_count();
  if (static_cast<int64_t>(src_to_dst.element_count()) != n ||
      static_cast<int64_t>(dst_to_src.element_count()) != n)
    return InvalidArg("moe_compute_token_index: index outputs must have T*topk entries");
  if (start_expert < 0 || start_expert + static_cast<int64_t>(sizes.element_count()) > num_experts)
    return InvalidArg("moe_compute_token_index: local expert range outside [0, num_experts)");
  if (n >= (int64_t{1} << 31)) return InvalidArg("moe_compute_token_index: T*topk must be < 2^31");
  return ffi::Error::Success();
}

inline ffi::Error CheckExpand(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& dst_to_src,
                              int64_t topk, const ffi::AnyBuffer& out) {
  if (topk < 1) return InvalidArg("moe_expand_input: topk must be >= 1");
  if (!IsFloatType(x.element_type()))
    return InvalidArg("moe_expand_input: x must be f32, bf16 or f16");
  const int64_t rows = dst_to_src.element_count();
  if (out.element_count() != static_cast<size_t>(rows * LastDim(x.dimensions())) ||
      out.element_type() != x.element_type())
    return InvalidArg("moe_expand_input: output must be (len(dst_to_src), H) of x's dtype");
  return ffi::Error::Success();
}

struct CombineDims {
  int64_t m, hidden, tokens, k;
};

inline ffi::Error CheckCombine(const ffi::AnyBuffer& y, const ffi::Buffer<ffi::F32>& weights,
                               const ffi::Buffer<ffi::S32>& src_to_dst, const ffi::AnyBuffer& out,
                               CombineDims* d) {
  *d = {LeadingRows(y.dimensions()), LastDim(y.dimensions()),
        LeadingRows(weights.dimensions()), LastDim(weights.dimensions())};
  if (static_cast<int64_t>(src_to_dst.element_count()) != d->tokens * d->k)
    return InvalidArg("moe_combine: src_to_dst must have T*topk entries");
  if (out.element_count() != static_cast<size_t>(d->tokens * d->hidden) ||
      out.element_type() != y.element_type())
    return InvalidArg("moe_combine: output must be (T, H) of y's dtype");
  return CheckFloat(y.element_type(), "y");
}

// combine_bwd: g (T, H) and dy (M, H) of y's dtype, src_to_dst (T*k,),
// dst_to_src (M,), dw (T, k); the dims are the forward's.
inline ffi::Error CheckCombineBwd(const ffi::AnyBuffer& g, const ffi::AnyBuffer& y,
                                  const ffi::Buffer<ffi::F32>& weights,
                                  const ffi::Buffer<ffi::S32>& src_to_dst,
                                  const ffi::Buffer<ffi::S32>& dst_to_src, const ffi::AnyBuffer& dy,
                                  const ffi::Buffer<ffi::F32>& dw, CombineDims* d) {
  *d = {LeadingRows(y.dimensions()), LastDim(y.dimensions()),
        LeadingRows(weights.dimensions()), LastDim(weights.dimensions())};
  if (g.element_count() != static_cast<size_t>(d->tokens * d->hidden) ||
      g.element_type() != y.element_type())
    return InvalidArg("moe_combine backward: g must be (T, H) of y's dtype");
  if (static_cast<int64_t>(src_to_dst.element_count()) != d->tokens * d->k)
    return InvalidArg("moe_combine backward: src_to_dst must have T*topk entries");
  if (static_cast<int64_t>(dst_to_src.element_count()) != d->m)
    return InvalidArg("moe_combine backward: dst_to_src must have one entry per row of y");
  if (dy.element_count() != static_cast<size_t>(d->m * d->hidden) ||
      dy.element_type() != y.element_type())
    return InvalidArg("moe_combine backward: dy must be (M, H) of y's dtype");
  if (static_cast<int64_t>(dw.element_count()) != d->tokens * d->k)
    return InvalidArg("moe_combine backward: dw must be (T, topk)");
  return CheckFloat(y.element_type(), "y");
}

struct ActDims {
  int64_t rows, width, inter;  // input rows x width -> rows x inter
};

inline ffi::Error CheckActivation(const ffi::AnyBuffer& h, int64_t activation, bool gated,
                                  const ffi::AnyBuffer& out, ActDims* d) {
  d->rows = LeadingRows(h.dimensions());
  d->width = LastDim(h.dimensions());
  if (gated && d->width % 2 != 0) return InvalidArg("gated activation: last dim must be even");
  if (activation < kSilu || activation > kGeluTanh) return InvalidArg("unknown activation code");
  d->inter = gated ? d->width / 2 : d->width;
  if (out.element_count() != static_cast<size_t>(d->rows * d->inter) ||
      out.element_type() != h.element_type())
    return InvalidArg("activation: output must be (..., I) of h's dtype");
  return CheckFloat(h.element_type(), "h");
}

// activation_grad: h as for the activation, d (..., I) and out (h's shape),
// both of h's dtype.
inline ffi::Error CheckActivationGrad(const ffi::AnyBuffer& h, const ffi::AnyBuffer& d,
                                      int64_t activation, bool gated, const ffi::AnyBuffer& out,
                                      ActDims* dims) {
  if (auto err = CheckActivation(h, activation, gated, d, dims); err.failure())
    return InvalidArg("activation grad: h (..., 2I or I) and its output's cotangent (..., I), "
                      "one float dtype");
  if (out.element_count() != h.element_count() || out.element_type() != h.element_type())
    return InvalidArg("activation grad: dh must have h's shape and dtype");
  return ffi::Error::Success();
}

// activation_scaled_grad: h, d and dh as for activation_grad; scale, dot
// (rows,) and as (rows, I) of h's dtype.
inline ffi::Error CheckActivationScaledGrad(const ffi::AnyBuffer& h, const ffi::AnyBuffer& d,
                                            const ffi::Buffer<ffi::F32>& scale,
                                            int64_t activation, bool gated,
                                            const ffi::AnyBuffer& dh, const ffi::AnyBuffer& as,
                                            const ffi::Buffer<ffi::F32>& dot, ActDims* dims) {
  if (auto err = CheckActivationGrad(h, d, activation, gated, dh, dims); err.failure())
    return err;
  if (static_cast<int64_t>(scale.element_count()) != dims->rows ||
      static_cast<int64_t>(dot.element_count()) != dims->rows)
    return InvalidArg("activation scaled grad: scale and dot must have one entry per row of h");
  if (as.element_count() != d.element_count() || as.element_type() != h.element_type())
    return InvalidArg("activation scaled grad: the scaled activation must have d's shape and "
                      "h's dtype");
  return ffi::Error::Success();
}

// group_gemm_wgrad: dy (M, N); x (M, K), or with `gather` x (T, K) and rows
// (M,) naming token rows; out (E, N, K) with E = expert_sizes' entries. Fills
// d: m = M, k = K, groups = E, n = N, x_rows = x's rows.
inline ffi::Error CheckGroupGemmWgrad(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                      const ffi::Buffer<ffi::S32>& sizes,
                                      const ffi::Buffer<ffi::S32>& rows, bool gather,
                                      int64_t topk, const ffi::AnyBuffer& out, GemmDims* d) {
  auto dd = dy.dimensions();
  auto xd = x.dimensions();
  auto od = out.dimensions();
  if (dd.size() != 2 || xd.size() != 2 || od.size() != 3)
    return InvalidArg("group_gemm_wgrad: dy must be (M, N), x (M, K) or (T, K), out (E, N, K)");
  *d = {dd[0], xd[1], static_cast<int64_t>(sizes.element_count()), dd[1], xd[0]};
  if (gather && static_cast<int64_t>(rows.element_count()) != d->m)
    return InvalidArg("group_gemm_wgrad: dst_to_src must have M entries (dy's rows)");
  if (!gather && d->x_rows != d->m)
    return InvalidArg("group_gemm_wgrad: x and dy must have M rows");
  if (od[0] != d->groups || od[1] != d->n || od[2] != d->k)
    return InvalidArg("group_gemm_wgrad: output must be (E, N, K)");
  if (auto err = CheckFloat(dy.element_type(), "group_gemm_wgrad: dy"); err.failure()) return err;
  if (x.element_type() != dy.element_type() || out.element_type() != dy.element_type())
    return InvalidArg("group_gemm_wgrad: dy, x and the output must share a dtype");
  if (gather) {
    if (auto err = CheckGatherTopk("group_gemm_wgrad", topk); err.failure()) return err;
  }
  return ffi::Error::Success();
}

}  // namespace jax_moe
