"""group_gemm_wgrad at sizes where the CUDA kernels' schedules matter: many
32-row steps per expert, N and K off the 64 x 64 output tiles, the Hopper
kernel's problems (bf16/f16, N and K multiples of 8) and the portable
kernel's (anything else), against the CPU handler and the reference. The
gpu-marked tests need a GPU; the others run on every backend (on the CPU they
check the CPU handler), and those marked sanitize are compute-sanitizer's
small cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import (BAD_SIZES, DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, gather_rows,
                    normal, on_cpu, split_rows)
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
half_dtypes = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
ref_wgrad = jax.jit(reference.group_gemm_wgrad, static_argnames=("topk",))

# (N, K): the Hopper kernel's problems on an H100/H200 for bf16/f16 (both
# multiples of 8), and the portable kernel's everywhere (N, K odd).
WIDTHS = {"hopper": (264, 520), "portable": (262, 517)}


def _zero_where_empty(got, sizes, m, what):
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), m)
    for e in np.flatnonzero(np.diff(np.concatenate([[0], ends])) == 0):
        assert np.all(np.asarray(got[e]).astype(np.float32) == 0), f"{what}: expert {e}"


@pytest.mark.gpu
@dtypes
@pytest.mark.parametrize("pattern", ["random", "all_in_one", "empty_first_middle_last"])
@pytest.mark.parametrize("width", list(WIDTHS))
def test_cuda_wgrad_large(rng, width, pattern, dtype):
    # M = 3000 over 7 experts (the last 37 rows past the groups): hundreds of
    # rows per expert, one expert with all of them, empty ones.
    m, experts = 3000, 7
    n, k = WIDTHS[width]
    dy, x = normal(rng, (m, n), dtype), normal(rng, (m, k), dtype)
    sizes = jnp.asarray(split_rows(rng, m - 37, experts, pattern))
    got = ops.group_gemm_wgrad(dy, x, sizes)
    assert_close(got, on_cpu(ops.group_gemm_wgrad, dy, x, sizes), dtype, "CUDA vs CPU")
    assert_close(got, ref_wgrad(dy, x, sizes), dtype, "CUDA vs reference")
    _zero_where_empty(got, sizes, m, f"{width} {pattern}")


@pytest.mark.gpu
@half_dtypes
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("topk", [1, 4])
def test_cuda_wgrad_gather_large(rng, topk, width, dtype):
    tokens, experts = 3000 // topk, 9
    n, k = WIDTHS[width]
    dy = normal(rng, (tokens * topk, n), dtype)
    x = normal(rng, (tokens, k), dtype)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    got = ops.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk)
    want_cpu = on_cpu(lambda *a: ops.group_gemm_wgrad(*a[:3], dst_to_src=a[3], topk=topk),
                      dy, x, sizes, d2s)
    assert_close(got, want_cpu, dtype, "CUDA vs CPU")
    assert_close(got, ref_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk), dtype,
                 "CUDA vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize("m, experts, n, k", [(8192, 8, 512, 1024), (2048, 64, 256, 512)])
def test_cuda_wgrad_model_widths(rng, m, experts, n, k):
    # bf16 at wider N and K: the Hopper kernel's problem on an H100/H200
    # (~1000 rows per expert; ~32 per expert, three experts empty).
    dy = normal(rng, (m, n), jnp.bfloat16, scale=0.1)
    x = normal(rng, (m, k), jnp.bfloat16)
    sizes = jnp.asarray(split_rows(rng, m, experts, "empty_first_middle_last"))
    got = ops.group_gemm_wgrad(dy, x, sizes)
    assert_close(got, on_cpu(ops.group_gemm_wgrad, dy, x, sizes), jnp.bfloat16, "CUDA vs CPU")
    _zero_where_empty(got, sizes, m, f"m={m}")


@pytest.mark.parametrize("dtype, width", [(jnp.bfloat16, "hopper"), (jnp.bfloat16, "portable"),
                                          (jnp.float32, "hopper")],
                         ids=["bf16-hopper", "bf16-portable", "f32"])
def test_wgrad_bitwise_reproducible_large(rng, dtype, width):
    # No atomics, no split over rows: the same bits on every run, eager or jitted.
    m, experts = 2100, 5
    n, k = WIDTHS[width]
    dy, x = normal(rng, (m, n), dtype), normal(rng, (m, k), dtype)
    sizes = jnp.asarray(split_rows(rng, m, experts, "random"))
    first = ops.group_gemm_wgrad(dy, x, sizes)
    assert_equal(ops.group_gemm_wgrad(dy, x, sizes), first, "second eager run")
    jitted = jax.jit(ops.group_gemm_wgrad)
    assert_equal(jitted(dy, x, sizes), first, "jitted run")
    assert_equal(jitted(dy, x, sizes), first, "second jitted run")


def test_wgrad_more_experts_than_a_grid_dimension(rng):
    # 70,000 experts: past the 65,535 blocks of a CUDA grid's y dimension,
    # which the portable kernel strides over.
    m, n, k, experts = 50, 3, 2, 70_000
    dy, x = normal(rng, (m, n), jnp.float32), normal(rng, (m, k), jnp.float32)
    sizes = np.zeros(experts, np.int32)
    sizes[[0, 5, 65_535, 65_540, experts - 1]] = [10, 10, 10, 10, 10]
    got = ops.group_gemm_wgrad(dy, x, jnp.asarray(sizes))
    want = np.zeros((experts, n, k), np.float32)
    for i, e in enumerate([0, 5, 65_535, 65_540, experts - 1]):
        rows = slice(10 * i, 10 * i + 10)
        want[e] = np.asarray(dy[rows]).astype(np.float64).T @ np.asarray(x[rows])
    assert_close(got, want, jnp.float32, "70,000 experts")


# ---- compute-sanitizer's small cases (every edge of both kernels' bounds) ------------

@pytest.mark.sanitize
@half_dtypes
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("pattern", ["partial", "all_in_one", "empty_first_middle_last"])
def test_wgrad_small_sanitize(rng, pattern, width, dtype):
    # 100 rows (partial: some past the groups) over 6 experts, N and K across
    # the tile edges.
    m, experts = 100, 6
    n, k = WIDTHS[width]
    dy, x = normal(rng, (m, n), dtype), normal(rng, (m, k), dtype)
    sizes = jnp.asarray(split_rows(rng, m, experts, pattern))
    got = ops.group_gemm_wgrad(dy, x, sizes)
    assert_close(got, ref_wgrad(dy, x, sizes), dtype, f"{width} {pattern}")
    _zero_where_empty(got, sizes, m, f"{width} {pattern}")


@pytest.mark.sanitize
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("sizes", list(BAD_SIZES.values()), ids=list(BAD_SIZES))
def test_wgrad_bf16_clamps_bad_sizes_sanitize(rng, sizes, width):
    n, k = WIDTHS[width]
    dy, x = normal(rng, (64, n), jnp.bfloat16), normal(rng, (64, k), jnp.bfloat16)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = ops.group_gemm_wgrad(dy, x, sizes)
    assert_close(got, ref_wgrad(dy, x, sizes), jnp.bfloat16, f"{width}")


@pytest.mark.sanitize
@pytest.mark.parametrize("width", list(WIDTHS))
def test_wgrad_gather_sanitize(rng, width):
    # -1, T * topk and -2^30 entries in dst_to_src; one token; M = 0.
    n, k = WIDTHS[width]
    for tokens, topk in [(37, 3), (1, 2)]:
        dy = normal(rng, (tokens * topk, n), jnp.bfloat16)
        x = normal(rng, (tokens, k), jnp.bfloat16)
        d2s, sizes = gather_rows(rng, tokens, topk, 4)
        got = ops.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk)
        assert_close(got, ref_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk), jnp.bfloat16,
                     f"T={tokens} topk={topk}")
    empty = ops.group_gemm_wgrad(jnp.zeros((0, n), jnp.bfloat16), x, jnp.asarray([0, 0, 0]),
                                 dst_to_src=jnp.zeros((0,), jnp.int32), topk=2)
    assert_equal(empty, np.zeros((3, n, k), jnp.bfloat16), "M = 0")
