"""Step 3, expand: ops.moe_expand_input against its twin in jax_moe.reference
and against the numpy oracle, bit for bit (a pure copy). The contract on both
backends at the edges is in test_conformance.py."""

import jax.numpy as jnp
import pytest

import oracle
from common import DTYPE_IDS, FLOAT_DTYPES, assert_equal, normal, random_ids, ref
from jax_moe import ops

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


EXPAND_SHAPES = [  # (T, k, H)
    (1, 1, 1), (1, 4, 72), (33, 2, 130), (64, 8, 72), (17_000, 4, 8)]


@dtypes
@pytest.mark.parametrize("local", [False, True], ids=["all_local", "some_remote"])
@pytest.mark.parametrize("shape", EXPAND_SHAPES, ids=str)
def test_expand(rng, shape, dtype, local):
    tokens, k, hidden = shape
    experts = 8
    ids = random_ids(rng, tokens, k, experts)
    # "some_remote": experts 0 and 7 live elsewhere, so dst_to_src has a -1 tail.
    start, count = (1, 6) if local else (0, experts)
    _, d2s, _ = oracle.token_index(ids, experts, start, count)
    x = normal(rng, (tokens, hidden), dtype)
    got = ops.moe_expand_input(x, jnp.asarray(d2s), k)
    assert got.shape == (tokens * k, hidden) and got.dtype == dtype
    # A pure copy: bit-exact against both.
    assert_equal(got, ref.moe_expand_input(x, jnp.asarray(d2s), k), "vs reference")
    assert_equal(got, oracle.expand(x, d2s, k), "vs numpy oracle")
