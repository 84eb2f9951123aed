"""Property tests of the whole layer: moe_forward on the FFI kernels against
the reference backend for every routing option, gated and plain
activations, shared experts; an expert range (expert parallelism: only the
experts [start, start + L) computed, as each device of moe_forward_sharded
does); jax.grad on small sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import jax_moe
from common import mlp_weights, normal, rel_err
from jax_moe import _checks, backends
from jax_moe.ops.moe_layer import routed_layer
from property_common import (ACTIVATIONS, MARKS, NORM_TOL, dtypes, experts_topk, local_range,
                             routing_logits, routing_options, seeds, sizes)

pytestmark = MARKS

STATIC = ("topk", "renormalize", "activation", "is_gated", "scoring_func", "num_expert_group",
          "topk_group", "routed_scaling_factor", "backend")
forward = jax.jit(jax_moe.moe_forward, static_argnames=STATIC)


@st.composite
def layer_case(draw, max_tokens=40, max_hidden=70, max_inter=40):
    """(arrays, static keyword arguments, dtype) of one moe_forward call."""
    seed = draw(seeds)
    tokens, hidden, inter = (draw(sizes(max_tokens)), draw(sizes(max_hidden, 1)),
                             draw(sizes(max_inter, 1)))
    experts, k, routing = draw(experts_topk())
    dtype = draw(dtypes)
    kw = draw(routing_options(experts, k))
    gated = draw(st.booleans())
    kw.update(topk=k, activation=draw(st.sampled_from(ACTIVATIONS)), is_gated=gated)
    rng = np.random.default_rng(seed)
    arrays = dict(hidden_states=normal(rng, (tokens, hidden), dtype),
                  router_logits=routing_logits(rng, tokens, experts, routing))
    arrays["w13"], arrays["w2"] = mlp_weights(rng, experts, hidden, inter, dtype, gated)
    if draw(st.booleans()):  # chooses experts, never weights them
        arrays["e_score_correction_bias"] = jnp.asarray(rng.standard_normal(experts), jnp.float32)
    shared = draw(st.sampled_from(["none", "mlp", "gated_mlp", "output"]))
    if shared in ("mlp", "gated_mlp"):
        si = draw(sizes(30, 1))
        arrays["shared_w13"] = normal(rng, (2 * si if gated else si, hidden), dtype,
                                      hidden**-0.5)
        arrays["shared_w2"] = normal(rng, (hidden, si), dtype, si**-0.5)
        if shared == "gated_mlp":
            arrays["shared_gate"] = normal(rng, (hidden,), dtype, hidden**-0.5)
    elif shared == "output":
        arrays["shared_expert_output"] = normal(rng, (tokens, hidden), dtype)
    return arrays, kw, dtype


@given(case=layer_case())
def test_forward(case):
    arrays, kw, dtype = case
    got = forward(**arrays, **kw, backend="ffi")
    want = forward(**arrays, **kw, backend="reference")
    assert got.shape == arrays["hidden_states"].shape and got.dtype == dtype
    err = rel_err(got, want)
    assert err <= NORM_TOL[jnp.dtype(dtype)], f"ffi vs reference: relative error {err:.3g}"


_REF = backends.steps("reference")


@functools.partial(jax.jit, static_argnames=("spec", "start", "local"))
def local_layers(x, logits, w13, w2, spec, start, local):
    """The layer over experts [start, start + local) only: the kernels'
    routed_layer, and the reference's steps composed the same way."""
    got = routed_layer(x, logits, w13, w2, None, spec, start, local)
    r = spec.routing
    weights, ids = _REF.route(logits, None, r)
    s2d, d2s, sz = _REF.token_index(ids, logits.shape[1], start, local)
    y = _REF.expert_mlp(x, w13, w2, sz, d2s, r.topk, spec.activation, spec.is_gated,
                        tuple(spec.tile_m))
    return got, _REF.combine(y, weights, s2d)


@given(seed=seeds, tokens=sizes(40), hidden=sizes(60, 1), inter=sizes(30, 1), ek=experts_topk(),
       gated=st.booleans(), name=st.sampled_from(ACTIVATIONS), data=st.data(), dtype=dtypes)
def test_local_expert_range(seed, tokens, hidden, inter, ek, gated, name, data, dtype):
    experts, k, routing = ek
    start, local = data.draw(local_range(experts))
    kw = data.draw(routing_options(experts, k))
    rng = np.random.default_rng(seed)
    x = normal(rng, (tokens, hidden), dtype)
    logits = routing_logits(rng, tokens, experts, routing)
    w13, w2 = mlp_weights(rng, local, hidden, inter, dtype, gated)
    # the checks of moe_layer on all E experts' weights shapes (the spec only)
    spec = _checks.moe_layer_args(
        x, logits, jax.ShapeDtypeStruct((experts,) + w13.shape[1:], dtype),
        jax.ShapeDtypeStruct((experts,) + w2.shape[1:], dtype), k,
        activation_name=name, is_gated=gated, e_score_correction_bias=None, tile=None,
        **{key: kw.get(key) for key in ("num_expert_group", "topk_group")},
        **{key: kw[key] for key in ("scoring_func", "renormalize", "routed_scaling_factor")})
    got, want = local_layers(x, logits, w13, w2, spec, start, local)
    assert got.shape == want.shape == (tokens, hidden)
    err = rel_err(got, want)
    assert err <= NORM_TOL[jnp.dtype(dtype)], f"expert range: relative error {err:.3g}"


@functools.partial(jax.jit, static_argnames=("kw",))
def grads(arrays, ct, kw):
    kw = dict(kw)

    def loss(a):
        return jnp.sum(jax_moe.moe_forward(**a, **kw).astype(jnp.float32) * ct)

    float_arrays = {n: a for n, a in arrays.items() if n != "e_score_correction_bias"}
    rest = {n: a for n, a in arrays.items() if n == "e_score_correction_bias"}
    return jax.grad(lambda a: loss({**a, **rest}))(float_arrays)


@given(case=layer_case(max_tokens=12, max_hidden=24, max_inter=12))
def test_grad(case):
    arrays, kw, dtype = case
    ct = normal(np.random.default_rng(0), arrays["hidden_states"].shape, jnp.float32)
    got = grads(arrays, ct, tuple(sorted({**kw, "backend": "ffi"}.items())))
    want = grads(arrays, ct, tuple(sorted({**kw, "backend": "reference"}.items())))
    # A gradient that is zero in exact arithmetic (top-1 with renormalisation:
    # every weight is 1, whatever the logits) is rounding noise of either sign
    # on both backends: then both must be that small, against the cotangent.
    noise = 1e-5 * float(np.linalg.norm(np.asarray(ct, np.float64)))
    # In bf16/f16 the two backends round the same intermediates but sum in
    # other orders; where a gradient is a sum of terms that nearly cancel (one
    # token, H = 2) one ulp of a term is many of the result. So the bound is
    # the tolerance plus twice the reference's own error against the same
    # gradient computed in f32 (the backends may differ by both their errors).
    want32 = want
    if jnp.dtype(dtype) != jnp.float32:
        up = {n: a.astype(jnp.float32) for n, a in arrays.items()}
        want32 = grads(up, ct, tuple(sorted({**kw, "backend": "reference"}.items())))
    for name in got:
        assert got[name].shape == arrays[name].shape, name
        if np.linalg.norm(np.asarray(want[name], np.float64)) < noise:
            assert np.linalg.norm(np.asarray(got[name], np.float64)) < noise, f"d {name}: not ~0"
            continue
        err = rel_err(got[name], want[name])
        bound = NORM_TOL[jnp.dtype(dtype)] + 2 * rel_err(want[name], want32[name])
        assert err <= bound, f"d {name}: relative error {err:.3g} > {bound:.3g}"
