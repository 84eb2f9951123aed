"""moe_forward with block-scaled fp8 expert weights (w13_scale, w2_scale): the
kernels against the reference twin (the same quantisation) for the routing
options, activations, shared experts and routing patterns; against the bf16
layer on the dequantised weights; clear errors for missing or misshapen
scales and for mixed weight dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from common import mlp_weights, normal, rel_err, router_logits, routing_allowed
from jax_moe import fp8

# The twin quantises the same rows with the same rule. Its w13 GEMM sums in
# another order, so h may differ in the last bit, which can flip one
# element's e4m3 rounding in the activation's quantisation (up to 2^-4 of
# that element): f32 results agree to the ulp in most draws (median about
# 3e-7), but a flip moves the small layers here by up to a few 1e-3 (the
# largest of 900 draws of test_activations' layers on the CPU: 2.2e-3). In
# bf16 a last-bit difference of the activation's output flips its e4m3 code
# far more often (the e4m3 midpoints are bf16 values), and a few flips move
# the layers by up to about 2e-2.
TOL = {jnp.dtype(jnp.float32): 5e-3, jnp.dtype(jnp.bfloat16): 2e-2}


def layer_inputs(rng, tokens, hidden, inter, experts, dtype, pattern="uniform", k=2, gated=True):
    w13, w2 = mlp_weights(rng, experts, hidden, inter, jnp.float32, gated)
    w13q, s13 = fp8.quantize_blocks(w13)
    w2q, s2 = fp8.quantize_blocks(w2)
    allowed = routing_allowed(pattern, experts, k, rng)
    return dict(hidden_states=normal(rng, (tokens, hidden), dtype),
                router_logits=router_logits(rng, tokens, experts, jnp.float32, allowed),
                w13=w13q, w2=w2q, w13_scale=s13, w2_scale=s2)


def forward(a, backend, **kw):
    return jax.jit(lambda a: jax_moe.moe_forward(**a, backend=backend, **kw))(a)


def check_against_twin(a, **kw):
    got = forward(a, "ffi", **kw)
    want = forward(a, "reference", **kw)
    assert got.dtype == a["hidden_states"].dtype and got.shape == a["hidden_states"].shape
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    assert rel_err(got, want) <= TOL[jnp.dtype(got.dtype)]
    return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [
    (1, 256, 128, 8, 2),      # one token (on the GPU: ops.moe_decode_fp8)
    (37, 200, 136, 6, 2),     # sizes off the 128 grid
    (64, 256, 128, 4, 4),     # topk = E
])
def test_matches_twin(rng, dtype, tokens, hidden, inter, experts, k):
    check_against_twin(layer_inputs(rng, tokens, hidden, inter, experts, dtype, k=k), topk=k)


@pytest.mark.parametrize("routing", ["deepseek", "qwen_plain"])
def test_routing_options(rng, routing):
    a = layer_inputs(rng, 48, 256, 128, 8, jnp.bfloat16, k=2)
    if routing == "deepseek":
        kw = dict(topk=2, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                  routed_scaling_factor=2.5, e_score_correction_bias=normal(rng, (8,),
                                                                           jnp.float32, 0.1))
    else:
        kw = dict(topk=2, renormalize=False)
    check_against_twin(a, **kw)


@pytest.mark.parametrize("activation,gated", [("gelu", True), ("silu", False)])
def test_activations(rng, activation, gated):
    a = layer_inputs(rng, 40, 128, 128, 4, jnp.float32, gated=gated)
    check_against_twin(a, topk=2, activation=activation, is_gated=gated)


@pytest.mark.parametrize("pattern", ["one_set", "empty_edges"])
def test_routing_patterns(rng, pattern):
    check_against_twin(layer_inputs(rng, 50, 128, 128, 8, jnp.bfloat16, pattern=pattern), topk=2)


def test_shared_experts(rng):
    a = layer_inputs(rng, 30, 128, 128, 4, jnp.bfloat16)
    sw13, sw2 = mlp_weights(rng, 1, 128, 64, jnp.bfloat16)
    check_against_twin(a, topk=2, shared_w13=sw13[0], shared_w2=sw2[0])


def test_close_to_bf16_on_dequantised_weights(rng):
    """What fp8 costs in accuracy: only the activations' quantisation (the
    weights are the same numbers). Both GEMMs' inputs are rounded to e4m3
    (3 mantissa bits): on Gaussian data that is about 4.4% of the output,
    the twin's figure too."""
    a = layer_inputs(rng, 64, 512, 256, 8, jnp.bfloat16)
    got = forward(a, "ffi", topk=2).astype(jnp.float32)
    bf16 = dict(a, w13=fp8.dequantize_blocks(a["w13"], a["w13_scale"], jnp.bfloat16),
                w2=fp8.dequantize_blocks(a["w2"], a["w2_scale"], jnp.bfloat16),
                w13_scale=None, w2_scale=None)
    want = forward(bf16, "ffi", topk=2).astype(jnp.float32)
    assert rel_err(got, want) <= 6e-2


def test_lowers_to_the_fp8_gemm(rng):
    a = layer_inputs(rng, 16, 128, 128, 4, jnp.bfloat16)
    text = jax.jit(lambda a: jax_moe.moe_forward(**a, topk=2)).lower(a).as_text()
    assert text.count("jax_moe_group_gemm_fp8") == 2
    assert "jax_moe_moe_layer" not in text
    # The gate/up GEMM reads the token rows itself: no expanded copy of x.
    assert "jax_moe_expand" not in text


def _bad(rng, case):
    a = layer_inputs(rng, 8, 128, 128, 4, jnp.bfloat16)
    w13b = fp8.dequantize_blocks(a["w13"], a["w13_scale"], jnp.bfloat16)
    return {
        "no_w13_scale": dict(a, w13_scale=None),
        "no_w2_scale": dict(a, w2_scale=None),
        "scale_shape": dict(a, w13_scale=a["w13_scale"][:, :1]),
        "scale_dtype": dict(a, w2_scale=a["w2_scale"].astype(jnp.bfloat16)),
        "mixed": dict(a, w13=w13b),
        "scale_for_bf16": dict(a, w13=w13b, w2=fp8.dequantize_blocks(a["w2"], a["w2_scale"],
                                                                     jnp.bfloat16)),
    }[case]


@pytest.mark.parametrize("case,exc,match", [
    ("no_w13_scale", ValueError, "pass its block scales as w13_scale"),
    ("no_w2_scale", ValueError, "pass its block scales as w2_scale"),
    ("scale_shape", ValueError, "w13_scale must have shape"),
    ("scale_dtype", TypeError, "w2_scale must be float32"),
    ("mixed", TypeError, "w13 must be float8_e4m3fn"),
    ("scale_for_bf16", TypeError, "w13 must be float8_e4m3fn"),
])
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_rejects_bad_fp8_arguments(rng, case, exc, match, backend):
    with pytest.raises(exc, match=match):
        jax_moe.moe_forward(**_bad(rng, case), topk=2, backend=backend)


def test_moe_layer_takes_fp8_scales(rng):
    a = layer_inputs(rng, 16, 128, 128, 4, jnp.bfloat16)
    cfg = jax_moe.MoEConfig(num_experts=4, topk=2, hidden_size=128, intermediate_size=128)
    got = jax_moe.MoELayer(cfg)(a["hidden_states"], a["router_logits"], a["w13"], a["w2"],
                                w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(forward(a, "ffi", topk=2), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 12], ids=["one_token", "T12"])
def test_gradients_match_twin(rng, dtype, tokens):
    # Frozen fp8 experts, trainable around them: the gradients of the tokens
    # and of the router logits (one token on the GPU: the fused kernel's
    # forward, the chain's backward) against the twin's, the same rule.
    a = layer_inputs(rng, tokens, 256, 128, 4, dtype)
    cot = normal(rng, a["hidden_states"].shape, jnp.float32)

    def grads(backend):
        def loss(x, lg):
            out = jax_moe.moe_forward(**dict(a, hidden_states=x, router_logits=lg), topk=2,
                                      backend=backend)
            return jnp.sum(out.astype(jnp.float32) * cot)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(a["hidden_states"], a["router_logits"])

    (dx, dlg), (want_dx, want_dlg) = grads("ffi"), grads("reference")
    assert dx.dtype == dtype and dx.shape == a["hidden_states"].shape
    for got, want in ((dx, want_dx), (dlg, want_dlg)):
        assert np.all(np.isfinite(np.asarray(got, np.float32))) and np.any(np.asarray(want))
        assert rel_err(got, want) <= TOL[jnp.dtype(dtype)]


@pytest.mark.parametrize("backend", ["ffi", "reference"])
@pytest.mark.parametrize("tokens", [1, 12], ids=["one_token", "T12"])
@pytest.mark.parametrize("name", ["w13", "w2_scale"])
def test_fp8_weights_are_frozen(rng, backend, tokens, name):
    a = layer_inputs(rng, tokens, 128, 128, 4, jnp.float32)

    def loss(v):
        return jnp.sum(jax_moe.moe_forward(**dict(a, **{name: v}), topk=2, backend=backend))

    with pytest.raises(TypeError, match="are frozen: they have no gradient"):
        jax.grad(loss)(a[name])
