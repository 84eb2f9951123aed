"""Step 2, the token index: FFI target jax_moe_token_index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe._ffi import INDEX_CHUNK
from jax_moe.ops._common import sds
from jax_moe._int32 import index_int32


def moe_compute_token_index(topk_ids, num_experts: int, *, start_expert: int = 0,
                            num_local_experts: int | None = None):
    """Step 2: histogram, exclusive prefix sum, stable placement.

    topk_ids (T, k) int -> src_to_dst (T*k,), dst_to_src (T*k,), expert_sizes
    (num_local_experts,), all int32. Only ids in [start_expert, start_expert +
    num_local_experts) are placed (expert parallelism): the others get
    src_to_dst = -1, and dst_to_src is -1 past the last placed row. Within an
    expert, rows keep ascending flat index t*k + j.
    """
    num_experts, start, local = _checks.token_index_args(
        topk_ids, num_experts, start_expert, num_local_experts)
    return _token_index(topk_ids, num_experts, start, local)


def _token_index(topk_ids, num_experts: int, start: int, local: int):
    """moe_compute_token_index on checked arguments."""
    n = int(np.prod(topk_ids.shape))
    chunks = -(-n // INDEX_CHUNK)
    call = jax.ffi.ffi_call(
        "jax_moe_token_index",
        (sds((n,), jnp.int32), sds((n,), jnp.int32), sds((local,), jnp.int32),
         sds((chunks * local + 1,), jnp.int32)),  # scratch for the CUDA kernels
        vmap_method="sequential",
    )
    # Integer in, integer out: no gradient (stop_gradient keeps autodiff from
    # asking the custom call for a JVP when ids come out of a differentiated op).
    src_to_dst, dst_to_src, sizes, _ = call(
        index_int32(jax.lax.stop_gradient(topk_ids)), num_experts=np.int64(num_experts),
        start_expert=np.int64(start))
    return src_to_dst, dst_to_src, sizes
