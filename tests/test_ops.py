"""Each op of jax_moe.ops against its twin in jax_moe.reference and against the
plain-numpy oracle (tests/oracle.py), on fresh random inputs.

Runs on the default backend: the CPU handlers here, the CUDA ones under
JAX_PLATFORMS=cuda. The `gpu` tests also compare CUDA with the CPU handlers.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import (DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, on_cpu,
                    random_ids, ref, router_logits, routing_allowed, split_rows)
from conftest import ON_GPU
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


def test_every_target_registered_for_every_built_platform():
    from jax_moe._ffi import HAS_CUDA, _ext
    regs = _ext.registrations()
    want = {"jax_moe_route", "jax_moe_token_index", "jax_moe_expand",
            "jax_moe_group_gemm", "jax_moe_expert_mlp", "jax_moe_activation", "jax_moe_combine",
            "jax_moe_moe_layer", "jax_moe_moe_decode", "jax_moe_write_kv", "jax_moe_paged_decode", "jax_moe_fill_rows"}
    assert set(regs) == ({"cpu", "CUDA"} if HAS_CUDA else {"cpu"})
    for platform, targets in regs.items():
        assert set(targets) == want, platform


def test_host_platform_has_eight_devices():
    # conftest.py sets --xla_force_host_platform_device_count=8 for shard_map tests.
    assert len(jax.devices("cpu")) == 8


# ---------------------------------------------------------------- step 1: router

TOPK_SHAPES = [  # (T, E, k)
    (1, 1, 1),      # one token, one expert
    (1, 8, 8),      # topk = E
    (5, 8, 1),
    (33, 8, 2),
    (130, 64, 6),
    (257, 13, 13),  # odd E, topk = E
    (64, 160, 8),
    (32, 256, 8),
    (8, 1000, 10),
    (3, 100, 100),  # topk = E > 32: each lane of the CUDA warp holds several picks
    (4, 3072, 40),  # the most experts the CUDA router takes, k > 32
]


@dtypes
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", TOPK_SHAPES, ids=str)
def test_topk_softmax(rng, shape, dtype, renormalize):
    tokens, experts, k = shape
    logits = normal(rng, (tokens, experts), dtype, scale=2.0)
    weights, ids = ops.topk_softmax(logits, k, renormalize)
    assert weights.shape == (tokens, k) and weights.dtype == jnp.float32
    assert ids.shape == (tokens, k) and ids.dtype == jnp.int32

    ref_w, ref_ids = ref.topk_softmax(logits, k, renormalize)
    np_w, np_ids = oracle.topk_softmax(logits, k, renormalize)
    # Low-precision logits can tie; both sides break ties to the lower id, so ids match exactly.
    assert_equal(ids, ref_ids, "ids vs reference")
    assert_equal(ids, np_ids, "ids vs numpy oracle")
    # The weights are f32 whatever the logits' dtype (bf16/f16 logits convert exactly).
    assert_close(weights, ref_w, jnp.float32, "weights vs reference")
    assert_close(weights, np_w, jnp.float32, "weights vs numpy oracle")
    if renormalize:
        np.testing.assert_allclose(np.asarray(weights).sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_all_equal_logits_pick_lowest_ids(rng, impl, k):
    experts, tokens = 8, 17
    value = rng.standard_normal((tokens, 1))
    logits = jnp.asarray(np.broadcast_to(value, (tokens, experts)), jnp.float32)
    fn = ops.topk_softmax if impl == "ffi" else ref.topk_softmax
    for renormalize, weight in ((True, 1.0 / k), (False, 1.0 / experts)):
        weights, ids = fn(logits, k, renormalize)
        assert_equal(ids, np.broadcast_to(np.arange(k, dtype=np.int32), (tokens, k)),
                     "ties go to the lower expert id")
        np.testing.assert_allclose(np.asarray(weights), weight, rtol=1e-6)


@dtypes
def test_topk_with_many_ties_matches_stable_sort(rng, dtype):
    # Integer logits from a small range: most rows have ties at the k-th place.
    logits = jnp.asarray(rng.integers(-2, 3, size=(300, 16)), dtype)
    np_w, np_ids = oracle.topk_softmax(logits, 5, True)
    for fn in (ops.topk_softmax, ref.topk_softmax):
        weights, ids = fn(logits, 5, True)
        assert_equal(ids, np_ids, f"{fn}: ids vs stable argsort")
        assert_close(weights, np_w, jnp.float32, f"{fn}: weights")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_topk_softmax_many_tokens(rng, dtype):
    tokens, experts, k = 20_000, 16, 4  # T*k = 80,000 > 65,536
    logits = normal(rng, (tokens, experts), dtype, scale=2.0)
    weights, ids = ops.topk_softmax(logits, k)
    np_w, np_ids = oracle.topk_softmax(logits, k)
    assert_equal(ids, np_ids, "ids")
    assert_close(weights, np_w, jnp.float32, "weights")


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_topk_masked_experts_are_never_picked(rng, impl):
    # -inf logits (masked experts) get weight 0 and are not chosen while enough
    # finite experts remain.
    logits = rng.standard_normal((50, 8)).astype(np.float32)
    masked = rng.choice(8, size=3, replace=False)
    logits[:, masked] = -np.inf
    fn = ops.topk_softmax if impl == "ffi" else ref.topk_softmax
    weights, ids = fn(jnp.asarray(logits), 5, False)
    np_w, np_ids = oracle.topk_softmax(logits, 5, False)
    assert not np.isin(np.asarray(ids), masked).any()
    assert_equal(ids, np_ids, "ids")
    assert_close(weights, np_w, jnp.float32, "weights")


@dtypes
def test_topk_large_logits(rng, dtype):
    # |logits| up to ~4000: the softmax must subtract the row max (no overflow).
    logits = normal(rng, (64, 16), dtype, scale=1000.0)
    weights, ids = ops.topk_softmax(logits, 4, False)
    np_w, np_ids = oracle.topk_softmax(logits, 4, False)
    assert_equal(ids, np_ids, "ids")
    assert_close(weights, np_w, jnp.float32, "weights")


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_topk_nan_logits_are_never_picked(rng, impl):
    # The kernels treat a NaN logit as -inf (never preferred); reference.py too.
    logits = rng.standard_normal((40, 8)).astype(np.float32)
    nan_at = rng.random((40, 8)) < 0.3
    nan_at[:, :4] = False  # at least four finite experts per row
    logits[nan_at] = np.nan
    fn = ops.topk_softmax if impl == "ffi" else ref.topk_softmax
    weights, ids = fn(jnp.asarray(logits), 4, True)
    np_w, np_ids = oracle.topk_softmax(np.where(nan_at, -np.inf, logits), 4, True)
    assert not np.take_along_axis(nan_at, np.asarray(ids), axis=1).any()
    assert_equal(ids, np_ids, "ids")
    assert np.all(np.isfinite(np.asarray(weights)))
    assert_close(weights, np_w, jnp.float32, "weights")


# ----------------------------------------------------------------- step 2: index

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


# ---------------------------------------------------------------- step 3: expand

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


# ----------------------------------------------------------- steps 4, 6: group GEMM

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


# expert_sizes outside the contract (for 64 rows, 4 experts): each GEMM path
# must clamp them as reference.py does.
BAD_SIZES = {"oversized_first": [90, 5, 0, 0], "negative": [5, -3, 70, 20],
             "negative_first_oversized_last": [-5, 10, 4, 100], "sum_past_m": [30, 30, 30, 30]}


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


def _gemm_inputs(rng, shape, pattern, dtype):
    """x (M, K), w (E, N, K) and expert_sizes (a split of M by `pattern`) for
    shape (M, K, N, E)."""
    m, k, n, experts = shape
    x = normal(rng, (m, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    return x, w, jnp.asarray(split_rows(rng, m, experts, pattern))


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
    x, w, sizes = _gemm_inputs(rng, shape, pattern, dtype)
    got = ops.group_gemm(x, w, sizes, tile_m=tile_m)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, ref.group_gemm(x, w, sizes), dtype, f"tile_m={tile_m}, sizes={sizes}")
    assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


def _gather_rows(rng, tokens, topk, experts, extra_invalid=True):
    """dst_to_src of a random routing, plus -1 and out-of-range entries."""
    ids = jnp.asarray(random_ids(rng, tokens, topk, experts))
    _, dst_to_src, sizes = ref.moe_compute_token_index(ids, num_experts=experts)
    d2s = np.asarray(dst_to_src).copy()
    if extra_invalid and d2s.size >= 3:
        d2s[rng.integers(d2s.size)] = -1
        d2s[rng.integers(d2s.size)] = tokens * topk      # one past the last valid entry
        d2s[rng.integers(d2s.size)] = -(1 << 30)
    return jnp.asarray(d2s), sizes


@pytest.mark.sanitize
@dtypes
@pytest.mark.parametrize("tile_m", [None, 8, 16, 32, 128, 256])
@pytest.mark.parametrize("shape", [(1, 72, 40, 8, 2), (37, 136, 70, 6, 3), (5, 13, 9, 4, 4)],
                         ids=["T1", "T37", "K13_topk_eq_E"])
def test_group_gemm_gather_matches_expand_then_gemm(rng, shape, tile_m, dtype):
    tokens, k, n, experts, topk = shape
    x = normal(rng, (tokens, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    d2s, sizes = _gather_rows(rng, tokens, topk, experts)
    got = ops.group_gemm_gather(x, w, sizes, d2s, topk, tile_m=tile_m)
    want = ref.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w, sizes)
    assert got.shape == (tokens * topk, n) and got.dtype == dtype
    assert_close(got, want, dtype, f"gather, tile_m={tile_m}")
    assert_close(reference.group_gemm_gather(x, w, sizes, d2s, topk), want, dtype, "reference twin")


@pytest.mark.sanitize
@pytest.mark.parametrize("tile_m", [8, 32, 64, 128])
def test_group_gemm_tiles_small_sanitize(rng, tile_m):
    # Small cases of every tile for compute-sanitizer: empty experts, a
    # partial tail, K and N off the tile sizes.
    for shape in [(1, 72, 26, 7), (45, 264, 70, 5), (20, 13, 9, 4)]:
        x, w, sizes = _gemm_inputs(rng, shape, "partial", jnp.bfloat16)
        assert_close(ops.group_gemm(x, w, sizes, tile_m=tile_m), ref.group_gemm(x, w, sizes),
                     jnp.bfloat16, f"tile_m={tile_m} shape={shape}")


@pytest.mark.parametrize("bad", [0, 24, 512, -8, 8.0, "8"])
def test_group_gemm_rejects_bad_tile_m(bad):
    x = jnp.zeros((4, 8), jnp.bfloat16)
    w = jnp.zeros((2, 6, 8), jnp.bfloat16)
    sizes = jnp.asarray([2, 2], jnp.int32)
    for mod in (ops, reference):
        with pytest.raises((ValueError, TypeError), match="tile_m"):
            mod.group_gemm(x, w, sizes, tile_m=bad)


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
    x, w, sizes = _gemm_inputs(rng, (600, 520, 2000, 16), "empty_first_middle_last",
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
    d2s, sizes = _gather_rows(rng, tokens, topk, experts)
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


# expert_mlp: steps 3-6 in one call, with the bits of the three ops it
# replaces, at every tile (on the GPU the w2 GEMM and the activation start
# early by programmatic dependent launch), gated or not, every activation.
# Shapes (T, H, I, E, topk): one token, I = 4 and 24 (off the column blocks),
# H = 13 (K off 16-byte loads for the w13 GEMM), topk = E.
EXPERT_MLP_SHAPES = [(1, 72, 4, 7, 2), (37, 136, 24, 6, 3), (5, 13, 9, 4, 4)]


def _mlp_weights(rng, experts, hidden, inter, dtype, gated=True):
    """w13 (E, 2I or I, H) and w2 (E, H, I), scaled to keep outputs O(1)."""
    up = 2 * inter if gated else inter
    return (normal(rng, (experts, up, hidden), dtype, scale=hidden**-0.5),
            normal(rng, (experts, hidden, inter), dtype, scale=inter**-0.5))


@dtypes
@pytest.mark.parametrize("tiles", [None, (8, 8), (16, 8), (8, 32), (128, 64), (256, 8)], ids=str)
@pytest.mark.parametrize("shape", EXPERT_MLP_SHAPES, ids=str)
def test_expert_mlp_same_bits_as_three_ops(rng, shape, tiles, dtype):
    tokens, hidden, inter, experts, topk = shape
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = _mlp_weights(rng, experts, hidden, inter, dtype)
    d2s, sizes = _gather_rows(rng, tokens, topk, experts)
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
    w13, w2 = _mlp_weights(rng, experts, hidden, inter, jnp.bfloat16, gated=is_gated)
    d2s, sizes = _gather_rows(rng, tokens, topk, experts)
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
        ids = jnp.asarray(random_ids(rng, tokens, topk, experts))
    start, local = (2, 2) if routing == "local_2_of_6" else (0, experts)
    _, d2s, sizes = ref.moe_compute_token_index(ids, num_experts=experts, start_expert=start,
                                                num_local_experts=local)
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = _mlp_weights(rng, local, hidden, inter, dtype)
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


# moe_layer: steps 1-7 in one call (on the GPU every kernel after the router
# starts early by programmatic dependent launch), with the bits of the four
# ops it replaces. (T, H, I, E, topk, experts the router may pick, routing):
# one token; topk = E; H = 13 (K off the 16-byte loads); one expert; every
# token on expert 2 of 4 (three empty); the first, a middle and the last
# expert empty; T*k = 1200 entries (the token index's three-kernel form, past
# one chunk of 256) with grouped sigmoid routing, a correction bias and a scale.
MOE_LAYER_CASES = [
    (1, 72, 4, 7, 2, None, {}),
    (5, 13, 9, 4, 4, None, {}),
    (37, 136, 24, 6, 3, None, {"renormalize": False}),
    (9, 40, 16, 1, 1, None, {}),
    (12, 64, 24, 4, 1, [2], {}),
    (20, 48, 8, 8, 2, [1, 2, 3, 5, 6], {}),
    # Grouped routing with a bias at decode size; T * k = 256 (on CUDA the
    # largest token index of one launch) and 264 (three kernels).
    (16, 64, 24, 16, 4, None, dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                                   routed_scaling_factor=2.5)),
    (32, 48, 16, 64, 8, None, {}),
    (33, 48, 16, 64, 8, None, {}),
    (300, 64, 24, 16, 4, None, dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                                    routed_scaling_factor=2.5)),
]
MOE_LAYER_IDS = ["T1", "topk_eq_E", "H13_no_renorm", "one_expert", "all_on_one", "empty_edges",
                 "grouped_sigmoid_T16", "T32_k8", "T33_k8", "grouped_sigmoid_T300"]


def _moe_layer_inputs(rng, case, dtype, gated=True):
    tokens, hidden, inter, experts, topk, allowed, kw = case
    x = normal(rng, (tokens, hidden), dtype)
    logits = router_logits(rng, tokens, experts, jnp.float32, allowed)
    w13, w2 = _mlp_weights(rng, experts, hidden, inter, dtype, gated=gated)
    kw = dict(kw)
    if "num_expert_group" in kw:
        kw["e_score_correction_bias"] = jnp.asarray(rng.standard_normal(experts), jnp.float32)
    return (x, logits, w13, w2, topk), kw


def _layer_by_ops(mod, x, logits, w13, w2, topk, activation="silu", is_gated=True, tile_m=None,
                  **routing):
    weights, ids = mod.route(logits, topk, **routing)
    src_to_dst, dst_to_src, sizes = mod.moe_compute_token_index(ids, w13.shape[0])
    y = mod.expert_mlp(x, w13, w2, sizes, dst_to_src, topk, activation=activation,
                       is_gated=is_gated, tile_m=tile_m)
    return mod.moe_combine(y, weights, src_to_dst)


@dtypes
@pytest.mark.parametrize("tiles", [None, (8, 16), (32, 128), (256, 8)], ids=str)
@pytest.mark.parametrize("case", MOE_LAYER_CASES, ids=MOE_LAYER_IDS)
def test_moe_layer_same_bits_as_four_ops(rng, case, tiles, dtype):
    args, kw = _moe_layer_inputs(rng, case, dtype)
    got = jax.jit(functools.partial(ops.moe_layer, topk=args[-1], tile_m=tiles, **kw))(*args[:-1])
    assert got.shape == args[0].shape and got.dtype == dtype
    assert_equal(got, _layer_by_ops(ops, *args, tile_m=tiles, **kw), f"tiles={tiles}")
    assert_close(got, reference.moe_layer(*args, **kw), dtype, "vs reference")
    assert np.any(np.asarray(got, np.float32) != 0.0)


@pytest.mark.sanitize
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("is_gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("case", [MOE_LAYER_CASES[0], MOE_LAYER_CASES[-1]], ids=["T1", "T300"])
def test_moe_layer_activations(rng, case, activation, is_gated):
    args, kw = _moe_layer_inputs(rng, case, jnp.bfloat16, gated=is_gated)
    got = ops.moe_layer(*args, activation=activation, is_gated=is_gated, **kw)
    want = _layer_by_ops(ops, *args, activation=activation, is_gated=is_gated, **kw)
    assert_equal(got, want, f"{activation}, gated={is_gated}")
    assert_close(got, reference.moe_layer(*args, activation=activation, is_gated=is_gated, **kw),
                 jnp.bfloat16, "vs reference")


def test_moe_layer_rejects_bad_args():
    x = jnp.zeros((4, 8), jnp.bfloat16)
    logits = jnp.zeros((4, 2), jnp.float32)
    w13 = jnp.zeros((2, 6, 8), jnp.bfloat16)
    w2 = jnp.zeros((2, 8, 3), jnp.bfloat16)
    for mod in (ops, reference):
        with pytest.raises(ValueError, match="router_logits must be"):
            mod.moe_layer(x, logits[:3], w13, w2, 2)
        with pytest.raises(ValueError, match="router_logits has E=3"):
            mod.moe_layer(x, jnp.zeros((4, 3)), w13, w2, 2)
        with pytest.raises(ValueError, match="w2 must be"):
            mod.moe_layer(x, logits, w13, jnp.zeros((2, 8, 4), jnp.bfloat16), 2)
        with pytest.raises(ValueError, match="topk"):
            mod.moe_layer(x, logits, w13, w2, 3)
        with pytest.raises(TypeError, match="dtype"):
            mod.moe_layer(x, logits, w13.astype(jnp.float32), w2, 2)
        with pytest.raises(ValueError, match="activation"):
            mod.moe_layer(x, logits, w13, w2, 2, activation="relu")
        with pytest.raises(ValueError, match="scoring_func"):
            mod.moe_layer(x, logits, w13, w2, 2, scoring_func="relu")
        with pytest.raises(TypeError, match="tile_m must be None or a pair"):
            mod.moe_layer(x, logits, w13, w2, 2, tile_m=8)


@pytest.mark.parametrize("tile_m, shape", [(16, (600, 136, 2600, 16)), (256, (2100, 200, 264, 4))],
                         ids=["tma", "sm90"])
def test_group_gemm_is_bitwise_reproducible(rng, tile_m, shape):
    # The TMA decode kernel (tile 16: one warp sums each output over all of K
    # in k order) and the sm90 kernel (tile 256: no split-K or stream-K): the
    # same bits every run, eager or jitted.
    x, w, sizes = _gemm_inputs(rng, shape, "random", jnp.bfloat16)
    first = ops.group_gemm(x, w, sizes, tile_m=tile_m)
    assert_equal(ops.group_gemm(x, w, sizes, tile_m=tile_m), first, "second eager run")
    jitted = jax.jit(functools.partial(ops.group_gemm, tile_m=tile_m))
    assert_equal(jitted(x, w, sizes), first, "jitted run")
    assert_equal(jitted(x, w, sizes), first, "second jitted run")


# ------------------------------------------------- tile_m = 256: the sm90 kernel
# On a compute capability 9.0 GPU (H100/H200) of a build with CUTLASS,
# tile_m = 256 runs the CUTLASS wgmma/TMA kernel (csrc/cuda/group_gemm_sm90.cu)
# for bf16/f16 with N and K multiples of 8; everywhere else (CPU, other GPUs,
# f32, other N or K) the 128-row tile. On CPU these tests check the CPU
# handler with tile_m = 256 accepted.

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
    (1020, 200, 264, 4),   # 255 rows per expert: 128x256, experts off the tile
    (1024, 200, 264, 4),   # 256 rows per expert: 128x256 tiles
    (2100, 200, 264, 4),   # ~525 rows per expert: 128x256 tiles, experts off the tile
]


@half_dtypes
@pytest.mark.parametrize("pattern", ["random", "all_in_one", "partial", "empty_first_middle_last"])
@pytest.mark.parametrize("shape", SM90_SHAPES, ids=str)
def test_group_gemm_sm90(rng, shape, pattern, dtype):
    _check_tile(rng, shape, pattern, 256, dtype)


@pytest.mark.sanitize
def test_group_gemm_sm90_small_sanitize(rng):
    # Small cases for compute-sanitizer: one row and E > M with a partial
    # tail (64x128 tiles), one expert with every row (128x128 tiles, N < 256),
    # and 128x256 tiles (~550 rows per expert).
    for (m, k, n, experts), pattern in [((1, 64, 72, 4), "partial"), ((77, 8, 8, 16), "partial"),
                                        ((300, 200, 136, 3), "all_in_one"),
                                        ((1100, 64, 256, 2), "partial"),
                                        ((1100, 64, 256, 2), "all_in_one")]:
        x, w, sizes = _gemm_inputs(rng, (m, k, n, experts), pattern, jnp.bfloat16)
        got = ops.group_gemm(x, w, sizes, tile_m=256)
        assert_close(got, ref.group_gemm(x, w, sizes), jnp.bfloat16, f"m={m} sizes={sizes}")
        assert np.all(np.asarray(got)[int(sizes.sum()):].astype(np.float32) == 0)


@pytest.mark.sanitize
@half_dtypes
@pytest.mark.parametrize("tail", [False, True], ids=["all_rows", "tail"])
@pytest.mark.parametrize("shape", [(1, 72, 40, 8, 2), (37, 136, 72, 6, 3), (300, 200, 136, 4, 2),
                                   (600, 64, 256, 2, 2), (2200, 64, 136, 4, 2),
                                   (40, 2056, 72, 4, 3)],
                         ids=["T1", "T37", "T300", "T600_wide", "T2200", "T40_K2056"])
def test_group_gemm_gather_sm90(rng, shape, tail, dtype):
    # The sm90 path expands the gathered rows (invalid entries: zero rows)
    # before its GEMM: 4400 rows (T2200) are more than one pass of the prep
    # grid (8 blocks per SM, 1056 rows on 132 SMs); K = 2056 (257 16-byte
    # vectors) takes two passes of its 256 threads along a row. With `tail`,
    # the last non-empty expert's rows are left out of expert_sizes: they
    # must come out zero.
    tokens, k, n, experts, topk = shape
    x = normal(rng, (tokens, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    d2s, sizes = _gather_rows(rng, tokens, topk, experts)
    if tail:
        s = np.asarray(sizes).copy()
        s[np.flatnonzero(s)[-1]] = 0
        sizes = jnp.asarray(s)
    got = ops.group_gemm_gather(x, w, sizes, d2s, topk, tile_m=256)
    want = ref.group_gemm(ref.moe_expand_input(x, d2s, topk=topk), w, sizes)
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
    x, w, sizes = _gemm_inputs(rng, (300, k, n, 3), "partial", dtype)
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
        d2s, sizes = _gather_rows(rng, tokens, topk, experts, extra_invalid=trial > 0)
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
def test_group_gemm_scratch_output_only_for_sm90(rng, tile_m):
    # The custom call's second output is the sm90 kernel's scratch: sized by
    # the extension where that kernel will run, empty everywhere else.
    from jax_moe import tuning
    from jax_moe._ffi import _ext
    m, k, n, experts = 256, 64, 72, 4
    x = normal(rng, (m, k), jnp.bfloat16)
    w = normal(rng, (experts, n, k), jnp.bfloat16)
    sizes = jnp.asarray(split_rows(rng, m, experts, "random"))
    text = jax.jit(functools.partial(ops.group_gemm, tile_m=tile_m)).lower(x, w, sizes).as_text()
    scratch = [int(b) for b in re.findall(r"tensor<(\d+)xui8>", text)]
    want = (_ext.group_gemm_sm90_scratch_bytes(m, k, experts, False)
            if tile_m == 256 and tuning.sm90_usable(n, k, jnp.bfloat16) else 0)
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


# ------------------------------------------------------------- step 5: activation

ACT_SHAPES = [(1, 2), (7, 14), (64, 26), (33, 260), (3, 5, 144)]  # (..., 2I)


@dtypes
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
def test_gated_activation(rng, shape, activation, dtype):
    h = normal(rng, shape, dtype, scale=2.0)
    got = ops.gated_activation(h, activation)
    assert got.shape == shape[:-1] + (shape[-1] // 2,) and got.dtype == dtype
    # gelu's 1 + erf(g/sqrt2) (or 1 + tanh(...)) cancels for negative g: in f32
    # it carries an absolute error of a few 2^-24, so act(g) * u is only good
    # to ~|g * u| * 2^-24 however small the result. Allow 1e-6 * |g * u| on top.
    gu = np.abs(oracle.f64(h[..., : shape[-1] // 2]) * oracle.f64(h[..., shape[-1] // 2:]))
    assert_close(got, ref.gated_activation(h, activation), dtype, "vs reference", atol=1e-6 * gu)
    assert_close(got, oracle.gated_activation(h, activation), dtype, "vs numpy oracle", atol=1e-6 * gu)


def test_activation_aliases(rng):
    h = normal(rng, (9, 40), jnp.float32)
    assert_equal(ops.silu_and_mul(h), ops.gated_activation(h, "silu"))
    assert_equal(ops.gelu_and_mul(h), ops.gated_activation(h, "gelu"))
    assert_equal(ops.gelu_and_mul(h, approximate=True), ops.gated_activation(h, "gelu_tanh"))
    # The three activations really differ (the code is passed through).
    assert not np.array_equal(np.asarray(ops.silu_and_mul(h)), np.asarray(ops.gelu_and_mul(h)))
    assert not np.array_equal(np.asarray(ops.gelu_and_mul(h)),
                              np.asarray(ops.gelu_and_mul(h, approximate=True)))


# ---------------------------------------------------------------- step 7: combine

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


ZERO_TOKEN_CALLS = {  # every op on T = 0 tokens (an empty local batch)
    "topk_softmax": lambda m: m.topk_softmax(jnp.zeros((0, 8)), 2),
    "token_index": lambda m: m.moe_compute_token_index(jnp.zeros((0, 2), jnp.int32), 8),
    "expand": lambda m: m.moe_expand_input(jnp.zeros((0, 16)), jnp.zeros((0,), jnp.int32), 2),
    "group_gemm": lambda m: m.group_gemm(jnp.zeros((0, 16)), jnp.zeros((8, 6, 16)),
                                         jnp.zeros((8,), jnp.int32)),
    "expert_mlp": lambda m: m.expert_mlp(jnp.zeros((0, 16)), jnp.zeros((8, 6, 16)),
                                         jnp.zeros((8, 16, 3)), jnp.zeros((8,), jnp.int32),
                                         jnp.zeros((0,), jnp.int32), 2),
    "gated_act": lambda m: m.gated_activation(jnp.zeros((0, 6))),
    "combine": lambda m: m.moe_combine(jnp.zeros((0, 16)), jnp.zeros((0, 2)), jnp.zeros((0,), jnp.int32)),
    "moe_layer": lambda m: m.moe_layer(jnp.zeros((0, 16)), jnp.zeros((0, 8)), jnp.zeros((8, 6, 16)),
                                       jnp.zeros((8, 16, 3)), 2),
}
ZERO_TOKEN_SHAPES = {"topk_softmax": [(0, 2), (0, 2)], "token_index": [(0,), (0,), (8,)],
                     "expand": [(0, 16)], "group_gemm": [(0, 6)], "expert_mlp": [(0, 16)],
                     "gated_act": [(0, 3)],
                     "combine": [(0, 16)], "moe_layer": [(0, 16)]}


@pytest.mark.sanitize
@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("name", list(ZERO_TOKEN_CALLS))
def test_zero_tokens(name, impl):
    out = ZERO_TOKEN_CALLS[name](ops if impl == "ffi" else ref)
    shapes = [leaf.shape for leaf in jax.tree.leaves(jax.block_until_ready(out))]
    assert shapes == ZERO_TOKEN_SHAPES[name]
    if name == "token_index":
        assert np.all(np.asarray(out[2]) == 0), "no tokens: every expert size is 0"


# ------------------------------------------------------- one case per op, reused

TARGETS = {
    "topk_softmax": "jax_moe_route",
    "token_index": "jax_moe_token_index",
    "expand": "jax_moe_expand",
    "group_gemm": "jax_moe_group_gemm",
    "expert_mlp": "jax_moe_expert_mlp",
    "gated_act": "jax_moe_activation",
    "combine": "jax_moe_combine",
    "moe_layer": "jax_moe_moe_layer",
}


def op_case(name, rng, dtype, batch=None):
    """(fn, args) for one op on a moderate random input; with batch=B every
    argument gets a leading batch axis of size B (fresh data per element)."""
    tokens, k, experts, hidden, inter = 48, 2, 8, 72, 13
    lead = () if batch is None else (batch,)
    per = range(batch or 1)

    def stack(make):
        arrays = [make() for _ in per]
        return arrays[0] if batch is None else jnp.stack([jnp.asarray(a) for a in arrays])

    def index():
        return oracle.token_index(random_ids(rng, tokens, k, experts), experts)

    if name == "topk_softmax":
        return functools.partial(ops.topk_softmax, topk=k, renormalize=True), (
            normal(rng, lead + (tokens, experts), dtype, 2.0),)
    if name == "token_index":
        return functools.partial(ops.moe_compute_token_index, num_experts=experts), (
            stack(lambda: random_ids(rng, tokens, k, experts)),)
    if name == "expand":
        return functools.partial(ops.moe_expand_input, topk=k), (
            normal(rng, lead + (tokens, hidden), dtype), stack(lambda: index()[1]))
    if name == "group_gemm":
        m = tokens * k
        return ops.group_gemm, (
            normal(rng, lead + (m, hidden), dtype),
            normal(rng, lead + (experts, 2 * inter, hidden), dtype, 1 / np.sqrt(hidden)),
            stack(lambda: split_rows(rng, m, experts, "empty_middle")))
    if name == "expert_mlp":
        idx = [index() for _ in per]  # sizes and dst_to_src of one routing per element

        def part(j):
            return idx[0][j] if batch is None else jnp.stack([jnp.asarray(i[j]) for i in idx])
        return functools.partial(ops.expert_mlp, topk=k), (
            normal(rng, lead + (tokens, hidden), dtype),
            normal(rng, lead + (experts, 2 * inter, hidden), dtype, 1 / np.sqrt(hidden)),
            normal(rng, lead + (experts, hidden, inter), dtype, 1 / np.sqrt(inter)),
            part(2), part(1))
    if name.startswith("gated_act"):
        activation = name.split(":")[1] if ":" in name else "silu"
        return functools.partial(ops.gated_activation, activation=activation), (
            normal(rng, lead + (tokens * k, 2 * inter), dtype, 2.0),)
    if name == "combine":
        return ops.moe_combine, (
            normal(rng, lead + (tokens * k, hidden), dtype),
            jnp.asarray(rng.random(lead + (tokens, k)), jnp.float32),
            stack(lambda: index()[0]))
    if name == "moe_layer":
        return functools.partial(ops.moe_layer, topk=k), (
            normal(rng, lead + (tokens, hidden), dtype),
            normal(rng, lead + (tokens, experts), jnp.float32, 2.0),
            normal(rng, lead + (experts, 2 * inter, hidden), dtype, 1 / np.sqrt(hidden)),
            normal(rng, lead + (experts, hidden, inter), dtype, 1 / np.sqrt(inter)))
    raise ValueError(name)


OP_NAMES = list(TARGETS)


def _compare(got, want, dtype, what):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if jnp.issubdtype(g.dtype, jnp.integer):
            assert_equal(g, w, f"{what}[{i}]")
        else:
            assert_close(g, w, g.dtype, f"{what}[{i}]")


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_lowers_to_its_custom_call(rng, name):
    fn, args = op_case(name, rng, jnp.float32)
    text = jax.jit(fn).lower(*args).as_text()
    targets = set(re.findall(r"custom_call\s*@(\w+)", text))
    assert TARGETS[name] in targets, f"{name}: custom calls in the lowered module: {targets}"


# ------------------------------------------------------------------------- vmap

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", OP_NAMES + ["gated_act:gelu"])
def test_vmap_matches_loop(rng, name, dtype):
    batch = 3
    fn, args = op_case(name, rng, dtype, batch=batch)
    got = jax.vmap(fn)(*args)
    for b in range(batch):
        want = fn(*(a[b] for a in args))
        got_b = jax.tree.map(lambda g: g[b], got)
        _compare(got_b, want, dtype, f"{name}, batch element {b}")


def test_vmap_group_gemm_shared_weights(rng):
    # x and expert_sizes batched, one weight tensor for the whole batch.
    fn, (x, w, sizes) = op_case("group_gemm", rng, jnp.float32, batch=3)
    got = jax.vmap(fn, in_axes=(0, None, 0))(x, w[0], sizes)
    for b in range(3):
        assert_close(got[b], fn(x[b], w[0], sizes[b]), jnp.float32, f"batch element {b}")


def test_vmap_nested_topk(rng):
    logits = normal(rng, (2, 3, 10, 8), jnp.float32)
    fn = functools.partial(ops.topk_softmax, topk=3)
    weights, ids = jax.vmap(jax.vmap(fn))(logits)
    for a in range(2):
        for b in range(3):
            w, i = fn(logits[a, b])
            assert_equal(ids[a, b], i)
            assert_close(weights[a, b], w, jnp.float32)


# ------------------------------------------------------------- GPU against CPU

@pytest.mark.gpu
@pytest.mark.sanitize
@dtypes
@pytest.mark.parametrize("name", OP_NAMES + ["gated_act:gelu", "gated_act:gelu_tanh"])
def test_cuda_matches_cpu_ffi(rng, name, dtype):
    fn, args = op_case(name, rng, dtype)
    got = jax.block_until_ready(fn(*args))
    assert all(leaf.devices() == {jax.devices()[0]} for leaf in jax.tree.leaves(got)), \
        "the op did not run on the GPU"
    want = on_cpu(fn, *args)
    assert all(leaf.devices() == {jax.devices("cpu")[0]} for leaf in jax.tree.leaves(want))
    _compare(got, want, dtype, f"{name}: CUDA vs CPU")
