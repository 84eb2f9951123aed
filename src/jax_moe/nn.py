"""A Flax NNX module around ``moe_forward``: ``jax_moe.nn.MoE``.

Flax is an optional dependency (``pip install flax``, or this package's
``[flax]`` extra when installing from the source tree); ``import jax_moe``
never imports it, only ``import jax_moe.nn`` does.
"""

from __future__ import annotations

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "jax_moe.nn needs Flax (the NNX API, flax >= 0.12): install it with "
        "`pip install flax`") from e

import functools
import math

import jax
import jax.numpy as jnp

from jax_moe import _checks, backends, convert, losses
from jax_moe.layer import MoEConfig, moe_forward

__all__ = ["MoE", "Buffer"]


class Buffer(nnx.Variable):
    """A non-trainable variable (like a PyTorch buffer): DeepSeek-V3's
    e_score_correction_bias. ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
    ``nnx.grad`` (whose default filter is nnx.Param) leave it alone."""


@functools.partial(jax.jit, static_argnames=("shapes", "dtype"))
def _lecun_uniform(key, shapes, dtype):
    """One array per shape, uniform with variance 1/fan_in (fan_in: the last
    axis, the PyTorch (out, in) layout). Drawn as one flat array and cut: a
    single small compile (threefry draws of rank-3 shapes compile slowly)."""
    sizes = [math.prod(s) for s in shapes]
    flat = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)
    out, start = [], 0
    for shape, size in zip(shapes, sizes):
        bound = math.sqrt(3.0 / shape[-1])
        out.append((flat[start:start + size] * bound).reshape(shape).astype(dtype))
        start += size
    return out


class MoE(nnx.Module):
    """A MoE block (router + routed experts + optional shared expert) in Flax NNX.

    Parameters (PyTorch / Hugging Face layout, see ``jax_moe.convert``)::

        router                   nnx.Param (E, H)
        w13                      nnx.Param (E, 2I, H)   concat(gate, up) per expert
        w2                       nnx.Param (E, H, I)
        e_score_correction_bias  Buffer (E,) float32    if config.use_correction_bias (zeros)
        shared_w13, shared_w2    nnx.Param (2I_s, H), (H, I_s)  if config.shared_intermediate_size
        shared_gate              nnx.Param (H,)         if config.shared_expert_gate
        w13_scale, w2_scale      Buffer (f32 block scales)  from_state_dict(keep_fp8=True):
                                 w13, w2 are then float8_e4m3fn Buffers (not trained)

    Absent ones are None. Weights are drawn uniform with variance 1/fan_in
    (fan_in = the last axis), or by ``kernel_init(key, shape, param_dtype)``
    (a ``jax.nn.initializers`` function) if given; the bias starts at zero.
    ``__call__(x)`` takes x (..., H), computes
    ``router_logits = x @ router.T`` in float32 and runs ``moe_forward`` with
    ``config.forward_kwargs()`` on ``backend``; the result has x's leading
    shape and ``dtype``. Parameters are stored in ``param_dtype`` and cast to
    ``dtype`` (the computation dtype) for the call, as in ``nnx.Linear``.

    Gradients: both backends are differentiable (``jax.grad``, ``nnx.grad``,
    training with optax); on "ffi" the backward runs on the kernels too (see
    ``jax_moe.moe_forward``). Routing is a discrete choice: gradients reach
    the router through the chosen experts' weights, and through the
    auxiliary losses below.

    ``__call__(x, return_aux=True)`` returns ``(out, aux)``: aux holds the
    float32 ``router_logits`` (T, E), ``load_balancing_loss`` and
    ``router_z_loss`` (``jax_moe.losses``) and ``aux_loss`` =
    router_aux_loss_coef * load_balancing_loss + router_z_loss_coef *
    router_z_loss, the term to add to the model's loss.
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, backend: str = "ffi", kernel_init=None,
                 router_aux_loss_coef: float = 0.001, router_z_loss_coef: float = 0.0):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a jax_moe.MoEConfig, got {type(config).__name__}")
        backends.get(backend)  # raises ValueError for an unknown backend
        for name, v in (("router_aux_loss_coef", router_aux_loss_coef),
                        ("router_z_loss_coef", router_z_loss_coef)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{name} must be a finite float, got {v!r}")
        self.router_aux_loss_coef = float(router_aux_loss_coef)
        self.router_z_loss_coef = float(router_z_loss_coef)
        self.config = config
        self.backend = backend
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        c = config
        e, h, i = c.num_experts, c.hidden_size, c.intermediate_size
        up = 2 if c.is_gated else 1
        i_s = c.shared_intermediate_size
        shapes = {"router": (e, h), "w13": (e, up * i, h), "w2": (e, h, i)}
        if i_s:
            shapes.update(shared_w13=(up * i_s, h), shared_w2=(h, i_s))
        if c.shared_expert_gate:
            shapes["shared_gate"] = (h,) if kernel_init is None else (1, h)
        if kernel_init is None:
            values = _lecun_uniform(rngs.params(), tuple(shapes.values()), self.param_dtype)
        else:
            values = [kernel_init(rngs.params(), s, self.param_dtype) for s in shapes.values()]
        values = dict(zip(shapes, values))
        self.router = nnx.Param(values["router"])
        self.w13 = nnx.Param(values["w13"])
        self.w2 = nnx.Param(values["w2"])
        self.e_score_correction_bias = (
            Buffer(jnp.zeros((e,), jnp.float32)) if c.use_correction_bias else None)
        self.shared_w13 = nnx.Param(values["shared_w13"]) if i_s else None
        self.shared_w2 = nnx.Param(values["shared_w2"]) if i_s else None
        self.shared_gate = (nnx.Param(values["shared_gate"].reshape(h))
                            if c.shared_expert_gate else None)
        # Block scales of fp8 experts (from_state_dict(..., keep_fp8=True)), else None.
        self.w13_scale = None
        self.w2_scale = None

    def __call__(self, x, *, return_aux: bool = False):
        c = self.config
        _checks.is_array(x, "x")
        if x.ndim < 1 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must be (..., H={c.hidden_size}), got shape {x.shape}")
        lead = x.shape[:-1]
        x2 = jnp.asarray(x).reshape(-1, c.hidden_size).astype(self.dtype)

        def cast(v):
            return None if v is None else v[...].astype(self.dtype)

        logits = jnp.dot(x2.astype(jnp.float32), self.router[...].astype(jnp.float32).T,
                         preferred_element_type=jnp.float32)
        bias = self.e_score_correction_bias
        fp8_experts = self.w13_scale is not None  # fp8 codes and scales, used as stored
        out = moe_forward(
            x2, logits, self.w13[...] if fp8_experts else cast(self.w13),
            self.w2[...] if fp8_experts else cast(self.w2),
            e_score_correction_bias=None if bias is None else bias[...],
            shared_w13=cast(self.shared_w13), shared_w2=cast(self.shared_w2),
            shared_gate=cast(self.shared_gate),
            w13_scale=self.w13_scale[...] if fp8_experts else None,
            w2_scale=self.w2_scale[...] if fp8_experts else None,
            backend=self.backend, **c.forward_kwargs())
        out = out.reshape(*lead, c.hidden_size)
        if not return_aux:
            return out
        balance = losses.load_balancing_loss(logits, c.topk)
        z = losses.router_z_loss(logits)
        return out, {"router_logits": logits, "load_balancing_loss": balance,
                     "router_z_loss": z,
                     "aux_loss": self.router_aux_loss_coef * balance
                     + self.router_z_loss_coef * z}

    @classmethod
    def from_state_dict(cls, config: MoEConfig, state_dict, *, prefix: str = "",
                        layout: str | None = None, dtype=jnp.float32, param_dtype=jnp.float32,
                        backend: str = "ffi", keep_fp8: bool = False) -> MoE:
        """A MoE holding the weights of one Hugging Face MoE block
        (``jax_moe.convert.convert_moe_block(state_dict, prefix=..., layout=...)``),
        cast to param_dtype. The weights must match `config` (use
        ``convert.config_from_hf`` on the model's config.json): a mismatch
        raises ValueError, a tensor the config needs but the state dict lacks
        KeyError. No random initialisation is done.

        keep_fp8=True with an FP8 checkpoint: the routed experts stay
        block-scaled fp8 (``convert_moe_block(..., keep_fp8=True)``) and are
        held as Buffers, not Params (they are not trained), with their scales
        in ``w13_scale`` and ``w2_scale``; the forward runs moe_forward's fp8
        path. The router and shared experts are Params in param_dtype."""
        arrays = convert.convert_moe_block(state_dict, prefix=prefix, layout=layout,
                                           dtype=param_dtype, keep_fp8=keep_fp8)
        scales = {n: arrays.pop(n) for n in ("w13_scale", "w2_scale") if n in arrays}
        # Build the module abstractly (no init cost), then fill in the arrays.
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype,
                                           param_dtype=param_dtype, backend=backend))
        p = convert._norm_prefix(prefix)
        where = {"router": "gate.weight", "e_score_correction_bias": "gate.e_score_correction_bias",
                 "shared_w13": "shared expert", "shared_w2": "shared expert",
                 "shared_gate": "shared_expert_gate.weight"}
        for name in ("router", "w13", "w2", "e_score_correction_bias", "shared_w13",
                     "shared_w2", "shared_gate"):
            var = getattr(model, name)
            value = arrays.pop(name, None)
            if var is None and value is None:
                continue
            if var is None:
                raise ValueError(
                    f"the state dict under {p!r} has {name} but the config does not expect it "
                    f"({_config_hint(name)})")
            if value is None:
                raise KeyError(
                    f"the config expects {name} ({_config_hint(name)}) but the state dict under "
                    f"{p!r} has none ({where.get(name, name)})")
            if value.shape != var.shape:
                raise ValueError(
                    f"{name} from the state dict under {p!r} has shape {value.shape}, the config "
                    f"expects {var.shape} ({_config_hint(name)})")
            if scales and name in ("w13", "w2"):
                setattr(model, name, Buffer(value))  # fp8 codes: held, not trained
                # data, not a static attribute (it was None when built)
                setattr(model, name + "_scale", nnx.data(Buffer(scales[name + "_scale"])))
                continue
            var.set_value(value)
        return model


def _config_hint(name: str) -> str:
    return {
        "e_score_correction_bias": "MoEConfig.use_correction_bias",
        "shared_w13": "MoEConfig.shared_intermediate_size",
        "shared_w2": "MoEConfig.shared_intermediate_size",
        "shared_gate": "MoEConfig.shared_expert_gate",
    }.get(name, "MoEConfig.num_experts, hidden_size, intermediate_size")
