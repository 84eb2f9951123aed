"""Step 1, the router: FFI target jax_moe_route."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks, reference
from jax_moe.ops._common import SCORING, bias_arg, sds


def route(router_logits, topk: int, *, scoring_func: str = "softmax", renormalize: bool = True,
          num_expert_group: int | None = None, topk_group: int | None = None,
          e_score_correction_bias=None, routed_scaling_factor: float = 1.0):
    """Step 1, general form (Qwen2/3-MoE, Mixtral, DeepSeek-V3 routing); the
    semantics of ``reference.route``, in one FFI call.

    router_logits (T, E) float -> (weights (T, k) float32, ids (T, k) int32).
    A NaN logit counts as -inf; a NaN choice value (a NaN correction bias)
    ranks below -inf, so that expert is never preferred; ties go to the
    lower expert id. The same rule on every backend.
    """
    routing = _checks.route_args(
        router_logits, topk, scoring_func=scoring_func, renormalize=renormalize,
        num_expert_group=num_expert_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)
    return _route(router_logits, e_score_correction_bias, routing)


def topk_softmax(router_logits, topk: int, renormalize: bool = True):
    """Step 1 with softmax scoring: route(router_logits, topk, renormalize=renormalize).

    router_logits (T, E) float -> (weights (T, k) float32, ids (T, k) int32).
    A NaN logit counts as -inf; a NaN choice value (a NaN correction bias)
    ranks below -inf, so that expert is never preferred; ties go to the
    lower expert id. The same rule on every backend.
    """
    routing = _checks.route_args(router_logits, topk, renormalize=renormalize)
    return _route(router_logits, None, routing)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _route(router_logits, e_score_correction_bias, r: _checks.Routing):
    """route on checked arguments; differentiable in router_logits (the
    weights' gradient, for the experts the kernel chose)."""
    return _route_call(router_logits, e_score_correction_bias, r)


def _route_fwd(router_logits, e_score_correction_bias, r):
    weights, ids = _route_call(router_logits, e_score_correction_bias, r)
    return (weights, ids), (router_logits, e_score_correction_bias, ids)


def _route_bwd(r, res, cotangents):
    """The weights are the chosen experts' scores (renormalised, scaled): a
    small elementwise function of the (T, E) logits, left to XLA. The choice
    is piecewise constant, so the ids and the correction bias get none."""
    logits, bias, ids = res
    d_weights = cotangents[0]
    _, vjp = jax.vjp(lambda lg: reference._route_weights(lg, ids, r), logits)
    (d_logits,) = vjp(d_weights.astype(jnp.float32))
    return d_logits.astype(logits.dtype), None if bias is None else jnp.zeros_like(bias)


_route.defvjp(_route_fwd, _route_bwd)


def _route_call(router_logits, e_score_correction_bias, r: _checks.Routing):
    """The jax_moe_route custom call."""
    tokens, experts = router_logits.shape
    has_bias, bias = bias_arg(e_score_correction_bias, experts)
    # broadcast_all hands the kernel logits (..., T, E) and bias (..., E) with
    # the same batch dims (an unbatched bias is broadcast): one bias row per
    # batch element.
    call = jax.ffi.ffi_call(
        "jax_moe_route",
        (sds((tokens, r.topk), jnp.float32), sds((tokens, r.topk), jnp.int32)),
        vmap_method="broadcast_all",
    )
    return call(router_logits, bias, renormalize=r.renormalize,
                scoring=np.int64(SCORING[r.scoring_func]),
                num_expert_group=np.int64(r.num_expert_group), topk_group=np.int64(r.topk_group),
                has_bias=bool(has_bias), routed_scaling_factor=np.float32(r.routed_scaling_factor))
