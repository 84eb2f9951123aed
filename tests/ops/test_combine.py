"""Step 7, combine: ops.moe_combine against its twin in jax_moe.reference and
against the numpy oracle, with remote (-1) slots, split rows, bitwise
reproducibility. The contract on both backends at the edges is in
test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, random_ids, ref
from jax_moe import ops

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


COMBINE_SHAPES = [  # (T, k, H)
    (1, 1, 1), (1, 4, 72), (33, 2, 130), (64, 8, 72), (17_000, 4, 8),
    (1, 8, 2048),   # decode: the CUDA kernel splits a row over several blocks
    (2, 10, 4104),  # k > 8 (two batches of slot loads), a split row with a ragged end
    (3, 3, 1001),   # odd H (scalar path), split
]


def _combine_inputs(rng, tokens, k, hidden, dtype, remote):
    experts = 8 if k <= 8 else 16
    ids = random_ids(rng, tokens, k, experts)
    start, count = (2, 4) if remote else (0, experts)  # remote: some entries are -1
    s2d, _, _ = oracle.token_index(ids, experts, start, count)
    y = normal(rng, (tokens * k, hidden), dtype)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    return y, weights, s2d


@dtypes
@pytest.mark.parametrize("remote", [False, True], ids=["all_local", "some_remote"])
@pytest.mark.parametrize("shape", COMBINE_SHAPES, ids=str)
def test_combine(rng, shape, dtype, remote):
    y, weights, s2d = _combine_inputs(rng, *shape, dtype, remote)
    got = ops.moe_combine(y, weights, jnp.asarray(s2d))
    assert got.shape == (shape[0], shape[2]) and got.dtype == dtype
    assert_close(got, ref.moe_combine(y, weights, jnp.asarray(s2d)), dtype, "vs reference")
    assert_close(got, oracle.combine(y, weights, s2d), dtype, "vs numpy oracle")


@pytest.mark.sanitize
@pytest.mark.parametrize("shape", [(1, 8, 2048), (2, 10, 4104), (3, 3, 1001)], ids=str)
def test_combine_split_rows_sanitize(rng, shape):
    # The few-token launch (rows split over blocks, k > 8, odd H) for
    # compute-sanitizer, with remote (-1) slots.
    y, weights, s2d = _combine_inputs(rng, *shape, jnp.bfloat16, True)
    got = ops.moe_combine(y, weights, jnp.asarray(s2d))
    assert_close(got, oracle.combine(y, weights, s2d), jnp.bfloat16, "vs numpy oracle")


@dtypes
def test_combine_minus_one_counts_as_zero(rng, dtype):
    tokens, k, hidden = 40, 4, 24
    y, weights, s2d = _combine_inputs(rng, tokens, k, hidden, dtype, remote=True)
    missing = s2d < 0
    assert missing.any() and (~missing).any()
    got = ops.moe_combine(y, weights, jnp.asarray(s2d))
    # Same result when the -1 entries instead point at a real row with weight 0.
    pointed = np.where(missing, 0, s2d).astype(np.int32)
    zeroed = jnp.where(jnp.asarray(missing.reshape(tokens, k)), 0.0, weights)
    assert_close(got, ops.moe_combine(y, zeroed, jnp.asarray(pointed)), dtype, "vs zero weights")
    # All -1: exactly zero.
    none = ops.moe_combine(y, weights, jnp.full((tokens * k,), -1, jnp.int32))
    assert np.all(np.asarray(none).astype(np.float32) == 0)


@dtypes
def test_combine_is_bitwise_reproducible(rng, dtype):
    y, weights, s2d = _combine_inputs(rng, 3000, 8, 130, dtype, remote=False)
    s2d = jnp.asarray(s2d)
    first = ops.moe_combine(y, weights, s2d)
    assert_equal(ops.moe_combine(y, weights, s2d), first, "second eager run")
    jitted = jax.jit(ops.moe_combine)
    assert_equal(jitted(y, weights, s2d), first, "jitted run")
    assert_equal(jitted(y, weights, s2d), first, "second jitted run")
