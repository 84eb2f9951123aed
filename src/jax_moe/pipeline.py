"""moe_forward: the seven steps composed, on the FFI kernels or reference.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_moe import _checks, ops, reference

__all__ = ["moe_forward", "MoEConfig", "MoELayer"]

_BACKENDS = {"ffi": ops, "reference": reference}


def _validate(hidden_states, router_logits, w13, w2, topk, shared_expert_output):
    _checks.rank(hidden_states, "hidden_states", 2)
    _checks.rank(router_logits, "router_logits", 2)
    _checks.rank(w13, "w13", 3)
    _checks.rank(w2, "w2", 3)
    _checks.float_dtype(hidden_states, "hidden_states")
    _checks.float_dtype(router_logits, "router_logits")
    _checks.same_dtype(hidden_states, "hidden_states", w13, "w13")
    _checks.same_dtype(hidden_states, "hidden_states", w2, "w2")
    tokens, hidden = hidden_states.shape
    experts, two_i, h13 = w13.shape
    if router_logits.shape[0] != tokens:
        raise ValueError(
            f"router_logits must be (T={tokens}, E), got {router_logits.shape}")
    if router_logits.shape[1] != experts:
        raise ValueError(
            f"router_logits has E={router_logits.shape[1]} experts but w13 has {experts}")
    if h13 != hidden:
        raise ValueError(f"w13 must be (E, 2*I, H={hidden}), got {w13.shape}")
    if two_i % 2:
        raise ValueError(f"w13's second dimension must be 2*I (even), got {two_i}")
    if w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(
            f"w2 must be (E={experts}, H={hidden}, I={two_i // 2}), got {w2.shape}")
    k = _checks.topk(topk, experts)
    if shared_expert_output is not None and shared_expert_output.shape != (tokens, hidden):
        raise ValueError(
            f"shared_expert_output must be (T={tokens}, H={hidden}), got {shared_expert_output.shape}")
    return k


def moe_forward(hidden_states, router_logits, w13, w2, topk: int, *,
                renormalize: bool = True, activation: str = "silu",
                shared_expert_output=None, backend: str = "ffi"):
    """The MoE layer forward: route, group by expert, gated FFN, combine.

    hidden_states (T, H); router_logits (T, E) (any float dtype, softmax in
    f32); w13 (E, 2*I, H) = concat(gate_proj, up_proj) per expert; w2
    (E, H, I). Returns (T, H) in hidden_states' dtype. backend: "ffi" (the
    custom calls) or "reference" (plain jax.numpy). Jit it with
    ``static_argnames=("topk", "renormalize", "activation", "backend")``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    _checks.activation(activation)
    k = _validate(hidden_states, router_logits, w13, w2, topk, shared_expert_output)
    impl = _BACKENDS[backend]
    experts = w13.shape[0]

    weights, ids = impl.topk_softmax(router_logits, k, renormalize)
    src_to_dst, dst_to_src, sizes = impl.moe_compute_token_index(ids, experts)
    xs = impl.moe_expand_input(hidden_states, dst_to_src, k)
    h = impl.group_gemm(xs, w13, sizes)
    a = impl.gated_activation(h, activation)
    y = impl.group_gemm(a, w2, sizes)
    out = impl.moe_combine(y, weights, src_to_dst)
    if shared_expert_output is not None:
        out = (out.astype(jnp.float32) + shared_expert_output.astype(jnp.float32)).astype(out.dtype)
    return out.astype(hidden_states.dtype)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The original pipeline's layer configuration."""

    num_experts: int
    topk: int
    hidden_size: int
    intermediate_size: int
    is_gated: bool = True
    renormalize: bool = True
    hidden_act: str = "silu"
    scoring_func: str = "softmax"

    def __post_init__(self):
        for name in ("num_experts", "topk", "hidden_size", "intermediate_size"):
            if _checks.static_int(getattr(self, name), name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        _checks.topk(self.topk, self.num_experts)
        _checks.activation(self.hidden_act)
        if not self.is_gated:
            raise NotImplementedError("is_gated=False (plain, non-gated experts) is not supported yet")
        if self.scoring_func != "softmax":
            raise NotImplementedError(
                f"scoring_func={self.scoring_func!r}: only 'softmax' is supported yet")


class MoELayer:
    """Holds a MoEConfig and a jitted forward (compiled once per input shape)."""

    def __init__(self, config: MoEConfig, backend: str = "ffi"):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        self.config = config
        self.backend = backend
        self._fn = jax.jit(functools.partial(
            moe_forward, topk=config.topk, renormalize=config.renormalize,
            activation=config.hidden_act, backend=backend))

    def __call__(self, hidden_states, router_logits, w13, w2, shared_expert_output=None):
        c = self.config
        if hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must have H={c.hidden_size}, got {hidden_states.shape}")
        if w13.shape != (c.num_experts, 2 * c.intermediate_size, c.hidden_size):
            raise ValueError(
                f"w13 must be (E={c.num_experts}, 2*I={2 * c.intermediate_size}, H={c.hidden_size}), got {w13.shape}")
        return self._fn(hidden_states, router_logits, w13, w2,
                        shared_expert_output=shared_expert_output)
