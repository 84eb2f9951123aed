"""What the step modules of jax_moe.ops share: output shapes, the router's
operands and the grouped GEMM's tile choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import tuning
from jax_moe._int32 import index_int32

# The router kernels' scoring codes.
SCORING = {"softmax": 0, "sigmoid": 1}


def sds(shape, dtype):
    """A ShapeDtypeStruct with Python-int dimensions (an ffi_call result)."""
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype))


def bias_arg(e_score_correction_bias, experts: int):
    """(has_bias, the router kernel's f32 bias operand: zeros when there is none)."""
    if e_score_correction_bias is None:
        return False, jnp.zeros((experts,), jnp.float32)
    return True, jnp.asarray(e_score_correction_bias).astype(jnp.float32)


def gemm_tile(m: int, shape, dtype, tile) -> int:
    """group_gemm's rows per tile for m rows and w of shape (E, N, K): `tile`
    (checked) when given, else jax_moe.tuning's choice."""
    if tile is not None:
        return tile
    experts, n, k = shape
    return tuning.group_gemm_tile_m(m, experts, n, k, dtype)


def inverse_map(index, size: int):
    """(inverse (size,), repeated (len(index),)) of an int map `index` into
    [0, size) (entries outside it name nothing): inverse[j] is the last i
    with index[i] == j, -1 where none (a scatter-max: the same result in any
    order); repeated[i] says that index[i] names a j whose inverse is
    another i. Both on the device, for backward passes that must stay exact
    when a map (unlike step 2's) names one place twice."""
    index = index_int32(index)
    pos = jnp.arange(index.shape[0], dtype=jnp.int32)
    at = jnp.where((index >= 0) & (index < size), index, size)  # `size`: dropped
    inverse = jnp.full((size,), -1, jnp.int32).at[at].max(pos, mode="drop")
    repeated = (at < size) & (inverse[jnp.minimum(at, size - 1)] != pos)
    return inverse, repeated
