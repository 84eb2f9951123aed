"""Steps 1-7 in one call: FFI target jax_moe_moe_layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks, tuning
from jax_moe._ffi import INDEX_CHUNK
from jax_moe.ops._common import SCORING, bias_arg, sds
from jax_moe.ops.combine import _combine
from jax_moe.ops.expert_mlp import _expert_mlp_out, _mlp_tiles
from jax_moe.ops.route import _route
from jax_moe.ops.routed_experts import routed_experts
from jax_moe.ops.token_index import _token_index


def moe_layer(hidden_states, router_logits, w13, w2, topk: int, *, scoring_func: str = "softmax",
              renormalize: bool = True, num_expert_group: int | None = None,
              topk_group: int | None = None, e_score_correction_bias=None,
              routed_scaling_factor: float = 1.0, activation: str = "silu",
              is_gated: bool = True, tile_m: tuple | None = None):
    """Steps 1-7 in one call, with the same bits as the ops one by one:
    route, moe_compute_token_index, expert_mlp, moe_combine. hidden_states
    (T, H), router_logits (T, E), w13 (E, 2*I, H) (or (E, I, H) with
    is_gated=False), w2 (E, H, I) -> (T, H) in hidden_states' dtype. The
    routing keywords are route's, activation / is_gated / tile_m expert_mlp's.

    One call instead of four: on a compute capability 9.0+ GPU every kernel
    after the router starts while the one before it finishes (programmatic
    dependent launch, which under XLA's command buffers only works inside one
    custom call). A GEMM whose tile is the Hopper kernels' (256) runs in the
    call where the own Hopper kernel takes it (experts averaging at most
    tuning.WGMMA_MAX_AVG_ROWS rows; the w13 GEMM then with the gated
    activation in its epilogue, the same bits); where CUTLASS's would, the
    ops run as separate calls, as in expert_mlp."""
    spec = _checks.moe_layer_args(
        hidden_states, router_logits, w13, w2, topk, scoring_func=scoring_func,
        renormalize=renormalize, num_expert_group=num_expert_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor, activation_name=activation,
        is_gated=is_gated, tile=tile_m)
    return _moe_layer(hidden_states, router_logits, w13, w2, e_score_correction_bias, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _moe_layer(hidden_states, router_logits, w13, w2, e_score_correction_bias,
               spec: _checks.Layer):
    """moe_layer on checked arguments. Differentiable on the kernels: under
    jax.grad its forward runs the steps as separate calls (routed_layer),
    keeping what their backward passes need."""
    return _moe_layer_call(hidden_states, router_logits, w13, w2, e_score_correction_bias, spec)


def _moe_layer_fwd(hidden_states, router_logits, w13, w2, e_score_correction_bias, spec):
    return jax.vjp(functools.partial(routed_layer, spec=spec), hidden_states, router_logits,
                   w13, w2, e_score_correction_bias)


def _moe_layer_bwd(spec, vjp, g):
    return vjp(g)


_moe_layer.defvjp(_moe_layer_fwd, _moe_layer_bwd)


def routed_layer(hidden_states, router_logits, w13, w2, e_score_correction_bias,
                 spec: _checks.Layer, start_expert: int = 0, num_local_experts: int | None = None):
    """Steps 1-7 as differentiable calls (route, token index, then steps 3-7
    as routed_experts; each with its backward on the kernels); with an
    expert range, only the experts [start_expert, start_expert +
    num_local_experts) of w13 and w2 (which then hold only those) are
    computed and the other slots count zero. What the backward keeps: the
    router's weights and the token index, the w13 GEMM's output (T*k rows
    of 2I; not with spec.remat) and, where expert_mlp's forward keeps them
    (_keeps_rows), the expanded rows of the tokens (T*k rows of H)."""
    r = spec.routing
    experts = router_logits.shape[-1]
    local = experts if num_local_experts is None else num_local_experts
    weights, ids = _route(router_logits, e_score_correction_bias, r)
    src_to_dst, dst_to_src, sizes = _token_index(ids, experts, start_expert, local)
    return routed_experts(hidden_states, w13, w2, weights, sizes, dst_to_src, src_to_dst, r.topk,
                          spec.activation, spec.is_gated, tuple(spec.tile_m), spec.remat)


def _moe_layer_call(hidden_states, router_logits, w13, w2, e_score_correction_bias,
                    spec: _checks.Layer):
    """The forward alone: one jax_moe_moe_layer call where the tiles allow."""
    r = spec.routing
    k = r.topk
    x = hidden_states
    tokens, hidden = x.shape
    experts, n1, _ = w13.shape
    inter = w2.shape[2]
    m = tokens * k
    t1, t2 = _mlp_tiles(m, w13, w2, x.dtype, spec.tile_m)
    sm90 = tuning.SM90_TILE in (t1, t2)
    own = ((t1 != tuning.SM90_TILE or tuning.wgmma_runs(m, experts, n1, hidden, x.dtype))
           and (t2 != tuning.SM90_TILE or tuning.wgmma_runs(m, experts, hidden, inter, x.dtype)))
    if sm90 and not own:
        weights, ids = _route(router_logits, e_score_correction_bias, r)
        src_to_dst, dst_to_src, sizes = _token_index(ids, experts, 0, experts)
        y = _expert_mlp_out(x, w13, w2, sizes, dst_to_src, k, spec.activation, spec.is_gated,
                            (t1, t2))
        return _combine(y, weights, src_to_dst)
    has_bias, bias = bias_arg(e_score_correction_bias, experts)
    chunks = -(-m // INDEX_CHUNK)
    i32 = jnp.int32
    call = jax.ffi.ffi_call(
        "jax_moe_moe_layer",
        (sds((tokens, hidden), x.dtype),
         # scratch: the steps' outputs, as the separate ops return them
         sds((tokens, k), jnp.float32), sds((tokens, k), i32), sds((m,), i32),
         sds((m,), i32), sds((experts,), i32), sds((chunks * experts + 1,), i32),
         sds((m, hidden), x.dtype), sds((m, n1), x.dtype), sds((m, inter), x.dtype),
         # the own Hopper kernel's tile counters, where a GEMM runs it
         sds((2 if sm90 else 0,), i32)),
        vmap_method="sequential")
    outs = call(x, router_logits, bias, w13, w2, renormalize=r.renormalize,
                scoring=np.int64(SCORING[r.scoring_func]),
                num_expert_group=np.int64(r.num_expert_group), topk_group=np.int64(r.topk_group),
                has_bias=bool(has_bias), routed_scaling_factor=np.float32(r.routed_scaling_factor),
                activation=np.int64(_checks.ACTIVATIONS[spec.activation]),
                gated=spec.is_gated, tile_m1=np.int64(t1), tile_m2=np.int64(t2))
    return outs[0]
