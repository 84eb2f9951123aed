"""Steps 4 and 6, the grouped GEMM: FFI target jax_moe_group_gemm."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks, tuning
from jax_moe._ffi import _ext
from jax_moe.ops._common import gemm_tile, sds
from jax_moe.ops.expand import gather_transpose
from jax_moe.ops.group_gemm_wgrad import _group_gemm_wgrad
from jax_moe._int32 import index_int32


def group_gemm(x, w, expert_sizes, *, tile_m: int | None = None):
    """Steps 4 and 6: rows of x grouped by expert in order; out[rows of e] =
    x[rows of e] @ w[e].T with f32 accumulation. x (M, K), w (E, N, K),
    expert_sizes (E,) -> (M, N) in x's dtype; rows past sum(expert_sizes) are 0.

    tile_m (CUDA only; None = the tuning table's or the heuristic's choice, see
    jax_moe.tuning): rows per tile, 8 (the decode kernel), 16 (the TMA decode
    kernel on compute capability 9.0+ GPUs for bf16/f16 with K a multiple of
    8 and launches of at least 6 tiles per SM (1.5 from K = 8192), else 8),
    32, 64 or 128 (the mma.sync tile kernel), or 256: the Hopper kernels
    (the own wgmma kernel where experts average at most 128 rows, CUTLASS's
    beyond) on compute capability 9.0 GPUs for bf16/f16 with N and K
    multiples of 8, else 128."""
    tile = _checks.group_gemm_args(x, w, expert_sizes, tile_m)
    return _group_gemm(x, w, expert_sizes, None, 1, tile)


def group_gemm_gather(x, w, expert_sizes, dst_to_src, topk: int, *, tile_m: int | None = None):
    """Steps 3 and 4 in one kernel: group_gemm(moe_expand_input(x, dst_to_src,
    topk), w, expert_sizes) without writing the expanded rows. x (T, K) tokens,
    dst_to_src (M,) -> (M, N)."""
    k, tile = _checks.group_gemm_gather_args(x, w, expert_sizes, dst_to_src, topk, tile_m)
    return _group_gemm(x, w, expert_sizes, dst_to_src, k, tile)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _group_gemm(x, w, expert_sizes, rows, topk: int, tile):
    """group_gemm (rows None) or group_gemm_gather (rows = dst_to_src) on
    checked arguments; tile: a checked tile_m, None for the tuned one.
    Differentiable in x and w (group_gemm_vjp)."""
    return _group_gemm_call(x, w, expert_sizes, rows, topk, tile)


def _group_gemm_fwd(x, w, expert_sizes, rows, topk, tile):
    return _group_gemm_call(x, w, expert_sizes, rows, topk, tile), (x, w, expert_sizes, rows)


def _group_gemm_bwd(topk, tile, res, g):
    x, w, expert_sizes, rows = res
    dx, dw = group_gemm_vjp(x, w, expert_sizes, rows, topk, g)
    return dx, dw, None, None


_group_gemm.defvjp(_group_gemm_fwd, _group_gemm_bwd)


def group_gemm_vjp(x, w, expert_sizes, rows, topk: int, g, src_to_dst=None):
    """The gradients (dx, dw) of group_gemm (rows None) or group_gemm_gather
    for the output cotangent g (M, N), on the kernels: dx by the grouped GEMM
    against w in the other orientation (then, with a gather, summed back into
    the tokens by gather_transpose; src_to_dst: the inverse of rows when the
    caller has it), dw by the k-grouped GEMM (group_gemm_wgrad)."""
    g = g.astype(x.dtype)
    dxs = matmul_kn(g, w, expert_sizes)  # g[rows of e] @ w[e]
    if rows is None:
        dx = dxs
    else:
        dx = gather_transpose(dxs, rows, topk, x.shape[0], src_to_dst)
    return dx, _group_gemm_wgrad(g, x, expert_sizes, rows, topk)


def matmul_kn(x, w, expert_sizes):
    """x (M, K) grouped by expert times w[e] for w (E, K, N) -> (M, N): the
    dgrad's product (against the forward's (E, N, K) weights) and
    ragged_dot's. Where the tuned tile is the sm90 kernel's it reads w as
    stored (w_kn); elsewhere the other kernels run against a transposed copy
    of w, which XLA writes each call."""
    experts, k, n = w.shape
    m = x.shape[0]
    if (m > 0 and tuning.sm90_usable(n, k, x.dtype)
            and tuning.group_gemm_tile_m(m, experts, n, k, x.dtype) == tuning.SM90_TILE):
        return _group_gemm_call(x, w, expert_sizes, None, 1, tuning.SM90_TILE, w_kn=True)
    return _group_gemm_call(x, jnp.swapaxes(w, 1, 2), expert_sizes, None, 1, None)


def _group_gemm_call(x, w, expert_sizes, rows, topk: int, tile, w_kn: bool = False):
    """The jax_moe_group_gemm custom call; w_kn: w is (E, K, N) (sm90 only)."""
    experts, n, k = w.shape
    if w_kn:
        n, k = k, n
    m = x.shape[0] if rows is None else rows.shape[0]
    tile = gemm_tile(m, (experts, n, k), x.dtype, tile)
    gather = rows is not None
    # The Hopper kernels' scratch lives in a second output: an XLA buffer
    # keeps a fixed address in a recorded CUDA graph, where memory from the
    # FFI scratch allocator would be freed when the handler returns. The own
    # kernel's is its tile counter; CUTLASS's, the device-side group arrays,
    # its workspace and (with a gather) the expanded rows. Empty wherever
    # neither will run.
    scratch = 0
    if tile == tuning.SM90_TILE and m > 0 and experts > 0 and tuning.sm90_usable(n, k, x.dtype):
        scratch = (16 if not w_kn and tuning.wgmma_runs(m, experts, n, k, x.dtype)
                   else _ext.group_gemm_sm90_scratch_bytes(m, k, experts, gather))
    call = jax.ffi.ffi_call(
        "jax_moe_group_gemm", (sds((m, n), x.dtype), sds((scratch,), jnp.uint8)),
        vmap_method="sequential")
    rows = index_int32(rows) if gather else jnp.zeros((0,), jnp.int32)
    out, _ = call(x, w, index_int32(expert_sizes), rows, gather=gather,
                  topk=np.int64(topk), tile_m=np.int64(tile), w_kn=w_kn)
    return out
