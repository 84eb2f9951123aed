"""The step contract (the table of steps in README.md), run over both backends
of jax_moe.backends.BACKENDS: "ffi" (jax_moe.ops, the FFI kernels, on the
default backend) and "reference" (jax_moe.reference, plain jax.numpy),
through the `backend` fixture.

For each step: the shapes and dtypes of the outputs, the -1 conventions
(ids outside the local experts are not placed, dst_to_src is -1 past the
placed rows, expand and the gather give zero rows where dst_to_src is -1,
rows past the groups are zero, combine skips -1 slots), and the edges (one
token, one expert, every token on one expert, experts without tokens,
topk = E, zero tokens, sizes that are no multiple of any tile), against
expected values computed without jax_moe: the numpy oracle (tests/oracle.py)
or numpy written here. Each backend is held to the contract on its own, so
a bug shared by both fails here too; the other files of tests/ops compare
the backends with each other (bits, tiles, kernel paths).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import (DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, mlp_weights, normal,
                    random_ids, rel_err, router_logits, routing_allowed, split_rows)
from jax_moe.backends import BACKENDS

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
f32_bf16 = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
# ||got - oracle|| / ||oracle|| where the step rounds to the dtype more than
# once (h, a, y, out) of up to half an ulp each: bf16 2^-8, f16 2^-11.
CHAIN_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
             jnp.dtype(jnp.float16): 4e-3}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    """The module of ops under test: jax_moe.ops or jax_moe.reference."""
    return BACKENDS[request.param]


def _assert_tail_zero(out, start, what):
    tail = np.asarray(out)[start:].astype(np.float32)
    assert np.all(tail == 0), f"{what}: rows from {start} on must be zero"


# ------------------------------------------------------------ step 1: router

@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_all_equal_logits_pick_lowest_ids(rng, backend, k):
    experts, tokens = 8, 17
    value = rng.standard_normal((tokens, 1))
    logits = jnp.asarray(np.broadcast_to(value, (tokens, experts)), jnp.float32)
    for renormalize, weight in ((True, 1.0 / k), (False, 1.0 / experts)):
        weights, ids = backend.topk_softmax(logits, k, renormalize)
        assert_equal(ids, np.broadcast_to(np.arange(k, dtype=np.int32), (tokens, k)),
                     "ties go to the lower expert id")
        np.testing.assert_allclose(np.asarray(weights), weight, rtol=1e-6)


def test_topk_masked_experts_are_never_picked(rng, backend):
    # -inf logits (masked experts) get weight 0 and are not chosen while enough
    # finite experts remain.
    logits = rng.standard_normal((50, 8)).astype(np.float32)
    masked = rng.choice(8, size=3, replace=False)
    logits[:, masked] = -np.inf
    weights, ids = backend.topk_softmax(jnp.asarray(logits), 5, False)
    np_w, np_ids = oracle.topk_softmax(logits, 5, False)
    assert not np.isin(np.asarray(ids), masked).any()
    assert_equal(ids, np_ids, "ids")
    assert_close(weights, np_w, jnp.float32, "weights")


def test_topk_nan_logits_are_never_picked(rng, backend):
    # The kernels treat a NaN logit as -inf (never preferred); reference.py too.
    logits = rng.standard_normal((40, 8)).astype(np.float32)
    nan_at = rng.random((40, 8)) < 0.3
    nan_at[:, :4] = False  # at least four finite experts per row
    logits[nan_at] = np.nan
    weights, ids = backend.topk_softmax(jnp.asarray(logits), 4, True)
    np_w, np_ids = oracle.topk_softmax(np.where(nan_at, -np.inf, logits), 4, True)
    assert not np.take_along_axis(nan_at, np.asarray(ids), axis=1).any()
    assert_equal(ids, np_ids, "ids")
    assert np.all(np.isfinite(np.asarray(weights)))
    assert_close(weights, np_w, jnp.float32, "weights")


@pytest.mark.parametrize("groups", [None, (4, 2)], ids=["flat", "grouped"])
def test_route_nan_bias_expert_is_never_picked(rng, backend, groups):
    # One rule on every backend: a choice value that is NaN (a NaN correction
    # bias) ranks below -inf, so that expert is never picked while another
    # remains; the weights come from the scores, which the bias never enters.
    tokens, experts, k = 30, 8, 3
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1
    bias[[2, 5]] = np.nan
    opts = dict(scoring_func="sigmoid", renormalize=True, routed_scaling_factor=2.5)
    if groups:
        opts.update(num_expert_group=groups[0], topk_group=groups[1])
    weights, ids = backend.route(logits, k, e_score_correction_bias=jnp.asarray(bias), **opts)
    # The same choice as with those experts masked out by a -inf bias.
    masked = np.where(np.isnan(bias), -np.inf, bias)
    w_ref, ids_ref = backend.route(logits, k, e_score_correction_bias=jnp.asarray(masked), **opts)
    assert not np.isin(np.asarray(ids), [2, 5]).any()
    assert_equal(ids, ids_ref, "ids")
    assert_close(weights, w_ref, jnp.float32, "weights")


def test_route_nan_bias_agrees_across_backends(rng):
    tokens, experts, k = 25, 16, 4
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1
    bias[[0, 7, 8]] = np.nan
    outs = [b.route(logits, k, scoring_func="sigmoid", e_score_correction_bias=jnp.asarray(bias),
                    num_expert_group=4, topk_group=2) for b in BACKENDS.values()]
    assert_equal(outs[0][1], outs[1][1], "ids: ffi against reference")
    assert_close(outs[0][0], outs[1][0], jnp.float32, "weights: ffi against reference")


ROUTE_EDGES = {  # (T, E, k, experts the logits favour: None for all)
    "one_token": (1, 8, 2, None),
    "one_expert": (5, 1, 1, None),
    "topk_eq_E": (6, 5, 5, None),
    "all_on_one": (9, 6, 1, [4]),
    "E13_k3": (7, 13, 3, None),
    "zero_tokens": (0, 8, 2, None),
}
ROUTE_OPTIONS = {  # route's keywords (no bias, no groups: the choice is on the logits)
    "softmax": dict(scoring_func="softmax", renormalize=True),
    "softmax_no_renorm": dict(scoring_func="softmax", renormalize=False),
    "sigmoid_scaled": dict(scoring_func="sigmoid", renormalize=True, routed_scaling_factor=2.5),
}


@f32_bf16
@pytest.mark.parametrize("options", ROUTE_OPTIONS)
@pytest.mark.parametrize("case", ROUTE_EDGES)
def test_route_contract(rng, backend, case, options, dtype):
    tokens, experts, k, favoured = ROUTE_EDGES[case]
    kw = ROUTE_OPTIONS[options]
    logits = router_logits(rng, tokens, experts, dtype, favoured)
    weights, ids = backend.route(logits, k, **kw)
    assert weights.shape == (tokens, k) and weights.dtype == jnp.float32
    assert ids.shape == (tokens, k) and ids.dtype == jnp.int32
    np_w, np_ids = oracle.route(logits, k, **kw)
    assert_equal(ids, np_ids, "ids vs numpy oracle")
    assert_close(weights, np_w, jnp.float32, "weights vs numpy oracle")
    ids = np.asarray(ids)
    assert all(len(set(row)) == k for row in ids.tolist()), "ids distinct within a row"
    if k == experts:
        assert np.all(np.sort(ids, axis=1) == np.arange(experts)), "topk = E: every expert"
    if favoured is not None and k == 1:
        assert np.all(ids == favoured[0]), "every token on the favoured expert"
    if kw["renormalize"] and tokens:
        np.testing.assert_allclose(np.asarray(weights).sum(axis=1),
                                   kw.get("routed_scaling_factor", 1.0), rtol=1e-5)


# ------------------------------------------------------- step 2: token index

INDEX_EDGES = {  # (T, k, E, ids pattern, start_expert, num_local_experts)
    "one_token": (1, 2, 8, "uniform", 0, None),
    "one_expert": (5, 1, 1, "uniform", 0, None),
    "all_on_one": (9, 1, 4, "all_on_2", 0, None),
    "empty_experts": (12, 2, 8, "empty_edges", 0, None),
    "topk_eq_E": (3, 4, 4, "uniform", 0, None),
    "dropped_ids": (10, 3, 8, "uniform", 2, 3),
    "one_past_a_chunk": (129, 2, 8, "uniform", 0, None),
    "zero_tokens": (0, 2, 8, "uniform", 0, None),
}


def _index_case(rng, case):
    tokens, k, experts, pattern, start, local = INDEX_EDGES[case]
    if pattern == "all_on_2":
        ids = np.full((tokens, k), 2, np.int32)
    else:
        ids = random_ids(rng, tokens, k, experts, routing_allowed(pattern, experts, k, rng))
    return ids, experts, start, local


@pytest.mark.parametrize("case", INDEX_EDGES)
def test_token_index_contract(rng, backend, case):
    ids, experts, start, local = _index_case(rng, case)
    n = ids.size
    s2d, d2s, sizes = backend.moe_compute_token_index(
        jnp.asarray(ids), experts, start_expert=start, num_local_experts=local)
    stop = experts if local is None else start + local
    for name, got, shape in (("src_to_dst", s2d, (n,)), ("dst_to_src", d2s, (n,)),
                             ("expert_sizes", sizes, (stop - start,))):
        assert got.shape == shape and got.dtype == jnp.int32, name
    for name, got, want in zip(("src_to_dst", "dst_to_src", "expert_sizes"), (s2d, d2s, sizes),
                               oracle.token_index(ids, experts, start, local)):
        assert_equal(got, want, f"{name} vs numpy oracle")
    # The -1 conventions, stated on the inputs.
    flat = ids.ravel()
    placed = (flat >= start) & (flat < stop)
    s2d, d2s, sizes = (np.asarray(a) for a in (s2d, d2s, sizes))
    assert np.all(s2d[~placed] == -1), "entries outside the local experts are not placed"
    assert np.all(d2s[placed.sum():] == -1), "dst_to_src is -1 past the placed rows"
    assert_equal(d2s[s2d[placed]], np.flatnonzero(placed).astype(np.int32), "inverse maps")
    want_sizes = np.bincount(flat[placed] - start, minlength=stop - start).astype(np.int32)
    assert_equal(sizes, want_sizes, "expert_sizes is the histogram of the local ids")


# ------------------------------------------------------------ step 3: expand

EXPAND_EDGES = {  # (T, k, H, local experts of 8: (start, count))
    "one_token": (1, 2, 8, (0, 8)),
    "topk_1": (6, 1, 5, (0, 8)),
    "some_dropped": (10, 3, 12, (2, 3)),
    "all_dropped": (4, 2, 8, None),
    "H13": (7, 3, 13, (0, 8)),
    "zero_tokens": (0, 2, 16, (0, 8)),
}


@dtypes
@pytest.mark.parametrize("case", EXPAND_EDGES)
def test_expand_contract(rng, backend, case, dtype):
    tokens, k, hidden, local = EXPAND_EDGES[case]
    if local is None:  # no entry placed: every row -1
        d2s = np.full(tokens * k, -1, np.int32)
    else:
        _, d2s, _ = oracle.token_index(random_ids(rng, tokens, k, 8), 8, *local)
    x = normal(rng, (tokens, hidden), dtype)
    got = backend.moe_expand_input(x, jnp.asarray(d2s), k)
    assert got.shape == (tokens * k, hidden) and got.dtype == dtype
    assert_equal(got, oracle.expand(x, d2s, k), "vs numpy oracle")
    rows = np.asarray(got).astype(np.float32)
    assert np.all(rows[d2s < 0] == 0), "zero rows where dst_to_src is -1"
    ok = d2s >= 0
    np.testing.assert_array_equal(rows[ok], np.asarray(x).astype(np.float32)[d2s[ok] // k])


# ------------------------------------------------------- steps 4, 6: group GEMM

GEMM_EDGES = {  # (M, K, N, E, expert_sizes pattern of common.split_rows)
    "one_row": (1, 8, 8, 4, "random"),
    "one_expert": (9, 16, 12, 1, "random"),
    "all_in_one": (20, 13, 7, 5, "all_in_one"),
    "empty_experts": (30, 24, 10, 6, "empty_first_middle_last"),
    "partial": (25, 16, 9, 3, "partial"),
    "no_rows_used": (10, 8, 6, 3, "none"),
    "K13_N7": (37, 13, 7, 3, "random"),
    "zero_rows": (0, 16, 6, 8, "none"),
}


@dtypes
@pytest.mark.parametrize("case", GEMM_EDGES)
def test_group_gemm_contract(rng, backend, case, dtype):
    m, k, n, experts, pattern = GEMM_EDGES[case]
    x = normal(rng, (m, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    sizes = split_rows(rng, m, experts, pattern)
    got = backend.group_gemm(x, w, jnp.asarray(sizes))
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, oracle.group_gemm(x, w, sizes), dtype, f"vs numpy oracle, sizes={sizes}")
    _assert_tail_zero(got, int(sizes.sum()), "rows past the groups")


GATHER_EDGES = {  # (T, K, N, E, topk, -1 entries inside the groups)
    "one_token": (1, 8, 6, 4, 2, 0),
    "topk_eq_E": (5, 13, 9, 4, 4, 0),
    "minus_one_rows": (12, 16, 10, 6, 3, 4),
    "zero_tokens": (0, 16, 6, 4, 2, 0),
}


@f32_bf16
@pytest.mark.parametrize("case", GATHER_EDGES)
def test_group_gemm_gather_contract(rng, backend, case, dtype):
    tokens, k, n, experts, topk, holes = GATHER_EDGES[case]
    _, d2s, sizes = oracle.token_index(random_ids(rng, tokens, topk, experts), experts)
    d2s[rng.choice(d2s.size, size=holes, replace=False)] = -1
    x = normal(rng, (tokens, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    got = backend.group_gemm_gather(x, w, jnp.asarray(sizes), jnp.asarray(d2s), topk)
    assert got.shape == (tokens * topk, n) and got.dtype == dtype
    want = oracle.group_gemm(oracle.expand(x, d2s, topk), w, sizes)
    assert_close(got, want, dtype, "vs numpy oracle")
    assert np.all(np.asarray(got)[d2s < 0].astype(np.float32) == 0), "-1 rows are zero"


# -------------------------------------------------------- step 5: activation

ACT_EDGES = {"one_row_I1": (1, 2), "I13": (7, 26), "batched": (2, 3, 10), "zero_rows": (0, 6)}


@dtypes
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("case", ACT_EDGES)
def test_activation_contract(rng, backend, case, gated, dtype):
    shape = ACT_EDGES[case]
    h = normal(rng, shape, dtype, scale=2.0)
    inter = shape[-1] // 2
    for name in ("silu", "gelu", "gelu_tanh"):
        if gated:
            got = backend.gated_activation(h, name)
            out_shape = shape[:-1] + (inter,)
            want = oracle.gated_activation(h, name)
            # gelu's 1 + erf (or 1 + tanh) cancels for negative g: in f32 an
            # absolute error of a few 2^-24 of |g * u| (see test_activation.py).
            atol = 1e-6 * np.abs(oracle.f64(h[..., :inter]) * oracle.f64(h[..., inter:]))
        else:
            got = backend.activation(h, name)
            out_shape = shape
            want = oracle.activation(oracle.f64(h), name)
            atol = 1e-6 * np.abs(oracle.f64(h))
        assert got.shape == out_shape and got.dtype == dtype, name
        assert_close(got, want, dtype, f"{name} vs numpy oracle", atol=atol)


# ----------------------------------------------------------- step 7: combine

COMBINE_EDGES = {  # (T, k, H, local experts of 8: (start, count), or None: every slot -1)
    "one_token": (1, 2, 8, (0, 8)),
    "topk_1": (6, 1, 5, (0, 8)),
    "topk_eq_E": (4, 8, 8, (0, 8)),
    "some_remote": (10, 3, 12, (2, 4)),
    "all_remote": (5, 2, 4, None),
    "H13": (9, 3, 13, (0, 8)),
    "zero_tokens": (0, 2, 16, (0, 8)),
}


@dtypes
@pytest.mark.parametrize("case", COMBINE_EDGES)
def test_combine_contract(rng, backend, case, dtype):
    tokens, k, hidden, local = COMBINE_EDGES[case]
    if local is None:
        s2d = np.full(tokens * k, -1, np.int32)
    else:
        s2d, _, _ = oracle.token_index(random_ids(rng, tokens, k, 8), 8, *local)
    y = normal(rng, (tokens * k, hidden), dtype)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    got = backend.moe_combine(y, weights, jnp.asarray(s2d))
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    assert_close(got, oracle.combine(y, weights, s2d), dtype, "vs numpy oracle")
    unrouted = np.all(s2d.reshape(tokens, k) < 0, axis=1)
    assert np.all(np.asarray(got)[unrouted].astype(np.float32) == 0), "tokens with no slot"


# ----------------------------------------------- steps 3-6 in one: expert_mlp

MLP_EDGES = {  # (T, H, I, E, topk, routing, local experts (start, count) or None: all)
    "one_token": (1, 16, 8, 4, 2, "uniform", None),
    "one_expert": (7, 16, 8, 1, 1, "uniform", None),
    "all_on_one": (9, 16, 8, 4, 1, "all_on_2", None),
    "empty_experts": (12, 24, 8, 8, 2, "empty_edges", None),
    "topk_eq_E": (5, 13, 9, 4, 4, "uniform", None),
    "dropped": (10, 16, 8, 6, 3, "uniform", (2, 2)),
    "zero_tokens": (0, 16, 8, 4, 2, "uniform", None),
}


def _mlp_routing(rng, tokens, experts, topk, routing, local):
    if routing == "all_on_2":
        ids = np.full((tokens, topk), 2, np.int32)
    else:
        ids = random_ids(rng, tokens, topk, experts, routing_allowed(routing, experts, topk, rng))
    start, count = (0, experts) if local is None else local
    _, d2s, sizes = oracle.token_index(ids, experts, start, count)
    return d2s, sizes, count


@f32_bf16
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("case", MLP_EDGES)
def test_expert_mlp_contract(rng, backend, case, gated, dtype):
    tokens, hidden, inter, experts, topk, routing, local = MLP_EDGES[case]
    d2s, sizes, count = _mlp_routing(rng, tokens, experts, topk, routing, local)
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = mlp_weights(rng, count, hidden, inter, dtype, gated=gated)
    got = backend.expert_mlp(x, w13, w2, jnp.asarray(sizes), jnp.asarray(d2s), topk,
                             activation="gelu", is_gated=gated)
    assert got.shape == (tokens * topk, hidden) and got.dtype == dtype
    h = oracle.group_gemm(oracle.expand(x, d2s, topk), w13, sizes)
    a = oracle.gated_activation(h, "gelu") if gated else oracle.activation(h, "gelu")
    want = oracle.group_gemm(a, w2, sizes)
    if dtype == jnp.float32:
        assert_close(got, want, dtype, "vs numpy oracle")
    else:
        err = rel_err(got, want)
        assert err < CHAIN_TOL[jnp.dtype(dtype)], f"vs numpy oracle: relative error {err:.3g}"
    placed = int(sizes.sum())
    _assert_tail_zero(got, placed, "rows past the placed ones")
    if placed:
        assert np.any(np.asarray(got[:placed], np.float32) != 0)


# ----------------------------------------------- steps 1-7 in one: moe_layer

LAYER_EDGES = {  # (T, H, I, E, topk, experts the router may pick)
    "one_token": (1, 16, 8, 4, 2, None),
    "one_expert": (6, 16, 8, 1, 1, None),
    "all_on_one": (8, 16, 8, 4, 1, [2]),
    "empty_experts": (20, 16, 8, 8, 2, [1, 2, 3, 5, 6]),
    "topk_eq_E_H13": (5, 13, 9, 4, 4, None),
    "zero_tokens": (0, 16, 8, 4, 2, None),
}


@f32_bf16
@pytest.mark.parametrize("case", LAYER_EDGES)
def test_moe_layer_contract(rng, backend, case, dtype):
    tokens, hidden, inter, experts, topk, allowed = LAYER_EDGES[case]
    x = normal(rng, (tokens, hidden), dtype)
    logits = router_logits(rng, tokens, experts, jnp.float32, allowed)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype)
    got = backend.moe_layer(x, logits, w13, w2, topk)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    want = oracle.moe_forward(x, logits, w13, w2, topk)
    err = rel_err(got, want)
    assert err < CHAIN_TOL[jnp.dtype(dtype)], f"vs numpy oracle: relative error {err:.3g}"


# --------------------------------------------- one token in one: moe_decode

DECODE_EDGES = {  # (H, I, E, topk): H and I multiples of 256, as moe_decode requires
    "small": (256, 256, 4, 2),
    "one_expert": (256, 256, 1, 1),
    "topk_eq_E": (256, 512, 8, 8),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", DECODE_EDGES)
def test_moe_decode_contract(rng, backend, case, dtype):
    hidden, inter, experts, topk = DECODE_EDGES[case]
    x = normal(rng, (1, hidden), dtype)
    logits = router_logits(rng, 1, experts, jnp.float32)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype)
    got = backend.moe_decode(x, logits, w13, w2, topk)
    assert got.shape == (1, hidden) and got.dtype == dtype
    want = oracle.moe_forward(x, logits, w13, w2, topk)
    err = rel_err(got, want)
    assert err < CHAIN_TOL[jnp.dtype(dtype)], f"vs numpy oracle: relative error {err:.3g}"


# ------------------------------------------------------------- zero tokens

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
    "combine": lambda m: m.moe_combine(jnp.zeros((0, 16)), jnp.zeros((0, 2)),
                                       jnp.zeros((0,), jnp.int32)),
    "moe_layer": lambda m: m.moe_layer(jnp.zeros((0, 16)), jnp.zeros((0, 8)),
                                       jnp.zeros((8, 6, 16)), jnp.zeros((8, 16, 3)), 2),
}
ZERO_TOKEN_SHAPES = {"topk_softmax": [(0, 2), (0, 2)], "token_index": [(0,), (0,), (8,)],
                     "expand": [(0, 16)], "group_gemm": [(0, 6)], "expert_mlp": [(0, 16)],
                     "gated_act": [(0, 3)],
                     "combine": [(0, 16)], "moe_layer": [(0, 16)]}


@pytest.mark.sanitize
@pytest.mark.parametrize("name", list(ZERO_TOKEN_CALLS))
def test_zero_tokens(name, backend):
    out = ZERO_TOKEN_CALLS[name](backend)
    shapes = [leaf.shape for leaf in jax.tree.leaves(jax.block_until_ready(out))]
    assert shapes == ZERO_TOKEN_SHAPES[name]
    if name == "token_index":
        assert np.all(np.asarray(out[2]) == 0), "no tokens: every expert size is 0"
