"""Training-step benchmark of the MoE layer: forward + backward with the
gradients of hidden states, router logits, w13 and w2, jax_moe (FFI kernels
both ways) beside the pure-JAX path (reference.py: jax.lax.ragged_dot and its
autodiff) in the same run.

Each timed program is a straight-line chain of steps (_bench_common.chain):
step i routes with fresh logits (rotating among several random batches),
made to depend on the previous step's gradients, takes its input gradient
as its input, uses its output (as a loss would: nothing of the forward may
be left out), and sees the weights through an optimization barrier, so that
XLA can neither merge work across steps nor keep a transposed copy of the
weights from one step to the next (in training the weights change every
step). Time per step is the slope between programs of --calls and a fifth as
many steps, median of --repeats (_bench_common.per_call_seconds); the
forward alone is timed the same way, and the backward is the difference.
TFLOP/s counts 3 x the forward's 2*T*k*3*H*I. Memory: the compiled step's
arguments + temporaries + outputs (XLA's memory analysis of one step).

    python benchmarks/bench_train.py            # the grid (meant for the GPU)
    python benchmarks/bench_train.py --quick    # tiny shapes, any backend (CI smoke)
"""

from __future__ import annotations

import argparse
from datetime import date

import jax
import jax.numpy as jnp
from _bench_common import (check_least, per_call_seconds, pick_shapes, random_weights,
                           training_chain, training_step, write_json)

import jax_moe

SHAPES = {n: jax_moe.tuning.MODEL_SHAPES[n] for n in ("qwen3_30b_a3b", "deepseek_v3",
                                                       "mixtral_8x7b")}
TOKENS = (4096, 16384, 65536)
QUICK_SHAPES = {"tiny": (64, 32, 8, 2), "tiny_odd": (72, 40, 5, 3)}
QUICK_TOKENS = (16, 100)
ROUTINGS = 4


def _inputs(shape, tokens, dtype, seed):
    h, i, e, _ = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (tokens, h), jnp.float32).astype(dtype)
    logits = jax.random.normal(keys[1], (ROUTINGS, tokens, e), jnp.float32)
    w13 = random_weights(keys[2], (e, 2 * i, h), h**-0.5, dtype)
    w2 = random_weights(keys[3], (e, h, i), i**-0.5, dtype)
    ct = (jax.random.normal(keys[4], (tokens, h), jnp.float32) * 0.01).astype(dtype)
    return x, logits, w13, w2, ct


def _step_fn(backend, topk, backward, remat):
    """One step of moe_forward (_bench_common.training_step)."""

    def layer(h, lg, w13, w2):
        return jax_moe.moe_forward(h, lg, w13, w2, topk, backend=backend, remat=remat)

    return training_step(layer, backward)


def _program(backend, topk, n, backward, remat):
    step = _step_fn(backend, topk, backward, remat)
    return jax.jit(lambda *args: training_chain(step, n, *args))


def _time(backend, topk, calls, repeats, args, backward, remat):
    def program(n):
        run = _program(backend, topk, n, backward, remat)
        jax.block_until_ready(run(*args))  # compile + warm-up
        return lambda: jax.block_until_ready(run(*args))
    return per_call_seconds(program, calls, repeats)


def _step_bytes(backend, topk, args, remat):
    """Device bytes of one compiled training step: arguments, temporaries, outputs."""
    step = _step_fn(backend, topk, True, remat)
    x, logits, w13, w2, ct = args
    one = jax.jit(lambda *a: step(*a)[:2])
    m = one.lower(x, logits[0], w13, w2, ct).compile().memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes


def bench_case(name, shape, tokens, dtype, calls, ref_calls, ref_max_tokens, repeats, remat):
    h, i, e, k = shape
    args = _inputs(shape, tokens, dtype, seed=tokens + e)
    flops = 3 * 2.0 * tokens * k * 3 * h * i
    row = {"shape": name, "tokens": tokens, "H": h, "I": i, "E": e, "k": k, "remat": remat}
    for backend, n in (("ffi", calls), ("reference", ref_calls)):
        for key in ("step_ms", "fwd_ms", "bwd_ms", "tflops", "step_gb"):
            row[f"{backend}_{key}"] = None
        if n == 0 or (backend == "reference" and tokens > ref_max_tokens):
            continue
        try:
            step = _time(backend, k, n, repeats, args, True, remat)
            fwd = _time(backend, k, n, repeats, args, False, remat)
        except jax.errors.JaxRuntimeError as exc:  # e.g. out of memory: the row says so
            print(f"  {backend} failed for {name} T={tokens}: {str(exc).splitlines()[0][:100]}")
            continue
        mem = _step_bytes(backend, k, args, remat)
        row.update({f"{backend}_step_ms": step * 1e3, f"{backend}_fwd_ms": fwd * 1e3,
                    f"{backend}_bwd_ms": (step - fwd) * 1e3,
                    f"{backend}_tflops": flops / step / 1e12,
                    f"{backend}_step_gb": None if mem is None else mem / 1e9})
    ffi, ref = row["ffi_step_ms"], row["reference_step_ms"]
    row["bwd_over_fwd"] = None if ffi is None else row["ffi_bwd_ms"] / row["ffi_fwd_ms"]
    row["speedup_vs_jax"] = None if ref is None or ffi is None else ref / ffi
    return row


def _fmt(v, spec, width, suffix=""):
    """v formatted by spec (+ suffix), or "-" for None, right-aligned in width."""
    return ("-" if v is None else format(v, spec) + suffix).rjust(width)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes, any backend (smoke test)")
    p.add_argument("--shapes", nargs="*", help="subset of shape names")
    p.add_argument("--tokens", nargs="*", type=int)
    p.add_argument("--calls", type=int, default=None,
                   help="steps per timed chain (default 10; the slope is against a fifth as many)")
    p.add_argument("--ref-calls", type=int, default=None,
                   help="steps per timed chain of the pure-JAX path (default 5; 0 skips it)")
    p.add_argument("--ref-max-tokens", type=int, default=4096,
                   help="largest T at which the pure-JAX path is timed (its dense lowering "
                        "grows with T x E)")
    p.add_argument("--remat", action="store_true",
                   help="moe_forward(remat=True): the w13 GEMM recomputed in the backward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="bench_train.json")
    args = p.parse_args()
    check_least(p, args, calls=1, ref_calls=0, repeats=1, tokens=1, ref_max_tokens=0)

    shapes = pick_shapes(p, args.shapes, QUICK_SHAPES if args.quick else SHAPES)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    calls = args.calls or (2 if args.quick else 10)
    ref_calls = args.ref_calls if args.ref_calls is not None else (2 if args.quick else 5)
    repeats = 1 if args.quick else args.repeats
    dtype = jnp.float32 if args.quick and jax.default_backend() == "cpu" else jnp.bfloat16
    dev = jax.devices()[0].device_kind
    print(f"# {date.today()} {dev} ({jax.default_backend()}), jax {jax.__version__}, "
          f"{jnp.dtype(dtype).name}, remat={args.remat}")
    meta = {"date": str(date.today()), "device": dev, "backend": jax.default_backend(),
            "jax": jax.__version__, "dtype": jnp.dtype(dtype).name, "calls": calls,
            "ref_calls": ref_calls, "repeats": repeats, "remat": args.remat,
            "quick": args.quick}
    rows = []
    write_json(args.json, meta, rows)
    print(f"{'shape':<15}{'T':>6}{'step ms':>9}{'fwd ms':>8}{'bwd ms':>8}{'bwd/fwd':>8}"
          f"{'TFLOP/s':>8}{'GB':>7}{'JAX ms':>9}{'JAX GB':>7}{'speed-up':>9}")
    for name, shape in shapes.items():
        for t in tokens:
            r = bench_case(name, shape, t, dtype, calls, ref_calls, args.ref_max_tokens,
                           repeats, args.remat)
            rows.append(r)
            write_json(args.json, meta, rows)
            print(f"{name:<15}{t:>6}{_fmt(r['ffi_step_ms'], '.2f', 9)}"
                  f"{_fmt(r['ffi_fwd_ms'], '.2f', 8)}{_fmt(r['ffi_bwd_ms'], '.2f', 8)}"
                  f"{_fmt(r['bwd_over_fwd'], '.2f', 8)}{_fmt(r['ffi_tflops'], '.1f', 8)}"
                  f"{_fmt(r['ffi_step_gb'], '.1f', 7)}{_fmt(r['reference_step_ms'], '.1f', 9)}"
                  f"{_fmt(r['reference_step_gb'], '.1f', 7)}"
                  f"{_fmt(r['speedup_vs_jax'], '.1f', 9, 'x')}", flush=True)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
