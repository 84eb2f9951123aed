"""One token's routed experts with block-scaled fp8 weights in one kernel:
FFI target jax_moe_moe_decode_fp8 (CUDA only). moe_forward takes it on the
GPU for one token with fp8 experts, after the router; other platforms run
the step chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe.ops._common import sds


def decode_fp8_applies(hidden_states, w2, topk: int) -> bool:
    """Whether the kernel takes a layer of these (checked) shapes: one token,
    H and I within DECODE_FP8_LIMITS."""
    lim = _checks.DECODE_FP8_LIMITS
    tokens, hidden = hidden_states.shape
    inter = w2.shape[2]
    mult = lim["multiple"]
    return (tokens == 1 and 1 <= topk <= lim["max_topk"]
            and hidden % mult == 0 and mult <= hidden <= lim["max_hidden"]
            and inter % mult == 0 and mult <= inter <= lim["max_inter"])


def _moe_decode_fp8(hidden_states, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale,
                    activation: str, is_gated: bool):
    """The custom call on checked arguments within decode_fp8_applies: steps
    3-7 of the fp8 layer for one token given the router's (1, k) weights and
    ids -> (1, H) in hidden_states' dtype. The twin is the step chain
    (backends.fp8_expert_mlp and the combine); the rounding points are its,
    the sums run in another order."""
    k = topk_ids.shape[1]
    hidden, inter = hidden_states.shape[1], w2.shape[2]
    call = jax.ffi.ffi_call(
        "jax_moe_moe_decode_fp8",
        (sds((1, hidden), hidden_states.dtype), sds((k, inter), jnp.float32),
         sds((k, hidden), jnp.float32)),  # out, act and y scratch
        vmap_method="sequential")
    out, _, _ = call(hidden_states, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32),
                     w13, w13_scale, w2, w2_scale,
                     activation=np.int64(_checks.ACTIVATIONS[activation]), gated=bool(is_gated))
    return out
