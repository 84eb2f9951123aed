"""moe_forward, MoEConfig and MoELayer: the routed layer (with shared experts)
on the FFI kernels or on jax_moe.reference.

moe_forward checks its arguments once (jax_moe._checks.forward_args), then
composes the backend's unchecked steps (jax_moe.backends.steps).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_moe import _checks, backends, fp8
from jax_moe.ops.moe_decode_fp8 import _moe_decode_fp8, decode_fp8_applies

__all__ = ["moe_forward", "MoEConfig", "MoELayer"]

_FFI = backends.steps("ffi")


def _dense_mlp(steps, x, w_up, w_down, spec: _checks.Layer):
    """A dense (shared) expert: x (T, H) -> (T, H), f32 accumulation."""
    h = jnp.dot(x, w_up.T, preferred_element_type=jnp.float32).astype(x.dtype)
    a = steps.activation(h, spec.activation, spec.is_gated)
    return jnp.dot(a, w_down.T, preferred_element_type=jnp.float32)


def _decode_applies(spec: _checks.Layer, a: dict) -> bool:
    """Whether ops.moe_decode computes this layer: softmax routing without
    groups or bias, gated SiLU, and the kernel's shape limits."""
    r = spec.routing
    if (spec.fp8 or r.scoring_func != "softmax" or r.num_expert_group != 1
            or a["e_score_correction_bias"] is not None or spec.activation != "silu"
            or not spec.is_gated):
        return False
    # moe_forward has checked the arguments; only the kernel's limits remain.
    return _checks.decode_limits(a["hidden_states"], a["w13"], a["w2"], r.topk) is None


def _fp8_routed(steps, spec: _checks.Layer, x, logits, w13, w2, bias, w13_scale, w2_scale):
    """Steps 1-7 with block-scaled fp8 expert weights: routing, index and
    combine as for float weights, steps 3-6 backends.fp8_expert_mlp. One
    token on the GPU: steps 3-7 in one kernel (ops.moe_decode_fp8)."""
    r = spec.routing
    experts = w13.shape[0]
    weights, ids = steps.route(logits, bias, r)

    # The one-token kernel has no backward of its own: under jax.grad the
    # gradients of x and of the router's weights are the chain's (run again
    # in the backward); the fp8 weights are frozen, as in the chain.
    @jax.custom_vjp
    def fused(x, weights, ids, w13, w13_scale, w2, w2_scale):
        return _moe_decode_fp8(x, weights, ids, w13, w13_scale, w2, w2_scale, spec.activation,
                               spec.is_gated)

    def fused_fwd(*args):
        fp8.refuse_weight_gradients(*args[3:])
        values = tuple(a.value for a in args)
        return fused(*values), values

    def fused_bwd(values, g):
        x, weights, ids, *frozen = values
        _, vjp = jax.vjp(lambda x, weights: chain(x, weights, ids, *frozen), x, weights)
        return (*vjp(g), None, None, None, None, None)

    fused.defvjp(fused_fwd, fused_bwd, symbolic_zeros=True)

    def chain(x, weights, ids, w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale):
        src_to_dst, dst_to_src, sizes = steps.token_index(ids, experts, 0, experts)
        y = backends.fp8_expert_mlp(steps, x, w13, w13_scale, w2, w2_scale, sizes, dst_to_src,
                                    r.topk, spec.activation, spec.is_gated)
        return steps.combine(y, weights, src_to_dst, dst_to_src)

    if steps is _FFI and decode_fp8_applies(x, w2, r.topk):
        return jax.lax.platform_dependent(x, weights, ids, w13, w13_scale, w2, w2_scale,
                                          cuda=fused, default=chain)
    return chain(x, weights, ids)


def _layer(steps, spec: _checks.Layer, a: dict):
    """The layer on one backend's unchecked steps; `a` holds the arrays (None
    where absent)."""
    x = a["hidden_states"]
    bias = a["e_score_correction_bias"]

    def routed(x, logits, w13, w2):  # steps 1-7 (one ffi call for float weights)
        if spec.fp8:
            return _fp8_routed(steps, spec, x, logits, w13, w2, bias, a["w13_scale"],
                               a["w2_scale"])
        return steps.moe_layer(x, logits, w13, w2, bias, spec)

    def decode(x, logits, w13, w2):  # one token, the whole layer in one kernel
        return steps.moe_decode(x, logits, w13, w2, spec.routing)

    args = (x, a["router_logits"], a["w13"], a["w2"])
    if steps is _FFI and _decode_applies(spec, a):
        # The GPU takes the one-kernel decode; other platforms keep moe_layer's bits.
        out = jax.lax.platform_dependent(*args, cuda=decode, default=routed)
    else:
        out = routed(*args)

    extra = None
    if a["shared_w13"] is not None:
        extra = _dense_mlp(steps, x, a["shared_w13"], a["shared_w2"], spec)
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


def moe_forward(hidden_states, router_logits, w13, w2, topk: int, *,
                renormalize: bool = True, activation: str = "silu", is_gated: bool = True,
                scoring_func: str = "softmax", num_expert_group: int | None = None,
                topk_group: int | None = None, e_score_correction_bias=None,
                routed_scaling_factor: float = 1.0, shared_w13=None, shared_w2=None,
                shared_gate=None, shared_expert_output=None, remat: bool = False,
                w13_scale=None, w2_scale=None, backend: str = "ffi"):
    """The MoE layer forward: route, group by expert, expert FFN, combine.

    hidden_states (T, H); router_logits (T, E) (float32, bfloat16 or float16;
    routing in f32); w13 (E, 2*I, H) = concat(gate_proj, up_proj) per expert (or (E, I, H)
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

    Differentiable in hidden_states, router_logits, w13, w2 and the shared
    experts' arrays. On the "ffi" backend the backward runs on the kernels
    (grouped GEMMs against the weights for the inputs' gradients, k-grouped
    GEMMs for the weights', the activation's and the router's backward);
    the forward keeps the router's weights, the token index and the w13
    GEMM's output (T*k rows of 2I) for it, and where w13's GEMM is the
    Hopper tile (256: CUTLASS's kernel copies the rows before its loads
    anyway) the expanded input rows (T*k rows of H); not the expert outputs. remat=True
    keeps neither w13's output nor those rows and recomputes that GEMM in
    the backward instead.

    Block-scaled fp8 experts (DeepSeek-V3's and the Qwen3-MoE FP8 checkpoints'
    weights): w13 and w2 in float8_e4m3fn with one f32 scale per 128 x 128
    block, w13_scale (E, ceil(2*I/128), ceil(H/128)) and w2_scale (E,
    ceil(H/128), ceil(I/128)) (the checkpoints' ``weight_scale_inv``). Both
    GEMMs then run ``ops.group_gemm_fp8`` (each row of their input quantised
    per 128 channels); the rest of the layer is unchanged. On the GPU one
    token (H and I multiples of 16) runs everything after the router in one
    kernel (the jax_moe_moe_decode_fp8 custom call), with the same rounding
    points. The fp8 weights are frozen (jax.grad with respect to them raises
    a TypeError); the gradients of the tokens and the router logits run the
    fp8 GEMMs' backward (ops.group_gemm_fp8). remat does not apply to fp8
    experts (their backward keeps the w13 GEMM's output).

    backend: "ffi" (the custom calls) or "reference" (plain jax.numpy); see
    jax_moe.backends. On the GPU, one token within ``ops.moe_decode_supported``
    (softmax routing without groups or bias, gated SiLU) runs ops.moe_decode.
    Jit it with the non-array arguments static: ``static_argnames=("topk",
    "renormalize", "activation", "is_gated", "scoring_func", "num_expert_group",
    "topk_group", "routed_scaling_factor", "remat", "backend")``.
    """
    steps = backends.steps(backend)
    spec = _checks.forward_args(
        hidden_states, router_logits, w13, w2, topk, renormalize=renormalize,
        activation_name=activation, is_gated=is_gated, scoring_func=scoring_func,
        num_expert_group=num_expert_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor, shared_w13=shared_w13, shared_w2=shared_w2,
        shared_gate=shared_gate, shared_expert_output=shared_expert_output,
        w13_scale=w13_scale, w2_scale=w2_scale, remat=remat)
    arrays = dict(hidden_states=hidden_states, router_logits=router_logits, w13=w13, w2=w2,
                  e_score_correction_bias=e_score_correction_bias, shared_w13=shared_w13,
                  shared_w2=shared_w2, shared_gate=shared_gate,
                  shared_expert_output=shared_expert_output, w13_scale=w13_scale,
                  w2_scale=w2_scale)
    return _layer(steps, spec, arrays)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A MoE block's configuration: experts, top-k and sizes, the routing and
    shared-expert options of Qwen2/3-MoE, Mixtral and DeepSeek-V3."""

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
        for name in ("is_gated", "renormalize", "use_correction_bias", "shared_expert_gate"):
            _checks.static_bool(getattr(self, name), name)  # "false" would read as True
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
        bias = (jax.ShapeDtypeStruct((self.num_experts,), jnp.float32)
                if self.use_correction_bias else None)
        _checks.route_args(logits, self.topk, scoring_func=self.scoring_func,
                           renormalize=self.renormalize, num_expert_group=self.num_expert_group,
                           topk_group=self.topk_group, e_score_correction_bias=bias,
                           routed_scaling_factor=self.routed_scaling_factor)

    def forward_kwargs(self) -> dict:
        """moe_forward's static keyword arguments for this config."""
        return dict(topk=self.topk, renormalize=self.renormalize, activation=self.hidden_act,
                    is_gated=self.is_gated, scoring_func=self.scoring_func,
                    num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor)


class MoELayer:
    """Holds a MoEConfig and a jitted forward (compiled once per input shape)."""

    def __init__(self, config: MoEConfig, backend: str = "ffi"):
        backends.get(backend)  # raises ValueError for an unknown backend
        self.config = config
        self.backend = backend
        self._fn = jax.jit(functools.partial(moe_forward, backend=backend,
                                             **config.forward_kwargs()))

    def __call__(self, hidden_states, router_logits, w13, w2, **arrays):
        """arrays: e_score_correction_bias, shared_w13, shared_w2, shared_gate,
        shared_expert_output, w13_scale, w2_scale (as moe_forward)."""
        c = self.config
        for name, a in (("hidden_states", hidden_states), ("router_logits", router_logits),
                        ("w13", w13), ("w2", w2)):
            _checks.is_array(a, name)
        if hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(
                f"hidden_states must have H={c.hidden_size}, got {hidden_states.shape}")
        up = (2 if c.is_gated else 1) * c.intermediate_size
        if w13.shape != (c.num_experts, up, c.hidden_size):
            raise ValueError(
                f"w13 must be (E={c.num_experts}, {up}, H={c.hidden_size}), got {w13.shape}")
        _config_arrays(c, arrays)
        return self._fn(hidden_states, router_logits, w13, w2, **arrays)


_ARRAYS = ("e_score_correction_bias", "shared_w13", "shared_w2", "shared_gate",
           "shared_expert_output", "w13_scale", "w2_scale")


def _config_arrays(c: MoEConfig, arrays: dict) -> None:
    """The arrays that c implies are there, and none that it rules out: a
    DeepSeek-V3 block called without its correction bias would route wrongly
    with no error."""
    unknown = sorted(set(arrays) - set(_ARRAYS))
    if unknown:
        raise TypeError(f"MoELayer got unknown arrays {unknown}; it takes {list(_ARRAYS)}")
    given = {k for k, v in arrays.items() if v is not None}
    want = set()
    if c.use_correction_bias:
        want.add("e_score_correction_bias")
    if c.shared_intermediate_size:
        if "shared_expert_output" not in given:  # else the shared expert ran outside
            want |= {"shared_w13", "shared_w2"}
        if c.shared_expert_gate and "shared_expert_output" not in given:
            want.add("shared_gate")
    missing = sorted(want - given)
    if missing:
        raise ValueError(f"MoELayer's config needs {missing}, which were not passed")
    if not c.use_correction_bias and "e_score_correction_bias" in given:
        raise ValueError("e_score_correction_bias was passed but the config has "
                         "use_correction_bias=False")
    if not c.shared_expert_gate and "shared_gate" in given:
        raise ValueError("shared_gate was passed but the config has shared_expert_gate=False")
    if not c.shared_intermediate_size and given & {"shared_w13", "shared_w2", "shared_gate",
                                                   "shared_expert_output"}:
        raise ValueError(f"shared-expert arrays {sorted(given & set(_ARRAYS[1:]))} were passed "
                         "but the config has shared_intermediate_size=0")
