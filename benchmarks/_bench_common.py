"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`,
so this sibling module is importable)."""

from __future__ import annotations

import functools
import json
import statistics
import time


def wall_time(fn) -> float:
    """Seconds one call of fn takes (fn must block until the device is done)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check_least(parser, args, **least) -> None:
    """parser.error (exit 2, naming the flag) for an integer option, or any
    element of a list option, below its least value; None (not given) passes."""
    for dest, lo in least.items():
        value = getattr(args, dest)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v < lo:
                parser.error(f"--{dest.replace('_', '-')} must be at least {lo}, got {v}")


def pick_shapes(parser, names, shapes: dict) -> dict:
    """The --shapes subset of `shapes` (all of them when none are named);
    parser.error (exit 2) for an unknown name."""
    if not names:
        return shapes
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        parser.error(f"unknown --shapes {unknown}; known: {sorted(shapes)}")
    return {n: shapes[n] for n in names}


def per_call_seconds(program, calls: int, repeats: int) -> float:
    """Device seconds per call of a chained loop: program(n) compiles and warms
    up a jitted program of n chained calls and returns a callable that runs
    it once and blocks. The result is the slope between programs of `calls`
    and `calls // 5` calls, each program's time the median of `repeats` runs:
    a fixed cost per program (about a millisecond on a GPU, different for
    each program) cancels out, the gaps between calls stay in. With
    fewer than 5 calls: the program's time / calls."""

    def median_time(n):
        run = program(n)
        return statistics.median(wall_time(run) for _ in range(repeats))

    long_s = median_time(calls)
    short = calls // 5
    if short < 1:
        return long_s / calls
    return (long_s - median_time(short)) / (calls - short)


def chain(body, calls: int, x):
    """x = body(i, x) for i in range(calls), unrolled in Python: inside jax.jit
    a straight-line program. lax.fori_loop would make an XLA while loop, whose
    GPU version checks its condition on the host every trip, a fixed cost per
    call that is not the work being timed. The calls still run back to back on
    the device, each on the previous one's output, with no host sync."""
    for i in range(calls):
        x = body(i, x)
    return x


def after(x, h):
    """x (T, ...), made to depend on h (T, ...) at the cost of one tiny
    elementwise fusion (x + 0 * h[:, :1], row by row: under a token sharding
    no data moves between devices). In a model a layer's router logits come
    from its input, so its routing cannot start before the previous layer
    ends; with logits that depend on nothing, XLA deduplicates the routing of
    calls that share logits, and a chain times less than a layer's latency."""
    return x + (h[:, :1] * 0).astype(x.dtype)


def training_step(layer, backward: bool = True):
    """One training step of layer(h, logits, w13, w2) -> out, as
    step(h, logits, w13, w2, ct) -> (the input's gradient, a scalar that keeps
    every gradient alive, the weights as the next step must see them). ct is
    the output's cotangent. With backward=False, the forward alone (its output
    in the gradient's place).

    The weights pass through a barrier with this step's input: to XLA they are
    new values each step (as after an optimizer's update), so nothing derived
    from them (a transposed copy, say) is kept from step to step. Each step's
    barrier takes the previous one's output: barriers on the parameters
    themselves would each get a copy. The output is used too (as a loss would
    use it), so that no part of the forward that the backward does not need is
    left out."""
    import jax
    import jax.numpy as jnp

    def step(h, lg, w13, w2, ct):
        w13, w2 = jax.lax.optimization_barrier((w13, w2, h))[:2]
        if not backward:
            return layer(h, lg, w13, w2), jnp.zeros((), jnp.float32), w13, w2
        out, vjp = jax.vjp(layer, h, lg, w13, w2)
        dx, dlg, dw13, dw2, out = jax.lax.optimization_barrier(vjp(ct) + (out,))
        keep = sum(a[(0,) * a.ndim].astype(jnp.float32) for a in (dlg, dw13, dw2, out))
        return dx, keep, w13, w2

    return step


def training_chain(step, calls: int, x, logits, w13, w2, ct):
    """`calls` training steps (training_step) chained in a straight line
    (chain) -> (the last input gradient, the last step's scalar). Step i routes
    with logits[i % len(logits)], made to wait for the previous step's
    gradients (as a step waits for the optimizer's update), so every step's
    gradients are used, each before the next step, and die there. (A sum of
    every step's scalar as an output would be fused at the program's end,
    reading every step's weight gradients there and keeping them all alive.)"""
    import jax.numpy as jnp

    def body(i, carry):
        h, prev, w13, w2 = carry
        lg = after(logits[i % logits.shape[0]], h) + prev * 0
        nxt, keep, w13, w2 = step(h, lg, w13, w2, ct)
        return after(x, nxt), keep, w13, w2

    return chain(body, calls, (x, jnp.zeros((), jnp.float32), w13, w2))[:2]


@functools.cache
def _weights_program():
    import jax
    import jax.numpy as jnp
    from jax_moe import fp8

    def make(key, shape, scale, dtype):
        def one(k):
            w = jax.random.normal(k, shape[1:], jnp.float32) * scale
            return fp8.quantize_blocks(w) if dtype is None else w.astype(dtype)
        return jax.lax.map(one, jax.random.split(key, shape[0]), batch_size=8)
    return jax.jit(make, static_argnums=(1, 2, 3))


def random_weights(key, shape, scale, dtype):
    """(E, N, K) N(0, scale²) weights in `dtype`, or block-quantised fp8
    (codes, scales) when dtype is None, drawn 8 experts at a time in one
    jitted program so no f32 copy of the whole tensor exists (DeepSeek-V3's
    w13 alone takes 30 GB in f32)."""
    return _weights_program()(key, tuple(shape), float(scale), dtype)


def write_json(path, meta, rows) -> None:
    """{"meta": ..., "rows": [...]} to path; nothing when path is empty."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said once) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt
