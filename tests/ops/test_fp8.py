"""Block-scaled fp8 (jax_moe.fp8) and the fp8 grouped GEMM, its reference twin
(reference.group_gemm_fp8) and its kernels (ops.group_gemm_fp8), against
NumPy with ml_dtypes' e4m3: 128 x 128 weight blocks and 1 x 128 activation
groups, partial blocks, zero and huge blocks, NaN, empty experts, one row,
bad scales."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from common import normal, rel_err
from jax_moe import fp8, ops, reference

E4M3 = ml_dtypes.float8_e4m3fn


def np_quantize(a, block_rows, block_cols):
    """NumPy oracle: a (R, C) f64 -> (e4m3 values, f64 scales) with
    (block_rows x block_cols) blocks; scale = block amax * f32(1/448), 1 for
    zero; values = the block times f32(1 / scale), clipped to +-448."""
    r, c = a.shape
    sr, sc = -(-r // block_rows), -(-c // block_cols)
    scales = np.ones((sr, sc))
    values = np.zeros((r, c), E4M3)
    for i in range(sr):
        for j in range(sc):
            blk = a[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols]
            amax = np.max(np.abs(blk))
            s = np.float32(amax) * np.float32(1 / 448) if amax > 0 else np.float32(1)
            scales[i, j] = s
            q = blk.astype(np.float32) * (np.float32(1) / np.float32(s))
            q = np.clip(q, -448, 448).astype(E4M3)
            values[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols] = q
    return values, scales


@pytest.mark.parametrize("n,k", [(128, 128), (200, 300), (1, 5), (256, 129)])
def test_quantize_blocks_matches_numpy(rng, n, k):
    w = normal(rng, (2, n, k), jnp.float32, 3.0)
    values, scales = jax.jit(fp8.quantize_blocks)(w)
    assert values.dtype == fp8.FP8 and values.shape == w.shape
    assert scales.dtype == jnp.float32 and scales.shape == (2, -(-n // 128), -(-k // 128))
    for e in range(2):
        want_v, want_s = np_quantize(np.asarray(w[e], np.float64), 128, 128)
        np.testing.assert_array_equal(np.asarray(scales[e]), want_s.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(values[e]).view(np.uint8), want_v.view(np.uint8))


def test_block_extremes_and_round_trip(rng):
    """Each block's largest magnitude maps to 448; the round trip is within
    half an e4m3 step (3 mantissa bits) of each value, or of the block's
    smallest subnormal step."""
    w = normal(rng, (1, 256, 384), jnp.float32)
    w = w.at[0, :128, :128].multiply(1e30).at[0, 128:, 128:256].multiply(1e-30)
    values, scales = fp8.quantize_blocks(w)
    v = np.abs(np.asarray(values, np.float32)).reshape(2, 128, 3, 128)
    np.testing.assert_array_equal(v.max(axis=(1, 3)), np.full((2, 3), 448.0, np.float32))
    back = np.asarray(fp8.dequantize_blocks(values, scales), np.float64)
    full = np.repeat(np.repeat(np.asarray(scales[0], np.float64), 128, 0), 128, 1)
    bound = np.abs(np.asarray(w[0], np.float64)) * 2.0**-4 + full * 2.0**-10
    assert np.all(np.abs(back[0] - np.asarray(w[0], np.float64)) <= bound)
    assert np.all(np.isfinite(back))


def test_zero_block_and_nan_block_stay_apart(rng):
    w = normal(rng, (1, 256, 256), jnp.float32)
    w = w.at[0, :128, :128].set(0.0).at[0, 130, 140].set(jnp.nan).at[0, 5, 200].set(jnp.inf)
    values, scales = fp8.quantize_blocks(w)
    assert float(scales[0, 0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(values[0, :128, :128], np.float32), 0.0)
    v = np.asarray(values[0], np.float32)
    assert np.all(np.isnan(v[128:, 128:])) and np.isnan(float(scales[0, 1, 1]))
    assert np.all(np.isnan(v[:128, 128:])) and np.isnan(float(scales[0, 0, 1]))  # the inf
    assert np.all(np.isfinite(v[128:, :128]))  # the other block never sees either


@pytest.mark.parametrize("k", [128, 300, 7])
def test_quantize_rows_matches_numpy(rng, k):
    x = normal(rng, (9, k), jnp.bfloat16, 5.0)
    values, scales = jax.jit(fp8.quantize_rows)(x)
    want_v, want_s = np_quantize(np.asarray(x, np.float64), 1, 128)
    np.testing.assert_array_equal(np.asarray(scales), want_s.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), want_v.view(np.uint8))
    back = fp8.dequantize_rows(values, scales, jnp.float32)
    assert back.shape == x.shape


def np_group_gemm_fp8(x, w, w_scale, sizes):
    """The recipe spelled out: per expert, per row, per 128-wide K block,
    sum(xq * wq) * x_scale * w_scale, in f64."""
    m, k = x.shape
    e_count, n, _ = w.shape
    xq, xs = np_quantize(np.asarray(x, np.float64), 1, 128)
    xq = xq.astype(np.float64)
    wq = np.asarray(w, np.float32).astype(np.float64)
    ws = np.asarray(w_scale, np.float64)
    out = np.zeros((m, n))
    start = 0
    for e in range(e_count):
        rows = range(min(start, m), min(start + max(int(sizes[e]), 0), m))
        start += max(int(sizes[e]), 0)
        for r in rows:
            for kb in range(-(-k // 128)):
                ks = slice(kb * 128, (kb + 1) * 128)
                part = wq[e, :, ks] @ xq[r, ks]
                out[r] += part * xs[r, kb] * np.repeat(ws[e, :, kb], 128)[:n]
    return out


modules = pytest.mark.parametrize("module", [reference, ops], ids=["reference", "ops"])


@modules
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("m,n,k,sizes", [
    (40, 256, 256, (10, 0, 30)),      # an empty expert in the middle
    (1, 64, 200, (0, 1, 0)),          # one row; K not a multiple of 128
    (33, 300, 130, (33, 0, 0)),       # every row on one expert; partial blocks
    (20, 128, 128, (0, 0, 0)),        # no rows owned: zeros
    (12, 96, 384, (5, 20, -3)),       # sizes past m; a negative size counts 0
])
def test_group_gemm_fp8_matches_recipe(rng, module, dtype, m, n, k, sizes):
    x = normal(rng, (m, k), dtype)
    w, w_scale = fp8.quantize_blocks(normal(rng, (len(sizes), n, k), jnp.float32, k**-0.5))
    s = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(module.group_gemm_fp8)(x, w, w_scale, s)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (m, n)
    want = np_group_gemm_fp8(x, w, w_scale, sizes)
    # the output's rounding to its dtype (bf16 2^-9, f16 2^-12), f32 sums in another order
    tol = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}[dtype]
    if np.any(want):
        assert rel_err(got, want) <= tol
    owned = min(sum(max(v, 0) for v in sizes), m)
    np.testing.assert_array_equal(np.asarray(got[owned:], np.float32), 0.0)


def test_group_gemm_fp8_close_to_bf16_on_dequantised_weights(rng):
    """Only the activations' quantisation separates the two."""
    x = normal(rng, (64, 512), jnp.bfloat16)
    w, w_scale = fp8.quantize_blocks(normal(rng, (4, 256, 512), jnp.float32, 512**-0.5))
    s = jnp.asarray([16, 16, 0, 32], jnp.int32)
    got = reference.group_gemm_fp8(x, w, w_scale, s).astype(jnp.float32)
    want = reference.group_gemm(x, fp8.dequantize_blocks(w, w_scale, jnp.bfloat16), s)
    assert rel_err(got, want) < 3e-2


def _bad(rng, case):
    x = normal(rng, (8, 256), jnp.bfloat16)
    w, ws = fp8.quantize_blocks(normal(rng, (2, 128, 256), jnp.float32))
    s = jnp.asarray([4, 4], jnp.int32)
    return {
        "scale_shape": (x, w, ws[:, :, :1], s),
        "scale_dtype": (x, w, ws.astype(jnp.float16), s),
        "scale_list": (x, w, ws.tolist(), s),
        "w_not_fp8": (x, w.astype(jnp.bfloat16), ws, s),
        "x_fp8": (x.astype(fp8.FP8), w, ws, s),
        "k_mismatch": (x[:, :128], w, ws, s),
        "sizes_len": (x, w, ws, s[:1]),
    }[case]


@pytest.mark.parametrize("case,exc,match", [
    ("scale_shape", ValueError, "w_scale must have shape"),
    ("scale_dtype", TypeError, "w_scale must be float32"),
    ("scale_list", TypeError, "w_scale must be an array"),
    ("w_not_fp8", TypeError, "w must be float8_e4m3fn"),
    ("x_fp8", TypeError, "x must be float32, bfloat16 or float16"),
    ("k_mismatch", ValueError, "w must be"),
    ("sizes_len", ValueError, "expert_sizes must have E=2"),
])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@modules
def test_group_gemm_fp8_rejects_bad_arguments(rng, module, case, exc, match, jit):
    args = _bad(rng, case)
    f = jax.jit(module.group_gemm_fp8) if jit else module.group_gemm_fp8
    with pytest.raises(exc, match=match):
        f(*args)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: fp8.quantize_blocks(jnp.ones((128,))), ValueError, "w must have rank >= 2"),
    (lambda: fp8.quantize_rows(jnp.ones((4, 8), jnp.int32)), TypeError, "x must be float32"),
    (lambda: fp8.dequantize_blocks(jnp.ones((4, 8), fp8.FP8), jnp.ones((2, 1))), ValueError,
     "scales must have shape"),
])
def test_fp8_helpers_reject_bad_arguments(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()
