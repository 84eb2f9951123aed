"""The whole layer: moe_forward on the FFI kernels against the reference
backend and against a token-by-token numpy oracle; jit, vmap and lowering;
at one token, its use of moe_decode on the GPU."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
import oracle
from common import (DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, mlp_weights, normal,
                    on_cpu, rel_err, routing_allowed, router_logits)
from conftest import ON_GPU
from jax_moe import moe_forward, ops

moe_jit = jax.jit(jax_moe.moe_forward,
                  static_argnames=("topk", "renormalize", "activation", "backend"))

# ||ffi - reference|| / ||reference||: both round to the dtype at the same
# points (h, a, y, out), so they differ only by rounding flips (see common.RTOL).
# On the CPU they agree bit for bit; the CUDA kernels accumulate in another
# order, and with few outputs (T = 1: 72 values) the flips of one bf16 ulp
# (2^-8) in h and a can add up to more than 1e-2 on the GPU.
# bf16 therefore gets the oracle's bound: each side is within 2e-2 of the
# exact result (below), and a wrong expert or weight is off by O(1).
BACKEND_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
               jnp.dtype(jnp.float16): 2e-3}
# Against the float64 oracle, which never rounds: four roundings to the dtype
# (h, a, y, out) of up to half an ulp each (bf16 2^-8, f16 2^-11).
ORACLE_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
              jnp.dtype(jnp.float16): 4e-3}

LAYER_SHAPES = [  # (T, H, I, E, k)
    (1, 72, 13, 8, 2),    # one token
    (33, 72, 24, 1, 1),   # one expert
    (40, 130, 7, 4, 4),   # topk = E; H, I not multiples of any tile
    (64, 72, 32, 16, 4),
    (128, 64, 48, 8, 2),
]


def layer_inputs(rng, shape, dtype, logits_dtype=jnp.float32, pattern="uniform", shared=False):
    tokens, hidden, inter, experts, k = shape
    allowed = routing_allowed(pattern, experts, k, rng)
    inputs = dict(
        hidden_states=normal(rng, (tokens, hidden), dtype),
        router_logits=router_logits(rng, tokens, experts, logits_dtype, allowed),
        w13=normal(rng, (experts, 2 * inter, hidden), dtype, 1 / np.sqrt(hidden)),
        w2=normal(rng, (experts, hidden, inter), dtype, 1 / np.sqrt(inter)),
    )
    if shared:
        inputs["shared_expert_output"] = normal(rng, (tokens, hidden), dtype)
    return inputs


def check_layer(inputs, topk, dtype, renormalize=True, activation="silu", use_oracle=True):
    kw = dict(topk=topk, renormalize=renormalize, activation=activation)
    got = moe_jit(**inputs, **kw, backend="ffi")
    want = moe_jit(**inputs, **kw, backend="reference")
    assert got.shape == inputs["hidden_states"].shape and got.dtype == dtype
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    err = rel_err(got, want)
    assert err < BACKEND_TOL[jnp.dtype(dtype)], f"ffi vs reference: relative error {err:.3g}"
    if use_oracle:
        want_np = oracle.moe_forward(
            inputs["hidden_states"], inputs["router_logits"], inputs["w13"], inputs["w2"], topk,
            renormalize, activation, inputs.get("shared_expert_output"))
        tol = ORACLE_TOL[jnp.dtype(dtype)]
        for name, out in (("ffi", got), ("reference", want)):
            err = rel_err(out, want_np)
            assert err < tol, f"{name} vs numpy oracle: relative error {err:.3g}"
    return got


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=str)
def test_layer(rng, shape, dtype):
    check_layer(layer_inputs(rng, shape, dtype), shape[-1], dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_layer_activation_and_renormalize(rng, activation, renormalize, dtype):
    shape = (48, 72, 13, 8, 3)
    check_layer(layer_inputs(rng, shape, dtype), 3, dtype, renormalize, activation)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pattern", ["one_set", "empty_edges"])
@pytest.mark.parametrize("k", [1, 2])
def test_layer_routing_patterns(rng, pattern, k, dtype):
    # one_set: every token on the same k experts (k=1: all on one expert);
    # empty_edges: the first, a middle and the last expert get no tokens.
    shape = (64, 72, 16, 8, k)
    check_layer(layer_inputs(rng, shape, dtype, pattern=pattern), k, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_layer_shared_expert_output(rng, dtype):
    shape = (32, 72, 16, 8, 2)
    inputs = layer_inputs(rng, shape, dtype, shared=True)
    with_shared = check_layer(inputs, 2, dtype)
    without = moe_jit(**{k: v for k, v in inputs.items() if k != "shared_expert_output"}, topk=2)
    # The shared output is really added (not dropped).
    diff = np.asarray(with_shared, np.float64) - np.asarray(without, np.float64)
    assert rel_err(diff, inputs["shared_expert_output"]) < ORACLE_TOL[jnp.dtype(dtype)]


@pytest.mark.parametrize("logits_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_layer_low_precision_logits(rng, logits_dtype):
    shape = (40, 72, 16, 8, 2)
    check_layer(layer_inputs(rng, shape, jnp.float32, logits_dtype=logits_dtype), 2, jnp.float32)


def test_layer_many_tokens(rng):
    shape = (17_000, 16, 8, 8, 4)  # T*k = 68,000 > 65,536
    check_layer(layer_inputs(rng, shape, jnp.bfloat16), 4, jnp.bfloat16, use_oracle=False)


def test_layer_eager_matches_jit(rng):
    shape = (20, 72, 13, 8, 2)
    inputs = layer_inputs(rng, shape, jnp.float32)
    eager = jax_moe.moe_forward(**inputs, topk=2)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(moe_jit(**inputs, topk=2)))


def test_moe_layer_class(rng):
    tokens, hidden, inter, experts, k = shape = (24, 72, 13, 8, 2)
    config = jax_moe.MoEConfig(num_experts=experts, topk=k, hidden_size=hidden,
                               intermediate_size=inter, renormalize=False, hidden_act="gelu")
    layer = jax_moe.MoELayer(config)
    inputs = layer_inputs(rng, shape, jnp.float32)
    got = layer(inputs["hidden_states"], inputs["router_logits"], inputs["w13"], inputs["w2"])
    want = oracle.moe_forward(*inputs.values(), k, False, "gelu")
    assert rel_err(got, want) < 1e-5


@pytest.mark.sanitize
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_layer_zero_tokens(rng, backend):
    inputs = layer_inputs(rng, (0, 72, 13, 8, 2), jnp.bfloat16)
    out = moe_jit(**inputs, topk=2, backend=backend)
    assert out.shape == (0, 72) and out.dtype == jnp.bfloat16


# ------------------------------------------------------------- jit: one trace

def test_jit_traces_once_per_shape(rng):
    traces = []

    @jax.jit
    def layer(x, logits, w13, w2):
        traces.append(x.shape)  # runs only while tracing
        return jax_moe.moe_forward(x, logits, w13, w2, topk=2)

    shape = (64, 72, 16, 8, 2)
    first = layer_inputs(rng, shape, jnp.float32)
    second = dict(first, router_logits=router_logits(rng, 64, 8, jnp.float32))
    # The two calls really route differently.
    assert not np.array_equal(oracle.topk_softmax(first["router_logits"], 2)[1],
                              oracle.topk_softmax(second["router_logits"], 2)[1])
    for inputs in (first, second):
        out = layer(*inputs.values())
        want = oracle.moe_forward(*inputs.values(), 2)
        assert rel_err(out, want) < 1e-5  # and the cached executable is right for new routing
    assert len(traces) == 1
    layer(*layer_inputs(rng, (65, 72, 16, 8, 2), jnp.float32).values())
    assert len(traces) == 2  # a new shape does trace again (the counter works)


# ------------------------------------------------------------ lowered module

# Steps 1-7 in one call (ops.moe_layer) at decode-sized tiles.
FFI_TARGETS = {"jax_moe_moe_layer"}
SEPARATE_STEPS = {"jax_moe_route", "jax_moe_token_index", "jax_moe_expand",
                  "jax_moe_group_gemm", "jax_moe_expert_mlp", "jax_moe_activation",
                  "jax_moe_combine"}


def custom_call_targets(lowered):
    stablehlo = re.findall(r"custom_call\s*@(\w+)", lowered.as_text())
    hlo = re.findall(r'custom_call_target="(\w+)"', lowered.compile().as_text())
    return stablehlo, hlo


def test_ffi_backend_lowers_to_custom_calls(rng):
    inputs = layer_inputs(rng, (16, 72, 13, 8, 2), jnp.bfloat16)
    stablehlo, hlo = custom_call_targets(moe_jit.lower(**inputs, topk=2, backend="ffi"))
    assert FFI_TARGETS <= set(stablehlo), stablehlo
    assert FFI_TARGETS <= set(hlo), hlo
    assert not SEPARATE_STEPS & set(stablehlo), stablehlo


def test_reference_backend_has_no_custom_calls(rng):
    inputs = layer_inputs(rng, (16, 72, 13, 8, 2), jnp.bfloat16)
    stablehlo, hlo = custom_call_targets(moe_jit.lower(**inputs, topk=2, backend="reference"))
    assert not [t for t in stablehlo + hlo if t.startswith("jax_moe")], (stablehlo, hlo)


# ------------------------------------------------------------------------ vmap

@pytest.mark.parametrize("weights_batched", [False, True], ids=["shared_weights", "batched_weights"])
def test_vmap_matches_loop(rng, weights_batched):
    batch, shape = 3, (24, 72, 13, 8, 2)
    per_element = [layer_inputs(rng, shape, jnp.float32) for _ in range(batch)]
    stacked = {k: jnp.stack([p[k] for p in per_element]) for k in per_element[0]}
    if not weights_batched:
        stacked["w13"], stacked["w2"] = per_element[0]["w13"], per_element[0]["w2"]
        for p in per_element:
            p["w13"], p["w2"] = stacked["w13"], stacked["w2"]
    w_axis = 0 if weights_batched else None
    fn = functools.partial(jax_moe.moe_forward, topk=2, activation="gelu_tanh")
    got = jax.jit(jax.vmap(fn, in_axes=(0, 0, w_axis, w_axis)))(
        stacked["hidden_states"], stacked["router_logits"], stacked["w13"], stacked["w2"])
    assert got.shape == (batch,) + stacked["hidden_states"].shape[1:]
    for b, inputs in enumerate(per_element):
        want = moe_jit(**inputs, topk=2, activation="gelu_tanh")
        assert rel_err(got[b], want) < 1e-6, f"batch element {b}"
        assert rel_err(got[b], oracle.moe_forward(*inputs.values(), 2, True, "gelu_tanh")) < 1e-5


# --------------------------------------------------------- GPU against CPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_cuda_layer_matches_cpu_ffi(rng, dtype):
    shape = (256, 512, 128, 16, 4)
    inputs = layer_inputs(rng, shape, dtype)
    fn = functools.partial(moe_jit, topk=4, backend="ffi")
    got = fn(**inputs)
    assert got.devices() == {jax.devices()[0]}
    want = on_cpu(fn, *inputs.values())
    err = rel_err(got, want)
    assert err < BACKEND_TOL[jnp.dtype(dtype)], f"CUDA vs CPU: relative error {err:.3g}"


# ------------------------------------------------ one token: moe_decode

def _forward_hlo(x, logits, w13, w2, k, platform, **kw):
    fn = jax.jit(lambda *a: moe_forward(*a, k, **kw))
    return fn.trace(x, logits, w13, w2).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_moe_forward_takes_decode_on_the_gpu_only(rng, platform):
    # Lowered for each platform here (no device needed): one token goes to
    # moe_decode on CUDA; the CPU keeps moe_layer (and its bits).
    x = normal(rng, (1, 256), jnp.bfloat16)
    logits = router_logits(rng, 1, 8, jnp.float32)
    w13, w2 = mlp_weights(rng, 8, 256, 256, jnp.bfloat16)
    hlo = _forward_hlo(x, logits, w13, w2, 2, platform)
    assert ("jax_moe_moe_decode" in hlo) == (platform == "cuda")
    assert ("jax_moe_moe_layer" in hlo) == (platform == "cpu")
    # Where moe_decode does not apply, moe_layer everywhere.
    for kw in ({"scoring_func": "sigmoid"}, {"activation": "gelu"}):
        hlo = _forward_hlo(x, logits, w13, w2, 2, platform, **kw)
        assert "jax_moe_moe_decode" not in hlo and "jax_moe_moe_layer" in hlo, kw
    hlo = _forward_hlo(jnp.concatenate([x, x]), jnp.concatenate([logits, logits]), w13, w2, 2,
                       platform)
    assert "jax_moe_moe_decode" not in hlo


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_moe_forward_one_token(rng, dtype):
    # moe_forward at T = 1 (moe_decode on the GPU) against the reference layer.
    x = normal(rng, (1, 2048), dtype)
    logits = router_logits(rng, 1, 16, jnp.float32)
    w13, w2 = mlp_weights(rng, 16, 2048, 768, dtype)
    got = jax.jit(lambda *a: moe_forward(*a, 8))(x, logits, w13, w2)
    want = moe_forward(x, logits, w13, w2, 8, backend="reference")
    assert_close(got, want, dtype, f"moe_forward T=1 on {'GPU' if ON_GPU else 'CPU'}")
    if ON_GPU:
        assert_equal(got, ops.moe_decode(x, logits, w13, w2, 8), "moe_forward is moe_decode")
