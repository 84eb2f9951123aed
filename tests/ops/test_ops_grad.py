"""Op-level gradients on the kernels: jax.grad of ops.group_gemm,
group_gemm_gather, moe_expand_input, expert_mlp, gated_activation and route
against jax.grad of their reference twins."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import (DTYPE_IDS, FLOAT_DTYPES, assert_equal, gather_rows, gemm_inputs, mlp_weights,
                    normal, random_ids, rel_err)
from jax_moe import ops, reference
from jax_moe.ops.expert_mlp import _keeps_rows, expert_mlp_vjp
from jax_moe.ops.group_gemm import _group_gemm_call

GRAD_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
            jnp.dtype(jnp.float16): 4e-3}


@functools.partial(jax.jit, static_argnames=("fn", "argnums"))
def vjp_of(fn, argnums, args, ct):
    """The cotangents of args[argnums] for the output cotangent ct."""
    def f(*diff):
        full = list(args)
        for i, v in zip(argnums, diff):
            full[i] = v
        return fn(*full)
    _, vjp = jax.vjp(f, *(args[i] for i in argnums))
    return vjp(ct)


def compare(op, twin, args, argnums, ct, dtype):
    got = vjp_of(op, argnums, args, ct)
    want = vjp_of(twin, argnums, args, ct)
    for i, a, w in zip(argnums, got, want):
        assert a.shape == args[i].shape and a.dtype == args[i].dtype, i
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"argument {i}: not finite"
        err = rel_err(a, w)
        assert err < GRAD_TOL[jnp.dtype(dtype)], f"argument {i}: relative error {err:.3g}"
    return got


PATTERNS = ["random", "partial", "empty_first_middle_last", "all_in_one", "none"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", [(70, 40, 24, 5), (1, 16, 8, 1), (130, 72, 136, 3)], ids=str)
def test_group_gemm_grad(rng, shape, pattern, dtype):
    x, w, sizes = gemm_inputs(rng, shape, pattern, dtype)
    ct = normal(rng, (shape[0], shape[2]), dtype)
    dx, dw = compare(ops.group_gemm, reference.group_gemm, (x, w, sizes), (0, 1), ct, dtype)
    for e in np.flatnonzero(np.asarray(sizes) <= 0):
        assert_equal(dw[e], jnp.zeros_like(dw[e]), f"d w of expert {e}, which has no rows")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,topk,experts", [(37, 2, 5), (1, 1, 1), (16, 4, 4)])
def test_group_gemm_gather_grad(rng, tokens, topk, experts, dtype):
    hidden, n = 40, 24
    rows, sizes = gather_rows(rng, tokens, topk, experts)
    x = normal(rng, (tokens, hidden), dtype)
    w = normal(rng, (experts, n, hidden), dtype, hidden**-0.5)
    ct = normal(rng, (rows.shape[0], n), dtype)
    compare(functools.partial(ops.group_gemm_gather, topk=topk),
            functools.partial(reference.group_gemm_gather, topk=topk), (x, w, sizes, rows),
            (0, 1), ct, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_expand_grad_with_repeated_rows(rng, dtype):
    """A slot named by several rows (allowed by moe_expand_input): its token
    gets every one of those rows' gradients."""
    tokens, topk, hidden = 9, 2, 24
    rows = np.asarray(rng.integers(-2, tokens * topk + 2, size=40), np.int32)
    rows[:6] = 5  # slot 5 (token 2) six times
    x = normal(rng, (tokens, hidden), dtype)
    ct = normal(rng, (rows.size, hidden), dtype)
    compare(functools.partial(ops.moe_expand_input, topk=topk),
            functools.partial(reference.moe_expand_input, topk=topk), (x, jnp.asarray(rows)),
            (0,), ct, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu", True),
                                              ("gelu_tanh", False)])
def test_expert_mlp_grad(rng, activation, gated, dtype):
    tokens, topk, experts, hidden, inter = 30, 2, 6, 40, 16
    rows, sizes = gather_rows(rng, tokens, topk, experts)
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype, gated)
    ct = normal(rng, (rows.shape[0], hidden), dtype)

    def op(x, w13, w2, sizes, rows):
        return ops.expert_mlp(x, w13, w2, sizes, rows, topk, activation=activation,
                              is_gated=gated)

    def twin(x, w13, w2, sizes, rows):
        return reference.expert_mlp(x, w13, w2, sizes, rows, topk, activation=activation,
                                    is_gated=gated)

    compare(op, twin, (x, w13, w2, sizes, rows), (0, 1, 2), ct, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_expert_mlp_grad_with_kept_rows(rng, dtype):
    """Where w13's GEMM is the sm90 kernel's tile (256; 16-bit types), the
    forward expands the rows itself and keeps them for w13's weight
    gradient: the gradients match the twin's and have the bits of the path
    that gathers them again."""
    tokens, topk, experts, hidden, inter = 30, 2, 6, 40, 16
    rows, sizes = gather_rows(rng, tokens, topk, experts)
    rows = jnp.asarray(rows).at[3].set(-1)  # a dropped slot: a zero row
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype, True)
    ct = normal(rng, (rows.shape[0], hidden), dtype)
    tiles = (256, 256)
    assert _keeps_rows(rows.shape[0], x, w13, tiles, False)
    assert not _keeps_rows(rows.shape[0], x, w13, tiles, True)  # remat keeps memory down
    assert not _keeps_rows(rows.shape[0], x.astype(jnp.float32), w13, tiles, False)

    def op(x, w13, w2, sizes, rows):
        return ops.expert_mlp(x, w13, w2, sizes, rows, topk, tile_m=tiles)

    def twin(x, w13, w2, sizes, rows):
        return reference.expert_mlp(x, w13, w2, sizes, rows, topk)

    got = compare(op, twin, (x, w13, w2, sizes, rows), (0, 1, 2), ct, dtype)
    assert "jax_moe_expand" in jax.jit(jax.grad(
        lambda x: op(x, w13, w2, sizes, rows).astype(jnp.float32).sum())).lower(x).as_text()

    @jax.jit
    def gathering(x, w13, w2, sizes, rows, ct):
        h = _group_gemm_call(x, w13, sizes, rows, topk, tiles[0])
        return expert_mlp_vjp(x, w13, w2, sizes, rows, None, topk, "silu", True, h, ct)

    for name, a, b in zip(("x", "w13", "w2"), got, gathering(x, w13, w2, sizes, rows, ct)):
        assert_equal(a, b, f"d{name}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gated", [True, False])
def test_activation_grad(rng, gated, dtype):
    h = normal(rng, (17, 2 * 24), dtype)
    ct = normal(rng, (17, 24 if gated else 48), dtype)
    op = ops.gated_activation if gated else ops.activation
    twin = reference.gated_activation if gated else reference.activation
    compare(functools.partial(op, activation="gelu"), functools.partial(twin, activation="gelu"),
            (h,), (0,), ct, dtype)


@pytest.mark.parametrize("options", [
    dict(), dict(renormalize=False), dict(scoring_func="sigmoid", routed_scaling_factor=2.5),
    dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2, bias=True)], ids=str)
def test_route_grad(rng, options):
    opts = dict(options)
    logits = normal(rng, (33, 16), jnp.float32) * 2
    bias = jnp.asarray(rng.standard_normal(16) * 0.1, jnp.float32) if opts.pop("bias", 0) else None

    def op(lg):
        return ops.route(lg, 3, e_score_correction_bias=bias, **opts)[0]

    def twin(lg):
        return reference.route(lg, 3, e_score_correction_bias=bias, **opts)[0]

    ct = normal(rng, (33, 3), jnp.float32)
    compare(op, twin, (logits,), (0,), ct, jnp.float32)


def test_gather_transpose_sums_slots_in_order(rng):
    """The gradient of the gather, per token, is the f32 sum of its slots'
    rows in slot order: the same bits run to run, with the inverse map or without."""
    tokens, topk, experts = 50, 4, 8
    ids = jnp.asarray(random_ids(rng, tokens, topk, experts))
    s2d, d2s, _ = reference.moe_compute_token_index(ids, experts)
    g = normal(rng, (tokens * topk, 32), jnp.bfloat16)
    from jax_moe.ops.expand import gather_transpose
    with_inverse = gather_transpose(g, d2s, topk, tokens, s2d)
    without = gather_transpose(g, d2s, topk, tokens)
    assert_equal(without, with_inverse)
    rows = np.asarray(g, np.float32)[np.asarray(s2d)].reshape(tokens, topk, 32)
    want = rows[:, 0]
    for j in range(1, topk):
        want = want + rows[:, j]
    assert_equal(with_inverse, jnp.asarray(want).astype(jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("kw", [{}, {"renormalize": False, "routed_scaling_factor": 2.5}],
                         ids=["renormalized", "scaled"])
def test_moe_decode_grad(rng, dtype, kw):
    """ops.moe_decode (one token, one kernel) is differentiable in all four
    arguments, the router logits included, as its twin."""
    experts, hidden, inter, k = 8, 256, 256, 3
    x = normal(rng, (1, hidden), dtype)
    logits = normal(rng, (1, experts), jnp.float32)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype)
    ct = normal(rng, (1, hidden), dtype)
    grads = compare(functools.partial(ops.moe_decode, topk=k, **kw),
                    functools.partial(reference.moe_decode, topk=k, **kw),
                    (x, logits, w13, w2), (0, 1, 2, 3), ct, dtype)
    # Only the k chosen experts' weights get a gradient.
    touched = np.any(np.asarray(grads[2], np.float32) != 0, axis=(1, 2))
    assert touched.sum() == k
