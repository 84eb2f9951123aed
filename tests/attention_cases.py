"""Helpers shared by the attention tests (tests/attention/): the jitted
reference ops, plain numpy float64 oracles (dense attention, paged decode,
packed prefill) and random paged caches and packed batches."""

import jax
import jax.numpy as jnp
import numpy as np

from common import assert_close, normal
from jax_moe import attention, attention_reference

ref_write_kv = jax.jit(attention_reference.write_kv)
ref_decode = jax.jit(attention_reference.paged_decode_attention, static_argnames=("scale",))
ref_prefill = jax.jit(attention_reference.prefill_attention, static_argnames=("causal", "scale"))
# The XLA prefill path rounds the probabilities to the input dtype before P.V
# (jax.nn.dot_product_attention's XLA implementation): allow twice the ulp.
PREFILL_RTOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
                jnp.dtype(jnp.float16): 4e-3}


# ---- numpy float64 oracles --------------------------------------------------

def dense_attention_np(q, k, v, scale, causal_offset=None):
    """q (Tq, Hq, Dk), k (Tk, Hkv, Dk), v (Tk, Hkv, Dv) float64 -> (Tq, Hq, Dv);
    causal_offset: query i sees keys j <= i + causal_offset. No keys: zeros."""
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = np.zeros((tq, hq, v.shape[2]))
    if k.shape[0] == 0:
        return out
    for h in range(hq):
        s = (q[:, h, :] @ k[:, h // g, :].T) * scale  # (Tq, Tk)
        if causal_offset is not None:
            allowed = np.arange(k.shape[0])[None, :] <= np.arange(tq)[:, None] + causal_offset
            s = np.where(allowed, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[:, h, :] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // g, :]
    return out


def decode_np(q, k_pages, v_pages, page_table, lengths, scale):
    q, kp, vp = (np.asarray(a).astype(np.float64) for a in (q, k_pages, v_pages))
    pt, ln = np.asarray(page_table), np.asarray(lengths)
    ps = kp.shape[1]
    out = np.zeros(q.shape[:2] + vp.shape[3:])
    for b in range(q.shape[0]):
        toks = [(pt[b, t // ps], t % ps) for t in range(ln[b])]
        toks = [(p, o) for p, o in toks if 0 <= p < kp.shape[0]]
        k = np.array([kp[p, o] for p, o in toks]).reshape(len(toks), *kp.shape[2:])
        v = np.array([vp[p, o] for p, o in toks]).reshape(len(toks), *vp.shape[2:])
        out[b] = dense_attention_np(q[b:b + 1], k, v, scale)[0]
    return out


# ---- random paged caches ----------------------------------------------------

def make_cache(rng, lengths, page_size, hkv, d, dtype, extra_pages=3, max_pages=None,
               share=False, dv=None):
    """Caches with the pages of all sequences in a random order (and spare
    pages); share=True makes the first page of every sequence the same page
    (a shared prefix). K's head dim d, V's dv (default d)."""
    need = [max(1, -(-int(n) // page_size)) for n in lengths]
    max_pages = max(need) + 1 if max_pages is None else max_pages
    total = sum(need) + extra_pages
    perm = rng.permutation(total)
    table = np.full((len(lengths), max_pages), -1, np.int32)  # unused entries: -1
    i = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[i:i + n]
        i += n
    if share:
        table[:, 0] = table[0, 0]
    kp = normal(rng, (total, page_size, hkv, d), dtype)
    vp = normal(rng, (total, page_size, hkv, d if dv is None else dv), dtype)
    return kp, vp, jnp.asarray(table), jnp.asarray(np.asarray(lengths, np.int32))


def check_decode(q, kp, vp, table, lengths, dtype, scale=None):
    s = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    out = attention.paged_decode_attention(q, kp, vp, table, lengths, scale=scale)
    assert out.shape == q.shape[:2] + vp.shape[3:] and out.dtype == q.dtype
    want_ref = ref_decode(q, kp, vp, table, lengths, scale=scale)
    assert_close(out, want_ref, dtype, "decode vs reference")
    assert_close(out, decode_np(q, kp, vp, table, lengths, s), dtype, "decode vs numpy")
    assert_close(want_ref, decode_np(q, kp, vp, table, lengths, s), dtype, "reference vs numpy")
    return out


def prefill_np(q, k, v, cu, causal, scale):
    q, k, v = (np.asarray(a).astype(np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    cu = np.asarray(cu)
    for a, b in zip(cu[:-1], cu[1:]):
        out[a:b] = dense_attention_np(q[a:b], k[a:b], v[a:b], scale, 0 if causal else None)
    return out


# ---- packed prefill batches (max_seqlen: padded batch + sequence lengths) --

prefill_jit = jax.jit(attention.prefill_attention,
                      static_argnames=("causal", "scale", "implementation", "max_seqlen"))


def packed_inputs(rng, lens, n, hq, hkv, d, dtype):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] <= n
    q = normal(rng, (n, hq, d), dtype)
    k, v = normal(rng, (n, hkv, d), dtype), normal(rng, (n, hkv, d), dtype)
    return q, k, v, cu


# layout -> (lengths, N, max_seqlen): "reshape" has N == B * max_seqlen (no
# gather), "reshape_tail" the same with the last sequence short (padding
# tokens at the end), "gather" unequal lengths, an empty sequence and padding.
MAX_SEQLEN_LAYOUTS = {
    "reshape": ([16, 16, 16], 48, 16),
    "reshape_tail": ([16, 16, 9], 48, 16),
    "gather": ([5, 16, 0, 1, 11], 40, 16),
}


# ---- small paged-decode arguments (for the error tests) --------------------

def decode_inputs(b=2, hq=4, hkv=2, d=64, pages=4, ps=16, mp=2, dtype=jnp.float32, dv=None):
    q = jnp.zeros((b, hq, d), dtype)
    kp = jnp.zeros((pages, ps, hkv, d), dtype)
    vp = kp if dv is None else jnp.zeros((pages, ps, hkv, dv), dtype)
    return q, kp, vp, jnp.zeros((b, mp), jnp.int32), jnp.ones((b,), jnp.int32)
