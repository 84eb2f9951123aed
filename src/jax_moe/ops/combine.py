"""Step 7, the weighted combine: FFI target jax_moe_combine, and its backward,
jax_moe_combine_bwd (moe_combine's VJP)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _checks, reference
from jax_moe.ops._common import sds


def moe_combine(y, topk_weights, src_to_dst):
    """Step 7: out[t] = sum_j w[t, j] * y[src_to_dst[t*k + j]], accumulated in
    f32 in j order (bitwise reproducible); entries with src_to_dst outside
    [0, M) count as zero. y (M, H), topk_weights (T, k) -> (T, H) in y's dtype.
    Differentiable in y and topk_weights (jax_moe_combine_bwd)."""
    _checks.combine_args(y, topk_weights, src_to_dst)
    return _combine(y, topk_weights, src_to_dst)


def _combine_call(y, topk_weights, src_to_dst):
    tokens = topk_weights.shape[0]
    call = jax.ffi.ffi_call(
        "jax_moe_combine", sds((tokens, y.shape[1]), y.dtype), vmap_method="sequential")
    return call(y, topk_weights.astype(jnp.float32), src_to_dst.astype(jnp.int32))


@jax.custom_vjp
def _combine(y, topk_weights, src_to_dst):
    """moe_combine on checked arguments."""
    return _combine_call(y, topk_weights, src_to_dst)


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
                src_to_dst.astype(jnp.int32), dst_to_src.astype(jnp.int32))


def _inverse_map(src_to_dst, rows: int):
    """(dst_to_src (rows,): the slot that names each row, -1 where none does;
    whether some row is named by two slots), on the device. Where two slots
    name one row, dst_to_src holds one of them."""
    slots = jnp.arange(src_to_dst.shape[0], dtype=jnp.int32)
    valid = (src_to_dst >= 0) & (src_to_dst < rows)
    # `rows` is out of range and dropped; a negative index would wrap around.
    d2s = jnp.full((rows,), -1, jnp.int32).at[jnp.where(valid, src_to_dst, rows)].set(
        slots, mode="drop", unique_indices=True)
    # Every slot whose row does not name it back shares that row with another.
    named_back = d2s[jnp.clip(src_to_dst, 0, rows - 1)] == slots
    return d2s, jnp.any(valid & ~named_back)


def _reference_grads(g, y, topk_weights, src_to_dst):
    _, vjp = jax.vjp(lambda y_, w_: reference._combine(y_, w_, src_to_dst), y, topk_weights)
    return vjp(g)


def _combine_vjp_fwd(y, topk_weights, src_to_dst):
    return _combine_call(y, topk_weights, src_to_dst), (y, topk_weights, src_to_dst)


def _combine_vjp_bwd(res, g):
    y, topk_weights, src_to_dst = res
    s2d = src_to_dst.astype(jnp.int32)
    if y.shape[0] == 0:  # no rows: every slot counts as zero
        return jnp.zeros_like(y), jnp.zeros_like(topk_weights), None

    def kernel(g, y, w, s2d, d2s):
        dy, dw = _combine_bwd(g, y, w, s2d, d2s)
        return dy, dw.astype(w.dtype)

    def shared_rows(g, y, w, s2d, d2s):
        return _reference_grads(g, y, w, s2d)

    # Step 2's maps name each row at most once (the kernel's rule); a map
    # that names a row twice takes the reference's VJP, chosen on the device.
    d2s, shared = _inverse_map(s2d, y.shape[0])
    dy, dw = jax.lax.cond(shared, shared_rows, kernel, g.astype(y.dtype), y, topk_weights,
                          s2d, d2s)
    return dy, dw, None


_combine.defvjp(_combine_vjp_fwd, _combine_vjp_bwd)
