"""Arguments of the wrong kind (a list for an array, a string for a number
or a flag), layers past int32's slots, and MoELayer calls missing the arrays
that their config implies: each a clear exception naming the argument,
eagerly and under jax.jit, before any kernel runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import ops

T, E, H, I, K = 6, 4, 8, 3, 2
X = jnp.zeros((T, H), jnp.float32)
LOGITS = jnp.zeros((T, E), jnp.float32)
W13 = jnp.zeros((E, 2 * I, H), jnp.float32)
W2 = jnp.zeros((E, H, I), jnp.float32)
STATIC = ("topk", "renormalize", "is_gated", "routed_scaling_factor", "backend")


def _both(fn, *args, **kwargs):
    """fn eagerly, then under jax.jit (kwargs static): (eager raise, jit raise)."""
    yield lambda: fn(*args, **kwargs)
    yield lambda: jax.jit(lambda *a: fn(*a, **kwargs))(*args)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
@pytest.mark.parametrize("which", ["hidden_states", "router_logits"])
def test_list_for_an_array_names_the_argument(backend, which):
    args = {"hidden_states": X, "router_logits": LOGITS}
    args[which] = np.asarray(args[which]).tolist()
    call = lambda: jax_moe.moe_forward(args["hidden_states"], args["router_logits"], W13, W2,
                                       topk=K, backend=backend)
    with pytest.raises(TypeError, match=f"{which} must be an array"):
        call()


def test_list_for_an_op_array_names_the_argument():
    with pytest.raises(TypeError, match="router_logits must be an array"):
        ops.topk_softmax([[0.0, 1.0]], topk=1)
    with pytest.raises(TypeError, match="topk_ids must be an array"):
        ops.moe_compute_token_index([[0, 1]], num_experts=2)


@pytest.mark.parametrize("value", ["abc", "2.5x", "2.5", None, [2.5], True])
def test_scaling_factor_must_be_a_number(value):
    for run in _both(jax_moe.moe_forward, X, LOGITS, W13, W2, topk=K,
                     routed_scaling_factor=value):
        with pytest.raises(TypeError, match="routed_scaling_factor"):
            run()


@pytest.mark.parametrize("value", [2, 2.5, np.float32(2.5), np.int64(2)])
def test_scaling_factor_numbers_are_taken(value):
    out = jax_moe.moe_forward(X + 1, LOGITS, W13 + 0.1, W2 + 0.1, topk=K,
                              routed_scaling_factor=value, backend="reference")
    ref = jax_moe.moe_forward(X + 1, LOGITS, W13 + 0.1, W2 + 0.1, topk=K,
                              routed_scaling_factor=1.0, backend="reference")
    np.testing.assert_allclose(np.asarray(out), float(value) * np.asarray(ref), rtol=1e-5)


@pytest.mark.parametrize("name", ["renormalize", "is_gated"])
@pytest.mark.parametrize("value", ["False", "yes", 1.0, None])
def test_flags_must_be_bools(name, value):
    for run in _both(jax_moe.moe_forward, X, LOGITS, W13, W2, topk=K, **{name: value}):
        with pytest.raises(TypeError, match=name):
            run()


@pytest.mark.parametrize("entry", ["moe_forward", "moe_layer", "moe_decode"])
def test_slots_past_int32_rejected_at_trace_time(entry):
    # T * k = 2**31 slots: shapes only (jax.eval_shape), nothing is allocated.
    t, k = 2**30, 2
    x = jax.ShapeDtypeStruct((t, 16), jnp.bfloat16)
    lg = jax.ShapeDtypeStruct((t, 4), jnp.float32)
    w13 = jax.ShapeDtypeStruct((4, 32, 16), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((4, 16, 16), jnp.bfloat16)
    fn = {"moe_forward": jax_moe.moe_forward, "moe_layer": ops.moe_layer,
          "moe_decode": ops.moe_decode}[entry]
    with pytest.raises(ValueError, match="topk=2 must be at most 2147483647"):
        jax.eval_shape(lambda *a: fn(*a, topk=k), x, lg, w13, w2)


def test_slots_just_under_int32_pass_the_checks():
    t = (2**31 - 1) // 3  # T * 3 <= 2**31 - 1
    x = jax.ShapeDtypeStruct((t, 8), jnp.float32)
    lg = jax.ShapeDtypeStruct((t, 4), jnp.float32)
    out = jax.eval_shape(lambda *a: jax_moe.moe_forward(*a, topk=3, backend="reference"),
                         x, lg, jax.ShapeDtypeStruct((4, 6, 8), jnp.float32),
                         jax.ShapeDtypeStruct((4, 8, 3), jnp.float32))
    assert out.shape == (t, 8)


# ---- MoELayer: the arrays its config implies ------------------------------------

def _layer(**cfg):
    config = jax_moe.MoEConfig(num_experts=E, topk=K, hidden_size=H, intermediate_size=I, **cfg)
    return jax_moe.MoELayer(config, backend="reference")


def test_moe_layer_needs_the_correction_bias():
    layer = _layer(scoring_func="sigmoid", use_correction_bias=True)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        layer(X, LOGITS, W13, W2)
    out = layer(X, LOGITS, W13, W2, e_score_correction_bias=jnp.zeros((E,), jnp.float32))
    assert out.shape == (T, H)


def test_moe_layer_rejects_a_bias_its_config_lacks():
    with pytest.raises(ValueError, match="use_correction_bias=False"):
        _layer()(X, LOGITS, W13, W2, e_score_correction_bias=jnp.zeros((E,), jnp.float32))


def test_moe_layer_needs_the_shared_expert():
    layer = _layer(shared_intermediate_size=4)
    with pytest.raises(ValueError, match="shared_w13"):
        layer(X, LOGITS, W13, W2)
    sw13, sw2 = jnp.zeros((8, H), jnp.float32), jnp.zeros((H, 4), jnp.float32)
    assert layer(X, LOGITS, W13, W2, shared_w13=sw13, shared_w2=sw2).shape == (T, H)
    # The shared expert run outside: its output stands for the weights.
    assert layer(X, LOGITS, W13, W2, shared_expert_output=X).shape == (T, H)
    gated = _layer(shared_intermediate_size=4, shared_expert_gate=True)
    with pytest.raises(ValueError, match="shared_gate"):
        gated(X, LOGITS, W13, W2, shared_w13=sw13, shared_w2=sw2)


def test_moe_layer_rejects_shared_arrays_its_config_lacks():
    sw13, sw2 = jnp.zeros((8, H), jnp.float32), jnp.zeros((H, 4), jnp.float32)
    with pytest.raises(ValueError, match="shared_intermediate_size=0"):
        _layer()(X, LOGITS, W13, W2, shared_w13=sw13, shared_w2=sw2)
    with pytest.raises(ValueError, match="shared_expert_gate=False"):
        _layer(shared_intermediate_size=4)(X, LOGITS, W13, W2, shared_w13=sw13, shared_w2=sw2,
                                           shared_gate=jnp.zeros((H,), jnp.float32))
    with pytest.raises(TypeError, match="unknown arrays"):
        _layer()(X, LOGITS, W13, W2, bias=jnp.zeros((E,), jnp.float32))
