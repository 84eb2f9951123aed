"""moe_forward: the seven steps composed, on the FFI kernels or reference.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_moe import _checks, ops, reference

__all__ = ["moe_forward", "MoEConfig", "MoELayer"]

_BACKENDS = {"ffi": ops, "reference": reference}


def _validate_shared(hidden_states, shared_w13, shared_w2, shared_gate, is_gated):
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13 and shared_w2 must be given together")
    if shared_w13 is None:
        if shared_gate is not None:
            raise ValueError("shared_gate needs shared_w13 and shared_w2")
        return
    hidden = hidden_states.shape[1]
    _checks.rank(shared_w13, "shared_w13", 2)
    _checks.rank(shared_w2, "shared_w2", 2)
    _checks.same_dtype(hidden_states, "hidden_states", shared_w13, "shared_w13")
    _checks.same_dtype(hidden_states, "hidden_states", shared_w2, "shared_w2")
    up_width = shared_w13.shape[0]
    if shared_w13.shape[1] != hidden or (is_gated and up_width % 2):
        raise ValueError(
            f"shared_w13 must be ({'2*I_s' if is_gated else 'I_s'}, H={hidden}), got {shared_w13.shape}")
    inter = up_width // 2 if is_gated else up_width
    if shared_w2.shape != (hidden, inter):
        raise ValueError(f"shared_w2 must be (H={hidden}, I_s={inter}), got {shared_w2.shape}")
    if shared_gate is not None and shared_gate.size != hidden:
        raise ValueError(f"shared_gate must hold H={hidden} values ((H,) or (1, H)), got {shared_gate.shape}")


@dataclasses.dataclass(frozen=True)
class _Static:
    """The non-array arguments of one layer call (hashable)."""

    topk: int
    renormalize: bool
    activation: str
    is_gated: bool
    scoring_func: str
    num_expert_group: int | None
    topk_group: int | None
    routed_scaling_factor: float


def _dense_mlp(impl, x, w_up, w_down, st: _Static):
    """A dense (shared) expert: x (T, H) -> (T, H), f32 accumulation."""
    h = jnp.dot(x, w_up.T, preferred_element_type=jnp.float32).astype(x.dtype)
    a = impl.gated_activation(h, st.activation) if st.is_gated else impl.activation(h, st.activation)
    return jnp.dot(a, w_down.T, preferred_element_type=jnp.float32)


def _decode_applies(st: _Static, a: dict) -> bool:
    """Whether ops.moe_decode computes this layer: softmax routing without
    groups or bias, gated SiLU, and the kernel's shape limits."""
    if (st.scoring_func != "softmax" or st.num_expert_group is not None
            or a["e_score_correction_bias"] is not None or st.activation != "silu"
            or not st.is_gated):
        return False
    # moe_forward has checked the arguments; only the kernel's limits remain.
    return _checks.decode_limits(a["hidden_states"], a["w13"], a["w2"], st.topk) is None


def _layer(impl, st: _Static, a: dict):
    """The layer on one backend; `a` holds the arrays (None where absent)."""
    x = a["hidden_states"]

    def steps(x, logits, w13, w2):  # steps 1-7, one call on the ffi backend
        return impl.moe_layer(
            x, logits, w13, w2, st.topk, scoring_func=st.scoring_func,
            renormalize=st.renormalize, num_expert_group=st.num_expert_group,
            topk_group=st.topk_group, e_score_correction_bias=a["e_score_correction_bias"],
            routed_scaling_factor=st.routed_scaling_factor, activation=st.activation,
            is_gated=st.is_gated)

    def decode(x, logits, w13, w2):  # one token, the whole layer in one kernel
        return ops.moe_decode(x, logits, w13, w2, st.topk, renormalize=st.renormalize,
                              routed_scaling_factor=st.routed_scaling_factor)

    args = (x, a["router_logits"], a["w13"], a["w2"])
    if impl is ops and _decode_applies(st, a):
        # The GPU takes the one-kernel decode; other platforms keep moe_layer's bits.
        out = jax.lax.platform_dependent(*args, cuda=decode, default=steps)
    else:
        out = steps(*args)

    extra = None
    if a["shared_w13"] is not None:
        extra = _dense_mlp(impl, x, a["shared_w13"], a["shared_w2"], st)
        if a["shared_gate"] is not None:
            gate = jnp.dot(x, a["shared_gate"].reshape(-1).astype(x.dtype),
                           preferred_element_type=jnp.float32)
            extra = extra * jax.nn.sigmoid(gate)[:, None]
    if a["shared_expert_output"] is not None:
        given = a["shared_expert_output"].astype(jnp.float32)
        extra = given if extra is None else extra + given
    if extra is not None:
        out = (out.astype(jnp.float32) + extra).astype(out.dtype)
    return out.astype(x.dtype)


# The FFI kernels have no backward pass yet: under jax.grad the ffi backend
# runs its forward through the kernels and its backward as the VJP of the
# reference layer (recomputed), so gradients are exact and training works.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ffi_layer(st: _Static, a: dict):
    return _layer(ops, st, a)


def _ffi_layer_fwd(st, a):
    return _layer(ops, st, a), a


def _ffi_layer_bwd(st, a, g):
    _, vjp = jax.vjp(lambda arrays: _layer(reference, st, arrays), a)
    return vjp(g)


_ffi_layer.defvjp(_ffi_layer_fwd, _ffi_layer_bwd)


def moe_forward(hidden_states, router_logits, w13, w2, topk: int, *,
                renormalize: bool = True, activation: str = "silu", is_gated: bool = True,
                scoring_func: str = "softmax", num_expert_group: int | None = None,
                topk_group: int | None = None, e_score_correction_bias=None,
                routed_scaling_factor: float = 1.0, shared_w13=None, shared_w2=None,
                shared_gate=None, shared_expert_output=None, backend: str = "ffi"):
    """The MoE layer forward: route, group by expert, expert FFN, combine.

    hidden_states (T, H); router_logits (T, E) (any float dtype; routing in
    f32); w13 (E, 2*I, H) = concat(gate_proj, up_proj) per expert (or (E, I, H)
    = up_proj when is_gated=False); w2 (E, H, I). Returns (T, H) in
    hidden_states' dtype.

    Routing (see ``reference.route``): scoring_func "softmax" | "sigmoid",
    renormalize, group-limited top-k (num_expert_group, topk_group), an
    e_score_correction_bias (E,) that chooses experts but does not weight them,
    routed_scaling_factor. activation: "silu" | "gelu" | "gelu_tanh", gated
    (act(gate) * up) unless is_gated=False.

    Shared experts: shared_w13 (2*I_s, H) and shared_w2 (H, I_s) are computed
    here and added; shared_gate (H,) or (1, H) scales them by sigmoid(x @
    gate) per token (Qwen2-MoE). shared_expert_output (T, H) adds an output
    computed elsewhere.

    backend: "ffi" (the custom calls; differentiable, with the reference
    layer's VJP as backward) or "reference" (plain jax.numpy). Jit it with the
    non-array arguments static: ``static_argnames=("topk", "renormalize",
    "activation", "is_gated", "scoring_func", "num_expert_group", "topk_group",
    "routed_scaling_factor", "backend")``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    _checks.activation(activation)
    k = _checks.layer_args(hidden_states, router_logits, w13, w2, topk, shared_expert_output,
                           is_gated=is_gated)
    _, groups, tg, scale = _checks.route_args(
        router_logits, k, scoring_func, num_expert_group, topk_group,
        e_score_correction_bias, routed_scaling_factor)
    _validate_shared(hidden_states, shared_w13, shared_w2, shared_gate, is_gated)
    st = _Static(topk=k, renormalize=bool(renormalize), activation=activation,
                 is_gated=bool(is_gated), scoring_func=scoring_func,
                 num_expert_group=groups if groups > 1 else None,
                 topk_group=tg if groups > 1 else None, routed_scaling_factor=scale)
    arrays = dict(hidden_states=hidden_states, router_logits=router_logits, w13=w13, w2=w2,
                  e_score_correction_bias=e_score_correction_bias, shared_w13=shared_w13,
                  shared_w2=shared_w2, shared_gate=shared_gate,
                  shared_expert_output=shared_expert_output)
    if backend == "reference":
        return _layer(reference, st, arrays)
    return _ffi_layer(st, arrays)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A MoE block's configuration: the original pipeline's fields plus the
    routing and shared-expert options of Qwen2/3-MoE, Mixtral and DeepSeek-V3."""

    num_experts: int
    topk: int
    hidden_size: int
    intermediate_size: int
    is_gated: bool = True
    renormalize: bool = True
    hidden_act: str = "silu"
    scoring_func: str = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False
    shared_intermediate_size: int = 0   # 0: no shared expert
    shared_expert_gate: bool = False    # Qwen2-MoE's sigmoid gate on the shared expert

    def __post_init__(self):
        for name in ("num_experts", "topk", "hidden_size", "intermediate_size"):
            if _checks.static_int(getattr(self, name), name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if _checks.static_int(self.shared_intermediate_size, "shared_intermediate_size") < 0:
            raise ValueError(
                f"shared_intermediate_size must be >= 0, got {self.shared_intermediate_size}")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError("shared_expert_gate needs shared_intermediate_size > 0")
        _checks.topk(self.topk, self.num_experts)
        _checks.activation(self.hidden_act)
        logits = jax.ShapeDtypeStruct((1, self.num_experts), jnp.float32)
        bias = jax.ShapeDtypeStruct((self.num_experts,), jnp.float32) if self.use_correction_bias else None
        _checks.route_args(logits, self.topk, self.scoring_func, self.num_expert_group,
                           self.topk_group, bias, self.routed_scaling_factor)

    def forward_kwargs(self) -> dict:
        """moe_forward's static keyword arguments for this config."""
        return dict(topk=self.topk, renormalize=self.renormalize, activation=self.hidden_act,
                    is_gated=self.is_gated, scoring_func=self.scoring_func,
                    num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor)


class MoELayer:
    """Holds a MoEConfig and a jitted forward (compiled once per input shape)."""

    def __init__(self, config: MoEConfig, backend: str = "ffi"):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        self.config = config
        self.backend = backend
        self._fn = jax.jit(functools.partial(moe_forward, backend=backend, **config.forward_kwargs()))

    def __call__(self, hidden_states, router_logits, w13, w2, **arrays):
        """arrays: e_score_correction_bias, shared_w13, shared_w2, shared_gate,
        shared_expert_output (as moe_forward)."""
        c = self.config
        if hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must have H={c.hidden_size}, got {hidden_states.shape}")
        up = (2 if c.is_gated else 1) * c.intermediate_size
        if w13.shape != (c.num_experts, up, c.hidden_size):
            raise ValueError(
                f"w13 must be (E={c.num_experts}, {up}, H={c.hidden_size}), got {w13.shape}")
        return self._fn(hidden_states, router_logits, w13, w2, **arrays)
