"""Step 2, the token index: ops.moe_compute_token_index against its twin in
jax_moe.reference and against the numpy oracle, exactly: every routing
pattern, local expert ranges, id dtypes, jit. The contract on both backends at
the edges is in test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import assert_equal, random_ids, ref, routing_allowed
from jax_moe import ops


INDEX_SHAPES = [  # (T, k, E)
    (1, 1, 1),
    (1, 4, 4),       # topk = E
    (7, 2, 8),
    (128, 2, 8),     # T*k = 256: exactly one index chunk
    (129, 2, 8),     # one past a chunk
    (30, 8, 3000),   # the one-launch path (T*k <= 256) with many experts per lane
    (300, 8, 64),
    (1000, 6, 160),
    (1000, 8, 2048),  # many experts, most of them empty
    (17_000, 4, 8),  # T*k = 68,000 > 65,536
]


def _index_ids(rng, pattern, tokens, k, experts):
    if pattern == "repeats":  # arbitrary ids, repeated within a row too
        return rng.integers(0, experts, size=(tokens, k)).astype(np.int32)
    if pattern == "one_expert":  # every entry on one expert
        return np.full((tokens, k), rng.integers(experts), np.int32)
    return random_ids(rng, tokens, k, experts, routing_allowed(pattern, experts, k, rng))


def _check_index(ids, experts, start=0, local=None, got=None):
    """Compares got (or ops' result) with reference.py and the oracle, exactly."""
    kwargs = dict(start_expert=start, num_local_experts=local)
    if got is None:
        got = ops.moe_compute_token_index(jnp.asarray(ids), experts, **kwargs)
    want_ref = ref.moe_compute_token_index(jnp.asarray(ids), experts, **kwargs)
    want_np = oracle.token_index(ids, experts, start, local)
    for name, g, r, o in zip(("src_to_dst", "dst_to_src", "expert_sizes"), got, want_ref, want_np):
        assert g.dtype == jnp.int32, name
        assert_equal(g, r, f"{name} vs reference")
        assert_equal(g, o, f"{name} vs numpy oracle")
    return got


@pytest.mark.parametrize("pattern", ["uniform", "one_set", "empty_edges", "repeats", "one_expert"])
@pytest.mark.parametrize("shape", INDEX_SHAPES, ids=str)
def test_token_index(rng, shape, pattern):
    tokens, k, experts = shape
    ids = _index_ids(rng, pattern, tokens, k, experts)
    s2d, d2s, sizes = _check_index(ids, experts)
    # Every entry is local here: a permutation, and the sizes are a histogram.
    assert_equal(np.sort(np.asarray(d2s)), np.arange(tokens * k, dtype=np.int32), "d2s is a permutation")
    assert_equal(sizes, np.bincount(ids.ravel(), minlength=experts).astype(np.int32), "histogram")


@pytest.mark.sanitize
def test_token_index_small_sanitize(rng):
    # Small cases for compute-sanitizer: the one-launch kernel (one entry;
    # 94 experts per lane), the three kernels over several chunks with a
    # partial last chunk and 2 or 13 local experts (scan blocks take 8), and
    # more chunks (266) than one round of the scan's loads (256).
    for (tokens, k, experts), start, local in [((1, 1, 1), 0, None), ((30, 8, 3000), 0, None),
                                               ((129, 2, 8), 3, 2), ((300, 8, 64), 5, 13),
                                               ((17_000, 4, 8), 0, None)]:
        _check_index(random_ids(rng, tokens, k, experts), experts, start, local)


LOCAL_RANGES = [  # (E, start_expert, num_local_experts)
    (8, 0, 8), (8, 0, 3), (8, 3, 2), (8, 5, 3), (8, 7, 1), (8, 2, None), (64, 16, 16), (1, 0, 1)]


@pytest.mark.parametrize("shape", [(1, 1), (9, 2), (129, 2), (500, 4)], ids=str)
@pytest.mark.parametrize("local_range", LOCAL_RANGES, ids=str)
def test_token_index_local_experts(rng, local_range, shape):
    experts, start, local = local_range
    tokens, k = shape
    k = min(k, experts)
    ids = random_ids(rng, tokens, k, experts)
    s2d, d2s, sizes = _check_index(ids, experts, start, local)
    # The contract, stated on the inputs: entries outside the local range are
    # not placed, and dst_to_src is -1 past the placed rows.
    stop = experts if local is None else start + local
    outside = (ids.ravel() < start) | (ids.ravel() >= stop)
    placed = int((~outside).sum())
    assert np.all(np.asarray(s2d)[outside] == -1)
    assert np.all(np.asarray(s2d)[~outside] >= 0)
    assert np.all(np.asarray(d2s)[placed:] == -1)
    assert int(np.asarray(sizes).sum()) == placed
    assert sizes.shape == (stop - start,)


@pytest.mark.parametrize("id_dtype", [jnp.int8, jnp.int16, jnp.uint8, jnp.uint32])
def test_token_index_accepts_other_int_dtypes(rng, id_dtype):
    ids = random_ids(rng, 50, 3, 12)
    got = ops.moe_compute_token_index(jnp.asarray(ids, id_dtype), 12)
    _check_index(ids, 12, got=got)


def test_token_index_under_jit(rng):
    ids = random_ids(rng, 700, 4, 32)
    fn = jax.jit(ops.moe_compute_token_index, static_argnames=("num_experts", "start_expert",
                                                               "num_local_experts"))
    _check_index(ids, 32, 4, 20, got=fn(jnp.asarray(ids), 32, start_expert=4, num_local_experts=20))


def test_token_index_under_jit_drops_out_of_range_ids(rng):
    # Under jit the ids cannot be checked; the kernels leave out-of-range ids
    # unplaced (src_to_dst -1), like ids of another rank's experts.
    ids = rng.integers(-3, 12, size=(300, 2)).astype(np.int32)
    fn = jax.jit(ops.moe_compute_token_index, static_argnames=("num_experts",))
    _check_index(ids, 8, got=fn(jnp.asarray(ids), num_experts=8))
