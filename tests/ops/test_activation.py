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


# (..., 2I); (1000, 1040): many blocks of the GPU kernel, the last one partial
ACT_SHAPES = [(1, 2), (7, 14), (64, 26), (33, 260), (3, 5, 144), (1000, 1040)]


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


# ---- the backward (the jax_moe_activation_grad kernel)

# (..., 2I); 2I/2 odd too
GRAD_SHAPES = [(1, 2), (7, 14), (0, 16), (33, 260), (3, 5, 144), (1000, 1040)]


def _vjp(fn, h, g):
    return jax.vjp(fn, h)[1](g)[0]


def _op(name, gated):
    return (lambda v: ops.gated_activation(v, name)) if gated else (lambda v: ops.activation(v, name))


def _ref(name, gated):
    return lambda v: reference._activation(v, name, gated)


def _f64_grad(h, g, name, gated):
    """d/dh sum(g * act) of the float64 oracle by central differences: each
    output depends on one gate (and one up) entry, so one shift per half."""
    h, g = oracle.f64(h), oracle.f64(g)
    def f(v):
        return oracle.gated_activation(v, name) if gated else oracle.activation(v, name)
    eps = 1e-6
    out = np.zeros_like(h)
    halves = [slice(0, h.shape[-1] // 2), slice(h.shape[-1] // 2, None)] if gated else [slice(None)]
    for part in halves:
        shift = np.zeros_like(h)
        shift[..., part] = eps
        out[..., part] = (g * (f(h + shift) - f(h - shift)) / (2 * eps))[..., : h[..., part].shape[-1]]
    return out


@dtypes
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_activation_grad(rng, shape, activation, gated, dtype):
    h = normal(rng, shape, dtype, scale=2.0)
    out_shape = shape[:-1] + (shape[-1] // 2 if gated else shape[-1],)
    g = normal(rng, out_shape, dtype)
    got = _vjp(_op(activation, gated), h, g)
    assert got.shape == shape and got.dtype == dtype
    # The autodiff of the reference (XLA) and the kernel round the same f32
    # values to the dtype once; their f32 forms of act' differ by a few ulp.
    assert_close(got, _vjp(_ref(activation, gated), h, g), dtype, "vs reference autodiff",
                 atol=1e-6 * np.abs(oracle.f64(h)).max(initial=0) * np.abs(oracle.f64(g)).max(initial=0))
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(got, np.float64), _f64_grad(h, g, activation, gated),
                                   rtol=1e-4, atol=1e-4)


def test_activation_grad_jit_vmap(rng):
    h = normal(rng, (3, 9, 16), jnp.bfloat16)
    g = normal(rng, (3, 9, 8), jnp.bfloat16)
    fn = jax.jit(jax.vmap(lambda a, b: _vjp(_op("silu", True), a, b)))
    want = jnp.stack([_vjp(_op("silu", True), a, b) for a, b in zip(h, g)])
    assert_equal(fn(h, g), want)


def test_activation_grad_nonfinite_stays_in_its_element(rng):
    # A NaN or inf gate in one row reaches only that row's gradient.
    h = np.array(normal(rng, (4, 16), jnp.float32))
    h[1, 3] = np.nan
    h[2, 0] = np.inf
    g = normal(rng, (4, 8), jnp.float32)
    got = np.asarray(_vjp(_op("silu", True), jnp.asarray(h), g))
    assert np.all(np.isfinite(got[[0, 3]]))
    assert np.isnan(got[1, 3]) and np.all(np.isfinite(np.delete(got[1], [3, 11])))


@pytest.mark.sanitize
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_activation_grad_sanitize(rng, gated, dtype):
    # Small, with a width that is not a multiple of the 16-byte vector (the
    # scalar path) and one that is, and several blocks ending in a partial one.
    for rows, width in ((5, 26), (5, 32), (300, 1040)):
        h = normal(rng, (rows, width), dtype)
        g = normal(rng, (rows, width // 2 if gated else width), dtype)
        assert_close(_op("gelu", gated)(h), _ref("gelu", gated)(h), dtype, "forward", atol=1e-5)
        assert_close(_vjp(_op("gelu", gated), h, g), _vjp(_ref("gelu", gated), h, g), dtype,
                     "vs reference autodiff", atol=1e-5)


# ---- the routed layer's backward (the jax_moe_activation_scaled_grad kernel)

from jax_moe.ops.activation import activation_scaled_vjp  # noqa: E402

_scaled_twin = jax.jit(reference._activation_scaled_grad, static_argnums=(3, 4))


@dtypes
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 2), (7, 14), (0, 16), (33, 260), (40, 512)], ids=str)
def test_activation_scaled_grad(rng, shape, activation, gated, dtype):
    """Against the twin (autodiff of the reference for the cotangent scale *
    d) and, for dot and the scaled activation, float64 sums of the rounded
    forward activation; zero scales (unplaced rows) give zero dh and as."""
    h = normal(rng, shape, dtype, scale=2.0)
    inter = shape[-1] // 2 if gated else shape[-1]
    d = normal(rng, (shape[0], inter), dtype)
    scale = jnp.asarray(rng.random(shape[0]), jnp.float32)
    if shape[0] > 2:
        scale = scale.at[1].set(0.0)
    dh, scaled, dot = activation_scaled_vjp(h, d, scale, activation, gated)
    assert dh.shape == h.shape and dh.dtype == dtype
    assert scaled.shape == d.shape and scaled.dtype == dtype
    assert dot.shape == (shape[0],) and dot.dtype == jnp.float32
    want_dh, want_scaled, want_dot = _scaled_twin(h, d, scale, activation, gated)
    mag = np.abs(oracle.f64(h)).max(initial=0) * np.abs(oracle.f64(d)).max(initial=0)
    assert_close(dh, want_dh, dtype, "dh vs twin", atol=1e-6 * mag)
    # As in test_gated_activation: gelu's 1 + erf (or tanh) cancels for a
    # negative gate, so act * up is good to ~|gate * up| * 2^-24 in f32 however
    # small it is; allow 1e-6 of that per element (and in each term of dot).
    hf = oracle.f64(h)
    gu = np.abs(hf[:, :inter] * hf[:, inter:]) if gated else np.abs(hf)
    sc = oracle.f64(scale)[:, None]
    assert_close(scaled, want_scaled, dtype, "scale * act vs twin", atol=1e-6 * gu * sc)
    a = oracle.f64(reference._activation(h, activation, gated))
    df = oracle.f64(d)
    assert_close(dot, np.sum(a * df, axis=-1), jnp.float32, "dot vs float64",
                 rtol=1e-2 if dtype != jnp.float32 else 1e-4,
                 atol=1e-5 * np.sqrt(inter) * mag + 1e-6 * np.sum(gu * np.abs(df), axis=-1))
    assert_close(scaled, a * sc, dtype, "scale * act vs float64", atol=1e-6 * gu * sc)
    if shape[0] > 2:
        assert not np.any(np.asarray(dh[1], np.float32))
        assert not np.any(np.asarray(scaled[1], np.float32))


def test_activation_scaled_grad_same_bits_as_activation_grad(rng):
    """With unit scales, dh is the plain backward's on the same cotangent,
    bit for bit, and the scaled activation is the forward's."""
    h = normal(rng, (9, 64), jnp.bfloat16, scale=2.0)
    d = normal(rng, (9, 32), jnp.bfloat16)
    dh, scaled, _ = activation_scaled_vjp(h, d, jnp.ones((9,), jnp.float32), "silu", True)
    assert_equal(scaled, ops.gated_activation(h, "silu"))
    assert_equal(dh, _vjp(_op("silu", True), h, d))


@pytest.mark.sanitize
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_activation_scaled_grad_sanitize(rng, gated):
    for width in (26, 32):  # the scalar path and the 16-byte one
        h = normal(rng, (5, width), jnp.bfloat16)
        d = normal(rng, (5, width // 2 if gated else width), jnp.bfloat16)
        scale = jnp.asarray(rng.random(5), jnp.float32)
        got = activation_scaled_vjp(h, d, scale, "gelu", gated)
        want = _scaled_twin(h, d, scale, "gelu", gated)
        # All three to bf16's tolerance: dot sums the activation rounded to
        # bf16, where the twin's and the kernel's may differ by a rounding flip.
        for g, w in zip(got, want):
            assert_close(g, w, jnp.bfloat16, "vs twin", atol=1e-3)


def test_activation_scaled_grad_leaves_a_live_h_intact(rng):
    """dh may take h's buffer only where nothing reads h afterwards: a caller
    that still holds h, eagerly or in the same jitted program, sees it
    unchanged."""
    h = normal(rng, (6, 48), jnp.bfloat16, scale=2.0)
    d = normal(rng, (6, 24), jnp.bfloat16)
    scale = jnp.asarray(rng.random(6), jnp.float32)
    before = np.asarray(h, np.float32).copy()
    dh = activation_scaled_vjp(h, d, scale, "silu", True)[0]
    np.testing.assert_array_equal(np.asarray(h, np.float32), before)
    both = jax.jit(lambda h, d, s: (activation_scaled_vjp(h, d, s, "silu", True)[0], h * 1))
    dh2, h2 = both(h, d, scale)
    np.testing.assert_array_equal(np.asarray(h2, np.float32), before)
    assert_equal(dh2, dh)
