"""Where a layer call's device time goes: runs `calls` chained moe_forward
calls (as benchmarks/bench_moe.py does) under jax.profiler, then sums the
GPU kernel time per kernel name from the trace and prints it per layer call,
largest first, with the sum and the wall time per call for comparison.

    python3 scripts/profile_layer.py deepseek_v3 1024 [calls] [trace dir]
"""
import os
import sys
import time

import jax
import jax.numpy as jnp

import jax_moe
from _trace import device_time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from _bench_common import after  # noqa: E402

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
        # its logits made to depend on that output, as in bench_moe.py
        x = jax_moe.moe_forward(x, after(logits[c], x), w13, w2, k)
    return x


run(x, logits, w13, w2).block_until_ready()
t0 = time.perf_counter()
run(x, logits, w13, w2).block_until_ready()
wall = (time.perf_counter() - t0) / calls * 1e6
print(f"{name} T={tokens}: wall {wall:.1f} µs per call ({calls} chained calls)")
device_time(lambda: run(x, logits, w13, w2).block_until_ready(), calls, trace_dir)
