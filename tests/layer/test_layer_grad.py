"""Gradients of the whole layer: jax.grad of moe_forward on the FFI kernels
(forward and backward custom calls) against jax.grad of the reference
backend (plain jax.numpy autodiff), for every routing option and at the
edges; the compiled gradient's custom calls; reproducibility; remat."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from common import (DTYPE_IDS, FLOAT_DTYPES, assert_equal, normal, rel_err, router_logits,
                    routing_allowed)
from conftest import ON_GPU

# ||ffi - reference|| / ||reference|| per gradient. Both sides round the same
# intermediates to the dtype (h, a, y, dy, da, dh) but sum in other orders,
# so they differ by rounding flips: bf16 one ulp 2^-8 of a value, f16 2^-11.
GRAD_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
            jnp.dtype(jnp.float16): 4e-3}
NAMES = ("hidden_states", "router_logits", "w13", "w2")


def inputs(rng, tokens, hidden, inter, experts, dtype, pattern="uniform", k=2, gated=True):
    allowed = routing_allowed(pattern, experts, k, rng)
    up = 2 * inter if gated else inter
    return dict(
        hidden_states=normal(rng, (tokens, hidden), dtype),
        router_logits=router_logits(rng, tokens, experts, jnp.float32, allowed),
        w13=normal(rng, (experts, up, hidden), dtype, hidden**-0.5),
        w2=normal(rng, (experts, hidden, inter), dtype, inter**-0.5),
    ), normal(rng, (tokens, hidden), dtype)


@functools.partial(jax.jit, static_argnames=("backend", "static"))
def grads(arrays, ct, backend, static):
    """Gradients of sum(out * ct) w.r.t. every float array in `arrays`."""
    kw = dict(static)

    def loss(arrays):
        out = jax_moe.moe_forward(**arrays, **kw, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    return jax.grad(loss)(arrays)


@functools.partial(jax.jit, static_argnames=("static",))
def logit_scale(arrays, ct, static):
    """sqrt(sum_t ||ct_t||^2 ||out_t||^2): the size of d router_logits without
    cancellation. A token's d logits mix g_j = <ct_t, y_j> over its experts
    in differences (top-2 renormalised: w1 w2 (g1 - g2)) that can cancel, while
    the rounding in each g_j scales with ||ct_t|| ||y_j||."""
    out = jax_moe.moe_forward(**arrays, **dict(static), backend="reference").astype(jnp.float32)
    per_token = jnp.sum(jnp.square(ct.astype(jnp.float32)), -1) * jnp.sum(jnp.square(out), -1)
    return jnp.sqrt(jnp.sum(per_token))


def check(arrays, ct, dtype, **static):
    static = tuple(sorted(static.items()))
    got = grads(arrays, ct, "ffi", static)
    want = grads(arrays, ct, "reference", static)
    for name in got:
        a, w = got[name], want[name]
        assert a.shape == arrays[name].shape and a.dtype == arrays[name].dtype, name
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"d {name}: not finite"
        # A gradient that is zero in exact arithmetic (top-1 with
        # renormalisation: every weight is 1) is rounding noise on both
        # sides: then both must be that small, against the cotangent's scale.
        noise = 1e-5 * float(np.linalg.norm(np.asarray(ct, np.float64)))
        if np.linalg.norm(np.asarray(w, np.float64)) < noise:
            assert np.linalg.norm(np.asarray(a, np.float64)) < noise, f"d {name}: not ~0"
            continue
        err = rel_err(a, w)
        if name == "router_logits":  # against the uncancelled size when that is larger
            diff = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(w, np.float64))
            err = diff / max(np.linalg.norm(np.asarray(w, np.float64)),
                             float(logit_scale(arrays, ct, static)))
        assert err < GRAD_TOL[jnp.dtype(dtype)], f"d {name}: relative error {err:.3g}"
    return got


SHAPES = [  # (T, H, I, E, k)
    (1, 72, 13, 8, 2),     # one token
    (33, 72, 24, 1, 1),    # one expert
    (40, 130, 7, 4, 4),    # topk = E; H, I not multiples of any tile
    (96, 64, 48, 16, 4),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_grad_matches_reference(rng, shape, dtype):
    t, h, i, e, k = shape
    arrays, ct = inputs(rng, t, h, i, e, dtype, k=k)
    check(arrays, ct, dtype, topk=k)


ROUTINGS = {
    "softmax_no_renorm": dict(renormalize=False),
    "sigmoid_scaled": dict(scoring_func="sigmoid", routed_scaling_factor=2.5),
    "grouped": dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                    routed_scaling_factor=2.5, bias=True),
    "grouped_softmax": dict(num_expert_group=4, topk_group=3, renormalize=False),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
def test_grad_routing_options(rng, routing, dtype):
    opts = dict(ROUTINGS[routing])
    arrays, ct = inputs(rng, 48, 64, 24, 16, dtype, k=3)
    if opts.pop("bias", False):
        arrays["e_score_correction_bias"] = jnp.asarray(rng.standard_normal(16) * 0.1,
                                                        jnp.float32)
    got = check(arrays, ct, dtype, topk=3, **opts)
    if "e_score_correction_bias" in got:  # it chooses, never weights: no gradient
        assert_equal(got["e_score_correction_bias"], jnp.zeros(16, jnp.float32))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_grad_activations(rng, activation, gated):
    arrays, ct = inputs(rng, 40, 72, 16, 8, jnp.float32, k=2, gated=gated)
    check(arrays, ct, jnp.float32, topk=2, activation=activation, is_gated=gated)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pattern", ["one_set", "empty_edges"])
@pytest.mark.parametrize("k", [1, 2])
def test_grad_routing_patterns(rng, pattern, k, dtype):
    # one_set: every token on the same k experts (k = 1: all on one expert);
    # empty_edges: the first, a middle and the last expert get no tokens, so
    # their weight gradients must be exactly zero.
    e = 8
    arrays, ct = inputs(rng, 64, 72, 16, e, dtype, pattern=pattern, k=k)
    got = check(arrays, ct, dtype, topk=k)
    ids = np.asarray(jax_moe.reference.route(arrays["router_logits"], k)[1])
    for expert in sorted(set(range(e)) - set(ids.ravel().tolist())):
        for name in ("w13", "w2"):
            assert_equal(got[name][expert], jnp.zeros_like(got[name][expert]),
                         f"d {name} of expert {expert}, which has no tokens")


@pytest.mark.parametrize("gate", [False, True])
def test_grad_shared_experts(rng, gate):
    t, h, i, e, k, i_s = 32, 72, 16, 8, 2, 24
    arrays, ct = inputs(rng, t, h, i, e, jnp.float32, k=k)
    arrays["shared_w13"] = normal(rng, (2 * i_s, h), jnp.float32, h**-0.5)
    arrays["shared_w2"] = normal(rng, (h, i_s), jnp.float32, i_s**-0.5)
    if gate:
        arrays["shared_gate"] = normal(rng, (h,), jnp.float32, h**-0.5)
    check(arrays, ct, jnp.float32, topk=k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_remat_same_bits_and_reproducible(rng, dtype):
    arrays, ct = inputs(rng, 80, 64, 32, 8, dtype, k=2)
    static = (("topk", 2),)
    first = grads(arrays, ct, "ffi", static)
    again = grads(arrays, ct, "ffi", static)
    remat = grads(arrays, ct, "ffi", static + (("remat", True),))
    for name in first:
        assert_equal(again[name], first[name], f"d {name}: second run")
        assert_equal(remat[name], first[name], f"d {name} with remat")


def test_grad_program_runs_on_the_kernels(rng):
    """The compiled gradient runs the backward custom calls, and no
    ragged_dot or dot (dense expert matmul) at all."""
    arrays, ct = inputs(rng, 64, 64, 32, 8, jnp.float32, k=2)
    text = grads.lower(arrays, ct, "ffi", (("topk", 2),)).as_text()
    def has(target):
        return f'"{target}"' in text or f"@{target}" in text or target + '"' in text

    for target in ("jax_moe_route", "jax_moe_token_index", "jax_moe_group_gemm",
                   "jax_moe_group_gemm_wgrad", "jax_moe_expand", "jax_moe_combine",
                   "jax_moe_activation", "jax_moe_activation_scaled_grad"):
        assert has(target), target
    # The top-k weights' gradient comes from the activation's backward, not
    # from the expert outputs (which the forward does not keep).
    assert not has("jax_moe_combine_bwd")
    assert "ragged_dot" not in text
    assert "dot_general" not in text


@pytest.mark.skipif(not ON_GPU, reason="the one-token kernel runs on the GPU only")
def test_grad_one_token_decode_kernel(rng):
    """At one token the GPU forward is moe_decode; its gradient is the layer's."""
    arrays, ct = inputs(rng, 1, 256, 256, 16, jnp.bfloat16, k=4)
    assert jax_moe.ops.moe_decode_supported(arrays["hidden_states"], arrays["router_logits"],
                                            arrays["w13"], arrays["w2"], 4)
    check(arrays, ct, jnp.bfloat16, topk=4)


def test_grad_under_vmap_free_jit_no_retrace(rng):
    """One compile serves new routings: the gradient's shapes never depend on them."""
    arrays, ct = inputs(rng, 24, 64, 16, 8, jnp.float32, k=2)
    static = (("topk", 2),)
    grads(arrays, ct, "ffi", static)
    before = grads._cache_size()
    arrays["router_logits"] = router_logits(rng, 24, 8, jnp.float32)
    grads(arrays, ct, "ffi", static)
    assert grads._cache_size() == before


def test_forward_keeps_no_expert_outputs(rng):
    """What jax.vjp keeps from the forward: w13's output h (T*k x 2I) once, the
    expanded rows (T*k x H) only where expert_mlp keeps them, and no expert
    outputs y (T*k x H): the top-k weights' gradient is computed without
    them. With remat, neither h nor the rows."""
    from jax_moe.ops.expert_mlp import _keeps_rows
    tokens, hidden, inter, experts, k = 16, 48, 40, 8, 2
    arrays, _ = inputs(rng, tokens, hidden, inter, experts, jnp.float32, k=k)
    m = tokens * k
    for remat in (False, True):
        layer = functools.partial(jax_moe.moe_forward, topk=k, remat=remat)
        _, vjp = jax.vjp(layer, *arrays.values())
        shapes = [tuple(a.shape) for a in jax.tree_util.tree_leaves(vjp)]
        kept = _keeps_rows(m, arrays["hidden_states"], arrays["w13"], (None, None), remat)
        assert shapes.count((m, hidden)) == int(kept), shapes
        assert shapes.count((m, 2 * inter)) == (0 if remat else 1), shapes
