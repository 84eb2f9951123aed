"""Block-scaled fp8 (e4m3) numbers, as DeepSeek-V3 and the Qwen3-MoE FP8
checkpoints store their expert weights, and the per-token activation
quantisation of the same recipe.

Weights: an (..., N, K) array of ``float8_e4m3fn`` values with one f32
scale per 128 x 128 block, shape (..., ceil(N / 128), ceil(K / 128)) (the
checkpoints' ``weight_scale_inv``): the weight is value x scale. The last
block along N or K may be partial. Activations: each row quantised per 128
channels, one f32 scale per (row, 128-channel block).

A block's scale is its largest magnitude times the f32 constant 1/448
(448: e4m3's largest finite value), so that its largest value maps to
+-448; an all-zero block gets scale 1 and zero values (never 0 / 0). A
block holding a NaN or an infinity gets a NaN scale and NaN values (e4m3fn
has no infinity): it never reaches other blocks.

These are the building blocks of the fp8 reference twin
(``reference.group_gemm_fp8``): plain jax.numpy, jit-safe, any backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _check_basics as _basics

BLOCK = 128
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # jnp.finfo(float8_e4m3fn).max
INV_FP8_MAX = np.float32(1.0 / FP8_MAX)

# What jax.grad with respect to block-scaled fp8 weights raises (TypeError).
FROZEN_WEIGHTS = (
    "block-scaled fp8 expert weights (moe_forward's w13 / w2 with w13_scale / w2_scale, "
    "group_gemm_fp8's w / w_scale) are frozen: they have no gradient. Train bf16 "
    "weights (jax_moe.fp8.dequantize_blocks) to differentiate with respect to them.")


def refuse_weight_gradients(*primals) -> None:
    """In the forward of a custom_vjp defined with symbolic_zeros=True: the
    TypeError FROZEN_WEIGHTS when any of these primals (the fp8 weights and
    their scales, or pytrees of them) is being differentiated."""
    if any(p.perturbed for p in jax.tree.leaves(primals)):
        raise TypeError(FROZEN_WEIGHTS)


def dense_cotangent(g):
    """A cotangent of a custom_vjp with symbolic_zeros=True as an array:
    zeros where it is a symbolic zero."""
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(g.aval.shape, g.aval.dtype)
    return g


def blocks(n: int) -> int:
    """Number of 128-wide blocks covering n."""
    return -(-n // BLOCK)


def _float_matrix(x, name: str) -> None:
    """A float32/bfloat16/float16 array of rank >= 2, else an error naming it."""
    _basics.is_array(x, name)
    _basics.float_dtype(x, name)
    if x.ndim < 2:
        raise ValueError(f"{name} must have rank >= 2, got shape {x.shape}")


def _pad_to_blocks(a, axes):
    """a, zero-padded at the end of each axis in `axes` to a multiple of 128."""
    pad = [(0, 0)] * a.ndim
    for ax in axes:
        pad[ax] = (0, blocks(a.shape[ax]) * BLOCK - a.shape[ax])
    return jnp.pad(a, pad)


def _scale_of(blocks_f32, axes):
    """The f32 scale of each block (the reduction over `axes`) mapping its
    largest magnitude to 448; 1 for an all-zero block (its values stay
    zero); NaN for a block holding a NaN or an infinity (whatever a
    backend's max does with NaN)."""
    finite = jnp.isfinite(blocks_f32)
    amax = jnp.max(jnp.where(finite, jnp.abs(blocks_f32), 0.0), axis=axes)
    bad = ~jnp.all(finite, axis=axes)
    # times the f32 constant 1/448 rather than over 448: XLA may turn a
    # division by a constant into this product, and the product is one
    # rounding everywhere.
    return jnp.where(bad, jnp.nan, jnp.where(amax > 0, amax * INV_FP8_MAX, 1.0))


def _to_fp8(v):
    """v (already times 1 / its block's scale: a product, not a quotient,
    because XLA may rewrite a quotient into that product anyway) as e4m3.
    e4m3fn overflows to NaN, not to its largest value: clip first (the
    product can round a hair past 448)."""
    return jnp.clip(v, -FP8_MAX, FP8_MAX).astype(FP8)


def _exact_fp8(values):
    """values, kept as e4m3 under jit. With its default excess precision
    (xla_allow_excess_precision) XLA on GPUs folds a convert to a narrower
    float and back into nothing, so quantize then dequantize inside one jitted
    program would skip the rounding to e4m3; the barrier keeps it."""
    return jax.lax.optimization_barrier(values)


def quantize_blocks(w):
    """(..., N, K) float weights -> (values (..., N, K) float8_e4m3fn,
    scales (..., ceil(N/128), ceil(K/128)) f32), one scale per 128 x 128
    block: the layout of the FP8 checkpoints."""
    _float_matrix(w, "w")
    n, k = w.shape[-2:]
    nb, kb = blocks(n), blocks(k)
    wp = _pad_to_blocks(w.astype(jnp.float32), (w.ndim - 2, w.ndim - 1))
    tiles = wp.reshape(w.shape[:-2] + (nb, BLOCK, kb, BLOCK))
    scale = _scale_of(tiles, (-3, -1))
    values = _to_fp8(tiles * (1.0 / scale)[..., :, None, :, None])
    values = values.reshape(wp.shape)[..., :n, :k]
    return values, scale


def dequantize_blocks(values, scales, dtype=jnp.float32):
    """values x scale of its 128 x 128 block, in `dtype`: the inverse of
    quantize_blocks (up to e4m3's rounding)."""
    check_block_scales(values, scales, "values", "scales")
    n, k = values.shape[-2:]
    full = jnp.repeat(jnp.repeat(scales, BLOCK, axis=-2), BLOCK, axis=-1)[..., :n, :k]
    return (_exact_fp8(values).astype(jnp.float32) * full).astype(dtype)


def quantize_rows(x):
    """(M, K) activations -> (values (M, K) float8_e4m3fn, scales
    (M, ceil(K/128)) f32): each row quantised per 128 channels."""
    _float_matrix(x, "x")
    k = x.shape[-1]
    kb = blocks(k)
    xp = _pad_to_blocks(x.astype(jnp.float32), (x.ndim - 1,))
    groups = xp.reshape(x.shape[:-1] + (kb, BLOCK))
    scale = _scale_of(groups, -1)
    values = _to_fp8(groups * (1.0 / scale)[..., None]).reshape(xp.shape)[..., :k]
    return values, scale


def dequantize_rows(values, scales, dtype=jnp.float32):
    """values x the scale of its (row, 128-channel block), in `dtype`."""
    k = values.shape[-1]
    full = jnp.repeat(scales, BLOCK, axis=-1)[..., :k]
    return (_exact_fp8(values).astype(jnp.float32) * full).astype(dtype)


def check_block_scales(values, scales, name: str, scale_name: str) -> None:
    """TypeError / ValueError naming the arguments unless `values` is a
    float8_e4m3fn (..., N, K) array and `scales` its f32 block scales
    (..., ceil(N/128), ceil(K/128))."""
    _basics.is_array(values, name)
    _basics.is_array(scales, scale_name)
    if values.dtype != FP8:
        raise TypeError(f"{name} must be float8_e4m3fn for block scales, got {values.dtype}")
    if scales.dtype != jnp.float32:
        raise TypeError(f"{scale_name} must be float32, got {scales.dtype}")
    if values.ndim < 2:
        raise ValueError(f"{name} must have rank >= 2, got shape {values.shape}")
    want = values.shape[:-2] + (blocks(values.shape[-2]), blocks(values.shape[-1]))
    if tuple(scales.shape) != want:
        raise ValueError(f"{scale_name} must have shape {want} (one scale per 128 x 128 block "
                         f"of {name} {tuple(values.shape)}), got {tuple(scales.shape)}")


def transpose_blocks(values, scales):
    """Block-scaled (..., N, K) values and their scales -> the (..., K, N)
    transpose: the same weights, each 128 x 128 block's scale moved with it."""
    return jnp.swapaxes(values, -1, -2), jnp.swapaxes(scales, -1, -2)
