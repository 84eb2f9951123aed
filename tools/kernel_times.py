"""Where a layer call's GPU time goes: each kernel's time per call from a
jax.profiler trace of bench_moe's chained program.

    python3 tools/kernel_times.py --shape mixtral_8x7b --tokens 128 [--fp8] [--calls 10]

Runs bench_moe.make_loop's straight-line program of --calls dependent layer
calls once to compile and warm up, then once under jax.profiler.trace, and
prints every kernel on the GPU's streams: its time divided by the call count
(µs; a kernel that starts while the one before it runs counts from that
one's end), its launches per call, its share of the busy time, and the idle
time of its stream just before it started (µs per call: the GPU waiting for
the host or for a dependency), largest first. The head line adds the whole
span per call (first kernel's start to last kernel's end), which bench_moe's
wall time follows, and the next line each call's span in chain order (from
one launch of the chain's first kernel to the next), to show a chain whose
later calls run slower.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_moe  # noqa: E402
from _bench_common import random_weights  # noqa: E402


def gpu_kernel_events(trace: dict) -> list:
    """The complete ("X") events on the GPU processes' stream threads (the
    trace's other GPU lines, XLA's modules and ops, span the same time)."""
    meta = [e for e in trace.get("traceEvents", []) if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    streams = {(e["pid"], e.get("tid")) for e in meta if e.get("name") == "thread_name"
               and e["pid"] in gpu_pids and "Stream" in str(e.get("args", {}).get("name", ""))}
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and "dur" in e and e.get("pid") in gpu_pids
            and (not streams or (e["pid"], e.get("tid")) in streams)]


def kernel_times(events) -> tuple:
    """({kernel name: µs}, {kernel name: launches}, {kernel name: idle µs
    before it}) of the events. A kernel launched early (programmatic
    dependent launch) waits inside the one before it: each kernel counts
    from where its stream's previous kernel ended, so that overlapping spans
    are counted once; the idle time is its start minus that end, where
    positive."""
    total, count, idle = collections.Counter(), collections.Counter(), collections.Counter()
    last_end = {}
    for ev in sorted(events, key=lambda ev: float(ev["ts"])):
        start, end = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
        stream = (ev["pid"], ev.get("tid"))
        total[ev["name"]] += max(0.0, end - max(start, last_end.get(stream, start)))
        idle[ev["name"]] += max(0.0, start - last_end.get(stream, start))
        last_end[stream] = max(end, last_end.get(stream, end))
        count[ev["name"]] += 1
    return total, count, idle


def timeline(events) -> tuple:
    """(first start, last end) of the events, µs."""
    return (min(float(ev["ts"]) for ev in events),
            max(float(ev["ts"]) + float(ev["dur"]) for ev in events))


def call_spans(events, calls: int) -> list | None:
    """Each call's span (µs) in chain order: from one start of the first
    kernel of the timeline to the next, the last call to the timeline's end;
    None when that kernel does not run once a call."""
    if not events:
        return None
    events = sorted(events, key=lambda ev: float(ev["ts"]))
    first = events[0]["name"]
    starts = [float(ev["ts"]) for ev in events if ev["name"] == first]
    if len(starts) != calls:
        return None
    return [b - a for a, b in zip(starts, starts[1:] + [timeline(events)[1]])]


def short_names(names, width: int = 100) -> dict:
    """{name: label of at most `width` characters}. A name longer than
    that is cut to its first `width`, unless another name starts the same
    (CUTLASS's mangled names share their first few hundred characters): then
    its label is its head, "…", and the stretch where it first differs from
    the others."""
    names = list(names)
    labels = {}
    for name in names:
        if len(name) <= width:
            labels[name] = name
            continue
        rivals = [o for o in names if o != name and o[:width] == name[:width]]
        if not rivals:
            labels[name] = name[:width]
            continue
        # the first index where name differs from every rival
        differ = max(next((i for i, (a, b) in enumerate(zip(name, o)) if a != b),
                          min(len(name), len(o))) for o in rivals)
        head = width * 2 // 5
        start = max(head, differ - 10)
        labels[name] = name[:head] + "…" + name[start:start + width - head - 1]
    return labels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes = {**bench_moe.SHAPES, **bench_moe.QUICK_SHAPES}
    p.add_argument("--shape", required=True, choices=list(shapes))
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--fp8", action="store_true")
    args = p.parse_args(argv)

    h, i, e, k = shapes[args.shape]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (args.tokens, h), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(keys[1], (bench_moe.ROUTINGS, args.tokens, e), jnp.float32)
    w13_draw, w2_draw = ((e, 2 * i, h), h**-0.5), ((e, h, i), i**-0.5)  # shape, scale
    if args.fp8:  # dtype None: block-quantised fp8 codes and scales
        (w13, s13), (w2, s2) = (random_weights(keys[2], *w13_draw, None),
                                random_weights(keys[3], *w2_draw, None))
        scales = (s13, s2)
    else:
        w13 = random_weights(keys[2], *w13_draw, jnp.bfloat16)
        w2 = random_weights(keys[3], *w2_draw, jnp.bfloat16)
        scales = (None, None)
    routing = bench_moe.ROUTING.get(args.shape, {})
    bias = jnp.zeros((e,), jnp.float32) if routing else None
    run = bench_moe.make_loop("ffi", k, args.calls, routing)
    run(x, logits, w13, w2, bias, scales).block_until_ready()  # compile, warm up

    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            run(x, logits, w13, w2, bias, scales).block_until_ready()
        files = list(pathlib.Path(logdir).rglob("perfetto_trace.json.gz"))
        if not files:
            print("no perfetto trace was written", file=sys.stderr)
            return 1
        trace = json.loads(gzip.decompress(files[0].read_bytes()))
    events = gpu_kernel_events(trace)
    if not events:
        print("the trace has no GPU kernels (no GPU, or no device tracing)", file=sys.stderr)
        return 1
    total, count, idle = kernel_times(events)
    whole = sum(total.values())
    start, end = timeline(events)
    span = end - start
    print(f"# {args.shape} T={args.tokens}{' fp8' if args.fp8 else ''}: {args.calls} calls, "
          f"kernel time {whole / args.calls:.1f} µs a call, span {span / args.calls:.1f}")
    spans = call_spans(events, args.calls)
    if spans is not None:
        print("call spans µs: " + " ".join(f"{us:.1f}" for us in spans))
    print(f"{'µs':>10}  {'calls':>6}  {'share':>6}  {'idle µs':>8}  kernel")
    labels = short_names(total)
    for name, us in total.most_common():
        print(f"{us / args.calls:10.1f}  {count[name] / args.calls:5.1f}x  "
              f"{100 * us / whole:5.1f}%  {idle[name] / args.calls:8.1f}  {labels[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
