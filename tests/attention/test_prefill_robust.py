"""prefill_attention on bad values under jax.jit, on every path (segment
mask, max_seqlen's padded layouts) and in its jnp twin: a non-finite q, k or
v value stays in its own sequence (padding tokens are never read), and
cu_seqlens outside its contract make the whole output NaN, never a silently
wrong result."""

import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (MAX_SEQLEN_LAYOUTS, PREFILL_RTOL, packed_inputs, prefill_jit,
                             ref_prefill)
from common import assert_close, assert_equal, normal
from jax_moe import attention

HQ, HKV, D = 4, 2, 64
G = HQ // HKV
SEQ, OFFSET = 1, 5        # the bad token: sequence 1 (16 tokens in both layouts), its 6th
HEAD, DIM = 1, 7          # the bad element: kv head 1 (query heads 2, 3) / query head 1, dim 7
PATHS = ["mask", "max_seqlen", "reference"]


def run(path, q, k, v, cu, causal, m):
    if path == "mask":
        return prefill_jit(q, k, v, cu, causal=causal)
    if path == "max_seqlen":
        return prefill_jit(q, k, v, cu, causal=causal, max_seqlen=m)
    return ref_prefill(q, k, v, cu, causal=causal)


def to_f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("which", ["q_nan", "k_nan", "k_inf", "v_nan", "v_inf"])
@pytest.mark.parametrize("where", ["sequence", "padding"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["reshape_tail", "gather"])
@pytest.mark.parametrize("path", PATHS)
def test_prefill_nonfinite_stays_in_its_sequence(rng, path, layout, causal, where, which, dtype):
    """One non-finite element in a token of sequence 1 or in a padding token:
    every row of the other sequences (and of padding) equals the clean run's.
    The segment-mask path and the twin give NaN in exactly the elements that
    attend to it (all of a query head's outputs for q and k, the element's own
    dim for v); with max_seqlen the kernels' arithmetic may reach more rows of
    sequence 1, but a NaN reaches at least those."""
    lens, n, m = MAX_SEQLEN_LAYOUTS[layout]
    q, k, v, cu = packed_inputs(rng, lens, n, HQ, HKV, D, dtype)
    clean = to_f32(run(path, q, k, v, jnp.asarray(cu), causal, m))
    assert np.all(np.isfinite(clean))

    name, value = which.split("_")
    t = cu[SEQ] + OFFSET if where == "sequence" else cu[-1] + 1
    assert (cu[SEQ] + OFFSET < cu[SEQ + 1]) and cu[-1] + 1 < n
    arrays = {"q": q, "k": k, "v": v}
    head = HEAD if name != "q" else 1
    arrays[name] = arrays[name].at[t, head, DIM].set(np.inf if value == "inf" else np.nan)
    out = to_f32(run(path, arrays["q"], arrays["k"], arrays["v"], jnp.asarray(cu), causal, m))

    # The elements that attend to the bad one (none for padding).
    reach = np.zeros(out.shape, bool)
    if where == "sequence":
        a, e = cu[SEQ], cu[SEQ + 1]
        rows = slice(t, e) if causal else slice(a, e)
        if name == "q":
            reach[t, head, :] = True
        elif name == "k":
            reach[rows, HEAD * G:(HEAD + 1) * G, :] = True
        else:
            reach[rows, HEAD * G:(HEAD + 1) * G, DIM] = True
    rtol = PREFILL_RTOL[jnp.dtype(dtype)]
    if path == "max_seqlen":
        own = np.zeros(out.shape, bool)
        if where == "sequence":
            own[cu[SEQ]:cu[SEQ + 1]] = True
        assert_close(out[~own], clean[~own], dtype, "outside the bad token's sequence", rtol=rtol)
        if value == "nan":
            assert np.all(np.isnan(out[reach])), "a NaN reaches the elements that attend to it"
    else:
        assert_equal(~np.isfinite(out), reach, "non-finite elements")
        assert np.all(np.isnan(out[reach])), "non-finite inputs come out as NaN"
        assert_close(out[~reach], clean[~reach], dtype, "the other elements", rtol=rtol)
    assert np.all(out[cu[-1]:] == 0), "padding rows"


def test_prefill_nonfinite_padding_of_mask_path_is_never_read(rng):
    """Every padding token NaN (q, k and v), on the segment-mask path and in
    the twin: the real rows equal the clean run's, the padding rows are 0."""
    lens, n = [7, 12, 3], 30
    q, k, v, cu = packed_inputs(rng, lens, n, HQ, HKV, D, jnp.float32)
    cu_j = jnp.asarray(cu)
    pad = lambda x: x.at[cu[-1]:].set(np.nan)  # noqa: E731
    for name, f in [("mask", prefill_jit), ("reference", ref_prefill)]:
        want = np.asarray(f(q, k, v, cu_j))
        got = np.asarray(f(pad(q), pad(k), pad(v), cu_j))
        assert_close(got[:cu[-1]], want[:cu[-1]], jnp.float32, name)
        assert np.all(got[cu[-1]:] == 0), name


# ---- cu_seqlens outside its contract, under jit -----------------------------

# (cu_seqlens, N): B = 2 (N = 40 = 2 * 20 is the reshape layout for
# max_seqlen=20, max_seqlen=32 the gather one), and B = 0 with a bad start.
BAD_CU = {
    "start": ([2, 20, 40], 40),
    "negative_start": ([-3, 20, 40], 40),
    "decreasing": ([0, 20, 15], 40),
    "past_end": ([0, 20, 41], 40),
    "no_sequence_start": ([3], 40),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("path, m", [("mask", None), ("max_seqlen", 32), ("max_seqlen", 20),
                                     ("reference", None)],
                         ids=["mask", "gather", "reshape", "reference"])
@pytest.mark.parametrize("case", list(BAD_CU))
def test_prefill_bad_cu_seqlens_gives_nan_under_jit(rng, case, path, m, causal):
    """Every path (and the twin) agrees: the whole output is NaN, padding rows
    included; eagerly the same cu_seqlens raise."""
    c, n = BAD_CU[case]
    q = normal(rng, (n, HQ, D), jnp.bfloat16)
    k, v = normal(rng, (n, HKV, D), jnp.bfloat16), normal(rng, (n, HKV, D), jnp.bfloat16)
    cu = jnp.asarray(c, jnp.int32)
    out = to_f32(run(path, q, k, v, cu, causal, m))
    assert out.shape == (n, HQ, D)
    assert np.all(np.isnan(out)), "the whole output is NaN"
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        attention.prefill_attention(q, k, v, cu, causal=causal, max_seqlen=m)
