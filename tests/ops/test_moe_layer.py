"""Steps 1-7 in one call: ops.moe_layer with the bits of the four ops it
replaces (route, token index, expert_mlp, combine), at every tile and
activation, against its twin in jax_moe.reference. The contract on both
backends at the edges is in test_conformance.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import (DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, mlp_weights, normal,
                    router_logits, rtol_for)
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


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
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype, gated=gated)
    kw = dict(kw)
    if "num_expert_group" in kw:
        kw["e_score_correction_bias"] = jnp.asarray(rng.standard_normal(experts), jnp.float32)
    return (x, logits, w13, w2, topk), kw


def _assert_close_to_reference(got, args, kw, dtype, activation="silu", is_gated=True):
    """got against reference.moe_layer. Past the one rounding that RTOL
    allows for, the layer rounds h, the activation and y to the dtype before
    the combine sums the weighted y rows: a flip there moves the output by
    about rtol of the terms summed, however much they cancel, so each element
    may also be off by rtol * sum_j |w_j| |y_j| (the reference's steps, in f32)."""
    x, logits, w13, w2, topk = args
    weights, ids = reference.route(logits, topk, **kw)
    src_to_dst, dst_to_src, sizes = reference.moe_compute_token_index(ids, w13.shape[0])
    y = reference.expert_mlp(x, w13, w2, sizes, dst_to_src, topk, activation=activation,
                             is_gated=is_gated)
    terms = reference.moe_combine(jnp.abs(y.astype(jnp.float32)), jnp.abs(weights), src_to_dst)
    want = reference.moe_layer(*args, activation=activation, is_gated=is_gated, **kw)
    assert_close(got, want, dtype, "vs reference", atol=rtol_for(dtype) * np.asarray(terms))


def _layer_by_ops(mod, x, logits, w13, w2, topk, activation="silu", is_gated=True, tile_m=None,
                  **routing):
    weights, ids = mod.route(logits, topk, **routing)
    src_to_dst, dst_to_src, sizes = mod.moe_compute_token_index(ids, w13.shape[0])
    y = mod.expert_mlp(x, w13, w2, sizes, dst_to_src, topk, activation=activation,
                       is_gated=is_gated, tile_m=tile_m)
    return mod.moe_combine(y, weights, src_to_dst)


@dtypes
@pytest.mark.parametrize("tiles", [None, (8, 16), (32, 128), (256, 8), (256, 256)], ids=str)
@pytest.mark.parametrize("case", MOE_LAYER_CASES, ids=MOE_LAYER_IDS)
def test_moe_layer_same_bits_as_four_ops(rng, case, tiles, dtype):
    args, kw = _moe_layer_inputs(rng, case, dtype)
    got = jax.jit(functools.partial(ops.moe_layer, topk=args[-1], tile_m=tiles, **kw))(*args[:-1])
    assert got.shape == args[0].shape and got.dtype == dtype
    assert_equal(got, _layer_by_ops(ops, *args, tile_m=tiles, **kw), f"tiles={tiles}")
    _assert_close_to_reference(got, args, kw, dtype)
    assert np.any(np.asarray(got, np.float32) != 0.0)


def _check_calls_at_tile_256(rng, tokens, inter, one_call, experts=4):
    """moe_layer at tiles (256, 256), top-2, H = 64: one call (its last
    scratch output the two GEMMs' tile counters) or separate ones, with the
    bits of the four ops either way."""
    x = normal(rng, (tokens, 64), jnp.bfloat16)
    logits = router_logits(rng, tokens, experts, jnp.float32, None)
    w13, w2 = mlp_weights(rng, experts, 64, inter, jnp.bfloat16)
    layer = functools.partial(ops.moe_layer, topk=2, tile_m=(256, 256))
    text = jax.jit(layer).lower(x, logits, w13, w2).as_text()
    assert ("jax_moe_moe_layer" in text) == one_call, text
    assert ("jax_moe_group_gemm" in text) == (not one_call), text
    assert ("tensor<2xi32>" in text) == one_call, text
    assert_equal(layer(x, logits, w13, w2),
                 _layer_by_ops(ops, x, logits, w13, w2, 2, tile_m=(256, 256)), f"T={tokens}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, experts, one_call",
                         [(128, 4, True), (1024, 4, False), (128, 1025, False)])
def test_moe_layer_one_call_where_the_own_kernel_runs(rng, tokens, experts, one_call):
    # Tiles of 256 with experts averaging at most WGMMA_MAX_AVG_ROWS (128)
    # rows, at most 1024 of them: the own Hopper kernel, chained in the one
    # moe_layer call (T = 128: 64 rows an expert); with more rows (T = 1024:
    # 512) or past 1024 experts, CUTLASS's kernels in separate calls with
    # their scratch. Elsewhere than on Hopper: separate.
    from jax_moe import tuning
    _check_calls_at_tile_256(rng, tokens, 128, one_call and tuning.sm90_device(), experts)


@pytest.mark.parametrize("tokens, experts, one_call",
                         [(256, 4, True), (258, 4, False), (128, 1024, True), (128, 1025, False)])
def test_moe_layer_one_call_switch_with_the_hopper_rule_forced(rng, monkeypatch, tokens, experts,
                                                               one_call):
    # The rule as on a Hopper GPU (sm90_usable forced, so that every backend
    # runs it): experts averaging at most WGMMA_MAX_AVG_ROWS (128) rows keep
    # one call, its last scratch output the two GEMMs' tile counters (T = 256,
    # top-2 over 4 experts: 128 rows); one row more (T = 258: 129) takes
    # separate calls, and so does one expert past the own kernel's 1024.
    # Either way the bits of the four ops (the CPU handler leaves the
    # counters alone).
    from jax_moe import tuning
    monkeypatch.setattr(tuning, "sm90_usable", lambda n, k, dtype: True)
    _check_calls_at_tile_256(rng, tokens, 64, one_call, experts)


@pytest.mark.sanitize
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("is_gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("case", [MOE_LAYER_CASES[0], MOE_LAYER_CASES[-1]], ids=["T1", "T300"])
def test_moe_layer_activations(rng, case, activation, is_gated):
    args, kw = _moe_layer_inputs(rng, case, jnp.bfloat16, gated=is_gated)
    got = ops.moe_layer(*args, activation=activation, is_gated=is_gated, **kw)
    want = _layer_by_ops(ops, *args, activation=activation, is_gated=is_gated, **kw)
    assert_equal(got, want, f"{activation}, gated={is_gated}")
    _assert_close_to_reference(got, args, kw, jnp.bfloat16, activation, is_gated)


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
