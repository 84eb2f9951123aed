"""jax_moe.attention.prefill_attention on packed sequences (cu_seqlens),
causal or not, against its jnp twin (attention_reference) and a plain numpy
float64 dense attention per sequence; the path it takes (XLA or cuDNN); the
padded layout of max_seqlen; argument errors; (gpu) cuDNN with sequence
lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (MAX_SEQLEN_LAYOUTS, PREFILL_RTOL, packed_inputs, prefill_jit,
                             prefill_np, ref_prefill)
from common import DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal
from jax_moe import attention, attention_reference


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

@pytest.mark.parametrize("case, exc, match", [
    ("heads", ValueError, "multiple of k's kv heads"),
    ("kv_len", ValueError, "k must be"),
    ("dtype", TypeError, "v"),
    ("cu_bad", ValueError, "cu_seqlens must start at 0"),
    ("cu_rank", ValueError, "cu_seqlens must have rank 1"),
    ("cu_empty", ValueError, "cu_seqlens must have B\\+1 >= 1 entries"),
    ("v_shape", ValueError, "v must have the shape of k"),
    ("scale_nan", ValueError, "scale must be finite"),
    ("causal_str", TypeError, "causal must be True or False"),
    ("causal_none", TypeError, "causal must be True or False"),
])
def test_prefill_errors(case, exc, match):
    q = jnp.zeros((8, 4, 64))
    k = v = jnp.zeros((8, 2, 64))
    cu = jnp.asarray([0, 3, 8], jnp.int32)
    kw = {"scale_nan": {"scale": float("nan")}, "causal_str": {"causal": "no"},
          "causal_none": {"causal": None}}.get(case, {})
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
    elif case == "cu_empty":
        cu = jnp.zeros((0,), jnp.int32)
    elif case == "v_shape":
        v = jnp.zeros((8, 1, 64))
    with pytest.raises(exc, match=match):
        attention.prefill_attention(q, k, v, cu, **kw)
    with pytest.raises(exc, match=match):
        attention_reference.prefill_attention(q, k, v, cu, **kw)


# ---- GPU: cuDNN with sequence lengths ---------------------------------------

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
