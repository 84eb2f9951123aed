"""Pure jax.numpy twins of jax_moe.attention (same names, signatures and
semantics): the test oracle and a fallback.

Semantics shared with the kernels:
- write_kv: slots outside [0, num_pages * page_size) are skipped.
- paged_decode_attention: lengths are clamped to [0, max_pages * page_size];
  tokens whose page id lies outside [0, num_pages) are skipped (masked out); a
  sequence with no valid token gets a zero output. Softmax in f32. V's head
  dim (v_pages' last axis, the output's) may differ from K's.
- Index arguments of any integer dtype reach int32 saturated
  (_attention_checks.index_int32): a 64-bit value past int32 is out of range,
  never wrapped.
- prefill_attention: a query reads only the keys of its own sequence; padding
  tokens are never read. A non-finite k or v value makes NaN of exactly the
  queries that attend to it (the kernel path's default layout does the same;
  with max_seqlen, other rows of that sequence may be NaN too). cu_seqlens
  outside its contract make the whole output NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _attention_checks as _ac
from jax_moe import _checks

__all__ = ["write_kv", "paged_decode_attention", "prefill_attention", "attention_dispatch",
           "segment_ids", "fill_rows"]


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    _ac.write_kv_args(k_pages, v_pages, k, v, slot_mapping)
    p, ps, hkv, d = k_pages.shape
    num_slots = p * ps
    s = _ac.index_int32(slot_mapping)
    s = jnp.where((s >= 0) & (s < num_slots), s, num_slots)  # out of bounds: dropped
    kf = k_pages.reshape(num_slots, hkv, d).at[s].set(k, mode="drop")
    vf = v_pages.reshape(num_slots, hkv, v_pages.shape[3]).at[s].set(v, mode="drop")
    return kf.reshape(k_pages.shape), vf.reshape(v_pages.shape)


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale=None,
                           split_tokens=None):
    """The twin of jax_moe.attention.paged_decode_attention; split_tokens is
    checked for signature parity, not used."""
    scale = _ac.decode_args(q, k_pages, v_pages, page_table, lengths, scale)
    _ac.decode_split_tokens(split_tokens, page_table.shape[1] * k_pages.shape[1])
    b, hq, d = q.shape
    p, ps, hkv, _ = k_pages.shape
    dv = v_pages.shape[3]
    g = hq // hkv
    mp = page_table.shape[1]
    t = jnp.arange(mp * ps)
    pages = _ac.index_int32(page_table)[:, t // ps]                        # (B, T)
    ln = jnp.clip(_ac.index_int32(lengths), 0, mp * ps)
    valid = (t[None, :] < ln[:, None]) & (pages >= 0) & (pages < p)
    slots = jnp.where(valid, pages * ps + t[None, :] % ps, 0)
    kk = k_pages.reshape(p * ps, hkv, d)[slots].astype(jnp.float32)       # (B, T, Hkv, D)
    vv = v_pages.reshape(p * ps, hkv, dv)[slots].astype(jnp.float32)     # (B, T, Hkv, Dv)
    qf = q.astype(jnp.float32).reshape(b, hkv, g, d) * scale
    s = jnp.einsum("bhgd,bthd->bhgt", qf, kk, precision=jax.lax.Precision.HIGHEST)
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(valid[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bhgt,bthd->bhgd", e, vv, precision=jax.lax.Precision.HIGHEST)
    o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
    return o.reshape(b, hq, dv).astype(q.dtype)


def fill_rows(x, start, poison):
    """The twin of jax_moe.attention.fill_rows: rows start .. N-1 of x set to
    0 (start clamped to [0, N]), or every element NaN where poison is true."""
    start, poison = _ac.fill_rows_args(x, start, poison)
    rows = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
    zeroed = jnp.where(rows >= start, jnp.zeros((), x.dtype), x)
    return jnp.where(poison != 0, jnp.asarray(jnp.nan, x.dtype), zeroed)


def segment_ids(cu_seqlens, n: int):
    """(N,) int32: sequence index of each packed token; tokens past
    cu_seqlens[-1] get -1 (padding)."""
    pos = jnp.arange(n, dtype=jnp.int32)
    cu = _ac.index_int32(cu_seqlens)
    seg = jnp.searchsorted(cu[1:], pos, side="right").astype(jnp.int32)
    return jnp.where(pos < cu[-1], seg, -1)


def prefill_attention(q, k, v, cu_seqlens, *, causal=True, scale=None):
    """Dense jnp attention over each packed sequence (f32 softmax); padding
    tokens (past cu_seqlens[-1]) get a zero output.

    Sequences are isolated: each query reads only the keys it attends to.
    Non-finite k, v values are replaced by 0 in the products (so that a
    masked-out key's 0 * NaN never happens) and the queries that attend to
    them get NaN: in every element of that kv head's query heads for k, in
    the element's own position for v. cu_seqlens outside its contract (not
    starting at 0, decreasing, ending past N) make the whole output NaN."""
    scale = _ac.prefill_args(q, k, v, cu_seqlens, scale)
    causal = _ac.causal_flag(causal)
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if n == 0:  # no tokens: nothing to attend (the reductions below need a row)
        return jnp.zeros((0, hq, v.shape[2]), q.dtype)
    seg = segment_ids(cu_seqlens, n)
    mask = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    if causal:
        mask &= jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    # (N, Hkv, D): the k, v elements that a query reading key row j must not
    # come out finite from
    nonfinite = ~jnp.all(jnp.isfinite(kf), axis=-1, keepdims=True) | ~jnp.isfinite(vf)
    kf = jnp.where(jnp.isfinite(kf), kf, 0.0)
    vf = jnp.where(jnp.isfinite(vf), vf, 0.0)
    qf = q.astype(jnp.float32).reshape(n, hkv, g, d) * scale
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("qhgd,khd->hgqk", qf, kf, precision=hi)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("hgqk,khd->qhgd", e / jnp.where(l > 0, l, 1.0), vf, precision=hi)
    # Non-finite elements each query attends to, counted through the mask.
    hits = jnp.einsum("qk,khd->qhd", mask.astype(jnp.float32), nonfinite.astype(jnp.float32),
                      precision=hi)
    o = jnp.where(hits[:, :, None, :] > 0, jnp.nan, o)
    o = jnp.where(_ac.cu_seqlens_violated(cu_seqlens, n), jnp.nan, o)
    return o.reshape(n, hq, d).astype(q.dtype)


def dispatch_steps(write_kv_fn, prefill_fn, decode_fn, q, k, v, k_pages, v_pages, page_table,
                   lengths, cu_seqlens, is_decode, slot_mapping, scale, split_tokens):
    """attention_dispatch built from the three ops it is given (the kernels'
    or their twins'): write every new token, prefill over the packed batch
    (decode tokens as sequences of one, replaced), decode over the B
    sequences' first tokens (prefill sequences with length 0: nothing read),
    then a select per row; a decode sequence with other than one new token
    gets NaN rows, and cu_seqlens outside its contract make every row NaN."""
    # Every op's checks first, so that bad input raises before any kernel runs.
    _ac.dispatch_args(q, cu_seqlens, is_decode)
    _ac.write_kv_args(k_pages, v_pages, k, v, slot_mapping)
    _ac.prefill_args(q, k, v, cu_seqlens, scale)
    n = q.shape[0]
    b = is_decode.shape[0]
    _checks.rank(lengths, "lengths", 1)
    _checks.int_dtype(lengths, "lengths")
    if lengths.shape[0] != b:
        raise ValueError(f"lengths must have B={b} entries (len(cu_seqlens) - 1), "
                         f"got {lengths.shape[0]}")
    decode_lengths = jnp.where(is_decode, _ac.index_int32(lengths), 0)
    _ac.decode_args(jax.ShapeDtypeStruct((b,) + q.shape[1:], q.dtype), k_pages, v_pages,
                    page_table, decode_lengths, scale)
    _ac.decode_split_tokens(split_tokens, page_table.shape[1] * k_pages.shape[1])
    k_pages, v_pages = write_kv_fn(k_pages, v_pages, k, v, slot_mapping)
    cu = _ac.index_int32(cu_seqlens)
    prefill_out = prefill_fn(q, k, v, cu)
    if n == 0 or b == 0:  # no query token, or no sequence: prefill's zeros
        return prefill_out, k_pages, v_pages
    q_first = jnp.take(q, cu[:-1], axis=0, mode="fill", fill_value=0)  # (B, Hq, D)
    decode_out = decode_fn(q_first, k_pages, v_pages, page_table, decode_lengths)
    seg = segment_ids(cu, n)
    seq = jnp.clip(seg, 0, b - 1)
    row_decode = (seg >= 0) & is_decode[seq]
    # cu_seqlens outside its contract: every row NaN, as prefill's are
    row_bad = (row_decode & ((cu[1:] - cu[:-1])[seq] != 1)) | _ac.cu_seqlens_violated(cu, n)
    out = jnp.where(row_decode[:, None, None], decode_out[seq], prefill_out)
    return (jnp.where(row_bad[:, None, None], jnp.asarray(jnp.nan, out.dtype), out),
            k_pages, v_pages)


def attention_dispatch(q, k, v, k_pages, v_pages, page_table, lengths, cu_seqlens, is_decode,
                       slot_mapping, *, scale=None, max_seqlen=None, implementation=None,
                       split_tokens=None):
    """The twin of jax_moe.attention.attention_dispatch; max_seqlen and
    split_tokens are checked for signature parity, implementation is not
    used."""
    _ac.prefill_max_seqlen(q, cu_seqlens, max_seqlen)

    def decode(qd, kp, vp, pt, ln):
        return paged_decode_attention(qd, kp, vp, pt, ln, scale=scale, split_tokens=split_tokens)

    return dispatch_steps(write_kv, lambda q_, k_, v_, cu: prefill_attention(
        q_, k_, v_, cu, causal=True, scale=scale), decode, q, k, v, k_pages, v_pages, page_table,
        lengths, cu_seqlens, is_decode, slot_mapping, scale, split_tokens)
