"""Property tests of jax_moe.ragged_dot against jax.lax.ragged_dot: values
and gradients, group sizes summing to M, less or more, and a local group
range (group_offset)."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import jax_moe
from common import assert_equal, lax_ragged, normal, rel_err, value_and_grads
from property_common import MARKS, NORM_TOL, SPLITS, dtypes, seeds, sizes, split_sizes

pytestmark = MARKS


def _check(got, want, dtype):
    for what, a, w in zip(("out", "d lhs", "d rhs"), got, want):
        assert a.shape == w.shape and a.dtype == jnp.dtype(dtype), what
        err = rel_err(a, w)
        assert err <= NORM_TOL[jnp.dtype(dtype)], f"{what}: relative error {err:.3g}"


@given(seed=seeds, m=sizes(120), k=sizes(60, 1), n=sizes(60, 1), groups=st.integers(1, 6),
       split=st.sampled_from(SPLITS), dtype=dtypes)
def test_matches_lax(seed, m, k, n, groups, split, dtype):
    rng = np.random.default_rng(seed)
    lhs, rhs = normal(rng, (m, k), dtype), normal(rng, (groups, k, n), dtype, k**-0.5)
    s = jnp.asarray(split_sizes(rng, m, groups, split))
    ct = normal(rng, (m, n), dtype)
    got = value_and_grads(jax_moe.ragged_dot, lhs, rhs, s, ct)
    _check(got, value_and_grads(lax_ragged, lhs, rhs, s, ct), dtype)
    for e in np.flatnonzero(np.asarray(s) == 0):
        assert_equal(got[2][e], jnp.zeros_like(got[2][e]), f"d rhs of empty group {e}")


@given(seed=seeds, m=sizes(120), k=sizes(40, 1), n=sizes(40, 1), groups=st.integers(1, 6),
       split=st.sampled_from(SPLITS), data=st.data(), dtype=dtypes)
def test_group_offset(seed, m, k, n, groups, split, data, dtype):
    """Groups [o, o + L) of all: their rows as with every group, the other
    rows zero; gradients likewise (those of the other groups' weights are
    not taken)."""
    o = data.draw(st.integers(0, groups - 1))
    local = data.draw(st.integers(1, groups - o))
    rng = np.random.default_rng(seed)
    lhs, rhs = normal(rng, (m, k), dtype), normal(rng, (groups, k, n), dtype, k**-0.5)
    sizes_np = split_sizes(rng, m, groups, split)
    bounds = np.minimum(np.concatenate([[0], np.cumsum(sizes_np)]), m)
    mine = (np.arange(m) >= bounds[o]) & (np.arange(m) < bounds[o + local])
    s = jnp.asarray(sizes_np)
    ct = normal(rng, (m, n), dtype)
    offset = jnp.asarray([o], jnp.int32)

    def local_fn(a, b, s):
        return jax_moe.ragged_dot(a, b[o:o + local], s, group_offset=offset)

    def masked(a, b, s):
        return jnp.where(mine[:, None], lax_ragged(a, b, s), 0).astype(dtype)

    # the other groups' weights get exactly zero gradients: masked's rows are zero there
    _check(value_and_grads(local_fn, lhs, rhs, s, ct), value_and_grads(masked, lhs, rhs, s, ct),
           dtype)
