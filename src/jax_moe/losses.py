"""Router auxiliary losses for training MoE layers: the load-balancing loss
of Switch Transformer / Qwen3-MoE and the router z-loss of ST-MoE. Plain
jax.numpy on the (T, E) router logits, differentiable in them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _checks

__all__ = ["load_balancing_loss", "router_z_loss"]


def load_balancing_loss(router_logits, topk: int):
    """E * sum_e f_e * P_e: f_e the fraction of the T*k (token, slot) choices
    that go to expert e (top-k of the softmax scores, as Hugging Face's
    Qwen3-MoE and Mixtral compute it), P_e the mean softmax probability of
    expert e. k when both are uniform; the gradient flows through P only.
    router_logits (T, E) -> a float32 scalar."""
    _checks.rank(router_logits, "router_logits", 2)
    _checks.float_dtype(router_logits, "router_logits")
    tokens, experts = router_logits.shape
    k = _checks.topk(topk, experts)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(probs), k)
    # Counts by a scatter-add of the T*k ids: no (T, k, E) one-hot.
    counts = jnp.zeros((experts,), jnp.float32).at[ids.reshape(-1)].add(1.0)
    fraction = counts / max(tokens, 1)  # per expert, summed over the k slots
    return experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def router_z_loss(router_logits):
    """mean over tokens of logsumexp(logits)^2 (ST-MoE): keeps the logits
    small. router_logits (T, E) -> a float32 scalar."""
    _checks.rank(router_logits, "router_logits", 2)
    _checks.float_dtype(router_logits, "router_logits")
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(z * z)
