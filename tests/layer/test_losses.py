"""Router auxiliary losses (jax_moe.losses) against numpy written from their
published formulas, and nn.MoE's return_aux."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from common import normal


def numpy_load_balancing(logits, k):
    """Hugging Face's Qwen3-MoE / Mixtral form: a (T, k, E) one-hot of the
    top-k softmax choices, averaged over tokens, times the mean probability."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    p = z / z.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    mask = np.eye(logits.shape[1])[ids]            # (T, k, E)
    return logits.shape[1] * np.sum(mask.mean(0) * p.mean(0)[None])


@pytest.mark.parametrize("tokens,experts,k", [(1, 4, 1), (37, 8, 2), (64, 16, 16)])
def test_load_balancing_loss(rng, tokens, experts, k):
    logits = normal(rng, (tokens, experts), jnp.float32) * 2
    got = jax_moe.losses.load_balancing_loss(logits, k)
    want = numpy_load_balancing(np.asarray(logits, np.float64), k)
    assert abs(float(got) - want) <= 1e-5 * abs(want)
    # Gradient through the mean probabilities only: finite, and a step along
    # it lowers the loss for a fixed choice.
    g = jax.grad(jax_moe.losses.load_balancing_loss)(logits, k)
    assert g.shape == logits.shape and np.all(np.isfinite(np.asarray(g)))


def test_load_balancing_uniform_is_k():
    logits = jnp.zeros((8, 4), jnp.float32).at[jnp.arange(8), jnp.arange(8) % 4].set(1e-3)
    assert abs(float(jax_moe.losses.load_balancing_loss(logits, 2)) - 2.0) < 1e-2


def test_router_z_loss(rng):
    logits = normal(rng, (20, 6), jnp.bfloat16)
    l64 = np.asarray(logits, np.float64)
    m = l64.max(-1)
    want = np.mean((m + np.log(np.exp(l64 - m[:, None]).sum(-1))) ** 2)
    assert abs(float(jax_moe.losses.router_z_loss(logits)) - want) <= 1e-5 * want


def test_losses_check_their_arguments():
    with pytest.raises(ValueError, match="router_logits"):
        jax_moe.losses.router_z_loss(jnp.zeros((3,)))
    with pytest.raises(ValueError, match="topk"):
        jax_moe.losses.load_balancing_loss(jnp.zeros((3, 4)), 5)


def test_nn_moe_return_aux(rng):
    nnx = pytest.importorskip("flax.nnx")
    from jax_moe.nn import MoE
    cfg = jax_moe.MoEConfig(num_experts=8, topk=2, hidden_size=32, intermediate_size=16)
    model = MoE(cfg, rngs=nnx.Rngs(0), router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    x = normal(rng, (10, 32), jnp.float32)
    out, aux = model(x, return_aux=True)
    assert out.shape == (10, 32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(model(x)))
    logits = x @ model.router[...].T
    np.testing.assert_allclose(np.asarray(aux["router_logits"]), np.asarray(logits), rtol=1e-6)
    want = (0.5 * jax_moe.losses.load_balancing_loss(logits, 2)
            + 0.25 * jax_moe.losses.router_z_loss(logits))
    np.testing.assert_allclose(float(aux["aux_loss"]), float(want), rtol=1e-5)
    # The auxiliary loss alone reaches the router weights, and only them.
    grads = nnx.grad(lambda m: m(x, return_aux=True)[1]["aux_loss"])(model)
    assert float(jnp.abs(grads.router[...]).max()) > 0
    assert float(jnp.abs(grads.w13[...]).max()) == 0
    with pytest.raises(TypeError, match="router_aux_loss_coef"):
        MoE(cfg, rngs=nnx.Rngs(0), router_aux_loss_coef="x")
