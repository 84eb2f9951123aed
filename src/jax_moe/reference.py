"""The MoE steps and the whole layer in plain jax.numpy / jax.lax.

The test oracle for every kernel, and a fallback users can pick with
``moe_forward(..., backend="reference")``. Signatures and semantics match
``jax_moe.ops`` exactly (same validation, same -1 conventions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _checks

__all__ = [
    "topk_softmax",
    "moe_compute_token_index",
    "moe_expand_input",
    "group_gemm",
    "gated_activation",
    "silu_and_mul",
    "gelu_and_mul",
    "moe_combine",
]


def topk_softmax(router_logits, topk: int, renormalize: bool = True):
    k = _checks.topk_softmax_args(router_logits, topk)
    logits = router_logits.astype(jnp.float32)
    logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits)  # as the kernels: NaN never wins
    probs = jax.nn.softmax(logits, axis=-1)
    # Select on the logits (exact order; lax.top_k puts the lower index first on ties).
    _, ids = jax.lax.top_k(logits, k)
    weights = jnp.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def moe_compute_token_index(topk_ids, num_experts: int, *, start_expert: int = 0,
                            num_local_experts: int | None = None):
    _, start, local = _checks.token_index_args(
        topk_ids, num_experts, start_expert, num_local_experts)
    flat = topk_ids.reshape(-1).astype(jnp.int32) - start
    n = flat.shape[0]
    valid = (flat >= 0) & (flat < local)
    key = jnp.where(valid, flat, local)  # unplaced entries sort last
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((local,), jnp.int32).at[jnp.where(valid, flat, local)].add(1, mode="drop")
    total = jnp.sum(sizes)
    pos = jnp.arange(n, dtype=jnp.int32)
    dst_to_src = jnp.where(pos < total, order, -1)
    src_to_dst = jnp.zeros((n,), jnp.int32).at[order].set(pos)
    src_to_dst = jnp.where(valid, src_to_dst, -1)
    return src_to_dst, dst_to_src, sizes


def moe_expand_input(x, dst_to_src, topk: int):
    k = _checks.expand_args(x, dst_to_src, topk)
    valid = (dst_to_src >= 0) & (dst_to_src < x.shape[0] * k)
    rows = x[jnp.where(valid, dst_to_src, 0) // k]
    return jnp.where(valid[:, None], rows, jnp.zeros_like(rows))


def _clamped_sizes(expert_sizes, m: int):
    sizes = jnp.maximum(expert_sizes.astype(jnp.int32), 0)
    end = jnp.cumsum(sizes)
    return jnp.clip(end, 0, m) - jnp.clip(end - sizes, 0, m)


def group_gemm(x, w, expert_sizes):
    """jax.lax.ragged_dot, accumulating in f32 (the pure-JAX grouped GEMM)."""
    _checks.group_gemm_args(x, w, expert_sizes)
    sizes = _clamped_sizes(expert_sizes, x.shape[0])
    out = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), sizes,
                             preferred_element_type=jnp.float32)
    # ragged_dot leaves rows past the last group undefined on some backends.
    rows = jnp.arange(x.shape[0])
    out = jnp.where((rows < jnp.sum(sizes))[:, None], out, 0.0)
    return out.astype(x.dtype)


def _act(g, activation: str):
    if activation == "silu":
        return jax.nn.silu(g)
    if activation == "gelu":
        return jax.nn.gelu(g, approximate=False)
    return jax.nn.gelu(g, approximate=True)


def gated_activation(h, activation: str = "silu"):
    _checks.gated_args(h, activation)
    inter = h.shape[-1] // 2
    hf = h.astype(jnp.float32)
    return (_act(hf[..., :inter], activation) * hf[..., inter:]).astype(h.dtype)


def silu_and_mul(h):
    return gated_activation(h, "silu")


def gelu_and_mul(h, approximate: bool = False):
    return gated_activation(h, "gelu_tanh" if approximate else "gelu")


def moe_combine(y, topk_weights, src_to_dst):
    _checks.combine_args(y, topk_weights, src_to_dst)
    tokens, k = topk_weights.shape
    valid = (src_to_dst >= 0) & (src_to_dst < y.shape[0])
    rows = y[jnp.where(valid, src_to_dst, 0)].astype(jnp.float32).reshape(tokens, k, y.shape[1])
    w = jnp.where(valid.reshape(tokens, k), topk_weights.astype(jnp.float32), 0.0)
    return jnp.sum(rows * w[..., None], axis=1).astype(y.dtype)
