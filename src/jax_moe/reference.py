"""The MoE steps and the whole layer in plain jax.numpy / jax.lax.

The test oracle for every kernel, and a fallback users can pick with
``moe_forward(..., backend="reference")``. Signatures and semantics match
``jax_moe.ops`` exactly (same validation, same -1 conventions).

As in jax_moe.ops, each public twin checks its arguments once (jax_moe._checks)
and calls its unchecked twin (``_route``, ``_token_index``, ...); the layer
twins compose the unchecked twins.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _checks, fp8
from jax_moe._int32 import index_int32, owned_rows

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
    "group_gemm_wgrad",
    "group_gemm_fp8",
]


def route(router_logits, topk: int, *, scoring_func: str = "softmax", renormalize: bool = True,
          num_expert_group: int | None = None, topk_group: int | None = None,
          e_score_correction_bias=None, routed_scaling_factor: float = 1.0):
    """Step 1, general form: the routing of Qwen2/3-MoE, Mixtral, DeepSeek-V3.

    scores = softmax or sigmoid of the f32 logits. Experts are chosen on
    scores + e_score_correction_bias (the bias chooses, never weights); with
    num_expert_group / topk_group only the topk_group groups with the highest
    group score (sum of the group's top-2 choice scores) are eligible. Weights
    are the chosen experts' scores, renormalised to sum 1 if asked, times
    routed_scaling_factor. Ties go to the lower expert id. Without bias or
    groups the choice is made on the logits themselves (the same order,
    exactly). -> (weights (T, k) float32, ids (T, k) int32).
    """
    routing = _checks.route_args(
        router_logits, topk, scoring_func=scoring_func, renormalize=renormalize,
        num_expert_group=num_expert_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)
    return _route(router_logits, e_score_correction_bias, routing)


def topk_softmax(router_logits, topk: int, renormalize: bool = True):
    """Step 1 with softmax scoring: route(router_logits, topk, renormalize=renormalize)."""
    return _route(router_logits, None, _checks.route_args(router_logits, topk,
                                                          renormalize=renormalize))


def moe_compute_token_index(topk_ids, num_experts: int, *, start_expert: int = 0,
                            num_local_experts: int | None = None):
    num_experts, start, local = _checks.token_index_args(
        topk_ids, num_experts, start_expert, num_local_experts)
    return _token_index(topk_ids, num_experts, start, local)


def moe_expand_input(x, dst_to_src, topk: int):
    return _expand(x, dst_to_src, _checks.expand_args(x, dst_to_src, topk))


def group_gemm(x, w, expert_sizes, *, tile_m: int | None = None):
    """jax.lax.ragged_dot, accumulating in f32 (the pure-JAX grouped GEMM).
    tile_m is accepted for signature parity with ops and checked, not used.
    A NaN or inf weight of one expert may reach every row here (XLA may
    compute ragged_dot densely, and 0 * NaN is NaN), not only that expert's
    rows as in ops.group_gemm."""
    _checks.group_gemm_args(x, w, expert_sizes, tile_m)
    return _group_gemm(x, w, expert_sizes)


def group_gemm_fp8(x, w, w_scale, expert_sizes, *, dst_to_src=None, topk: int = 1,
                   tile_m: int | None = None):
    """group_gemm with block-scaled fp8 weights, the DeepSeek-V3 recipe: w
    (E, N, K) float8_e4m3fn with one f32 scale per 128 x 128 block, w_scale
    (E, ceil(N/128), ceil(K/128)) (dequantised weight = value x scale); each
    row of x (M, K) quantised to e4m3 per 128 channels (jax_moe.fp8.
    quantize_rows); f32 accumulation with both scales applied per K block
    -> (M, N) in x's dtype. Rows are owned as in group_gemm. With dst_to_src
    (M,), x holds the tokens (T, K) and its rows are moe_expand_input's
    (steps 3 and 4). tile_m is accepted for signature parity with ops and
    checked, not used. Differentiable in x by the kernels' rule (this GEMM
    of the output cotangent on w and w_scale transposed, fp8.transpose_blocks),
    not in w or w_scale (TypeError: fp8.FROZEN_WEIGHTS)."""
    k, _ = _checks.group_gemm_fp8_args(x, w, w_scale, expert_sizes, tile_m, dst_to_src, topk)
    return _group_gemm_fp8(x, w, w_scale, expert_sizes, dst_to_src, k)


def group_gemm_gather(x, w, expert_sizes, dst_to_src, topk: int, *, tile_m: int | None = None):
    """Steps 3 and 4: group_gemm of the expanded rows of x."""
    k, _ = _checks.group_gemm_gather_args(x, w, expert_sizes, dst_to_src, topk, tile_m)
    return _group_gemm(_expand(x, dst_to_src, k), w, expert_sizes)


def expert_mlp(x, w13, w2, expert_sizes, dst_to_src, topk: int, *, activation: str = "silu",
               is_gated: bool = True, tile_m: tuple | None = None):
    """Steps 3-6: the w13 GEMM of the expanded rows, the activation, the w2 GEMM."""
    k, tiles = _checks.expert_mlp_args(x, w13, w2, expert_sizes, dst_to_src, topk, activation,
                                       is_gated, tile_m)
    return _expert_mlp(x, w13, w2, expert_sizes, dst_to_src, k, activation, is_gated, tiles)


def gated_activation(h, activation: str = "silu"):
    _checks.activation_args(h, activation, gated=True)
    return _activation(h, activation, True)


def activation(h, activation: str = "silu"):
    _checks.activation_args(h, activation, gated=False)
    return _activation(h, activation, False)


def silu_and_mul(h):
    _checks.activation_args(h, "silu", gated=True)
    return _activation(h, "silu", True)


def gelu_and_mul(h, approximate: bool = False):
    name = _checks.gelu_and_mul_args(h, approximate)
    return _activation(h, name, True)


def moe_combine(y, topk_weights, src_to_dst):
    _checks.combine_args(y, topk_weights, src_to_dst)
    return _combine(y, topk_weights, src_to_dst)


def moe_layer(hidden_states, router_logits, w13, w2, topk: int, *, scoring_func: str = "softmax",
              renormalize: bool = True, num_expert_group: int | None = None,
              topk_group: int | None = None, e_score_correction_bias=None,
              routed_scaling_factor: float = 1.0, activation: str = "silu",
              is_gated: bool = True, tile_m: tuple | None = None):
    """Steps 1-7: route, token index, expert_mlp, combine (tile_m is checked, not used)."""
    spec = _checks.moe_layer_args(
        hidden_states, router_logits, w13, w2, topk, scoring_func=scoring_func,
        renormalize=renormalize, num_expert_group=num_expert_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor, activation_name=activation,
        is_gated=is_gated, tile=tile_m)
    return _moe_layer(hidden_states, router_logits, w13, w2, e_score_correction_bias, spec)


def moe_decode(hidden_states, router_logits, w13, w2, topk: int, *, renormalize: bool = True,
               routed_scaling_factor: float = 1.0):
    """ops.moe_decode's twin: moe_layer with softmax routing and SiLU, for
    one token, with moe_decode's limits."""
    routing = _checks.moe_decode_args(hidden_states, router_logits, w13, w2, topk,
                                      renormalize=renormalize,
                                      routed_scaling_factor=routed_scaling_factor)
    return _moe_decode(hidden_states, router_logits, w13, w2, routing)


def group_gemm_wgrad(dy, x, expert_sizes, *, dst_to_src=None, topk: int = 1):
    """The weight gradient of group_gemm / group_gemm_gather: dw[e] =
    dy[rows of e].T @ x[rows of e] (x's rows gathered through dst_to_src when
    given), f32 accumulation, exactly zero for experts without rows."""
    k = _checks.group_gemm_wgrad_args(dy, x, expert_sizes, dst_to_src, topk)
    return _group_gemm_wgrad(dy, x, expert_sizes, dst_to_src, k)


# ---- the unchecked twins: checked arguments, normalised static values ------------

def _route(router_logits, e_score_correction_bias, r: _checks.Routing):
    tokens, experts = router_logits.shape
    groups = r.num_expert_group
    logits = _finite_or_minus_inf(router_logits)
    scores = _scores(logits, r)
    if e_score_correction_bias is None and groups == 1:
        choice = logits
    else:
        choice = scores
        if e_score_correction_bias is not None:
            choice = choice + e_score_correction_bias.astype(jnp.float32)
    key = _order_key(choice)
    if groups > 1:
        per = experts // groups
        grouped = choice.reshape(tokens, groups, per)
        best = jax.lax.top_k(key.reshape(tokens, groups, per), min(2, per))[1]
        group_score = jnp.sum(jnp.take_along_axis(grouped, best, axis=-1), axis=-1)
        _, chosen = jax.lax.top_k(_order_key(group_score), r.topk_group)
        keep = jnp.sum(jax.nn.one_hot(chosen, groups, dtype=jnp.int32), axis=1) > 0
        # Experts of the other groups rank as -inf (as in the kernels: above
        # a NaN choice value of a kept group).
        key = jnp.where(jnp.repeat(keep, per, axis=1), key, _order_key(jnp.float32(-jnp.inf)))
    _, ids = jax.lax.top_k(key, r.topk)
    return _chosen_weights(scores, ids, r), ids.astype(jnp.int32)


def _order_key(v):
    """The kernels' int32 order key of f32 values: -inf < ... < -0 < +0 < ...
    < +inf, and every NaN (a NaN correction bias makes one) below -inf, so a
    NaN is never preferred; top_k over the keys takes the lower expert id
    among equals, as the kernels do."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    bits = jnp.where(jnp.isnan(v), jnp.int32(-0x400000), bits)  # 0xffc00000: -NaN
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _finite_or_minus_inf(router_logits):
    """The logits in f32 with NaN as -inf (as the kernels: NaN never wins)."""
    logits = router_logits.astype(jnp.float32)
    return jnp.where(jnp.isnan(logits), -jnp.inf, logits)


def _scores(logits, r: _checks.Routing):
    """The router's f32 scores of the f32 logits (NaN already -inf)."""
    return jax.nn.softmax(logits, axis=-1) if r.scoring_func == "softmax" else jax.nn.sigmoid(logits)


def _chosen_weights(scores, ids, r: _checks.Routing):
    """The top-k weights of the chosen experts `ids`: their scores,
    renormalised if asked, times routed_scaling_factor."""
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if r.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if r.routed_scaling_factor != 1.0:
        weights = weights * jnp.float32(r.routed_scaling_factor)
    return weights


def _route_weights(router_logits, ids, r: _checks.Routing):
    """The top-k weights as a function of the logits for a fixed choice of
    experts: what the router's gradient flows through (the choice itself,
    and so the correction bias and the groups, get none)."""
    return _chosen_weights(_scores(_finite_or_minus_inf(router_logits), r), ids, r)


def _token_index(topk_ids, num_experts: int, start: int, local: int):
    flat = index_int32(topk_ids.reshape(-1)) - start
    n = flat.shape[0]
    valid = (flat >= 0) & (flat < local)
    key = jnp.where(valid, flat, local)  # unplaced entries sort last
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((local,), jnp.int32).at[jnp.where(valid, flat, local)].add(1, mode="drop")
    total = jnp.sum(sizes)
    pos = jnp.arange(n, dtype=jnp.int32)
    dst_to_src = jnp.where(pos < total, order, -1)
    src_to_dst = jnp.zeros((n,), jnp.int32).at[order].set(pos)
    src_to_dst = jnp.where(valid, src_to_dst, -1)
    return src_to_dst, dst_to_src, sizes


def _expand(x, dst_to_src, k: int):
    if x.shape[0] == 0:  # no tokens: every row is a zero row (nothing to gather from)
        return jnp.zeros((dst_to_src.shape[0], x.shape[1]), x.dtype)
    valid = (dst_to_src >= 0) & (dst_to_src < x.shape[0] * k)
    rows = x[jnp.where(valid, dst_to_src, 0) // k]
    return jnp.where(valid[:, None], rows, jnp.zeros_like(rows))


def _group_gemm(x, w, expert_sizes):
    sizes = owned_rows(expert_sizes, x.shape[0])
    # f32 in full precision: on GPUs XLA's default would round f32 operands
    # (TF32-like passes), and the twin is the kernels' yardstick.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), sizes, precision=precision,
                             preferred_element_type=jnp.float32)
    # ragged_dot leaves rows past the last group undefined on some backends.
    rows = jnp.arange(x.shape[0])
    out = jnp.where((rows < jnp.sum(sizes))[:, None], out, 0.0)
    return out.astype(x.dtype)


def _group_gemm_fp8(x, w, w_scale, expert_sizes, rows=None, topk: int = 1,
                    activation: str | None = None, gated: bool = True):
    """rows: dst_to_src (x: the tokens) or None; activation: step 5 on x
    first (the FFI steps' fused form). Differentiable in x as the kernels'
    (ops.group_gemm_fp8); the expansion's transpose by autodiff."""
    if rows is not None:
        x = _expand(x, rows, topk)
    if activation is not None:
        x = _activation(x, activation, gated)
    return _fp8_rows(x, w, w_scale, expert_sizes)


@jax.custom_vjp
def _fp8_rows(x, w, w_scale, expert_sizes):
    # The per-block sums sx * sw * sum(xq * wq) equal sum((xq sx) (wq sw)):
    # each product of two e4m3 values is exact in f32, so the twin runs the
    # f32 grouped GEMM on both operands dequantised. The barriers keep x and
    # the output rounded to their dtype, as the kernels' are: under jit on
    # GPUs XLA may fold a rounding to bf16 and back into nothing (its excess
    # precision), and an unrounded input can flip an e4m3 rounding (2^-4).
    x = jax.lax.optimization_barrier(x)
    xq = fp8.dequantize_rows(*fp8.quantize_rows(x))
    wq = fp8.dequantize_blocks(w, w_scale)
    return jax.lax.optimization_barrier(_group_gemm(xq, wq, expert_sizes).astype(x.dtype))


def _fp8_rows_fwd(x, w, w_scale, expert_sizes):
    fp8.refuse_weight_gradients(w, w_scale)
    args = (x.value, w.value, w_scale.value, expert_sizes.value)
    return _fp8_rows(*args), args[1:]


def _fp8_rows_bwd(res, g):
    # The kernels' rule: this GEMM of the cotangent on the transposed weights.
    w, w_scale, expert_sizes = res
    return (_fp8_rows(fp8.dense_cotangent(g), *fp8.transpose_blocks(w, w_scale), expert_sizes),
            None, None, None)


_fp8_rows.defvjp(_fp8_rows_fwd, _fp8_rows_bwd, symbolic_zeros=True)


def _expert_mlp(x, w13, w2, expert_sizes, dst_to_src, k: int, activation: str, is_gated: bool,
                tiles=(None, None), remat: bool = False):
    """tiles and remat: accepted for parity with ops, not used (autodiff of
    plain jax.numpy keeps what XLA decides)."""
    h = _group_gemm(_expand(x, dst_to_src, k), w13, expert_sizes)
    return _group_gemm(_activation(h, activation, is_gated), w2, expert_sizes)


def _act(g, activation: str):
    if activation == "silu":
        return jax.nn.silu(g)
    if activation == "gelu":
        return jax.nn.gelu(g, approximate=False)
    return jax.nn.gelu(g, approximate=True)


def _routed_experts(x, w13, w2, topk_weights, expert_sizes, dst_to_src, src_to_dst, k: int,
                    activation: str, is_gated: bool, tiles=(None, None), remat: bool = False):
    """Steps 3-7: the combine of expert_mlp's rows (tiles and remat as there)."""
    y = _expert_mlp(x, w13, w2, expert_sizes, dst_to_src, k, activation, is_gated)
    return _combine(y, topk_weights, src_to_dst, dst_to_src)


def _activation(h, activation: str, gated: bool):
    """gated_activation (gated) or activation: computed in f32, in h's dtype."""
    return _act_f32(h.astype(jnp.float32), activation, gated).astype(h.dtype)


def _activation_scaled_grad(h, d, scale, activation: str, gated: bool):
    """ops.activation.activation_scaled_vjp's twin: (dh for the cotangent
    scale[r] * d[r], scale[r] * act(h[r]), dot[r] = <act(h[r]) in h's dtype,
    d[r]> in f32)."""
    hf, df = h.astype(jnp.float32), d.astype(jnp.float32)
    sf = scale.astype(jnp.float32)[..., None]
    a, vjp = jax.vjp(lambda v: _act_f32(v, activation, gated), hf)
    dh = vjp(sf * df)[0].astype(h.dtype)
    dot = jnp.sum(a.astype(h.dtype).astype(jnp.float32) * df, axis=-1)
    return dh, (sf * a).astype(h.dtype), dot


def _act_f32(hf, activation: str, gated: bool):
    """The activation of f32 rows, in f32 (unrounded)."""
    if not gated:
        return _act(hf, activation)
    inter = hf.shape[-1] // 2
    return _act(hf[..., :inter], activation) * hf[..., inter:]


def _combine(y, topk_weights, src_to_dst, dst_to_src=None):
    """dst_to_src: accepted for parity with ops (its backward's hint), not used."""
    tokens, k = topk_weights.shape
    valid = (src_to_dst >= 0) & (src_to_dst < y.shape[0])
    rows = y[jnp.where(valid, src_to_dst, 0)].astype(jnp.float32).reshape(tokens, k, y.shape[1])
    w = jnp.where(valid.reshape(tokens, k), topk_weights.astype(jnp.float32), 0.0)
    return jnp.sum(rows * w[..., None], axis=1).astype(y.dtype)


def _combine_bwd(g, y, topk_weights, src_to_dst, dst_to_src):
    """The combine's backward (ops.combine._combine_bwd's twin): dy[r] =
    w[i] * g[i // k] for i = dst_to_src[r] when 0 <= i < T*k and
    src_to_dst[i] == r, else zero (y's dtype); dw[t, j] = sum_h y[r, h] *
    g[t, h] in f32 for r = src_to_dst[t*k + j] in [0, M), else 0."""
    rows, hidden = y.shape
    tokens, k = topk_weights.shape
    slots = tokens * k
    w = topk_weights.astype(jnp.float32).reshape(-1)
    s2d = index_int32(src_to_dst)
    d2s = index_int32(dst_to_src)
    gf = g.astype(jnp.float32)
    if slots == 0:
        return jnp.zeros_like(y), jnp.zeros((tokens, k), jnp.float32)
    slot = jnp.clip(d2s, 0, slots - 1)
    owned = (d2s >= 0) & (d2s < slots) & (s2d[slot] == jnp.arange(rows))
    dy = jnp.where(owned[:, None], w[slot][:, None] * gf[slot // k], 0.0).astype(y.dtype)
    valid = (s2d >= 0) & (s2d < rows)
    if rows == 0:
        return dy, jnp.zeros((tokens, k), jnp.float32)
    named = y[jnp.clip(s2d, 0, rows - 1)].astype(jnp.float32).reshape(tokens, k, hidden)
    dots = jnp.sum(named * gf[:, None, :], axis=-1)  # elementwise: no reduced-precision dot
    return dy, jnp.where(valid.reshape(tokens, k), dots, 0.0)


def _moe_layer(hidden_states, router_logits, w13, w2, e_score_correction_bias,
               spec: _checks.Layer):
    r = spec.routing
    weights, ids = _route(router_logits, e_score_correction_bias, r)
    src_to_dst, dst_to_src, sizes = _token_index(ids, w13.shape[0], 0, w13.shape[0])
    y = _expert_mlp(hidden_states, w13, w2, sizes, dst_to_src, r.topk, spec.activation,
                    spec.is_gated)
    return _combine(y, weights, src_to_dst)


def _moe_decode(hidden_states, router_logits, w13, w2, r: _checks.Routing):
    """moe_layer with softmax routing (r) and gated SiLU."""
    return _moe_layer(hidden_states, router_logits, w13, w2, None, _checks.Layer(routing=r))


def _group_gemm_wgrad(dy, x, expert_sizes, rows, topk: int):
    """rows: dst_to_src of a gather, or None. Each expert's rows are selected
    from both operands by a mask (the rows outside it become +0, so nothing
    from them, not even a NaN, reaches that expert), then one batched f32
    dot per expert: E x M x (N + K) memory, a test oracle's cost."""
    m = dy.shape[0]
    if rows is not None:  # no tokens (T = 0): every row is a zero row
        x = _expand(x, rows, topk)
    sizes = owned_rows(expert_sizes, m)
    end = jnp.cumsum(sizes)
    r = jnp.arange(m, dtype=end.dtype)
    owned = ((r[None, :] >= (end - sizes)[:, None]) & (r[None, :] < end[:, None]))[..., None]
    dy_e = jnp.where(owned, dy.astype(jnp.float32)[None], 0.0)
    x_e = jnp.where(owned, x.astype(jnp.float32)[None], 0.0)
    dw = jnp.einsum("emn,emk->enk", dy_e, x_e, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)
    return dw.astype(dy.dtype)
