"""ops.group_gemm_fp8's kernels against the reference twin at the edges of the
recipe: e4m3 rounding ties and subnormals, NaN and infinity in x, zero and
huge block scales, all-zero rows, sizes that are not multiples of a tile
(64 x 64) or of a scale block (128), rows past the groups, and isolation: a
bad row never changes another row's result. Runs on whatever device JAX has
(CPU in CI; on a GPU the "skinny" shapes, and every one-token case with K a
multiple of 16, take the decode kernel, the "tma" shapes in bf16 Hopper's
CUTLASS paths, the rest the portable kernel)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import DTYPE_IDS, FLOAT_DTYPES, gather_rows, normal, on_cpu, rel_err
from jax_moe import fp8, ops, reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _weights(rng, experts, n, k):
    return fp8.quantize_blocks(normal(rng, (experts, n, k), jnp.float32, k**-0.5))


# (m, n, k, sizes): one row, column and channel past the portable kernel's
# tiles; and sizes that Hopper's TMA path takes (bf16, n % 8 == 0, k % 16
# == 0) with neither n nor k a multiple of 128 and rows past the groups, in
# its 64-row tiles (fewer than 128 rows an expert on average) and its
# 128-row tiles (each expert's last 64 rows or fewer in a 64-row tile after
# them: an expert of only 64 rows, experts ending 1, 16, 22 and 64 rows past
# a whole 128-row tile, and 112 rows past, kept in 128-row tiles); and on
# CUDA the decode form's (at most 2 rows an expert on average, k % 16 == 0,
# any dtype): an empty expert and rows past the groups, and one expert of
# twelve with all the rows (passes of 8, 8 and 4 rows).
SHAPES = {"offgrid": (65, 65, 129, (20, 0, 45)), "tma": (150, 200, 272, (20, 0, 110)),
          "tma_wide": (400, 136, 272, (150, 0, 240)),
          "tma_split": (530, 136, 272, (64, 0, 192, 129, 144)), "skinny": (6, 200, 272, (3, 0, 2)),
          "skinny_one": (20, 136, 400, (0, 20) + (0,) * 10)}


def _bad_rows(m, sizes):
    """Two rows of the groups of an m-row case, for a NaN and an infinity."""
    owned = min(sum(max(int(s), 0) for s in sizes), m)
    return (4, 30) if owned > 30 else (1, owned - 1)


def _case(rng, name, dtype, shape="offgrid"):
    """(x, w, w_scale, sizes) of one edge case."""
    m, n, k, sizes = SHAPES[shape]
    x = np.array(normal(rng, (m, k), jnp.float32))
    w, ws = _weights(rng, len(sizes), n, k)
    if name == "ties":
        # amax 448 makes the block's scale exactly 1: every value below is an
        # exact midpoint of two e4m3 values, rounded to the even one.
        mids = np.array([1.0625, 1.1875, 432.0, 2.0**-10, 1.5 * 2.0**-9, 7.5 * 2.0**-9, 3.25,
                         -1.0625, -432.0, -7.5 * 2.0**-9])
        x[:, :128] = np.resize(mids, (m, 128))
        x[:, 5] = 448.0
    elif name == "subnormal":
        x[:, :128] *= 1e-3  # against the block's one large value: e4m3 subnormals
        x[:, 7] = 300.0
    elif name == "zero_rows":
        x[3:9] = 0.0
    elif name == "big":
        x *= 1e30 if dtype == jnp.float32 else 1e3
    elif name == "zero_scale":
        ws = ws.at[0, :, 1].set(0.0)
    elif name == "huge_scale":
        # Positive values in the block: its partial sums cannot cancel to about
        # zero, where the summation order would pick the sign of an f16
        # infinity (or none).
        ws = ws.at[2, 0, 0].set(1e30)
        w = w.at[2, :128, :128].set(jnp.abs(w[2, :128, :128]))
        x[:, :128] = np.abs(x[:, :128])
    elif name == "nonfinite_x":
        nan_row, inf_row = _bad_rows(m, sizes)
        x[nan_row, 128] = np.nan
        x[inf_row, 2] = np.inf
    elif name == "nan_scale":
        ws = ws.at[2, 0, 1].set(np.nan)
    elif name == "one_token":
        x, sizes = x[:1], (0, 1) + (0,) * (len(sizes) - 2)
    elif name == "rows_past_groups":
        sizes = (3, 0, 5) + (0,) * (len(sizes) - 3)
    elif name == "one_expert":
        w, ws, sizes = w[:1], ws[:1], (m,)
    return jnp.asarray(x, dtype), w, ws, jnp.asarray(sizes, jnp.int32)


CASES = ["random", "ties", "subnormal", "zero_rows", "big", "zero_scale", "huge_scale",
         "nonfinite_x", "nan_scale", "one_token", "one_expert", "rows_past_groups"]


@pytest.mark.sanitize
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CASES)
def test_kernels_match_the_twin(rng, name, dtype, shape):
    x, w, ws, sizes = _case(rng, name, dtype, shape)
    got = np.asarray(jax.jit(ops.group_gemm_fp8)(x, w, ws, sizes), np.float64)
    # The twin on the host CPU (IEEE f32, as the NumPy recipe it is tested
    # against in test_fp8), whatever device the kernels run on.
    want = np.asarray(on_cpu(reference.group_gemm_fp8, x, w, ws, sizes), np.float64)
    assert got.shape == want.shape == (x.shape[0], w.shape[1])
    rows = slice(None)
    if name == "nan_scale":
        # The twin's ragged_dot carries a NaN weight into other experts' rows
        # (0 x NaN); compare the NaN expert's rows and the rows past the
        # groups (test below: the kernels keep the others finite).
        owned = np.cumsum(np.maximum(np.asarray(sizes), 0))
        rows = np.r_[owned[1]:owned[2], min(owned[-1], x.shape[0]):x.shape[0]]
        got, want = got[rows], want[rows]
    rerun = np.asarray(jax.jit(ops.group_gemm_fp8)(x, w, ws, sizes), np.float64)[rows]
    # The same non-finite outputs (NaN where a NaN reaches, the same infinities).
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.where(np.isinf(got), got, 0), np.where(np.isinf(want), want, 0))
    fin = np.isfinite(want)
    if np.any(want[fin]):
        assert rel_err(got[fin], want[fin]) <= TOL[dtype], name
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)])
    np.testing.assert_array_equal(np.isnan(rerun), np.isnan(got))
    np.testing.assert_array_equal(rerun[~np.isnan(got)], got[~np.isnan(got)])  # the same bits


@pytest.mark.sanitize
@pytest.mark.parametrize("shape", list(SHAPES))
def test_nonfinite_values_stay_in_their_row(rng, shape):
    """A NaN or an infinity in one row's input makes NaN of that row's outputs
    only; every other row keeps the bits it has without them."""
    x, w, ws, sizes = _case(rng, "random", jnp.bfloat16, shape)
    rows = list(_bad_rows(x.shape[0], np.asarray(sizes)))
    clean = np.asarray(ops.group_gemm_fp8(x, w, ws, sizes), np.float32)
    bad = x.at[rows[0], 128].set(jnp.nan).at[rows[1], 2].set(jnp.inf)
    got = np.asarray(ops.group_gemm_fp8(bad, w, ws, sizes), np.float32)
    assert np.all(np.isnan(got[rows]))
    others = np.setdiff1d(np.arange(x.shape[0]), rows)
    np.testing.assert_array_equal(got[others], clean[others])


@pytest.mark.parametrize("sizes", [(10, 30), (1, 3)], ids=["tiles", "decode"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nan_block_scale_reaches_its_block_only(rng, dtype, sizes):
    first = sizes[0]  # expert 1's first row
    x = normal(rng, (sum(sizes), 256), dtype)
    w, ws = _weights(rng, 2, 200, 256)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(ops.group_gemm_fp8(x, w, ws.at[1, 0, 1].set(jnp.nan), sizes), np.float32)
    assert np.all(np.isnan(got[first:, :128]))  # expert 1's rows, the block's 128 columns
    assert np.all(np.isfinite(got[:first])) and np.all(np.isfinite(got[first:, 128:]))


def test_lowers_to_its_custom_call(rng):
    x, w, ws, sizes = _case(rng, "random", jnp.bfloat16)
    text = jax.jit(ops.group_gemm_fp8).lower(x, w, ws, sizes).as_text()
    assert "jax_moe_group_gemm_fp8" in text


@pytest.mark.parametrize("tile_m", [8, 64, 128])
@pytest.mark.parametrize("shape", ["skinny", "tma", "tma_wide", "tma_split"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_every_tile_matches_the_twin(rng, tile_m, shape, dtype):
    # Each kernel forced whatever the rows per expert (on a GPU: 8 the decode
    # form, 64 and 128 Hopper's tiles for bf16, the portable kernel for f32;
    # on the CPU one kernel): the twin's values, the same bits run to run.
    x, w, ws, sizes = _case(rng, "random", dtype, shape)
    call = jax.jit(lambda *a: ops.group_gemm_fp8(*a, tile_m=tile_m))
    got = np.asarray(call(x, w, ws, sizes), np.float64)
    want = np.asarray(on_cpu(reference.group_gemm_fp8, x, w, ws, sizes), np.float64)
    assert rel_err(got, want) <= TOL[dtype]
    np.testing.assert_array_equal(np.asarray(call(x, w, ws, sizes), np.float64), got)
    owned = min(sum(max(int(s), 0) for s in np.asarray(sizes)), x.shape[0])
    assert not np.any(got[owned:])  # rows past the groups


def _gather_case(rng, dtype, shape, topk=2):
    """Tokens x (T, K) and a routing's dst_to_src (with invalid entries) whose
    rows make a case of `shape`'s sizes: (x, dst_to_src, w, w_scale, sizes)."""
    _, n, k, sizes = SHAPES[shape]
    experts = len(sizes)
    tokens = max(sum(sizes) // topk, 1)
    x = normal(rng, (tokens, k), jnp.float32).astype(dtype)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    w, ws = _weights(rng, experts, n, k)
    return x, d2s, w, ws, sizes


@pytest.mark.sanitize
@pytest.mark.parametrize("tile_m", [8, 64, 128])
@pytest.mark.parametrize("shape", ["skinny", "tma", "offgrid"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_gather_equals_the_expanded_rows(rng, tile_m, shape, dtype):
    # Each kernel reading the token rows through dst_to_src (invalid entries:
    # zero rows) gives the bits it gives on moe_expand_input's rows, and the
    # twin's values.
    topk = 2
    x, d2s, w, ws, sizes = _gather_case(rng, dtype, shape, topk)
    gathered = jax.jit(lambda *a: ops.group_gemm_fp8(*a[:4], dst_to_src=a[4], topk=topk,
                                                     tile_m=tile_m))
    plain = jax.jit(lambda *a: ops.group_gemm_fp8(*a, tile_m=tile_m))
    got = np.asarray(gathered(x, w, ws, sizes, d2s), np.float64)
    expanded = reference.moe_expand_input(x, d2s, topk)
    np.testing.assert_array_equal(got, np.asarray(plain(expanded, w, ws, sizes), np.float64))
    want = np.asarray(on_cpu(lambda *a: reference.group_gemm_fp8(
        *a[:4], dst_to_src=a[4], topk=topk), x, w, ws, sizes, d2s), np.float64)
    assert got.shape == want.shape == (d2s.shape[0], w.shape[1])
    assert rel_err(got, want) <= TOL[dtype]


def test_gather_of_no_tokens_is_zero(rng):
    # T = 0: every entry is outside the tokens, every row zero.
    x, d2s, w, ws, sizes = _gather_case(rng, jnp.bfloat16, "tma")
    none = jnp.zeros((0, x.shape[1]), x.dtype)
    got = ops.group_gemm_fp8(none, w, ws, sizes, dst_to_src=d2s, topk=2)
    assert got.shape == (d2s.shape[0], w.shape[1]) and not np.any(np.asarray(got, np.float32))


@pytest.mark.parametrize("case", ["topk_without_gather", "d2s_rank", "d2s_float", "topk_zero"])
def test_gather_argument_errors(rng, case):
    x, d2s, w, ws, sizes = _gather_case(rng, jnp.bfloat16, "tma")
    kwargs, match = {
        "topk_without_gather": (dict(topk=2), "topk"),
        "d2s_rank": (dict(dst_to_src=d2s[None], topk=2), "dst_to_src"),
        "d2s_float": (dict(dst_to_src=d2s.astype(jnp.float32), topk=2), "dst_to_src"),
        "topk_zero": (dict(dst_to_src=d2s, topk=0), "topk"),
    }[case]
    for fn in (ops.group_gemm_fp8, reference.group_gemm_fp8):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(x, w, ws, sizes, **kwargs)


@pytest.mark.parametrize("tile_m", [16, 256, 0, "64"])
def test_rejects_other_tiles(rng, tile_m):
    x, w, ws, sizes = _case(rng, "random", jnp.bfloat16)
    for fn in (ops.group_gemm_fp8, reference.group_gemm_fp8):
        with pytest.raises((ValueError, TypeError), match="tile_m"):
            fn(x, w, ws, sizes, tile_m=tile_m)


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gather"])
@pytest.mark.parametrize("shape", ["offgrid", "tma", "skinny"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_input_gradient_matches_the_twin(rng, gather, shape, dtype):
    # dx: the fp8 GEMM of the cotangent on the transposed weights (the
    # cotangent quantised per 128 channels), summed into the tokens with a
    # gather; against the twin's, and against the exact gradient of the
    # dequantised GEMM (cotangent @ w[e], straight through x's quantisation)
    # within that quantisation.
    topk = 2
    if gather:
        x, d2s, w, ws, sizes = _gather_case(rng, dtype, shape, topk)
        m = d2s.shape[0]
    else:
        x, w, ws, sizes = _case(rng, "random", dtype, shape)
        d2s, m = None, x.shape[0]
    cot = normal(rng, (m, w.shape[1]), jnp.float32).astype(dtype)
    rows = d2s if gather else jnp.zeros((0,), jnp.int32)

    def grad(fn, x, w, ws, sizes, rows, cot):
        def loss(x):
            out = fn(x, w, ws, sizes, dst_to_src=rows if gather else None,
                     topk=topk if gather else 1)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))
        return jax.jit(jax.grad(loss))(x)

    got = np.asarray(grad(ops.group_gemm_fp8, x, w, ws, sizes, rows, cot), np.float64)
    want = np.asarray(on_cpu(grad, reference.group_gemm_fp8, x, w, ws, sizes, rows, cot),
                      np.float64)
    assert got.shape == want.shape == x.shape
    assert rel_err(got, want) <= TOL[dtype]
    # The exact gradient of the dequantised GEMM, rows owned as in the forward.
    wd = np.asarray(fp8.dequantize_blocks(w, ws), np.float64)
    c = np.asarray(cot, np.float64)
    rows_dx = np.zeros((m, x.shape[1]))
    start = 0
    for e, size in enumerate(np.asarray(sizes)):
        end = min(start + max(int(size), 0), m)
        rows_dx[start:end] = c[start:end] @ wd[e]
        start = end
    if gather:
        exact = np.zeros(x.shape)
        for r, slot in enumerate(np.asarray(d2s)):
            if 0 <= slot < x.shape[0] * topk:
                exact[slot // topk] += rows_dx[r]
    else:
        exact = rows_dx
    assert rel_err(got, exact) <= 5e-2


@pytest.mark.parametrize("fn", [ops.group_gemm_fp8, reference.group_gemm_fp8],
                         ids=["ops", "reference"])
@pytest.mark.parametrize("arg", [1, 2], ids=["w", "w_scale"])
def test_weights_have_no_gradient(rng, fn, arg):
    x, w, ws, sizes = _case(rng, "random", jnp.float32, "tma")
    args = [x, w, ws, sizes]

    def loss(v):
        return jnp.sum(fn(*args[:arg], v, *args[arg + 1:]))

    with pytest.raises(TypeError, match="are frozen: they have no gradient"):
        jax.grad(loss)(args[arg])
