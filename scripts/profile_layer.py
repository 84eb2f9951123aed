"""Where a layer call's device time goes: runs `calls` chained moe_forward
calls (as benchmarks/bench_moe.py does) under jax.profiler, then sums the
GPU kernel time per kernel name from the trace and prints it per layer call,
largest first, with the sum and the wall time per call for comparison.

    python3 scripts/profile_layer.py deepseek_v3 1024 [calls] [trace dir]
"""
import collections
import glob
import gzip
import json
import re
import sys
import time

import jax
import jax.numpy as jnp

import jax_moe

name, tokens = sys.argv[1], int(sys.argv[2])
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 5
trace_dir = sys.argv[4] if len(sys.argv) > 4 else f"/tmp/trace_{name}_{tokens}"
h, i, e, k = jax_moe.tuning.MODEL_SHAPES[name]
keys = jax.random.split(jax.random.PRNGKey(0), 4)
x = jax.random.normal(keys[0], (tokens, h), jnp.float32).astype(jnp.bfloat16)
logits = jax.random.normal(keys[1], (calls, tokens, e), jnp.float32)
w13 = (jax.random.normal(keys[2], (e, 2 * i, h), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
w2 = (jax.random.normal(keys[3], (e, h, i), jnp.float32) * i**-0.5).astype(jnp.bfloat16)


@jax.jit
def run(x, logits, w13, w2):
    for c in range(calls):  # straight-line, each call on the previous output
        x = jax_moe.moe_forward(x, logits[c], w13, w2, k)
    return x


run(x, logits, w13, w2).block_until_ready()
t0 = time.perf_counter()
run(x, logits, w13, w2).block_until_ready()
wall = (time.perf_counter() - t0) / calls * 1e6
with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    run(x, logits, w13, w2).block_until_ready()

files = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
if not files:
    sys.exit(f"no perfetto trace under {trace_dir}")
events = json.load(gzip.open(sorted(files)[-1]))
events = events.get("traceEvents", events) if isinstance(events, dict) else events
procs = {ev["pid"]: ev["args"].get("name", "") for ev in events
         if ev.get("ph") == "M" and ev.get("name") == "process_name"}
gpu_pids = {pid for pid, pname in procs.items() if re.search(r"GPU|gpu|device", pname)
            and not re.search(r"[Hh]ost|CPU", pname)}
print("processes:", {p: procs[p] for p in sorted(procs)})
threads = {(ev["pid"], ev["tid"]): ev["args"].get("name", "") for ev in events
           if ev.get("ph") == "M" and ev.get("name") == "thread_name"}
# A device's lines: its streams (kernels, copies) and XLA's op and module
# annotations over them; summed per line so that nothing counts twice.
per_line = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
for ev in events:
    if ev.get("ph") == "X" and ev.get("pid") in gpu_pids and "dur" in ev:
        line = threads.get((ev["pid"], ev.get("tid")), str(ev.get("tid")))
        rec = per_line[line][ev.get("name", "?")[:90]]
        rec[0] += float(ev["dur"])
        rec[1] += 1
print(f"{name} T={tokens}: wall {wall:.1f} µs per call ({calls} chained calls)")
for line, per_kernel in per_line.items():
    total = sum(v[0] for v in per_kernel.values())
    print(f"-- {line}: {total / calls:.1f} µs per call")
    for kname, (dur, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"  {dur / calls:9.1f} µs  x{n / calls:4.1f}  {kname}")
