"""The fp8 layer at one token: on the GPU, steps 3-7 in one kernel
(ops.moe_decode_fp8) after the router, against the reference twin evaluated
on the host CPU and against the step chain on the GPU, at the edges (one
expert, topk = E, sizes off the 128 grid, a 16-channel minimum, every
activation, the routing options, scales of zero, huge and NaN), run to run
bitwise; which programs take the kernel; the CPU handler's error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from common import normal, on_cpu, rel_err
from jax_moe import _checks, backends
from jax_moe.ops.moe_decode_fp8 import _moe_decode_fp8, decode_fp8_applies
from test_fp8_layer import TOL, forward, layer_inputs

F16_TOL = 2e-2  # as bf16: an e4m3 midpoint is an f16 value too
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


def tol(dtype):
    return TOL.get(jnp.dtype(dtype), F16_TOL)


def compiled_text(a, **kw):
    return jax.jit(lambda a: jax_moe.moe_forward(**a, **kw)).lower(a).compile().as_text()


def twin(a, **kw):
    """The reference twin on the host CPU (XLA on the GPU may keep excess
    precision in the twin's jitted arithmetic)."""
    return on_cpu(lambda a: forward(a, "reference", **kw), a)


def gpu_chain(a, topk, activation="silu", is_gated=True):
    """The same layer as the FFI step chain on the default device (no fused
    kernel): router, token index, the fp8 expert MLP, combine."""
    steps = backends.steps("ffi")
    experts = a["w13"].shape[0]

    @jax.jit
    def run(a):
        r = _checks.Routing(topk=topk)
        weights, ids = steps.route(a["router_logits"], None, r)
        s2d, d2s, sizes = steps.token_index(ids, experts, 0, experts)
        y = backends.fp8_expert_mlp(steps, a["hidden_states"], a["w13"], a["w13_scale"], a["w2"],
                                    a["w2_scale"], sizes, d2s, topk, activation, is_gated)
        return steps.combine(y, weights, s2d, d2s)

    return run(a)


def check(a, **kw):
    got = forward(a, "ffi", **kw)
    assert got.dtype == a["hidden_states"].dtype and got.shape == a["hidden_states"].shape
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    err = rel_err(got, twin(a, **kw))
    assert err <= tol(got.dtype), err
    return got


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden,inter,experts,k", [
    (256, 128, 8, 2),      # one 128-block row of x and act
    (272, 144, 6, 6),      # topk = E; H and I off the 128 grid
    (16, 16, 1, 1),        # the smallest: one expert, 16 channels
    (1024, 512, 16, 8),    # several K blocks in both GEMMs, k = 8
    (400, 48, 40, 16),     # the most slots; I below one block
    (32, 16, 8, 8),        # 2 blocks: each one's run of w2 items spans 4 slots
])
def test_matches_twin(rng, dtype, hidden, inter, experts, k):
    a = layer_inputs(rng, 1, hidden, inter, experts, dtype, k=k)
    assert decode_fp8_applies(a["hidden_states"], a["w2"], k)
    assert "jax_moe_moe_decode_fp8" in compiled_text(a, topk=k)
    check(a, topk=k)


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("activation,gated", [("gelu", True), ("gelu_tanh", True),
                                              ("silu", False), ("gelu", False)])
def test_activations(rng, activation, gated):
    a = layer_inputs(rng, 1, 256, 160, 8, jnp.float32, k=3, gated=gated)
    check(a, topk=3, activation=activation, is_gated=gated)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["deepseek", "not_renormalized"])
def test_routing_options(rng, routing):
    a = layer_inputs(rng, 1, 256, 128, 8, jnp.bfloat16, k=2)
    if routing == "deepseek":
        kw = dict(topk=2, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                  routed_scaling_factor=2.5,
                  e_score_correction_bias=normal(rng, (8,), jnp.float32, 0.1))
    else:
        kw = dict(topk=2, renormalize=False)
    check(a, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matches_the_step_chain(rng, dtype):
    a = layer_inputs(rng, 1, 1024, 256, 32, dtype, k=8)
    got = forward(a, "ffi", topk=8)
    assert rel_err(got, gpu_chain(a, 8)) <= tol(dtype)


@pytest.mark.gpu
def test_same_bits_run_to_run(rng):
    a = layer_inputs(rng, 1, 512, 256, 16, jnp.bfloat16, k=4)
    f = jax.jit(lambda a: jax_moe.moe_forward(**a, topk=4))
    first = np.asarray(f(a)).view(np.uint16)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a)).view(np.uint16), first)


def _all_on_expert(a, e):
    """Logits that put every pick's weight on expert e first."""
    logits = np.asarray(a["router_logits"], np.float32).copy()
    logits[:, e] = logits.max() + 10.0
    return dict(a, router_logits=jnp.asarray(logits))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["zero", "huge"])
def test_extreme_scales(rng, case):
    # Expert 0 (picked first) with all its w13 scales 0 (its output is 0), or
    # scaled by 2^40 (h and act far from 1) and w2's by 2^-40.
    a = _all_on_expert(layer_inputs(rng, 1, 256, 128, 4, jnp.float32, k=2), 0)
    s13, s2 = np.asarray(a["w13_scale"]).copy(), np.asarray(a["w2_scale"]).copy()
    if case == "zero":
        s13[0] = 0.0
    else:
        s13[0] *= 2.0**40
        s2[0] *= 2.0**-40
    check(dict(a, w13_scale=jnp.asarray(s13), w2_scale=jnp.asarray(s2)), topk=2)


@pytest.mark.gpu
@pytest.mark.sanitize
def test_nan_scale_reaches_only_its_outputs(rng):
    # A NaN in w2's scale of expert 0, output block 1: only those 128 outputs
    # of the token are NaN (every slot's y there is summed into them).
    a = _all_on_expert(layer_inputs(rng, 1, 384, 128, 4, jnp.float32, k=2), 0)
    s2 = np.asarray(a["w2_scale"]).copy()
    s2[0, 1, :] = np.nan
    got = np.asarray(forward(dict(a, w2_scale=jnp.asarray(s2)), "ffi", topk=2))
    nan = np.isnan(got[0])
    assert nan[128:256].all() and not nan[:128].any() and not nan[256:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter", [(200, 128), (256, 136)], ids=["H200", "I136"])
def test_sizes_off_16_take_the_chain(rng, hidden, inter):
    a = layer_inputs(rng, 1, hidden, inter, 4, jnp.bfloat16, k=2)
    assert not decode_fp8_applies(a["hidden_states"], a["w2"], 2)
    text = compiled_text(a, topk=2)
    assert "jax_moe_moe_decode_fp8" not in text and "jax_moe_group_gemm_fp8" in text
    check(a, topk=2)


def test_other_platforms_take_the_chain(rng):
    a = layer_inputs(rng, 1, 256, 128, 8, jnp.bfloat16, k=2)
    cpu = jax.devices("cpu")[0]
    text = on_cpu(lambda a: compiled_text(a, topk=2), jax.device_put(a, cpu))
    assert "jax_moe_moe_decode_fp8" not in text and "jax_moe_group_gemm_fp8" in text


def test_the_cpu_handler_says_cuda_only(rng):
    a = layer_inputs(rng, 1, 256, 128, 8, jnp.bfloat16, k=2)
    ids = jnp.asarray([[0, 3]], jnp.int32)
    weights = jnp.asarray([[0.5, 0.5]], jnp.float32)
    with pytest.raises(Exception, match="runs on CUDA GPUs only"):
        on_cpu(lambda *x: _moe_decode_fp8(*x, "silu", True), a["hidden_states"], weights, ids,
               a["w13"], a["w13_scale"], a["w2"], a["w2_scale"])


def test_applies_within_the_limits(rng):
    x = jnp.zeros((1, 256), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((4, 256, 128), jnp.float8_e4m3fn)
    assert decode_fp8_applies(x, w2, 2)
    assert not decode_fp8_applies(jnp.zeros((2, 256), jnp.bfloat16), w2, 2)  # two tokens
    assert not decode_fp8_applies(x, w2, 17)                                 # topk past 16
    assert not decode_fp8_applies(x, jax.ShapeDtypeStruct((4, 256, 8192), jnp.float8_e4m3fn), 2)
