"""The forward-only layer's w13 GEMM with the gated activation in one kernel
(jax_moe_group_gemm_act): the bits of group_gemm_gather then
gated_activation, at routing and tile edges, every activation; on the GPU
the own Hopper kernel (every shape here is within its limits: bf16/f16, 2I a
multiple of 16, H of 8), on the CPU the two steps' kernels."""

import jax.numpy as jnp
import numpy as np
import pytest

from common import (assert_close, assert_equal, gather_rows, mlp_weights, normal, on_cpu, ref,
                    rtol_for, split_rows)
from jax_moe import ops, tuning
from jax_moe.ops.group_gemm_act import _group_gemm_act_call

HALF = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
ACTS = pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])


def two_ops(x, w13, sizes, d2s, topk, activation):
    h = ops.group_gemm_gather(x, w13, sizes, d2s, topk, tile_m=tuning.SM90_TILE)
    return ops.gated_activation(h, activation)


def assert_close_gated(got, want, dtype, what):
    # g and u are rounded to the dtype before act(g) * u. Summed in another
    # order (the CPU handler, the reference), a g or u within rounding error
    # of the midpoint between two representable values rounds the other way,
    # which moves the product by about one more ulp: twice the tolerance.
    assert_close(got, want, dtype, what, rtol=2 * rtol_for(dtype))


def check(x, w13, sizes, d2s, topk, activation, dtype, what):
    got = _group_gemm_act_call(x, w13, sizes, d2s, topk, activation)
    m, inter = d2s.shape[0], w13.shape[1] // 2
    assert got.shape == (m, inter) and got.dtype == dtype
    assert_equal(got, two_ops(x, w13, sizes, d2s, topk, activation), what)
    want = ref.gated_activation(
        ref.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w13, sizes), activation)
    assert_close_gated(got, want, dtype, f"{what} vs reference")
    placed = int(np.clip(np.asarray(sizes), 0, None).sum())
    assert np.all(np.asarray(got)[placed:].astype(np.float32) == 0), f"{what}: tail rows"
    return got


# (T, H, I, E, topk): one token; a few rows an expert (the one-warpgroup
# edge tile); 2I not a multiple of the 256 columns of a tile, H of the 64 k
# of a stage; topk = E; many rows an expert (several 128-row tiles, one
# edge tile each).
SHAPES = [(1, 72, 8, 7, 2), (37, 136, 24, 6, 3), (150, 264, 200, 5, 5), (700, 520, 136, 3, 2)]


@HALF
@ACTS
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_group_gemm_act_same_bits_as_two_ops(rng, shape, activation, dtype):
    tokens, hidden, inter, experts, topk = shape
    x = normal(rng, (tokens, hidden), dtype)
    w13, _ = mlp_weights(rng, experts, hidden, inter, dtype)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)  # with invalid entries
    check(x, w13, sizes, d2s, topk, activation, dtype, f"{shape} {activation}")


# Routing edges: one expert, every row on one expert of four (the others
# empty, the first among them), rows past the placed ones (sum(sizes) < M).
@HALF
@pytest.mark.parametrize("pattern", ["one_expert", "all_on_one", "empty_first_middle_last",
                                     "tail_rows"])
def test_group_gemm_act_routing_edges(rng, pattern, dtype):
    tokens, hidden, inter, topk = 200, 200, 72, 2
    experts = 1 if pattern == "one_expert" else 4
    m = tokens * topk
    x = normal(rng, (tokens, hidden), dtype)
    w13, _ = mlp_weights(rng, experts, hidden, inter, dtype)
    d2s = jnp.asarray(rng.permutation(m).astype(np.int32))
    if pattern == "one_expert":
        sizes = np.array([m], np.int32)
    elif pattern == "all_on_one":
        sizes = np.array([0, 0, m, 0], np.int32)
    elif pattern == "tail_rows":
        sizes = np.array([100, 7, 0, 180], np.int32)  # 287 of 400 rows placed
    else:
        sizes = np.asarray(split_rows(rng, m, experts, pattern), np.int32)
    check(x, w13, jnp.asarray(sizes), d2s, topk, "silu", dtype, pattern)


def test_group_gemm_act_f32_on_cpu(rng):
    # The CPU handler takes every float dtype (the GPU kernel bf16/f16 only).
    tokens, hidden, inter, experts, topk = 9, 24, 6, 3, 2
    x = normal(rng, (tokens, hidden), jnp.float32)
    w13, _ = mlp_weights(rng, experts, hidden, inter, jnp.float32)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    got = on_cpu(_group_gemm_act_call, x, w13, sizes, d2s, topk, "gelu")
    assert_equal(got, on_cpu(two_ops, x, w13, sizes, d2s, topk, "gelu"), "f32")


@pytest.mark.gpu
@pytest.mark.sanitize
@HALF
def test_group_gemm_act_cuda_vs_cpu(rng, dtype):
    # Model-like widths: several column tiles and a long K loop, against the CPU handler.
    tokens, hidden, inter, experts, topk = 512, 1024, 384, 16, 4
    x = normal(rng, (tokens, hidden), dtype)
    w13, _ = mlp_weights(rng, experts, hidden, inter, dtype)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    got = _group_gemm_act_call(x, w13, sizes, d2s, topk, "silu")
    assert_close_gated(got, on_cpu(_group_gemm_act_call, x, w13, sizes, d2s, topk, "silu"), dtype,
                       "CUDA vs CPU")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 4104], ids=["deferred", "epilogue"])
def test_group_gemm_act_defer_switch(rng, hidden):
    # Up to K = 4096 a warpgroup works its tile's activation off during its
    # next tile's main loop, above it in the epilogue. More tiles than SMs
    # (64 experts of about 64 rows, 4 column tiles each: about 256 tiles, two
    # warpgroups or one), so that warpgroups carry activations from tile to tile.
    tokens, inter, experts, topk, dtype = 1024, 512, 64, 4, jnp.bfloat16
    x = normal(rng, (tokens, hidden), dtype)
    w13, _ = mlp_weights(rng, experts, hidden, inter, dtype)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    check(x, w13, sizes, d2s, topk, "silu", dtype, f"K={hidden}")
