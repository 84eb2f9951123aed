"""Argument validation shared by ops.py, reference.py and pipeline.py.

Every check runs at trace time on shapes and dtypes only, so it costs nothing
under jax.jit and raises before any kernel runs.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
# The CUDA router and index kernels keep one row of per-expert state in shared
# memory (csrc/cuda/router.cu, token_index.cu); the same bound holds on every
# platform so that a program never works on the CPU and fails on the GPU.
MAX_EXPERTS = 3072


def rank(x, name: str, want: int) -> None:
    if jnp.ndim(x) != want:
        raise ValueError(f"{name} must have rank {want}, got shape {jnp.shape(x)}")


def float_dtype(x, name: str) -> None:
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def int_dtype(x, name: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")


def same_dtype(a, a_name: str, b, b_name: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{b_name} ({b.dtype}) must have the dtype of {a_name} ({a.dtype})")


def static_int(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python int (a static argument), got {value!r}") from None


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


# ---- per-op argument checks: ops.py and reference.py share these ----------

def topk_softmax_args(router_logits, topk_value) -> int:
    rank(router_logits, "router_logits", 2)
    float_dtype(router_logits, "router_logits")
    num_experts_bound(router_logits.shape[1], "router_logits' E")
    return topk(topk_value, router_logits.shape[1])


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
    rank(x, "x", 2)
    float_dtype(x, "x")
    rank(dst_to_src, "dst_to_src", 1)
    int_dtype(dst_to_src, "dst_to_src")
    k = static_int(topk_value, "topk")
    if k < 1:
        raise ValueError(f"topk must be >= 1, got {k}")
    return k


def group_gemm_args(x, w, expert_sizes) -> None:
    rank(x, "x", 2)
    rank(w, "w", 3)
    rank(expert_sizes, "expert_sizes", 1)
    float_dtype(x, "x")
    same_dtype(x, "x", w, "w")
    int_dtype(expert_sizes, "expert_sizes")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"w must be (E, N, K={x.shape[1]}) to match x, got {w.shape}")
    if expert_sizes.shape[0] != w.shape[0]:
        raise ValueError(
            f"expert_sizes must have E={w.shape[0]} entries (w's first dim), got {expert_sizes.shape[0]}")


def tile_pair(value) -> tuple:
    """expert_mlp's tile_m: None, or (w13's, w2's) tile_m (each None or one of TILE_M)."""
    if value is None:
        return None, None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"tile_m must be None or a pair (w13's, w2's), got {value!r}")
    return tile_m(value[0]), tile_m(value[1])


def expert_mlp_args(x, w13, w2, expert_sizes, dst_to_src, topk_value, activation_name: str,
                    is_gated: bool) -> tuple[int, int]:
    """(topk, activation code) of expert_mlp's arguments, checked."""
    k = expand_args(x, dst_to_src, topk_value)
    group_gemm_args(x, w13, expert_sizes)
    code = activation(activation_name)
    if not isinstance(is_gated, bool):
        raise TypeError(f"is_gated must be a bool, got {type(is_gated).__name__}")
    rank(w2, "w2", 3)
    same_dtype(x, "x", w2, "w2")
    experts, up_width, hidden = w13.shape
    if is_gated and up_width % 2:
        raise ValueError(f"w13's second dimension must be 2*I (even) when gated, got {w13.shape}")
    inter = up_width // 2 if is_gated else up_width
    if w2.shape != (experts, hidden, inter):
        raise ValueError(f"w2 must be (E={experts}, H={hidden}, I={inter}), got {w2.shape}")
    return k, code


# group_gemm's rows per tile. 8: the decode kernel; 16: the TMA decode kernel
# where it can run, else the same as 8; 32, 64, 128: the mma.sync tile kernel;
# 256: the CUTLASS sm90 kernel (wgmma + TMA; 64x128, 128x128 or 128x256
# tiles by rows per expert) where it can run, else the same as 128.
TILE_M = (8, 16, 32, 64, 128, 256)


def tile_m(value) -> int | None:
    """group_gemm's tile_m: None (tuned) or one of TILE_M."""
    if value is None:
        return None
    v = static_int(value, "tile_m")
    if v not in TILE_M:
        raise ValueError(f"tile_m must be None or one of {TILE_M}, got {value!r}")
    return v


def activation_args(h, name: str, gated: bool = True) -> int:
    code = activation(name)
    if jnp.ndim(h) < 1:
        raise ValueError("h must have at least one dimension")
    float_dtype(h, "h")
    if gated and h.shape[-1] % 2:
        raise ValueError(f"h's last dimension must be even (2*I), got {h.shape[-1]}")
    return code


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


SCORING_FUNCS = ("softmax", "sigmoid")


def route_args(router_logits, topk_value, scoring_func, num_expert_group, topk_group,
               e_score_correction_bias, routed_scaling_factor):
    """Checks the router's arguments; returns (k, groups, topk_group, scale)
    with groups = topk_group = 1 when routing is not group-limited."""
    k = topk_softmax_args(router_logits, topk_value)
    experts = router_logits.shape[1]
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
                f"topk={k} exceeds the {tg * (experts // groups)} experts of topk_group={tg} groups")
    if e_score_correction_bias is not None:
        rank(e_score_correction_bias, "e_score_correction_bias", 1)
        float_dtype(e_score_correction_bias, "e_score_correction_bias")
        if e_score_correction_bias.shape[0] != experts:
            raise ValueError(
                f"e_score_correction_bias must have num_experts={experts} entries, "
                f"got {e_score_correction_bias.shape[0]}")
    try:
        scale = float(routed_scaling_factor)
    except TypeError:
        raise TypeError(f"routed_scaling_factor must be a Python float, got {routed_scaling_factor!r}") from None
    return k, groups, tg, scale


def layer_args(hidden_states, router_logits, w13, w2, topk_value, shared_expert_output=None, *,
               is_gated: bool = True):
    """Shapes and dtypes of the routed layer; returns topk as an int."""
    rank(hidden_states, "hidden_states", 2)
    rank(router_logits, "router_logits", 2)
    rank(w13, "w13", 3)
    rank(w2, "w2", 3)
    float_dtype(hidden_states, "hidden_states")
    float_dtype(router_logits, "router_logits")
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
        raise ValueError(f"w13 must be (E, {'2*I' if is_gated else 'I'}, H={hidden}), got {w13.shape}")
    if is_gated and up_width % 2:
        raise ValueError(f"w13's second dimension must be 2*I (even), got {up_width}")
    inter = up_width // 2 if is_gated else up_width
    if w2.shape != (experts, hidden, inter):
        raise ValueError(
            f"w2 must be (E={experts}, H={hidden}, I={inter}), got {w2.shape}")
    k = topk(topk_value, experts)
    if shared_expert_output is not None and shared_expert_output.shape != (tokens, hidden):
        raise ValueError(
            f"shared_expert_output must be (T={tokens}, H={hidden}), got {shared_expert_output.shape}")
    return k


# moe_decode's kernel limits (csrc/shape_checks.h, CheckMoeDecode): one token,
# bf16/f16, H a multiple of 256 up to 2048, I a multiple of 256 up to 1024,
# topk <= 8, E <= 1024.
DECODE_DTYPES = ("bfloat16", "float16")


def decode_limits(hidden_states, w13, w2, k: int) -> str | None:
    """Why moe_decode cannot take this (already shape-checked) layer, or None."""
    tokens, hidden = hidden_states.shape
    experts, _, _ = w13.shape
    inter = w2.shape[2]
    if tokens != 1:
        return f"moe_decode takes one token: hidden_states must be (1, H), got {hidden_states.shape}"
    if jnp.dtype(hidden_states.dtype).name not in DECODE_DTYPES:
        return f"moe_decode needs bfloat16 or float16 hidden_states, got {hidden_states.dtype}"
    if hidden % 256 or not 256 <= hidden <= 2048:
        return f"moe_decode needs H a multiple of 256 in [256, 2048], got H={hidden}"
    if inter % 256 or not 256 <= inter <= 1024:
        return f"moe_decode needs I a multiple of 256 in [256, 1024], got I={inter}"
    if k > 8:
        return f"moe_decode needs topk <= 8, got topk={k}"
    if experts > 1024:
        return f"moe_decode needs at most 1024 experts, got E={experts}"
    return None
