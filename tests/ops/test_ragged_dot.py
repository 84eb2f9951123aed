"""jax_moe.ragged_dot against jax.lax.ragged_dot: values and gradients,
dtypes, empty groups, a local group range (group_offset), errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from common import (DTYPE_IDS, FLOAT_DTYPES, assert_equal, lax_ragged, normal, rel_err,
                    split_rows, value_and_grads)

TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 4e-3}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pattern", ["random", "partial", "empty_first_middle_last", "none"])
@pytest.mark.parametrize("shape", [(90, 40, 24, 6), (1, 8, 16, 1), (200, 72, 136, 3)], ids=str)
def test_matches_lax_ragged_dot(rng, shape, pattern, dtype):
    m, k, n, g = shape
    lhs = normal(rng, (m, k), dtype)
    rhs = normal(rng, (g, k, n), dtype, k**-0.5)
    sizes = jnp.asarray(split_rows(rng, m, g, pattern))
    ct = normal(rng, (m, n), dtype)
    got = value_and_grads(jax_moe.ragged_dot, lhs, rhs, sizes, ct)
    want = value_and_grads(lax_ragged, lhs, rhs, sizes, ct)
    for what, a, w in zip(("out", "d lhs", "d rhs"), got, want):
        assert a.shape == w.shape and a.dtype == dtype, what
        err = rel_err(a, w)
        assert err < TOL[jnp.dtype(dtype)], f"{what}: relative error {err:.3g}"
    for e in np.flatnonzero(np.asarray(sizes) == 0):
        assert_equal(got[2][e], jnp.zeros_like(got[2][e]), f"d rhs of empty group {e}")


def test_preferred_element_type_and_promotion(rng):
    lhs = normal(rng, (20, 16), jnp.bfloat16)
    rhs = normal(rng, (3, 16, 8), jnp.float32)
    sizes = jnp.asarray([5, 10, 5], jnp.int32)
    out = jax_moe.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32  # computed in the promoted dtype, f32 here
    want = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs, sizes)
    assert rel_err(out, want) < 1e-5
    assert jax_moe.ragged_dot(lhs, rhs.astype(jnp.bfloat16), sizes).dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("offset,local", [(0, 2), (2, 3), (4, 2), (0, 6)])
def test_group_offset(rng, offset, local, dtype):
    """Groups [offset, offset + local) of the six: their rows as with all
    groups, every other row zero; gradients likewise."""
    m, k, n, g = 120, 24, 40, 6
    lhs = normal(rng, (m, k), dtype)
    rhs = normal(rng, (g, k, n), dtype, k**-0.5)
    sizes = jnp.asarray(split_rows(rng, m, g, "partial"))
    start = int(np.sum(np.asarray(sizes)[:offset]))
    end = int(np.sum(np.asarray(sizes)[:offset + local]))
    mine = (np.arange(m) >= start) & (np.arange(m) < end)
    ct = normal(rng, (m, n), dtype)
    o = jnp.asarray([offset], jnp.int32)

    def local_fn(a, b, s):
        return jax_moe.ragged_dot(a, b[offset:offset + local], s, group_offset=o)

    def masked(a, b, s):
        return jnp.where(mine[:, None], lax_ragged(a, b, s), 0).astype(dtype)

    got = value_and_grads(local_fn, lhs, rhs, sizes, ct)
    want = value_and_grads(masked, lhs, rhs, sizes, ct)
    for what, a, w in zip(("out", "d lhs", "d rhs"), got, want):
        err = rel_err(a, w)
        assert err < TOL[jnp.dtype(dtype)], f"{what}: relative error {err:.3g}"
    assert_equal(got[0][~mine], jnp.zeros_like(got[0][~mine]), "rows of other groups")


def test_runs_on_the_kernels(rng):
    lhs = normal(rng, (64, 32), jnp.float32)
    rhs = normal(rng, (4, 32, 16), jnp.float32)
    sizes = jnp.asarray([16, 16, 16, 16], jnp.int32)
    ct = normal(rng, (64, 16), jnp.float32)
    text = value_and_grads.lower(jax_moe.ragged_dot, lhs, rhs, sizes, ct).as_text()
    assert "jax_moe_group_gemm_wgrad" in text and "jax_moe_group_gemm" in text
    assert "ragged_dot" not in text.replace("jax_moe.ragged_dot", "")
    assert "dot_general" not in text


def test_errors_name_the_argument(rng):
    lhs = normal(rng, (8, 4), jnp.float32)
    rhs = normal(rng, (2, 4, 3), jnp.float32)
    sizes = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="rhs"):
        jax_moe.ragged_dot(lhs, rhs[:, :3], sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        jax_moe.ragged_dot(lhs, rhs, jnp.asarray([8], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes"):
        jax_moe.ragged_dot(lhs, rhs, jnp.asarray([4.0, 4.0]))
    with pytest.raises(ValueError, match="lhs"):
        jax_moe.ragged_dot(lhs[0], rhs, sizes)
    with pytest.raises(ValueError, match="group_offset"):
        jax_moe.ragged_dot(lhs, rhs, sizes, group_offset=jnp.asarray([0, 1]))
    with pytest.raises(TypeError, match="lhs"):
        jax_moe.ragged_dot(lhs.astype(jnp.int32), rhs.astype(jnp.int32), sizes)
