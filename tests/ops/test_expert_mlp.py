"""Steps 3-6 in one call: ops.expert_mlp with the bits of the three ops it
replaces (group_gemm_gather, the activation, group_gemm), at every tile,
gated or not, every activation, at routing edges; against its twin in
jax_moe.reference. The contract on both backends at the edges is in
test_conformance.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from common import (DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, gather_rows, mlp_weights,
                    normal, random_ids, ref)
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


# expert_mlp: steps 3-6 in one call, with the bits of the three ops it
# replaces, at every tile (on the GPU the w2 GEMM and the activation start
# early by programmatic dependent launch), gated or not, every activation.
# Shapes (T, H, I, E, topk): one token, I = 4 and 24 (off the column blocks),
# H = 13 (K off 16-byte loads for the w13 GEMM), topk = E.
EXPERT_MLP_SHAPES = [(1, 72, 4, 7, 2), (37, 136, 24, 6, 3), (5, 13, 9, 4, 4)]


@dtypes
@pytest.mark.parametrize("tiles", [None, (8, 8), (16, 8), (8, 32), (128, 64), (256, 8)], ids=str)
@pytest.mark.parametrize("shape", EXPERT_MLP_SHAPES, ids=str)
def test_expert_mlp_same_bits_as_three_ops(rng, shape, tiles, dtype):
    tokens, hidden, inter, experts, topk = shape
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    t1, t2 = (None, None) if tiles is None else tiles
    got = ops.expert_mlp(x, w13, w2, sizes, d2s, topk, tile_m=tiles)
    assert got.shape == (tokens * topk, hidden) and got.dtype == dtype
    a = ops.gated_activation(ops.group_gemm_gather(x, w13, sizes, d2s, topk, tile_m=t1))
    assert_equal(got, ops.group_gemm(a, w2, sizes, tile_m=t2), f"tiles={tiles}")
    want = ref.group_gemm(ref.gated_activation(
        ref.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w13, sizes)), w2, sizes)
    assert_close(got, want, dtype, f"tiles={tiles} vs reference")
    assert_close(reference.expert_mlp(x, w13, w2, sizes, d2s, topk), want, dtype, "twin")


@pytest.mark.sanitize
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("is_gated", [True, False], ids=["gated", "plain"])
def test_expert_mlp_activations(rng, activation, is_gated):
    tokens, hidden, inter, experts, topk = 37, 136, 24, 6, 3
    x = normal(rng, (tokens, hidden), jnp.bfloat16)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, jnp.bfloat16, gated=is_gated)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    got = ops.expert_mlp(x, w13, w2, sizes, d2s, topk, activation=activation, is_gated=is_gated)
    h = ops.group_gemm_gather(x, w13, sizes, d2s, topk)
    a = ops.gated_activation(h, activation) if is_gated else ops.activation(h, activation)
    assert_equal(got, ops.group_gemm(a, w2, sizes), f"{activation}, gated={is_gated}")


# (T, H, I, E, topk, routing): one expert; every token on expert 2 of 4 (the
# others empty); local experts 2..3 of 6 (start_expert=2, two local: rows past
# the placed ones are dropped by the token index and must come out 0).
EXPERT_MLP_EDGES = [(9, 40, 16, 1, 1, "one_expert"), (12, 64, 24, 4, 1, "all_on_one"),
                    (10, 48, 8, 6, 3, "local_2_of_6")]


@dtypes
@pytest.mark.parametrize("tiles", [None, (8, 8), (16, 16), (32, 64)], ids=str)
@pytest.mark.parametrize("case", EXPERT_MLP_EDGES, ids=lambda c: c[-1])
def test_expert_mlp_routing_edges(rng, case, tiles, dtype):
    tokens, hidden, inter, experts, topk, routing = case
    if routing == "all_on_one":
        ids = jnp.full((tokens, 1), 2, jnp.int32)
    else:
        ids = random_ids(rng, tokens, topk, experts)
        if routing == "local_2_of_6":
            ids[0] = (2, 0, 5)  # one row placed and one dropped whatever the draw
        ids = jnp.asarray(ids)
    start, local = (2, 2) if routing == "local_2_of_6" else (0, experts)
    _, d2s, sizes = ref.moe_compute_token_index(ids, num_experts=experts, start_expert=start,
                                                num_local_experts=local)
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = mlp_weights(rng, local, hidden, inter, dtype)
    got = ops.expert_mlp(x, w13, w2, sizes, d2s, topk, tile_m=tiles)
    t1, t2 = (None, None) if tiles is None else tiles
    a = ops.gated_activation(ops.group_gemm_gather(x, w13, sizes, d2s, topk, tile_m=t1))
    assert_equal(got, ops.group_gemm(a, w2, sizes, tile_m=t2), f"{routing} tiles={tiles}")
    assert_close(got, reference.expert_mlp(x, w13, w2, sizes, d2s, topk), dtype, "twin")
    placed = int(np.asarray(sizes).sum())
    if routing == "local_2_of_6":
        assert 0 < placed < tokens * topk  # the case really drops rows
    np.testing.assert_array_equal(np.asarray(got[placed:], np.float32), 0.0)
    assert np.any(np.asarray(got[:placed], np.float32) != 0.0)


def test_expert_mlp_rejects_bad_args():
    x = jnp.zeros((4, 8), jnp.bfloat16)
    sizes = jnp.asarray([4, 4], jnp.int32)
    d2s = jnp.arange(8, dtype=jnp.int32)
    w13 = jnp.zeros((2, 6, 8), jnp.bfloat16)
    for mod in (ops, reference):
        with pytest.raises(ValueError, match="w2 must be"):
            mod.expert_mlp(x, w13, jnp.zeros((2, 8, 4), jnp.bfloat16), sizes, d2s, 2)
        with pytest.raises(ValueError, match="2\\*I"):
            mod.expert_mlp(x, jnp.zeros((2, 7, 8), jnp.bfloat16),
                           jnp.zeros((2, 8, 3), jnp.bfloat16), sizes, d2s, 2)
        with pytest.raises(ValueError, match="activation"):
            mod.expert_mlp(x, w13, jnp.zeros((2, 8, 3), jnp.bfloat16), sizes, d2s, 2,
                           activation="relu")
        with pytest.raises(TypeError, match="tile_m must be None or a pair"):
            mod.expert_mlp(x, w13, jnp.zeros((2, 8, 3), jnp.bfloat16), sizes, d2s, 2, tile_m=8)
        with pytest.raises((ValueError, TypeError), match="tile_m"):
            mod.expert_mlp(x, w13, jnp.zeros((2, 8, 3), jnp.bfloat16), sizes, d2s, 2,
                           tile_m=(8, 24))
