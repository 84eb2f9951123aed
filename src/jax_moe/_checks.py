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
