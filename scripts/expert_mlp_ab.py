"""A/B in one process: the MoE layer with steps 3-6 in one call
(ops.expert_mlp, what moe_forward runs; programmatic dependent launch between
its kernels on sm_90) against the same layer with the three separate calls
(group_gemm_gather, gated_activation, group_gemm). Needs a GPU.

    PYTHONPATH=<site> python3 scripts/expert_mlp_ab.py [shape ...] [--tokens 1 16]

Per call µs from the slope of 100- and 20-call chained programs with fresh
routing each call (benchmarks/_bench_common), the two forms timed alternately
(A B A B ...), each form's best and median of its rounds reported; the outputs of one call
are compared bit for bit.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from _bench_common import chain, per_call_seconds  # noqa: E402

from jax_moe import ops, tuning  # noqa: E402

ROUTINGS = 8
SHAPES = {**tuning.MODEL_SHAPES, "tiny": (64, 32, 8, 2)}  # tiny: a CPU check of this script


def layer(x, logits, w13, w2, topk, fused):
    weights, ids = ops.route(logits, topk)
    src_to_dst, dst_to_src, sizes = ops.moe_compute_token_index(ids, w13.shape[0])
    if fused:
        y = ops.expert_mlp(x, w13, w2, sizes, dst_to_src, topk)
    else:
        a = ops.gated_activation(ops.group_gemm_gather(x, w13, sizes, dst_to_src, topk), "silu")
        y = ops.group_gemm(a, w2, sizes)
    return ops.moe_combine(y, weights, src_to_dst)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["qwen3_30b_a3b", "qwen3_235b_a22b",
                                                 "mixtral_8x7b"])
    p.add_argument("--tokens", nargs="*", type=int, default=[1, 16])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    for name in args.shapes:
        hidden, inter, experts, topk = SHAPES[name]
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        w13 = (jax.random.normal(keys[0], (experts, 2 * inter, hidden), jnp.bfloat16)
               * hidden ** -0.5).astype(jnp.bfloat16)
        w2 = (jax.random.normal(keys[1], (experts, hidden, inter), jnp.bfloat16)
              * inter ** -0.5).astype(jnp.bfloat16)
        for tokens in args.tokens:
            x = jax.random.normal(keys[2], (tokens, hidden), jnp.bfloat16)
            logits = jax.random.normal(keys[3], (ROUTINGS, tokens, experts), jnp.float32)
            # Weights and logits are arguments: closed over, they would be
            # embedded in the program as constants.
            one = {f: jax.jit(lambda x, l, a, b, f=f: layer(x, l, a, b, topk, f))(
                x, logits[0], w13, w2) for f in (True, False)}
            same = np.array_equal(np.asarray(one[True]).view(np.uint16),
                                  np.asarray(one[False]).view(np.uint16))

            compiled = {}

            def program(n, fused):  # compiled once per (n, form), reused by the rounds
                if (n, fused) not in compiled:
                    run = jax.jit(lambda x, lg, a, b: chain(
                        lambda i, h: layer(h, lg[i % ROUTINGS], a, b, topk, fused), n, x))
                    run(x, logits, w13, w2).block_until_ready()
                    compiled[n, fused] = lambda: run(x, logits, w13, w2).block_until_ready()
                return compiled[n, fused]

            best = {True: [], False: []}
            for _ in range(args.rounds):
                for fused in (True, False):
                    best[fused].append(per_call_seconds(lambda n: program(n, fused), 100, 5) * 1e6)
            def show(v):
                return (f"best {min(v):.1f}, median {float(np.median(v)):.1f} µs "
                        f"(rounds {', '.join(f'{t:.1f}' for t in v)})")
            print(f"{name} T={tokens}: one call {show(best[True])}; three calls {show(best[False])}; "
                  f"outputs {'bitwise equal' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
