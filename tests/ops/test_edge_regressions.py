"""Edge cases the property suite (tests/property/) found, kept as plain
tests: ragged_dot's local groups when the sizes sum past M, and the
reference's gather with no tokens at all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from common import assert_close, assert_equal, normal
from jax_moe import reference


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("offset,sizes", [(1, [2, 3, 4, 1]), (0, [5, 9, 1, 0]),
                                          (2, [1, 1, 9, 3]), (1, [0, 7, 7, 7])])
def test_ragged_dot_group_offset_sizes_past_m(rng, offset, sizes, jit):
    """Sizes summing past M = 6: the local groups end at row M; the rows of
    the groups before the offset stay zero (they used to receive the local
    groups' rows that wrapped around)."""
    m, k, n, local = 6, 4, 3, 2
    lhs = normal(rng, (m, k), jnp.float32)
    rhs = normal(rng, (len(sizes), k, n), jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)
    fn = jax.jit(jax_moe.ragged_dot) if jit else jax_moe.ragged_dot
    got = fn(lhs, rhs[offset:offset + local], s, group_offset=jnp.asarray([offset]))
    # numpy: row r belongs to group g when it lies in [P_g, P_{g+1}) cut at M
    bounds = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), m)
    want = np.zeros((m, n))
    for g in range(offset, offset + local):
        a, b = bounds[g], bounds[g + 1]
        want[a:b] = np.asarray(lhs, np.float64)[a:b] @ np.asarray(rhs[g], np.float64)
    assert_close(got, want, jnp.float32, "ragged_dot with group_offset")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_reference_gather_without_tokens(jit):
    """T = 0 with entries in dst_to_src (all out of range then): zero rows, as
    the kernels give (the reference used to fail to gather from no rows)."""
    x = jnp.zeros((0, 4), jnp.float32)
    d2s = jnp.asarray([-1, 0, 3], jnp.int32)
    w = jnp.ones((2, 3, 4), jnp.float32)
    sizes = jnp.asarray([2, 1], jnp.int32)
    expand = jax.jit(reference.moe_expand_input, static_argnames="topk") if jit else \
        reference.moe_expand_input
    gather = jax.jit(reference.group_gemm_gather, static_argnames="topk") if jit else \
        reference.group_gemm_gather
    assert_equal(expand(x, d2s, topk=2), jnp.zeros((3, 4), jnp.float32), "expand")
    assert_equal(gather(x, w, sizes, d2s, topk=2), jnp.zeros((3, 3), jnp.float32), "gather")
    assert_equal(jax_moe.ops.moe_expand_input(x, d2s, 2), jnp.zeros((3, 4), jnp.float32),
                 "ffi expand")
