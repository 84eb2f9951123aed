"""Property tests of attention: prefill_attention on random packings
(cu_seqlens with empty sequences and padding, max_seqlen layouts) against the
twin and a float64 numpy oracle; paged_decode_attention on random page
tables and lengths; write_kv on random slots."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from attention_cases import PREFILL_RTOL, check_decode, make_cache, prefill_np, ref_prefill, \
    ref_write_kv
from common import assert_close, assert_equal, normal
from jax_moe import attention
from property_common import MARKS, dtypes, scaled, seeds, sizes

pytestmark = MARKS

prefill = jax.jit(attention.prefill_attention, static_argnames=("causal", "max_seqlen"))
write_kv = jax.jit(attention.write_kv)


@st.composite
def heads(draw):
    """(Hq, Hkv): GQA groups of 1, 2 or 4 query heads."""
    hkv = draw(st.integers(1, 2))
    return hkv * draw(st.sampled_from([1, 2, 4])), hkv


@given(seed=seeds, lens=st.lists(sizes(24), min_size=0, max_size=scaled(5)), pad=sizes(6),
       hh=heads(), d=st.sampled_from([8, 16, 40, 64]), causal=st.booleans(),
       padded=st.booleans(), dtype=dtypes)
def test_prefill(seed, lens, pad, hh, d, causal, padded, dtype):
    hq, hkv = hh
    rng = np.random.default_rng(seed)
    n = sum(lens) + pad
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    q, k, v = (normal(rng, (n, h, d), dtype) for h in (hq, hkv, hkv))
    # max_seqlen: the padded-batch path (any bound >= the longest sequence)
    m = max(lens, default=0) + int(rng.integers(0, 3)) if padded and lens else None
    out = prefill(q, k, v, cu, causal=causal, max_seqlen=m)
    assert out.shape == (n, hq, d) and out.dtype == dtype
    rtol = PREFILL_RTOL[jnp.dtype(dtype)]
    want = prefill_np(q, k, v, cu, causal, 1.0 / np.sqrt(d))
    assert_close(out, want, dtype, "prefill vs numpy", rtol=rtol)
    assert_close(ref_prefill(q, k, v, cu, causal=causal), want, dtype, "twin vs numpy",
                 rtol=rtol)


@given(seed=seeds, lengths=st.lists(sizes(70), min_size=1, max_size=scaled(4)),
       page_size=st.sampled_from([1, 3, 16]), hh=heads(), d=st.sampled_from([8, 64, 72]),
       share=st.booleans(), extra=st.integers(0, 2), dtype=dtypes)
def test_paged_decode(seed, lengths, page_size, hh, d, share, extra, dtype):
    """Pages in a random order with spare ones, the unused table entries -1,
    optionally a shared first page, extra table columns."""
    hq, hkv = hh
    rng = np.random.default_rng(seed)
    need = max(1, -(-max(lengths) // page_size))
    kp, vp, table, ln = make_cache(rng, lengths, page_size, hkv, d, dtype,
                                   max_pages=need + extra, share=share)
    q = normal(rng, (len(lengths), hq, d), dtype)
    check_decode(q, kp, vp, table, ln, dtype)


@given(seed=seeds, pages=st.integers(1, 6), page_size=st.sampled_from([1, 4, 16]),
       tokens=sizes(30), hkv=st.integers(1, 2), dv=st.sampled_from([8, 24]), dtype=dtypes)
def test_write_kv(seed, pages, page_size, tokens, hkv, dv, dtype):
    """Distinct random slots, some negative (padding) or past the cache
    (skipped): against the twin and a numpy scatter."""
    rng = np.random.default_rng(seed)
    cap = pages * page_size
    slots = rng.permutation(cap + tokens)[:tokens] - int(rng.integers(0, 3))
    slots = np.where(slots >= cap, cap + np.arange(tokens), slots).astype(np.int32)
    slots[slots < 0] = -1 - np.arange(tokens)[slots < 0]  # distinct negative ones too
    kp = normal(rng, (pages, page_size, hkv, 16), dtype)
    vp = normal(rng, (pages, page_size, hkv, dv), dtype)
    k, v = normal(rng, (tokens, hkv, 16), dtype), normal(rng, (tokens, hkv, dv), dtype)
    s = jnp.asarray(slots)
    got_k, got_v = write_kv(kp, vp, k, v, s)
    ref_k, ref_v = ref_write_kv(kp, vp, k, v, s)
    want_k, want_v = np.asarray(kp).copy(), np.asarray(vp).copy()
    for i, slot in enumerate(slots):
        if 0 <= slot < cap:
            want_k[slot // page_size, slot % page_size] = np.asarray(k)[i]
            want_v[slot // page_size, slot % page_size] = np.asarray(v)[i]
    for name, a, b in (("k", got_k, want_k), ("v", got_v, want_v), ("twin k", ref_k, want_k),
                       ("twin v", ref_v, want_v)):
        assert_equal(a, b, name)
