"""A small decoder layer served from a paged KV cache: one packed prefill of B
prompts of different lengths, then N greedy decode steps, then one mixed step
in which a new prompt joins the batch while the B sequences decode
(continuous batching, attention_dispatch); every step jitted with the caches
donated (updated in place), and checked against a dense reference that never
sees a page.

Layer (no positional encoding, parameter-free RMS pre-norms):
    h   = x + o_proj(attention(q_proj(n(x)), k_proj(n(x)), v_proj(n(x))))   GQA
    out = h + moe_forward(n(h), n(h) @ router, w13, w2, topk)
The "token" fed back at each step is the layer's output hidden state for the
last position of each sequence (no vocabulary).

Paged path:  prefill_attention over the packed prompts + write_kv of their K/V,
             then per step write_kv of the new token + paged_decode_attention;
             the mixed step is one attention_dispatch over the B decode
             tokens and the new prompt's tokens.
Reference:   for every sequence, the layer recomputed from scratch over its
             whole history of inputs (prompt + tokens fed back so far) with
             plain causal jnp attention and moe_forward(backend="reference").

    python examples/decode_loop.py [--steps 8] [--prompt-lens 37 16 50] [--join-len 11]
                                   [--page-size 16]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe
from jax_moe import attention

# Exact f32 matmuls everywhere (XLA on GPU would otherwise use TF32 for f32 dots
# and the 1e-4 check would measure TF32 rounding, not the cache).
jax.config.update("jax_default_matmul_precision", "highest")


def rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def init_params(key, hidden, hq, hkv, d, experts, inter, dtype):
    ks = jax.random.split(key, 7)

    def w(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5).astype(dtype)

    return {
        "wq": w(ks[0], (hidden, hq * d), hidden),
        "wk": w(ks[1], (hidden, hkv * d), hidden),
        "wv": w(ks[2], (hidden, hkv * d), hidden),
        "wo": w(ks[3], (hq * d, hidden), hq * d),
        "router": w(ks[4], (hidden, experts), hidden),
        "w13": w(ks[5], (experts, 2 * inter, hidden), hidden),  # (E, 2I, H): gate | up
        "w2": w(ks[6], (experts, hidden, inter), inter),         # (E, H, I)
    }


def qkv(p, x, hq, hkv, d):
    n = rms(x)
    return ((n @ p["wq"]).reshape(-1, hq, d), (n @ p["wk"]).reshape(-1, hkv, d),
            (n @ p["wv"]).reshape(-1, hkv, d))


def ffn(p, h, topk, backend):
    n = rms(h)
    return h + jax_moe.moe_forward(n, (n @ p["router"]).astype(jnp.float32), p["w13"], p["w2"],
                                   topk, backend=backend)


def make_prefill(hq, hkv, d, topk):
    """Packed prefill: x (N, H) of all prompts back to back (padding past
    cu_seqlens[-1] has slot -1) -> (outputs (N, H), caches)."""

    def prefill(p, k_pages, v_pages, x, cu_seqlens, slots):
        q, k, v = qkv(p, x, hq, hkv, d)
        k_pages, v_pages = attention.write_kv(k_pages, v_pages, k, v, slots)
        a = attention.prefill_attention(q, k, v, cu_seqlens, causal=True)
        h = x + a.reshape(x.shape[0], hq * d) @ p["wo"]
        return k_pages, v_pages, ffn(p, h, topk, "ffi")

    return jax.jit(prefill, donate_argnums=(1, 2))


def make_decode(hq, hkv, d, topk, page_size):
    """One decode step: x (B, H) is token number lengths[b] of sequence b."""

    def decode(p, k_pages, v_pages, page_table, lengths, x):
        q, k, v = qkv(p, x, hq, hkv, d)
        rows = jnp.arange(x.shape[0])
        slots = page_table[rows, lengths // page_size] * page_size + lengths % page_size
        k_pages, v_pages = attention.write_kv(k_pages, v_pages, k, v, slots)
        lengths = lengths + 1
        a = attention.paged_decode_attention(q, k_pages, v_pages, page_table, lengths)
        h = x + a.reshape(x.shape[0], hq * d) @ p["wo"]
        return k_pages, v_pages, lengths, ffn(p, h, topk, "ffi")

    return jax.jit(decode, donate_argnums=(1, 2))


def make_mixed(hq, hkv, d, topk):
    """One continuous-batching step: x (N, H) packs each decode sequence's
    next token and each joining prompt's tokens (cu_seqlens, is_decode,
    slots describe them, as attention_dispatch takes them)."""

    def mixed(p, k_pages, v_pages, page_table, lengths, x, cu_seqlens, is_decode, slots):
        q, k, v = qkv(p, x, hq, hkv, d)
        a, k_pages, v_pages = attention.attention_dispatch(
            q, k, v, k_pages, v_pages, page_table, lengths, cu_seqlens, is_decode, slots)
        h = x + a.reshape(x.shape[0], hq * d) @ p["wo"]
        return k_pages, v_pages, ffn(p, h, topk, "ffi")

    return jax.jit(mixed, donate_argnums=(1, 2))


def make_reference(hq, hkv, d, topk):
    """The layer over one sequence's whole history x_hist (L, H), dense causal
    attention in plain jnp (f32 softmax), reference MoE -> (L, H)."""

    def ref(p, x, n):
        # x is padded to a fixed length (one compilation); rows >= n are
        # ignored: keys there are masked out and their outputs unused.
        q, k, v = qkv(p, x, hq, hkv, d)
        g = hq // hkv
        length = x.shape[0]
        qf = q.astype(jnp.float32).reshape(length, hkv, g, d) / np.sqrt(d)
        s = jnp.einsum("qhgd,khd->hgqk", qf, k.astype(jnp.float32))
        pos = jnp.arange(length)
        causal = (pos[:, None] >= pos[None, :]) & (pos[None, :] < n)
        s = jnp.where(causal, s, -jnp.inf)
        pr = jax.nn.softmax(s, axis=-1)
        a = jnp.einsum("hgqk,khd->qhgd", pr, v.astype(jnp.float32)).astype(x.dtype)
        h = x + a.reshape(length, hq * d) @ p["wo"]
        return ffn(p, h, topk, "reference")

    ref = jax.jit(ref)

    def run(p, x_hist, max_len):
        n = x_hist.shape[0]
        padded = np.zeros((max_len, x_hist.shape[1]), x_hist.dtype)
        padded[:n] = x_hist
        return np.asarray(ref(p, jnp.asarray(padded), n))[:n]

    return run


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[37, 16, 50],
                    help="prompt length of each sequence (B = how many)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps")
    ap.add_argument("--join-len", type=int, default=11,
                    help="prompt length of the sequence that joins in the last, mixed step "
                         "(0: no mixed step)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64, choices=[64, 128, 256])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--spare-pages", type=int, default=5, help="unused pages in the pool")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative error allowed per step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dtype = jnp.float32
    lens = [int(n) for n in args.prompt_lens]
    if min(lens) < 1:
        ap.error("prompt lengths must be >= 1")
    if args.steps < 0 or args.join_len < 0:
        ap.error("--steps and --join-len must be >= 0")
    join = args.join_len
    b, ps, hq, hkv, d = len(lens), args.page_size, args.q_heads, args.kv_heads, args.head_dim
    hidden, steps = args.hidden, args.steps
    rng = np.random.default_rng(args.seed)
    key_p, key_x = jax.random.split(jax.random.PRNGKey(args.seed))
    params = init_params(key_p, hidden, hq, hkv, d, args.experts, args.intermediate, dtype)

    # Page pool: each sequence gets enough pages for prompt + all decode steps
    # (+ the mixed step), the joining prompt for its tokens (the table's last
    # row), drawn in a random order from a pool with spare pages (nothing
    # contiguous).
    mixed_steps = 1 if join else 0
    need = [-(-(n + steps + mixed_steps) // ps) for n in lens] + ([-(-join // ps)] if join else [])
    num_pages = sum(need) + args.spare_pages
    perm = rng.permutation(num_pages)
    max_pages = max(need)
    table = np.full((len(need), max_pages), -1, np.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    k_pages = jnp.zeros((num_pages, ps, hkv, d), dtype)
    v_pages = jnp.zeros((num_pages, ps, hkv, d), dtype)

    # Packed prompts, padded to a multiple of 16 tokens (padding: slot -1).
    total = sum(lens)
    n_pad = -(-total // 16) * 16
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = np.full((n_pad,), -1, np.int32)
    for i, n in enumerate(lens):
        t = np.arange(n)
        slots[cu[i]:cu[i + 1]] = table[i, t // ps] * ps + t % ps
    x_packed = jax.random.normal(key_x, (n_pad, hidden), jnp.float32).astype(dtype)
    x_packed = jnp.where((jnp.arange(n_pad) < total)[:, None], x_packed, 0)

    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); B={b} prompts {lens}, "
          f"{steps} decode steps, page size {ps}, {num_pages} pages; H={hidden} Hq={hq} Hkv={hkv} "
          f"D={d}; MoE E={args.experts} k={args.topk} I={args.intermediate}; {jnp.dtype(dtype).name}")

    prefill = make_prefill(hq, hkv, d, args.topk)
    decode = make_decode(hq, hkv, d, args.topk, ps)
    reference = make_reference(hq, hkv, d, args.topk)
    page_table = jnp.asarray(table[:b])

    max_len = -(-(max(lens + [join]) + steps + mixed_steps) // 16) * 16
    history = [np.asarray(x_packed[cu[i]:cu[i + 1]]) for i in range(b)]  # inputs seen so far
    worst = 0.0
    t0 = time.perf_counter()
    k_pages, v_pages, out = prefill(params, k_pages, v_pages, x_packed, jnp.asarray(cu),
                                    jnp.asarray(slots))
    out = np.asarray(out)
    t_prefill = time.perf_counter() - t0
    err = max(rel_err(out[cu[i]:cu[i + 1]], reference(params, history[i], max_len))
              for i in range(b))
    worst = max(worst, err)
    print(f"prefill ({total} packed tokens, {t_prefill:.2f} s incl. compile): max rel err {err:.2e}")

    x = jnp.asarray(np.stack([out[cu[i + 1] - 1] for i in range(b)]))  # last position -> next token
    lengths = jnp.asarray(np.asarray(lens, np.int32))
    for step in range(steps):
        for i in range(b):
            history[i] = np.concatenate([history[i], np.asarray(x[i:i + 1])])
        t0 = time.perf_counter()
        k_pages, v_pages, lengths, x = decode(params, k_pages, v_pages, page_table, lengths, x)
        x.block_until_ready()
        dt = time.perf_counter() - t0
        got = np.asarray(x)
        err = max(rel_err(got[i], reference(params, history[i], max_len)[-1]) for i in range(b))
        worst = max(worst, err)
        print(f"decode step {step}: lengths {np.asarray(lengths).tolist()}, max rel err {err:.2e} "
              f"({1e3 * dt:.1f} ms{' incl. compile' if step == 0 else ''})")

    if join:
        # The B sequences' next tokens (rows 0..B-1) and the joining prompt
        # (rows B..B+join-1), padded to a multiple of 16 rows (slot -1).
        x_new = jax.random.normal(jax.random.PRNGKey(args.seed + 1), (join, hidden), dtype)
        n_rows = -(-(b + join) // 16) * 16
        rows = jnp.zeros((n_rows, hidden), dtype).at[:b].set(x).at[b:b + join].set(x_new)
        ln = np.asarray(lengths)
        t = np.arange(join)
        slots = np.full((n_rows,), -1, np.int32)
        slots[:b] = table[np.arange(b), ln // ps] * ps + ln % ps
        slots[b:b + join] = table[b, t // ps] * ps + t % ps
        cu = np.concatenate([np.arange(b + 1), [b + join]]).astype(np.int32)
        is_decode = np.arange(b + 1) < b
        for i in range(b):
            history[i] = np.concatenate([history[i], np.asarray(x[i:i + 1])])
        t0 = time.perf_counter()
        k_pages, v_pages, out = make_mixed(hq, hkv, d, args.topk)(
            params, k_pages, v_pages, jnp.asarray(table), jnp.asarray(np.append(ln + 1, join)),
            rows, jnp.asarray(cu), jnp.asarray(is_decode), jnp.asarray(slots))
        out = np.asarray(out)
        dt = time.perf_counter() - t0
        err = max([rel_err(out[i], reference(params, history[i], max_len)[-1]) for i in range(b)]
                  + [rel_err(out[b:b + join], reference(params, np.asarray(x_new), max_len))])
        worst = max(worst, err)
        print(f"mixed step: {b} decode tokens + a {join}-token prompt, attention_dispatch, "
              f"max rel err {err:.2e} ({1e3 * dt:.1f} ms incl. compile)")

    print(f"worst max relative error: {worst:.2e} (tolerance {args.tol:g})")
    if not worst <= args.tol:  # NaN fails too
        print("FAILED: the paged path and the dense reference disagree")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
