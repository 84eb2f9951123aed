"""Step 7, the weighted combine: FFI target jax_moe_combine, and its backward,
jax_moe_combine_bwd (moe_combine's VJP)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _checks
from jax_moe.ops._common import inverse_map, sds
from jax_moe._int32 import index_int32


def moe_combine(y, topk_weights, src_to_dst):
    """Step 7: out[t] = sum_j w[t, j] * y[src_to_dst[t*k + j]], accumulated in
    f32 in j order (bitwise reproducible); entries with src_to_dst outside
    [0, M) count as zero. y (M, H), topk_weights (T, k) -> (T, H) in y's dtype.
    Differentiable in y and topk_weights (jax_moe_combine_bwd)."""
    _checks.combine_args(y, topk_weights, src_to_dst)
    return _combine(y, topk_weights, src_to_dst)


def _combine_call(y, topk_weights, src_to_dst):
    """The jax_moe_combine custom call."""
    tokens = topk_weights.shape[0]
    call = jax.ffi.ffi_call(
        "jax_moe_combine", sds((tokens, y.shape[1]), y.dtype), vmap_method="sequential")
    return call(y, topk_weights.astype(jnp.float32), index_int32(src_to_dst))


def _combine(y, topk_weights, src_to_dst, dst_to_src=None):
    """moe_combine on checked arguments; differentiable in y and
    topk_weights. dst_to_src: src_to_dst's inverse when the caller has it
    (step 2 returns both), which spares the backward building it."""
    return _combine_diff(y, topk_weights, src_to_dst, dst_to_src)


@jax.custom_vjp
def _combine_diff(y, topk_weights, src_to_dst, dst_to_src):
    """_combine; dst_to_src names each row once, or is None."""
    return _combine_call(y, topk_weights, src_to_dst)


def _combine_vjp_fwd(y, topk_weights, src_to_dst, dst_to_src):
    out = _combine_call(y, topk_weights, src_to_dst)
    return out, (y, topk_weights, src_to_dst, dst_to_src)


def _combine_vjp_bwd(res, g):
    y, w, s2d, d2s = res
    rows = y.shape[0]
    if rows == 0:  # no rows: every slot counts as zero
        return jnp.zeros_like(y), jnp.zeros_like(w), None, None
    if d2s is not None:
        dy, dw = _combine_bwd(g, y, w, s2d, d2s)
        return dy, dw.astype(w.dtype), None, None
    # Without step 2's map: the last slot that names a row is its kernel
    # slot (max is order-free), and a slot sharing its row with another
    # (which step 2 never makes) is added after with an XLA scatter-add.
    # No jax.lax.cond: on the GPU its predicate would be copied to the host.
    s2d = index_int32(s2d)
    inverse, shared = inverse_map(s2d, rows)
    dy, dw = _combine_bwd(g, y, w, s2d, inverse)
    k = w.shape[1]
    extra = w.reshape(-1, 1).astype(jnp.float32) * jnp.repeat(g.astype(jnp.float32), k, axis=0)
    fix = jnp.zeros(y.shape, jnp.float32).at[jnp.where(shared, s2d, rows)].add(
        extra, mode="drop")
    return (dy.astype(jnp.float32) + fix).astype(y.dtype), dw.astype(w.dtype), None, None


_combine_diff.defvjp(_combine_vjp_fwd, _combine_vjp_bwd)


def _combine_bwd(g, y, topk_weights, src_to_dst, dst_to_src):
    """The combine's backward on checked arguments, for the output cotangent
    g (T, H) and dst_to_src (M,), the inverse of src_to_dst (step 2's):
      dy[r]    = w[i] * g[i // k] for i = dst_to_src[r] when 0 <= i < T*k and
                 src_to_dst[i] == r, else a zero row (y's dtype, rounded once);
      dw[t, j] = sum_h y[r, h] * g[t, h] in f32, r = src_to_dst[t*k + j], 0
                 where r is outside [0, M).
    A row that two slots name gets only the gradient of the slot that
    dst_to_src names. -> (dy (M, H) in y's dtype, dw (T, k) float32)."""
    call = jax.ffi.ffi_call(
        "jax_moe_combine_bwd",
        (sds(y.shape, y.dtype), sds(topk_weights.shape, jnp.float32)),
        vmap_method="sequential")
    return call(g.astype(y.dtype), y, topk_weights.astype(jnp.float32),
                index_int32(src_to_dst), index_int32(dst_to_src))
