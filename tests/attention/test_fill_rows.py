"""jax_moe.attention.fill_rows (FFI, CPU + CUDA), the prefill path's padding
rows and poison, against its jnp twin (attention_reference.fill_rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import DTYPE_IDS, FLOAT_DTYPES, assert_equal, normal
from jax_moe import attention, attention_reference


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(9, 4, 8), (7, 3), (5,)])  # 16-byte rows, odd rows, scalars
@pytest.mark.parametrize("start, poison", [(-3, 0), (0, 0), (4, 0), (9, 0), (40, 0), (4, 1)])
def test_fill_rows_matches_reference(rng, dtype, shape, start, poison):
    x = normal(rng, shape, dtype)
    f = jax.jit(attention.fill_rows)
    got = np.asarray(f(x, jnp.int32(start), jnp.int32(poison)).astype(jnp.float32))
    want = np.asarray(attention_reference.fill_rows(x, start, poison).astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    n = shape[0]
    lo = 0 if poison else min(max(start, 0), n)
    assert np.all(np.isnan(got[lo:])) if poison else np.all(got[lo:] == 0)
    np.testing.assert_array_equal(got[:lo], np.asarray(x.astype(jnp.float32))[:lo])  # untouched


@pytest.mark.sanitize
@pytest.mark.parametrize("start, poison", [(3, 0), (0, 1), (11, 0)], ids=["tail", "poison", "none"])
def test_sanitize_fill_rows(rng, start, poison):
    x = normal(rng, (11, 2, 12), jnp.bfloat16)
    got = jax.jit(attention.fill_rows)(x, jnp.int32(start), jnp.int32(poison))
    want = attention_reference.fill_rows(x, start, poison)
    assert_equal(jnp.nan_to_num(got), jnp.nan_to_num(want), "fill_rows")


def test_fill_rows_errors():
    with pytest.raises(TypeError, match="x"):
        attention.fill_rows(jnp.zeros((3, 2), jnp.int32), 1, 0)
    with pytest.raises(ValueError, match="leading row axis"):
        attention.fill_rows(jnp.zeros((), jnp.float32), 0, 0)
    with pytest.raises(ValueError, match="start must be a scalar"):
        attention.fill_rows(jnp.zeros((3, 2)), jnp.zeros((2,), jnp.int32), 0)
    with pytest.raises(ValueError, match="poison must be a scalar"):
        attention.fill_rows(jnp.zeros((3, 2)), 1, jnp.zeros((1,), bool))
    for impl in (attention, attention_reference):
        with pytest.raises(TypeError, match="start must be an integer, got dtype float"):
            impl.fill_rows(jnp.zeros((3, 2)), 1.7, 0)
        with pytest.raises(TypeError, match="poison must be a bool or an integer, got dtype float"):
            impl.fill_rows(jnp.zeros((3, 2)), 1, 0.5)


@pytest.mark.parametrize("impl", [attention, attention_reference], ids=["ffi", "reference"])
def test_fill_rows_wide_integers(impl):
    # An int64 start past int32 clamps to N (nothing zeroed), a negative one
    # to 0; an int64 poison of 2**32 is nonzero (true), not wrapped to 0.
    x = jnp.ones((4, 2), jnp.float32)
    wide = np.int64(2**32 + 1)
    np.testing.assert_array_equal(np.asarray(impl.fill_rows(x, wide, False)), np.ones((4, 2)))
    np.testing.assert_array_equal(np.asarray(impl.fill_rows(x, np.int64(-2**32 + 2), False)),
                                  np.zeros((4, 2)))
    assert np.all(np.isnan(np.asarray(impl.fill_rows(x, 1, np.int64(2**32)))))
    assert np.all(np.asarray(impl.fill_rows(x, 2, np.bool_(False)))[:2] == 1)
