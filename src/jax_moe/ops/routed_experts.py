"""Steps 3-7 under autodiff: expert_mlp and the weighted combine as one
differentiable function, whose backward needs no expert outputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_moe.ops.activation import activation_scaled_vjp
from jax_moe.ops.combine import _combine_call
from jax_moe.ops.expand import _expand_call
from jax_moe.ops.expert_mlp import _expert_mlp_fwd, _expert_mlp_out, recompute_h, w13_vjp
from jax_moe.ops.group_gemm import matmul_kn
from jax_moe.ops.group_gemm_wgrad import _group_gemm_wgrad
from jax_moe._int32 import index_int32


def routed_experts(x, w13, w2, topk_weights, expert_sizes, dst_to_src, src_to_dst, k: int,
                   activation: str, is_gated: bool, tiles=(None, None), remat: bool = False):
    """moe_combine(expert_mlp(x, w13, w2, expert_sizes, dst_to_src, k),
    topk_weights, src_to_dst) on checked arguments, with the same bits;
    src_to_dst and dst_to_src are step 2's maps (inverses of each other).
    Differentiable in x, w13, w2 and topk_weights, on the kernels.

    The backward pulls the output's gradient back through w2 unweighted
    (the rows of g, expanded) and applies each row's top-k weight in the
    activation's backward, which also returns the weight's gradient as the
    dot of the activation with that pull-back (equal to the dot of the
    expert output with g). So the forward keeps no expert outputs: only w13's
    output h (not with remat) and, where expert_mlp keeps them, the
    expanded rows of x."""
    return _routed_experts(x, w13, w2, topk_weights, expert_sizes, dst_to_src, src_to_dst, k,
                           activation, is_gated, tuple(tiles), bool(remat))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _routed_experts(x, w13, w2, topk_weights, expert_sizes, dst_to_src, src_to_dst, k,
                    activation, is_gated, tiles, remat):
    y = _expert_mlp_out(x, w13, w2, expert_sizes, dst_to_src, k, activation, is_gated, tiles)
    return _combine_call(y, topk_weights, src_to_dst)


def _routed_experts_fwd(x, w13, w2, topk_weights, expert_sizes, dst_to_src, src_to_dst, k,
                        activation, is_gated, tiles, remat):
    y, res = _expert_mlp_fwd(x, w13, w2, expert_sizes, dst_to_src, src_to_dst, k, activation,
                             is_gated, tiles, remat)
    return _combine_call(y, topk_weights, src_to_dst), (res, topk_weights)


def _routed_experts_bwd(k, activation, is_gated, tiles, remat, res, g):
    (x, xe, w13, w2, sizes, d2s, s2d, h), weights = res
    m = d2s.shape[0]
    if m == 0:  # no rows: nothing reaches the weights, and every slot counts zero
        return (jnp.zeros_like(x), jnp.zeros_like(w13), jnp.zeros_like(w2),
                jnp.zeros_like(weights), None, None, None)
    d2s, s2d = index_int32(d2s), index_int32(s2d)
    u = _expand_call(g.astype(x.dtype), d2s, k)  # row r: g of its token (zero where unplaced)
    if h is None:
        h = recompute_h(x, w13, sizes, d2s, k, tiles[0])
    scale = _gather_or_zero(weights.reshape(-1).astype(jnp.float32), d2s)
    dh, scaled_act, dot = activation_scaled_vjp(h, matmul_kn(u, w2, sizes), scale, activation,
                                                is_gated)
    dw2 = _group_gemm_wgrad(u, scaled_act, sizes, None, 1)
    dx, dw13 = w13_vjp(x, w13, sizes, d2s, s2d, k, dh, xe)
    dweights = _gather_or_zero(dot, s2d).reshape(weights.shape).astype(weights.dtype)
    return dx, dw13, dw2, dweights, None, None, None


_routed_experts.defvjp(_routed_experts_fwd, _routed_experts_bwd)


def _gather_or_zero(values, index):
    """values[index] where index is in [0, len(values)), else 0."""
    ok = (index >= 0) & (index < values.shape[0])
    return jnp.where(ok, values[jnp.where(ok, index, 0)], 0).astype(values.dtype)
