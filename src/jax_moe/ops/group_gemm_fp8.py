"""The grouped GEMM with block-scaled fp8 weights: FFI target jax_moe_group_gemm_fp8."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks, fp8, tuning
from jax_moe._ffi import _ext
from jax_moe._int32 import index_int32
from jax_moe.ops._common import sds
from jax_moe.ops.activation import _activation, activation_vjp
from jax_moe.ops.expand import gather_transpose


def group_gemm_fp8(x, w, w_scale, expert_sizes, *, dst_to_src=None, topk: int = 1,
                   tile_m: int | None = None):
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

    With dst_to_src (M,), x holds the tokens (T, K) and row r is
    x[dst_to_src[r] // topk], a zero row where dst_to_src[r] is outside
    [0, T * topk): steps 3 and 4 in one call, each kernel reading the token
    rows where it reads its rows (moe_expand_input's rows are not written).

    Kernels, by tile_m (None: the GPU model's tuning table, else
    jax_moe.tuning.default_fp8_tile_m): on CUDA, 8 is a decode kernel (the
    weights streamed once into tensor cores; K a multiple of 16), 64 and 128
    CUTLASS's blockwise-scaled fp8 grouped GEMM in tiles of that many rows on
    Hopper for bf16 x (N a multiple of 8, K of 16; x quantised into the
    scratch output first; with 128, each expert's last 64 rows or fewer in
    64-row tiles). Where the chosen kernel does not apply, CUTLASS's
    with its own tile rule, then a portable SIMT kernel. The CPU has one
    kernel.

    Differentiable in x, not in the frozen fp8 weights (jax.grad with respect
    to w or w_scale raises a TypeError): dx is this GEMM of the output
    cotangent on the transposed weights (each cotangent row quantised per 128
    channels, as DeepSeek-V3's recipe does for its dgrad; the 128 x 128 block
    scales transpose with their blocks), summed back into the tokens with a
    gather. The backward writes the transposed fp8 weights and scales, a copy
    the size of w."""
    k, tile = _checks.group_gemm_fp8_args(x, w, w_scale, expert_sizes, tile_m, dst_to_src, topk)
    return _group_gemm_fp8(x, w, w_scale, expert_sizes, tile, dst_to_src, k)


def _group_gemm_fp8(x, w, w_scale, expert_sizes, tile_m=None, rows=None, topk: int = 1,
                    activation: str | None = None, gated: bool = True):
    """group_gemm_fp8 on checked arguments (tile_m None: tuned; rows:
    dst_to_src or None). With `activation` (no rows), the GEMM of step 5's
    output on x (the previous GEMM's rows, (M, 2K) when gated): where the
    Hopper kernel runs, its prep kernel applies the activation to each row as
    it quantises it (the activation kernel's rounding, so the same bits, and
    no activation output written); elsewhere the activation op, then this
    GEMM."""
    m = x.shape[0] if rows is None else rows.shape[0]
    experts, n, k = w.shape
    tile = tuning.group_gemm_fp8_tile_m(m, experts, n, k, x.dtype, tile_m)
    # The Hopper path's group arrays, workspace and quantised x live in a
    # second output (a fixed address in a recorded CUDA graph, as
    # group_gemm's); empty wherever that kernel will not run.
    sm90 = (m > 0 and experts > 0 and not tuning.fp8_decode_runs(tile, experts, k)
            and tuning.fp8_sm90_usable(n, k, x.dtype))
    # The handler takes an activation only onto that kernel, which runs
    # wherever this holds (its size limits included).
    if activation is not None and not (sm90 and rows is None and m * -(-k // 128) < 2**31):
        x, activation = _activation(x, activation, gated), None
    scratch = _ext.group_gemm_fp8_sm90_scratch_bytes(m, n, k, experts) if sm90 else 0
    gather = rows is not None
    rows = index_int32(rows) if gather else jnp.zeros((0,), jnp.int32)
    return _fp8_call(x, w, w_scale, index_int32(expert_sizes), rows,
                     (m, n, scratch, x.shape[0]), gather, topk, tile, activation, gated)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _fp8_call(x, w, w_scale, expert_sizes, rows, shapes, gather: bool, topk: int, tile: int,
              activation: str | None, gated: bool):
    """The custom call, differentiable in x (group_gemm_fp8's docstring;
    with an activation, through it)."""
    m, n, scratch, _ = shapes  # and the rows of x
    call = jax.ffi.ffi_call("jax_moe_group_gemm_fp8",
                            (sds((m, n), x.dtype), sds((scratch,), jnp.uint8)),
                            vmap_method="sequential")
    code = -1 if activation is None else _checks.ACTIVATIONS[activation]
    out, _ = call(x, w, w_scale, expert_sizes, rows, gather=gather, topk=np.int64(topk),
                  tile_m=np.int64(tile), activation=np.int64(code), gated=bool(gated))
    return out


def _fp8_call_fwd(x, w, w_scale, expert_sizes, rows, shapes, gather, topk, tile, activation,
                  gated):
    fp8.refuse_weight_gradients(w, w_scale)
    out = _fp8_call(x.value, w.value, w_scale.value, expert_sizes.value, rows.value, shapes,
                    gather, topk, tile, activation, gated)
    h = x.value if activation is not None else None  # the activation's input, for its backward
    return out, (w.value, w_scale.value, expert_sizes.value, rows.value, h)


def _fp8_call_bwd(shapes, gather, topk, tile, activation, gated, res, g):
    w, w_scale, expert_sizes, rows, h = res
    dx = _group_gemm_fp8(fp8.dense_cotangent(g), *fp8.transpose_blocks(w, w_scale), expert_sizes)
    if activation is not None:
        dx = activation_vjp(h, dx, activation, gated)
    if gather:
        dx = gather_transpose(dx, rows, topk, shapes[3])
    return dx, None, None, None, None


_fp8_call.defvjp(_fp8_call_fwd, _fp8_call_bwd, symbolic_zeros=True)
