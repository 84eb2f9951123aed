"""The seven MoE steps as XLA FFI custom calls (CPU and CUDA handlers).

Each function validates shapes and dtypes at trace time, then calls one FFI
target. Row-wise ops (router, activation) batch under ``jax.vmap`` by handing
the kernel extra leading dimensions; ops whose semantics span the whole batch
(index, expand, GEMM, combine) batch sequentially.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks, tuning
from jax_moe._ffi import INDEX_CHUNK, _ext

__all__ = [
    "route",
    "topk_softmax",
    "moe_compute_token_index",
    "moe_expand_input",
    "group_gemm",
    "group_gemm_gather",
    "expert_mlp",
    "gated_activation",
    "activation",
    "silu_and_mul",
    "gelu_and_mul",
    "moe_combine",
    "moe_layer",
    "moe_decode",
    "moe_decode_supported",
]


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype))


def topk_softmax(router_logits, topk: int, renormalize: bool = True):
    """Step 1 as in the original pipeline: route() with softmax scoring.

    router_logits (T, E) float -> (weights (T, k) float32, ids (T, k) int32).
    """
    return route(router_logits, topk, renormalize=renormalize)


_SCORING = {"softmax": 0, "sigmoid": 1}


def _bias_arg(e_score_correction_bias, experts: int):
    """(has_bias, the router kernel's f32 bias operand: zeros when there is none)."""
    if e_score_correction_bias is None:
        return False, jnp.zeros((experts,), jnp.float32)
    return True, jnp.asarray(e_score_correction_bias).astype(jnp.float32)


def route(router_logits, topk: int, *, scoring_func: str = "softmax", renormalize: bool = True,
          num_expert_group: int | None = None, topk_group: int | None = None,
          e_score_correction_bias=None, routed_scaling_factor: float = 1.0):
    """Step 1, general form (Qwen2/3-MoE, Mixtral, DeepSeek-V3 routing); the
    semantics of ``reference.route``, in one FFI call.

    router_logits (T, E) float -> (weights (T, k) float32, ids (T, k) int32).
    """
    k, groups, tg, scale = _checks.route_args(
        router_logits, topk, scoring_func, num_expert_group, topk_group,
        e_score_correction_bias, routed_scaling_factor)
    tokens, experts = router_logits.shape
    has_bias, bias = _bias_arg(e_score_correction_bias, experts)
    # broadcast_all hands the kernel logits (..., T, E) and bias (..., E) with
    # the same batch dims (an unbatched bias is broadcast): one bias row per
    # batch element.
    call = jax.ffi.ffi_call(
        "jax_moe_route",
        (_sds((tokens, k), jnp.float32), _sds((tokens, k), jnp.int32)),
        vmap_method="broadcast_all",
    )
    return call(router_logits, bias, renormalize=bool(renormalize),
                scoring=np.int64(_SCORING[scoring_func]), num_expert_group=np.int64(groups),
                topk_group=np.int64(tg), has_bias=bool(has_bias),
                routed_scaling_factor=np.float32(scale))


def moe_compute_token_index(topk_ids, num_experts: int, *, start_expert: int = 0,
                            num_local_experts: int | None = None):
    """Step 2: histogram, exclusive prefix sum, stable placement.

    topk_ids (T, k) int -> src_to_dst (T*k,), dst_to_src (T*k,), expert_sizes
    (num_local_experts,), all int32. Only ids in [start_expert, start_expert +
    num_local_experts) are placed (expert parallelism): the others get
    src_to_dst = -1, and dst_to_src is -1 past the last placed row. Within an
    expert, rows keep ascending flat index t*k + j.
    """
    num_experts, start, local = _checks.token_index_args(
        topk_ids, num_experts, start_expert, num_local_experts)
    n = int(np.prod(topk_ids.shape))
    chunks = -(-n // INDEX_CHUNK)
    call = jax.ffi.ffi_call(
        "jax_moe_token_index",
        (_sds((n,), jnp.int32), _sds((n,), jnp.int32), _sds((local,), jnp.int32),
         _sds((chunks * local + 1,), jnp.int32)),  # scratch for the CUDA kernels
        vmap_method="sequential",
    )
    src_to_dst, dst_to_src, sizes, _ = call(
        topk_ids.astype(jnp.int32), num_experts=np.int64(num_experts),
        start_expert=np.int64(start))
    return src_to_dst, dst_to_src, sizes


def moe_expand_input(x, dst_to_src, topk: int):
    """Step 3: row i of the result is x[dst_to_src[i] // topk] (zero where
    dst_to_src[i] is -1). x (T, H) -> (len(dst_to_src), H)."""
    k = _checks.expand_args(x, dst_to_src, topk)
    call = jax.ffi.ffi_call(
        "jax_moe_expand", _sds((dst_to_src.shape[0], x.shape[1]), x.dtype),
        vmap_method="sequential")
    return call(x, dst_to_src.astype(jnp.int32), topk=np.int64(k))


def _group_gemm_call(x, w, expert_sizes, rows, topk, tile_m, m):
    experts, n, k = w.shape
    tile = tuning.group_gemm_tile_m(m, experts, n, k, x.dtype, tile_m)
    gather = rows is not None
    # The sm90 kernel's device-side group arrays, CUTLASS workspace and (with
    # a gather) expanded rows live in a second output: an XLA buffer keeps a
    # fixed address in a recorded CUDA graph, where memory from the FFI
    # scratch allocator would be freed when the handler returns. Empty
    # wherever that kernel will not run.
    scratch = (_ext.group_gemm_sm90_scratch_bytes(m, k, experts, gather)
               if tile == tuning.SM90_TILE and m > 0 and experts > 0
               and tuning.sm90_usable(n, k, x.dtype) else 0)
    call = jax.ffi.ffi_call(
        "jax_moe_group_gemm", (_sds((m, n), x.dtype), _sds((scratch,), jnp.uint8)),
        vmap_method="sequential")
    rows = rows.astype(jnp.int32) if gather else jnp.zeros((0,), jnp.int32)
    out, _ = call(x, w, expert_sizes.astype(jnp.int32), rows, gather=gather,
                  topk=np.int64(topk), tile_m=np.int64(tile))
    return out


def group_gemm(x, w, expert_sizes, *, tile_m: int | None = None):
    """Steps 4 and 6: rows of x grouped by expert in order; out[rows of e] =
    x[rows of e] @ w[e].T with f32 accumulation. x (M, K), w (E, N, K),
    expert_sizes (E,) -> (M, N) in x's dtype; rows past sum(expert_sizes) are 0.

    tile_m (CUDA only; None = the tuning table's or the heuristic's choice, see
    jax_moe.tuning): rows per tile, 8 (the decode kernel), 16 (the TMA decode
    kernel on compute capability 9.0+ GPUs for bf16/f16 with K a multiple of
    8 and launches of at least 6 tiles per SM (1.5 from K = 8192), else 8),
    32, 64 or 128 (the mma.sync tile kernel), or 256: the CUTLASS sm90 kernel
    on compute capability 9.0 GPUs for bf16/f16 with N and K multiples of 8,
    else 128."""
    _checks.group_gemm_args(x, w, expert_sizes)
    return _group_gemm_call(x, w, expert_sizes, None, 1, tile_m, x.shape[0])


def group_gemm_gather(x, w, expert_sizes, dst_to_src, topk: int, *, tile_m: int | None = None):
    """Steps 3 and 4 in one kernel: group_gemm(moe_expand_input(x, dst_to_src,
    topk), w, expert_sizes) without writing the expanded rows. x (T, K) tokens,
    dst_to_src (M,) -> (M, N)."""
    k = _checks.expand_args(x, dst_to_src, topk)
    _checks.group_gemm_args(x, w, expert_sizes)
    return _group_gemm_call(x, w, expert_sizes, dst_to_src, k, tile_m, dst_to_src.shape[0])


def _mlp_tiles(m, w13, w2, dtype, tile_m):
    """(w13's, w2's) tile_m for m rows: tile_m checked, None resolved by jax_moe.tuning."""
    t1, t2 = _checks.tile_pair(tile_m)
    experts, n1, hidden = w13.shape
    return (tuning.group_gemm_tile_m(m, experts, n1, hidden, dtype, t1),
            tuning.group_gemm_tile_m(m, experts, hidden, w2.shape[2], dtype, t2))


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
    (the CUTLASS kernel) the three ops run as separate calls."""
    k, code = _checks.expert_mlp_args(x, w13, w2, expert_sizes, dst_to_src, topk, activation,
                                      is_gated)
    experts, n1, hidden = w13.shape
    inter = w2.shape[2]
    m = dst_to_src.shape[0]
    t1, t2 = _mlp_tiles(m, w13, w2, x.dtype, tile_m)
    if tuning.SM90_TILE in (t1, t2):
        h = _group_gemm_call(x, w13, expert_sizes, dst_to_src, k, t1, m)
        a = _activation_call(h, activation, is_gated)
        return _group_gemm_call(a, w2, expert_sizes, None, 1, t2, m)
    call = jax.ffi.ffi_call(
        "jax_moe_expert_mlp",
        (_sds((m, hidden), x.dtype), _sds((m, n1), x.dtype), _sds((m, inter), x.dtype)),
        vmap_method="sequential")
    out, _, _ = call(x, w13, w2, expert_sizes.astype(jnp.int32), dst_to_src.astype(jnp.int32),
                     topk=np.int64(k), activation=np.int64(code), gated=bool(is_gated),
                     tile_m1=np.int64(t1), tile_m2=np.int64(t2))
    return out


def _activation_call(h, name: str, gated: bool):
    code = _checks.activation_args(h, name, gated)
    width = h.shape[-1] // 2 if gated else h.shape[-1]
    call = jax.ffi.ffi_call(
        "jax_moe_activation", _sds(h.shape[:-1] + (width,), h.dtype),
        vmap_method="broadcast_all")
    return call(h, activation=np.int64(code), gated=bool(gated))


def gated_activation(h, activation: str = "silu"):
    """Step 5: act(h[..., :I]) * h[..., I:], computed in f32, in h's dtype.
    activation: "silu", "gelu" (exact, erf) or "gelu_tanh"."""
    return _activation_call(h, activation, gated=True)


def activation(h, activation: str = "silu"):
    """Step 5 for non-gated experts: act(h) elementwise, in f32, in h's dtype."""
    return _activation_call(h, activation, gated=False)


def silu_and_mul(h):
    """silu(h[..., :I]) * h[..., I:]."""
    return gated_activation(h, "silu")


def gelu_and_mul(h, approximate: bool = False):
    """gelu(h[..., :I]) * h[..., I:]; approximate=True uses the tanh form."""
    return gated_activation(h, "gelu_tanh" if approximate else "gelu")


def moe_combine(y, topk_weights, src_to_dst):
    """Step 7: out[t] = sum_j w[t, j] * y[src_to_dst[t*k + j]], accumulated in
    f32 in j order (bitwise reproducible); entries with src_to_dst = -1 count
    as zero. y (M, H), topk_weights (T, k) -> (T, H) in y's dtype."""
    _checks.combine_args(y, topk_weights, src_to_dst)
    tokens = topk_weights.shape[0]
    call = jax.ffi.ffi_call(
        "jax_moe_combine", _sds((tokens, y.shape[1]), y.dtype), vmap_method="sequential")
    return call(y, topk_weights.astype(jnp.float32), src_to_dst.astype(jnp.int32))


def moe_layer(hidden_states, router_logits, w13, w2, topk: int, *, scoring_func: str = "softmax",
              renormalize: bool = True, num_expert_group: int | None = None,
              topk_group: int | None = None, e_score_correction_bias=None,
              routed_scaling_factor: float = 1.0, activation: str = "silu",
              is_gated: bool = True, tile_m: tuple | None = None):
    """Steps 1-7 in one call, with the same bits as the ops one by one:
    route, moe_compute_token_index, expert_mlp, moe_combine. hidden_states
    (T, H), router_logits (T, E), w13 (E, 2*I, H) (or (E, I, H) with
    is_gated=False), w2 (E, H, I) -> (T, H) in hidden_states' dtype. The
    routing keywords are route's, activation / is_gated / tile_m expert_mlp's.

    One call instead of four: on a compute capability 9.0+ GPU every kernel
    after the router starts while the one before it finishes (programmatic
    dependent launch, which under XLA's command buffers only works inside one
    custom call). Where either GEMM's tile is the CUTLASS kernel's (256), the
    ops run as separate calls, as in expert_mlp."""
    k = _checks.layer_args(hidden_states, router_logits, w13, w2, topk, is_gated=is_gated)
    _, groups, tg, scale = _checks.route_args(
        router_logits, k, scoring_func, num_expert_group, topk_group,
        e_score_correction_bias, routed_scaling_factor)
    code = _checks.activation(activation)
    x = hidden_states
    tokens, hidden = x.shape
    experts, n1, _ = w13.shape
    inter = w2.shape[2]
    m = tokens * k
    t1, t2 = _mlp_tiles(m, w13, w2, x.dtype, tile_m)
    if tuning.SM90_TILE in (t1, t2):
        weights, ids = route(router_logits, k, scoring_func=scoring_func, renormalize=renormalize,
                             num_expert_group=num_expert_group, topk_group=topk_group,
                             e_score_correction_bias=e_score_correction_bias,
                             routed_scaling_factor=routed_scaling_factor)
        src_to_dst, dst_to_src, sizes = moe_compute_token_index(ids, experts)
        y = expert_mlp(x, w13, w2, sizes, dst_to_src, k, activation=activation,
                       is_gated=is_gated, tile_m=(t1, t2))
        return moe_combine(y, weights, src_to_dst)
    has_bias, bias = _bias_arg(e_score_correction_bias, experts)
    chunks = -(-m // INDEX_CHUNK)
    i32 = jnp.int32
    call = jax.ffi.ffi_call(
        "jax_moe_moe_layer",
        (_sds((tokens, hidden), x.dtype),
         # scratch: the steps' outputs, as the separate ops return them
         _sds((tokens, k), jnp.float32), _sds((tokens, k), i32), _sds((m,), i32),
         _sds((m,), i32), _sds((experts,), i32), _sds((chunks * experts + 1,), i32),
         _sds((m, hidden), x.dtype), _sds((m, n1), x.dtype), _sds((m, inter), x.dtype)),
        vmap_method="sequential")
    outs = call(x, router_logits, bias, w13, w2, renormalize=bool(renormalize),
                scoring=np.int64(_SCORING[scoring_func]), num_expert_group=np.int64(groups),
                topk_group=np.int64(tg), has_bias=bool(has_bias),
                routed_scaling_factor=np.float32(scale), activation=np.int64(code),
                gated=bool(is_gated), tile_m1=np.int64(t1), tile_m2=np.int64(t2))
    return outs[0]


def moe_decode_supported(hidden_states, router_logits, w13, w2, topk: int) -> bool:
    """Whether moe_decode takes this layer (its kernel's limits; the
    arguments themselves are checked by moe_decode)."""
    k = _checks.layer_args(hidden_states, router_logits, w13, w2, topk)
    return _checks.decode_limits(hidden_states, w13, w2, k) is None


def moe_decode(hidden_states, router_logits, w13, w2, topk: int, *, renormalize: bool = True,
               routed_scaling_factor: float = 1.0):
    """The routed layer for ONE token in one kernel: softmax top-k routing,
    w13, SiLU-and-mul, w2 and the weighted combine. hidden_states (1, H)
    bfloat16 or float16, router_logits (1, E) float, w13 (E, 2*I, H), w2
    (E, H, I) -> (1, H). Limits: H and I multiples of 256, H <= 2048,
    I <= 1024, topk <= 8, E <= 1024 (``moe_decode_supported``).

    The rounding points are moe_layer's (h, the activation and each expert's
    output in the input dtype, f32 sums) but the sums run in another order,
    so the bits may differ from moe_layer's; the result is the same bits run
    to run. On the GPU one block per SM streams the chosen experts' w13 rows
    while its w2 rows load into shared memory, then a grid-wide barrier
    (cooperative launch) and w2 + combine (csrc/cuda/moe_decode.cu).
    moe_forward uses it on the GPU wherever it applies."""
    k = _checks.layer_args(hidden_states, router_logits, w13, w2, topk)
    _, _, _, scale = _checks.route_args(router_logits, k, "softmax", None, None, None,
                                        routed_scaling_factor)
    why = _checks.decode_limits(hidden_states, w13, w2, k)
    if why is not None:
        raise ValueError(why)
    hidden, inter = hidden_states.shape[1], w2.shape[2]
    call = jax.ffi.ffi_call(
        "jax_moe_moe_decode",
        (_sds((1, hidden), hidden_states.dtype), _sds((k, inter), jnp.float32)),  # out, act scratch
        vmap_method="sequential")
    out, _ = call(hidden_states, router_logits, w13, w2, topk=np.int64(k),
                  renormalize=bool(renormalize), routed_scaling_factor=np.float32(scale))
    return out
