"""Property tests of each step op of jax_moe.ops against its twin in
jax_moe.reference, on random sizes (0 and 1 included, most not a multiple of
any tile), dtypes, routings and expert ranges."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import jax_moe
from common import assert_close, assert_equal, mlp_weights, normal, ref, rel_err
from jax_moe import ops, reference
from property_common import (ACTIVATIONS, MARKS, NORM_TOL, SPLITS, dtypes, experts_topk,
                             local_range, routing_logits, routing_options, scaled, seeds, sizes,
                             split_sizes)

pytestmark = MARKS

def _jit(fn, *static):
    return jax.jit(fn, static_argnames=static)


ops_route = _jit(ops.route, "topk", "scoring_func", "renormalize", "num_expert_group",
                 "topk_group", "routed_scaling_factor")
ref_route = _jit(reference.route, "topk", "scoring_func", "renormalize", "num_expert_group",
                 "topk_group", "routed_scaling_factor")
ops_token_index = _jit(ops.moe_compute_token_index, "num_experts", "start_expert",
                       "num_local_experts")
ops_expand = _jit(ops.moe_expand_input, "topk")
ops_gemm = _jit(ops.group_gemm)
ops_gather = _jit(ops.group_gemm_gather, "topk")
ref_gather = _jit(reference.group_gemm_gather, "topk")
ops_act = _jit(ops.activation, "activation")
ref_act = _jit(reference.activation, "activation")
ops_gated = _jit(ops.gated_activation, "activation")
ops_combine = _jit(ops.moe_combine)
ops_wgrad = _jit(ops.group_gemm_wgrad, "topk")
ref_wgrad = _jit(reference.group_gemm_wgrad, "topk")
ops_mlp = _jit(ops.expert_mlp, "topk", "activation", "is_gated")
ops_layer = _jit(ops.moe_layer, "topk", "scoring_func", "renormalize", "num_expert_group",
                 "topk_group", "routed_scaling_factor", "activation", "is_gated")
ops_decode = _jit(ops.moe_decode, "topk", "renormalize", "routed_scaling_factor")
ref_decode = _jit(reference.moe_decode, "topk", "renormalize", "routed_scaling_factor")


def _ids(rng, tokens, experts, k, routing):
    _, ids = ref.topk_softmax(routing_logits(rng, tokens, experts, routing), topk=k)
    return ids


@given(seed=seeds, tokens=sizes(70), ek=experts_topk(), data=st.data())
def test_route(seed, tokens, ek, data):
    experts, k, routing = ek
    kw = data.draw(routing_options(experts, k))
    logits = routing_logits(np.random.default_rng(seed), tokens, experts, routing)
    w, ids = ops_route(logits, topk=k, **kw)
    w_ref, ids_ref = ref_route(logits, topk=k, **kw)
    assert_equal(ids, ids_ref, "ids")
    assert_close(w, w_ref, jnp.float32, "weights")


@given(seed=seeds, tokens=sizes(70), ek=experts_topk(), data=st.data())
def test_token_index(seed, tokens, ek, data):
    experts, k, routing = ek
    start, local = data.draw(local_range(experts))
    ids = _ids(np.random.default_rng(seed), tokens, experts, k, routing)
    got = ops_token_index(ids, num_experts=experts, start_expert=start, num_local_experts=local)
    want = ref.moe_compute_token_index(ids, num_experts=experts, start_expert=start,
                                       num_local_experts=local)
    for name, a, b in zip(("src_to_dst", "dst_to_src", "sizes"), got, want):
        assert_equal(a, b, name)


def _gather_inputs(rng, tokens, experts, k, routing, start, local):
    ids = _ids(rng, tokens, experts, k, routing)
    return ref.moe_compute_token_index(ids, num_experts=experts, start_expert=start,
                                       num_local_experts=local)


@given(seed=seeds, tokens=sizes(50), hidden=sizes(70, 1), ek=experts_topk(), data=st.data(),
       dtype=dtypes)
def test_expand(seed, tokens, hidden, ek, data, dtype):
    experts, k, routing = ek
    start, local = data.draw(local_range(experts))
    rng = np.random.default_rng(seed)
    _, d2s, _ = _gather_inputs(rng, tokens, experts, k, routing, start, local)
    x = normal(rng, (tokens, hidden), dtype)
    assert_equal(ops_expand(x, d2s, topk=k), ref.moe_expand_input(x, d2s, topk=k), "expand")


@given(seed=seeds, rows=sizes(150), kdim=sizes(80, 1), n=sizes(80, 1),
       groups=st.integers(1, 7), split=st.sampled_from(SPLITS), dtype=dtypes)
def test_group_gemm(seed, rows, kdim, n, groups, split, dtype):
    rng = np.random.default_rng(seed)
    x = normal(rng, (rows, kdim), dtype)
    w = normal(rng, (groups, n, kdim), dtype, kdim**-0.5)
    s = jnp.asarray(split_sizes(rng, rows, groups, split))
    assert_close(ops_gemm(x, w, s), ref.group_gemm(x, w, s), dtype, "group_gemm")


@given(seed=seeds, tokens=sizes(50), kdim=sizes(70, 1), n=sizes(70, 1), ek=experts_topk(),
       data=st.data(), dtype=dtypes)
def test_group_gemm_gather(seed, tokens, kdim, n, ek, data, dtype):
    experts, k, routing = ek
    start, local = data.draw(local_range(experts))
    rng = np.random.default_rng(seed)
    _, d2s, s = _gather_inputs(rng, tokens, experts, k, routing, start, local)
    x = normal(rng, (tokens, kdim), dtype)
    w = normal(rng, (local, n, kdim), dtype, kdim**-0.5)
    assert_close(ops_gather(x, w, s, d2s, topk=k), ref_gather(x, w, s, d2s, topk=k), dtype,
                 "group_gemm_gather")


@given(seed=seeds, rows=sizes(100), inter=sizes(90, 1), gated=st.booleans(),
       name=st.sampled_from(ACTIVATIONS), dtype=dtypes)
def test_activation(seed, rows, inter, gated, name, dtype):
    h = normal(np.random.default_rng(seed), (rows, 2 * inter if gated else inter), dtype, 2.0)
    if gated:
        got, want = ops_gated(h, activation=name), ref.gated_activation(h, activation=name)
    else:
        got, want = ops_act(h, activation=name), ref_act(h, activation=name)
    assert_close(got, want, dtype, f"{name} gated={gated}")


@given(seed=seeds, tokens=sizes(60), hidden=sizes(70, 1), ek=experts_topk(), data=st.data(),
       dtype=dtypes)
def test_combine(seed, tokens, hidden, ek, data, dtype):
    experts, k, routing = ek
    start, local = data.draw(local_range(experts))
    rng = np.random.default_rng(seed)
    s2d, _, _ = _gather_inputs(rng, tokens, experts, k, routing, start, local)
    y = normal(rng, (tokens * k, hidden), dtype)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    assert_close(ops_combine(y, weights, s2d), ref.moe_combine(y, weights, s2d), dtype,
                 "combine")


@given(seed=seeds, tokens=sizes(50), kdim=sizes(60, 1), n=sizes(60, 1), ek=experts_topk(),
       gather=st.booleans(), data=st.data(), dtype=dtypes)
def test_group_gemm_wgrad(seed, tokens, kdim, n, ek, gather, data, dtype):
    experts, k, routing = ek
    start, local = data.draw(local_range(experts))
    rng = np.random.default_rng(seed)
    _, d2s, s = _gather_inputs(rng, tokens, experts, k, routing, start, local)
    dy = normal(rng, (tokens * k, n), dtype)
    x = normal(rng, (tokens if gather else tokens * k, kdim), dtype)
    kw = dict(dst_to_src=d2s, topk=k) if gather else dict(topk=1)
    got, want = ops_wgrad(dy, x, s, **kw), ref_wgrad(dy, x, s, **kw)
    assert_close(got, want, dtype, "group_gemm_wgrad")
    for e in np.flatnonzero(np.asarray(s) == 0):  # no rows: exact zeros
        assert_equal(got[e], jnp.zeros_like(got[e]), f"dw of empty expert {e}")


@given(seed=seeds, tokens=sizes(40), hidden=sizes(70, 1), inter=sizes(40, 1), ek=experts_topk(),
       gated=st.booleans(), name=st.sampled_from(ACTIVATIONS), data=st.data(), dtype=dtypes)
def test_expert_mlp(seed, tokens, hidden, inter, ek, gated, name, data, dtype):
    experts, k, routing = ek
    start, local = data.draw(local_range(experts))
    rng = np.random.default_rng(seed)
    _, d2s, s = _gather_inputs(rng, tokens, experts, k, routing, start, local)
    x = normal(rng, (tokens, hidden), dtype)
    w13, w2 = mlp_weights(rng, local, hidden, inter, dtype, gated)
    kw = dict(topk=k, activation=name, is_gated=gated)
    got, want = ops_mlp(x, w13, w2, s, d2s, **kw), ref.expert_mlp(x, w13, w2, s, d2s, **kw)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(got, want) <= NORM_TOL[jnp.dtype(dtype)], "expert_mlp"


@given(seed=seeds, tokens=sizes(40), hidden=sizes(70, 1), inter=sizes(40, 1), ek=experts_topk(),
       gated=st.booleans(), name=st.sampled_from(ACTIVATIONS), data=st.data(), dtype=dtypes)
def test_moe_layer(seed, tokens, hidden, inter, ek, gated, name, data, dtype):
    experts, k, routing = ek
    kw = data.draw(routing_options(experts, k))
    rng = np.random.default_rng(seed)
    x = normal(rng, (tokens, hidden), dtype)
    logits = routing_logits(rng, tokens, experts, routing)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype, gated)
    kw.update(topk=k, activation=name, is_gated=gated)
    got = ops_layer(x, logits, w13, w2, **kw)
    want = ref.moe_layer(x, logits, w13, w2, **kw)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(got, want) <= NORM_TOL[jnp.dtype(dtype)], "moe_layer"


@given(seed=seeds, hidden_blocks=st.integers(1, scaled(6)), inter_blocks=st.integers(1, scaled(4)),
       ek=experts_topk(), renormalize=st.booleans(),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float16]))
def test_moe_decode(seed, hidden_blocks, inter_blocks, ek, renormalize, dtype):
    """One token within moe_decode's limits (H, I multiples of its unit)."""
    experts, k, routing = ek
    unit = jax_moe._checks.DECODE_LIMITS["multiple"]
    hidden, inter = hidden_blocks * unit, inter_blocks * unit
    rng = np.random.default_rng(seed)
    x = normal(rng, (1, hidden), dtype)
    logits = routing_logits(rng, 1, experts, routing)
    w13 = normal(rng, (experts, 2 * inter, hidden), dtype, hidden**-0.5)
    w2 = normal(rng, (experts, hidden, inter), dtype, inter**-0.5)
    assert ops.moe_decode_supported(x, logits, w13, w2, k)
    kw = dict(topk=k, renormalize=renormalize)
    got, want = ops_decode(x, logits, w13, w2, **kw), ref_decode(x, logits, w13, w2, **kw)
    assert got.shape == (1, hidden) and got.dtype == dtype
    assert rel_err(got, want) <= NORM_TOL[jnp.dtype(dtype)], "moe_decode"
