"""End-to-end MoE layer benchmark: jax_moe (FFI kernels) vs the pure-JAX path
(reference.py, jax.lax.ragged_dot), routing through combine.

Device time per call comes from jitted programs of many calls: each call waits
for the previous one's output (its router logits depend on it), takes the same
input rows and fresh routing (the logits rotate among several random batches),
so nothing is cached or hoisted. After a warm-up each program
runs several times (median); the time per call is the slope between a program
of --calls calls and one of a fifth as many (the fixed cost of dispatching a
program cancels out; _bench_common.per_call_seconds), reported with % of the hardware
floor max(bytes / bandwidth, FLOPs / matmul rate) where bytes are the weights
of the experts the batch touches plus activations in and out. The method and
the H200's numbers: docs/performance.md.

    python benchmarks/bench_moe.py             # the full grid (meant for the GPU)
    python benchmarks/bench_moe.py --fp8       # the same with block-scaled fp8 experts
    python benchmarks/bench_moe.py --quick     # tiny shapes, any backend (CI smoke)

With --fp8 the experts' weights are float8_e4m3fn with 128 x 128 block
scales (moe_forward's w13_scale, w2_scale); the floor counts one byte a
weight plus the scales, and twice the bf16 matmul rate (Hopper's fp8 tensor
cores).
"""

from __future__ import annotations

import argparse
import math
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np
from _bench_common import (after, chain, check_least, per_call_seconds, pick_shapes, pyplot,
                           random_weights, wall_time, write_json)

import jax_moe

SHAPES = {  # name: (H, I, E, k)
    **jax_moe.tuning.MODEL_SHAPES,
    # with DeepSeek-V3's own routing (ROUTING)
    "deepseek_v3_routed": jax_moe.tuning.MODEL_SHAPES["deepseek_v3"],
}
# Routing other than plain softmax top-k + renormalize, by shape name.
ROUTING = {
    "deepseek_v3_routed": dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4,
                               routed_scaling_factor=2.5),
    "tiny_routed": dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                        routed_scaling_factor=2.5),
}
TOKENS = (1, 16, 128, 1024, 8192)
QUICK_SHAPES = {"tiny": (64, 32, 8, 2), "tiny_odd": (72, 40, 5, 3), "tiny_routed": (64, 32, 8, 2)}
QUICK_TOKENS = (1, 16, 100)
ROUTINGS = 8  # distinct random routings the loop rotates through
# The floor's ceilings, fixed figures for the H200: 4.3 TB/s of memory
# bandwidth and 790 TFLOP/s of bf16 matmul (docs/performance.md, "Method").
# The copy and matmul rates this run measures itself are printed and saved
# beside them.
FLOOR_BANDWIDTH, FLOOR_MATMUL = 4.3e12, 790e12


def measure_ceilings(quick: bool) -> tuple[float, float]:
    """Copy bandwidth (bytes read + written per s) and bf16 matmul rate, each
    from a jitted loop of 10 back-to-back operations."""
    if quick:
        return FLOOR_BANDWIDTH, FLOOR_MATMUL  # not measured on a smoke run
    reps = 10

    def rate(fn, arg, work):
        fn(arg).block_until_ready()
        return work * reps / min(wall_time(lambda: fn(arg).block_until_ready()) for _ in range(3))

    n = 1 << 30  # 2 GiB of bf16
    copy = jax.jit(lambda v: jax.lax.fori_loop(0, reps, lambda i, a: a + jnp.bfloat16(1), v))
    bw = rate(copy, jnp.ones((n,), jnp.bfloat16), 2 * n * 2)
    m = 8192
    x = jax.random.normal(jax.random.PRNGKey(0), (m, m), jnp.bfloat16) * (1 / m)
    mm = jax.jit(lambda v: jax.lax.fori_loop(0, reps, lambda i, a: a @ x, v))
    return bw, rate(mm, x, 2 * m**3)



def make_loop(backend: str, topk: int, calls: int, routing: dict, chunks: int = 1):
    """`calls` layer calls in one jitted straight-line program (see
    _bench_common.chain); call i routes with logits[i % R], made to depend on
    the previous call's output (_bench_common.after), and takes x as its
    input. (Fed back as the next input, the output of a layer with random
    weights and no residual shrinks to zeros within a few calls, and the
    chain would time the kernels on zeros.) chunks > 1: each call runs the
    layer on `chunks` equal slices of the tokens one after another (lax.map;
    routing is per token, so the result is the same), for a path that cannot
    compile the whole batch."""

    def layer(h, lg, w13, w2, bias, scales):
        return jax_moe.moe_forward(h, lg, w13, w2, topk, backend=backend,
                                   e_score_correction_bias=bias, w13_scale=scales[0],
                                   w2_scale=scales[1], **routing)

    @jax.jit
    def run(x, logits, w13, w2, bias, scales=(None, None)):  # scales: fp8 experts' (w13, w2)
        def body(i, h):
            lg = after(logits[i % logits.shape[0]], h)
            if chunks == 1:
                return layer(x, lg, w13, w2, bias, scales)
            t = x.shape[0]
            out = jax.lax.map(lambda a: layer(a[0], a[1], w13, w2, bias, scales),
                              (x.reshape(chunks, t // chunks, -1),
                               lg.reshape(chunks, t // chunks, -1)))
            return out.reshape(x.shape)
        return chain(body, calls, x)

    return run


def bench_case(name, shape, tokens, dtype, calls, ref_calls, repeats, bw, flops_rate, rng,
               ref_chunks=1, fp8=False):
    h, i, e, k = shape
    keys = jax.random.split(jax.random.PRNGKey(rng.integers(1 << 30)), 4)
    x = (jax.random.normal(keys[0], (tokens, h), jnp.float32)).astype(dtype)
    logits = jax.random.normal(keys[1], (ROUTINGS, tokens, e), jnp.float32)
    if fp8:
        (w13, s13), (w2, s2) = (random_weights(keys[2], (e, 2 * i, h), h**-0.5, None),
                                random_weights(keys[3], (e, h, i), i**-0.5, None))
        scales = (s13, s2)
        # one byte a weight, and each expert's scales (f32)
        per_expert = 3 * h * i + 4 * (s13[0].size + s2[0].size)
    else:
        w13 = random_weights(keys[2], (e, 2 * i, h), h**-0.5, dtype)
        w2 = random_weights(keys[3], (e, h, i), i**-0.5, dtype)
        scales = (None, None)
        per_expert = 3 * h * i * jnp.dtype(dtype).itemsize

    routing = ROUTING.get(name, {})
    # DeepSeek-V3's bias: small random offsets, as a trained checkpoint has.
    bias = (jax.random.normal(keys[0], (e,), jnp.float32) * 0.01) if routing else None
    ids = np.stack([np.asarray(jax_moe.reference.route(
        logits[r], k, e_score_correction_bias=bias, **routing)[1]) for r in range(ROUTINGS)])
    touched = np.mean([len(np.unique(ids[r])) for r in range(ROUTINGS)])
    item = jnp.dtype(dtype).itemsize
    nbytes = touched * per_expert + 2 * tokens * h * item
    flops = 2.0 * tokens * k * 3 * h * i
    floor = max(nbytes / bw, flops / flops_rate)

    row = {"shape": name, "tokens": tokens, "H": h, "I": i, "E": e, "k": k,
           "weights": "float8_e4m3fn" if fp8 else jnp.dtype(dtype).name,
           "experts_touched": float(touched), "floor_us": floor * 1e6, "reference_chunks": None}
    for backend, n_calls in (("ffi", calls), ("reference", ref_calls)):
        row[f"{backend}_us"] = None
        if n_calls == 0:  # --ref-calls 0: the pure-JAX path is not timed
            continue
        chunks = 1 if backend == "ffi" else math.gcd(ref_chunks, tokens)
        while tokens % chunks == 0:
            def program(n, backend=backend, chunks=chunks):
                run = make_loop(backend, k, n, routing, chunks)
                run(x, logits, w13, w2, bias, scales).block_until_ready()  # compile + warm-up
                return lambda: run(x, logits, w13, w2, bias, scales).block_until_ready()

            try:
                row[f"{backend}_us"] = per_call_seconds(program, n_calls, repeats) * 1e6
                break
            except jax.errors.JaxRuntimeError as exc:
                if backend == "ffi":
                    raise
                # XLA lowers ragged_dot densely on the GPU (every row against
                # every expert): at large T it needs more memory than the
                # device has. Retried on token slices, and said so.
                print(f"  pure-JAX path failed for {name} T={tokens} in {chunks} slice(s): "
                      f"{str(exc).splitlines()[0][:100]}")
                chunks *= 2
        if backend == "reference" and row["reference_us"] is not None:
            row["reference_chunks"] = chunks
    row["pct_of_floor"] = 100.0 * floor / (row["ffi_us"] * 1e-6)
    row["tflops"] = flops / (row["ffi_us"] * 1e-6) / 1e12
    ref = row["reference_us"]
    row["speedup_vs_jax"] = None if ref is None else ref / row["ffi_us"]
    return row



def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    names = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = [r for r in rows if r["shape"] == name]
        tok = [r["tokens"] for r in rs]
        ax.plot(tok, [r["ffi_us"] for r in rs], "o-", label="jax_moe")
        if any(r["reference_us"] is not None for r in rs):  # --ref-calls 0: no such line
            ax.plot(tok, [r["reference_us"] for r in rs], "s-", label="pure JAX (ragged_dot)")
        ax.plot(tok, [r["floor_us"] for r in rs], "k--", label="hardware floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per layer")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes, any backend (smoke test)")
    p.add_argument("--shapes", nargs="*", help="subset of shape names")
    p.add_argument("--tokens", nargs="*", type=int)
    p.add_argument("--calls", type=int, default=None,
                   help="layer calls per timed loop (default 20, and 100 at T <= 16: a program's "
                        "fixed cost varies by a few hundred µs between runs, too much for a "
                        "slope over 16 calls of a layer of a few tens of µs)")
    p.add_argument("--ref-calls", type=int, default=None,
                   help="calls per timed loop of the pure-JAX path (slow at large T; default 10, "
                        "a slope against 2 calls: a slope against one call was too noisy; "
                        "0 skips it)")
    p.add_argument("--ref-chunks", type=int, default=1,
                   help="token slices the pure-JAX path starts with (at most what divides T; "
                        "doubled while it fails, e.g. out of memory; the table marks the count "
                        "used, after a '/'). Slices run in a lax.map: on the GPU its while loop "
                        "adds a host round trip per slice, small beside a slice's milliseconds")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fp8", action="store_true",
                   help="block-scaled float8_e4m3fn expert weights (128 x 128 scales)")
    p.add_argument("--json", default="bench_moe.json")
    p.add_argument("--plot", default="bench_moe.png")
    args = p.parse_args()
    check_least(p, args, calls=1, ref_calls=0, ref_chunks=1, repeats=1, tokens=1)

    shapes = pick_shapes(p, args.shapes, QUICK_SHAPES if args.quick else SHAPES)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    def calls_for(t):  # see --calls
        return args.calls or (2 if args.quick else (100 if t <= 16 else 20))
    ref_calls = args.ref_calls if args.ref_calls is not None else (2 if args.quick else 10)
    repeats = 2 if args.quick else args.repeats
    dtype = jnp.float32 if args.quick and jax.default_backend() == "cpu" else jnp.bfloat16
    measured_bw, measured_rate = measure_ceilings(args.quick)
    bw, rate = FLOOR_BANDWIDTH, FLOOR_MATMUL * (2 if args.fp8 else 1)
    dev = jax.devices()[0].device_kind
    print(f"# {date.today()} {dev} ({jax.default_backend()}), jax {jax.__version__}, "
          f"{jnp.dtype(dtype).name}{', fp8 experts' if args.fp8 else ''}; floor from {bw / 1e12:.1f} TB/s and {rate / 1e12:.0f} TFLOP/s; "
          f"measured in this run: {measured_bw / 1e12:.2f} TB/s copy, {measured_rate / 1e12:.0f} TFLOP/s matmul")
    meta = {"date": str(date.today()), "device": dev, "backend": jax.default_backend(),
            "jax": jax.__version__, "dtype": jnp.dtype(dtype).name,
            "floor_bandwidth_Bps": bw, "floor_matmul_flops": rate,
            "measured_bandwidth_Bps": measured_bw, "measured_matmul_flops": measured_rate,
            "fp8": args.fp8, "quick": args.quick, "calls": {t: calls_for(t) for t in tokens}, "ref_calls": ref_calls,
            "ref_chunks": args.ref_chunks,
            "repeats": repeats}
    rng = np.random.default_rng(0)
    rows = []
    write_json(args.json, meta, rows)
    print(f"{'shape':<16}{'T':>6}{'floor µs':>10}{'jax_moe µs':>12}{'% floor':>9}"
          f"{'TFLOP/s':>9}{'pure JAX µs':>13}{'speed-up':>9}")
    for name, shape in shapes.items():
        for t in tokens:
            r = bench_case(name, shape, t, dtype, calls_for(t), ref_calls, repeats, bw, rate, rng,
                           args.ref_chunks, args.fp8)
            rows.append(r)
            write_json(args.json, meta, rows)  # after each case: a cut-off run keeps its rows
            ref = ("-" if ref_calls == 0 else "failed") if r["reference_us"] is None \
                else f"{r['reference_us']:.1f}"
            if (r["reference_chunks"] or 1) > 1:
                ref += f" /{r['reference_chunks']}"  # run on that many token slices
            speed = "-" if r["speedup_vs_jax"] is None else f"{r['speedup_vs_jax']:.2f}x"
            print(f"{name:<16}{t:>6}{r['floor_us']:>10.1f}{r['ffi_us']:>12.1f}"
                  f"{r['pct_of_floor']:>8.1f}%{r['tflops']:>9.1f}{ref:>13}{speed:>9}", flush=True)
    print(f"json: {args.json}")
    if not args.quick:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
