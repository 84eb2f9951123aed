"""Attention benchmark: jax_moe.attention's paged decode and packed prefill
against dense jax.nn.dot_product_attention on contiguous (padded) tensors.

decode:  paged_decode_attention (page sizes 16 and 64, pages in random order)
         vs jax.nn.dot_product_attention(implementation="xla" | "cudnn") on a
         contiguous (B, L, Hkv, D) cache with key_value_seq_lengths. Reported
         as µs per call and TB/s of KV read: the bytes of K and V that the
         lengths cover (sum(lengths) * Hkv * D * 2 * itemsize).
prefill: prefill_attention on B sequences packed into S tokens vs dense
         causal attention on the padded batch (B, S/B, H, D) ("xla" |
         "cudnn"). The packed batch runs on the default implementation with
         the segment mask, with max_seqlen = S/B (sequence lengths; N == B *
         max_seqlen: a reshape) and with max_seqlen = S/B + 128 (the gathered
         layout), and with the mask forced onto "xla". Reported as µs and
         TFLOP/s of useful causal FLOPs: 4 * Hq * D * sum_i s_i (s_i + 1) / 2,
         and the max abs difference to dense XLA.
dispatch: attention_dispatch on a continuous-batching step (B decode
         sequences of L tokens, pages of 16 in random order, and one prompt
         of P tokens joining), against the same work as separate calls
         (write_kv, paged_decode_attention over the B sequences,
         prefill_attention over the prompt): the cost of the static-shape
         dispatch. The caches are threaded through the chain, so that
         write_kv updates them in place.

Timing: a jitted straight-line loop of many calls, each call's output is the
next call's query (nothing hoisted or cached), run after a warm-up several
times (median); the time per call is the slope between a loop of --calls
calls and one of a fifth as many, so that the fixed cost of dispatching a
program cancels out (_bench_common.per_call_seconds). cuDNN rows are
attempted on GPU only and recorded as failed when cuDNN refuses the shape.

    python benchmarks/bench_attention.py                       # full grid (meant for the GPU)
    python benchmarks/bench_attention.py --quick --json a.json # tiny sizes, any backend (CI smoke)
"""

from __future__ import annotations

import argparse
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np
from _bench_common import chain, check_least, per_call_seconds, pyplot, write_json

from jax_moe import attention

DECODE_CASES = ((64, 4096), (8, 32768))      # (B, L)
PREFILL_CASES = ((1, 4096), (4, 8192))       # (B sequences, S packed tokens)
DISPATCH_CASES = ((64, 4096, 512),)          # (B decode sequences, L, prompt tokens)
PAGE_SIZES = (16, 64)
HEADS = (32, 8, 128)                         # Hq, Hkv, D
QUICK_DECODE_CASES = ((4, 256), (2, 1024))
QUICK_PREFILL_CASES = ((1, 128), (2, 256))
QUICK_DISPATCH_CASES = ((4, 256, 64),)
QUICK_HEADS = (4, 2, 64)



def time_loop(step, state, args, calls, repeats):
    """Device seconds per call of `step(state, *args) -> state'`, chained on
    its own output (_bench_common.per_call_seconds). The state is the query,
    or a tuple of the query and the caches for a step that writes them: only
    the chain's first write then copies the (not donated) caches, once per
    program, and the slope drops it."""

    def program(n):
        @jax.jit
        def run(state, *args):
            return chain(lambda i, st: step(st, *args), n, state)

        jax.block_until_ready(run(state, *args))  # compile + warm-up
        return lambda: jax.block_until_ready(run(state, *args))

    return per_call_seconds(program, calls, repeats)


def dense_impls(on_gpu: bool):
    return ("xla", "cudnn") if on_gpu else ("xla",)


def _max_err(out, want):
    """Max |out - want| (want: the dense XLA yardstick as f32 numpy, or None)."""
    if want is None:
        return None
    return float(np.max(np.abs(np.asarray(out.astype(jnp.float32)) - want)))


def _failed(what, exc):
    msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
    print(f"  {what} failed: {msg}")


def bench_decode(b, length, heads, dtype, calls, repeats, on_gpu, rng, decode_splits=()):
    hq, hkv, d = heads
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, length, hkv, d), jnp.float32).astype(dtype)   # contiguous
    v = jax.random.normal(kv, (b, length, hkv, d), jnp.float32).astype(dtype)
    lengths = jnp.full((b,), length, jnp.int32)
    item = jnp.dtype(dtype).itemsize
    kv_bytes = float(np.sum(np.asarray(lengths))) * hkv * d * 2 * item
    case = f"B={b} L={length}"
    rows = []

    def row(impl, sec, err=None):
        r = {"kind": "decode", "case": case, "B": b, "L": length, "impl": impl,
             "us": None if sec is None else sec * 1e6, "kv_bytes": kv_bytes,
             "tbps": None if sec is None else kv_bytes / sec / 1e12, "max_abs_err_vs_xla": err}
        rows.append(r)
        return r

    # Dense XLA first: the yardstick the paged outputs are compared with.
    def dense(impl):
        def step(x, k, v, lengths):
            o = jax.nn.dot_product_attention(x[:, None], k, v, key_value_seq_lengths=lengths,
                                             implementation=impl)
            return o[:, 0]
        return step

    want = None
    for impl in dense_impls(on_gpu):
        try:
            sec = time_loop(dense(impl), q, (k, v, lengths), calls, repeats)
            out = jax.jit(dense(impl))(q, k, v, lengths)
            err = _max_err(out, want)  # None for the yardstick itself
            if impl == "xla":
                want = np.asarray(out.astype(jnp.float32))
            row(f"dense {impl}", sec, err)
        except Exception as exc:  # noqa: BLE001 - cuDNN may refuse a shape: recorded
            _failed(f"decode {case} dense {impl}", exc)
            row(f"dense {impl}", None)

    for ps in PAGE_SIZES:
        if length % ps:
            continue
        per_seq = length // ps
        num_pages = b * per_seq
        # The same tokens, scattered over pages in a random order.
        perm = rng.permutation(num_pages).astype(np.int32)
        table = jnp.asarray(perm.reshape(b, per_seq))
        inv = np.argsort(perm)  # page id -> (sequence, page index) of the contiguous cache
        k_pages = k.reshape(num_pages, ps, hkv, d)[inv]
        v_pages = v.reshape(num_pages, ps, hkv, d)[inv]

        # The automatic split first, then the --decode-splits sweep (page 16).
        auto = attention.decode_split_tokens(b, hq, hkv, length, dtype)
        for split in [None] + ([s for s in decode_splits if s != auto] if ps == PAGE_SIZES[0] else []):
            def step(x, kp, vp, table, lengths, split=split):
                return attention.paged_decode_attention(x, kp, vp, table, lengths,
                                                        split_tokens=split)

            sec = time_loop(step, q, (k_pages, v_pages, table, lengths), calls, repeats)
            out = jax.jit(step)(q, k_pages, v_pages, table, lengths)
            err = _max_err(out, want)
            row(f"paged ps={ps} split={auto if split is None else split}"
                f"{' (auto)' if split is None else ''}", sec, err)
        del k_pages, v_pages
    return rows


def bench_prefill(b, s, heads, dtype, calls, repeats, on_gpu, rng):
    hq, hkv, d = heads
    if s % b:
        raise ValueError(f"prefill S={s} must be a multiple of B={b}")
    per = s // b
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (s, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (s, hkv, d), jnp.float32).astype(dtype)
    cu = jnp.asarray(np.arange(b + 1, dtype=np.int32) * per)
    flops = 4.0 * hq * d * b * per * (per + 1) / 2
    case = f"B={b} S={s}"
    rows = []

    def row(impl, sec, err=None):
        r = {"kind": "prefill", "case": case, "B": b, "S": s, "impl": impl,
             "us": None if sec is None else sec * 1e6, "flops": flops,
             "tflops": None if sec is None else flops / sec / 1e12, "max_abs_err_vs_xla": err}
        rows.append(r)

    # Dense XLA first: the yardstick the other outputs are compared with.
    # With lengths (an argument, as in the max_seqlen path), cuDNN's padding
    # mask (all sequences full here): its own cost, before any work of that path.
    def dense(impl):
        def step(x, k, v, lens=None):
            o = jax.nn.dot_product_attention(x.reshape(b, per, hq, d), k.reshape(b, per, hkv, d),
                                             v.reshape(b, per, hkv, d), is_causal=True,
                                             query_seq_lengths=lens, key_value_seq_lengths=lens,
                                             implementation=impl)
            return o.reshape(s, hq, d)
        return step

    want = None
    dense_rows = [(f"dense padded {impl}", impl, (k, v)) for impl in dense_impls(on_gpu)]
    if on_gpu:
        dense_rows.append(("dense padded cudnn + seq lengths", "cudnn",
                           (k, v, jnp.full((b,), per, jnp.int32))))
    for name, impl, args in dense_rows:
        try:
            sec = time_loop(dense(impl), q, args, calls, repeats)
            out = jax.jit(dense(impl))(q, *args)
            err = _max_err(out, want)
            if impl == "xla":
                want = np.asarray(out.astype(jnp.float32))
            row(name, sec, err)
        except Exception as exc:  # noqa: BLE001 - cuDNN may refuse a shape: recorded
            _failed(f"prefill {case} {name}", exc)
            row(name, None)

    # The packed batch three ways on the default implementation: the (N, N)
    # segment mask; max_seqlen = S/B (N == B * max_seqlen: a reshape into the
    # padded batch); max_seqlen = S/B + 128 (the gathered layout, as for
    # unequal lengths). Then the mask path forced onto XLA.
    auto = attention.prefill_path(q, k, v, cu)
    variants = [(f"packed mask ({auto})", {}),
                (f"packed max_seqlen={per} ({auto}_padded, reshape)", {"max_seqlen": per}),
                (f"packed max_seqlen={per + 128} ({auto}_padded, gather)",
                 {"max_seqlen": per + 128})]
    if auto != "xla":
        variants.append(("packed mask (xla)", {"implementation": "xla"}))
    for name, kw in variants:
        def step(x, k, v, cu, kw=kw):
            return attention.prefill_attention(x, k, v, cu, causal=True, **kw)
        try:
            sec = time_loop(step, q, (k, v, cu), calls, repeats)
            row(name, sec, _max_err(jax.jit(step)(q, k, v, cu), want))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the N x N mask: recorded
            _failed(f"prefill {case} {name}", exc)
            row(name, None)
    return rows


def bench_dispatch(b, length, prompt, heads, dtype, calls, repeats, on_gpu, rng):
    hq, hkv, d = heads
    ps = 16
    per_seq, prompt_pages = -(-length // ps), -(-prompt // ps)
    num_pages = b * per_seq + prompt_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((b + 1, max(per_seq, prompt_pages)), -1, np.int32)
    table[:b, :per_seq] = perm[:b * per_seq].reshape(b, per_seq)
    table[b, :prompt_pages] = perm[b * per_seq:]
    n = b + prompt
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (n, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (n, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (n, hkv, d), jnp.float32).astype(dtype)
    k_pages = jax.random.normal(kc, (num_pages, ps, hkv, d), jnp.float32).astype(dtype)
    v_pages = k_pages[::-1]
    # Decode token of sequence i: position length - 1; the prompt: 0 .. prompt - 1.
    pos = np.concatenate([np.full(b, length - 1), np.arange(prompt)])
    seq = np.concatenate([np.arange(b), np.full(prompt, b)])
    slots = jnp.asarray((table[seq, pos // ps] * ps + pos % ps).astype(np.int32))
    lengths = jnp.asarray(np.append(np.full(b, length), prompt).astype(np.int32))
    cu = jnp.asarray(np.append(np.arange(b + 1), n).astype(np.int32))
    is_decode = jnp.asarray(np.arange(b + 1) < b)
    table = jnp.asarray(table)
    cu_prompt = jnp.asarray(np.array([0, prompt], np.int32))
    case = f"B={b} L={length} +{prompt}"

    def dispatch(st, k, v, table, lengths, cu, is_decode, slots):
        return attention.attention_dispatch(st[0], k, v, st[1], st[2], table, lengths, cu,
                                            is_decode, slots)

    def separate(st, k, v, table, lengths, cu, is_decode, slots):
        x, kp, vp = st
        kp, vp = attention.write_kv(kp, vp, k, v, slots)
        dec = attention.paged_decode_attention(x[:b], kp, vp, table[:b], lengths[:b])
        pre = attention.prefill_attention(x[b:], k[b:], v[b:], cu_prompt, causal=True)
        return jnp.concatenate([dec, pre]), kp, vp

    args = (k, v, table, lengths, cu, is_decode, slots)
    state = (q, k_pages, v_pages)
    steps = {"separate calls": separate, "attention_dispatch": dispatch}
    secs = {name: time_loop(fn, state, args, calls, repeats) for name, fn in steps.items()}
    outs = {name: np.asarray(jax.jit(fn)(state, *args)[0].astype(jnp.float32))
            for name, fn in steps.items()}
    err = float(np.max(np.abs(outs["attention_dispatch"] - outs["separate calls"])))
    base = secs["separate calls"]
    return [{"kind": "dispatch", "case": case, "B": b, "L": length, "prompt": prompt,
             "impl": name, "us": sec * 1e6, "vs_separate": sec / base,
             "max_abs_err_vs_separate": err if name == "attention_dispatch" else None}
            for name, sec in secs.items()]


def _fmt(x, spec):
    return "failed" if x is None else format(x, spec)


def print_row(r):
    if r["kind"] == "decode":
        err = r["max_abs_err_vs_xla"]
        extra = f"{_fmt(r['tbps'], '.3f'):>10} TB/s  err vs xla {'-' if err is None else f'{err:.1e}'}"
    elif r["kind"] == "dispatch":
        err = r["max_abs_err_vs_separate"]
        extra = (f"{r['vs_separate']:>10.3f} x separate  err vs separate "
                 f"{'-' if err is None else f'{err:.1e}'}")
    else:
        err = r["max_abs_err_vs_xla"]
        extra = (f"{_fmt(r['tflops'], '.2f'):>10} TFLOP/s  err vs xla "
                 f"{'-' if err is None else f'{err:.1e}'}")
    print(f"{r['kind']:<9}{r['case']:<18}{r['impl']:<46}{_fmt(r['us'], '.1f'):>12} µs  {extra}",
          flush=True)



def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, kind, metric, label in ((axes[0], "decode", "tbps", "TB/s of KV read"),
                                    (axes[1], "prefill", "tflops", "TFLOP/s (causal)")):
        rs = [r for r in rows if r["kind"] == kind]  # dispatch rows: the table only
        cases = list(dict.fromkeys(r["case"] for r in rs))
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            vals = [next((r[metric] or 0.0 for r in rs if r["case"] == c and r["impl"] == impl), 0.0)
                    for c in cases]
            ax.bar(np.arange(len(cases)) + j * width, vals, width, label=impl)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
        ax.set_xticklabels(cases)
        ax.set_ylabel(label)
        ax.set_title(kind)
        if impls:  # --only leaves the other panel empty
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, any backend (smoke test)")
    p.add_argument("--only", choices=["decode", "prefill", "dispatch"], help="run one kind only")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default bfloat16 (float32 for --quick on CPU)")
    p.add_argument("--calls", type=int, default=None, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-splits", default="",
                   help="comma-separated split_tokens to time beside the automatic one (page 16)")
    p.add_argument("--json", default=None, help="write the results here (JSON)")
    p.add_argument("--plot", default=None, help="draw a PNG here (needs matplotlib)")
    args = p.parse_args()
    check_least(p, args, calls=1, repeats=1)
    try:
        splits = tuple(int(x) for x in args.decode_splits.split(",") if x)
    except ValueError:
        p.error(f"--decode-splits takes comma-separated integers, got {args.decode_splits!r}")
    if any(x < 1 for x in splits):
        p.error(f"--decode-splits must be positive, got {args.decode_splits!r}")

    backend = jax.default_backend()
    on_gpu = backend in ("gpu", "cuda")
    decode_cases = QUICK_DECODE_CASES if args.quick else DECODE_CASES
    prefill_cases = QUICK_PREFILL_CASES if args.quick else PREFILL_CASES
    dispatch_cases = QUICK_DISPATCH_CASES if args.quick else DISPATCH_CASES
    heads = QUICK_HEADS if args.quick else HEADS
    calls = args.calls or (2 if args.quick else 100)
    repeats = 2 if args.quick else args.repeats
    if args.dtype:
        dtype = jnp.dtype(args.dtype)
    else:
        dtype = jnp.dtype(jnp.float32 if args.quick and backend == "cpu" else jnp.bfloat16)
    dev = jax.devices()[0].device_kind
    hq, hkv, d = heads
    print(f"# {date.today()} {dev} ({backend}), jax {jax.__version__}, {dtype.name}, "
          f"Hq={hq} Hkv={hkv} D={d}; per-call slope of {calls}- and {calls // 5}-call loops, "
          f"median of {repeats}")
    meta = {"date": str(date.today()), "device": dev, "backend": backend, "jax": jax.__version__,
            "dtype": dtype.name, "Hq": hq, "Hkv": hkv, "D": d, "calls": calls,
            "repeats": repeats, "quick": args.quick}
    rng = np.random.default_rng(0)
    rows = []
    write_json(args.json, meta, rows)
    print(f"{'kind':<9}{'case':<18}{'impl':<46}{'time':>12}")
    jobs = []
    if args.only in (None, "decode"):
        jobs += [(bench_decode, c) for c in decode_cases]
    if args.only in (None, "prefill"):
        jobs += [(bench_prefill, c) for c in prefill_cases]
    if args.only in (None, "dispatch"):
        jobs += [(bench_dispatch, c) for c in dispatch_cases]
    for fn, case in jobs:
        extra = {"decode_splits": splits} if fn is bench_decode else {}
        for r in fn(*case, heads, dtype, calls, repeats, on_gpu, rng, **extra):
            rows.append(r)
            print_row(r)
        write_json(args.json, meta, rows)  # after each case: a cut-off run keeps its rows
    if args.json:
        print(f"json: {args.json}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
