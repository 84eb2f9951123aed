"""Token rows and their routing in one collective, differentiable: the
packing that jax_moe.parallel's dispatch uses (the routing's f32 weights and
int32 ids as the bits of the rows' dtype, appended as a few rows)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def exchange(x, weights, ids, collective, transpose):
    """One collective for token rows and their routing: x (B, N, H) float,
    weights (B, N, k) f32 and ids (B, N, k) int32 are packed as the bits of
    x's dtype, each block's routing appended as a few rows, `collective`
    maps the packed (B, N + R, H) to (B', N + R, H), and the result is
    unpacked into (B', N, ...) arrays. Differentiable in x and weights: their
    cotangents go back through `transpose` (the collective's transpose, one
    call each; ids get none)."""
    n, hidden = x.shape[1], x.shape[2]
    k = weights.shape[-1]
    meta = _meta_words(weights, ids, _uint_like(x.dtype))  # (B, N, m)
    packed = jnp.concatenate([_to_bits(x), _meta_rows(meta, hidden)], axis=1)
    out = collective(packed)
    w, i = _meta_unpack(_rows_meta(out[:, n:], n, meta.shape[-1]), k)
    return _from_bits(out[:, :n], x.dtype), w, i


def _exchange_fwd(x, weights, ids, collective, transpose):
    return exchange(x, weights, ids, collective, transpose), None


def _exchange_bwd(collective, transpose, _, cotangents):
    dx, dw, _ = cotangents
    return transpose(dx), transpose(dw), None


exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _uint_like(dtype):
    size = jnp.dtype(dtype).itemsize
    return {2: jnp.uint16, 4: jnp.uint32}[size]


def _to_bits(x):
    return jax.lax.bitcast_convert_type(x, _uint_like(x.dtype))


def _from_bits(bits, dtype):
    return jax.lax.bitcast_convert_type(bits, dtype)


def _meta_words(weights, ids, udt):
    """(..., k) f32 weights and (..., k) i32 ids -> their bits as (..., m) words
    of the unsigned type udt (m = 2k for uint32, 4k for uint16)."""
    words = jnp.concatenate(
        [jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.uint32),
         jax.lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.uint32)], axis=-1)
    if udt == jnp.uint16:
        words = jax.lax.bitcast_convert_type(words, jnp.uint16)  # (..., 2k, 2)
        words = words.reshape(*words.shape[:-2], -1)
    return words


def _meta_unpack(words, k):
    """Inverse of _meta_words, from uint32 or uint16 words."""
    if words.dtype == jnp.uint16:
        words = jax.lax.bitcast_convert_type(words.reshape(*words.shape[:-1], 2 * k, 2),
                                             jnp.uint32)
    return (jax.lax.bitcast_convert_type(words[..., :k], jnp.float32),
            jax.lax.bitcast_convert_type(words[..., k:], jnp.int32))


def _meta_row_count(n, words, hidden):
    return max(1, math.ceil(n * words / hidden))


def _meta_rows(meta, hidden):
    """(B, N, m) -> (B, R, hidden): the words laid out row after row, 0-padded."""
    b, n, m = meta.shape
    r = _meta_row_count(n, m, hidden)
    flat = meta.reshape(b, n * m)
    flat = jnp.pad(flat, ((0, 0), (0, r * hidden - n * m)))
    return flat.reshape(b, r, hidden)


def _rows_meta(rows, n, m):
    """Inverse of _meta_rows: (B, R, hidden) -> (B, N, m)."""
    b = rows.shape[0]
    return rows.reshape(b, -1)[:, : n * m].reshape(b, n, m)
