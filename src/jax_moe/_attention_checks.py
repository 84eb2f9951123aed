"""Argument validation shared by attention.py and attention_reference.py.

Shape and dtype checks run at trace time (free under jax.jit, before any
kernel). Value checks (slots, page ids, lengths) run only eagerly, on concrete
arrays: under jit the values are unknown and the kernels clamp/skip instead,
or, where no clamp gives a right answer (cu_seqlens_violated), poison the
output with NaN from a predicate computed on the device.
Index arguments may have any integer dtype; index_int32 is how they reach the
kernels' int32 (saturated, so that a 64-bit value past int32 stays out of
range instead of wrapping onto a valid index).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _checks
from jax_moe._int32 import index_int32  # noqa: F401  (attention's index arguments)

# paged_decode_attention's head dims (q's and k_pages' Dk, v_pages' Dv, which
# may differ): multiples of HEAD_DIM_UNIT up to MAX_HEAD_DIM
# (kDecodeHeadDimUnit, kDecodeMaxHeadDim in csrc/kernels/common/attention.h).
HEAD_DIM_UNIT = 8
MAX_HEAD_DIM = 256
# The CUDA decode kernel puts its splits on grid.y (<= 65535); with the
# default splits of >= 256 tokens, the same bound holds on every platform
# (csrc/ffi/attention.cc).
MAX_DECODE_SPLITS = 65535
MAX_DECODE_TOKENS = MAX_DECODE_SPLITS * 256
# Split sizes the decode kernel accepts (kDecodeSplitUnit, kDecodeMaxSplitTokens
# in csrc/kernels/common/attention.h; a test checks that the extension agrees).
DECODE_SPLIT_UNIT = 64
DECODE_MAX_SPLIT_TOKENS = 2048


def _concrete(x) -> bool:
    return _checks.is_concrete(x)


def scale_value(scale, d: int) -> float:
    """The softmax scale: 1/sqrt(D) by default, else a finite static real number."""
    if scale is None:
        return float(1.0 / np.sqrt(d))
    return _checks.static_float(scale, "scale")


def causal_flag(causal) -> bool:
    """causal as a bool: True or False only (a string such as "no" would
    otherwise read as True and silently mask causally)."""
    return _checks.static_bool(causal, "causal")


def head_dim(d: int, name: str) -> None:
    """A head dim of paged_decode_attention: a multiple of HEAD_DIM_UNIT in
    [HEAD_DIM_UNIT, MAX_HEAD_DIM]."""
    if d < HEAD_DIM_UNIT or d > MAX_HEAD_DIM or d % HEAD_DIM_UNIT:
        raise ValueError(f"{name} must be a multiple of {HEAD_DIM_UNIT} in [{HEAD_DIM_UNIT}, "
                         f"{MAX_HEAD_DIM}], got {d}")


def cache_args(k_pages, v_pages) -> None:
    """k_pages (P, page_size, Hkv, Dk) and v_pages (P, page_size, Hkv, Dv):
    one dtype, the same pages and kv heads; the head dims may differ."""
    _checks.rank(k_pages, "k_pages", 4)
    _checks.rank(v_pages, "v_pages", 4)
    _checks.float_dtype(k_pages, "k_pages")
    _checks.same_dtype(k_pages, "k_pages", v_pages, "v_pages")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(
            f"v_pages must be (num_pages, page_size, Hkv, Dv) = {k_pages.shape[:3]} + (Dv,) as "
            f"k_pages {k_pages.shape}, got {v_pages.shape}")
    if k_pages.shape[1] < 1:
        raise ValueError(f"page_size (k_pages.shape[1]) must be >= 1, got {k_pages.shape[1]}")
    num_slots = k_pages.shape[0] * k_pages.shape[1]
    if num_slots >= 2**31:
        raise ValueError(f"k_pages holds num_pages * page_size = {num_slots} slots; the kernels "
                         "index slots with int32 (at most 2**31 - 1)")


def write_kv_args(k_pages, v_pages, k, v, slot_mapping) -> None:
    cache_args(k_pages, v_pages)
    _checks.rank(k, "k", 3)
    _checks.rank(v, "v", 3)
    _checks.same_dtype(k_pages, "k_pages", k, "k")
    _checks.same_dtype(k_pages, "k_pages", v, "v")
    _, _, hkv, d = k_pages.shape
    dv = v_pages.shape[3]
    if k.shape[1:] != (hkv, d):
        raise ValueError(f"k must be (N, Hkv={hkv}, Dk={d}) to match k_pages, got {k.shape}")
    if v.shape != (k.shape[0], hkv, dv):
        raise ValueError(f"v must be (N={k.shape[0]}, Hkv={hkv}, Dv={dv}) to match k and v_pages, "
                         f"got {v.shape}")
    _checks.rank(slot_mapping, "slot_mapping", 1)
    _checks.int_dtype(slot_mapping, "slot_mapping")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping must have N={k.shape[0]} entries, got {slot_mapping.shape[0]}")
    num_slots = k_pages.shape[0] * k_pages.shape[1]
    if _concrete(slot_mapping) and slot_mapping.shape[0]:
        s = np.asarray(slot_mapping)  # compared in its own dtype: nothing wraps
        if int(s.max()) >= num_slots:
            raise ValueError(
                f"slot_mapping must lie in [0, num_pages * page_size = {num_slots}) (negative = "
                f"skip), found {int(s.max())}")
        valid = s[s >= 0]
        if np.unique(valid).size != valid.size:
            raise ValueError("slot_mapping has duplicate slots (each token needs its own slot)")


def decode_split_tokens(split_tokens, capacity: int) -> int | None:
    """paged_decode_attention's split_tokens: None (automatic) or a static
    multiple of DECODE_SPLIT_UNIT up to DECODE_MAX_SPLIT_TOKENS that cuts the
    capacity into at most MAX_DECODE_SPLITS splits."""
    unit, largest = DECODE_SPLIT_UNIT, DECODE_MAX_SPLIT_TOKENS
    if split_tokens is None:
        return None
    v = _checks.static_int(split_tokens, "split_tokens")
    if v < unit or v > largest or v % unit:
        raise ValueError(f"split_tokens must be a multiple of {unit} in [{unit}, {largest}], "
                         f"got {split_tokens!r}")
    if -(-capacity // v) > MAX_DECODE_SPLITS:
        raise ValueError(f"split_tokens={v} cuts page_table's capacity {capacity} into more than "
                         f"{MAX_DECODE_SPLITS} splits; use a larger split_tokens")
    return v


def decode_args(q, k_pages, v_pages, page_table, lengths, scale) -> float:
    cache_args(k_pages, v_pages)
    _checks.rank(q, "q", 3)
    _checks.float_dtype(q, "q")
    _checks.same_dtype(q, "q", k_pages, "k_pages")
    _checks.rank(page_table, "page_table", 2)
    _checks.int_dtype(page_table, "page_table")
    _checks.rank(lengths, "lengths", 1)
    _checks.int_dtype(lengths, "lengths")
    b, hq, d = q.shape
    num_pages, page_size, hkv, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"k_pages' head dim {dk} must equal q's head dim {d}")
    head_dim(d, "q's head dim")
    head_dim(v_pages.shape[3], "v_pages' head dim")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k_pages' kv heads ({hkv})")
    if page_table.shape[0] != b:
        raise ValueError(f"page_table must have B={b} rows (q's batch), got {page_table.shape[0]}")
    if lengths.shape[0] != b:
        raise ValueError(f"lengths must have B={b} entries (q's batch), got {lengths.shape[0]}")
    capacity = page_table.shape[1] * page_size
    if capacity > MAX_DECODE_TOKENS:
        raise ValueError(
            f"page_table's capacity max_pages_per_seq * page_size = {capacity} exceeds "
            f"{MAX_DECODE_TOKENS} tokens")
    if _concrete(lengths) and b:
        ln = np.asarray(lengths)  # compared in its own dtype: nothing wraps
        if int(ln.min()) < 0 or int(ln.max()) > capacity:
            raise ValueError(
                f"lengths must lie in [0, max_pages_per_seq * page_size = {capacity}], found "
                f"values in [{int(ln.min())}, {int(ln.max())}]")
        ln = ln.astype(np.int64)  # in [0, capacity]
        if _concrete(page_table):
            pt = np.asarray(page_table)
            used = np.arange(pt.shape[1])[None, :] * page_size < ln[:, None]
            bad = used & ((pt < 0) | (pt >= num_pages))
            if bad.any():
                bi, pi = (int(x) for x in np.argwhere(bad)[0])
                raise ValueError(
                    f"page_table[{bi}, {pi}] = {int(pt[bi, pi])} is outside [0, num_pages = "
                    f"{num_pages}) but holds tokens of sequence {bi} (length {int(ln[bi])})")
    return scale_value(scale, d)


def prefill_args(q, k, v, cu_seqlens, scale) -> float:
    _checks.rank(q, "q", 3)
    _checks.rank(k, "k", 3)
    _checks.rank(v, "v", 3)
    _checks.float_dtype(q, "q")
    _checks.same_dtype(q, "q", k, "k")
    _checks.same_dtype(q, "q", v, "v")
    n, hq, d = q.shape
    if k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"k must be (N={n}, Hkv, D={d}) to match q, got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    hkv = k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's kv heads ({hkv})")
    _checks.rank(cu_seqlens, "cu_seqlens", 1)
    _checks.int_dtype(cu_seqlens, "cu_seqlens")
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have B+1 >= 1 entries")
    if _concrete(cu_seqlens):
        c = np.asarray(cu_seqlens).astype(np.int64)
        if c[0] != 0 or np.any(np.diff(c) < 0) or c[-1] > n:
            raise ValueError(
                f"cu_seqlens must start at 0, be non-decreasing and end at most at N={n}, "
                f"got {c.tolist()}")
    return scale_value(scale, d)


def cu_seqlens_violated(cu_seqlens, n: int):
    """Device-side form of prefill_args' value check, for jitted code: a
    scalar bool, true where cu_seqlens does not start at 0, decreases
    anywhere or ends past N. No host sync: callers select NaN with it."""
    c = cu_seqlens
    return (c[0] != 0) | jnp.any(c[1:] < c[:-1]) | (c[-1] > n)


def prefill_max_seqlen(q, cu_seqlens, max_seqlen) -> int | None:
    """max_seqlen of prefill_attention: None, or a static int >= 1. Eagerly
    (concrete cu_seqlens) the padded layout's contract is checked: every
    sequence at most max_seqlen tokens and, when N == B * max_seqlen (the
    layout is then a reshape), sequence i starting at token i * max_seqlen.
    Under jit a violation poisons the output with NaN instead."""
    if max_seqlen is None:
        return None
    if isinstance(max_seqlen, bool):
        raise TypeError(f"max_seqlen must be a Python int (static) or None, got {max_seqlen!r}")
    m = _checks.static_int(max_seqlen, "max_seqlen")
    if m < 1:
        raise ValueError(f"max_seqlen must be >= 1, got {m}")
    if _concrete(cu_seqlens) and cu_seqlens.shape[0] > 1:
        c = np.asarray(cu_seqlens).astype(np.int64)
        lens = np.diff(c)
        if int(lens.max()) > m:
            i = int(np.argmax(lens))
            raise ValueError(
                f"sequence {i} has {int(lens[i])} tokens, more than max_seqlen={m}")
        b = c.shape[0] - 1
        if q.shape[0] == b * m and np.any(c[:-1] != np.arange(b) * m):
            raise ValueError(
                f"N = B * max_seqlen = {q.shape[0]}: the packed batch is read as B rows of "
                f"max_seqlen tokens, so sequence i must start at i * max_seqlen (all sequences "
                f"but the last exactly max_seqlen long), got cu_seqlens {c.tolist()}; pass a "
                f"larger max_seqlen (the general, gathered layout)")
    return m


def dispatch_args(q, cu_seqlens, is_decode) -> None:
    """attention_dispatch's own arguments (the rest are checked by write_kv,
    prefill_attention and paged_decode_attention): is_decode (B,) bool with B
    = len(cu_seqlens) - 1; eagerly, every decode sequence has exactly one new
    token (under jit its rows are NaN instead)."""
    _checks.rank(cu_seqlens, "cu_seqlens", 1)
    _checks.rank(is_decode, "is_decode", 1)
    if jnp.dtype(is_decode.dtype) != jnp.dtype(bool):
        raise TypeError(f"is_decode must be a bool array, got {is_decode.dtype}")
    b = cu_seqlens.shape[0] - 1
    if is_decode.shape[0] != b:
        raise ValueError(f"is_decode must have B={b} entries (len(cu_seqlens) - 1), "
                         f"got {is_decode.shape[0]}")
    if _concrete(cu_seqlens) and _concrete(is_decode) and b > 0:
        lens = np.diff(np.asarray(cu_seqlens).astype(np.int64))
        bad = np.asarray(is_decode) & (lens != 1)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"sequence {i} is a decode sequence (is_decode[{i}]) with "
                             f"{int(lens[i])} new tokens in cu_seqlens; a decode sequence has "
                             "exactly one")


def fill_rows_args(x, start, poison):
    """fill_rows' arguments; returns (start, poison) as int32 scalars: start
    clamped to [0, N] (a host integer before it becomes int32, so that a wide
    one cannot wrap), poison as poison != 0."""
    _checks.float_dtype(x, "x")
    if x.ndim < 1:
        raise ValueError(f"x must have a leading row axis, got shape {x.shape}")
    for name, v in (("start", start), ("poison", poison)):
        if jnp.ndim(v) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(v)}")
    on_host = [not isinstance(v, jax.Array) for v in (start, poison)]  # Python or NumPy
    start_a, poison_a = (np.asarray(v) if h else v for v, h in zip((start, poison), on_host))
    if not jnp.issubdtype(start_a.dtype, jnp.integer):
        raise TypeError(f"start must be an integer, got dtype {start_a.dtype}")
    if not (poison_a.dtype == np.bool_ or jnp.issubdtype(poison_a.dtype, jnp.integer)):
        raise TypeError(f"poison must be a bool or an integer, got dtype {poison_a.dtype}")
    n = x.shape[0]
    start_i = (np.int32(np.clip(start_a, 0, n)) if on_host[0]
               else jnp.clip(start_a, 0, n).astype(jnp.int32))
    poison_i = np.int32(poison_a != 0) if on_host[1] else (poison_a != 0).astype(jnp.int32)
    return jnp.asarray(start_i), jnp.asarray(poison_i)
