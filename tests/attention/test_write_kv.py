"""jax_moe.attention.write_kv (FFI, CPU + CUDA): the new tokens' k and v
written into the paged cache at slot_mapping, against its jnp twin
(attention_reference.write_kv): padding and out-of-range slots, V's head dim
differing from K's, 64-bit slots past int32, in place with donation,
argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import ref_write_kv
from common import DTYPE_IDS, FLOAT_DTYPES, assert_equal, normal
from jax_moe import attention, attention_reference


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


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d,dv", [(192, 128), (64, 16), (16, 64), (8, 3)],
                         ids=["192x128", "64x16", "16x64", "8x3"])
def test_write_kv_v_head_dim_differs(rng, dtype, d, dv):
    """v_pages (P, page_size, Hkv, Dv) and v (N, Hkv, Dv) with Dv != Dk; rows
    of different byte widths (8x3: V rows of 6 or 12 bytes)."""
    pages, ps, hkv, n = 5, 16, 2, 12
    kp, vp = normal(rng, (pages, ps, hkv, d), dtype), normal(rng, (pages, ps, hkv, dv), dtype)
    k, v = normal(rng, (n, hkv, d), dtype), normal(rng, (n, hkv, dv), dtype)
    # Distinct slots (duplicates race on the GPU): none of the random ones is
    # the last slot, which s[1] takes.
    s = rng.choice(pages * ps - 1, size=n, replace=False).astype(np.int32)
    s[:2] = [-1, pages * ps - 1]  # padding, the last slot
    slots = jnp.asarray(s)
    got = jax.jit(attention.write_kv)(kp, vp, k, v, slots)
    for g, w, what in zip(got, ref_write_kv(kp, vp, k, v, slots), ("k_pages", "v_pages")):
        assert_equal(g, w, what)
    for cache, new, old in ((got[0], k, kp), (got[1], v, vp)):
        want = np.asarray(old).reshape(pages * ps, hkv, -1).copy()
        want[s[s >= 0]] = np.asarray(new)[s >= 0]
        assert_equal(np.asarray(cache).reshape(want.shape), want, "written rows, the rest kept")


def test_write_kv_int64_slots_past_int32_are_skipped_under_jit(rng):
    """With x64 on, int64 slots past int32 are out of range: skipped under jit
    (never wrapped onto slot 5 or 7), ValueError eagerly."""
    with jax.enable_x64(True):
        kp, vp = normal(rng, (3, 16, 1, 64), jnp.float32), normal(rng, (3, 16, 1, 64), jnp.float32)
        k, v = normal(rng, (4, 1, 64), jnp.float32), normal(rng, (4, 1, 64), jnp.float32)
        slots = jnp.asarray([2**32 + 5, 3, -(2**32) + 7, 2**31], jnp.int64)
        for f, name in ((attention.write_kv, "write_kv"),
                        (attention_reference.write_kv, "reference")):
            nk, nv = jax.jit(f)(kp, vp, k, v, slots)
            for got, old, new, what in ((nk, kp, k, "k_pages"), (nv, vp, v, "v_pages")):
                want = np.asarray(old).reshape(48, 1, -1).copy()
                want[3] = np.asarray(new)[1]  # only slot 3 is in range
                assert_equal(np.asarray(got).reshape(want.shape), want, f"{name} {what}")
        with pytest.raises(ValueError, match="slot_mapping must lie in"):
            attention.write_kv(kp, vp, k, v, slots)


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


@pytest.mark.parametrize("case, exc, match", [
    ("slot_high", ValueError, "slot_mapping must lie in"),
    ("slot_dup", ValueError, "duplicate"),
    ("slot_len", ValueError, "slot_mapping must have N"),
    ("slot_dtype", TypeError, "slot_mapping"),
    ("k_shape", ValueError, "k must be"),
    ("k_dtype", TypeError, "k "),
    ("v_shape", ValueError, "v must be"),
    ("v_dim", ValueError, "v must be"),
    ("v_pages_heads", ValueError, "v_pages must be"),
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
    elif case == "v_dim":  # v_pages' head dim is 64
        v = jnp.zeros((3, 2, 32))
    elif case == "v_pages_heads":
        vp = jnp.zeros((2, 16, 1, 64))
    elif case == "cache_rank":
        kp = jnp.zeros((32, 2, 64))
    with pytest.raises(exc, match=match):
        attention.write_kv(kp, vp, k, v, sl)
