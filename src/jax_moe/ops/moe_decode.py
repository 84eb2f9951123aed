"""The routed layer for one token in one kernel: FFI target jax_moe_moe_decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe.ops._common import sds
from jax_moe.ops.moe_layer import routed_layer


def moe_decode_supported(hidden_states, router_logits, w13, w2, topk: int) -> bool:
    """Whether moe_decode takes this layer (its kernel's limits; the
    arguments themselves are checked as moe_decode checks them)."""
    return _checks.decode_supported(hidden_states, router_logits, w13, w2, topk)


def moe_decode(hidden_states, router_logits, w13, w2, topk: int, *, renormalize: bool = True,
               routed_scaling_factor: float = 1.0):
    """The routed layer for ONE token in one kernel: softmax top-k routing,
    w13, SiLU-and-mul, w2 and the weighted combine. hidden_states (1, H)
    bfloat16 or float16, router_logits (1, E) float, w13 (E, 2*I, H), w2
    (E, H, I) -> (1, H). Limits (the kernel's, from the extension's
    DECODE_LIMITS): H and I multiples of {multiple}, H <= {max_hidden}, I <=
    {max_inter}, topk <= {max_topk}, E <= {max_experts}; ``moe_decode_supported``
    tells whether a layer is within them.

    The rounding points are moe_layer's (h, the activation and each expert's
    output in the input dtype, f32 sums) but the sums run in another order,
    so the bits may differ from moe_layer's; the result is the same bits run
    to run. On the GPU one block per SM streams the chosen experts' w13 rows
    while its w2 rows load into shared memory, then a grid-wide barrier
    (cooperative launch) and w2 + combine (csrc/kernels/cuda/moe_decode.cu).
    moe_forward uses it on the GPU wherever it applies."""
    routing = _checks.moe_decode_args(hidden_states, router_logits, w13, w2, topk,
                                      renormalize=renormalize,
                                      routed_scaling_factor=routed_scaling_factor)
    return _moe_decode(hidden_states, router_logits, w13, w2, routing)


if moe_decode.__doc__:  # None under python -OO
    moe_decode.__doc__ = moe_decode.__doc__.format(**_checks.DECODE_LIMITS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _moe_decode(hidden_states, router_logits, w13, w2, r: _checks.Routing):
    """moe_decode on checked arguments (softmax routing, within the limits).
    Differentiable: under jax.grad the forward runs as moe_layer's steps
    (routed_layer), whose backward passes run on the kernels."""
    return _moe_decode_call(hidden_states, router_logits, w13, w2, r)


def _moe_decode_fwd(hidden_states, router_logits, w13, w2, r):
    layer = functools.partial(routed_layer, e_score_correction_bias=None,
                              spec=_checks.Layer(routing=r))
    return jax.vjp(layer, hidden_states, router_logits, w13, w2)


def _moe_decode_bwd(r, vjp, g):
    return vjp(g)


_moe_decode.defvjp(_moe_decode_fwd, _moe_decode_bwd)


def _moe_decode_call(hidden_states, router_logits, w13, w2, r: _checks.Routing):
    """The jax_moe_moe_decode custom call."""
    k = r.topk
    hidden, inter = hidden_states.shape[1], w2.shape[2]
    call = jax.ffi.ffi_call(
        "jax_moe_moe_decode",
        (sds((1, hidden), hidden_states.dtype), sds((k, inter), jnp.float32)),  # out, act scratch
        vmap_method="sequential")
    out, _ = call(hidden_states, router_logits, w13, w2, topk=np.int64(k),
                  renormalize=r.renormalize,
                  routed_scaling_factor=np.float32(r.routed_scaling_factor))
    return out
