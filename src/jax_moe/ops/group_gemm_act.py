"""Steps 3-5 in one kernel, the forward-only layer's w13 GEMM with the gated
activation in its epilogue: FFI target jax_moe_group_gemm_act."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe.ops._common import sds
from jax_moe._int32 import index_int32


def _group_gemm_act_call(x, w13, expert_sizes, dst_to_src, k: int, activation: str):
    """gated_activation(group_gemm_gather(x, w13, expert_sizes, dst_to_src,
    k), activation) with the same bits (the product rounded to x's dtype,
    then the activation in f32), without writing the product: x (T, H),
    w13 (E, 2*I, H), dst_to_src (M,) -> (M, I). Not differentiable (the
    training forward keeps the product for the backward). On the GPU only
    within the kernel's limits (tuning.group_gemm_act_runs without its rows
    rule: compute capability 9.0, bf16/f16, 2I a multiple of 16, H of 8, at
    most 1024 experts); on the CPU anywhere."""
    m = dst_to_src.shape[0]
    inter = w13.shape[1] // 2
    call = jax.ffi.ffi_call(
        "jax_moe_group_gemm_act", (sds((m, inter), x.dtype), sds((4,), jnp.uint8)),
        vmap_method="sequential")
    out, _ = call(x, w13, index_int32(expert_sizes), index_int32(dst_to_src), topk=np.int64(k),
                  activation=np.int64(_checks.ACTIVATIONS[activation]))
    return out
