"""Index and size arguments wider than int32 (int64 with jax_enable_x64)
saturate into int32's range instead of wrapping: an id, row or slot past it
is out of range (dropped, a zero row), a size past it clamps to the rows
there are. Each op, on both backends, eagerly and under jax.jit, against the
same call with the narrow equivalent (-1 for an index, 2**31 - 1 or -1 for a
size)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import ops, reference

WIDE = 2**32 + 1      # wraps to 1 through a plain int32 cast
NEG_WIDE = -(2**32) + 3  # wraps to 3
T, K, E, H, N = 5, 2, 3, 8, 6


def _i64(values):
    return jnp.asarray(np.asarray(values, np.int64))


def _same(fn, wide_args, narrow_args):
    """fn(*wide_args) == fn(*narrow_args), eagerly and under jax.jit."""
    for f in (fn, jax.jit(fn)):
        got = jax.tree.map(np.asarray, f(*wide_args))
        want = jax.tree.map(np.asarray, f(*narrow_args))
        jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, N, H)), jnp.float32)
    return rng, x, w


@pytest.mark.parametrize("impl", [ops, reference], ids=["ffi", "reference"])
def test_token_index_drops_wide_ids(x64, impl):
    # Eagerly, ids out of range are an error; under jit (values unknown at
    # trace time) they are dropped, wide ones included.
    ids = [[0, 1], [2, WIDE], [NEG_WIDE, 1], [0, 2], [1, 1]]
    narrow = [[0, 1], [2, -1], [-1, 1], [0, 2], [1, 1]]
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        impl.moe_compute_token_index(_i64(ids), E)
    f = jax.jit(lambda i: impl.moe_compute_token_index(i, E))
    jax.tree.map(np.testing.assert_array_equal, f(_i64(ids)), f(_i64(narrow)))


@pytest.mark.parametrize("impl", [ops, reference], ids=["ffi", "reference"])
def test_expand_and_gather_drop_wide_rows(x64, impl):
    _, x, w = _data()
    d2s, narrow = _i64([3, WIDE, 0, NEG_WIDE, 9, 2]), _i64([3, -1, 0, -1, 9, 2])
    sizes = _i64([2, 3, 1])
    _same(lambda d: impl.moe_expand_input(x, d, K), [d2s], [narrow])
    _same(lambda d: impl.group_gemm_gather(x, w, sizes, d, K), [d2s], [narrow])
    _same(lambda d: impl.expert_mlp(x, w, jnp.swapaxes(w, 1, 2)[:, :, : N // 2], sizes, d, K), [d2s], [narrow])


@pytest.mark.parametrize("impl", [ops, reference], ids=["ffi", "reference"])
def test_combine_drops_wide_slots(x64, impl):
    rng, _, _ = _data()
    y = jnp.asarray(rng.standard_normal((T * K, H)), jnp.float32)
    wts = jnp.asarray(rng.random((T, K)), jnp.float32)
    s2d = np.arange(T * K, dtype=np.int64)
    narrow = s2d.copy()
    s2d[[1, 6]] = [WIDE, NEG_WIDE]
    narrow[[1, 6]] = -1
    _same(lambda s: impl.moe_combine(y, wts, s), [_i64(s2d)], [_i64(narrow)])


@pytest.mark.parametrize("impl", [ops, reference], ids=["ffi", "reference"])
def test_gemm_sizes_saturate(x64, impl):
    rng, _, w = _data()
    x = jnp.asarray(rng.standard_normal((T * K, H)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((T * K, N)), jnp.float32)
    for wide, narrow in (([3, WIDE, 4], [3, 2**31 - 1, 4]), ([NEG_WIDE, 4, 5], [-1, 4, 5])):
        _same(lambda s: impl.group_gemm(x, w, s), [_i64(wide)], [_i64(narrow)])
        _same(lambda s: impl.group_gemm_wgrad(dy, x, s), [_i64(wide)], [_i64(narrow)])
    rows, rows_narrow = _i64([0, 1, WIDE, 3, 4, 5, 6, 7, 8, NEG_WIDE]), _i64(
        [0, 1, -1, 3, 4, 5, 6, 7, 8, -1])
    xt = x[:T]
    _same(lambda r: impl.group_gemm_wgrad(dy, xt, _i64([4, 3, 3]), dst_to_src=r, topk=K),
          [rows], [rows_narrow])


def test_ragged_dot_group_sizes_saturate(x64):
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((10, H)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((E, H, N)), jnp.float32)
    _same(lambda s: jax_moe.ragged_dot(lhs, rhs, s), [_i64([3, WIDE, 4])],
          [_i64([3, 2**31 - 1, 4])])
    _same(lambda s: jax_moe.ragged_dot(lhs, rhs, s), [_i64([NEG_WIDE, 4, 5])],
          [_i64([-1, 4, 5])])


def test_wide_id_is_not_expert_one(x64):
    # The defect this guards: 2**32 + 1 through astype(int32) is expert 1.
    src_to_dst, _, sizes = jax.jit(lambda i: ops.moe_compute_token_index(i, E))(_i64([[WIDE]]))
    assert np.asarray(sizes).tolist() == [0, 0, 0]
    assert np.asarray(src_to_dst).tolist() == [-1]
