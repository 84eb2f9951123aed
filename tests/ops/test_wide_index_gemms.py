"""Rows, sizes and group offsets past int32 (int64 under jax_enable_x64,
uint32 without it) through the GEMMs, the MLP, the weight gradient, the
backward of expand and ragged_dot: never wrapped onto a valid value (the
ids, rows and slots of the single steps: test_wide_indices.py).

An id or row outside int32 is out of range, and dropped as any other (not
placed, a zero row, a slot that counts zero): 2**32 + 1 is not 1. A size past
int32 saturates (it covers every row that is left): 2**32 + 3 is not 3, and
-2**32 + 3 counts 0. Each case runs eagerly and under jax.jit on both
backends; x64 is switched on only inside each test (jax.enable_x64).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import assert_close, assert_equal, normal
from jax_moe import ragged_dot
from jax_moe.backends import BACKENDS

WRAP_TO_1 = [2**32 + 1, -(2**32) + 1]  # astype(int32) gives 1 for both


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def eager_and_jit(fn, *args):
    """fn(*args) eagerly and under a fresh jax.jit (traced with x64 on)."""
    return [("eager", fn(*args)), ("jit", jax.jit(fn)(*args))]


def i64(values):
    return jnp.asarray(np.asarray(values, np.int64))


def _grouped(x, w, sizes):
    """numpy: rows [P_e, P_e+1) of x times w[e].T for the prefix sums P of
    sizes (given as Python ints: no wrap), cut at M; other rows zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for e, size in enumerate(sizes):
        stop = min(start + max(size, 0), x.shape[0])
        out[start:stop] = x[start:stop] @ w[e].T
        start = stop
    return out


# ---- rows ------------------------------------------------------------------

@pytest.mark.parametrize("wide", WRAP_TO_1)
def test_expand_grad_drops_rows_past_int32(rng, backend, wide):
    # expand's backward builds the inverse of dst_to_src (ops._common.inverse_map).
    x = normal(rng, (3, 8), jnp.float32)
    d2s = i64([0, wide, 3, 1])
    g = normal(rng, (4, 8), jnp.float32)
    fn = lambda x, d: jax.vjp(lambda x: backend.moe_expand_input(x, d, 2), x)[1](g)[0]  # noqa
    gn = np.asarray(g, np.float64)
    want = np.stack([gn[0] + gn[3], gn[2], np.zeros(8)])
    for how, got in eager_and_jit(fn, x, d2s):
        assert_close(got, want, jnp.float32, f"{how}: the row past int32 gets nothing")


# ---- sizes -----------------------------------------------------------------

# (int64 sizes, their meaning as Python ints): saturated, never wrapped.
SIZE_CASES = {
    "past_int32_first": ([2**32 + 3, 5, 0, 0], [2**31 - 1, 5, 0, 0]),  # wrap: 3 rows
    "below_int32": ([-(2**32) + 3, 10, 4, 100], [0, 10, 4, 100]),       # wrap: 3 rows
    "sum_past_int32": ([20, 2**33, 5, 2**40], [20, 2**31 - 1, 5, 2**31 - 1]),
}


@pytest.mark.parametrize("case", SIZE_CASES)
def test_group_gemm_saturates_sizes_past_int32(rng, backend, case):
    wide, meaning = SIZE_CASES[case]
    x = normal(rng, (64, 24), jnp.float32)
    w = normal(rng, (4, 10, 24), jnp.float32, 0.2)
    want = _grouped(x, w, meaning)
    for how, got in eager_and_jit(backend.group_gemm, x, w, i64(wide)):
        assert_close(got, want, jnp.float32, f"{how}: {case}")


@pytest.mark.parametrize("case", SIZE_CASES)
def test_group_gemm_gather_wide_rows_and_sizes(rng, backend, case):
    wide, meaning = SIZE_CASES[case]
    tokens, k = 32, 2
    x = normal(rng, (tokens, 24), jnp.float32)
    w = normal(rng, (4, 10, 24), jnp.float32, 0.2)
    d2s = rng.permutation(tokens * k).astype(np.int64)
    d2s[[3, 40]] = WRAP_TO_1
    ok = (d2s >= 0) & (d2s < tokens * k)
    rows = np.asarray(x, np.float64)[np.where(ok, d2s, 0) // k] * ok[:, None]
    want = _grouped(rows, w, meaning)
    fn = lambda x, w, s, d: backend.group_gemm_gather(x, w, s, d, k)  # noqa: E731
    for how, got in eager_and_jit(fn, x, w, i64(wide), jnp.asarray(d2s)):
        assert_close(got, want, jnp.float32, f"{how}: {case}")


@pytest.mark.parametrize("case", SIZE_CASES)
def test_expert_mlp_wide_rows_and_sizes(rng, backend, case):
    wide, meaning = SIZE_CASES[case]
    tokens, k, hidden, inter = 32, 2, 16, 8
    x = normal(rng, (tokens, hidden), jnp.float32)
    w13 = normal(rng, (4, inter, hidden), jnp.float32, 0.25)
    w2 = normal(rng, (4, hidden, inter), jnp.float32, 0.3)
    d2s = rng.permutation(tokens * k).astype(np.int64)
    d2s[[3, 40]] = WRAP_TO_1
    ok = (d2s >= 0) & (d2s < tokens * k)
    rows = np.asarray(x, np.float64)[np.where(ok, d2s, 0) // k] * ok[:, None]
    h = _grouped(rows, w13, meaning)
    want = _grouped(h / (1.0 + np.exp(-h)), w2, meaning)  # silu, not gated
    fn = lambda x, s, d: backend.expert_mlp(x, w13, w2, s, d, k, is_gated=False)  # noqa: E731
    for how, got in eager_and_jit(fn, x, i64(wide), jnp.asarray(d2s)):
        assert_close(got, want, jnp.float32, f"{how}: {case}")


@pytest.mark.parametrize("case", SIZE_CASES)
def test_group_gemm_wgrad_wide_rows_and_sizes(rng, backend, case):
    wide, meaning = SIZE_CASES[case]
    tokens, k = 32, 2
    dy = normal(rng, (tokens * k, 10), jnp.float32)
    x = normal(rng, (tokens, 24), jnp.float32)
    d2s = rng.permutation(tokens * k).astype(np.int64)
    d2s[[3, 40]] = WRAP_TO_1
    ok = (d2s >= 0) & (d2s < tokens * k)
    rows = np.asarray(x, np.float64)[np.where(ok, d2s, 0) // k] * ok[:, None]
    dyn = np.asarray(dy, np.float64)
    want = np.zeros((4, 10, 24))
    start = 0
    for e, size in enumerate(meaning):
        stop = min(start + max(size, 0), tokens * k)
        want[e] = dyn[start:stop].T @ rows[start:stop]
        start = stop
    fn = lambda dy, x, s, d: backend.group_gemm_wgrad(dy, x, s, dst_to_src=d, topk=k)  # noqa
    for how, got in eager_and_jit(fn, dy, x, i64(wide), jnp.asarray(d2s)):
        assert_close(got, want, jnp.float32, f"{how}: {case}")


@pytest.mark.parametrize("case", SIZE_CASES)
def test_ragged_dot_saturates_group_sizes_past_int32(rng, case):
    wide, meaning = SIZE_CASES[case]
    lhs = normal(rng, (64, 24), jnp.float32)
    rhs = normal(rng, (4, 24, 10), jnp.float32, 0.2)
    want = _grouped(lhs, np.swapaxes(np.asarray(rhs), 1, 2), meaning)
    for how, got in eager_and_jit(ragged_dot, lhs, rhs, i64(wide)):
        assert_close(got, want, jnp.float32, f"{how}: {case}")
    # The gradients run the kernels on the same (saturated) sizes.
    g = normal(rng, (64, 10), jnp.float32)
    fn = lambda a, b, s: jax.vjp(lambda a, b: ragged_dot(a, b, s), a, b)[1](g)  # noqa: E731
    d_lhs_want = _grouped(g, np.asarray(rhs), meaning)
    for how, (d_lhs, _) in eager_and_jit(fn, lhs, rhs, i64(wide)):
        assert_close(d_lhs, d_lhs_want, jnp.float32, f"{how}: d lhs, {case}")


@pytest.mark.parametrize("offset,meaning", [(2**32 + 1, 2), (-(2**32) + 1, 0), (2**40, 2)])
def test_ragged_dot_group_offset_past_int32_is_clamped(rng, offset, meaning):
    # group_offset is clamped to [0, groups - G]; past int32 it saturates
    # first (2**32 + 1 is the last offset, not 1).
    lhs = normal(rng, (40, 24), jnp.float32)
    rhs = normal(rng, (2, 24, 10), jnp.float32, 0.2)
    sizes = [7, 9, 11, 5]
    want = np.zeros((40, 10))
    start = sum(sizes[:meaning])
    rows = np.asarray(lhs, np.float64)
    for g in range(2):
        stop = start + sizes[meaning + g]
        want[start:stop] = rows[start:stop] @ np.asarray(rhs[g], np.float64)
        start = stop
    fn = lambda a, b, s, o: ragged_dot(a, b, s, group_offset=o)  # noqa: E731
    for how, got in eager_and_jit(fn, lhs, rhs, i64(sizes), i64([offset])):
        assert_close(got, want, jnp.float32, f"{how}: offset {offset}")


@pytest.mark.parametrize("below", [[2**31 - 1, 2**31 - 1], [30, 30]], ids=["past_int32", "past_m"])
def test_ragged_dot_local_groups_after_every_row_get_none(rng, below):
    # The rows below the local groups (summed past int32, or past M) are all
    # of them: the local groups start after the last row and get none.
    lhs = normal(rng, (40, 24), jnp.float32)
    rhs = normal(rng, (2, 24, 10), jnp.float32, 0.2)
    sizes = i64(below + [3, 4])
    fn = lambda a, b, s: ragged_dot(a, b, s, group_offset=jnp.asarray([2], jnp.int32))  # noqa
    for how, got in eager_and_jit(fn, lhs, rhs, sizes):
        assert_equal(got, np.zeros((40, 10), np.float32), f"{how}: no local rows")


def test_uint32_sizes_past_int32_saturate(rng, backend):
    # Without x64 too: a uint32 size past 2**31 - 1 is not a negative one.
    x = normal(rng, (64, 24), jnp.float32)
    w = normal(rng, (4, 10, 24), jnp.float32, 0.2)
    want = _grouped(x, w, [20, 2**31 - 1, 0, 0])
    with jax.enable_x64(False):
        sizes = jnp.asarray(np.array([20, 2**31 + 5, 0, 0], np.uint32))
        for how, got in eager_and_jit(backend.group_gemm, x, w, sizes):
            assert_close(got, want, jnp.float32, f"{how}: uint32")
