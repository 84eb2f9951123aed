"""Steps 4 and 6, the grouped GEMM: ops.group_gemm and ops.group_gemm_gather
against their twins in jax_moe.reference and against the numpy oracle, on the
default backend (the CPU handler here, the CUDA kernels under
JAX_PLATFORMS=cuda): shapes, expert_sizes patterns, the gather form, tile_m
checks, expert_sizes outside the contract. The CUDA kernels' own paths
(tile_m, the decode and sm90 kernels) are in test_group_gemm_cuda.py, the
contract on both backends at the edges in test_conformance.py."""

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import (BAD_SIZES, DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, gather_rows,
                    normal, on_cpu, ref, split_rows)
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


GEMM_SHAPES = [  # (M, K, N, E)
    (1, 8, 8, 1),
    (7, 13, 7, 3),      # odd K and N
    (64, 72, 130, 8),
    (100, 130, 72, 4),
    (33, 13, 7, 16),    # many experts for few rows: most groups empty or tiny
    (256, 64, 32, 8),
]
SIZE_PATTERNS = ["random", "partial", "empty_first", "empty_middle", "empty_last",
                 "empty_first_middle_last", "all_in_one", "none"]


def _check_gemm(rng, m, k, n, experts, dtype, pattern):
    x = normal(rng, (m, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    sizes = split_rows(rng, m, experts, pattern)
    got = ops.group_gemm(x, w, jnp.asarray(sizes))
    assert got.shape == (m, n) and got.dtype == dtype
    want_ref = ref.group_gemm(x, w, jnp.asarray(sizes))
    assert_close(got, want_ref, dtype, f"vs reference, sizes={sizes}")
    assert_close(got, oracle.group_gemm(x, w, sizes), dtype, f"vs numpy oracle, sizes={sizes}")
    used = int(sizes.sum())
    for name, out in (("ffi", got), ("reference", want_ref)):
        tail = np.asarray(out)[used:].astype(np.float32)
        assert np.all(tail == 0), f"{name}: rows past sum(expert_sizes)={used} must be zero"


@dtypes
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=str)
def test_group_gemm_shapes(rng, shape, dtype):
    _check_gemm(rng, *shape, dtype, "random")


@pytest.mark.sanitize
@dtypes
@pytest.mark.parametrize("pattern", SIZE_PATTERNS)
def test_group_gemm_expert_sizes(rng, pattern, dtype):
    _check_gemm(rng, 90, 72, 26, 7, dtype, pattern)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_group_gemm_many_rows(rng, dtype):
    _check_gemm(rng, 70_000, 13, 7, 8, dtype, "empty_middle")  # M > 65,536, small N, K


@pytest.mark.parametrize("gather", [False, True], ids=["dense", "gather"])
def test_cpu_group_gemm_threaded_same_bits_as_serial(rng, gather):
    # The CPU handler splits a call of 2^22 multiply-adds or more into items
    # of 32 columns of one expert over XLA's thread pool (here 64 x 456 x 440
    # = 12.8M, N off the 32 columns, an empty expert), and runs smaller ones
    # on one thread (one expert's 16 rows: 3.2M). Each output is the same dot
    # product either way: the same bits, expert by expert.
    m, n, k, experts = 64, 456, 440, 5
    sizes = np.array([16, 16, 0, 16, 16], np.int32)
    w = normal(rng, (experts, n, k), jnp.bfloat16, scale=k**-0.5)
    if gather:
        x = normal(rng, (m // 2, k), jnp.bfloat16)
        rows = jnp.asarray(rng.permutation(m), jnp.int32)  # token rows[r] // 2
        whole = on_cpu(ops.group_gemm_gather, x, w, jnp.asarray(sizes), rows, 2)
        x_rows = np.asarray(x)[np.asarray(rows) // 2]
    else:
        x_rows = np.asarray(normal(rng, (m, k), jnp.bfloat16))
        whole = on_cpu(ops.group_gemm, jnp.asarray(x_rows), w, jnp.asarray(sizes))
    start = np.concatenate([[0], np.cumsum(sizes)])
    for e in np.flatnonzero(sizes):
        part = on_cpu(ops.group_gemm, jnp.asarray(x_rows[start[e]:start[e + 1]]), w[e:e + 1],
                      jnp.asarray(sizes[e:e + 1]))
        assert_equal(whole[start[e]:start[e + 1]], part, f"expert {e}, gather={gather}")


@pytest.mark.sanitize
@pytest.mark.parametrize("sizes", list(BAD_SIZES.values()), ids=list(BAD_SIZES))
def test_group_gemm_clamps_bad_sizes_like_reference(rng, sizes):
    # Not part of the seven-step contract, but both backends promise never to
    # index past their buffers: negative counts act as 0, and groups are cut
    # at M. The FFI kernels must agree with reference.py's clamping.
    x = normal(rng, (64, 24), jnp.float32)
    w = normal(rng, (4, 10, 24), jnp.float32, 0.2)
    sizes = jnp.asarray(sizes, jnp.int32)
    assert_close(ops.group_gemm(x, w, sizes), ref.group_gemm(x, w, sizes), jnp.float32)


@pytest.mark.sanitize
@dtypes
@pytest.mark.parametrize("tile_m", [None, 8, 16, 32, 128, 256])
@pytest.mark.parametrize("shape", [(1, 72, 40, 8, 2), (37, 136, 70, 6, 3), (5, 13, 9, 4, 4)],
                         ids=["T1", "T37", "K13_topk_eq_E"])
def test_group_gemm_gather_matches_expand_then_gemm(rng, shape, tile_m, dtype):
    tokens, k, n, experts, topk = shape
    x = normal(rng, (tokens, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    got = ops.group_gemm_gather(x, w, sizes, d2s, topk, tile_m=tile_m)
    want = ref.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w, sizes)
    assert got.shape == (tokens * topk, n) and got.dtype == dtype
    assert_close(got, want, dtype, f"gather, tile_m={tile_m}")
    assert_close(reference.group_gemm_gather(x, w, sizes, d2s, topk), want, dtype, "reference twin")


@pytest.mark.parametrize("bad", [0, 24, 512, -8, 8.0, "8"])
def test_group_gemm_rejects_bad_tile_m(bad):
    x = jnp.zeros((4, 8), jnp.bfloat16)
    w = jnp.zeros((2, 6, 8), jnp.bfloat16)
    sizes = jnp.asarray([2, 2], jnp.int32)
    for mod in (ops, reference):
        with pytest.raises((ValueError, TypeError), match="tile_m"):
            mod.group_gemm(x, w, sizes, tile_m=bad)
