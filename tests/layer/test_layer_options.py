"""moe_forward's model options: non-gated experts, routing variants, shared
experts (with Qwen2-MoE's sigmoid gate), and gradients through the ffi
backend (its backward on the kernels) against the reference backend's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
import oracle
from common import normal, rel_err

STATIC = ("topk", "renormalize", "activation", "is_gated", "scoring_func", "num_expert_group",
          "topk_group", "routed_scaling_factor", "backend")
moe_jit = jax.jit(jax_moe.moe_forward, static_argnames=STATIC)
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}


def inputs(rng, tokens, hidden, inter, experts, dtype, gated=True):
    up = 2 * inter if gated else inter
    return dict(hidden_states=normal(rng, (tokens, hidden), dtype),
                router_logits=normal(rng, (tokens, experts), jnp.float32, 2.0),
                w13=normal(rng, (experts, up, hidden), dtype, 1 / np.sqrt(hidden)),
                w2=normal(rng, (experts, hidden, inter), dtype, 1 / np.sqrt(inter)))


def both(inp, **kw):
    got = moe_jit(**inp, **kw, backend="ffi")
    want = moe_jit(**inp, **kw, backend="reference")
    return got, want


# ------------------------------------------------------------ non-gated experts

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_non_gated_layer(rng, dtype):
    inp = inputs(rng, 29, 48, 24, 6, dtype, gated=False)
    got, want = both(inp, topk=2, is_gated=False, activation="gelu")
    assert rel_err(got, want) < TOL[jnp.dtype(dtype)]
    # numpy: out[t] = sum_j w_j * w2[e] @ gelu(w1[e] @ x[t])
    x, w1, w2 = (oracle.f64(inp[n]) for n in ("hidden_states", "w13", "w2"))
    weights, ids = oracle.topk_softmax(inp["router_logits"], 2, True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            e = ids[t, j]
            out[t] += weights[t, j] * (w2[e] @ oracle.activation(w1[e] @ x[t], "gelu"))
    assert rel_err(got, out) < (1e-5 if dtype == jnp.float32 else 2e-2)


def test_non_gated_shape_errors(rng):
    inp = inputs(rng, 4, 16, 8, 4, jnp.float32, gated=False)
    with pytest.raises(ValueError, match="w2 must be"):
        jax_moe.moe_forward(**inp, topk=2)  # read as gated: I = 4, w2 has 8
    with pytest.raises(ValueError, match="activation"):
        jax_moe.moe_forward(**inp, topk=2, is_gated=False, activation="relu")


# ------------------------------------------------------------ routing options

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_deepseek_style_routing_through_the_layer(rng, dtype):
    inp = inputs(rng, 33, 32, 16, 16, dtype)
    bias = jnp.asarray(rng.standard_normal(16) * 0.1, jnp.float32)
    kw = dict(topk=4, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
              routed_scaling_factor=2.5)
    got, want = both(dict(inp, e_score_correction_bias=bias), **kw)
    assert rel_err(got, want) < TOL[jnp.dtype(dtype)]
    # The routing really is the one asked for (not plain softmax).
    plain = moe_jit(**inp, topk=4, backend="reference")
    assert rel_err(plain, want) > 0.05


# ------------------------------------------------------------ shared experts

def numpy_shared(x, w13, w2, gate, activation="silu"):
    x, w13, w2 = oracle.f64(x), oracle.f64(w13), oracle.f64(w2)
    inter = w13.shape[0] // 2
    h = x @ w13.T
    out = (oracle.activation(h[:, :inter], activation) * h[:, inter:]) @ w2.T
    if gate is not None:
        out = out / (1 + np.exp(-(x @ oracle.f64(gate).reshape(-1))))[:, None]
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gated_shared", [False, True], ids=["plain_shared", "sigmoid_gate"])
def test_shared_expert_weights(rng, dtype, gated_shared):
    inp = inputs(rng, 21, 40, 12, 8, dtype)
    s13 = normal(rng, (2 * 20, 40), dtype, 1 / np.sqrt(40))
    s2 = normal(rng, (40, 20), dtype, 1 / np.sqrt(20))
    gate = normal(rng, (1, 40), dtype, 1 / np.sqrt(40)) if gated_shared else None
    got, want = both(dict(inp, shared_w13=s13, shared_w2=s2, shared_gate=gate), topk=2)
    assert rel_err(got, want) < TOL[jnp.dtype(dtype)]
    routed = oracle.moe_forward(inp["hidden_states"], inp["router_logits"], inp["w13"],
                                inp["w2"], 2)
    expect = routed + numpy_shared(inp["hidden_states"], s13, s2, gate)
    assert rel_err(got, expect) < (1e-5 if dtype == jnp.float32 else 2e-2)


def test_shared_expert_errors(rng):
    inp = inputs(rng, 4, 16, 8, 4, jnp.float32)
    s13 = jnp.zeros((12, 16))
    with pytest.raises(ValueError, match="shared_w13 and shared_w2"):
        jax_moe.moe_forward(**inp, topk=2, shared_w13=s13)
    with pytest.raises(ValueError, match="shared_w2 must be"):
        jax_moe.moe_forward(**inp, topk=2, shared_w13=s13, shared_w2=jnp.zeros((16, 5)))
    with pytest.raises(ValueError, match="shared_gate"):
        jax_moe.moe_forward(**inp, topk=2, shared_w13=s13, shared_w2=jnp.zeros((16, 6)),
                            shared_gate=jnp.zeros((15,)))
    with pytest.raises(TypeError, match="shared_w13"):
        jax_moe.moe_forward(**inp, topk=2, shared_w13=s13.astype(jnp.bfloat16),
                            shared_w2=jnp.zeros((16, 6)))
    with pytest.raises(ValueError, match="shared_gate needs shared_w13 and shared_w2"):
        jax_moe.moe_forward(**inp, topk=2, shared_gate=jnp.zeros((16,)))
    with pytest.raises(ValueError, match=r"shared_w13 must be \(2\*I_s, H=16\)"):
        jax_moe.moe_forward(**inp, topk=2, shared_w13=jnp.zeros((12, 15)),
                            shared_w2=jnp.zeros((16, 6)))
    with pytest.raises(ValueError, match=r"shared_w13 must be \(2\*I_s, H=16\)"):  # odd 2*I_s
        jax_moe.moe_forward(**inp, topk=2, shared_w13=jnp.zeros((11, 16)),
                            shared_w2=jnp.zeros((16, 5)))


# ------------------------------------------------------------ gradients

def test_grad_through_ffi_equals_reference(rng):
    inp = inputs(rng, 19, 24, 8, 4, jnp.float32)
    s13 = normal(rng, (16, 24), jnp.float32, 0.2)
    s2 = normal(rng, (24, 8), jnp.float32, 0.3)
    args = dict(inp, shared_w13=s13, shared_w2=s2)
    names = ("hidden_states", "router_logits", "w13", "w2", "shared_w13", "shared_w2")

    def loss(params, backend):
        out = jax_moe.moe_forward(**dict(args, **params), topk=2, backend=backend)
        return jnp.sum(out * out)

    params = {n: args[n] for n in names}
    g_ffi = jax.jit(jax.grad(lambda p: loss(p, "ffi")))(params)
    g_ref = jax.jit(jax.grad(lambda p: loss(p, "reference")))(params)
    for n in names:
        assert float(jnp.linalg.norm(g_ref[n])) > 0, n
        assert rel_err(g_ffi[n], g_ref[n]) < 1e-5, n
    # ...and under grad both passes run the custom calls.
    hlo = jax.jit(jax.grad(lambda p: loss(p, "ffi"))).lower(params).as_text()
    for target in ("jax_moe_group_gemm", "jax_moe_group_gemm_wgrad",
                   "jax_moe_activation_scaled_grad"):
        assert target in hlo, target


def test_moe_config_options():
    cfg = jax_moe.MoEConfig(num_experts=16, topk=4, hidden_size=32, intermediate_size=8,
                            scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                            routed_scaling_factor=2.5, use_correction_bias=True,
                            shared_intermediate_size=16)
    assert cfg.forward_kwargs()["num_expert_group"] == 4
    with pytest.raises(ValueError, match="num_expert_group"):
        jax_moe.MoEConfig(num_experts=16, topk=4, hidden_size=32, intermediate_size=8,
                          num_expert_group=5, topk_group=2)
    with pytest.raises(ValueError, match="scoring_func"):
        jax_moe.MoEConfig(num_experts=16, topk=4, hidden_size=32, intermediate_size=8,
                          scoring_func="relu")
    with pytest.raises(ValueError, match="shared_expert_gate"):
        jax_moe.MoEConfig(num_experts=16, topk=4, hidden_size=32, intermediate_size=8,
                          shared_expert_gate=True)
