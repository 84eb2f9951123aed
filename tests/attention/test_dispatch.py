"""jax_moe.attention.attention_dispatch (prefill and decode sequences in one
batch: write_kv, then prefill rows and paged-decode rows) against its jnp twin
and a plain numpy float64 continuous-batching step; argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import PREFILL_RTOL, decode_inputs, dense_attention_np, make_cache
from common import DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal
from jax_moe import attention, attention_reference


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


def test_dispatch_int64_values_past_int32_are_out_of_range_under_jit(rng):
    """With x64 on, int64 index arguments past int32 are out of range under
    jit, as the int32 call with those meanings gives: a decode length clamped
    to the capacity (not wrapped to 20), a slot skipped (not wrapped onto the
    token's own slot). Eagerly they raise."""
    with jax.enable_x64(True):
        kinds = [("decode", 20), ("prefill", 5), ("decode", 9)]
        args, _ = mixed_batch(rng, kinds, jnp.float32)
        q, k, v, kp, vp, table, ln, cu, dec, slots = args
        capacity = table.shape[1] * kp.shape[1]
        ln32, sl32 = np.asarray(ln).copy(), np.asarray(slots).copy()
        ln64, sl64 = ln32.astype(np.int64), sl32.astype(np.int64)
        ln64[0] += 2**32      # int32 wrap: 20
        ln32[0] = capacity
        sl64[2] += 2**32      # int32 wrap: its own slot
        sl32[2] = -1
        as64 = (q, k, v, kp, vp, table.astype(jnp.int64), jnp.asarray(ln64),
                cu.astype(jnp.int64), dec, jnp.asarray(sl64))
        as32 = (q, k, v, kp, vp, table, jnp.asarray(ln32), cu, dec, jnp.asarray(sl32))
        assert capacity != 20
        for f in (attention.attention_dispatch, attention_reference.attention_dispatch):
            for got, want, what in zip(jax.jit(f)(*as64), jax.jit(f)(*as32),
                                       ("out", "k_pages", "v_pages")):
                assert_equal(got, want, f"{f.__module__} {what}: int64 vs int32 meaning")
        with pytest.raises(ValueError):
            attention.attention_dispatch(*as64)


@pytest.mark.parametrize("max_seqlen", [None, 16])
@pytest.mark.parametrize("bad_cu", [[1, 6, 7, 10], [0, 6, 7, 14]], ids=["start", "past_end"])
def test_dispatch_bad_cu_seqlens_gives_nan_under_jit(rng, bad_cu, max_seqlen):
    """cu_seqlens not starting at 0 or ending past N: under jit every row is
    NaN, the decode rows included (as prefill_attention's), in the twin too;
    eagerly it raises."""
    kinds = [("prefill", 6), ("decode", 9), ("prefill", 3)]
    args, _ = mixed_batch(rng, kinds, jnp.float32)  # N = 10 + 3 padding rows
    q, k, v, kp, vp, table, ln, cu, dec, slots = args
    bad = jnp.asarray(np.array(bad_cu, np.int32))
    bad_args = (q, k, v, kp, vp, table, ln, bad, dec, slots)
    f = jax.jit(functools.partial(attention.attention_dispatch, max_seqlen=max_seqlen))
    assert np.isnan(np.asarray(f(*bad_args)[0])).all(), "dispatch"
    assert np.isnan(np.asarray(ref_dispatch(*bad_args)[0])).all(), "reference"
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        attention.attention_dispatch(*bad_args, max_seqlen=max_seqlen)


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
    _, kp, _, table, _ = decode_inputs()  # 4 pages of 16, a (2, 2) page table
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
