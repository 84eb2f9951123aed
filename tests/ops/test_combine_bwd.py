"""Step 7's backward: the jax_moe_combine_bwd target (ops.combine._combine_bwd)
against its twin (reference._combine_bwd), a float64 numpy oracle of its rule
and jax.vjp of reference._combine; and jax.grad of ops.moe_combine (its
custom VJP) against that of reference.moe_combine, duplicate rows included."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import (DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, on_cpu,
                    random_ids, rtol_for, to_f64)
from jax_moe import ops, reference
from jax_moe.ops import combine as combine_mod

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
F32 = jnp.float32

_twin = jax.jit(reference._combine_bwd)


def _inputs(rng, tokens, k, hidden, dtype, remote=False, extra_rows=0, experts=None):
    """g, y, topk_weights, src_to_dst and dst_to_src of a random routing
    (step 2's maps, from the numpy oracle); remote: only experts 2..5 are
    local, so some slots are -1 and the tail of dst_to_src is -1; extra_rows:
    rows of y that no slot names (dst_to_src -1 there)."""
    experts = experts or (8 if k <= 8 else 16)
    ids = random_ids(rng, tokens, k, experts)
    start, count = (2, 4) if remote else (0, experts)
    s2d, d2s, _ = oracle.token_index(ids, experts, start, count)
    d2s = np.concatenate([d2s, np.full(extra_rows, -1, np.int32)])
    rows = tokens * k + extra_rows
    y = normal(rng, (rows, hidden), dtype)
    g = normal(rng, (tokens, hidden), dtype)
    w = jnp.asarray(rng.random((tokens, k)), F32)
    return g, y, w, s2d, d2s


def _rule(g, y, w, s2d, d2s):
    """The target's rule in float64 on the inputs' values."""
    g, y, w = to_f64(g), to_f64(y), to_f64(w).reshape(-1)
    s2d, d2s = np.asarray(s2d).astype(np.int64), np.asarray(d2s).astype(np.int64)
    rows, slots, k = y.shape[0], w.size, (w.size // g.shape[0] if g.shape[0] else 1)
    dy = np.zeros_like(y)
    for r, i in enumerate(d2s):
        if 0 <= i < slots and s2d[i] == r:
            dy[r] = w[i] * g[i // k]
    dw = np.zeros(slots)
    for i, r in enumerate(s2d):
        if 0 <= r < rows:
            dw[i] = y[r] @ g[i // k]
    return dy, dw.reshape(g.shape[0], -1)


def _oracle_vjp(g, y, w, s2d):
    """jax.vjp of the reference combine (in y's and w's dtypes)."""
    _, vjp = jax.vjp(lambda y_, w_: reference._combine(y_, w_, jnp.asarray(s2d)), y, w)
    return vjp(g)


# dw is an f32 dot over the hidden size: its rounding scales with the sum of
# the terms' magnitudes, not with the (possibly cancelled) result. Allowed
# on top of RTOL: 2^-22 (4 f32 roundings) times that sum.
DOT_ATOL = 2.0**-22


def _check_target(g, y, w, s2d, d2s, dtype, vs_vjp=True):
    s2d, d2s = jnp.asarray(s2d), jnp.asarray(d2s)
    dy, dw = combine_mod._combine_bwd(g, y, w, s2d, d2s)
    assert dy.shape == y.shape and dy.dtype == y.dtype
    assert dw.shape == w.shape and dw.dtype == F32
    tdy, tdw = _twin(g, y, w, s2d, d2s)
    _, terms = _rule(np.abs(to_f64(g)), np.abs(to_f64(y)), w, s2d, d2s)  # sum |y_h g_h|
    atol = DOT_ATOL * terms
    # Both compute w * g in f32 and round once: the same bits.
    assert_equal(dy, tdy, "dy vs twin")
    assert_close(dw, tdw, F32, "dw vs twin", atol=atol)
    rdy, rdw = _rule(g, y, w, s2d, d2s)
    assert_close(dy, rdy, dtype, "dy vs float64 rule")
    assert_close(dw, rdw, F32, "dw vs float64 rule", atol=atol)
    if vs_vjp:  # the maps are each other's inverse: the rule is the VJP
        ody, odw = _oracle_vjp(g, y, w, s2d)
        assert_close(dy, ody, dtype, "dy vs vjp of reference._combine")
        assert_close(dw, odw, F32, "dw vs vjp of reference._combine", atol=atol)
    return dy, dw


BWD_SHAPES = [  # (T, k, H)
    (1, 1, 8),       # one token, one slot
    (1, 4, 72),
    (33, 2, 130),    # H % 8 != 0 for 16-bit types (scalar path), % 4 == 2 for f32
    (64, 8, 72),
    (7, 3, 1001),    # odd H: the scalar path for every dtype
    (2, 10, 4104),   # k > 8: two batches of slots per token
    (1, 8, 2048),
    (300, 4, 16),
]


@dtypes
@pytest.mark.parametrize("remote", [False, True], ids=["all_local", "some_remote"])
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=str)
def test_combine_bwd(rng, shape, dtype, remote):
    _check_target(*_inputs(rng, *shape, dtype, remote=remote), dtype)


@dtypes
def test_combine_bwd_k_equals_experts(rng, dtype):
    # Every token on every expert (k = E): each expert group holds all T tokens.
    _check_target(*_inputs(rng, 40, 8, 24, dtype, experts=8), dtype)


@dtypes
def test_combine_bwd_unreferenced_rows_are_zero(rng, dtype):
    # Rows of y past the placed ones (dst_to_src -1) and the rows of remote
    # slots get exactly zero gradient, whatever y and g hold there.
    g, y, w, s2d, d2s = _inputs(rng, 50, 4, 40, dtype, remote=True, extra_rows=37)
    dy, _ = _check_target(g, y, w, s2d, d2s, dtype)
    named = np.zeros(y.shape[0], bool)
    named[s2d[s2d >= 0]] = True
    assert (~named).sum() >= 37
    assert np.all(np.asarray(dy)[~named].astype(np.float32) == 0)
    assert not np.any(np.signbit(np.asarray(dy)[~named].astype(np.float32))), "zero rows: +0"


@dtypes
def test_combine_bwd_dropped_and_inconsistent_entries(rng, dtype):
    # src_to_dst: -1, >= M and very negative entries (dropped: dw 0, no
    # gradient); dst_to_src: -1, >= T*k, very negative, and a row naming a
    # slot that names another row (a zero row): nothing is read or written
    # out of bounds, and the target follows its rule.
    tokens, k, hidden = 30, 4, 48
    g, y, w, s2d, d2s = _inputs(rng, tokens, k, hidden, dtype, extra_rows=5)
    rows = y.shape[0]
    s2d, d2s = s2d.copy(), d2s.copy()
    s2d[[1, 5, 9]] = [-1, rows, rows + 1000]
    s2d[13] = -(1 << 30)
    d2s[[3, 7, 11]] = [-1, tokens * k, -(1 << 30)]
    other = int(np.flatnonzero(s2d >= 0)[0])
    wrong = int(np.flatnonzero((d2s >= 0) & (d2s != other))[0])
    d2s[wrong] = other  # names a slot that names another row: row `wrong` is zero
    dy, dw = _check_target(g, y, w, s2d, d2s, dtype, vs_vjp=False)
    assert np.all(np.asarray(dw).reshape(-1)[[1, 5, 9, 13]] == 0)
    assert np.all(np.asarray(dy)[wrong].astype(np.float32) == 0)


def test_combine_bwd_nothing_routed(rng):
    # All slots dropped: dy and dw exactly zero.
    g, y, w, _, _ = _inputs(rng, 9, 2, 16, jnp.bfloat16)
    none = jnp.full((18,), -1, jnp.int32)
    dy, dw = combine_mod._combine_bwd(g, y, w, none, none)
    assert np.all(np.asarray(dy).astype(np.float32) == 0) and np.all(np.asarray(dw) == 0)


@dtypes
def test_combine_bwd_is_bitwise_reproducible(rng, dtype):
    g, y, w, s2d, d2s = _inputs(rng, 600, 8, 264, dtype, remote=True)
    args = (g, y, w, jnp.asarray(s2d), jnp.asarray(d2s))
    first = combine_mod._combine_bwd(*args)
    second = combine_mod._combine_bwd(*args)
    jitted = jax.jit(combine_mod._combine_bwd)
    for what, got in [("second call", second), ("jitted", jitted(*args)),
                      ("second jitted", jitted(*args))]:
        assert_equal(got[0], first[0], f"dy, {what}")
        assert_equal(got[1], first[1], f"dw, {what}")


def test_combine_bwd_rejects_bad_dst_to_src(rng):
    # The handler's own check (the unchecked entry trusts its caller).
    g, y, w, s2d, d2s = _inputs(rng, 4, 2, 8, F32)
    with pytest.raises(Exception, match="dst_to_src"):
        jax.block_until_ready(
            combine_mod._combine_bwd(g, y, w, jnp.asarray(s2d), jnp.asarray(d2s[:-1])))


@pytest.mark.sanitize
@pytest.mark.parametrize("shape", [(3, 3, 1001), (1, 8, 2048), (5, 10, 24)], ids=str)
def test_combine_bwd_small_sanitize(rng, shape):
    # For compute-sanitizer: scalar and vector paths, k > 8, dropped and
    # out-of-range entries in both maps, rows no slot names.
    tokens, k, _ = shape
    g, y, w, s2d, d2s = _inputs(rng, *shape, jnp.bfloat16, remote=True, extra_rows=3)
    s2d, d2s = s2d.copy(), d2s.copy()
    s2d[0], d2s[-1], d2s[-2] = y.shape[0], tokens * k, -(1 << 30)
    _check_target(g, y, w, s2d, d2s, jnp.bfloat16, vs_vjp=False)


@pytest.mark.gpu
@dtypes
@pytest.mark.parametrize("shape", [(256, 8, 7168), (500, 6, 2880), (129, 2, 1001)], ids=str)
def test_cuda_combine_bwd_vs_cpu(rng, shape, dtype):
    # The CUDA kernels against the CPU handler: dy bit for bit (one rounding
    # of the same product), dw up to summation order.
    g, y, w, s2d, d2s = _inputs(rng, *shape, dtype, remote=True, extra_rows=11)
    args = (g, y, w, jnp.asarray(s2d), jnp.asarray(d2s))
    dy, dw = combine_mod._combine_bwd(*args)
    cdy, cdw = on_cpu(combine_mod._combine_bwd, *args)
    assert_equal(np.asarray(dy), np.asarray(cdy), "dy, CUDA vs CPU")
    assert_close(dw, cdw, F32, "dw, CUDA vs CPU")


# ---- the VJP of ops.moe_combine ------------------------------------------------

def _grads(combine, y, w, s2d, g):
    return jax.grad(lambda y_, w_: jnp.sum((combine(y_, w_, s2d) * g).astype(F32)),
                    argnums=(0, 1))(y, w)


@dtypes
@pytest.mark.parametrize("weights_dtype", [F32, jnp.bfloat16], ids=["w_f32", "w_bf16"])
@pytest.mark.parametrize("remote", [False, True], ids=["all_local", "some_remote"])
@pytest.mark.parametrize("shape", [(1, 1, 8), (33, 2, 130), (64, 8, 72), (2, 10, 264)],
                         ids=str)
def test_grad_moe_combine(rng, shape, dtype, remote, weights_dtype):
    g, y, w, s2d, d2s = _inputs(rng, *shape, dtype, remote=remote)
    w = w.astype(weights_dtype)
    s2d = jnp.asarray(s2d)
    dy, dw = jax.jit(functools.partial(_grads, ops.moe_combine))(y, w, s2d, g)
    rdy, rdw = jax.jit(functools.partial(_grads, reference.moe_combine))(y, w, s2d, g)
    assert dy.dtype == y.dtype and dw.dtype == weights_dtype
    assert_close(dy, rdy, dtype, "dy vs reference")
    assert_close(dw, rdw, weights_dtype, "dw vs reference")
    # Without shared rows the gradients are the target's, given step 2's map.
    tdy, tdw = combine_mod._combine_bwd(g, y, w, s2d, jnp.asarray(d2s))
    assert_equal(dy, tdy, "dy vs the target")
    assert_equal(dw, tdw.astype(weights_dtype), "dw vs the target")


@dtypes
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_moe_combine_duplicate_rows(rng, dtype, jit):
    # A user's src_to_dst that names one row from two slots (and another from
    # three): the row's gradient is the sum of all of them, as autodiff of
    # the reference gives.
    tokens, k, hidden = 12, 3, 40
    g, y, w, s2d, _ = _inputs(rng, tokens, k, hidden, dtype)
    s2d = s2d.copy()
    s2d[5] = s2d[0]
    s2d[20] = s2d[30] = s2d[7]
    s2d = jnp.asarray(s2d)
    grads = functools.partial(_grads, ops.moe_combine)
    dy, dw = (jax.jit(grads) if jit else grads)(y, w, s2d, g)
    rdy, rdw = _grads(reference.moe_combine, y, w, s2d, g)
    # Float64: each row sums every slot that names it. scale: the sum of the
    # terms' magnitudes, which bounds what rounding each partial sum in the
    # dtype can cost where the terms cancel.
    want, scale = np.zeros((y.shape[0], hidden)), np.zeros((y.shape[0], hidden))
    gf, wf = to_f64(g), to_f64(w).reshape(-1)
    for i, r in enumerate(np.asarray(s2d)):
        want[r] += wf[i] * gf[i // k]
        scale[r] += np.abs(wf[i] * gf[i // k])
    # Against the reference, which adds the slots in another order: the
    # dtype's tolerance, plus (where several slots cancel) both sides'
    # roundings of the partial sums; zero extra for a row of one slot.
    cancel = 3 * rtol_for(dtype) * (scale - np.abs(want))
    assert_close(dy, rdy, dtype, "dy vs reference", atol=2 * cancel)
    assert_close(dw, rdw, F32, "dw vs reference")
    # And against float64 (up to one rounding per slot in the reference's dtype).
    assert_close(dy, want, dtype, "dy vs float64", atol=3 * rtol_for(dtype) * scale)


def test_vjp_without_the_map_equals_with_it(rng):
    # moe_combine's VJP builds src_to_dst's inverse itself; the layer hands
    # step 2's. For step 2's maps (remote slots dropped, the tail -1) the two
    # give the same bits.
    ids = random_ids(rng, 40, 4, 8)
    s2d, d2s, _ = oracle.token_index(ids, 8, 2, 4)
    g = normal(rng, (40, 24), jnp.bfloat16)
    y = normal(rng, (s2d.size, 24), jnp.bfloat16)
    w = normal(rng, (40, 4), jnp.float32)

    def grads(d2s):
        _, vjp = jax.vjp(lambda y, w: combine_mod._combine(y, w, jnp.asarray(s2d), d2s), y, w)
        return vjp(g)

    for a, b in zip(grads(None), grads(jnp.asarray(d2s))):
        assert_equal(a, b, "with and without dst_to_src")


def test_grad_moe_combine_under_vmap(rng):
    # Batched: one element with a shared row (the reference's path), the
    # others without; the batched cond must pick per element.
    batch, tokens, k, hidden = 3, 6, 2, 16
    parts = [_inputs(rng, tokens, k, hidden, jnp.bfloat16) for _ in range(batch)]
    g, y, w = (jnp.stack([p[n] for p in parts]) for n in range(3))
    s2d = np.stack([p[3] for p in parts])
    s2d[1, 4] = s2d[1, 0]
    s2d = jnp.asarray(s2d)

    def vjp_of(combine):
        return lambda y_, w_, s_, g_: jax.vjp(lambda a, b: combine(a, b, s_), y_, w_)[1](g_)

    got = jax.vmap(vjp_of(ops.moe_combine))(y, w, s2d, g)
    for b in range(batch):
        want = _oracle_vjp(g[b], y[b], w[b], s2d[b])
        assert_close(got[0][b], want[0], jnp.bfloat16, f"dy[{b}]")
        assert_close(got[1][b], want[1], F32, f"dw[{b}]")
