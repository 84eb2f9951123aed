"""Paged-KV-cache attention: write_kv and paged_decode_attention as XLA FFI
custom calls (CPU and CUDA handlers), prefill_attention over packed
variable-length sequences through jax.nn.dot_product_attention, and
attention_dispatch: one step of a batch that mixes prefill and decode
sequences.

The KV cache is plain arrays:
  k_pages           (num_pages, page_size, Hkv, Dk)
  v_pages           (num_pages, page_size, Hkv, Dv): V's head dim may differ from K's
  page_table        (B, max_pages_per_seq) int32: page ids of each sequence, in order
  lengths           (B,) int32: tokens of each sequence
Token t of sequence b lives in slot page_table[b, t // page_size] * page_size +
t % page_size. Pure-jnp twins with the same semantics: jax_moe.attention_reference.

Index arguments (slot_mapping, page_table, lengths) may have any integer
dtype. Their values are compared with the ranges below in their own dtype:
the conversion to the kernels' int32 saturates, so an int64 value past int32
(jax_enable_x64) is out of range like any other, never wrapped onto a valid
slot, page or length.

Invalid values (only checkable eagerly; under jax.jit the kernels guard instead):
  - write_kv: slots outside [0, num_pages * page_size) are skipped (negative
    slots are the documented padding; eagerly, slots >= num_pages * page_size
    and duplicate slots raise ValueError).
  - paged_decode_attention: lengths are clamped to [0, max_pages * page_size];
    tokens on a page id outside [0, num_pages) are SKIPPED (masked out of the
    softmax); a sequence without any valid token gets a zero output. Eagerly,
    such page ids (in the used part of page_table) and lengths outside
    [0, capacity] raise ValueError.
  - prefill_attention: cu_seqlens not starting at 0, decreasing or ending
    past N, and with max_seqlen=M a sequence longer than M (or, when
    N == B * M, one not starting at a multiple of M), make the whole output
    NaN under jit, on every path; eagerly they raise ValueError. A non-finite
    q, k or v value reaches only rows of its own sequence; padding tokens are
    never read.
  - attention_dispatch: a decode sequence with other than one new token gets
    NaN rows under jit; eagerly it raises ValueError.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _attention_checks as _ac
from jax_moe import _checks, _ffi
from jax_moe.attention_reference import dispatch_steps, segment_ids

__all__ = ["write_kv", "paged_decode_attention", "prefill_attention", "prefill_path",
           "attention_dispatch", "fill_rows",
           "decode_num_splits", "decode_split_tokens", "DECODE_SPLIT_UNIT",
           "DECODE_MAX_SPLIT_TOKENS"]

# Tokens per split of the flash-decoding kernel: a multiple of
# DECODE_SPLIT_UNIT, at most DECODE_MAX_SPLIT_TOKENS (csrc/kernels/common/attention.h).
DECODE_SPLIT_UNIT: int = int(_ffi._ext.DECODE_SPLIT_UNIT)
DECODE_MAX_SPLIT_TOKENS: int = int(_ffi._ext.DECODE_MAX_SPLIT_TOKENS)
# The automatic split: the longest of 256 .. DECODE_MAX_SPLIT_TOKENS tokens
# that still gives the GPU this many blocks (about 5 waves of its 3 blocks
# per SM on an H200: longer splits amortise each block's start and merge and
# write fewer partial results; fewer, longer blocks leave a ragged last wave.
# Measured on the H200: 1024-token splits (2048 blocks) read faster than
# 2048-token splits; see docs/performance.md).
_DECODE_MIN_BLOCKS = 2048


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype))


def decode_num_splits(max_pages_per_seq: int, page_size: int, split_tokens: int) -> int:
    """Number of sequence splits of the decode kernel (static: from shapes only)."""
    return max(1, -(-(max_pages_per_seq * page_size) // split_tokens))


def decode_split_tokens(batch: int, q_heads: int, kv_heads: int, capacity: int, dtype) -> int:
    """The automatic split_tokens of paged_decode_attention (static: from
    shapes only). Blocks of the CUDA kernel: batch x kv heads x chunks of 8
    query heads of a GQA group x splits."""
    rows = 8
    chunks = kv_heads * -(-(q_heads // max(kv_heads, 1)) // rows)
    split = 256
    while (split < DECODE_MAX_SPLIT_TOKENS and split < capacity
           and batch * chunks * -(-capacity // (2 * split)) >= _DECODE_MIN_BLOCKS):
        split *= 2
    return split


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Writes token i's k[i] (N, Hkv, Dk) and v[i] (N, Hkv, Dv) into slot
    slot_mapping[i] = page * page_size + offset of k_pages (P, page_size, Hkv,
    Dk) and v_pages (P, page_size, Hkv, Dv); returns the updated (k_pages,
    v_pages). Dv may differ from Dk.

    The FFI call aliases its outputs to the cache inputs
    (input_output_aliases={0: 0, 1: 1}): under
    ``jax.jit(step, donate_argnums=...)`` with the caches donated, the update is
    in place and the cache is never copied. Slots < 0 (padding) and slots past
    the cache, however large (int64 slots are not wrapped to int32), are
    skipped; eagerly, slots past the cache and duplicate slots raise
    ValueError."""
    _ac.write_kv_args(k_pages, v_pages, k, v, slot_mapping)
    call = jax.ffi.ffi_call(
        "jax_moe_write_kv",
        (_sds(k_pages.shape, k_pages.dtype), _sds(v_pages.shape, v_pages.dtype)),
        input_output_aliases={0: 0, 1: 1},
        vmap_method="sequential",
    )
    return call(k_pages, v_pages, k, v, _ac.index_int32(slot_mapping))


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale=None,
                           split_tokens=None):
    """One query token per sequence against its paged cache.

    q (B, Hq, Dk), k_pages (P, page_size, Hkv, Dk), v_pages (P, page_size,
    Hkv, Dv) -> (B, Hq, Dv) in q's dtype; Hq a multiple of Hkv (GQA: query
    head h reads kv head h // (Hq // Hkv)). Dk and Dv are each a multiple of
    8 in [8, 256] and may differ (e.g. Dk = 192, Dv = 128 as in DeepSeek's
    attention: no zero padding of V in the cache). scale defaults to
    1/sqrt(Dk). Scores and softmax statistics in f32; the reduction order is
    fixed (bitwise reproducible run to run). On the GPU, bf16/f16 run on
    tensor cores with the probabilities rounded to q's dtype before they
    weight V (as FlashAttention does); f32 runs in f32 throughout. The CUDA
    kernels are compiled for head dims 64, 128 and 256; other pairs run on
    the smallest of them that covers both dims (rows zero-filled in shared
    memory: only the real dims are read from the cache, the arithmetic is
    that of the compiled dim).
    lengths are clamped to [0, capacity] and page ids outside [0, P) are
    skipped, whatever their integer dtype (64-bit values are saturated, not
    wrapped, on the way to the kernels' int32).

    split_tokens (static; None = decode_split_tokens' choice): tokens per
    split of the flash-decoding kernel, a multiple of DECODE_SPLIT_UNIT up to
    DECODE_MAX_SPLIT_TOKENS. A tuning knob only: any value gives the same
    result up to the order of the sums."""
    scale = _ac.decode_args(q, k_pages, v_pages, page_table, lengths, scale)
    b, hq, _ = q.shape
    dv = v_pages.shape[3]
    capacity = page_table.shape[1] * k_pages.shape[1]
    split_tokens = _ac.decode_split_tokens(split_tokens, capacity)
    if split_tokens is None:
        split_tokens = decode_split_tokens(b, hq, k_pages.shape[2], capacity, q.dtype)
    splits = decode_num_splits(page_table.shape[1], k_pages.shape[1], split_tokens)
    call = jax.ffi.ffi_call(
        "jax_moe_paged_decode",
        (_sds((b, hq, dv), q.dtype),
         _sds((b, hq, splits, dv), jnp.float32),  # scratch: per-split partial outputs
         _sds((b, hq, splits, 2), jnp.float32)),  # scratch: per-split (max, sum)
        vmap_method="sequential",
    )
    out, _, _ = call(q, k_pages, v_pages, _ac.index_int32(page_table),
                     _ac.index_int32(lengths), scale=np.float32(scale),
                     split_tokens=np.int64(split_tokens))
    return out


_IMPLEMENTATIONS = (None, "xla", "cudnn")


def _platform() -> str:
    """The platform computations are placed on by default ("cpu", "gpu", ...)."""
    dev = jax.config.jax_default_device
    if dev is not None:
        return dev if isinstance(dev, str) else dev.platform
    return jax.default_backend()


def _cudnn_ok(q) -> bool:
    if _platform() not in ("gpu", "cuda"):
        return False
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    d = q.shape[-1]
    if d % 8 or d > 128:  # cuDNN flash attention: D <= 128 before Hopper (256 on Hopper)
        return False
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
    except Exception:  # noqa: BLE001 - no cuDNN: the XLA path
        return False
    return True


def prefill_path(q, k, v, cu_seqlens, *, causal=True, scale=None, implementation=None,
                 max_seqlen=None) -> str:
    """The path prefill_attention takes for these arguments: "xla" or "cudnn"
    (segment mask over the packed batch), "xla_padded" or "cudnn_padded"
    (max_seqlen given: padded batch with sequence lengths).

    implementation=None picks cuDNN flash attention on an NVIDIA GPU for
    bf16/f16 with D <= 128 (multiple of 8) and XLA otherwise; "xla" / "cudnn"
    force an implementation ("cudnn" where unsupported raises, as in jax)."""
    _ac.prefill_args(q, k, v, cu_seqlens, scale)
    _ac.causal_flag(causal)
    m = _ac.prefill_max_seqlen(q, cu_seqlens, max_seqlen)
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    impl = implementation if implementation is not None else ("cudnn" if _cudnn_ok(q) else "xla")
    return impl if m is None else impl + "_padded"


def prefill_attention(q, k, v, cu_seqlens, *, causal=True, scale=None, implementation=None,
                      max_seqlen=None):
    """Attention within each packed sequence: tokens cu_seqlens[i] ..
    cu_seqlens[i+1]-1 form sequence i. q (N, Hq, D), k, v (N, Hkv, D),
    cu_seqlens (B+1,) int32 (values; N is the static shape) -> (N, Hq, D).
    Tokens past cu_seqlens[-1] are padding: their output is 0.

    Contract of cu_seqlens: it starts at 0, never decreases and ends at most
    at N. Eagerly a violation raises ValueError; under jit it is detected on
    device and the whole output (padding rows included) is NaN, on every
    path, as in the twin.

    Sequences are isolated: a row's output depends only on the q, k, v of
    its own sequence, and padding tokens are never read (they may hold
    anything, NaN included). A NaN in q, k or v (an inf too, on the default
    path) reaches, as NaN, the outputs that attend to it: q's row and head,
    every output of the attending rows' heads of that kv head for k, that
    element's dim of them for v. Without max_seqlen exactly those, as in the
    twin (non-finite k, v values go into the kernel as 0 and come back as
    NaN); with max_seqlen the kernels' own arithmetic may also make other
    rows of that sequence non-finite (0 * NaN for a causally masked key),
    never rows of another one.

    max_seqlen=None: jax.nn.dot_product_attention on the packed batch
    (1, N, H, D) with a block-diagonal (and causal) (N, N) boolean mask built
    from the segment ids of cu_seqlens. jax hands cuDNN a mask as a dense
    (N, N) bias, so every block of the N x N scores is computed: slow for
    several sequences.

    max_seqlen=M (static int): the sequences are laid out as a padded batch
    (B, M, H, D) and attended with query_seq_lengths = key_value_seq_lengths
    = the lengths from cu_seqlens (cuDNN's padding mask: no mask tensor to
    read, and causally the upper triangle is not computed). With N == B * M the
    layout is a reshape, which requires sequence i to start at token i * M
    (so all but the last sequence are exactly M long); with causal=True
    it then needs no lengths at all (no real query sees the padding at the
    end), so the dense causal kernel runs and the padding rows are zeroed
    afterwards. Otherwise device-side
    gathers computed from cu_seqlens move the tokens in and out (no host
    sync; jittable). Contract: cu_seqlens' above, every sequence has at most
    M tokens (and, with N == B * M, the starts above). Eagerly a violation
    raises ValueError; under jit it is detected on device and the whole
    output is NaN, never a silently wrong result.

    See prefill_path for which implementation is used."""
    scale = _ac.prefill_args(q, k, v, cu_seqlens, scale)
    causal = _ac.causal_flag(causal)
    path = prefill_path(q, k, v, cu_seqlens, causal=causal, implementation=implementation,
                        max_seqlen=max_seqlen)
    impl = path.removesuffix("_padded")
    dtype = q.dtype
    if (impl == "xla" and jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
            and _platform() == "cpu"):
        # XLA:CPU has no f16 x f16 -> f32 dot_general (which jax's XLA attention
        # emits under jit), nor bf16 x bf16 -> f32 where it emits the dot
        # elementwise (small dots: one head, one row): compute in f32 there,
        # round once at the end.
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    if path.endswith("_padded"):
        out = _prefill_padded(q, k, v, cu_seqlens, int(max_seqlen), causal=causal, scale=scale,
                              implementation=impl)
        return out.astype(dtype)
    n, hq, d = q.shape
    hkv = k.shape[1]
    cu = _ac.index_int32(cu_seqlens)
    seg = segment_ids(cu, n)
    mask = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    if causal:
        # Within one segment, key <= query is the causal mask; folded into the
        # mask so that both paths see the same (1, 1, N, N) mask.
        mask &= jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    # Every query multiplies every V row (a masked key's probability is 0, and
    # 0 * NaN is NaN; cuDNN adds the mask to the scores as a bias, so a
    # non-finite k reaches every query too): non-finite k, v values go in as
    # 0 and come back as NaN in exactly the queries that attend to them.
    finite_k, finite_v = jnp.isfinite(k), jnp.isfinite(v)
    nonfinite = ~jnp.all(finite_k, axis=-1, keepdims=True) | ~finite_v   # (N, Hkv, D)
    k = jnp.where(finite_k, k, jnp.zeros((), k.dtype))
    v = jnp.where(finite_v, v, jnp.zeros((), v.dtype))
    out = jax.nn.dot_product_attention(
        q[None], k[None], v[None], mask=mask[None, None], scale=scale, implementation=impl)[0]
    out = out.astype(dtype).reshape(n, hkv, hq // hkv, d)
    nan = jnp.asarray(jnp.nan, out.dtype)
    out = jnp.where(_attends_to(nonfinite, cu, seg, causal)[:, :, None, :], nan, out)
    out = jnp.where((seg >= 0)[:, None, None, None], out, jnp.zeros((), out.dtype))
    # cu_seqlens outside its contract: the whole output, padding rows too
    return jnp.where(_ac.cu_seqlens_violated(cu_seqlens, n), nan, out).reshape(n, hq, d)


def _attends_to(flags, cu, seg, causal: bool):
    """flags (N, ...) bool, one per packed key row -> (N, ...) bool: whether
    query row i attends to a flagged row (of its own sequence; causally, at
    or before i). One scan: last[i] is the last flagged row <= i, which lies
    in row i's sequence iff it is >= the sequence's start."""
    n = flags.shape[0]
    b = cu.shape[0] - 1
    pos = jnp.arange(n, dtype=jnp.int32).reshape((n,) + (1,) * (flags.ndim - 1))
    last = jax.lax.cummax(jnp.where(flags, pos, -1), axis=0)
    s = jnp.clip(seg, 0, max(b - 1, 0))  # padding rows: any sequence (their output is 0)
    if not causal:  # a query attends to its whole sequence: look from its last row
        last = jnp.take(last, jnp.clip(cu[jnp.minimum(s + 1, b)] - 1, 0, max(n - 1, 0)), axis=0)
    return last >= cu[s].reshape(pos.shape)


def attention_dispatch(q, k, v, k_pages, v_pages, page_table, lengths, cu_seqlens, is_decode,
                       slot_mapping, *, scale=None, max_seqlen=None, implementation=None,
                       split_tokens=None):
    """One attention step of a batch that mixes prefill and decode sequences
    (continuous batching), with static shapes; jittable.

    The batch: B sequences whose new tokens are packed into N rows; sequence
    b's are rows cu_seqlens[b] .. cu_seqlens[b+1]-1 of q (N, Hq, D) and k, v
    (N, Hkv, D); rows past cu_seqlens[-1] are padding (output 0).
      - is_decode[b] true (decode): exactly one new token, which attends over
        the sequence's paged cache: lengths[b] tokens through page_table[b],
        its own new token included.
      - is_decode[b] false (prefill): its tokens attend causally to each other
        (a prompt from scratch; lengths[b] is not used).
    slot_mapping (N,) int32: the cache slot of each new token (negative: not
    written), as write_kv takes it.

    Every new token is written to the cache first (write_kv; donate the
    caches under jit for an in-place update), then both paths run over the
    whole batch: prefill_attention over the packed rows (each decode token a
    sequence of one; max_seqlen, implementation as there) and
    paged_decode_attention over each sequence's first row (split_tokens as
    there), with the prefill sequences' lengths set to 0 so that their
    blocks read nothing. Each row takes its sequence's path's output.
    Cost: the prefill path also attends each decode token to itself, and
    with max_seqlen it pads every sequence, decode ones included, to
    max_seqlen rows (B * max_seqlen); for batches of many decode sequences
    leave max_seqlen None (a mask over the N packed rows).

    Returns (out (N, Hq, D), k_pages, v_pages). A decode sequence with other
    than one new token raises ValueError eagerly; under jit its rows are NaN.
    cu_seqlens outside prefill_attention's contract: under jit every row is
    NaN, decode rows included.
    Twin: jax_moe.attention_reference.attention_dispatch."""
    prefill_path(q, k, v, cu_seqlens, causal=True, scale=scale, implementation=implementation,
                 max_seqlen=max_seqlen)  # its argument checks, before any kernel

    def prefill(q_, k_, v_, cu):
        return prefill_attention(q_, k_, v_, cu, causal=True, scale=scale,
                                 implementation=implementation, max_seqlen=max_seqlen)

    def decode(qd, kp, vp, pt, ln):
        return paged_decode_attention(qd, kp, vp, pt, ln, scale=scale, split_tokens=split_tokens)

    return dispatch_steps(write_kv, prefill, decode, q, k, v, k_pages, v_pages, page_table,
                          lengths, cu_seqlens, is_decode, slot_mapping, scale, split_tokens)


def fill_rows(x, start, poison):
    """x (N, ...) with rows start .. N-1 set to 0 (start clamped to [0, N]),
    or, where poison is true, every element NaN: an FFI call on x's buffer in
    place (input_output_aliases), reading start and poison on the device, so
    that it costs a launch plus the rows it writes. start, poison: scalars
    (traced or not): start an integer, poison a bool or an integer (nonzero:
    true)."""
    start, poison = _ac.fill_rows_args(x, start, poison)
    ctrl = jnp.stack([start, poison])
    call = jax.ffi.ffi_call("jax_moe_fill_rows", _sds(x.shape, x.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(x, ctrl)


def _padded_gather_index(cu_seqlens, n: int, max_seqlen: int):
    """(B * max_seqlen,) int32: the packed token at row j of padded sequence i,
    flattened (i * max_seqlen + j); rows past a sequence's length (clamped to
    [0, max_seqlen]) and indices outside [0, N) give N (out of range: filled)."""
    cu = _ac.index_int32(cu_seqlens)
    lens = jnp.clip(cu[1:] - cu[:-1], 0, max_seqlen)
    j = jnp.arange(max_seqlen, dtype=jnp.int32)
    src = cu[:-1, None] + j[None, :]
    ok = (j[None, :] < lens[:, None]) & (src >= 0) & (src < n)
    return jnp.where(ok, src, n).reshape(-1)


def _padded_scatter_index(cu_seqlens, n: int, max_seqlen: int):
    """(N,) int32: the padded row (i * max_seqlen + j) holding packed token t;
    padding tokens (past cu_seqlens[-1]) and tokens past max_seqlen within
    their sequence give B * max_seqlen (out of range: filled)."""
    cu = _ac.index_int32(cu_seqlens)
    b = cu.shape[0] - 1
    seg = segment_ids(cu, n)
    segc = jnp.clip(seg, 0, b - 1)
    off = jnp.arange(n, dtype=jnp.int32) - cu[segc]
    ok = (seg >= 0) & (off >= 0) & (off < max_seqlen)
    return jnp.where(ok, segc * max_seqlen + off, b * max_seqlen)


def _take_rows(x, idx):
    """x[idx] along axis 0; out-of-range indices give zero rows."""
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def _zero_last_block_tail(xp, keep):
    """xp (B, M, ...) with rows keep .. M-1 of its last block set to 0."""
    last = xp[-1]
    rows = jnp.arange(last.shape[0]).reshape((-1,) + (1,) * (last.ndim - 1))
    last = jnp.where(rows < keep, last, jnp.zeros((), xp.dtype))
    return jax.lax.dynamic_update_index_in_dim(xp, last, xp.shape[0] - 1, axis=0)


def _prefill_padded(q, k, v, cu_seqlens, m, *, causal, scale, implementation):
    n, hq, d = q.shape
    hkv = k.shape[1]
    b = cu_seqlens.shape[0] - 1
    if n == 0 or b == 0:  # no sequence: every token is padding
        return jnp.where(_ac.cu_seqlens_violated(cu_seqlens, n), jnp.asarray(jnp.nan, q.dtype),
                         jnp.zeros(q.shape, q.dtype))
    cu = _ac.index_int32(cu_seqlens)
    lens = cu[1:] - cu[:-1]
    bad = _ac.cu_seqlens_violated(cu_seqlens, n) | jnp.any(lens > m)
    reshape = n == b * m
    if reshape:
        bad = bad | jnp.any(cu[:-1] != jnp.arange(b, dtype=jnp.int32) * m)
    # Never past the padded rows, whatever cu_seqlens holds; on a violation
    # every row is a query, so that the poison below reaches all of them.
    lens = jnp.where(bad, m, jnp.clip(lens, 0, m))

    def attend(qp, kp, vp):
        return jax.nn.dot_product_attention(
            qp, kp, vp, scale=scale, is_causal=causal, query_seq_lengths=lens,
            key_value_seq_lengths=lens, implementation=implementation)

    if reshape:
        # Rows i*m .. i*m + m - 1 are sequence i: a reshape, no copy. Padding
        # tokens (only possible at the end of the last sequence) are query rows
        # past its length, which both implementations output as 0.
        qp, kp, vp = (x.reshape(b, m, x.shape[1], d) for x in (q, k, v))
        # The padding tokens are K, V rows of the last sequence's block that
        # its queries multiply by a probability of 0 (0 * NaN is NaN): zero
        # them. One block (m rows) each, in place where k, v are intermediates.
        kp, vp = (_zero_last_block_tail(x, lens[-1]) for x in (kp, vp))
        if causal:
            # Every sequence but the last is m long, and the last one's padding
            # rows come after its tokens, so no real query sees a padding key:
            # the dense causal kernel without sequence lengths is exact for
            # every real row (cuDNN's length masking cost 4-11% on the H200).
            # fill_rows then zeroes the padding rows (from cu_seqlens[-1] on)
            # or, on a violation, fills the whole output with NaN, in place.
            out = jax.nn.dot_product_attention(qp, kp, vp, scale=scale, is_causal=True,
                                               implementation=implementation)
            return fill_rows(out.reshape(n, hq, d), cu[-1], bad)
        # Poison: NaN in the first V row of each sequence reaches every query
        # row (p * NaN is NaN even for p = 0). An update of B rows, in place
        # where v is an intermediate; a pass over the output would cost more.
        first = jnp.where(bad, jnp.asarray(jnp.nan, vp.dtype), vp[:, :1])
        vp = jax.lax.dynamic_update_slice_in_dim(vp, first, 0, axis=1)
        return attend(qp, kp, vp).reshape(n, hq, d)
    gather = _padded_gather_index(cu, n, m)
    qp = _take_rows(q, gather).reshape(b, m, hq, d)
    kp = _take_rows(k, gather).reshape(b, m, hkv, d)
    vp = _take_rows(v, gather).reshape(b, m, hkv, d)
    out = _take_rows(attend(qp, kp, vp).reshape(b * m, hq, d), _padded_scatter_index(cu, n, m))
    return jnp.where(bad, jnp.asarray(jnp.nan, out.dtype), out)  # fused into the gather
