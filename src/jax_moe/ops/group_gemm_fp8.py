"""The grouped GEMM with block-scaled fp8 weights: FFI target jax_moe_group_gemm_fp8."""

from __future__ import annotations

import jax

from jax_moe import _checks
from jax_moe._int32 import index_int32
from jax_moe.ops._common import sds


def group_gemm_fp8(x, w, w_scale, expert_sizes):
    """group_gemm with block-scaled fp8 weights, the DeepSeek-V3 recipe (the
    twin: reference.group_gemm_fp8): w (E, N, K) float8_e4m3fn with one f32
    scale per 128 x 128 block, w_scale (E, ceil(N/128), ceil(K/128)) (the
    FP8 checkpoints' ``weight_scale_inv``; weight = value x scale). Each row
    of x (M, K) (f32, bf16 or f16) is quantised to e4m3 per 128 channels
    inside the kernel (jax_moe.fp8's rule; no quantised copy is written); per
    128-channel block the e4m3 products are summed in f32 and added times
    both scales -> (M, N) in x's dtype. Rows are owned as in group_gemm; rows
    past sum(expert_sizes) are zero. A block scale or input holding NaN or
    infinity makes NaN of the outputs it reaches, and no others.

    Kernels: the CPU one, and on CUDA a portable SIMT kernel (no tensor-core
    path yet). Not differentiable (fp8 weights are for inference)."""
    _checks.group_gemm_fp8_args(x, w, w_scale, expert_sizes)
    return _group_gemm_fp8(x, w, w_scale, expert_sizes)


def _group_gemm_fp8(x, w, w_scale, expert_sizes):
    """group_gemm_fp8 on checked arguments."""
    call = jax.ffi.ffi_call("jax_moe_group_gemm_fp8", sds((x.shape[0], w.shape[1]), x.dtype),
                            vmap_method="sequential")
    return call(x, w, w_scale, index_int32(expert_sizes))
