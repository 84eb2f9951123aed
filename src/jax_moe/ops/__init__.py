"""The MoE steps as XLA FFI custom calls (CPU and CUDA handlers), one module
per step, named as the FFI targets and the C++ files: route, token_index,
expand, group_gemm, activation, combine, expert_mlp, moe_layer, moe_decode,
group_gemm_wgrad (group_gemm's weight gradient), group_gemm_fp8 (block-scaled
fp8 weights).

Each public function checks its arguments once at trace time (jax_moe._checks)
and then calls an unchecked implementation that builds the FFI call;
expert_mlp and moe_layer check once and compose the unchecked implementations
of the steps they run. Row-wise ops (router, activation) batch under
``jax.vmap`` by handing the kernel extra leading dimensions; ops whose
semantics span the whole batch (index, expand, GEMM, combine) batch
sequentially.

The package's attributes are the functions below (``jax_moe.ops.route`` is the
function; the module is ``jax_moe.ops.route`` in sys.modules, reached with
``from jax_moe.ops.route import ...``).
"""

from __future__ import annotations

from jax_moe.ops.activation import activation, gated_activation, gelu_and_mul, silu_and_mul
from jax_moe.ops.combine import moe_combine
from jax_moe.ops.expand import moe_expand_input
from jax_moe.ops.expert_mlp import expert_mlp
from jax_moe.ops.group_gemm import group_gemm, group_gemm_gather
from jax_moe.ops.group_gemm_fp8 import group_gemm_fp8
from jax_moe.ops.group_gemm_wgrad import group_gemm_wgrad
from jax_moe.ops.moe_decode import moe_decode, moe_decode_supported
from jax_moe.ops.moe_layer import moe_layer
from jax_moe.ops.route import route, topk_softmax
from jax_moe.ops.token_index import moe_compute_token_index

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
    "group_gemm_wgrad",
    "group_gemm_fp8",
]
