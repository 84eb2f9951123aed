"""The building blocks of the argument checks: an argument is an array of a
rank and dtype, a static argument is a Python int, float or bool. Shared by
_checks.py and _attention_checks.py; trace-time only (shapes, dtypes and
Python values), so they cost nothing under jax.jit."""

from __future__ import annotations

import math
import operator

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_array(x, name: str) -> None:
    """An array (JAX, NumPy or a tracer), not a list or a Python scalar: the
    checks below read its shape and dtype."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray), "
                        f"got {type(x).__name__}")


def rank(x, name: str, want: int) -> None:
    is_array(x, name)
    if jnp.ndim(x) != want:
        raise ValueError(f"{name} must have rank {want}, got shape {jnp.shape(x)}")


def float_dtype(x, name: str) -> None:
    is_array(x, name)
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def int_dtype(x, name: str) -> None:
    is_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")


def same_dtype(a, a_name: str, b, b_name: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{b_name} ({b.dtype}) must have the dtype of {a_name} ({a.dtype})")


def static_int(value, name: str) -> int:
    """A Python or NumPy integer (a static argument), as an int; True and
    False are refused (operator.index would read them as 1 and 0)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python int (a static argument), got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python int (a static argument), got {value!r}") from None


def static_float(value, name: str) -> float:
    """A finite Python or NumPy real number (a static argument), as a float:
    a NaN or infinite scale would turn every output into NaN or inf."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                         np.floating)):
        raise TypeError(f"{name} must be a Python float (a static argument), got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def static_bool(value, name: str) -> bool:
    """True or False (Python or NumPy), as a bool: a string such as "False"
    would otherwise read as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False (a static argument), got {value!r}")
    return bool(value)
