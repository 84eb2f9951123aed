"""jax_moe: Mixture-of-Experts layers for JAX with XLA FFI CUDA kernels."""

from jax_moe import (attention, attention_reference, backends, convert, losses, ops, reference,
                     tuning)
from jax_moe._ffi import HAS_CUDA, HAS_SM90_GEMM
from jax_moe.convert import config_from_hf, convert_moe_block
from jax_moe.layer import MoEConfig, MoELayer, moe_forward
from jax_moe.parallel import moe_forward_sharded, moe_shardings
from jax_moe.ragged_dot import ragged_dot

__all__ = [
    "ops", "reference", "moe_forward", "moe_forward_sharded", "moe_shardings",
    "MoEConfig", "MoELayer", "HAS_CUDA", "HAS_SM90_GEMM", "convert", "convert_moe_block",
    "config_from_hf", "attention", "attention_reference", "tuning", "backends", "ragged_dot",
    "losses",
]
__version__ = "0.1.0"
