"""Step 3, the row expansion: FFI target jax_moe_expand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe.ops._common import sds


def moe_expand_input(x, dst_to_src, topk: int):
    """Step 3: row i of the result is x[dst_to_src[i] // topk] (zero where
    dst_to_src[i] is -1). x (T, H) -> (len(dst_to_src), H)."""
    k = _checks.expand_args(x, dst_to_src, topk)
    return _expand(x, dst_to_src, k)


def _expand(x, dst_to_src, k: int):
    """moe_expand_input on checked arguments."""
    call = jax.ffi.ffi_call(
        "jax_moe_expand", sds((dst_to_src.shape[0], x.shape[1]), x.dtype),
        vmap_method="sequential")
    return call(x, dst_to_src.astype(jnp.int32), topk=np.int64(k))
