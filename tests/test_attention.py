"""jax_moe.attention: write_kv, paged_decode_attention (FFI, CPU + CUDA) and
prefill_attention, each against its jnp twin (attention_reference) and a plain
numpy float64 dense attention over the same tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, on_cpu
from jax_moe import _attention_checks as _ac
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
    """q (Tq, Hq, D), k/v (Tk, Hkv, D) float64 -> (Tq, Hq, D); causal_offset: query
    i sees keys j <= i + causal_offset. No keys: zeros."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = np.zeros((tq, hq, d))
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
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        toks = [(pt[b, t // ps], t % ps) for t in range(ln[b])]
        toks = [(p, o) for p, o in toks if 0 <= p < kp.shape[0]]
        k = np.array([kp[p, o] for p, o in toks]).reshape(len(toks), *kp.shape[2:])
        v = np.array([vp[p, o] for p, o in toks]).reshape(len(toks), *vp.shape[2:])
        out[b] = dense_attention_np(q[b:b + 1], k, v, scale)[0]
    return out


# ---- random paged caches ----------------------------------------------------

def make_cache(rng, lengths, page_size, hkv, d, dtype, extra_pages=3, max_pages=None,
               share=False):
    """Caches with the pages of all sequences in a random order (and spare
    pages); share=True makes the first page of every sequence the same page
    (a shared prefix)."""
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
    vp = normal(rng, (total, page_size, hkv, d), dtype)
    return kp, vp, jnp.asarray(table), jnp.asarray(np.asarray(lengths, np.int32))


def check_decode(q, kp, vp, table, lengths, dtype, scale=None):
    s = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    out = attention.paged_decode_attention(q, kp, vp, table, lengths, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    want_ref = ref_decode(q, kp, vp, table, lengths, scale=scale)
    assert_close(out, want_ref, dtype, "decode vs reference")
    assert_close(out, decode_np(q, kp, vp, table, lengths, s), dtype, "decode vs numpy")
    assert_close(want_ref, decode_np(q, kp, vp, table, lengths, s), dtype, "reference vs numpy")
    return out


# ---- write_kv ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [16, 32])
def test_write_kv_matches_reference(rng, dtype, page_size):
    pages, hkv, d, n = 6, 2, 64, 20
    kp, vp = normal(rng, (pages, page_size, hkv, d), dtype), normal(rng, (pages, page_size, hkv, d), dtype)
    k, v = normal(rng, (n, hkv, d), dtype), normal(rng, (n, hkv, d), dtype)
    slots = rng.choice(pages * page_size, size=n, replace=False).astype(np.int32)
    slots[rng.choice(n, size=4, replace=False)] = -1  # padding tokens
    slots = jnp.asarray(slots)
    got = attention.write_kv(kp, vp, k, v, slots)
    want = ref_write_kv(kp, vp, k, v, slots)
    for g, w, what in zip(got, want, ("k_pages", "v_pages")):
        assert_equal(g, w, what)
    # every valid slot holds its token; the rest is untouched
    flat_k = np.asarray(got[0]).reshape(-1, hkv, d)
    s = np.asarray(slots)
    assert_equal(flat_k[s[s >= 0]], np.asarray(k)[s >= 0], "written rows")
    untouched = np.setdiff1d(np.arange(pages * page_size), s)
    assert_equal(flat_k[untouched], np.asarray(kp).reshape(-1, hkv, d)[untouched], "other rows")


def test_write_kv_skips_out_of_range_under_jit(rng):
    """Under jit the values are unknown: slots past the cache are skipped."""
    kp, vp = normal(rng, (3, 16, 1, 64), jnp.float32), normal(rng, (3, 16, 1, 64), jnp.float32)
    k, v = normal(rng, (4, 1, 64), jnp.float32), normal(rng, (4, 1, 64), jnp.float32)
    slots = jnp.asarray([5, 48, 10**6, -7], jnp.int32)
    got = jax.jit(attention.write_kv)(kp, vp, k, v, slots)
    want = ref_write_kv(kp, vp, k, v, slots)
    assert_equal(got[0], want[0], "k_pages")
    assert_equal(got[1], want[1], "v_pages")
    assert_equal(np.asarray(got[0]).reshape(-1, 1, 64)[5], np.asarray(k)[0], "slot 5")


def test_write_kv_in_place_with_donation(rng):
    kp, vp = normal(rng, (8, 16, 2, 64), jnp.float32), normal(rng, (8, 16, 2, 64), jnp.float32)
    k, v = normal(rng, (3, 2, 64), jnp.float32), normal(rng, (3, 2, 64), jnp.float32)
    slots = jnp.asarray([0, 17, 127], jnp.int32)
    want = ref_write_kv(kp, vp, k, v, slots)
    step = jax.jit(attention.write_kv, donate_argnums=(0, 1))
    hlo = step.lower(kp, vp, k, v, slots).as_text()
    assert "output_operand_aliases" in hlo or "tf.aliasing_output" in hlo
    ptr_k, ptr_v = kp.unsafe_buffer_pointer(), vp.unsafe_buffer_pointer()
    nk, nv = step(kp, vp, k, v, slots)
    assert kp.is_deleted() and vp.is_deleted()
    assert nk.unsafe_buffer_pointer() == ptr_k and nv.unsafe_buffer_pointer() == ptr_v
    assert_equal(nk, want[0], "k_pages")
    assert_equal(nv, want[1], "v_pages")


# ---- paged decode -----------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [16, 32, 64])
# 3: heads idle in a block; 12: two blocks of 8, 20: three
@pytest.mark.parametrize("gqa", [1, 3, 4, 8, 12, 20])
def test_decode_matches_reference_and_numpy(rng, dtype, page_size, gqa):
    d = int(rng.choice([64, 128, 256]))
    hkv = 2 if gqa < 8 else 1
    # lengths: 1, a full last page, a non-multiple, a long one
    lengths = [1, 2 * page_size, int(rng.integers(2, 3 * page_size)) | 1, 5 * page_size - 3]
    kp, vp, table, ln = make_cache(rng, lengths, page_size, hkv, d, dtype)
    q = normal(rng, (len(lengths), hkv * gqa, d), dtype)
    check_decode(q, kp, vp, table, ln, dtype)


def test_decode_shared_pages_and_scale(rng):
    dtype = jnp.float32
    kp, vp, table, ln = make_cache(rng, [40, 33, 16, 64], 16, 2, 128, dtype, share=True)
    q = normal(rng, (4, 8, 128), dtype)
    check_decode(q, kp, vp, table, ln, dtype, scale=0.05)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("st", [64, 256, 2048])
def test_decode_long_sequences_many_splits(rng, dtype, st):
    """Longer than several CUDA splits of split_tokens, lengths not on a split
    boundary; the result does not depend on the split beyond rounding."""
    kp, vp, table, ln = make_cache(rng, [3 * st + 17, st, 1], 32, 2, 64, dtype)
    q = normal(rng, (3, 4, 64), dtype)
    out = jax.jit(functools.partial(attention.paged_decode_attention, split_tokens=st))(
        q, kp, vp, table, ln)
    s = 1 / np.sqrt(64)
    assert_close(out, decode_np(q, kp, vp, table, ln, s), dtype, "decode vs numpy")
    assert_close(out, check_decode(q, kp, vp, table, ln, dtype), dtype, "vs automatic split")


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("page_size,st", [(1, 2048), (3, 64), (48, 128), (100, 64)])
def test_decode_splits_starting_mid_page(rng, dtype, page_size, st):
    """Page sizes that do not divide split_tokens: splits begin inside a page
    (the CUDA kernels' page lookups start at an offset), and page 1 with a
    whole 2048-token split (2048 page ids for one block)."""
    lengths = [3 * st + 17, st + page_size, 2 * st, 1]
    kp, vp, table, ln = make_cache(rng, lengths, page_size, 2, 64, dtype)
    q = normal(rng, (len(lengths), 8, 64), dtype)
    out = jax.jit(functools.partial(attention.paged_decode_attention, split_tokens=st))(
        q, kp, vp, table, ln)
    assert_close(out, ref_decode(q, kp, vp, table, ln), dtype, "decode vs reference")
    assert_close(out, decode_np(q, kp, vp, table, ln, 1 / np.sqrt(64)), dtype, "vs numpy")


def test_decode_split_constants_match_the_extension():
    assert attention.DECODE_SPLIT_UNIT == _ac.DECODE_SPLIT_UNIT
    assert attention.DECODE_MAX_SPLIT_TOKENS == _ac.DECODE_MAX_SPLIT_TOKENS


def test_decode_split_tokens_rule():
    # long splits while the GPU still gets enough blocks; never past the capacity
    assert attention.decode_split_tokens(64, 32, 8, 4096, jnp.bfloat16) == 1024
    assert attention.decode_split_tokens(8, 32, 8, 32768, jnp.bfloat16) == 1024
    assert attention.decode_split_tokens(64, 32, 8, 16384, jnp.bfloat16) == 2048
    assert attention.decode_split_tokens(1, 32, 8, 4096, jnp.bfloat16) == 256
    assert attention.decode_split_tokens(512, 32, 8, 300, jnp.bfloat16) == 512
    assert attention.decode_split_tokens(4096, 64, 8, 1 << 20, jnp.float32) == 2048


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_decode_zero_length_gives_zero(rng, dtype):
    kp, vp, table, ln = make_cache(rng, [0, 5], 16, 1, 64, dtype)
    q = normal(rng, (2, 2, 64), dtype)
    out = check_decode(q, kp, vp, table, ln, dtype)
    assert_equal(out[0], jnp.zeros((2, 64), dtype), "empty sequence")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_decode_empty_sequences_between_split_ones(rng, dtype):
    """Empty sequences beside ones of many splits (the GPU's combine merges
    only the splits that hold tokens), a length on a split boundary, and two
    head chunks (GQA 12)."""
    st = 64
    lengths = [0, 5 * st + 17, 0, st, 2 * st]
    kp, vp, table, ln = make_cache(rng, lengths, 16, 2, 64, dtype)
    q = normal(rng, (len(lengths), 24, 64), dtype)
    f = jax.jit(functools.partial(attention.paged_decode_attention, split_tokens=st))
    out = f(q, kp, vp, table, ln)
    assert_close(out, ref_decode(q, kp, vp, table, ln), dtype, "decode vs reference")
    for i in (0, 2):
        assert_equal(out[i], jnp.zeros((24, 64), dtype), f"empty sequence {i}")
    assert_equal(out, f(q, kp, vp, table, ln), "run to run")


def test_decode_bad_values_under_jit_are_skipped(rng):
    """Under jit nothing can be checked: lengths are clamped to the table's
    capacity and tokens on page ids outside [0, P) are skipped, as the
    reference does."""
    kp, vp, table, _ = make_cache(rng, [30, 20, 16], 16, 2, 64, jnp.float32, max_pages=2)
    table = np.asarray(table).copy()
    table[0, 1] = 10**6     # second page of sequence 0 is invalid: its tokens are skipped
    table[1, 0] = -5        # first page of sequence 1 invalid
    table[2, :] = -1        # no valid page at all: output 0
    lengths = jnp.asarray([30, 10**6, 16], jnp.int32)  # 10**6 is clamped to 32
    table = jnp.asarray(table)
    q = normal(rng, (3, 4, 64), jnp.float32)
    out = jax.jit(attention.paged_decode_attention)(q, kp, vp, table, lengths)
    want = ref_decode(q, kp, vp, table, lengths)
    assert_close(out, want, jnp.float32, "decode vs reference")
    clamped = jnp.asarray([30, 32, 16], jnp.int32)
    assert_close(out, decode_np(q, kp, vp, table, clamped, 1 / 8), jnp.float32, "vs numpy")
    assert_equal(out[2], np.zeros((4, 64), np.float32), "no valid page")


def test_decode_is_deterministic(rng):
    kp, vp, table, ln = make_cache(rng, [300, 77], 16, 2, 128, jnp.bfloat16)
    q = normal(rng, (2, 8, 128), jnp.bfloat16)
    f = jax.jit(attention.paged_decode_attention)
    assert_equal(f(q, kp, vp, table, ln), f(q, kp, vp, table, ln), "two runs")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_write_kv_then_decode_is_dense_attention(rng, dtype):
    """A prefill of each sequence's tokens through write_kv (pages in random
    order, padded slot_mapping), then a decode step: dense attention over the
    written tokens."""
    page_size, hkv, gqa, d = 16, 2, 4, 64
    lengths = [1, 16, 37]
    kp, vp, table, ln = make_cache(rng, lengths, page_size, hkv, d, dtype)
    kp, vp = jnp.zeros_like(kp), jnp.zeros_like(vp)
    toks_k = [normal(rng, (n, hkv, d), dtype) for n in lengths]
    toks_v = [normal(rng, (n, hkv, d), dtype) for n in lengths]
    tbl = np.asarray(table)
    slots = [tbl[b, t // page_size] * page_size + t % page_size
             for b, n in enumerate(lengths) for t in range(n)]
    pad = 5
    slot_mapping = jnp.asarray(np.array(slots + [-1] * pad, np.int32))
    k = jnp.concatenate(toks_k + [jnp.zeros((pad, hkv, d), dtype)])
    v = jnp.concatenate(toks_v + [jnp.zeros((pad, hkv, d), dtype)])
    step = jax.jit(attention.write_kv, donate_argnums=(0, 1))
    kp, vp = step(kp, vp, k, v, slot_mapping)
    q = normal(rng, (3, hkv * gqa, d), dtype)
    out = jax.jit(attention.paged_decode_attention)(q, kp, vp, table, ln)
    want = np.stack([dense_attention_np(np.asarray(q[b:b + 1]).astype(np.float64),
                                        np.asarray(toks_k[b]).astype(np.float64),
                                        np.asarray(toks_v[b]).astype(np.float64),
                                        1 / np.sqrt(d))[0] for b in range(3)])
    assert_close(out, want, dtype, "write_kv + decode vs dense")


# ---- prefill ----------------------------------------------------------------

def prefill_np(q, k, v, cu, causal, scale):
    q, k, v = (np.asarray(a).astype(np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    cu = np.asarray(cu)
    for a, b in zip(cu[:-1], cu[1:]):
        out[a:b] = dense_attention_np(q[a:b], k[a:b], v[a:b], scale, 0 if causal else None)
    return out


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_prefill_matches_reference_and_numpy(rng, dtype, causal, gqa):
    n, hkv, d = 96, 1 if gqa == 8 else 2, int(rng.choice([64, 128]))
    # sequences of length 1, random lengths, and padding at the end
    lens = [1] + list(rng.integers(2, 30, size=3))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] < n
    q = normal(rng, (n, hkv * gqa, d), dtype)
    k, v = normal(rng, (n, hkv, d), dtype), normal(rng, (n, hkv, d), dtype)
    cu_j = jnp.asarray(cu)
    out = jax.jit(attention.prefill_attention, static_argnames=("causal",))(q, k, v, cu_j, causal=causal)
    want = prefill_np(q, k, v, cu, causal, 1 / np.sqrt(d))
    assert out.shape == q.shape and out.dtype == q.dtype
    rtol = PREFILL_RTOL[jnp.dtype(dtype)]
    assert_close(out, want, dtype, "prefill vs numpy", rtol=rtol)
    assert_close(ref_prefill(q, k, v, cu_j, causal=causal), want, dtype, "reference vs numpy")
    assert_close(out, ref_prefill(q, k, v, cu_j, causal=causal), dtype, "prefill vs reference",
                 rtol=rtol)
    assert_equal(out[cu[-1]:], np.zeros_like(np.asarray(out[cu[-1]:])), "padding rows")


def test_prefill_path():
    q = jnp.zeros((8, 4, 64), jnp.bfloat16)
    k = jnp.zeros((8, 2, 64), jnp.bfloat16)
    cu = jnp.asarray([0, 3, 8], jnp.int32)
    want = "cudnn" if attention._cudnn_ok(q) else "xla"
    assert attention.prefill_path(q, k, k, cu) == want
    assert attention.prefill_path(q, k, k, cu, implementation="xla") == "xla"
    if jax.default_backend() == "cpu":
        assert want == "xla"
    with pytest.raises(ValueError, match="implementation"):
        attention.prefill_path(q, k, k, cu, implementation="flash")
    assert attention.prefill_path(q, k, k, cu, max_seqlen=5) == want + "_padded"
    assert attention.prefill_path(q, k, k, cu, implementation="xla", max_seqlen=5) == "xla_padded"


# ---- prefill with max_seqlen (padded batch + sequence lengths) --------------

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


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("layout", list(MAX_SEQLEN_LAYOUTS))
def test_prefill_max_seqlen_matches_reference(rng, dtype, causal, gqa, layout):
    lens, n, m = MAX_SEQLEN_LAYOUTS[layout]
    hkv, d = 2, 64
    q, k, v, cu = packed_inputs(rng, lens, n, hkv * gqa, hkv, d, dtype)
    cu_j = jnp.asarray(cu)
    want_path = ("cudnn" if attention._cudnn_ok(q) else "xla") + "_padded"
    assert attention.prefill_path(q, k, v, cu_j, causal=causal, max_seqlen=m) == want_path
    out = prefill_jit(q, k, v, cu_j, causal=causal, max_seqlen=m)
    assert out.shape == q.shape and out.dtype == q.dtype
    rtol = PREFILL_RTOL[jnp.dtype(dtype)]
    assert_close(out, prefill_np(q, k, v, cu, causal, 1 / np.sqrt(d)), dtype, "vs numpy", rtol=rtol)
    assert_close(out, ref_prefill(q, k, v, cu_j, causal=causal), dtype, "vs reference", rtol=rtol)
    # padding rows are 0 (-0.0 on the reshape layout: the padded query rows)
    assert np.all(np.asarray(out[cu[-1]:]) == 0), "padding rows"
    # the segment-mask path agrees (same implementation, other layout)
    assert_close(out, prefill_jit(q, k, v, cu_j, causal=causal), dtype, "vs segment mask",
                 rtol=rtol)
    # N == B * max_seqlen is a reshape: no gather anywhere in the program
    jaxpr = str(jax.make_jaxpr(lambda *a: attention.prefill_attention(
        *a, causal=causal, max_seqlen=m))(q, k, v, cu_j))
    assert ("gather" in jaxpr) == (layout == "gather"), layout


def test_prefill_max_seqlen_scale_and_longer_padding(rng):
    """max_seqlen above every length (more padded rows than tokens), a custom scale."""
    lens = [3, 7, 1]
    q, k, v, cu = packed_inputs(rng, lens, 14, 8, 2, 128, jnp.float32)
    cu_j = jnp.asarray(cu)
    out = prefill_jit(q, k, v, cu_j, scale=0.3, max_seqlen=32)
    assert_close(out, prefill_np(q, k, v, cu, True, 0.3), jnp.float32, "vs numpy")
    assert_close(out, ref_prefill(q, k, v, cu_j, scale=0.3), jnp.float32, "vs reference")


def test_prefill_max_seqlen_gather_index_round_trip(rng):
    """The gather into the padded layout and the gather back are inverse on
    the tokens of the sequences; padded rows and padding tokens are filled."""
    lens, n, m = [5, 16, 0, 1, 11], 40, 16
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    fwd = np.asarray(attention._padded_gather_index(cu, n, m))
    back = np.asarray(attention._padded_scatter_index(cu, n, m))
    b = len(lens)
    assert fwd.shape == (b * m,) and back.shape == (n,)
    for i, ln in enumerate(lens):
        start = int(np.asarray(cu)[i])
        assert_equal(fwd[i * m:i * m + ln], np.arange(start, start + ln, dtype=np.int32),
                     f"seq {i}")
        assert np.all(fwd[i * m + ln:(i + 1) * m] == n)
    used = int(np.asarray(cu)[-1])
    assert_equal(fwd[back[:used]], np.arange(used, dtype=np.int32), "round trip")
    assert np.all(back[used:] == b * m)


@pytest.mark.parametrize("case", ["gather_long", "reshape_long", "reshape_misaligned"])
def test_prefill_max_seqlen_violation_gives_nan_under_jit(rng, case):
    """Under jit the contract cannot be checked before running: a sequence
    longer than max_seqlen (or, with N == B * max_seqlen, one not starting at a
    multiple of it) poisons the output with NaN instead of a wrong result."""
    lens, n, m = {"gather_long": ([5, 17, 3], 40, 16),   # 17 > 16
                  "reshape_long": ([8, 12, 4], 24, 8),   # 12 > 8, N = 3 * 8
                  "reshape_misaligned": ([7, 8, 8], 24, 8)}[case]  # all <= 8, starts 0, 7, 15
    q, k, v, cu = packed_inputs(rng, lens, n, 4, 2, 64, jnp.float32)
    out = np.asarray(prefill_jit(q, k, v, jnp.asarray(cu), max_seqlen=m))
    assert np.all(np.isnan(out)), "the whole output is NaN"
    # eagerly the same inputs raise
    with pytest.raises(ValueError, match="max_seqlen"):
        attention.prefill_attention(q, k, v, jnp.asarray(cu), max_seqlen=m)


@pytest.mark.parametrize("value, exc, match", [
    (0, ValueError, "max_seqlen must be >= 1"),
    (True, TypeError, "max_seqlen"),
    (2.5, TypeError, "max_seqlen"),
])
def test_prefill_max_seqlen_errors(value, exc, match):
    q = jnp.zeros((8, 4, 64))
    k = jnp.zeros((8, 2, 64))
    cu = jnp.asarray([0, 3, 8], jnp.int32)
    with pytest.raises(exc, match=match):
        attention.prefill_attention(q, k, k, cu, max_seqlen=value)
    with pytest.raises(exc, match=match):
        attention.prefill_path(q, k, k, cu, max_seqlen=value)


def test_prefill_max_seqlen_no_sequence():
    """B = 0 (cu_seqlens = [0]): every token is padding."""
    q = jnp.ones((6, 4, 64))
    k = jnp.ones((6, 2, 64))
    out = prefill_jit(q, k, k, jnp.asarray([0], jnp.int32), max_seqlen=4)
    assert_equal(out, np.zeros((6, 4, 64), np.float32), "all padding")


# ---- errors -----------------------------------------------------------------

def _decode_inputs(b=2, hq=4, hkv=2, d=64, pages=4, ps=16, mp=2, dtype=jnp.float32):
    q = jnp.zeros((b, hq, d), dtype)
    kp = jnp.zeros((pages, ps, hkv, d), dtype)
    return q, kp, kp, jnp.zeros((b, mp), jnp.int32), jnp.ones((b,), jnp.int32)


@pytest.mark.parametrize("case, exc, match", [
    ("heads", ValueError, "multiple of k_pages' kv heads"),
    ("head_dim", ValueError, "head dim must be one of"),
    ("dtype", TypeError, "k_pages"),
    ("vshape", ValueError, "v_pages"),
    ("table_rows", ValueError, "page_table"),
    ("lengths_rows", ValueError, "lengths"),
    ("table_dtype", TypeError, "page_table"),
    ("page_oob", ValueError, r"page_table\[1, 0\]"),
    ("page_neg", ValueError, r"page_table\[0, 1\]"),
    ("len_cap", ValueError, "lengths must lie in"),
    ("len_neg", ValueError, "lengths must lie in"),
    ("scale", TypeError, "scale"),
    ("split_small", ValueError, "split_tokens must be a multiple of 64"),
    ("split_odd", ValueError, "split_tokens must be a multiple of 64"),
    ("split_big", ValueError, "split_tokens must be a multiple of 64"),
    ("split_type", TypeError, "split_tokens"),
    ("split_many", ValueError, "more than 65535 splits"),
])
def test_decode_errors(case, exc, match):
    q, kp, vp, pt, ln = _decode_inputs()
    kw = {}
    if case == "heads":
        q = jnp.zeros((2, 3, 64))
    elif case == "head_dim":
        q, kp, vp, pt, ln = _decode_inputs(d=96)
    elif case == "dtype":
        kp = vp = kp.astype(jnp.bfloat16)
    elif case == "vshape":
        vp = jnp.zeros((5, 16, 2, 64))
    elif case == "table_rows":
        pt = jnp.zeros((3, 2), jnp.int32)
    elif case == "lengths_rows":
        ln = jnp.ones((3,), jnp.int32)
    elif case == "table_dtype":
        pt = pt.astype(jnp.float32)
    elif case == "page_oob":
        pt = pt.at[1, 0].set(4)
    elif case == "page_neg":
        pt = pt.at[0, 1].set(-1)
        ln = jnp.asarray([17, 1], jnp.int32)
    elif case == "len_cap":
        ln = jnp.asarray([33, 1], jnp.int32)
    elif case == "len_neg":
        ln = jnp.asarray([-1, 1], jnp.int32)
    elif case == "scale":
        kw = {"scale": "big"}
    elif case.startswith("split_"):
        kw = {"split_tokens": {"split_small": 0, "split_odd": 96, "split_big": 4096,
                               "split_type": 64.0, "split_many": 64}[case]}
        if case == "split_many":  # 2**18 pages of 16 per sequence: > 65535 splits of 64
            pt = jnp.zeros((2, 1 << 18), jnp.int32)
    with pytest.raises(exc, match=match):
        attention.paged_decode_attention(q, kp, vp, pt, ln, **kw)
    if case not in ("page_oob", "page_neg", "len_cap", "len_neg"):  # trace-time checks
        with pytest.raises(exc, match=match):
            attention_reference.paged_decode_attention(q, kp, vp, pt, ln, **kw)


def test_decode_unused_table_entries_may_be_garbage():
    q, kp, vp, pt, _ = _decode_inputs()
    pt = jnp.asarray([[1, -1], [2, 99]], jnp.int32)  # second pages unused at length 16
    ln = jnp.asarray([16, 16], jnp.int32)
    attention.paged_decode_attention(q, kp, vp, pt, ln)


@pytest.mark.parametrize("case, exc, match", [
    ("slot_high", ValueError, "slot_mapping must lie in"),
    ("slot_dup", ValueError, "duplicate"),
    ("slot_len", ValueError, "slot_mapping must have N"),
    ("slot_dtype", TypeError, "slot_mapping"),
    ("k_shape", ValueError, "k must be"),
    ("k_dtype", TypeError, "k "),
    ("v_shape", ValueError, "v must have"),
    ("cache_rank", ValueError, "k_pages must have rank 4"),
])
def test_write_kv_errors(case, exc, match):
    kp = jnp.zeros((2, 16, 2, 64))
    vp = kp
    k = v = jnp.zeros((3, 2, 64))
    sl = jnp.asarray([0, 5, -1], jnp.int32)
    if case == "slot_high":
        sl = jnp.asarray([0, 32, -1], jnp.int32)
    elif case == "slot_dup":
        sl = jnp.asarray([4, 4, -1], jnp.int32)
    elif case == "slot_len":
        sl = jnp.asarray([0, 1], jnp.int32)
    elif case == "slot_dtype":
        sl = sl.astype(jnp.float32)
    elif case == "k_shape":
        k = jnp.zeros((3, 1, 64))
    elif case == "k_dtype":
        k = k.astype(jnp.bfloat16)
    elif case == "v_shape":
        v = jnp.zeros((2, 2, 64))
    elif case == "cache_rank":
        kp = jnp.zeros((32, 2, 64))
    with pytest.raises(exc, match=match):
        attention.write_kv(kp, vp, k, v, sl)


@pytest.mark.parametrize("case, exc, match", [
    ("heads", ValueError, "multiple of k's kv heads"),
    ("kv_len", ValueError, "k must be"),
    ("dtype", TypeError, "v"),
    ("cu_bad", ValueError, "cu_seqlens must start at 0"),
    ("cu_rank", ValueError, "cu_seqlens must have rank 1"),
])
def test_prefill_errors(case, exc, match):
    q = jnp.zeros((8, 4, 64))
    k = v = jnp.zeros((8, 2, 64))
    cu = jnp.asarray([0, 3, 8], jnp.int32)
    if case == "heads":
        q = jnp.zeros((8, 3, 64))
    elif case == "kv_len":
        k = jnp.zeros((7, 2, 64))
    elif case == "dtype":
        v = v.astype(jnp.float16)
    elif case == "cu_bad":
        cu = jnp.asarray([0, 5, 3], jnp.int32)
    elif case == "cu_rank":
        cu = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(exc, match=match):
        attention.prefill_attention(q, k, v, cu)


# ---- fill_rows (the prefill path's padding rows and poison) ------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(9, 4, 8), (7, 3), (5,)])  # 16-byte rows, odd rows, scalars
@pytest.mark.parametrize("start, poison", [(-3, 0), (0, 0), (4, 0), (9, 0), (40, 0), (4, 1)])
def test_fill_rows_matches_reference(rng, dtype, shape, start, poison):
    x = normal(rng, shape, dtype)
    f = jax.jit(attention.fill_rows)
    got = np.asarray(f(x, jnp.int32(start), jnp.int32(poison)).astype(jnp.float32))
    want = np.asarray(attention_reference.fill_rows(x, start, poison).astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    n = shape[0]
    lo = 0 if poison else min(max(start, 0), n)
    assert np.all(np.isnan(got[lo:])) if poison else np.all(got[lo:] == 0)
    np.testing.assert_array_equal(got[:lo], np.asarray(x.astype(jnp.float32))[:lo])  # untouched


@pytest.mark.sanitize
@pytest.mark.parametrize("start, poison", [(3, 0), (0, 1), (11, 0)], ids=["tail", "poison", "none"])
def test_sanitize_fill_rows(rng, start, poison):
    x = normal(rng, (11, 2, 12), jnp.bfloat16)
    got = jax.jit(attention.fill_rows)(x, jnp.int32(start), jnp.int32(poison))
    want = attention_reference.fill_rows(x, start, poison)
    assert_equal(jnp.nan_to_num(got), jnp.nan_to_num(want), "fill_rows")


def test_fill_rows_errors():
    with pytest.raises(TypeError, match="x"):
        attention.fill_rows(jnp.zeros((3, 2), jnp.int32), 1, 0)
    with pytest.raises(ValueError, match="leading row axis"):
        attention.fill_rows(jnp.zeros((), jnp.float32), 0, 0)
    with pytest.raises(ValueError, match="start must be a scalar"):
        attention.fill_rows(jnp.zeros((3, 2)), jnp.zeros((2,), jnp.int32), 0)
    with pytest.raises(ValueError, match="poison must be a scalar"):
        attention.fill_rows(jnp.zeros((3, 2)), 1, jnp.zeros((1,), bool))


# ---- GPU: the CUDA handlers against the CPU ones ----------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_matches_cpu(rng, dtype, d):
    st = 256
    lengths = [1, 16, 2 * st + 5, 3 * st]
    kp, vp, table, ln = make_cache(rng, lengths, 16, 2, d, dtype)
    q = normal(rng, (4, 8, d), dtype)
    dec = jax.jit(attention.paged_decode_attention)
    gpu = dec(q, kp, vp, table, ln)
    cpu = on_cpu(dec, q, kp, vp, table, ln)
    assert_close(gpu, cpu, dtype, "decode cuda vs cpu")
    assert_equal(gpu, dec(q, kp, vp, table, ln), "decode cuda run to run")
    k, v = normal(rng, (7, 2, d), dtype), normal(rng, (7, 2, d), dtype)
    slots = jnp.asarray([0, 3, -1, 40, 10**6, 17, -2], jnp.int32)
    wkv = jax.jit(attention.write_kv)
    for g, c, what in zip(wkv(kp, vp, k, v, slots), on_cpu(wkv, kp, vp, k, v, slots), "kv"):
        assert_equal(g, c, f"write_kv {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(MAX_SEQLEN_LAYOUTS))
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_prefill_cudnn_padded(rng, layout, causal):
    """cuDNN with sequence lengths (max_seqlen) against the packed XLA path;
    padded query rows (reshape_tail: the end of the last sequence) are 0."""
    dtype = jnp.bfloat16
    lens, n, m = MAX_SEQLEN_LAYOUTS[layout]
    q, k, v, cu = packed_inputs(rng, lens, n, 8, 2, 128, dtype)
    cu_j = jnp.asarray(cu)
    if not attention._cudnn_ok(q):
        pytest.skip("cuDNN flash attention unavailable")
    assert attention.prefill_path(q, k, v, cu_j, max_seqlen=m) == "cudnn_padded"
    out = prefill_jit(q, k, v, cu_j, causal=causal, max_seqlen=m)
    want = prefill_jit(q, k, v, cu_j, causal=causal, implementation="xla")
    assert_close(out, want, dtype, "cudnn_padded vs xla", rtol=PREFILL_RTOL[jnp.dtype(dtype)])
    assert np.all(np.asarray(out[cu[-1]:]) == 0), "padding rows"
    bad = np.array(cu)
    bad[1] = m + 1 if layout == "gather" else m - 1  # sequence 0 too long / a misaligned start
    nan = np.asarray(prefill_jit(q, k, v, jnp.asarray(bad), causal=causal, max_seqlen=m))
    assert np.all(np.isnan(nan.astype(np.float32))), "contract violation: all NaN"


# ---- attention_dispatch (prefill and decode sequences in one batch) ----------

ref_dispatch = jax.jit(attention_reference.attention_dispatch)


def mixed_batch(rng, kinds, dtype, page_size=16, hkv=2, gqa=4, d=64, pad=3):
    """A continuous-batching step: kinds[b] is ("prefill", n new tokens) or
    ("decode", context length incl. the new token). Returns the dispatch
    arguments (caches in random page order, pre-filled at random) and the
    numpy float64 expected (out, k_pages, v_pages)."""
    ctx = [n for _, n in kinds]
    new = [n if kind == "prefill" else 1 for kind, n in kinds]
    kp, vp, table, _ = make_cache(rng, ctx, page_size, hkv, d, dtype)
    tbl = np.asarray(table)
    n = sum(new) + pad
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    slots = [int(tbl[b, t // page_size]) * page_size + t % page_size
             for b in range(len(kinds)) for t in range(ctx[b] - new[b], ctx[b])] + [-1] * pad
    q = normal(rng, (n, hkv * gqa, d), dtype)
    k, v = normal(rng, (n, hkv, d), dtype), normal(rng, (n, hkv, d), dtype)
    f64 = [np.asarray(a).astype(np.float64) for a in (q, k, v, kp, vp)]
    qn, kn, vn, kpn, vpn = f64
    rows = np.arange(sum(new))
    kpn.reshape(-1, hkv, d)[np.array(slots[:sum(new)])] = kn[rows]
    vpn.reshape(-1, hkv, d)[np.array(slots[:sum(new)])] = vn[rows]
    scale = 1 / np.sqrt(d)
    out = np.zeros(qn.shape)
    for b, (kind, c) in enumerate(kinds):
        a, e = cu[b], cu[b + 1]
        if kind == "prefill":
            out[a:e] = dense_attention_np(qn[a:e], kn[a:e], vn[a:e], scale, 0)
        else:
            sl = [tbl[b, t // page_size] * page_size + t % page_size for t in range(c)]
            out[a] = dense_attention_np(qn[a:a + 1], kpn.reshape(-1, hkv, d)[sl],
                                        vpn.reshape(-1, hkv, d)[sl], scale)[0]
    args = (q, k, v, kp, vp, table, jnp.asarray(np.array(ctx, np.int32)), jnp.asarray(cu),
            jnp.asarray(np.array([kind == "decode" for kind, _ in kinds])),
            jnp.asarray(np.array(slots, np.int32)))
    return args, (out, kpn, vpn)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch", ["mixed", "all_decode", "all_prefill"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_dispatch_matches_numpy_and_reference(rng, dtype, batch, gqa):
    kinds = {"mixed": [("prefill", 5), ("decode", 40), ("prefill", 0), ("decode", 1),
                       ("prefill", 17), ("decode", 16)],
             "all_decode": [("decode", 33), ("decode", 2), ("decode", 64)],
             "all_prefill": [("prefill", 9), ("prefill", 1)]}[batch]
    args, (want, want_k, want_v) = mixed_batch(rng, kinds, dtype, gqa=gqa)
    ref = ref_dispatch(*args)
    step = jax.jit(attention.attention_dispatch, donate_argnums=(3, 4))
    out, nk, nv = step(*args)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    rtol = PREFILL_RTOL[jnp.dtype(dtype)]
    assert_close(out, want, dtype, "dispatch vs numpy", rtol=rtol)
    assert_close(ref[0], want, dtype, "reference vs numpy")
    assert_close(out, ref[0], dtype, "dispatch vs reference", rtol=rtol)
    for got, exp, name in ((nk, want_k, "k_pages"), (nv, want_v, "v_pages"),
                           (ref[1], want_k, "reference k_pages")):
        assert_equal(got, exp.astype(np.asarray(got).dtype), name)
    assert_equal(out[-3:], np.zeros_like(np.asarray(out[-3:])), "padding rows")


def test_dispatch_with_max_seqlen_and_split(rng):
    """max_seqlen (the padded prefill layout) and split_tokens pass through."""
    kinds = [("prefill", 20), ("decode", 130), ("prefill", 3), ("decode", 5)]
    args, (want, _, _) = mixed_batch(rng, kinds, jnp.float32)
    f = jax.jit(functools.partial(attention.attention_dispatch, max_seqlen=24, split_tokens=64))
    assert_close(f(*args)[0], want, jnp.float32, "dispatch vs numpy")
    with pytest.raises(ValueError, match="more than max_seqlen=16"):
        attention.attention_dispatch(*args, max_seqlen=16)


def test_dispatch_decode_rows_are_paged_decode(rng):
    """A decode row of the dispatch is paged_decode_attention's output for its
    sequence on the updated cache, bit for bit."""
    kinds = [("decode", 300), ("prefill", 12), ("decode", 77)]
    args, _ = mixed_batch(rng, kinds, jnp.bfloat16)
    q, k, v, kp, vp, table, ln, cu, dec, slots = args
    out, nk, nv = jax.jit(attention.attention_dispatch)(*args)
    first = np.asarray(cu)[:-1]
    alone = jax.jit(attention.paged_decode_attention)(q[first], nk, nv, table,
                                                      jnp.where(dec, ln, 0))
    assert_equal(out[first[0]], alone[0], "decode row 0")
    assert_equal(out[first[2]], alone[2], "decode row 2")


def test_dispatch_bad_decode_sequence(rng):
    """A decode sequence with two new tokens: ValueError eagerly; under jit its
    rows are NaN and the other rows are untouched."""
    kinds = [("decode", 20), ("prefill", 6), ("decode", 9)]
    args, (want, _, _) = mixed_batch(rng, kinds, jnp.float32, pad=0)
    q, k, v, kp, vp, table, ln, cu, dec, slots = args
    # sequence 0 claims rows 0-1 (the prefill then starts one row later)
    bad_cu = jnp.asarray(np.array([0, 2, 7, 8], np.int32))
    with pytest.raises(ValueError, match=r"sequence 0 is a decode sequence \(is_decode\[0\]\) "
                                         r"with 2 new tokens"):
        attention.attention_dispatch(q, k, v, kp, vp, table, ln, bad_cu, dec, slots)
    out, _, _ = jax.jit(attention.attention_dispatch)(q, k, v, kp, vp, table, ln, bad_cu, dec,
                                                       slots)
    out = np.asarray(out)
    assert np.isnan(out[:2]).all(), "the bad decode sequence's rows"
    assert not np.isnan(out[2:]).any(), "the other rows"
    assert_close(out[7], want[7], jnp.float32, "the good decode row")


@pytest.mark.parametrize("case, exc, match", [
    ("dec_dtype", TypeError, "is_decode must be a bool array"),
    ("dec_len", ValueError, "is_decode must have B=2"),
    ("lengths_len", ValueError, "lengths must have B=2"),
    ("slots_len", ValueError, "slot_mapping must have N=3"),
    ("cu_bad", ValueError, "cu_seqlens must start at 0"),
    ("table_rows", ValueError, "page_table must have B=2"),
    ("page_oob", ValueError, r"page_table\[1, 0\]"),
    ("impl", ValueError, "implementation must be one of"),
    ("split", ValueError, "split_tokens must be a multiple of 64"),
])
def test_dispatch_errors(case, exc, match):
    q, k = jnp.zeros((3, 4, 64)), jnp.zeros((3, 2, 64))
    _, kp, _, table, _ = _decode_inputs()  # 4 pages of 16, a (2, 2) page table
    ln = jnp.asarray([5, 1], jnp.int32)
    cu, dec = jnp.asarray([0, 2, 3], jnp.int32), jnp.asarray([False, True])
    slots, kw = jnp.asarray([0, 1, 20], jnp.int32), {}
    if case == "dec_dtype":
        dec = dec.astype(jnp.int32)
    elif case == "dec_len":
        dec = jnp.asarray([False, True, True])
    elif case == "lengths_len":
        ln = jnp.ones((3,), jnp.int32)
    elif case == "slots_len":
        slots = slots[:2]
    elif case == "cu_bad":
        cu = jnp.asarray([1, 2, 3], jnp.int32)
    elif case == "table_rows":
        table = jnp.zeros((3, 2), jnp.int32)
    elif case == "page_oob":
        table = table.at[1, 0].set(4)
    elif case == "impl":
        kw = {"implementation": "triton"}
    elif case == "split":
        kw = {"split_tokens": 96}
    for f in (attention.attention_dispatch, attention_reference.attention_dispatch):
        if case == "impl" and f is attention_reference.attention_dispatch:
            continue  # the twin takes no implementation choice
        with pytest.raises(exc, match=match):
            f(q, k, k, kp, kp, table, ln, cu, dec, slots, **kw)


# ---- small edge cases (also run under compute-sanitizer on a GPU) -----------

@pytest.mark.sanitize
@pytest.mark.parametrize("case", ["len1", "empty", "full_page", "bad_pages", "group12"])
def test_sanitize_decode_edges(rng, case):
    dtype = jnp.bfloat16
    lengths = {"len1": [1], "empty": [0, 1], "full_page": [16, 32], "bad_pages": [20, 3],
               "group12": [300, 20]}[case]
    kp, vp, table, ln = make_cache(rng, lengths, 16, 1, 64, dtype, extra_pages=0)
    if case in ("bad_pages", "group12"):  # under jit: skipped, never read
        table = table.at[0, 1].set(10**6).at[1, 0].set(-3)
        ln = ln.at[1].set(10**6)
    # group12: 12 query heads on one kv head, two blocks of 8 and 4 heads, two splits
    q = normal(rng, (len(lengths), 12 if case == "group12" else 2, 64), dtype)
    out = jax.jit(attention.paged_decode_attention)(q, kp, vp, table, ln)
    assert_close(out, ref_decode(q, kp, vp, table, ln), dtype, case)
    k = normal(rng, (2, 1, 64), dtype)
    sl = jnp.asarray([kp.shape[0] * 16 - 1, kp.shape[0] * 16], jnp.int32)  # last slot, one past
    nk, nv = jax.jit(attention.write_kv)(kp, vp, k, k, sl)
    assert_equal(nk, ref_write_kv(kp, vp, k, k, sl)[0], "write_kv edge")


def test_decode_rejects_caches_past_int32_slots():
    """The kernels index cache slots with int32: a cache of 2**31 slots or
    more is rejected at trace time (shapes only, nothing allocated)."""
    q = jax.ShapeDtypeStruct((1, 2, 64), jnp.bfloat16)
    kp = jax.ShapeDtypeStruct((1 << 27, 16, 1, 64), jnp.bfloat16)
    pt = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    ln = jax.ShapeDtypeStruct((1,), jnp.int32)
    with pytest.raises(ValueError, match="int32"):
        jax.eval_shape(attention.paged_decode_attention, q, kp, kp, pt, ln)
    ok = jax.ShapeDtypeStruct(((1 << 27) - 1, 16, 1, 64), jnp.bfloat16)
    assert jax.eval_shape(attention.paged_decode_attention, q, ok, ok, pt, ln).shape == (1, 2, 64)
