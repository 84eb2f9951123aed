"""The grouped GEMM's kernel paths, chosen by tile_m: the decode tiles (8, the
persistent form; 16, the TMA kernel), the tensor-core tiles (32, 64, 128)
and the sm90 kernel (256), at the shapes where each switches paths, against
the reference; the gpu-marked tests compare the CUDA kernels with the CPU
handler at model widths. On the CPU (one path whatever tile_m says) the
tests that are not marked gpu check the CPU handler with each tile_m
accepted."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import (BAD_SIZES, DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, gather_rows,
                    gemm_inputs, normal, on_cpu, ref, split_rows)
from conftest import ON_GPU
from jax_moe import ops

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


@pytest.mark.gpu
@dtypes
@pytest.mark.parametrize("k", [512, 517], ids=["K512", "K517_odd"])
def test_cuda_group_gemm_large(rng, k, dtype):
    # Several row tiles per expert, a K loop of many stages, N not a multiple of
    # the tile: the GPU kernel's full tile schedule, against the CPU handler
    # and the reference (both in f32 accumulation).
    m, n, experts = 3000, 390, 16
    x = normal(rng, (m, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    sizes = jnp.asarray(split_rows(rng, m - 37, experts, "empty_first_middle_last"))
    got = ops.group_gemm(x, w, sizes)
    assert_close(got, on_cpu(ops.group_gemm, x, w, sizes), dtype, "CUDA vs CPU")
    assert_close(got, ref.group_gemm(x, w, sizes), dtype, "CUDA vs reference")
    assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


# Shapes where the CUDA kernels switch paths: rows per expert around the
# decode tile (8) and the tensor-core tiles (32, 64, 128), K a multiple of 8
# but not of the 32-element k step, K odd (the decode kernel falls back to the
# 32-row tile), N not a multiple of the 64/128-column tiles, E > M.
TILE_SHAPES = [
    (1, 72, 26, 7),      # one row (decode, T = 1, k = 1)
    (16, 264, 130, 128), # E >> M: most experts empty
    (45, 264, 70, 5),    # ~9 rows per expert: one or two decode tiles each
    (300, 136, 200, 3),  # ~100 rows per expert: many tiles of every size
    (20, 13, 9, 4),      # K odd
]


# The CPU handler has one path whatever tile_m says: on CPU one tile is enough.
# 256 (the sm90 kernel) falls back to 128 for most TILE_SHAPES (N or K not a
# multiple of 8, f32); its own cases are in the tile_m = 256 section below.
GPU_TILES = [8, 16, 32, 64, 128, 256] if ON_GPU else [32]


@dtypes
@pytest.mark.parametrize("tile_m", GPU_TILES)
@pytest.mark.parametrize("pattern", ["random", "all_in_one", "partial", "empty_first_middle_last"])
@pytest.mark.parametrize("shape", TILE_SHAPES, ids=str)
def test_group_gemm_tiles(rng, shape, pattern, tile_m, dtype):
    _check_tile(rng, shape, pattern, tile_m, dtype)


def _check_tile(rng, shape, pattern, tile_m, dtype):
    """group_gemm with `tile_m` on (M, K, N, E) and a split of M by `pattern`:
    shape, dtype, the reference's values, zero rows past sum(expert_sizes)."""
    m, _, n, _ = shape
    x, w, sizes = gemm_inputs(rng, shape, pattern, dtype)
    got = ops.group_gemm(x, w, sizes, tile_m=tile_m)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, ref.group_gemm(x, w, sizes), dtype, f"tile_m={tile_m}, sizes={sizes}")
    assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


@pytest.mark.sanitize
@pytest.mark.parametrize("tile_m", [8, 32, 64, 128])
def test_group_gemm_tiles_small_sanitize(rng, tile_m):
    # Small cases of every tile for compute-sanitizer: empty experts, a
    # partial tail, K and N off the tile sizes.
    for shape in [(1, 72, 26, 7), (45, 264, 70, 5), (20, 13, 9, 4)]:
        x, w, sizes = gemm_inputs(rng, shape, "partial", jnp.bfloat16)
        assert_close(ops.group_gemm(x, w, sizes, tile_m=tile_m), ref.group_gemm(x, w, sizes),
                     jnp.bfloat16, f"tile_m={tile_m} shape={shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [8, 16, 32, 64, 128, 256])
def test_cuda_group_gemm_tiles_large(rng, tile_m):
    # Real model widths (K = 2048, N = 1536) with decode- and prefill-like
    # routings, CUDA against the CPU handler.
    for m, experts in [(8, 128), (1024, 128), (4096, 16)]:
        x = normal(rng, (m, 2048), jnp.bfloat16)
        w = normal(rng, (experts, 1536, 2048), jnp.bfloat16, scale=2048**-0.5)
        sizes = jnp.asarray(split_rows(rng, m, experts, "random"))
        got = ops.group_gemm(x, w, sizes, tile_m=tile_m)
        assert_close(got, on_cpu(ops.group_gemm, x, w, sizes), jnp.bfloat16,
                     f"CUDA tile_m={tile_m} m={m} vs CPU")


# On the GPU the decode tile (8) runs persistent, one resident grid that walks
# the tiles, when a launch has at least 6 waves of resident blocks (4 per SM);
# TILE_SHAPES above are below that and run a block per tile. These have over
# 5,000 blocks of 8 x 32 (enough up to ~200 SMs; the H200 has 132), with N off
# the 32 columns and K off the 32-element k step; E = 1100 is past the
# persistent kernel's 1024 experts (the block-per-tile form runs).
PERSIST_SHAPES = [(600, 72, 2000, 16), (1000, 128, 1030, 130), (3000, 8, 200, 1100)]


def test_group_gemm_decode_tile_forms_agree_bitwise(rng):
    # N = 2000 runs the persistent form on the GPU (5,796 blocks), its first 64
    # columns alone the block per tile (184 blocks); both sum K (17 k steps of
    # 32, so two per warp) in the same order: the same bits.
    x, w, sizes = gemm_inputs(rng, (600, 520, 2000, 16), "empty_first_middle_last",
                              jnp.bfloat16)
    wide = ops.group_gemm(x, w, sizes, tile_m=8)
    narrow = ops.group_gemm(x, w[:, :64], sizes, tile_m=8)
    assert_equal(wide[:, :64], narrow, "persistent vs block per tile")


# The decode kernels on a gather large enough for their own schedules: the
# persistent tile-8 form, and the TMA kernel (tile 16), whose producer applies
# the gather index (cp.async of the token rows, zero-filled for out-of-range
# entries).
@pytest.mark.sanitize
@pytest.mark.parametrize("tile_m", [8, 16], ids=["persistent", "tma"])
def test_group_gemm_gather_decode_tiles(rng, tile_m):
    tokens, k, n, experts, topk = 300, 72, 2000, 16, 4
    x = normal(rng, (tokens, k), jnp.bfloat16)
    w = normal(rng, (experts, n, k), jnp.bfloat16, scale=1.0 / np.sqrt(k))
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    got = ops.group_gemm_gather(x, w, sizes, d2s, topk, tile_m=tile_m)
    want = ref.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w, sizes)
    assert_close(got, want, jnp.bfloat16, f"gather, tile_m={tile_m}")


# tile_m = 16 on the GPU (compute capability 9.0+, bf16/f16, K % 8 == 0) runs
# the TMA decode kernel when a launch has at least 6 tiles of 16 x 128 per SM
# (792 on the H200's 132 SMs); below, and past 1024
# experts, the decode kernel (8) runs. These have over 1,100 tiles, with N off
# the 128 columns, K off the 64-element box (K = 24: one partial box; 136: a
# last box of 8, half an mma k step), 1-16 rows per tile, and E = 1100 for
# the fallback. On the CPU tile_m is checked and otherwise unused.
TMA_SHAPES = [(1700, 24, 1500, 16), (600, 136, 2600, 16), (3000, 8, 200, 1100)]


# The decode kernels with their own schedules, at the shapes above: the
# persistent tile-8 form and the TMA kernel (tile 16).
@dtypes
@pytest.mark.parametrize("pattern", ["random", "all_in_one", "partial", "empty_first_middle_last"])
@pytest.mark.parametrize("tile_m, shape",
                         [(8, s) for s in PERSIST_SHAPES] + [(16, s) for s in TMA_SHAPES],
                         ids=[f"persistent-{s}" for s in PERSIST_SHAPES] +
                             [f"tma-{s}" for s in TMA_SHAPES])
def test_group_gemm_decode_tiles_large(rng, tile_m, shape, pattern, dtype):
    _check_tile(rng, shape, pattern, tile_m, dtype)


@pytest.mark.parametrize("tile_m, shape", [(16, (600, 136, 2600, 16)), (256, (2100, 200, 264, 4)),
                                           (256, (300, 200, 264, 4))],
                         ids=["tma", "sm90_cutlass", "sm90_own"])
def test_group_gemm_is_bitwise_reproducible(rng, tile_m, shape):
    # The TMA decode kernel (tile 16: one warp sums each output over all of K
    # in k order) and the Hopper kernels (tile 256; CUTLASS's above 128 rows
    # an expert, the own one below, whose CTAs take tiles from a counter in
    # any order: no split-K or stream-K in either): the same bits every run,
    # eager or jitted.
    x, w, sizes = gemm_inputs(rng, shape, "random", jnp.bfloat16)
    first = ops.group_gemm(x, w, sizes, tile_m=tile_m)
    assert_equal(ops.group_gemm(x, w, sizes, tile_m=tile_m), first, "second eager run")
    jitted = jax.jit(functools.partial(ops.group_gemm, tile_m=tile_m))
    assert_equal(jitted(x, w, sizes), first, "jitted run")
    assert_equal(jitted(x, w, sizes), first, "second jitted run")


# ------------------------------------------------- tile_m = 256: the sm90 kernel
# On a compute capability 9.0 GPU (H100/H200) of a build with CUTLASS,
# tile_m = 256 runs the CUTLASS wgmma/TMA kernel
# (csrc/kernels/cuda/group_gemm/gemm_sm90a.cu) for bf16/f16 with N and K
# multiples of 8; everywhere else (CPU, other GPUs, f32, other N or K) the
# 128-row tile. On CPU these tests check the CPU handler with tile_m = 256
# accepted.

half_dtypes = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])

# Where the sm90 kernel switches paths: M off its 64/128-row tiles; N and K
# odd multiples of 8 (TMA's 16-byte rows) around its 64-deep k tile and its
# 128/256-column tiles; E > M; experts averaging < 64 rows (64x128 pingpong
# tiles), else 128x256 tiles where N >= 256 and 128x128 where N < 256.
SM90_SHAPES = [  # (M, K, N, E)
    (1, 64, 72, 4),        # one row (64x128 tiles)
    (77, 8, 8, 16),        # K = N = 8: a sliver of one k tile and one column tile; E > M
    (300, 200, 136, 3),    # K = 25*8, N = 17*8 < 256; 100 rows per expert: 128x128
    (1000, 136, 264, 16),  # ~62 rows per expert: several 64x128 tiles, N past 256
    (1024, 136, 264, 16),  # 64 rows per expert, N >= 256: 128x256 from here
    (512, 200, 264, 4),    # 128 rows per expert: the own kernel's last
    (516, 200, 264, 4),    # 129: CUTLASS's first (WGMMA_MAX_AVG_ROWS)
    (1020, 200, 264, 4),   # 255 rows per expert: 128x256, experts off the tile
    (1024, 200, 264, 4),   # 256 rows per expert: 128x256 tiles
    (2100, 200, 264, 4),   # ~525 rows per expert: 128x256 tiles, experts off the tile
]


@half_dtypes
@pytest.mark.parametrize("pattern", ["random", "all_in_one", "partial", "empty_first_middle_last"])
@pytest.mark.parametrize("shape", SM90_SHAPES, ids=str)
def test_group_gemm_sm90(rng, shape, pattern, dtype):
    _check_tile(rng, shape, pattern, 256, dtype)


# Past the own kernel's 1024 experts CUTLASS's kernel runs at any rows count:
# 64x128 pingpong tiles while the experts average < 64 rows, else 128x256
# tiles where N >= 256 and 128x128 where N < 256. Checked against the numpy
# oracle (ragged_dot's dense lowering over 1030 experts is slow on the CPU).
SM90_MANY_EXPERTS_SHAPES = [  # (M, K, N, E)
    (3000, 136, 264, 1030),   # ~3 rows per expert: 64x128 tiles, N past 256
    (70000, 8, 264, 1030),    # ~68 rows per expert: 128x256 tiles
    (70000, 24, 136, 1030),   # N < 256: 128x128 tiles
]


@half_dtypes
@pytest.mark.parametrize("pattern", ["random", "all_in_one", "empty_first_middle_last"])
@pytest.mark.parametrize("shape", SM90_MANY_EXPERTS_SHAPES, ids=str)
def test_group_gemm_sm90_past_1024_experts(rng, shape, pattern, dtype):
    m, _, n, _ = shape
    x, w, sizes = gemm_inputs(rng, shape, pattern, dtype)
    got = ops.group_gemm(x, w, sizes, tile_m=256)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, oracle.group_gemm(x, w, sizes), dtype, f"sizes={sizes}")
    assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


@pytest.mark.sanitize
def test_group_gemm_sm90_small_sanitize(rng):
    # Small cases for compute-sanitizer: one row and E > M with a partial
    # tail (64x128 tiles), one expert with every row (128x128 tiles, N < 256),
    # and 128x256 tiles (~550 rows per expert).
    for (m, k, n, experts), pattern in [((1, 64, 72, 4), "partial"), ((77, 8, 8, 16), "partial"),
                                        ((300, 200, 136, 3), "all_in_one"),
                                        ((1100, 64, 256, 2), "partial"),
                                        ((1100, 64, 256, 2), "all_in_one")]:
        x, w, sizes = gemm_inputs(rng, (m, k, n, experts), pattern, jnp.bfloat16)
        got = ops.group_gemm(x, w, sizes, tile_m=256)
        assert_close(got, ref.group_gemm(x, w, sizes), jnp.bfloat16, f"m={m} sizes={sizes}")
        assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


@pytest.mark.sanitize
@half_dtypes
@pytest.mark.parametrize("tail", [False, True], ids=["all_rows", "tail"])
@pytest.mark.parametrize("shape", [(1, 72, 40, 8, 2), (37, 136, 72, 6, 3), (300, 200, 136, 4, 2),
                                   (600, 64, 256, 2, 2), (2200, 64, 136, 4, 2),
                                   (40, 2056, 72, 4, 3), (256, 64, 264, 4, 2),
                                   (258, 64, 264, 4, 2), (40, 2056, 72, 1030, 3)],
                         ids=["T1", "T37", "T300", "T600_wide", "T2200", "T40_K2056",
                              "T256_own_last", "T258_cutlass_first", "T40_K2056_1030_experts"])
def test_group_gemm_gather_sm90(rng, shape, tail, dtype):
    # Experts averaging at most 128 rows (T1, T37, T40_K2056, T256: 512 rows
    # over 4) run the own kernel, which reads the token rows itself; from 129
    # (T258: 516 rows over 4), and past the own kernel's 1024 experts at any
    # rows count, CUTLASS's path expands the gathered rows (invalid entries: zero rows)
    # before its GEMM: 4400 rows (T2200) are more than one pass of the prep
    # grid (8 blocks per SM, 1056 rows on 132 SMs); K = 2056 (257 16-byte
    # vectors) takes two passes of its 256 threads along a row. With `tail`,
    # the last non-empty expert's rows are left out of expert_sizes: they
    # must come out zero.
    tokens, k, n, experts, topk = shape
    x = normal(rng, (tokens, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    if tail:
        s = np.asarray(sizes).copy()
        s[np.flatnonzero(s)[-1]] = 0
        sizes = jnp.asarray(s)
    got = ops.group_gemm_gather(x, w, sizes, d2s, topk, tile_m=256)
    want = oracle.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w, sizes)
    assert got.shape == (tokens * topk, n) and got.dtype == dtype
    assert_close(got, want, dtype, f"gather, tile_m=256, sizes={sizes}")
    assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


# bf16 kernels with their own tile schedule, on expert_sizes outside the
# contract: the sm90 kernel (tile_m = 256), the persistent decode form
# (tile_m = 8, N = 16000: 13 m-slots x 500 column tiles) and the TMA decode
# kernel (tile_m = 16: 9 m-slots x 125 column tiles).
@pytest.mark.sanitize
@pytest.mark.parametrize("tile_m, n", [(256, 16), (8, 16000), (16, 16000)],
                         ids=["sm90", "decode_persistent", "decode_tma"])
@pytest.mark.parametrize("sizes", list(BAD_SIZES.values()), ids=list(BAD_SIZES))
def test_group_gemm_bf16_kernels_clamp_bad_sizes_like_reference(rng, sizes, tile_m, n):
    x = normal(rng, (64, 24), jnp.bfloat16)
    w = normal(rng, (4, n, 24), jnp.bfloat16, 0.2)
    sizes = jnp.asarray(sizes, jnp.int32)
    assert_close(ops.group_gemm(x, w, sizes, tile_m=tile_m), ref.group_gemm(x, w, sizes),
                 jnp.bfloat16, f"tile_m={tile_m}")


@pytest.mark.sanitize
@pytest.mark.parametrize("case", ["f32", "K_not_8x", "N_not_8x"])
def test_group_gemm_sm90_falls_back(rng, case):
    # Outside the sm90 kernel's problems tile_m = 256 runs the 128-row tile:
    # correct, and bit for bit what tile_m = 128 gives.
    dtype, k, n = {"f32": (jnp.float32, 64, 72), "K_not_8x": (jnp.bfloat16, 204, 136),
                   "N_not_8x": (jnp.float16, 200, 130)}[case]
    x, w, sizes = gemm_inputs(rng, (300, k, n, 3), "partial", dtype)
    got = ops.group_gemm(x, w, sizes, tile_m=256)
    assert_close(got, ref.group_gemm(x, w, sizes), dtype, f"{case}, sizes={sizes}")
    assert_equal(got, ops.group_gemm(x, w, sizes, tile_m=128), f"{case}: tile_m=256 vs 128")


def test_group_gemm_sm90_jit_new_routing(rng):
    # One executable (and, on the GPU, possibly one recorded CUDA graph) for
    # every routing: the group shapes are computed on the device per call.
    tokens, k, n, experts, topk = 256, 136, 264, 4, 2

    @jax.jit
    def two_gemms(x, w1, w2, d2s, sizes):
        h = ops.group_gemm_gather(x, w1, sizes, d2s, topk, tile_m=256)
        return ops.group_gemm(jnp.tanh(h), w2, sizes, tile_m=256)

    x = normal(rng, (tokens, k), jnp.bfloat16)
    w1 = normal(rng, (experts, n, k), jnp.bfloat16, scale=1.0 / np.sqrt(k))
    w2 = normal(rng, (experts, k, n), jnp.bfloat16, scale=1.0 / np.sqrt(n))
    for trial in range(3):
        d2s, sizes = gather_rows(rng, tokens, topk, experts, extra_invalid=trial > 0)
        h = ref.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w1, sizes)
        want = ref.group_gemm(jnp.tanh(h), w2, sizes)
        # Both GEMMs round to bf16; allow two roundings' worth.
        assert_close(two_gemms(x, w1, w2, d2s, sizes), want, jnp.bfloat16, f"routing {trial}",
                     rtol=2e-2)


def test_group_gemm_sm90_scratch_bytes():
    # The host-side sizing of the sm90 kernel's scratch (CUTLASS's workspace
    # size without device data): runs wherever the build has the kernel.
    from jax_moe._ffi import HAS_SM90_GEMM, _ext
    if not HAS_SM90_GEMM:
        pytest.skip("built without the sm90 kernel")
    size = _ext.group_gemm_sm90_scratch_bytes
    base = size(1000, 136, 16, False)
    assert base >= 2 * 128 * 144  # at least the A and B TMA descriptors of 144 SMs
    assert size(5, 136, 16, False) == base  # without a gather, M does not matter
    assert size(1000, 136, 16, True) >= base + 1000 * 136 * 2  # the expanded rows
    assert size(1000, 136, 4096, False) > base  # per-expert shapes, pointers, strides


@pytest.mark.parametrize("tile_m", [128, 256])
@pytest.mark.parametrize("m, experts", [(256, 4), (1024, 4), (256, 1030)])
def test_group_gemm_scratch_output_only_for_sm90(rng, tile_m, m, experts):
    # The custom call's second output is the Hopper kernels' scratch: the own
    # kernel's 16-byte tile counter where experts average at most
    # WGMMA_MAX_AVG_ROWS rows (m = 256 over 4 experts) and are at most 1024,
    # CUTLASS's arrays sized by the extension elsewhere (m = 1024 over 4;
    # 1030 experts), empty where neither runs.
    from jax_moe import tuning
    from jax_moe._ffi import _ext
    k, n = 64, 72
    x = normal(rng, (m, k), jnp.bfloat16)
    w = normal(rng, (experts, n, k), jnp.bfloat16)
    sizes = jnp.asarray(split_rows(rng, m, experts, "random"))
    text = jax.jit(functools.partial(ops.group_gemm, tile_m=tile_m)).lower(x, w, sizes).as_text()
    scratch = [int(b) for b in re.findall(r"tensor<(\d+)xui8>", text)]
    if tile_m != 256 or not tuning.sm90_usable(n, k, jnp.bfloat16):
        want = 0
    elif m <= tuning.WGMMA_MAX_AVG_ROWS * experts and experts <= 1024:
        want = 16
    else:
        want = _ext.group_gemm_sm90_scratch_bytes(m, k, experts, False)
    assert scratch == [want], text


@pytest.mark.gpu
def test_cuda_sm90_path_is_built_for_hopper():
    # On an H100/H200 the tile_m = 256 tests above must reach the sm90 kernel:
    # the build must include it and the device check must accept the GPU.
    from jax_moe import tuning
    hw = tuning.hardware()
    if hw is None or tuple(hw["compute_capability"]) != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    import jax_moe
    assert jax_moe.HAS_SM90_GEMM, "built without CUTLASS: tile_m=256 ran the 128-row tile"
    assert tuning.sm90_device() and tuning.sm90_usable(264, 200, jnp.bfloat16)
    assert tuning.group_gemm_tile_m(65536, 128, 1536, 2048, jnp.bfloat16) == 256


@pytest.mark.gpu
def test_cuda_group_gemm_sm90_large(rng):
    # Real model widths (K = 2048, N = 1536): decode-like (most experts empty),
    # ~256 rows per expert and ~1024 (128x256 tiles), CUDA against the CPU
    # handler.
    for m, experts in [(8, 128), (4096, 16), (8192, 8)]:
        x = normal(rng, (m, 2048), jnp.bfloat16)
        w = normal(rng, (experts, 1536, 2048), jnp.bfloat16, scale=2048**-0.5)
        sizes = jnp.asarray(split_rows(rng, m, experts, "random"))
        got = ops.group_gemm(x, w, sizes, tile_m=256)
        assert_close(got, on_cpu(ops.group_gemm, x, w, sizes), jnp.bfloat16,
                     f"CUDA tile_m=256 m={m} vs CPU")
