"""A/B in one process: the MoE layer as one custom call (ops.moe_layer,
what moe_forward runs; programmatic dependent launch between all its kernels
on sm_90), as four (route, token index, expert_mlp, combine: steps 3-6 in one
call) and as six (steps 3-6 as group_gemm_gather, gated_activation,
group_gemm), and at one token as ops.moe_decode (the whole layer in one
kernel; other bits, so compared with a tolerance). Needs a GPU.

    PYTHONPATH=<site> python3 scripts/layer_ab.py [shape ...] [--tokens 1 16]

Per call µs from the slope of 100- and 20-call chained programs with fresh
routing each call (benchmarks/_bench_common), the forms timed in turn
(A B C A B C ...), each form's best and median of its rounds reported; the
outputs of one call are compared bit for bit. --modes: "dependent" (call i's
logits depend on call i-1's output, as in a model: _bench_common.after) and
"independent" (they do not: XLA may then run later calls' routing beside
earlier calls' GEMMs).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from _bench_common import after, chain, per_call_seconds  # noqa: E402

from jax_moe import ops, tuning  # noqa: E402

ROUTINGS = 8
SHAPES = {**tuning.MODEL_SHAPES, "tiny": (64, 32, 8, 2)}  # tiny: a CPU check of this script


FORMS = ("one", "four", "six")


def layer(x, logits, w13, w2, topk, form):
    if form == "decode":
        return ops.moe_decode(x, logits, w13, w2, topk)
    if form == "one":
        return ops.moe_layer(x, logits, w13, w2, topk)
    weights, ids = ops.route(logits, topk)
    src_to_dst, dst_to_src, sizes = ops.moe_compute_token_index(ids, w13.shape[0])
    if form == "four":
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
    p.add_argument("--modes", nargs="*", default=["dependent", "independent"],
                   choices=["dependent", "independent"])
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
            forms = FORMS
            if tokens == 1 and ops.moe_decode_supported(x, logits[0], w13, w2, topk):
                forms = FORMS + ("decode",)
            outs = {f: np.asarray(jax.jit(lambda x, l, a, b, f=f: layer(x, l, a, b, topk, f))(
                x, logits[0], w13, w2)) for f in forms}
            one = {f: v.view(np.uint16) for f, v in outs.items()}
            same = all(np.array_equal(one[f], one["one"]) for f in FORMS)
            if "decode" in forms:
                ref = outs["one"].astype(np.float32)
                rel = float(np.max(np.abs(outs["decode"].astype(np.float32) - ref))
                            / np.max(np.abs(ref)))
                print(f"{name} T=1: moe_decode vs moe_layer, max abs diff / max |out| {rel:.2e}")

            compiled = {}

            def program(n, form, dep):  # compiled once per (n, form, mode), reused by the rounds
                if (n, form, dep) not in compiled:
                    def body(i, h, lg, a, b):
                        lg_i = after(lg[i % ROUTINGS], h) if dep else lg[i % ROUTINGS]
                        return layer(h, lg_i, a, b, topk, form)
                    run = jax.jit(lambda x, lg, a, b: chain(
                        lambda i, h: body(i, h, lg, a, b), n, x))
                    run(x, logits, w13, w2).block_until_ready()
                    compiled[n, form, dep] = lambda: run(x, logits, w13, w2).block_until_ready()
                return compiled[n, form, dep]

            for mode in args.modes:
                dep = mode == "dependent"
                best = {f: [] for f in forms}
                for _ in range(args.rounds):
                    for form in forms:
                        best[form].append(
                            per_call_seconds(lambda n: program(n, form, dep), 100, 5) * 1e6)
                def show(v):
                    return (f"best {min(v):.1f}, median {float(np.median(v)):.1f} µs "
                            f"(rounds {', '.join(f'{t:.1f}' for t in v)})")
                times = "; ".join(f"{f} call{'' if f in ('one', 'decode') else 's'} "
                                  f"{show(best[f])}" for f in forms)
                equal = "bitwise equal" if same else "DIFFER"
                print(f"{name} T={tokens} {mode}: {times}; one/four/six outputs {equal}",
                      flush=True)


if __name__ == "__main__":
    main()
