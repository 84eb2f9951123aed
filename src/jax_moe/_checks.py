"""Argument checks of the public entry points, and the static values they yield.

Each public function of jax_moe.ops and jax_moe.reference, and moe_forward /
moe_forward_sharded, makes ONE call to an ``*_args`` function here: it checks
every argument once and returns the normalised static values (ints, a
``Routing``, a ``Layer``) that the unchecked implementations take. Composite
entry points check once and compose unchecked implementations, so no
argument is checked twice. The building blocks (rank, dtype, static ints,
floats and bools) live in _check_basics.py, shared with _attention_checks.py,
and are re-exported here.

Every check runs at trace time on shapes and dtypes only, so it costs nothing
under jax.jit and raises before any kernel runs. moe_decode's kernel limits
live here only (``DECODE_LIMITS``, read from the extension).
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe._check_basics import (FLOAT_DTYPES, float_dtype, int_dtype, is_array,  # noqa: F401
                                   rank, same_dtype, static_bool, static_float, static_int)
from jax_moe._ffi import _ext
from jax_moe import fp8

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
SCORING_FUNCS = ("softmax", "sigmoid")
# The CUDA route and token_index kernels keep one row of per-expert state in
# shared memory; the same bound holds on every platform so that a program
# never works on the CPU and fails on the GPU.
MAX_EXPERTS = 3072
# group_gemm's rows per tile. 8: the decode kernel; 16: the TMA decode kernel
# where it can run, else the same as 8; 32, 64, 128: the mma.sync tile kernel;
# 256: the CUTLASS sm90 kernel (wgmma + TMA; 64x128, 128x128 or 128x256
# tiles by rows per expert) where it can run, else the same as 128.
TILE_M = (8, 16, 32, 64, 128, 256)
# group_gemm_fp8's: 8 the decode form, 64 and 128 the Hopper kernel's tiles.
FP8_TILE_M = (8, 64, 128)
# moe_decode's kernel limits, the constants the C++ handlers enforce
# (csrc/kernels/common/moe_decode.h, exported by the extension): max_topk,
# max_experts, max_hidden, max_inter and the multiple that H and I must be of.
# One token, bf16 or f16.
DECODE_LIMITS = types.MappingProxyType({k: int(v) for k, v in _ext.DECODE_LIMITS.items()})
DECODE_DTYPES = ("bfloat16", "float16")
# moe_decode_fp8's (the fp8 layer's one-token kernel, CUDA only; same header):
# max_topk, max_hidden, max_inter and the multiple that H and I must be of.
DECODE_FP8_LIMITS = types.MappingProxyType(
    {k: int(v) for k, v in _ext.DECODE_FP8_LIMITS.items()})
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's static arguments, checked. num_expert_group = topk_group
    = 1 when routing is not group-limited (the same choice, exactly)."""

    topk: int
    scoring_func: str = "softmax"
    renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class Layer:
    """The routed layer's static arguments, checked (hashable: a jit and
    custom_vjp static argument). tile_m: (w13's, w2's), each None or TILE_M."""

    routing: Routing
    activation: str = "silu"
    is_gated: bool = True
    tile_m: tuple = (None, None)
    remat: bool = False  # the backward recomputes the w13 GEMM instead of keeping it
    fp8: bool = False  # w13 and w2 are block-scaled float8_e4m3fn (with w13_scale, w2_scale)


# ---- building blocks (_check_basics) and bounds -----------------------------

def num_experts_bound(num_experts: int, name: str) -> None:
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"{name}={num_experts}: at most {MAX_EXPERTS} experts are supported")


def topk(value, num_experts: int) -> int:
    k = static_int(value, "topk")
    if not 1 <= k <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {k}")
    return k


def activation(name: str) -> int:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def ids_in_range(topk_ids, num_experts: int) -> None:
    """Eager calls only: under jit the values are unknown, and the kernels drop
    out-of-range ids instead (their rows are not placed)."""
    if is_concrete(topk_ids) and np.size(topk_ids):
        ids = np.asarray(topk_ids)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"topk_ids must lie in [0, num_experts={num_experts}), found values in [{lo}, {hi}]"
            )


def tile_m(value, allowed: tuple = TILE_M) -> int | None:
    """group_gemm's tile_m: None (tuned) or one of `allowed`."""
    if value is None:
        return None
    v = static_int(value, "tile_m")
    if v not in allowed:
        raise ValueError(f"tile_m must be None or one of {allowed}, got {value!r}")
    return v


def tile_pair(value) -> tuple:
    """expert_mlp's tile_m: None, or (w13's, w2's) tile_m (each None or one of TILE_M)."""
    if value is None:
        return None, None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"tile_m must be None or a pair (w13's, w2's), got {value!r}")
    return tile_m(value[0]), tile_m(value[1])


def _routing(experts: int, k: int, scoring_func, renormalize, num_expert_group, topk_group,
             e_score_correction_bias, routed_scaling_factor) -> Routing:
    """The routing options for router logits of `experts` columns and a checked topk."""
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError("num_expert_group and topk_group must be given together")
    groups, tg = 1, 1
    if num_expert_group is not None:
        groups = static_int(num_expert_group, "num_expert_group")
        tg = static_int(topk_group, "topk_group")
        if groups < 1 or experts % groups:
            raise ValueError(
                f"num_expert_group={groups} must be >= 1 and divide num_experts={experts}")
        if not 1 <= tg <= groups:
            raise ValueError(f"topk_group must be in [1, num_expert_group={groups}], got {tg}")
        if k > tg * (experts // groups):
            raise ValueError(
                f"topk={k} exceeds the {tg * (experts // groups)} experts of "
                f"topk_group={tg} groups")
    if e_score_correction_bias is not None:
        rank(e_score_correction_bias, "e_score_correction_bias", 1)
        float_dtype(e_score_correction_bias, "e_score_correction_bias")
        if e_score_correction_bias.shape[0] != experts:
            raise ValueError(
                f"e_score_correction_bias must have num_experts={experts} entries, "
                f"got {e_score_correction_bias.shape[0]}")
    scale = static_float(routed_scaling_factor, "routed_scaling_factor")
    return Routing(topk=k, scoring_func=scoring_func,
                   renormalize=static_bool(renormalize, "renormalize"),
                   num_expert_group=groups, topk_group=tg, routed_scaling_factor=scale)


# ---- the steps ----------------------------------------------------------------

def route_args(router_logits, topk_value, *, scoring_func="softmax", renormalize=True,
               num_expert_group=None, topk_group=None, e_score_correction_bias=None,
               routed_scaling_factor=1.0) -> Routing:
    """route's (and topk_softmax's) arguments."""
    rank(router_logits, "router_logits", 2)
    float_dtype(router_logits, "router_logits")
    experts = router_logits.shape[1]
    num_experts_bound(experts, "router_logits' E")
    k = topk(topk_value, experts)
    return _routing(experts, k, scoring_func, renormalize, num_expert_group, topk_group,
                    e_score_correction_bias, routed_scaling_factor)


def token_index_args(topk_ids, num_experts, start_expert, num_local_experts):
    """Returns (num_experts, start, local) as ints."""
    rank(topk_ids, "topk_ids", 2)
    int_dtype(topk_ids, "topk_ids")
    num_experts = static_int(num_experts, "num_experts")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    num_experts_bound(num_experts, "num_experts")
    start = static_int(start_expert, "start_expert")
    local = num_experts - start if num_local_experts is None else static_int(
        num_local_experts, "num_local_experts")
    if start < 0 or local < 1 or start + local > num_experts:
        raise ValueError(
            f"start_expert={start}, num_local_experts={local} must describe a non-empty "
            f"range inside [0, num_experts={num_experts})")
    if int(np.prod(topk_ids.shape)) >= 2**31:
        raise ValueError(f"topk_ids has {int(np.prod(topk_ids.shape))} entries; at most 2^31 - 1")
    ids_in_range(topk_ids, num_experts)
    return num_experts, start, local


def expand_args(x, dst_to_src, topk_value) -> int:
    """moe_expand_input's arguments; returns topk."""
    rank(x, "x", 2)
    float_dtype(x, "x")
    rank(dst_to_src, "dst_to_src", 1)
    int_dtype(dst_to_src, "dst_to_src")
    k = static_int(topk_value, "topk")
    if k < 1:
        raise ValueError(f"topk must be >= 1, got {k}")
    return k


def _weight_ranks(w, expert_sizes) -> None:
    rank(w, "w", 3)
    rank(expert_sizes, "expert_sizes", 1)


def _weight_match(x, w, expert_sizes) -> None:
    """w (E, N, K) and expert_sizes (E,) against x (M, K), all of checked rank."""
    same_dtype(x, "x", w, "w")
    _weight_shapes(x, w, expert_sizes)


def _weight_shapes(x, w, expert_sizes) -> None:
    """_weight_match without the dtypes' match (fp8 w against float x)."""
    int_dtype(expert_sizes, "expert_sizes")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"w must be (E, N, K={x.shape[1]}) to match x, got {w.shape}")
    if expert_sizes.shape[0] != w.shape[0]:
        raise ValueError(
            f"expert_sizes must have E={w.shape[0]} entries (w's first dim), "
            f"got {expert_sizes.shape[0]}")


def group_gemm_args(x, w, expert_sizes, tile) -> int | None:
    """group_gemm's arguments; returns tile_m (None: tuned)."""
    rank(x, "x", 2)
    _weight_ranks(w, expert_sizes)
    float_dtype(x, "x")
    _weight_match(x, w, expert_sizes)
    return tile_m(tile)


def fp8_tile_m(value) -> int | None:
    """group_gemm_fp8's tile_m: None (tuned) or one of FP8_TILE_M."""
    return tile_m(value, FP8_TILE_M)


def group_gemm_fp8_args(x, w, w_scale, expert_sizes, tile=None, dst_to_src=None,
                        topk_value=1) -> tuple:
    """group_gemm_fp8's arguments: x (M, K) float (the tokens (T, K) with
    dst_to_src (M,)), w (E, N, K) float8_e4m3fn with its block scales
    w_scale (E, ceil(N/128), ceil(K/128)) f32; returns (topk, tile_m)."""
    if dst_to_src is None:
        rank(x, "x", 2)
        float_dtype(x, "x")
        k = static_int(topk_value, "topk")
        if k != 1:
            raise ValueError(f"topk is for a gather: without dst_to_src it must be 1, got {k}")
    else:
        k = expand_args(x, dst_to_src, topk_value)
    _weight_ranks(w, expert_sizes)
    fp8.check_block_scales(w, w_scale, "w", "w_scale")
    _weight_shapes(x, w, expert_sizes)
    return k, fp8_tile_m(tile)


def group_gemm_gather_args(x, w, expert_sizes, dst_to_src, topk_value, tile) -> tuple:
    """group_gemm_gather's arguments; returns (topk, tile_m)."""
    k = expand_args(x, dst_to_src, topk_value)
    _weight_ranks(w, expert_sizes)
    _weight_match(x, w, expert_sizes)
    return k, tile_m(tile)


def expert_mlp_args(x, w13, w2, expert_sizes, dst_to_src, topk_value, activation_name: str,
                    is_gated: bool, tile) -> tuple:
    """expert_mlp's arguments; returns (topk, (w13's, w2's) tile_m)."""
    k = expand_args(x, dst_to_src, topk_value)
    _weight_ranks(w13, expert_sizes)
    _weight_match(x, w13, expert_sizes)
    activation(activation_name)
    static_bool(is_gated, "is_gated")
    rank(w2, "w2", 3)
    same_dtype(x, "x", w2, "w2")
    experts, up_width, hidden = w13.shape
    if is_gated and up_width % 2:
        raise ValueError(f"w13's second dimension must be 2*I (even) when gated, got {w13.shape}")
    inter = up_width // 2 if is_gated else up_width
    if w2.shape != (experts, hidden, inter):
        raise ValueError(f"w2 must be (E={experts}, H={hidden}, I={inter}), got {w2.shape}")
    return k, tile_pair(tile)


def activation_args(h, name: str, gated: bool) -> None:
    """gated_activation's (gated) and activation's arguments."""
    activation(name)
    if jnp.ndim(h) < 1:
        raise ValueError("h must have at least one dimension")
    float_dtype(h, "h")
    if gated and h.shape[-1] % 2:
        raise ValueError(f"h's last dimension must be even (2*I), got {h.shape[-1]}")


def gelu_and_mul_args(h, approximate) -> str:
    """gelu_and_mul's arguments; returns the activation's name."""
    name = "gelu_tanh" if static_bool(approximate, "approximate") else "gelu"
    activation_args(h, name, gated=True)
    return name


def combine_args(y, topk_weights, src_to_dst) -> None:
    rank(y, "y", 2)
    float_dtype(y, "y")
    rank(topk_weights, "topk_weights", 2)
    float_dtype(topk_weights, "topk_weights")
    rank(src_to_dst, "src_to_dst", 1)
    int_dtype(src_to_dst, "src_to_dst")
    tokens, k = topk_weights.shape
    if src_to_dst.shape[0] != tokens * k:
        raise ValueError(
            f"src_to_dst must have T*topk={tokens * k} entries, got {src_to_dst.shape[0]}")


# ---- the routed layer -----------------------------------------------------------

def _layer_shapes(hidden_states, router_logits, w13, w2, topk_value, shared_expert_output,
                  is_gated: bool, fp8_weights: bool = False) -> int:
    """Shapes and dtypes of the routed layer; returns topk as an int.
    fp8_weights: w13 and w2 are float8_e4m3fn (their scales checked apart)."""
    is_gated = static_bool(is_gated, "is_gated")
    rank(hidden_states, "hidden_states", 2)
    rank(router_logits, "router_logits", 2)
    rank(w13, "w13", 3)
    rank(w2, "w2", 3)
    float_dtype(hidden_states, "hidden_states")
    float_dtype(router_logits, "router_logits")
    if not fp8_weights:
        same_dtype(hidden_states, "hidden_states", w13, "w13")
        same_dtype(hidden_states, "hidden_states", w2, "w2")
    tokens, hidden = hidden_states.shape
    experts, up_width, h13 = w13.shape
    if router_logits.shape[0] != tokens:
        raise ValueError(
            f"router_logits must be (T={tokens}, E), got {router_logits.shape}")
    if router_logits.shape[1] != experts:
        raise ValueError(
            f"router_logits has E={router_logits.shape[1]} experts but w13 has {experts}")
    if h13 != hidden:
        up = "2*I" if is_gated else "I"
        raise ValueError(f"w13 must be (E, {up}, H={hidden}), got {w13.shape}")
    if is_gated and up_width % 2:
        raise ValueError(f"w13's second dimension must be 2*I (even), got {up_width}")
    inter = up_width // 2 if is_gated else up_width
    if w2.shape != (experts, hidden, inter):
        raise ValueError(
            f"w2 must be (E={experts}, H={hidden}, I={inter}), got {w2.shape}")
    k = topk(topk_value, experts)
    if tokens * k > INT32_MAX:
        # The slots (T·k rows) are indexed with int32 on every backend.
        raise ValueError(f"hidden_states' T={tokens} times topk={k} must be at most "
                         f"{INT32_MAX} (2**31 - 1) slots")
    if shared_expert_output is not None:
        float_dtype(shared_expert_output, "shared_expert_output")
        if shared_expert_output.shape != (tokens, hidden):
            raise ValueError(f"shared_expert_output must be (T={tokens}, H={hidden}), "
                             f"got {shared_expert_output.shape}")
    return k


def _layer_routing(router_logits, k, scoring_func, renormalize, num_expert_group, topk_group,
                   e_score_correction_bias, routed_scaling_factor) -> Routing:
    """The layer's routing options; router_logits' rank and dtype are checked."""
    experts = router_logits.shape[1]
    num_experts_bound(experts, "router_logits' E")
    return _routing(experts, k, scoring_func, renormalize, num_expert_group, topk_group,
                    e_score_correction_bias, routed_scaling_factor)


def _shared_experts(hidden_states, shared_w13, shared_w2, shared_gate, is_gated) -> None:
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13 and shared_w2 must be given together")
    if shared_w13 is None:
        if shared_gate is not None:
            raise ValueError("shared_gate needs shared_w13 and shared_w2")
        return
    hidden = hidden_states.shape[1]
    rank(shared_w13, "shared_w13", 2)
    rank(shared_w2, "shared_w2", 2)
    same_dtype(hidden_states, "hidden_states", shared_w13, "shared_w13")
    same_dtype(hidden_states, "hidden_states", shared_w2, "shared_w2")
    up_width = shared_w13.shape[0]
    if shared_w13.shape[1] != hidden or (is_gated and up_width % 2):
        raise ValueError(
            f"shared_w13 must be ({'2*I_s' if is_gated else 'I_s'}, H={hidden}), "
            f"got {shared_w13.shape}")
    inter = up_width // 2 if is_gated else up_width
    if shared_w2.shape != (hidden, inter):
        raise ValueError(f"shared_w2 must be (H={hidden}, I_s={inter}), got {shared_w2.shape}")
    if shared_gate is not None:
        float_dtype(shared_gate, "shared_gate")
        if shared_gate.shape not in ((hidden,), (1, hidden)):
            raise ValueError(f"shared_gate must be (H={hidden},) or (1, H={hidden}), "
                             f"got {shared_gate.shape}")


def moe_layer_args(hidden_states, router_logits, w13, w2, topk_value, *, scoring_func,
                   renormalize, num_expert_group, topk_group, e_score_correction_bias,
                   routed_scaling_factor, activation_name, is_gated, tile) -> Layer:
    """moe_layer's arguments."""
    k = _layer_shapes(hidden_states, router_logits, w13, w2, topk_value, None, is_gated)
    routing = _layer_routing(router_logits, k, scoring_func, renormalize, num_expert_group,
                             topk_group, e_score_correction_bias, routed_scaling_factor)
    activation(activation_name)
    return Layer(routing=routing, activation=activation_name,
                 is_gated=bool(is_gated), tile_m=tile_pair(tile))  # is_gated: checked above


def _fp8_weights(w13, w2, w13_scale, w2_scale) -> bool:
    """Whether the layer's expert weights are block-scaled fp8: both weights
    float8_e4m3fn with both scales, or neither (an error naming what is
    missing or extra)."""
    if w13_scale is None and w2_scale is None and not any(
            getattr(w, "dtype", None) == fp8.FP8 for w in (w13, w2)):
        return False
    for w, name, scale, scale_name in ((w13, "w13", w13_scale, "w13_scale"),
                                       (w2, "w2", w2_scale, "w2_scale")):
        is_array(w, name)
        if w.dtype != fp8.FP8:
            raise TypeError(f"{name} must be float8_e4m3fn when fp8 weights are given "
                            f"(with w13_scale and w2_scale), got {w.dtype}")
        if scale is None:
            raise ValueError(f"{name} is float8_e4m3fn: pass its block scales as {scale_name}")
        fp8.check_block_scales(w, scale, name, scale_name)
    return True


def forward_args(hidden_states, router_logits, w13, w2, topk_value, *, renormalize,
                 activation_name, is_gated, scoring_func, num_expert_group, topk_group,
                 e_score_correction_bias, routed_scaling_factor, shared_w13=None,
                 shared_w2=None, shared_gate=None, shared_expert_output=None, w13_scale=None,
                 w2_scale=None, remat=False) -> Layer:
    """moe_forward's (and moe_forward_sharded's) arguments, the shared experts
    and fp8 expert weights' scales included."""
    remat = static_bool(remat, "remat")
    activation(activation_name)
    fp8_weights = _fp8_weights(w13, w2, w13_scale, w2_scale)
    k = _layer_shapes(hidden_states, router_logits, w13, w2, topk_value, shared_expert_output,
                      is_gated, fp8_weights)
    routing = _layer_routing(router_logits, k, scoring_func, renormalize, num_expert_group,
                             topk_group, e_score_correction_bias, routed_scaling_factor)
    _shared_experts(hidden_states, shared_w13, shared_w2, shared_gate, is_gated)
    return Layer(routing=routing, activation=activation_name,
                 is_gated=bool(is_gated), fp8=fp8_weights, remat=remat)  # is_gated: checked above


def decode_limits(hidden_states, w13, w2, k: int) -> str | None:
    """Why moe_decode cannot take this (already checked) layer, or None. A
    query on checked shapes, not a check: it raises nothing."""
    lim = DECODE_LIMITS
    mult = lim["multiple"]
    tokens, hidden = hidden_states.shape
    experts = w13.shape[0]
    inter = w2.shape[2]
    if tokens != 1:
        return ("moe_decode takes one token: hidden_states must be (1, H), "
                f"got {hidden_states.shape}")
    if jnp.dtype(hidden_states.dtype).name not in DECODE_DTYPES:
        return f"moe_decode needs bfloat16 or float16 hidden_states, got {hidden_states.dtype}"
    if hidden % mult or not mult <= hidden <= lim["max_hidden"]:
        return (f"moe_decode needs H a multiple of {mult} in [{mult}, {lim['max_hidden']}], "
                f"got H={hidden}")
    if inter % mult or not mult <= inter <= lim["max_inter"]:
        return (f"moe_decode needs I a multiple of {mult} in [{mult}, {lim['max_inter']}], "
                f"got I={inter}")
    if k > lim["max_topk"]:
        return f"moe_decode needs topk <= {lim['max_topk']}, got topk={k}"
    if experts > lim["max_experts"]:
        return f"moe_decode needs at most {lim['max_experts']} experts, got E={experts}"
    return None


def moe_decode_args(hidden_states, router_logits, w13, w2, topk_value, *, renormalize,
                    routed_scaling_factor) -> Routing:
    """moe_decode's arguments, its kernel's limits included (softmax routing)."""
    k = _layer_shapes(hidden_states, router_logits, w13, w2, topk_value, None, True)
    routing = _layer_routing(router_logits, k, "softmax", renormalize, None, None, None,
                             routed_scaling_factor)
    why = decode_limits(hidden_states, w13, w2, k)
    if why is not None:
        raise ValueError(why)
    return routing


def decode_supported(hidden_states, router_logits, w13, w2, topk_value) -> bool:
    """moe_decode_supported's arguments checked; whether the kernel takes them."""
    k = _layer_shapes(hidden_states, router_logits, w13, w2, topk_value, None, True)
    return decode_limits(hidden_states, w13, w2, k) is None


def group_gemm_wgrad_args(dy, x, expert_sizes, dst_to_src, topk_value) -> int:
    """group_gemm_wgrad's arguments; returns topk."""
    rank(dy, "dy", 2)
    float_dtype(dy, "dy")
    rank(x, "x", 2)
    same_dtype(dy, "dy", x, "x")
    rank(expert_sizes, "expert_sizes", 1)
    int_dtype(expert_sizes, "expert_sizes")
    k = static_int(topk_value, "topk")
    if k < 1:
        raise ValueError(f"topk must be >= 1, got {k}")
    m = dy.shape[0]
    if dst_to_src is None:
        if x.shape[0] != m:
            raise ValueError(f"x must have M={m} rows (dy's) without dst_to_src, got {x.shape}")
    else:
        rank(dst_to_src, "dst_to_src", 1)
        int_dtype(dst_to_src, "dst_to_src")
        if dst_to_src.shape[0] != m:
            raise ValueError(
                f"dst_to_src must have M={m} entries (dy's rows), got {dst_to_src.shape[0]}")
    return k
