"""jax_moe.ragged_dot: jax.lax.ragged_dot's signature and semantics, forward
and backward on jax_moe's grouped GEMM kernels, and a local group range
(group_offset) for expert parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _checks
from jax_moe.ops.group_gemm import _group_gemm_call, matmul_kn
from jax_moe.ops.group_gemm_wgrad import _group_gemm_wgrad
from jax_moe._int32 import index_int32, owned_rows

__all__ = ["ragged_dot"]


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None):
    """``jax.lax.ragged_dot`` on jax_moe's kernels: lhs (M, K), rhs (G, K, N),
    group_sizes (G,) int -> (M, N); rows [P_g, P_{g+1}) of lhs (P the prefix
    sum of group_sizes) are multiplied by rhs[g], with f32 accumulation.
    Rows past the last group are zero, as are negative sizes; sizes that sum
    past M are cut at M.

    Differentiable in lhs and rhs: d lhs by the grouped GEMM against rhs as
    stored, d rhs by the k-grouped GEMM (a group without rows gets exact
    zeros). lhs and rhs are promoted to one float dtype (float32, bfloat16 or
    float16) and the result is computed in it; preferred_element_type (None:
    that dtype) is the dtype it is returned in. precision is accepted for
    signature parity: the kernels always accumulate in f32.

    group_offset: None, or a (1,) int array o: group_sizes then holds the
    sizes of all groups, rhs only those of groups [o, o + rhs.shape[0]) (a
    device's local experts), and rows of other groups come out zero.
    """
    del precision  # f32 accumulation always
    dtype = jnp.result_type(lhs, rhs)
    lhs = jnp.asarray(lhs, dtype)
    rhs = jnp.asarray(rhs, dtype)
    _checks.rank(lhs, "lhs", 2)
    _checks.rank(rhs, "rhs", 3)
    _checks.float_dtype(lhs, "lhs")
    _checks.rank(group_sizes, "group_sizes", 1)
    _checks.int_dtype(group_sizes, "group_sizes")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs must be (G, K={lhs.shape[1]}, N) to match lhs, got {rhs.shape}")
    out_dtype = dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    groups = rhs.shape[0]
    sizes = index_int32(group_sizes)
    if group_offset is None:
        if sizes.shape[0] != groups:
            raise ValueError(f"group_sizes must have G={groups} entries (rhs's first dim), "
                             f"got {sizes.shape[0]}")
        return _ragged_dot(lhs, rhs, sizes).astype(out_dtype)
    if jnp.shape(group_offset) != (1,):
        raise ValueError(f"group_offset must have shape (1,), got {jnp.shape(group_offset)}")
    _checks.int_dtype(group_offset, "group_offset")
    if sizes.shape[0] < groups:
        raise ValueError(f"group_sizes must hold at least G={groups} entries (rhs's first dim) "
                         f"with a group_offset, got {sizes.shape[0]}")
    return _local_groups(lhs, rhs, sizes, index_int32(group_offset)[0]).astype(out_dtype)


def _local_groups(lhs, rhs, sizes, offset):
    """Groups [offset, offset + G) of all of sizes: their rows are rotated to
    the top, multiplied, and rotated back (the rotation is a row permutation,
    so its gradient is the opposite rotation)."""
    m = lhs.shape[0]
    # Each group's rows of m in order: the local groups get what is left
    # after the groups below them, and no more (past it the rotation would
    # wrap around to the first groups' rows, which must stay zero).
    owned = owned_rows(sizes, m)
    offset = jnp.clip(offset, 0, sizes.shape[0] - rhs.shape[0])
    shift = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, owned, 0))
    local = jax.lax.dynamic_slice(owned, (offset,), (rhs.shape[0],))
    out = _ragged_dot(jnp.roll(lhs, -shift, axis=0), rhs, local)
    # Rows past the local groups are zero, and at least `shift` of them
    # (local rows <= m - shift): rotated back, they fill the other groups' rows.
    return jnp.roll(out, shift, axis=0)


@jax.custom_vjp
def _ragged_dot(lhs, rhs, sizes):
    # rhs (G, K, N): the forward reads it in that layout (matmul_kn), both
    # gradients as the forward kernels' (G, N', K').
    return matmul_kn(lhs, rhs, sizes)


def _ragged_dot_fwd(lhs, rhs, sizes):
    return _ragged_dot(lhs, rhs, sizes), (lhs, rhs, sizes)


def _ragged_dot_bwd(res, g):
    lhs, rhs, sizes = res
    g = g.astype(lhs.dtype)
    d_lhs = _group_gemm_call(g, rhs, sizes, None, 1, None)
    d_rhs = _group_gemm_wgrad(lhs, g, sizes, None, 1)
    return d_lhs, d_rhs, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)
