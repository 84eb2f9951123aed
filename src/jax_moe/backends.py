"""The backends the layers run on.

``BACKENDS`` maps each name to the module of its public, checked ops:
"ffi" to jax_moe.ops (the XLA FFI custom calls) and "reference" to
jax_moe.reference (plain jax.numpy, the same signatures and semantics, but
for ``moe_decode_supported``, which only ops has, and for non-finite
weights: ``jax.lax.ragged_dot`` may spread one expert's NaN or inf weight to
every row, where the kernels keep it to that expert's rows).
``get(name)`` returns that module and raises ValueError for any other name;
moe_forward, MoELayer, moe_forward_sharded and jax_moe.nn.MoE take these names
as their ``backend`` argument.

``steps(name)`` returns the backend's unchecked step implementations
(``Steps``): the building blocks of jax_moe's own layers, which check their
arguments once at their entry (jax_moe._checks) and then compose these. They
take the checked, normalised values that _checks returns (a ``Routing``, a
``Layer``, ints) and check nothing themselves.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

from jax_moe import ops, reference
from jax_moe.ops.activation import _activation as _ffi_activation
from jax_moe.ops.combine import _combine as _ffi_combine
from jax_moe.ops.expand import _expand as _ffi_expand
from jax_moe.ops.expert_mlp import _expert_mlp as _ffi_expert_mlp
from jax_moe.ops.group_gemm_fp8 import _group_gemm_fp8 as _ffi_group_gemm_fp8
from jax_moe.ops.moe_decode import _moe_decode as _ffi_moe_decode
from jax_moe.ops.moe_layer import _moe_layer as _ffi_moe_layer
from jax_moe.ops.route import _route as _ffi_route
from jax_moe.ops.routed_experts import routed_experts as _ffi_routed_experts
from jax_moe.ops.token_index import _token_index as _ffi_token_index

__all__ = ["BACKENDS", "get", "Steps", "steps", "fp8_expert_mlp"]

BACKENDS: types.MappingProxyType = types.MappingProxyType({"ffi": ops, "reference": reference})


def get(name: str) -> types.ModuleType:
    """The public ops module of backend `name` ("ffi" or "reference")."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


@dataclasses.dataclass(frozen=True)
class Steps:
    """One backend's unchecked step implementations, all with the same
    signatures on every backend (arrays first, then checked static values)."""

    name: str
    # (router_logits, e_score_correction_bias or None, Routing) -> (weights, ids)
    route: Callable
    # (topk_ids, num_experts, start_expert, num_local_experts) -> (src_to_dst, dst_to_src, sizes)
    token_index: Callable
    # (x, dst_to_src, topk) -> the expanded rows
    expand: Callable
    # (h, activation name, gated) -> act(h) or act(gate) * up
    activation: Callable
    # (x, w13, w2, expert_sizes, dst_to_src, topk, activation name, is_gated,
    #  (w13's, w2's) tile_m) -> (M, H)
    expert_mlp: Callable
    # (y, topk_weights, src_to_dst, dst_to_src=None: its inverse, if known) -> (T, H)
    combine: Callable
    # (x, w13, w2, topk_weights, expert_sizes, dst_to_src, src_to_dst, topk, activation
    #  name, is_gated, tiles, remat) -> (T, H): combine(expert_mlp(...)) with step 2's maps,
    #  differentiable without keeping the expert outputs
    routed_experts: Callable
    # (hidden_states, router_logits, w13, w2, e_score_correction_bias or None, Layer) -> (T, H)
    moe_layer: Callable
    # (hidden_states, router_logits, w13, w2, Routing) -> (1, H); within moe_decode's limits
    moe_decode: Callable
    # (x, w float8_e4m3fn, w_scale, expert_sizes, rows=None, topk=1, activation=None,
    #  gated=True) -> (M, N): the block-scaled fp8 grouped GEMM; with rows (dst_to_src),
    #  of x's expanded rows; with an activation name, of act(x) (step 5; no rows)
    group_gemm_fp8: Callable


_STEPS = types.MappingProxyType({
    "ffi": Steps(name="ffi", route=_ffi_route, token_index=_ffi_token_index, expand=_ffi_expand,
                 activation=_ffi_activation, expert_mlp=_ffi_expert_mlp, combine=_ffi_combine,
                 routed_experts=_ffi_routed_experts, moe_layer=_ffi_moe_layer,
                 moe_decode=_ffi_moe_decode, group_gemm_fp8=_ffi_group_gemm_fp8),
    "reference": Steps(name="reference", route=reference._route,
                       token_index=reference._token_index, expand=reference._expand,
                       activation=reference._activation, expert_mlp=reference._expert_mlp,
                       combine=reference._combine,
                       routed_experts=reference._routed_experts,
                       moe_layer=reference._moe_layer,
                       moe_decode=reference._moe_decode,
                       group_gemm_fp8=reference._group_gemm_fp8),
})


def steps(name: str) -> Steps:
    """The unchecked step implementations of backend `name` (ValueError as get)."""
    get(name)
    return _STEPS[name]


def fp8_expert_mlp(steps: Steps, x, w13, w13_scale, w2, w2_scale, expert_sizes, dst_to_src,
                   topk: int, activation: str, is_gated: bool):
    """Steps 3-6 with block-scaled fp8 expert weights on one backend's steps:
    both GEMMs the fp8 grouped GEMM (each row of their input quantised per
    128 channels), the first on the tokens' rows gathered by dst_to_src (no
    expanded copy of x), the second on the activation of the first's rows
    (as for float weights), which the Hopper kernel applies as it quantises
    them."""
    h = steps.group_gemm_fp8(x, w13, w13_scale, expert_sizes, rows=dst_to_src, topk=topk)
    return steps.group_gemm_fp8(h, w2, w2_scale, expert_sizes, activation=activation,
                                gated=is_gated)
