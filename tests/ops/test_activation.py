"""Step 5, the activation: ops.gated_activation (and its aliases) and the
plain ops.activation against their twins in jax_moe.reference and against the
numpy oracle. The contract on both backends at the edges is in
test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, ref
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


ACT_SHAPES = [(1, 2), (7, 14), (64, 26), (33, 260), (3, 5, 144)]  # (..., 2I)


@dtypes
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
def test_gated_activation(rng, shape, activation, dtype):
    h = normal(rng, shape, dtype, scale=2.0)
    got = ops.gated_activation(h, activation)
    assert got.shape == shape[:-1] + (shape[-1] // 2,) and got.dtype == dtype
    # gelu's 1 + erf(g/sqrt2) (or 1 + tanh(...)) cancels for negative g: in f32
    # it carries an absolute error of a few 2^-24, so act(g) * u is only good
    # to ~|g * u| * 2^-24 however small the result. Allow 1e-6 * |g * u| on top.
    gu = np.abs(oracle.f64(h[..., : shape[-1] // 2]) * oracle.f64(h[..., shape[-1] // 2:]))
    assert_close(got, ref.gated_activation(h, activation), dtype, "vs reference", atol=1e-6 * gu)
    assert_close(got, oracle.gated_activation(h, activation), dtype, "vs numpy oracle", atol=1e-6 * gu)


def test_activation_aliases(rng):
    h = normal(rng, (9, 40), jnp.float32)
    assert_equal(ops.silu_and_mul(h), ops.gated_activation(h, "silu"))
    assert_equal(ops.gelu_and_mul(h), ops.gated_activation(h, "gelu"))
    assert_equal(ops.gelu_and_mul(h, approximate=True), ops.gated_activation(h, "gelu_tanh"))
    # The three activations really differ (the code is passed through).
    assert not np.array_equal(np.asarray(ops.silu_and_mul(h)), np.asarray(ops.gelu_and_mul(h)))
    assert not np.array_equal(np.asarray(ops.gelu_and_mul(h)),
                              np.asarray(ops.gelu_and_mul(h, approximate=True)))


# ---- the plain (not gated) activation

# rtol and atol of the plain activation against the reference, per dtype (twice
# that against the float64 oracle).
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh"])
def test_plain_activation_op(rng, name, dtype):
    h = normal(rng, (37, 75), dtype, 2.0)
    got, want = ops.activation(h, name), reference.activation(h, name)
    assert got.shape == (37, 75) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOL[jnp.dtype(dtype)], atol=TOL[jnp.dtype(dtype)])
    ref64 = oracle.activation(oracle.f64(h), name)
    np.testing.assert_allclose(np.asarray(got, np.float64), ref64,
                               rtol=2 * TOL[jnp.dtype(dtype)], atol=2 * TOL[jnp.dtype(dtype)])


def test_plain_activation_vmap(rng):
    h = normal(rng, (3, 9, 16), jnp.float32)
    got = jax.vmap(lambda a: ops.activation(a, "gelu"))(h)
    want = jnp.stack([ops.activation(a, "gelu") for a in h])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
