"""The grouped GEMM against weights stored (E, K, N): ops.group_gemm's
matmul_kn, which the backward's dgrad and ragged_dot's forward run. On a
compute capability 9.0 GPU it is the sm90 kernel reading w as stored (the
w_kn form of jax_moe_group_gemm); elsewhere the other kernels against a
transposed copy. Both are checked against the reference on the transposed
weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import (BAD_SIZES, DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, ref,
                    split_rows)
from conftest import ON_GPU
from jax_moe import tuning
from jax_moe.ops.group_gemm import _group_gemm_call, matmul_kn

SM90 = tuning.sm90_device()
needs_sm90 = pytest.mark.skipif(not SM90, reason="the w_kn form runs on the sm90 kernel only")
half_dtypes = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])

# (M, K, N, E): one row; K = N = 8 with E > M; the 128x128 tiles (N < 256);
# 64x128 pingpong tiles (< 64 rows per expert); 128x256 tiles with experts
# off the tile; K off the 64-deep k tile.
SHAPES = [(1, 64, 72, 4), (77, 8, 8, 16), (300, 200, 136, 3), (1000, 136, 264, 16),
          (2100, 200, 264, 4), (530, 1000, 520, 2)]
PATTERNS = ["random", "all_in_one", "partial", "empty_first_middle_last"]


def _inputs(rng, shape, pattern, dtype):
    m, k, n, experts = shape
    x = normal(rng, (m, k), dtype)
    w = normal(rng, (experts, k, n), dtype, scale=1.0 / np.sqrt(k))
    return x, w, jnp.asarray(split_rows(rng, m, experts, pattern))


def _want(x, w, sizes):
    return ref.group_gemm(x, jnp.swapaxes(w, 1, 2), sizes)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matmul_kn_matches_reference(rng, shape, pattern, dtype):
    x, w, sizes = _inputs(rng, shape, pattern, dtype)
    got = jax.jit(matmul_kn)(x, w, sizes)
    assert got.shape == (shape[0], shape[2]) and got.dtype == dtype
    assert_close(got, _want(x, w, sizes), dtype, f"sizes={sizes}")
    assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


@needs_sm90
@pytest.mark.sanitize
@half_dtypes
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES[:3] + [(1100, 64, 256, 2)], ids=str)
def test_w_kn_kernel(rng, shape, pattern, dtype):
    # The sm90 kernel itself (tile 256, w_kn), not the choice around it.
    x, w, sizes = _inputs(rng, shape, pattern, dtype)
    got = _group_gemm_call(x, w, sizes, None, 1, tuning.SM90_TILE, w_kn=True)
    assert_close(got, _want(x, w, sizes), dtype, f"sizes={sizes}")
    assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


@needs_sm90
@pytest.mark.sanitize
@pytest.mark.parametrize("sizes", list(BAD_SIZES.values()), ids=list(BAD_SIZES))
def test_w_kn_clamps_bad_sizes_like_reference(rng, sizes):
    x = normal(rng, (64, 24), jnp.bfloat16)
    w = normal(rng, (4, 24, 16), jnp.bfloat16, 0.2)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = _group_gemm_call(x, w, sizes, None, 1, tuning.SM90_TILE, w_kn=True)
    assert_close(got, _want(x, w, sizes), jnp.bfloat16, f"sizes={sizes}")


@needs_sm90
def test_w_kn_is_bitwise_reproducible_and_matches_transposed_weights(rng):
    # One CTA sums each output over K in order (no split-K): the same bits
    # every run; against the forward layout on the transposed weights the
    # same tiles run, so the same bits too.
    x, w, sizes = _inputs(rng, (2100, 200, 264, 4), "random", jnp.bfloat16)
    first = matmul_kn(x, w, sizes)
    assert_equal(matmul_kn(x, w, sizes), first, "second run")
    nk = _group_gemm_call(x, jnp.swapaxes(w, 1, 2), sizes, None, 1, tuning.SM90_TILE)
    assert_close(first, nk, jnp.bfloat16, "w_kn vs the transposed weights")


@needs_sm90
def test_dgrad_reads_the_weights_as_stored(rng):
    # On the sm90 kernel the gradient program holds no transposed copy of w:
    # no transpose (or copy to another layout) of a w-sized array.
    x, w, sizes = _inputs(rng, (1024, 136, 264, 4), "random", jnp.bfloat16)
    w = jnp.swapaxes(w, 1, 2)  # (E, N, K): group_gemm's layout
    from jax_moe import ops

    def loss(x, w):
        return jnp.sum(ops.group_gemm(x, w, sizes).astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert "w_kn=true" in text.replace(" ", "").lower()
    assert "bf16[4,136,264]" not in text and "bf16[4,136,264]{1,2,0" not in text, \
        "a transposed copy of w"


def test_w_kn_elsewhere_is_an_error(rng):
    # Where the sm90 kernel cannot run the w_kn form (the CPU handler; f32;
    # another tile), the call fails with an error, never reads w wrongly.
    x, w, sizes = _inputs(rng, (40, 16, 24, 2), "random", jnp.float32)
    with pytest.raises(Exception, match="w_kn"):
        jax.block_until_ready(_group_gemm_call(x, w, sizes, None, 1, 128, w_kn=True))
    if not ON_GPU:
        with pytest.raises(Exception, match="w_kn"):
            jax.block_until_ready(
                _group_gemm_call(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, None, 1,
                                 tuning.SM90_TILE, w_kn=True))
