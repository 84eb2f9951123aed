// The FFI targets: their list, the handler symbols (defined in csrc/ffi/
// <step>.cc, registered by module.cc) and each target's signature.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_moe {

// Every FFI target once: X(python target name, handler stem). Each op family
// defines k<stem>Cpu and (CUDA builds) k<stem>Cuda in csrc/ffi/<step>.cc;
// module.cc registers both from this list.
#define JAX_MOE_TARGETS(X)                                  \
  X("jax_moe_route", Route)                                 \
  X("jax_moe_token_index", TokenIndex)                      \
  X("jax_moe_expand", Expand)                               \
  X("jax_moe_group_gemm", GroupGemm)                        \
  X("jax_moe_group_gemm_act", GroupGemmAct)                 \
  X("jax_moe_expert_mlp", ExpertMlp)                        \
  X("jax_moe_moe_layer", MoeLayer)                          \
  X("jax_moe_moe_decode", MoeDecode)                        \
  X("jax_moe_moe_decode_fp8", MoeDecodeFp8)                 \
  X("jax_moe_activation", Activation)                       \
  X("jax_moe_activation_grad", ActivationGrad)              \
  X("jax_moe_activation_scaled_grad", ActivationScaledGrad) \
  X("jax_moe_combine", Combine)                             \
  X("jax_moe_write_kv", WriteKv)                            \
  X("jax_moe_paged_decode", PagedDecode)                    \
  X("jax_moe_fill_rows", FillRows)                          \
  X("jax_moe_group_gemm_wgrad", GroupGemmWgrad)             \
  X("jax_moe_group_gemm_fp8", GroupGemmFp8)                 \
  X("jax_moe_combine_bwd", CombineBwd)

#define JAX_MOE_DECLARE_CPU(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(k##stem##Cpu);
JAX_MOE_TARGETS(JAX_MOE_DECLARE_CPU)
#undef JAX_MOE_DECLARE_CPU

#ifdef JAX_MOE_WITH_CUDA
#define JAX_MOE_DECLARE_CUDA(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(k##stem##Cuda);
JAX_MOE_TARGETS(JAX_MOE_DECLARE_CUDA)
#undef JAX_MOE_DECLARE_CUDA
#endif

// Each target's arguments, attributes and results after the platform's
// context (`bound`: ffi::Ffi::Bind(), with .Ctx<...>() where the handler takes
// one): one list for the CPU and the CUDA handler, which must match the
// Python side's ffi_call.

// The router's attributes (route, moe_layer).
template <typename Bound>
auto RouteAttrs(Bound bound) {
  return std::move(bound)
      .template Attr<bool>("renormalize")
      .template Attr<int64_t>("scoring")
      .template Attr<int64_t>("num_expert_group")
      .template Attr<int64_t>("topk_group")
      .template Attr<bool>("has_bias")
      .template Attr<float>("routed_scaling_factor");
}

// route (ops.route, ops.topk_softmax)
template <typename Bound>
auto RouteSignature(Bound bound) {
  return RouteAttrs(std::move(bound)
                        .template Arg<xla::ffi::AnyBuffer>()  // router_logits
                        .template Arg<xla::ffi::Buffer<xla::ffi::F32>>())  // bias
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // weights
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>();  // ids
}

// token_index (ops.moe_compute_token_index)
template <typename Bound>
auto TokenIndexSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // topk_ids
      .template Attr<int64_t>("num_experts")
      .template Attr<int64_t>("start_expert")
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // src_to_dst
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_sizes
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>();  // scratch (CUDA)
}

// expand (ops.moe_expand)
template <typename Bound>
auto ExpandSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // x
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src
      .template Attr<int64_t>("topk")
      .template Ret<xla::ffi::AnyBuffer>();  // expanded rows
}

// group_gemm (ops.group_gemm, group_gemm_gather)
template <typename Bound>
auto GroupGemmSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // x
      .template Arg<xla::ffi::AnyBuffer>()  // w
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_sizes
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src of the gather, or empty
      .template Attr<bool>("gather")
      .template Attr<int64_t>("topk")
      .template Attr<int64_t>("tile_m")
      .template Attr<bool>("w_kn")  // w is (E, K, N): the dgrad (sm90 path only)
      .template Ret<xla::ffi::AnyBuffer>()  // out
      .template Ret<xla::ffi::AnyBuffer>();  // scratch (u8; the sm90 path's)
}

// group_gemm_act (the forward-only layer's w13 GEMM with the gated activation)
template <typename Bound>
auto GroupGemmActSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // x (T, K)
      .template Arg<xla::ffi::AnyBuffer>()  // w (E, 2I, K)
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_sizes
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src (M,)
      .template Attr<int64_t>("topk")
      .template Attr<int64_t>("activation")
      .template Ret<xla::ffi::AnyBuffer>()  // out (M, I)
      .template Ret<xla::ffi::AnyBuffer>();  // the tile counter (4 bytes; the GPU's)
}

// activation (ops.gated_activation, ops.activation)
template <typename Bound>
auto ActivationSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // h
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Ret<xla::ffi::AnyBuffer>();  // out
}

// activation_grad (the activation's backward)
template <typename Bound>
auto ActivationGradSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // h
      .template Arg<xla::ffi::AnyBuffer>()  // the output's cotangent
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Ret<xla::ffi::AnyBuffer>();  // dh
}

// activation_scaled_grad (the routed layer's activation backward)
template <typename Bound>
auto ActivationScaledGradSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // h
      .template Arg<xla::ffi::AnyBuffer>()  // d: the unweighted cotangent of the activation
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale: each row's top-k weight
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Ret<xla::ffi::AnyBuffer>()  // dh
      .template Ret<xla::ffi::AnyBuffer>()  // scale * act(h)
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>();  // <act(h), d> per row
}

// combine (ops.moe_combine)
template <typename Bound>
auto CombineSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // y
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // topk_weights
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // src_to_dst
      .template Ret<xla::ffi::AnyBuffer>();  // out
}

// combine_bwd (the VJP of ops.moe_combine)
template <typename Bound>
auto CombineBwdSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // g, the output's cotangent (T, H)
      .template Arg<xla::ffi::AnyBuffer>()  // y (M, H)
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // topk_weights (T, k)
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // src_to_dst (T*k,)
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src (M,)
      .template Ret<xla::ffi::AnyBuffer>()  // dy (M, H)
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>();  // dw (T, k)
}

// write_kv (attention.write_kv; the results alias k_pages and v_pages)
template <typename Bound>
auto WriteKvSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // k_pages
      .template Arg<xla::ffi::AnyBuffer>()  // v_pages
      .template Arg<xla::ffi::AnyBuffer>()  // k
      .template Arg<xla::ffi::AnyBuffer>()  // v
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // slot_mapping
      .template Ret<xla::ffi::AnyBuffer>()  // k_pages
      .template Ret<xla::ffi::AnyBuffer>();  // v_pages
}

// paged_decode (attention.paged_decode_attention)
template <typename Bound>
auto PagedDecodeSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // q
      .template Arg<xla::ffi::AnyBuffer>()  // k_pages
      .template Arg<xla::ffi::AnyBuffer>()  // v_pages
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // page_table
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // lengths
      .template Attr<float>("scale")
      .template Attr<int64_t>("split_tokens")
      .template Ret<xla::ffi::AnyBuffer>()  // out
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scratch: per-split partial outputs
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>();  // scratch: per-split (max, sum)
}

// fill_rows (attention's packed prefill; the result aliases x)
template <typename Bound>
auto FillRowsSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // x
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ctrl
      .template Ret<xla::ffi::AnyBuffer>();  // x
}

// expert_mlp (ops.expert_mlp)
template <typename Bound>
auto ExpertMlpSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()   // x
      .template Arg<xla::ffi::AnyBuffer>()   // w13
      .template Arg<xla::ffi::AnyBuffer>()   // w2
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_sizes
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src
      .template Attr<int64_t>("topk")
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Attr<int64_t>("tile_m1")
      .template Attr<int64_t>("tile_m2")
      .template Ret<xla::ffi::AnyBuffer>()   // out
      .template Ret<xla::ffi::AnyBuffer>()   // h (scratch)
      .template Ret<xla::ffi::AnyBuffer>();  // a (scratch)
}

// moe_layer (ops.moe_layer): route, token index, expert_mlp and combine in one call
template <typename Bound>
auto MoeLayerSignature(Bound bound) {
  return RouteAttrs(std::move(bound)
                        .template Arg<xla::ffi::AnyBuffer>()  // hidden_states
                        .template Arg<xla::ffi::AnyBuffer>()  // router_logits
                        .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // bias (or zeros)
                        .template Arg<xla::ffi::AnyBuffer>()  // w13
                        .template Arg<xla::ffi::AnyBuffer>())  // w2
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Attr<int64_t>("tile_m1")
      .template Attr<int64_t>("tile_m2")
      .template Ret<xla::ffi::AnyBuffer>()   // out (T, H)
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scratch: topk weights
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // scratch: topk ids
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // scratch: src_to_dst
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // scratch: dst_to_src
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // scratch: expert_sizes
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // scratch: token index (CUDA)
      .template Ret<xla::ffi::AnyBuffer>()   // scratch: expert outputs y
      .template Ret<xla::ffi::AnyBuffer>()   // scratch: h
      .template Ret<xla::ffi::AnyBuffer>()   // scratch: a
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>();  // scratch: tile counters (2 or 0)
}

// moe_decode (ops.moe_decode): the routed layer for one token in one call
template <typename Bound>
auto MoeDecodeSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // hidden_states (1, H)
      .template Arg<xla::ffi::AnyBuffer>()  // router_logits (1, E)
      .template Arg<xla::ffi::AnyBuffer>()  // w13 (E, 2*I, H)
      .template Arg<xla::ffi::AnyBuffer>()  // w2 (E, H, I)
      .template Attr<int64_t>("topk")
      .template Attr<bool>("renormalize")
      .template Attr<float>("routed_scaling_factor")
      .template Ret<xla::ffi::AnyBuffer>()  // out (1, H)
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>();  // scratch: act (topk, I)
}

// moe_decode_fp8 (the fp8 layer's one-token form): a token's routed experts
// with block-scaled e4m3 weights in one call, after the router
template <typename Bound>
auto MoeDecodeFp8Signature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // hidden_states (1, H) f32 / bf16 / f16
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // topk_ids (1, k)
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // topk_weights (1, k)
      .template Arg<xla::ffi::AnyBuffer>()  // w13 (E, 2I or I, H) float8_e4m3fn
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w13_scale
      .template Arg<xla::ffi::AnyBuffer>()  // w2 (E, H, I) float8_e4m3fn
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w2_scale
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Ret<xla::ffi::AnyBuffer>()  // out (1, H), x's dtype
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // scratch: act (k, I)
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>();  // scratch: y (k, H)
}

// group_gemm_wgrad (ops.group_gemm_wgrad): the weight gradient of group_gemm
template <typename Bound>
auto GroupGemmWgradSignature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // dy (M, N)
      .template Arg<xla::ffi::AnyBuffer>()  // x (M, K), or (T, K) with a gather
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_sizes
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src of the gather, or empty
      .template Attr<bool>("gather")
      .template Attr<int64_t>("topk")
      .template Ret<xla::ffi::AnyBuffer>()  // dw (E, N, K)
      .template Ret<xla::ffi::AnyBuffer>();  // scratch (u8; the sm90 path's)
}

// group_gemm_fp8 (ops.group_gemm_fp8)
template <typename Bound>
auto GroupGemmFp8Signature(Bound bound) {
  return std::move(bound)
      .template Arg<xla::ffi::AnyBuffer>()  // x (M, K) f32 / bf16 / f16
      .template Arg<xla::ffi::AnyBuffer>()  // w (E, N, K) float8_e4m3fn
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w_scale (E, ceil(N/128), ceil(K/128))
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_sizes
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst_to_src of the gather, or empty
      .template Attr<bool>("gather")
      .template Attr<int64_t>("topk")
      .template Attr<int64_t>("tile_m")     // 8 decode form, 64 / 128 Hopper tiles, 0 the rule
      .template Attr<int64_t>("activation") // -1, or step 5 on x's rows first (Hopper only)
      .template Attr<bool>("gated")         // with an activation: x (M, 2K), act(gate) * up
      .template Ret<xla::ffi::AnyBuffer>()  // out (M, N), x's dtype
      .template Ret<xla::ffi::AnyBuffer>();  // scratch (u8; the sm90 path's)
}

}  // namespace jax_moe
