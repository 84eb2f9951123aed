"""Step 3, the row expansion: FFI target jax_moe_expand, and its transpose
(the sum of expanded rows back into their tokens) for the gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe.ops._common import inverse_map, sds
from jax_moe.ops.combine import _combine_call
from jax_moe._int32 import index_int32


def moe_expand_input(x, dst_to_src, topk: int):
    """Step 3: row i of the result is x[dst_to_src[i] // topk] (zero where
    dst_to_src[i] is -1). x (T, H) -> (len(dst_to_src), H). Differentiable
    in x (see gather_transpose)."""
    k = _checks.expand_args(x, dst_to_src, topk)
    return _expand(x, dst_to_src, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _expand(x, dst_to_src, k: int):
    """moe_expand_input on checked arguments."""
    return _expand_call(x, dst_to_src, k)


def _expand_fwd(x, dst_to_src, k):
    return _expand_call(x, dst_to_src, k), (dst_to_src, x.shape[0])


def _expand_bwd(k, res, g):
    dst_to_src, tokens = res
    return gather_transpose(g, dst_to_src, k, tokens), None


_expand.defvjp(_expand_fwd, _expand_bwd)


def _expand_call(x, dst_to_src, k: int):
    """The jax_moe_expand custom call."""
    call = jax.ffi.ffi_call(
        "jax_moe_expand", sds((dst_to_src.shape[0], x.shape[1]), x.dtype),
        vmap_method="sequential")
    return call(x, index_int32(dst_to_src), topk=np.int64(k))


def gather_transpose(g, dst_to_src, k: int, tokens: int, src_to_dst=None):
    """The transpose of the gather x -> x[dst_to_src // k]: out[t] = the sum
    of the rows g[r] whose dst_to_src[r] is one of token t's k slots, in
    slot order with f32 sums (the combine kernel with unit weights), in g's
    dtype. g (M, H) -> (tokens, H).

    src_to_dst: the inverse map when the caller has it (moe_compute_token_index
    returns both), else it is built here. A slot named by several rows (not
    something the token index produces) adds the extra rows with an XLA
    scatter-add, whose order among those duplicates is not fixed."""
    n = tokens * k
    if src_to_dst is not None:
        return _combine_call(g, jnp.ones((tokens, k), jnp.float32), src_to_dst)
    # One row per slot (the last that names it), summed per token by the
    # combine kernel; every other row naming a taken slot is added after.
    inverse, extra = inverse_map(dst_to_src, n)
    out = _combine_call(g, jnp.ones((tokens, k), jnp.float32), inverse)
    token = jnp.where(extra, index_int32(dst_to_src) // k, tokens)
    dup = jnp.zeros((tokens, g.shape[1]), jnp.float32).at[token].add(
        g.astype(jnp.float32), mode="drop")
    return (out.astype(jnp.float32) + dup).astype(g.dtype)
