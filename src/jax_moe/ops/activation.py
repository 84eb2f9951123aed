"""Step 5, the activation: FFI targets jax_moe_activation, (its backward)
jax_moe_activation_grad and (the routed layer's backward, with each row's
top-k weight) jax_moe_activation_scaled_grad."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe.ops._common import sds


def gated_activation(h, activation: str = "silu"):
    """Step 5: act(h[..., :I]) * h[..., I:], computed in f32, in h's dtype.
    activation: "silu", "gelu" (exact, erf) or "gelu_tanh"."""
    _checks.activation_args(h, activation, gated=True)
    return _activation(h, activation, True)


def activation(h, activation: str = "silu"):
    """Step 5 for non-gated experts: act(h) elementwise, in f32, in h's dtype."""
    _checks.activation_args(h, activation, gated=False)
    return _activation(h, activation, False)


def silu_and_mul(h):
    """silu(h[..., :I]) * h[..., I:]."""
    _checks.activation_args(h, "silu", gated=True)
    return _activation(h, "silu", True)


def gelu_and_mul(h, approximate: bool = False):
    """gelu(h[..., :I]) * h[..., I:]; approximate=True uses the tanh form."""
    name = _checks.gelu_and_mul_args(h, approximate)
    return _activation(h, name, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _activation(h, name: str, gated: bool):
    """gated_activation (gated) or activation on checked arguments;
    differentiable."""
    return _activation_call(h, name, gated)


def _activation_fwd(h, name, gated):
    return _activation_call(h, name, gated), h


def _activation_bwd(name, gated, h, g):
    return (activation_vjp(h, g, name, gated),)


def activation_vjp(h, g, name: str, gated: bool):
    """The gradient of the activation at h for the output cotangent g (h's
    shape with the last dim halved when gated), in h's dtype, computed in f32
    (as reference._activation's autodiff): one pass over h and g."""
    call = jax.ffi.ffi_call("jax_moe_activation_grad", sds(h.shape, h.dtype),
                            vmap_method="broadcast_all")
    return call(h, g.astype(h.dtype), activation=np.int64(_checks.ACTIVATIONS[name]),
                gated=bool(gated))


def activation_scaled_vjp(h, d, scale, name: str, gated: bool):
    """The activation's backward in the routed layer, where row r's output
    cotangent is scale[r] * d[r] (d (M, I): the gradient of the unweighted
    expert output pulled back through w2; scale (M,): the row's top-k
    weight). One pass over h and d -> (dh (h's shape, activation_vjp's for
    that cotangent), scale[r] * act(h[r]) (d's shape, w2's weight-gradient
    operand), dot (M,) float32 = the sum over c of act(h)[r, c] (rounded to
    h's dtype, as the forward stores it) times d[r, c], which is the top-k
    weight's gradient). All in f32, in h's dtype.

    dh takes h's buffer (input_output_aliases) where XLA can give it, that
    is where nothing reads h afterwards, as in the layer's backward: then
    h, d and the scaled activation are live at once, not also dh."""
    call = jax.ffi.ffi_call(
        "jax_moe_activation_scaled_grad",
        (sds(h.shape, h.dtype), sds(d.shape, h.dtype), sds(d.shape[:-1], jnp.float32)),
        vmap_method="broadcast_all", input_output_aliases={0: 0})
    return call(h, d.astype(h.dtype), scale.astype(jnp.float32),
                activation=np.int64(_checks.ACTIVATIONS[name]), gated=bool(gated))

_activation.defvjp(_activation_fwd, _activation_bwd)


def _activation_call(h, name: str, gated: bool):
    """The jax_moe_activation custom call."""
    width = h.shape[-1] // 2 if gated else h.shape[-1]
    call = jax.ffi.ffi_call(
        "jax_moe_activation", sds(h.shape[:-1] + (width,), h.dtype),
        vmap_method="broadcast_all")
    return call(h, activation=np.int64(_checks.ACTIVATIONS[name]), gated=bool(gated))
