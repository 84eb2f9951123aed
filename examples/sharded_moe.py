"""The MoE layer with expert and tensor parallelism on every device JAX sees.

    python examples/sharded_moe.py                 # check every (ep, tp) mesh
    python examples/sharded_moe.py --bench         # also time both strategies
    python examples/sharded_moe.py --devices 16    # CPU only: 16 host devices

On a CPU-only machine it asks XLA for 8 host devices (or --devices), unless
XLA_FLAGS already sets a count. For each factorisation ep x tp of the device
count it builds a Mesh(("ep", "tp")), places the inputs with
jax_moe.moe_shardings, runs jax_moe.moe_forward_sharded with both strategies
and compares the result with jax_moe.moe_forward on one device. Exits with
status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=203, help="T (need not divide the device count)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--devices", type=int, default=8, help="host devices to ask for on CPU")
    p.add_argument("--routing", default="uneven", choices=["uneven", "random"],
                   help="uneven: one expert is in most tokens' top-k")
    p.add_argument("--bench", action="store_true", help="time both strategies on each mesh")
    p.add_argument("--iters", type=int, default=10, help="timed calls per case with --bench")
    return p.parse_args()


def _force_host_devices(count: int) -> None:
    """Before jax starts: on a CPU-only run, ask for `count` host devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    if os.environ.get("JAX_PLATFORMS", "cpu") not in ("", "cpu"):
        return  # an accelerator was asked for: use its devices as they are
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _factor_pairs(n: int):
    return [(ep, n // ep) for ep in range(n, 0, -1) if n % ep == 0]


def main() -> int:
    args = _parse()
    _force_host_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jax_moe
    from jax_moe.parallel import moe_forward_sharded, moe_shardings

    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on GPUs
    dtype = jnp.dtype(args.dtype)
    t, h, i, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.topk
    devices = jax.devices()
    n = len(devices)
    print(f"{n} x {devices[0].device_kind} ({jax.default_backend()}); "
          f"T={t} H={h} I={i} E={e} k={k} {dtype.name}, {args.routing} routing")

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    logits = rng.standard_normal((t, e)).astype(np.float32) * 2.0
    if args.routing == "uneven":
        logits[:, e // 3] += 3.0  # one expert is in most tokens' top-k
    logits = jnp.asarray(logits)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) * h**-0.5, dtype)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) * i**-0.5, dtype)

    one = jax.jit(jax_moe.moe_forward, static_argnames=("topk",))
    want = np.asarray(one(x, logits, w13, w2, topk=k).astype(jnp.float32))
    if args.bench:
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            jax.block_until_ready(one(x, logits, w13, w2, topk=k))
            times.append(time.perf_counter() - start)
        print(f"one device (moe_forward): median {1e3 * float(np.median(times)):.2f} ms "
              f"over {args.iters}")
    tol = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}[dtype.name]

    failures = 0
    for ep, tp in _factor_pairs(n):
        if e % ep or i % tp:
            print(f"mesh ep={ep} tp={tp}: skipped (E={e} % ep or I={i} % tp is not 0)")
            continue
        mesh = Mesh(np.asarray(devices).reshape(ep, tp), ("ep", "tp"))
        sh = moe_shardings(mesh)
        if t % n == 0:
            tokens = (jax.device_put(x, sh["hidden_states"]),
                      jax.device_put(logits, sh["router_logits"]))
        else:  # T rows cannot be split evenly: moe_forward_sharded pads inside jit
            tokens = (x, logits)
        placed = (*tokens,
                  # the (E, 2, I, H) view of w13 can be stored split over tp
                  jax.device_put(w13.reshape(e, 2, i, h), sh["w13"]),
                  jax.device_put(w2, sh["w2"]))
        print(f"mesh {dict(mesh.shape)}: w13 {sh['w13'].spec}, w2 {sh['w2'].spec}, "
              f"tokens {sh['hidden_states'].spec}")
        fns = {}
        for strategy in ("allgather", "all_to_all"):
            fn = jax.jit(lambda a, b, c, d, s=strategy, m=mesh: moe_forward_sharded(
                a, b, c, d, k, mesh=m, strategy=s))
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*placed))
            first = time.perf_counter() - start
            got = np.asarray(out.astype(jnp.float32))
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            ok = got.shape == want.shape and err < tol
            failures += not ok
            fns[strategy] = fn
            print(f"  {strategy:10s} rel err {err:.2e} {'ok' if ok else 'MISMATCH'}  "
                  f"(first call, with compile: {first:.2f} s)")
        if args.bench:  # the two strategies alternate, so both see the same load
            times = {s: [] for s in fns}
            for _ in range(args.iters):
                for strategy, fn in fns.items():
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*placed))
                    times[strategy].append(time.perf_counter() - start)
            print("  median over %d calls: %s" % (args.iters, ", ".join(
                f"{s} {1e3 * float(np.median(v)):.1f} ms" for s, v in times.items())))
    print("all meshes match the single-device layer" if not failures
          else f"{failures} mismatch(es)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
