"""Step 7, the weighted combine: FFI target jax_moe_combine."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _checks
from jax_moe.ops._common import sds


def moe_combine(y, topk_weights, src_to_dst):
    """Step 7: out[t] = sum_j w[t, j] * y[src_to_dst[t*k + j]], accumulated in
    f32 in j order (bitwise reproducible); entries with src_to_dst = -1 count
    as zero. y (M, H), topk_weights (T, k) -> (T, H) in y's dtype."""
    _checks.combine_args(y, topk_weights, src_to_dst)
    return _combine(y, topk_weights, src_to_dst)


def _combine(y, topk_weights, src_to_dst):
    """moe_combine on checked arguments."""
    tokens = topk_weights.shape[0]
    call = jax.ffi.ffi_call(
        "jax_moe_combine", sds((tokens, y.shape[1]), y.dtype), vmap_method="sequential")
    return call(y, topk_weights.astype(jnp.float32), src_to_dst.astype(jnp.int32))
