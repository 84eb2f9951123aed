"""Runs a Qwen3-30B-A3B-sized MoE layer (H=2048, I=768, E=128, k=8) with
jax_moe on whatever device JAX has, and checks it against reference.py.

    python examples/moe_layer.py [--tokens 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jax_moe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()

    dtype = jnp.dtype(args.dtype)
    t, h, i, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.topk
    kx, kr, k1, k2 = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(kx, (t, h), jnp.float32).astype(dtype)
    logits = jax.random.normal(kr, (t, e), jnp.float32)
    w13 = (jax.random.normal(k1, (e, 2 * i, h), jnp.float32) * h**-0.5).astype(dtype)
    w2 = (jax.random.normal(k2, (e, h, i), jnp.float32) * i**-0.5).astype(dtype)

    jax.block_until_ready((x, logits, w13, w2))  # time the layer, not the random weights
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"T={t} H={h} I={i} E={e} k={k} {dtype.name}")
    layer = jax_moe.MoELayer(jax_moe.MoEConfig(
        num_experts=e, topk=k, hidden_size=h, intermediate_size=i))
    ref = jax.jit(jax_moe.moe_forward, static_argnames=("topk", "backend"))

    start = time.perf_counter()
    out = layer(x, logits, w13, w2).block_until_ready()
    print(f"jax_moe (ffi): first call {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    out = layer(x, logits, w13, w2).block_until_ready()
    print(f"jax_moe (ffi): second call {1e3 * (time.perf_counter() - start):.2f} ms")
    want = ref(x, logits, w13, w2, topk=k, backend="reference").block_until_ready()

    a, b = out.astype(jnp.float32), want.astype(jnp.float32)
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    print(f"relative error vs reference: {rel:.3e} (tolerance {tol:g})")
    if not rel < tol:
        raise SystemExit("FAILED: jax_moe and the reference disagree")
    print("OK")


if __name__ == "__main__":
    main()
