"""jax_moe.attention.paged_decode_attention (FFI, CPU + CUDA) against its jnp
twin (attention_reference) and a plain numpy float64 dense attention over the
same tokens: GQA, page sizes, head dims (small ones, V's differing from K's),
splits of long sequences, empty sequences, bad values under jit, 64-bit
index values, write_kv then decode, argument errors; (gpu) CUDA against the
CPU handler; small edge cases for compute-sanitizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (check_decode, decode_inputs, decode_np, dense_attention_np,
                             make_cache, ref_decode, ref_write_kv)
from common import DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, on_cpu
from jax_moe import _attention_checks as _ac
from jax_moe import attention, attention_reference


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


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("gqa", [1, 4, 12])
def test_decode_small_head_dims(rng, dtype, d, gqa):
    """Head dims 16 and 32 (a small model's, which prefill_attention takes):
    on the GPU they run on the 64-wide kernels with rows zero-filled."""
    hkv = 2 if gqa < 8 else 1
    lengths = [1, 17, 3 * 64 + 5, 0]
    kp, vp, table, ln = make_cache(rng, lengths, 16, hkv, d, dtype)
    q = normal(rng, (len(lengths), hkv * gqa, d), dtype)
    check_decode(q, kp, vp, table, ln, dtype)
    out = jax.jit(functools.partial(attention.paged_decode_attention, split_tokens=64))(
        q, kp, vp, table, ln)
    assert_close(out, ref_decode(q, kp, vp, table, ln), dtype, "several splits vs reference")


# (Dk, Dv): DeepSeek's 192 / 128, V narrower than K within one compiled dim
# and across, V wider than K, and dims that are multiples of 8 only.
HEAD_DIM_PAIRS = [(192, 128), (128, 64), (256, 16), (64, 32), (32, 64), (40, 24), (8, 8)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dk,dv", HEAD_DIM_PAIRS, ids=[f"{a}x{b}" for a, b in HEAD_DIM_PAIRS])
def test_decode_v_head_dim_differs(rng, dtype, dk, dv):
    """v_pages with its own head dim Dv: the output is (B, Hq, Dv), scale
    defaults to 1/sqrt(Dk)."""
    lengths = [1, 33, 2 * 64 + 7]
    kp, vp, table, ln = make_cache(rng, lengths, 16, 2, dk, dtype, dv=dv)
    q = normal(rng, (len(lengths), 8, dk), dtype)
    out = check_decode(q, kp, vp, table, ln, dtype)
    assert out.shape == (len(lengths), 8, dv)
    f = jax.jit(functools.partial(attention.paged_decode_attention, split_tokens=64))
    assert_close(f(q, kp, vp, table, ln), decode_np(q, kp, vp, table, ln, 1 / np.sqrt(dk)), dtype,
                 "several splits vs numpy")


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
@pytest.mark.parametrize("d,dv", [(64, 64), (16, 16), (192, 128)], ids=["64", "16", "192x128"])
def test_write_kv_then_decode_is_dense_attention(rng, dtype, d, dv):
    """A prefill of each sequence's tokens through write_kv (pages in random
    order, padded slot_mapping), then a decode step: dense attention over the
    written tokens."""
    page_size, hkv, gqa = 16, 2, 4
    lengths = [1, 16, 37]
    kp, vp, table, ln = make_cache(rng, lengths, page_size, hkv, d, dtype, dv=dv)
    kp, vp = jnp.zeros_like(kp), jnp.zeros_like(vp)
    toks_k = [normal(rng, (n, hkv, d), dtype) for n in lengths]
    toks_v = [normal(rng, (n, hkv, dv), dtype) for n in lengths]
    tbl = np.asarray(table)
    slots = [tbl[b, t // page_size] * page_size + t % page_size
             for b, n in enumerate(lengths) for t in range(n)]
    pad = 5
    slot_mapping = jnp.asarray(np.array(slots + [-1] * pad, np.int32))
    k = jnp.concatenate(toks_k + [jnp.zeros((pad, hkv, d), dtype)])
    v = jnp.concatenate(toks_v + [jnp.zeros((pad, hkv, dv), dtype)])
    step = jax.jit(attention.write_kv, donate_argnums=(0, 1))
    kp, vp = step(kp, vp, k, v, slot_mapping)
    q = normal(rng, (3, hkv * gqa, d), dtype)
    out = jax.jit(attention.paged_decode_attention)(q, kp, vp, table, ln)
    want = np.stack([dense_attention_np(np.asarray(q[b:b + 1]).astype(np.float64),
                                        np.asarray(toks_k[b]).astype(np.float64),
                                        np.asarray(toks_v[b]).astype(np.float64),
                                        1 / np.sqrt(d))[0] for b in range(3)])
    assert_close(out, want, dtype, "write_kv + decode vs dense")


# ---- errors -----------------------------------------------------------------

@pytest.mark.parametrize("case, exc, match", [
    ("heads", ValueError, "multiple of k_pages' kv heads"),
    ("head_dim", ValueError, "q's head dim must be a multiple of 8 in"),
    ("head_dim_big", ValueError, "q's head dim must be a multiple of 8 in"),
    ("v_head_dim", ValueError, "v_pages' head dim must be a multiple of 8 in"),
    ("v_heads", ValueError, "v_pages must be"),
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
    ("scale_nan", ValueError, "scale must be finite"),
    ("scale_inf", ValueError, "scale must be finite"),
    ("split_small", ValueError, "split_tokens must be a multiple of 64"),
    ("split_odd", ValueError, "split_tokens must be a multiple of 64"),
    ("split_big", ValueError, "split_tokens must be a multiple of 64"),
    ("split_type", TypeError, "split_tokens"),
    ("split_many", ValueError, "more than 65535 splits"),
    ("k_head_dim", ValueError, "k_pages' head dim 32 must equal q's head dim 64"),
    ("page_size", ValueError, r"page_size \(k_pages.shape\[1\]\) must be >= 1"),
    ("capacity", ValueError, "page_table's capacity"),
])
def test_decode_errors(case, exc, match):
    q, kp, vp, pt, ln = decode_inputs()
    kw = {}
    if case == "heads":
        q = jnp.zeros((2, 3, 64))
    elif case == "head_dim":
        q, kp, vp, pt, ln = decode_inputs(d=20)
    elif case == "head_dim_big":
        q, kp, vp, pt, ln = decode_inputs(d=264)
    elif case == "v_head_dim":
        q, kp, vp, pt, ln = decode_inputs(dv=12)
    elif case == "v_heads":
        vp = jnp.zeros((4, 16, 1, 64))
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
    elif case in ("scale_nan", "scale_inf"):
        kw = {"scale": {"scale_nan": float("nan"), "scale_inf": float("inf")}[case]}
    elif case.startswith("split_"):
        kw = {"split_tokens": {"split_small": 0, "split_odd": 96, "split_big": 4096,
                               "split_type": 64.0, "split_many": 64}[case]}
        if case == "split_many":  # 2**18 pages of 16 per sequence: > 65535 splits of 64
            pt = jnp.zeros((2, 1 << 18), jnp.int32)
    elif case == "k_head_dim":
        kp = vp = jnp.zeros((4, 16, 2, 32))
    elif case == "page_size":
        kp = vp = jnp.zeros((4, 0, 2, 64))
    elif case == "capacity":  # 2**20 + 1 pages of 16 per sequence: past 65535 splits of 256
        pt = jnp.zeros((2, (1 << 20) + 1), jnp.int32)
    with pytest.raises(exc, match=match):
        attention.paged_decode_attention(q, kp, vp, pt, ln, **kw)
    if case not in ("page_oob", "page_neg", "len_cap", "len_neg"):  # trace-time checks
        with pytest.raises(exc, match=match):
            attention_reference.paged_decode_attention(q, kp, vp, pt, ln, **kw)


def test_decode_unused_table_entries_may_be_garbage():
    q, kp, vp, pt, _ = decode_inputs()
    pt = jnp.asarray([[1, -1], [2, 99]], jnp.int32)  # second pages unused at length 16
    ln = jnp.asarray([16, 16], jnp.int32)
    attention.paged_decode_attention(q, kp, vp, pt, ln)


# ---- GPU: the CUDA handlers against the CPU ones ----------------------------

# Every compiled head dim (64, 128, 256), the smaller ones run on them, and
# V's head dim differing from K's.
GPU_DIMS = [(64, 64), (128, 128), (256, 256), (16, 16), (32, 32), (192, 128), (64, 32),
            (32, 128), (40, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d,dv", GPU_DIMS, ids=[f"{a}x{b}" for a, b in GPU_DIMS])
def test_gpu_matches_cpu(rng, dtype, d, dv):
    st = 256
    lengths = [1, 16, 2 * st + 5, 3 * st]
    kp, vp, table, ln = make_cache(rng, lengths, 16, 2, d, dtype, dv=dv)
    q = normal(rng, (4, 8, d), dtype)
    dec = jax.jit(attention.paged_decode_attention)
    gpu = dec(q, kp, vp, table, ln)
    cpu = on_cpu(dec, q, kp, vp, table, ln)
    assert_close(gpu, cpu, dtype, "decode cuda vs cpu")
    assert_equal(gpu, dec(q, kp, vp, table, ln), "decode cuda run to run")
    k, v = normal(rng, (7, 2, d), dtype), normal(rng, (7, 2, dv), dtype)
    slots = jnp.asarray([0, 3, -1, 40, 10**6, 17, -2], jnp.int32)
    wkv = jax.jit(attention.write_kv)
    for g, c, what in zip(wkv(kp, vp, k, v, slots), on_cpu(wkv, kp, vp, k, v, slots), "kv"):
        assert_equal(g, c, f"write_kv {what}")


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


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("d,dv", [(16, 16), (32, 32), (192, 128), (8, 64), (64, 8)],
                         ids=["16", "32", "192x128", "8x64", "64x8"])
def test_sanitize_decode_head_dims(rng, dtype, d, dv):
    """Head dims below the compiled 64 / 128 / 256 and V's differing from K's,
    on a cache without spare pages (the last slot is the buffer's end): the
    zero-filled rows are never read from memory, the outputs past Dv never
    written. Two splits, one sequence empty."""
    lengths = [64 + 9, 0, 16]
    kp, vp, table, ln = make_cache(rng, lengths, 16, 1, d, dtype, extra_pages=0, dv=dv)
    q = normal(rng, (len(lengths), 12, d), dtype)
    out = jax.jit(functools.partial(attention.paged_decode_attention, split_tokens=64))(
        q, kp, vp, table, ln)
    assert_close(out, ref_decode(q, kp, vp, table, ln), dtype, "decode vs reference")
    k, v = normal(rng, (2, 1, d), dtype), normal(rng, (2, 1, dv), dtype)
    sl = jnp.asarray([kp.shape[0] * 16 - 1, kp.shape[0] * 16], jnp.int32)  # last slot, one past
    got = jax.jit(attention.write_kv)(kp, vp, k, v, sl)
    for g, w, what in zip(got, ref_write_kv(kp, vp, k, v, sl), ("k_pages", "v_pages")):
        assert_equal(g, w, f"write_kv {what}")


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


# ---- 64-bit index values (jax_enable_x64) ----------------------------------

def test_decode_int64_values_past_int32_are_out_of_range_under_jit(rng):
    """With x64 on, page ids and lengths past int32 are out of range under
    jit (the page skipped, the length clamped to the capacity), as the int32
    call with those meanings gives; never wrapped onto page 1 or length 5."""
    with jax.enable_x64(True):
        kp, vp, table, _ = make_cache(rng, [40, 20, 30], 16, 2, 64, jnp.float32, max_pages=3)
        q = normal(rng, (3, 4, 64), jnp.float32)
        t32 = np.asarray(table).astype(np.int32)
        t64 = t32.astype(np.int64)
        t64[0, 1] = 2**32 + 1                  # int32 wrap: page 1
        t32[0, 1] = -1
        ln64 = np.array([40, 2**32 + 5, 30], np.int64)  # int32 wrap: 5
        ln32 = np.array([40, 48, 30], np.int32)         # the capacity, 3 pages of 16
        args64 = (q, kp, vp, jnp.asarray(t64, jnp.int64), jnp.asarray(ln64, jnp.int64))
        args32 = (q, kp, vp, jnp.asarray(t32), jnp.asarray(ln32))
        want = decode_np(*args32, 1 / 8)
        for f, name in ((attention.paged_decode_attention, "decode"),
                        (attention_reference.paged_decode_attention, "reference")):
            got = jax.jit(f)(*args64)
            assert_equal(got, jax.jit(f)(*args32), f"{name}: int64 vs int32 meaning")
            assert_close(got, want, jnp.float32, f"{name} vs numpy")
        with pytest.raises(ValueError, match="lengths must lie in"):
            attention.paged_decode_attention(*args64)


def test_decode_uint32_lengths_past_int32_are_clamped_under_jit(rng):
    """uint32 lengths past int32 (no x64 needed) are clamped to the capacity
    under jit, not wrapped to negative (no token)."""
    kp, vp, table, _ = make_cache(rng, [40, 20], 16, 2, 64, jnp.float32, max_pages=3)
    q = normal(rng, (2, 4, 64), jnp.float32)
    big = jnp.asarray([2**32 - 1, 20], jnp.uint32)
    meaning = jnp.asarray([48, 20], jnp.int32)  # the capacity, 3 pages of 16
    for f in (attention.paged_decode_attention, attention_reference.paged_decode_attention):
        got = jax.jit(f)(q, kp, vp, table, big)
        assert_equal(got, jax.jit(f)(q, kp, vp, table, meaning), f"{f.__module__}")
    assert_close(got, decode_np(q, kp, vp, table, meaning, 1 / 8), jnp.float32,
                 "vs numpy")
