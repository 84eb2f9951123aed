"""Integer index and size arguments as int32, saturated rather than wrapped.

The kernels index rows, slots, experts and pages with int32. An index array
of a wider type (int64 under jax_enable_x64, uint32, uint64, or a NumPy
int64 array) is clipped into int32's range before the cast: a value past
it becomes 2**31 - 1 or -2**31, which every op treats as out of range (an
expert id or row that is dropped, a size that clamps to the rows there
are), where a plain astype would wrap it onto a valid index (2**32 + 1 onto
1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_I32 = np.iinfo(np.int32)


def index_int32(x):
    """x (any integer dtype) as int32, saturated to int32's range."""
    dt = np.dtype(x.dtype)
    info = np.iinfo(dt)
    if info.min >= _I32.min and info.max <= _I32.max:
        return jnp.asarray(x).astype(jnp.int32)
    lo, hi = max(int(info.min), int(_I32.min)), min(int(info.max), int(_I32.max))
    if isinstance(x, np.ndarray):
        # Clipped here: JAX would wrap a NumPy int64 array into int32 on
        # the way in when x64 is off.
        return jnp.asarray(np.clip(x, lo, hi).astype(np.int32))
    return jnp.clip(x, np.array(lo, dt), np.array(hi, dt)).astype(jnp.int32)


def owned_rows(sizes, m: int):
    """The rows of m that each group owns, in group order, of group sizes
    of any integer dtype: a size below 0 counts 0, and the running sum
    saturates at m (a plain int32 cumsum of sizes near 2**31 would wrap and
    hand rows to the wrong groups). The result sums to at most m."""
    sizes = jnp.clip(index_int32(sizes), 0, m)
    end = jax.lax.associative_scan(lambda a, b: jnp.minimum(a, m - b) + b, sizes)
    return end - jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
