"""Steps 3-6 in one call: FFI target jax_moe_expert_mlp."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jax_moe import _checks, tuning
from jax_moe.ops._common import gemm_tile, sds
from jax_moe.ops.activation import _activation_call, activation_vjp
from jax_moe.ops.expand import _expand_call, gather_transpose
from jax_moe.ops.group_gemm import _group_gemm_call, group_gemm_vjp
from jax_moe.ops.group_gemm_act import _group_gemm_act_call
from jax_moe._int32 import index_int32


def expert_mlp(x, w13, w2, expert_sizes, dst_to_src, topk: int, *, activation: str = "silu",
               is_gated: bool = True, tile_m: tuple | None = None):
    """Steps 3-6 in one call: group_gemm(act(group_gemm_gather(x, w13,
    expert_sizes, dst_to_src, topk)), w2, expert_sizes), with the same bits as
    those ops (act: gated_activation or activation). x (T, H) tokens, w13
    (E, 2*I, H) (gated) or (E, I, H), w2 (E, H, I), dst_to_src (M,) -> (M, H).

    One call instead of three: on a compute capability 9.0+ GPU the
    activation and w2 kernels are launched with programmatic dependent launch,
    so that each starts while the previous one finishes (under XLA's command
    buffers that only works inside one custom call). tile_m: (w13's, w2's)
    tile_m as in group_gemm, None for the tuned choice; where either is 256
    (the Hopper kernels) the three ops run as separate calls (the first two
    as one kernel, group_gemm_act, where tuning.group_gemm_act_runs holds and
    no gradient is taken: the same bits)."""
    k, tiles = _checks.expert_mlp_args(x, w13, w2, expert_sizes, dst_to_src, topk, activation,
                                       is_gated, tile_m)
    return _expert_mlp(x, w13, w2, expert_sizes, dst_to_src, k, activation, is_gated, tiles)


def _mlp_tiles(m: int, w13, w2, dtype, tiles) -> tuple:
    """(w13's, w2's) tile_m for m rows: the checked pair `tiles`, each None
    resolved by jax_moe.tuning."""
    return gemm_tile(m, w13.shape, dtype, tiles[0]), gemm_tile(m, w2.shape, dtype, tiles[1])


def _expert_mlp(x, w13, w2, expert_sizes, dst_to_src, k: int, activation: str, is_gated: bool,
                tiles=(None, None), remat: bool = False):
    """expert_mlp on checked arguments; tiles: the checked (w13's, w2's)
    tile_m. Differentiable in x, w13 and w2 on the kernels (expert_mlp_vjp);
    remat: the backward recomputes the w13 GEMM instead of keeping its
    output (M, 2I) from the forward."""
    return _expert_mlp_diff(x, w13, w2, expert_sizes, dst_to_src, None, k, activation, is_gated,
                            tuple(tiles), bool(remat))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _expert_mlp_diff(x, w13, w2, expert_sizes, dst_to_src, src_to_dst, k, activation, is_gated,
                     tiles, remat):
    """_expert_mlp with the inverse map src_to_dst (or None) that its
    backward may use."""
    return _expert_mlp_out(x, w13, w2, expert_sizes, dst_to_src, k, activation, is_gated, tiles)


def _keeps_rows(m: int, x, w13, tiles, remat: bool) -> bool:
    """Whether the training forward expands the rows itself and keeps them
    for the w13 weight gradient: where w13's GEMM is the sm90 tile (256).
    CUTLASS's kernel cannot gather rows in its loads and copies them first
    anyway, so the forward does the same work and the backward's weight
    gradient no longer copies them again; the own Hopper kernel
    (tuning.wgmma_runs) reads the kept rows by TMA. Not under remat, which
    keeps memory down instead (the rows are T*k x H)."""
    t1 = gemm_tile(m, w13.shape, x.dtype, tiles[0])
    return (not remat and t1 == tuning.SM90_TILE
            and tuning.sm90_shape_ok(w13.shape[1], w13.shape[2], x.dtype))


def _expert_mlp_fwd(x, w13, w2, expert_sizes, dst_to_src, src_to_dst, k, activation, is_gated,
                    tiles, remat):
    m = dst_to_src.shape[0]
    if _keeps_rows(m, x, w13, tiles, remat):
        # The separate calls of _expert_mlp_call's sm90 branch, on rows expanded here.
        t1, t2 = _mlp_tiles(m, w13, w2, x.dtype, tiles)
        xe = _expand_call(x, dst_to_src, k)
        h = _group_gemm_call(xe, w13, expert_sizes, None, 1, t1)
        a = _activation_call(h, activation, is_gated)
        out = _group_gemm_call(a, w2, expert_sizes, None, 1, t2)
    else:
        xe = None
        out, h = _expert_mlp_call(x, w13, w2, expert_sizes, dst_to_src, k, activation, is_gated,
                                  tiles)
    return out, (x, xe, w13, w2, expert_sizes, dst_to_src, src_to_dst, None if remat else h)


def _expert_mlp_bwd(k, activation, is_gated, tiles, remat, res, g):
    x, xe, w13, w2, expert_sizes, dst_to_src, src_to_dst, h = res
    return expert_mlp_vjp(x, w13, w2, expert_sizes, dst_to_src, src_to_dst, k, activation,
                          is_gated, h, g, xe, tiles[0]) + (None, None, None)


_expert_mlp_diff.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


def expert_mlp_vjp(x, w13, w2, expert_sizes, dst_to_src, src_to_dst, k: int, activation: str,
                   is_gated: bool, h, g, xe=None, tile1=None):
    """(dx, dw13, dw2) of expert_mlp for the output cotangent g (M, H); h: the
    forward's w13 GEMM output, or None to recompute it (with w13's tile_m
    tile1, as the forward); xe: the forward's expanded rows of x
    (moe_expand_input), or None to gather them again. The activation is
    recomputed from h (the same kernel, so the same bits as the forward);
    its backward, and every GEMM, runs on the kernels."""
    if h is None:
        h = recompute_h(x, w13, expert_sizes, dst_to_src, k, tile1)
    a = _activation_call(h, activation, is_gated)
    da, dw2 = group_gemm_vjp(a, w2, expert_sizes, None, 1, g)
    dh = activation_vjp(h, da, activation, is_gated)
    dx, dw13 = w13_vjp(x, w13, expert_sizes, dst_to_src, src_to_dst, k, dh, xe)
    return dx, dw13, dw2


def recompute_h(x, w13, expert_sizes, dst_to_src, k: int, tile1):
    """The forward's w13 GEMM output again (remat), with its tile_m tile1."""
    return _group_gemm_call(x, w13, expert_sizes, dst_to_src, k, tile1)


def w13_vjp(x, w13, expert_sizes, dst_to_src, src_to_dst, k: int, dh, xe=None):
    """(dx, dw13) of the gathering w13 GEMM for its output cotangent dh:
    on the kept expanded rows xe where the forward kept them (the weight
    gradient then gathers nothing), else on x through dst_to_src."""
    if xe is None:
        return group_gemm_vjp(x, w13, expert_sizes, dst_to_src, k, dh, src_to_dst)
    dxe, dw13 = group_gemm_vjp(xe, w13, expert_sizes, None, 1, dh)
    return gather_transpose(dxe, dst_to_src, k, x.shape[0], src_to_dst), dw13


def _expert_mlp_out(x, w13, w2, expert_sizes, dst_to_src, k: int, activation: str,
                    is_gated: bool, tiles=(None, None)):
    """The forward's output (M, H) alone, where nothing keeps h: where w13's
    GEMM is the sm90 tile and group_gemm_act runs (tuning.group_gemm_act_runs,
    gated), the w13 GEMM and the activation are one kernel that never writes
    h, with the same bits; else _expert_mlp_call."""
    m = dst_to_src.shape[0]
    t1, t2 = _mlp_tiles(m, w13, w2, x.dtype, tiles)
    experts, n1, hidden = w13.shape
    if is_gated and t1 == tuning.SM90_TILE and tuning.group_gemm_act_runs(m, experts, n1, hidden,
                                                                          x.dtype):
        a = _group_gemm_act_call(x, w13, expert_sizes, dst_to_src, k, activation)
        return _group_gemm_call(a, w2, expert_sizes, None, 1, t2)
    return _expert_mlp_call(x, w13, w2, expert_sizes, dst_to_src, k, activation, is_gated,
                            tiles)[0]


def _expert_mlp_call(x, w13, w2, expert_sizes, dst_to_src, k: int, activation: str,
                     is_gated: bool, tiles=(None, None)):
    """The forward: (out (M, H), h (M, 2I) the w13 GEMM's output)."""
    hidden = w13.shape[2]
    n1, inter = w13.shape[1], w2.shape[2]
    m = dst_to_src.shape[0]
    t1, t2 = _mlp_tiles(m, w13, w2, x.dtype, tiles)
    if tuning.SM90_TILE in (t1, t2):
        h = _group_gemm_call(x, w13, expert_sizes, dst_to_src, k, t1)
        a = _activation_call(h, activation, is_gated)
        return _group_gemm_call(a, w2, expert_sizes, None, 1, t2), h
    call = jax.ffi.ffi_call(
        "jax_moe_expert_mlp",
        (sds((m, hidden), x.dtype), sds((m, n1), x.dtype), sds((m, inter), x.dtype)),
        vmap_method="sequential")
    out, h, _ = call(x, w13, w2, index_int32(expert_sizes), index_int32(dst_to_src),
                     topk=np.int64(k), activation=np.int64(_checks.ACTIVATIONS[activation]),
                     gated=bool(is_gated), tile_m1=np.int64(t1), tile_m2=np.int64(t2))
    return out, h
