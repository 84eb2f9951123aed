// The route target (ops.route, ops.topk_softmax): step 1, the router, on the
// CPU (kernels/cpu/route.h) and the GPU (kernels/cuda/route.h).
#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/common/routing.h"
#include "kernels/cpu/route.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/route.h"
#endif

namespace jax_moe {
namespace {

RouteOptions OptionsOf(const RouteDims& d, bool renormalize, int64_t scoring,
                       int64_t num_expert_group, int64_t topk_group, bool has_bias,
                       float routed_scaling_factor) {
  return RouteOptions{d.experts, d.k, d.tokens, num_expert_group, topk_group,
                      scoring == 0, has_bias, renormalize, routed_scaling_factor};
}

}  // namespace

ffi::Error RouteCpu(ffi::AnyBuffer logits, F32In bias, bool renormalize, int64_t scoring,
                    int64_t num_expert_group, int64_t topk_group, bool has_bias,
                    float routed_scaling_factor, F32Out weights, S32Out ids) {
  RouteDims d;
  if (auto err =
          CheckRoute(logits, bias, scoring, num_expert_group, topk_group, *weights, *ids, &d);
      err.failure())
    return err;
  RouteRows(ToDType(logits.element_type()), logits.untyped_data(), bias.typed_data(), d.rows,
            OptionsOf(d, renormalize, scoring, num_expert_group, topk_group, has_bias,
                      routed_scaling_factor),
            weights->typed_data(), ids->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kRouteCpu, RouteCpu, RouteSignature(ffi::Ffi::Bind()));

#ifdef JAX_MOE_WITH_CUDA
ffi::Error RouteCuda(cudaStream_t stream, ffi::AnyBuffer logits, F32In bias, bool renormalize,
                     int64_t scoring, int64_t num_expert_group, int64_t topk_group,
                     bool has_bias, float routed_scaling_factor, F32Out weights, S32Out ids) {
  RouteDims d;
  if (auto err =
          CheckRoute(logits, bias, scoring, num_expert_group, topk_group, *weights, *ids, &d);
      err.failure())
    return err;
  if (d.experts > kRouteMaxExpertsCuda) return InvalidArg("route: at most 3072 experts on CUDA");
  return CudaError(LaunchRoute(stream, ToDType(logits.element_type()), logits.untyped_data(),
                               bias.typed_data(), d.rows,
                               OptionsOf(d, renormalize, scoring, num_expert_group, topk_group,
                                         has_bias, routed_scaling_factor),
                               weights->typed_data(), ids->typed_data()),
                   "route launch");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kRouteCuda, RouteCuda,
    RouteSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
