"""Paged-KV-cache attention: write_kv and paged_decode_attention as XLA FFI
custom calls (CPU and CUDA handlers), prefill_attention over packed
variable-length sequences through jax.nn.dot_product_attention.

The KV cache is plain arrays:
  k_pages, v_pages  (num_pages, page_size, Hkv, D)
  page_table        (B, max_pages_per_seq) int32: page ids of each sequence, in order
  lengths           (B,) int32: tokens of each sequence
Token t of sequence b lives in slot page_table[b, t // page_size] * page_size +
t % page_size. Pure-jnp twins with the same semantics: jax_moe.attention_reference.

Invalid values (only checkable eagerly; under jax.jit the kernels guard instead):
  - write_kv: slots outside [0, num_pages * page_size) are skipped (negative
    slots are the documented padding; eagerly, slots >= num_pages * page_size
    and duplicate slots raise ValueError).
  - paged_decode_attention: lengths are clamped to [0, max_pages * page_size];
    tokens on a page id outside [0, num_pages) are SKIPPED (masked out of the
    softmax); a sequence without any valid token gets a zero output. Eagerly,
    such page ids (in the used part of page_table) and lengths outside
    [0, capacity] raise ValueError.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _attention_checks as _ac
from jax_moe import _ffi
from jax_moe.attention_reference import segment_ids

__all__ = ["write_kv", "paged_decode_attention", "prefill_attention", "prefill_path",
           "decode_num_splits", "DECODE_SPLIT_TOKENS"]

# Tokens per split of the CUDA flash-decoding kernel (csrc/attention_checks.h).
DECODE_SPLIT_TOKENS: int = int(_ffi._ext.DECODE_SPLIT_TOKENS)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype))


def decode_num_splits(max_pages_per_seq: int, page_size: int) -> int:
    """Number of sequence splits of the decode kernel (static: from shapes only)."""
    return max(1, -(-(max_pages_per_seq * page_size) // DECODE_SPLIT_TOKENS))


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Writes token i's k[i], v[i] (N, Hkv, D) into slot slot_mapping[i] =
    page * page_size + offset of the caches; returns the updated (k_pages, v_pages).

    The FFI call aliases its outputs to the cache inputs
    (input_output_aliases={0: 0, 1: 1}): under
    ``jax.jit(step, donate_argnums=...)`` with the caches donated, the update is
    in place and the cache is never copied. Slots < 0 (padding) and slots past
    the cache are skipped."""
    _ac.write_kv_args(k_pages, v_pages, k, v, slot_mapping)
    call = jax.ffi.ffi_call(
        "jax_moe_write_kv",
        (_sds(k_pages.shape, k_pages.dtype), _sds(v_pages.shape, v_pages.dtype)),
        input_output_aliases={0: 0, 1: 1},
        vmap_method="sequential",
    )
    return call(k_pages, v_pages, k, v, slot_mapping.astype(jnp.int32))


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale=None):
    """One query token per sequence against its paged cache.

    q (B, Hq, D) -> (B, Hq, D) in q's dtype; Hq a multiple of Hkv (GQA: query
    head h reads kv head h // (Hq // Hkv)); D in {64, 128, 256}; scale defaults
    to 1/sqrt(D). Scores and softmax statistics in f32; the reduction order is
    fixed (bitwise reproducible run to run)."""
    scale = _ac.decode_args(q, k_pages, v_pages, page_table, lengths, scale)
    b, hq, d = q.shape
    splits = decode_num_splits(page_table.shape[1], k_pages.shape[1])
    call = jax.ffi.ffi_call(
        "jax_moe_paged_decode",
        (_sds(q.shape, q.dtype),
         _sds((b, hq, splits, d), jnp.float32),   # scratch: per-split partial outputs
         _sds((b, hq, splits, 2), jnp.float32)),  # scratch: per-split (max, sum)
        vmap_method="sequential",
    )
    out, _, _ = call(q, k_pages, v_pages, page_table.astype(jnp.int32),
                     lengths.astype(jnp.int32), scale=np.float32(scale))
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


def prefill_path(q, k, v, cu_seqlens, *, causal=True, scale=None, implementation=None) -> str:
    """The path prefill_attention takes for these arguments: "xla" or "cudnn".

    implementation=None picks cuDNN flash attention on an NVIDIA GPU for
    bf16/f16 with D <= 128 (multiple of 8) and XLA otherwise; "xla" / "cudnn"
    force a path ("cudnn" where unsupported raises, as in jax)."""
    _ac.prefill_args(q, k, v, cu_seqlens, scale)
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation is not None:
        return implementation
    return "cudnn" if _cudnn_ok(q) else "xla"


def prefill_attention(q, k, v, cu_seqlens, *, causal=True, scale=None, implementation=None):
    """Attention within each packed sequence: tokens cu_seqlens[i] ..
    cu_seqlens[i+1]-1 form sequence i. q (N, Hq, D), k, v (N, Hkv, D),
    cu_seqlens (B+1,) int32 (values; N is the static shape) -> (N, Hq, D).
    Tokens past cu_seqlens[-1] are padding: their output is 0.

    Runs jax.nn.dot_product_attention on the packed batch (1, N, H, D) with a
    block-diagonal (and causal) boolean mask built from the segment ids of
    cu_seqlens; see prefill_path for which implementation is used."""
    scale = _ac.prefill_args(q, k, v, cu_seqlens, scale)
    path = prefill_path(q, k, v, cu_seqlens, causal=causal, implementation=implementation)
    n = q.shape[0]
    seg = segment_ids(cu_seqlens, n)
    mask = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    if causal:
        # Within one segment, key <= query is the causal mask; folded into the
        # mask so that both paths see the same (1, 1, N, N) mask.
        mask &= jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    dtype = q.dtype
    if path == "xla" and jnp.dtype(dtype) == jnp.dtype(jnp.float16) and _platform() == "cpu":
        # XLA:CPU has no f16 x f16 -> f32 dot_general (which jax's XLA attention
        # emits under jit): compute in f32 there, round once at the end.
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    out = jax.nn.dot_product_attention(
        q[None], k[None], v[None], mask=mask[None, None], scale=scale, implementation=path)[0]
    out = out.astype(dtype)
    return jnp.where((seg >= 0)[:, None, None], out, jnp.zeros((), out.dtype))
