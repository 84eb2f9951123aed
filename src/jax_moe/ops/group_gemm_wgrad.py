"""The grouped GEMM's weight gradient: FFI target jax_moe_group_gemm_wgrad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks, tuning
from jax_moe._ffi import _ext
from jax_moe.ops._common import sds
from jax_moe._int32 import index_int32


def group_gemm_wgrad(dy, x, expert_sizes, *, dst_to_src=None, topk: int = 1):
    """The gradient of group_gemm (or group_gemm_gather) with respect to w:
    dw[e] = dy[rows of e].T @ x[rows of e], a GEMM whose reduction runs over
    each expert's rows. dy (M, N), x (M, K), expert_sizes (E,) -> dw (E, N, K)
    in dy's dtype, f32 accumulation in row order (the same bits every run).

    With dst_to_src (M,), x holds the tokens (T, K) and row r is
    x[dst_to_src[r] // topk], a zero row where dst_to_src[r] is outside
    [0, T * topk) (the rows of moe_expand_input). Rows are owned as in
    group_gemm: expert e the rows after the first e groups, negative sizes
    count 0, rows past sum(expert_sizes) are ignored. An expert without rows
    gets exactly zero."""
    k = _checks.group_gemm_wgrad_args(dy, x, expert_sizes, dst_to_src, topk)
    return _group_gemm_wgrad(dy, x, expert_sizes, dst_to_src, k)


def _group_gemm_wgrad(dy, x, expert_sizes, rows, topk: int):
    """group_gemm_wgrad on checked arguments; rows: dst_to_src or None."""
    m, n = dy.shape
    k = x.shape[1]
    experts = expert_sizes.shape[0]
    gather = rows is not None
    # The sm90 kernel's workspace lives in a second output (a fixed address in
    # a recorded CUDA graph, as group_gemm's); empty wherever it will not run.
    scratch = (_ext.group_gemm_wgrad_sm90_scratch_bytes(m, k, experts, gather)
               if m > 0 and n > 0 and experts > 0 and tuning.sm90_usable(n, k, dy.dtype) else 0)
    call = jax.ffi.ffi_call(
        "jax_moe_group_gemm_wgrad", (sds((experts, n, k), dy.dtype), sds((scratch,), jnp.uint8)),
        vmap_method="sequential")
    rows = index_int32(rows) if gather else jnp.zeros((0,), jnp.int32)
    dw, _ = call(dy, x, index_int32(expert_sizes), rows, gather=gather,
                 topk=np.int64(topk))
    return dw
