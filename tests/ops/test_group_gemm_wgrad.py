"""The grouped GEMM's weight gradient, ops.group_gemm_wgrad: dw[e] = dy_e^T @ x_e
over each expert's rows, dense and gathered through dst_to_src, on the default
backend (the CPU handler here, the CUDA kernels under JAX_PLATFORMS=cuda),
against its twin in jax_moe.reference, the float64 numpy oracle and jax.vjp of
the reference grouped GEMM: shapes off every tile, expert_sizes patterns
(empty experts exactly zero), sizes outside the contract, -1 rows, M = 0,
jit, vmap, reproducible bits and the argument errors. Larger cases and the
CUDA kernel paths are in test_group_gemm_wgrad_cuda.py."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import (BAD_SIZES, DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, gather_rows,
                    normal, on_cpu, split_rows)
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
ref_wgrad = jax.jit(reference.group_gemm_wgrad, static_argnames=("topk",))


def owned_rows(sizes, m):
    """Rows per expert after clamping (negative sizes 0, groups cut at m)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), m)
    return np.diff(np.concatenate([[0], ends]))


def check_wgrad(got, dy, x, sizes, dtype, d2s=None, topk=1, what=""):
    """got against the twin and the oracle (the twin against the oracle too);
    experts without rows exactly zero in both jax results."""
    sizes = np.asarray(sizes)
    kw = {} if d2s is None else dict(dst_to_src=d2s, topk=topk)
    assert got.shape == (sizes.size, dy.shape[1], x.shape[1]) and got.dtype == dtype
    want = ref_wgrad(dy, x, jnp.asarray(sizes), **kw)
    exact = oracle.group_gemm_wgrad(dy, x, sizes, None if d2s is None else np.asarray(d2s), topk)
    assert_close(got, want, dtype, f"{what} vs reference, sizes={sizes}")
    assert_close(got, exact, dtype, f"{what} vs numpy oracle, sizes={sizes}")
    assert_close(want, exact, dtype, f"{what}: reference vs numpy oracle")
    for e in np.flatnonzero(owned_rows(sizes, dy.shape[0]) == 0):
        for name, out in (("ffi", got), ("reference", want)):
            assert np.all(np.asarray(out[e]).astype(np.float32) == 0), \
                f"{what}: {name}: expert {e} has no rows, its gradient must be zero"


SHAPES = [  # (M, N, K, E)
    (1, 8, 8, 1),
    (7, 13, 7, 3),       # odd N and K
    (90, 72, 130, 8),    # N, K not multiples of 64
    (100, 130, 72, 4),
    (33, 7, 13, 16),     # E > M: most experts empty
    (256, 64, 32, 8),
    (300, 65, 129, 2),   # ~150 rows per expert: several 32-row steps, one past each tile
]
SIZE_PATTERNS = ["random", "partial", "empty_first", "empty_middle", "empty_last",
                 "empty_first_middle_last", "all_in_one", "none"]


@dtypes
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_wgrad_shapes(rng, shape, dtype):
    m, n, k, experts = shape
    dy, x = normal(rng, (m, n), dtype), normal(rng, (m, k), dtype)
    sizes = split_rows(rng, m, experts, "random")
    check_wgrad(ops.group_gemm_wgrad(dy, x, jnp.asarray(sizes)), dy, x, sizes, dtype)


@pytest.mark.sanitize
@dtypes
@pytest.mark.parametrize("pattern", SIZE_PATTERNS)
def test_wgrad_expert_sizes(rng, pattern, dtype):
    dy, x = normal(rng, (90, 26), dtype), normal(rng, (90, 72), dtype)
    sizes = split_rows(rng, 90, 7, pattern)
    check_wgrad(ops.group_gemm_wgrad(dy, x, jnp.asarray(sizes)), dy, x, sizes, dtype, what=pattern)


@pytest.mark.sanitize
@pytest.mark.parametrize("sizes", list(BAD_SIZES.values()), ids=list(BAD_SIZES))
def test_wgrad_clamps_bad_sizes(rng, sizes):
    # Negative counts act as 0, groups are cut at M (sums above M), as in group_gemm.
    dy, x = normal(rng, (64, 10), jnp.float32), normal(rng, (64, 24), jnp.float32)
    sizes = np.asarray(sizes, np.int32)
    check_wgrad(ops.group_gemm_wgrad(dy, x, jnp.asarray(sizes)), dy, x, sizes, jnp.float32)


@pytest.mark.sanitize
@dtypes
@pytest.mark.parametrize("topk", [1, 2, 3, 4])
def test_wgrad_gather(rng, topk, dtype):
    # dst_to_src of a routing with -1 and out-of-range entries (zero rows).
    tokens, n, k, experts = 37, 70, 136, 6
    dy, x = normal(rng, (tokens * topk, n), dtype), normal(rng, (tokens, k), dtype)
    d2s, sizes = gather_rows(rng, tokens, topk, experts)
    got = ops.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk)
    check_wgrad(got, dy, x, sizes, dtype, d2s, topk, f"gather topk={topk}")
    expanded = reference.moe_expand_input(x, d2s, topk)
    assert_close(got, ops.group_gemm_wgrad(dy, expanded, sizes), dtype, "gather vs expanded rows")


def test_wgrad_without_rows_is_zero(rng):
    # M = 0 (dense and gathered), and no tokens at all (T = 0, every entry of
    # dst_to_src out of range): the whole gradient is zero.
    n, k, experts = 24, 40, 5
    sizes = jnp.asarray([3, 0, 2, 0, 1], jnp.int32)
    cases = {"M0": (jnp.zeros((0, n)), jnp.zeros((0, k)), None),
             "M0_gather": (jnp.zeros((0, n)), normal(rng, (4, k), jnp.float32),
                           jnp.zeros((0,), jnp.int32)),
             "T0_gather": (normal(rng, (6, n), jnp.float32), jnp.zeros((0, k)),
                           jnp.asarray([0, 1, -1, 2, 3, 4], jnp.int32))}
    for name, (dy, x, d2s) in cases.items():
        for mod in (ops, reference):
            out = mod.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=2)
            assert out.shape == (experts, n, k), name
            assert_equal(out, np.zeros((experts, n, k), np.float32), f"{name}, {mod.__name__}")


@pytest.mark.parametrize("gather", [False, True], ids=["dense", "gather"])
def test_wgrad_is_the_vjp_of_group_gemm(rng, gather):
    # The op is the gradient of the reference grouped GEMM with respect to w.
    tokens, n, k, experts, topk = 40, 33, 20, 5, 2
    m = tokens * topk
    dy = normal(rng, (m, n), jnp.float32)
    w = normal(rng, (experts, n, k), jnp.float32)
    if gather:
        x = normal(rng, (tokens, k), jnp.float32)
        d2s, sizes = gather_rows(rng, tokens, topk, experts)
        fwd = functools.partial(reference.group_gemm_gather, x, expert_sizes=sizes,
                                dst_to_src=d2s, topk=topk)
        got = ops.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk)
    else:
        x = normal(rng, (m, k), jnp.float32)
        sizes = jnp.asarray(split_rows(rng, m, experts, "partial"))
        fwd = functools.partial(reference.group_gemm, x, expert_sizes=sizes)
        got = ops.group_gemm_wgrad(dy, x, sizes)
    _, vjp = jax.vjp(lambda w_: fwd(w=w_), w)
    assert_close(got, vjp(dy)[0], jnp.float32, "vs jax.vjp of the reference GEMM")


def test_wgrad_jit_and_bitwise_reproducible(rng):
    # The same bits on every call, eager or jitted; one trace for every routing.
    tokens, n, k, experts, topk = 300, 72, 136, 8, 2
    dy = normal(rng, (tokens * topk, n), jnp.bfloat16)
    x = normal(rng, (tokens, k), jnp.bfloat16)
    traces = []

    @jax.jit
    def wgrad(dy, x, sizes, d2s):
        traces.append(1)
        return ops.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk)

    for trial in range(3):
        d2s, sizes = gather_rows(rng, tokens, topk, experts, extra_invalid=trial > 0)
        first = ops.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk)
        assert_equal(ops.group_gemm_wgrad(dy, x, sizes, dst_to_src=d2s, topk=topk), first,
                     "second eager call")
        assert_equal(wgrad(dy, x, sizes, d2s), first, f"jitted, routing {trial}")
        check_wgrad(first, dy, x, sizes, jnp.bfloat16, d2s, topk, f"routing {trial}")
    assert len(traces) == 1


def test_wgrad_vmap_matches_loop(rng):
    batch, m, n, k, experts = 3, 48, 20, 36, 4
    dy = normal(rng, (batch, m, n), jnp.float32)
    x = normal(rng, (batch, m, k), jnp.float32)
    sizes = jnp.stack([jnp.asarray(split_rows(rng, m, experts, p))
                       for p in ("random", "empty_middle", "partial")])
    got = jax.vmap(ops.group_gemm_wgrad)(dy, x, sizes)
    for b in range(batch):
        assert_equal(got[b], ops.group_gemm_wgrad(dy[b], x[b], sizes[b]), f"batch element {b}")


def test_cpu_wgrad_threaded_same_bits_as_serial(rng):
    # The CPU handler splits a call of 2^22 multiply-adds or more over XLA's
    # thread pool (here 64 x 456 x 440 = 12.8M, N and K off its blocks, an
    # empty expert) and runs smaller ones on one thread (one expert's 16 rows:
    # 3.2M). Each output sums the same rows in the same order either way.
    m, n, k, experts = 64, 456, 440, 5
    sizes = np.array([16, 16, 0, 16, 16], np.int32)
    dy, x = normal(rng, (m, n), jnp.bfloat16), normal(rng, (m, k), jnp.bfloat16)
    whole = on_cpu(ops.group_gemm_wgrad, dy, x, jnp.asarray(sizes))
    assert_equal(whole[2], np.zeros((n, k), jnp.bfloat16), "empty expert")
    start = np.concatenate([[0], np.cumsum(sizes)])
    for e in np.flatnonzero(sizes):
        rows = slice(start[e], start[e + 1])
        part = on_cpu(ops.group_gemm_wgrad, dy[rows], x[rows], jnp.asarray(sizes[e:e + 1]))
        assert_equal(whole[e], part[0], f"expert {e}")


def test_wgrad_lowers_to_its_custom_call(rng):
    # One custom call; its scratch output (the sm90 kernel's) is sized by the
    # extension only where that kernel may run.
    from jax_moe import tuning
    from jax_moe._ffi import _ext
    m, n, k, experts = 64, 72, 40, 4
    dy, x = normal(rng, (m, n), jnp.bfloat16), normal(rng, (m, k), jnp.bfloat16)
    sizes = jnp.asarray(split_rows(rng, m, experts, "random"))
    text = jax.jit(ops.group_gemm_wgrad).lower(dy, x, sizes).as_text()
    assert re.findall(r"custom_call\s*@(\w+)", text) == ["jax_moe_group_gemm_wgrad"]
    scratch = [int(b) for b in re.findall(r"tensor<(\d+)xui8>", text)]
    want = (_ext.group_gemm_wgrad_sm90_scratch_bytes(m, k, experts, False)
            if tuning.sm90_usable(n, k, jnp.bfloat16) else 0)
    assert scratch == [want], text


# ---- argument errors, named, at trace time (eagerly and under eval_shape) -----------

M_, N_, K_, E_ = 6, 5, 4, 3
DY, X, SIZES = jnp.zeros((M_, N_)), jnp.zeros((M_, K_)), jnp.asarray([2, 2, 2], jnp.int32)
D2S = jnp.arange(M_, dtype=jnp.int32)
ERROR_CASES = [  # (id, args, keyword arguments, exception, match)
    ("dy_rank", (DY[0], X, SIZES), {}, ValueError, r"\bdy\b"),
    ("dy_int", (DY.astype(jnp.int32), X, SIZES), {}, TypeError, r"\bdy\b"),
    ("x_rank", (DY, X[None], SIZES), {}, ValueError, r"\bx\b"),
    ("x_dtype", (DY, X.astype(jnp.bfloat16), SIZES), {}, TypeError, r"\bx\b"),
    ("x_rows", (DY, X[:-1], SIZES), {}, ValueError, r"\bx\b"),
    ("sizes_rank", (DY, X, SIZES[None]), {}, ValueError, "expert_sizes"),
    ("sizes_float", (DY, X, SIZES.astype(jnp.float32)), {}, TypeError, "expert_sizes"),
    ("d2s_len", (DY, X, SIZES), dict(dst_to_src=D2S[:-1], topk=2), ValueError, "dst_to_src"),
    ("d2s_rank", (DY, X, SIZES), dict(dst_to_src=D2S[None], topk=2), ValueError, "dst_to_src"),
    ("d2s_float", (DY, X, SIZES), dict(dst_to_src=D2S.astype(jnp.float32)), TypeError,
     "dst_to_src"),
    ("topk_zero", (DY, X, SIZES), dict(dst_to_src=D2S, topk=0), ValueError, "topk"),
    ("topk_float", (DY, X, SIZES), dict(dst_to_src=D2S, topk=2.0), TypeError, "topk"),
]


@pytest.mark.parametrize("mode", ["eager", "eval_shape"])
@pytest.mark.parametrize("module", [ops, reference], ids=["ops", "reference"])
@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_wgrad_rejects(case, module, mode):
    _, args, kw, exc, match = case
    fn = functools.partial(module.group_gemm_wgrad, **{k: v for k, v in kw.items()
                                                       if k != "dst_to_src"})
    d2s = kw.get("dst_to_src")
    with pytest.raises(exc, match=match):
        if mode == "eager":
            fn(*args, dst_to_src=d2s)
        else:  # abstract inputs: nothing could run, the error is a trace-time one
            abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
            d2s_abs = None if d2s is None else jax.ShapeDtypeStruct(d2s.shape, d2s.dtype)
            jax.eval_shape(lambda *a, d=None: fn(*a, dst_to_src=d), *abstract, d=d2s_abs)
