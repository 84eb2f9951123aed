"""Sharded MoE layer benchmark: jax_moe.moe_forward_sharded on every device JAX
sees, against jax_moe.moe_forward on one device (weak scaling).

For N devices, every mesh ("ep", "tp") = (ep, tp) with ep * tp = N, E % ep == 0
and I % tp == 0, and each strategy ("allgather", "all_to_all"), the layer runs
on T = tokens_per_device * N global tokens (inputs placed with
jax_moe.moe_shardings, w13 stored as its (E, 2, I, H) view). The baseline is
moe_forward on device 0 with T = tokens_per_device: the same tokens per device,
so  scaling efficiency = t_1dev / t_Ndev  (1.0 = perfect weak scaling; above
1.0 is possible: each device reads only 1/N of the weights) and throughput =
global tokens / t.

Timing: one jitted straight-line program of `calls` layer calls, as in
bench_moe.py: each call's output (sharded like its input) is the next call's
input, the routing rotates among ROUTINGS random logits batches (stacked on a leading, unsharded
axis, placed with the router_logits sharding), each made to depend on the
call's input (_bench_common.after: otherwise XLA deduplicates the routing of
calls that share logits; the expert-only loop below keeps independent logits,
so its routing may be deduplicated). One warm-up run, then the median
of `repeats` runs, divided by `calls`: device time per layer. Unlike
bench_moe.py this is not a slope between two programs, so the program's
fixed dispatch cost is spread over the calls.

Expert time vs collectives. "expert µs" is the same per-device work with every
collective removed, timed the same way: inside jax.shard_map over the same
mesh, each device routes its own T_loc tokens (the layer's router, same op) and
runs parallel._local_experts -- the very function both strategies call on each
device -- on the rows it holds after the dispatch: N * T_loc token rows (both
strategies hand each device n_ep * n_tp * T_loc rows, see docs/parallel.md,
"Bytes per device") against its E/ep experts and I/tp slice. Rows 0..T_loc-1
carry the device's own routing; the other rows' routing is drawn up front from
the same random-logits distribution (in the real layer they arrive with the
gathered tokens), so each device places as many (token, local expert) pairs as
it would in the layer. The same number serves both strategies.
"collective µs" = total - expert µs: the collectives *and* the local work
around them that only exists because of the sharding -- packing the routing
metadata rows next to the tokens, the all_to_all path's pair sort, send-buffer
fill and per-token sum over ranks, the final slice. Collectives are not
overlapped with compute in this layer (each call depends on the previous one),
so the difference is the time they add; with timing noise it can come out
slightly negative for tiny shapes.

With --train every timed call is a training step instead of a forward:
forward and backward with the gradients of the tokens, the router logits,
w13 and w2 (_bench_common.training_step, as benchmarks/bench_train.py times
it on one device), the next step's input its input gradient, the weights
through an optimization barrier; the baseline is the same step of
moe_forward on one device, and "expert µs" the same step of the
collective-free per-device work.

    python benchmarks/bench_sharded.py                        # full grid, all devices
    python benchmarks/bench_sharded.py --shapes deepseek_v3 --tokens 1024
    python benchmarks/bench_sharded.py --device-counts 2 4 8  # scaling over 2, 4, 8 of them
    python benchmarks/bench_sharded.py --tp 1                 # expert parallelism only
    python benchmarks/bench_sharded.py --quick                # tiny shape, 8 CPU host devices
    python benchmarks/bench_sharded.py --train                # training steps instead

With JAX_PLATFORMS unset or "cpu", XLA is asked for 8 host devices (unless
XLA_FLAGS already sets a count), so on a GPU machine run with
JAX_PLATFORMS=cuda. On CPU, collectives are memcpys and the devices share the
host's cores, so CPU numbers only show that everything runs.
"""

from __future__ import annotations

import os
import sys


def _cpu_flags() -> None:
    """Before jax is imported, on a CPU run (JAX_PLATFORMS unset or "cpu"): 8
    host devices (as examples/sharded_moe.py does), unless XLA_FLAGS sets a
    count; with --quick also less LLVM optimisation of XLA's own code (not the
    jax_moe kernels): a smoke run's time is mostly compiling ~60 programs."""
    if os.environ.get("JAX_PLATFORMS", "cpu") not in ("", "cpu"):
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_force_host_platform_device_count") for f in flags):
        flags.append("--xla_force_host_platform_device_count=8")
    if "--quick" in sys.argv[1:] and not any("xla_backend_optimization_level" in f for f in flags):
        flags += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    os.environ["XLA_FLAGS"] = " ".join(flags)


_cpu_flags()

import argparse  # noqa: E402
import statistics  # noqa: E402
from datetime import date  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _bench_common import (after, chain, check_least, training_chain,  # noqa: E402
                           training_step, wall_time, write_json)
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe  # noqa: E402
from jax_moe import parallel  # noqa: E402

SHAPES = {n: jax_moe.tuning.MODEL_SHAPES[n]  # name: (H, I, E, k)
          for n in ("qwen3_235b_a22b", "deepseek_v3")}
TOKENS = (128, 1024, 8192)  # per device
QUICK_SHAPES = {"tiny": (64, 32, 8, 2)}
QUICK_TOKENS = (1, 16, 100)
STRATEGIES = ("allgather", "all_to_all")
ROUTINGS = 8  # distinct random routings the loop rotates through
METHOD = ("expert_us: per-device routing of its own tokens + parallel._local_experts on the "
          "N*T_loc rows it holds after dispatch, inside shard_map with no collective; "
          "collective_us = total - expert_us (collectives + packing/dispatch bookkeeping)")
TRAIN_METHOD = ("training steps: forward + backward with the gradients of x, logits, w13 and "
                "w2, each step's input the previous step's input gradient "
                "(_bench_common.training_step)")


def factor_pairs(n, experts, inter):
    """(ep, tp) with ep * tp = n, E % ep == 0, I % tp == 0; ep first, largest first."""
    return [(ep, n // ep) for ep in range(n, 0, -1)
            if n % ep == 0 and experts % ep == 0 and inter % (n // ep) == 0]


def timed(run, args, calls, repeats) -> float:
    """µs per layer call: warm-up (and compile), then the median of `repeats` runs."""
    jax.block_until_ready(run(*args))
    times = [wall_time(lambda: jax.block_until_ready(run(*args))) / calls for _ in range(repeats)]
    return statistics.median(times) * 1e6


def random_arrays(key, specs: dict) -> dict:
    """Random arrays created directly on their devices, in one jitted call (one
    compile). specs: name -> (shape, dtype, scale, sharding) for normal(0, scale)
    entries, or name -> ("routing", shape (R, rows, E), topk, sharding) for the
    (weights, ids) of softmax top-k routing of normal logits (R, rows, E)."""
    names = list(specs)

    def make(key):
        out = []
        for name, sub in zip(names, jax.random.split(key, len(names))):
            spec = specs[name]
            if spec[0] == "routing":
                top, ids = jax.lax.top_k(jax.random.normal(sub, spec[1], jnp.float32), spec[2])
                out.append((jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)))
            else:
                shape, dtype, scale, _ = spec
                out.append((jax.random.normal(sub, shape, dtype) * scale).astype(dtype))
        return tuple(out)

    shardings = tuple((s[3], s[3]) if s[0] == "routing" else s[3] for s in specs.values())
    return dict(zip(names, jax.jit(make, out_shardings=shardings)(key)))


# ------------------------------------------------------------- the loops

def layer_loop(layer, calls, train):
    """`calls` chained calls of layer(h, logits, w13, w2) -> (T, H): forwards,
    run(x, logits, w13, w2), each on x and waiting for the previous call's
    output through its logits (as bench_moe.make_loop), or with `train`
    training steps, run(x, logits, w13, w2, ct)."""
    if train:
        step = training_step(layer)
        return jax.jit(lambda *args: training_chain(step, calls, *args))

    @jax.jit
    def run(x, logits, w13, w2):
        def body(i, h):
            return layer(x, after(logits[i % logits.shape[0]], h), w13, w2)
        return chain(body, calls, x)
    return run


def single_loop(topk, calls, train=False):
    return layer_loop(lambda h, lg, w13, w2: jax_moe.moe_forward(h, lg, w13, w2, topk),
                      calls, train)


def sharded_loop(mesh, strategy, topk, calls, train=False):
    return layer_loop(
        lambda h, lg, w13, w2: jax_moe.moe_forward_sharded(h, lg, w13, w2, topk, mesh=mesh,
                                                           strategy=strategy),
        calls, train)


def expert_loop(plan, calls, train=False):
    """The layer's per-device compute with no collective (see the docstring):
    carry xg is (N * T_glob, H) globally, (T_glob, H) = the post-dispatch rows
    per device; forwards run on xg every call, their logits waiting for the
    previous output. With `train`, training steps: run(..., ct) with ct like
    xg."""
    impl = jax_moe.backends.get("ffi")
    steps = jax_moe.backends.steps("ffi")
    tok = P(plan.token_axes, None)
    e_loc, k = plan.local_experts, plan.topk

    def local(xg, logits, w_pre, id_pre, w13, w2):
        t_loc = logits.shape[0]
        w, ids = impl.route(logits, k, scoring_func="softmax", renormalize=plan.renormalize)
        wg = jnp.concatenate([w, w_pre[t_loc:]])
        idg = jnp.concatenate([ids, id_pre[t_loc:]])
        rank = jax.lax.axis_index(plan.ep) if plan.n_ep > 1 else 0
        w13 = w13.reshape(e_loc, -1, xg.shape[1])  # (E_loc, 2, I_loc, H) -> (E_loc, 2 I_loc, H)
        y = parallel._local_experts(steps, xg, wg, idg - rank * e_loc, w13, w2, plan)
        return y.astype(xg.dtype)

    def local_after(xg, logits, w_pre, id_pre, w13, w2, prev):
        # The forward chain's dependency: this device's logits wait for its
        # rows of the previous output (prev: N x the logits' rows, as xg).
        lg = after(logits, prev.reshape(logits.shape[0], -1))
        return local(xg, lg, w_pre, id_pre, w13, w2)

    specs = (tok, tok, tok, tok, P(plan.ep, None, plan.tp, None), P(plan.ep, None, plan.tp))
    step = parallel._shard_map(local, plan.mesh, specs, tok)
    step_after = parallel._shard_map(local_after, plan.mesh, specs + (tok,), tok)

    if train:
        @jax.jit
        def run_train(xg, logits, w_pre, id_pre, w13, w2, ct):
            def body(i, carry):
                h, prev, w13, w2 = carry
                r = i % logits.shape[0]

                def layer(h, lg, w13, w2):
                    return step(h, lg, w_pre[r], id_pre[r], w13, w2)

                # Waits for the previous step's gradients (h has N x the logits' rows).
                lg = logits[r] + prev * 0
                nxt, keep, w13, w2 = training_step(layer)(h, lg, w13, w2, ct)
                return after(xg, nxt), keep, w13, w2
            return chain(body, calls, (xg, jnp.zeros((), jnp.float32), w13, w2))[:2]
        return run_train

    @jax.jit
    def run(xg, logits, w_pre, id_pre, w13, w2):
        def body(i, h):  # every call on xg, as layer_loop's forward on x
            r = i % logits.shape[0]
            return step_after(xg, logits[r], w_pre[r], id_pre[r], w13, w2, h)
        return chain(body, calls, xg)
    return run


# ------------------------------------------------------------- the cases

def token_sets(shape, devices, tokens, dtype, key, train=False) -> dict:
    """Per T/device: the random token-side inputs, split over `devices` in
    order (device j holds token block j), on a 1-D mesh. Made once per device
    count and reused by every (ep, tp) mesh through relabel(): a mesh over the
    same devices in the same order gives each device the same blocks. With
    `train`, also the output cotangents of the layer and of the expert-only
    run."""
    h, i, e, k = shape
    n = len(devices)
    flat = Mesh(np.asarray(devices), ("d",))
    rows, stacked = NamedSharding(flat, P("d", None)), NamedSharding(flat, P(None, "d", None))
    sets = {}
    for t_dev in tokens:
        t = t_dev * n
        specs = {
            "x": ((t, h), dtype, 1.0, rows),
            "logits": ((ROUTINGS, t, e), jnp.float32, 1.0, stacked),
            # for the expert-only run: every device holds the N * T_loc = T rows
            # it sees after the dispatch, and their routing
            "xg": ((n * t, h), dtype, 1.0, rows),
            "routing": ("routing", (ROUTINGS, n * t, e), k, stacked)}
        if train:
            specs.update({"ct": ((t, h), dtype, 0.01, rows), "ctg": ((n * t, h), dtype, 0.01, rows)})
        sets[t_dev] = random_arrays(jax.random.fold_in(key, t_dev), specs)
    return sets


def relabel(a, sharding):
    """The same per-device blocks, as an array with `sharding` (no copy).
    Checks that each device holds the block `sharding` assigns it."""
    shards = {s.device: s for s in a.addressable_shards}
    want = sharding.addressable_devices_indices_map(a.shape)
    assert all(shards[d].index == idx for d, idx in want.items()), "different blocks"
    return jax.make_array_from_single_device_arrays(
        a.shape, sharding, [shards[d].data for d in want])


def bench_single(shape, sets, dtype, calls, repeats, key, train=False):
    """{T per device: µs} for moe_forward on device 0, with the tokens and
    logits (and cotangent) that device 0 holds in the sharded runs."""
    h, i, e, k = shape
    dev0 = jax.devices()[0]
    one = SingleDeviceSharding(dev0)
    w = random_arrays(key, {"w13": ((e, 2 * i, h), dtype, h**-0.5, one),
                            "w2": ((e, h, i), dtype, i**-0.5, one)})
    run = single_loop(k, calls, train)
    out = {}
    for t_dev, a in sets.items():
        names = ("x", "logits", "ct") if train else ("x", "logits")
        local = [[s.data for s in a[name].addressable_shards if s.device == dev0][0]
                 for name in names]
        x, logits = local[:2]
        assert x.shape == (t_dev, h) and logits.shape == (ROUTINGS, t_dev, e)
        args = (x, logits, w["w13"], w["w2"], *local[2:])
        out[t_dev] = timed(run, args, calls, repeats)
    return out


def bench_mesh(shape, devices, ep, tp, sets, strategies, dtype, calls, repeats, key,
               train=False):
    """Rows {T, strategy, total_us, expert_us} on one (ep, tp) mesh of `devices`."""
    h, i, e, k = shape
    mesh = Mesh(np.asarray(devices).reshape(ep, tp), ("ep", "tp"))
    sh = parallel.moe_shardings(mesh)
    stacked = NamedSharding(mesh, P(None, tuple(mesh.axis_names), None))  # (R, T, .)
    w = random_arrays(key, {"w13": ((e, 2, i, h), dtype, h**-0.5, sh["w13"]),
                            "w2": ((e, h, i), dtype, i**-0.5, sh["w2"])})
    w13, w2 = w["w13"], w["w2"]
    rows = []
    for t_dev, a in sets.items():
        x, xg = relabel(a["x"], sh["hidden_states"]), relabel(a["xg"], sh["hidden_states"])
        logits = relabel(a["logits"], stacked)
        routing = [relabel(r, stacked) for r in a["routing"]]
        ct = (relabel(a["ct"], sh["hidden_states"]),) if train else ()
        ctg = (relabel(a["ctg"], sh["hidden_states"]),) if train else ()
        for strategy in strategies:
            us = timed(sharded_loop(mesh, strategy, k, calls, train), (x, logits, w13, w2, *ct),
                       calls, repeats)
            rows.append({"tokens_per_device": t_dev, "strategy": strategy, "total_us": us})
        plan = parallel._make_plan(x, jax.ShapeDtypeStruct(logits.shape[1:], logits.dtype),
                                   w13, w2, k, mesh, "ep", "tp", True, "silu", None, "ffi",
                                   "allgather")
        expert_us = timed(expert_loop(plan, calls, train),
                          (xg, logits, *routing, w13, w2, *ctg), calls, repeats)
        for r in rows[-len(strategies):]:
            r["expert_us"] = expert_us
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny shape H=64 I=32 E=8 k=2, T/device 1 16 100 (CPU smoke test)")
    p.add_argument("--shapes", nargs="*", choices=[*SHAPES, *QUICK_SHAPES],
                   help="subset of the shapes (default: all; 'tiny' with --quick)")
    p.add_argument("--tokens", nargs="*", type=int, help="tokens per device")
    p.add_argument("--strategies", nargs="*", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--device-counts", nargs="*", type=int,
                   help="run on the first n devices for each n given (default: all devices)")
    p.add_argument("--tp", nargs="*", type=int,
                   help="only the meshes with these tensor-parallel sizes (default: every "
                        "factorisation ep x tp of the device count)")
    p.add_argument("--calls", type=int, default=None, help="layer calls per timed loop")
    p.add_argument("--repeats", type=int, default=None, help="timed loops per case (median)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--train", action="store_true",
                   help="time training steps (forward + backward, four gradients) instead of "
                        "forwards")
    p.add_argument("--json", default="bench_sharded.json")
    args = p.parse_args()
    check_least(p, args, calls=1, repeats=1, tokens=1, device_counts=1, tp=1)

    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = {n: {**SHAPES, **QUICK_SHAPES}[n] for n in args.shapes}
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    calls = args.calls or (2 if args.quick else 20)
    repeats = args.repeats or (2 if args.quick else 5)
    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    all_devices = jax.devices()
    counts = args.device_counts or [len(all_devices)]
    if max(counts) > len(all_devices):
        p.error(f"--device-counts {max(counts)}: only {len(all_devices)} devices")

    dev = all_devices[0].device_kind
    print(f"# {date.today()} {len(all_devices)} x {dev} ({backend}), jax {jax.__version__}, "
          f"{dtype.name}, {calls} calls x {repeats} repeats, {ROUTINGS} routings")
    print(f"# {METHOD}")
    if args.train:
        print(f"# {TRAIN_METHOD}")
    meta = {"date": str(date.today()), "device": dev, "backend": backend,
            "devices": len(all_devices), "device_counts": counts, "jax": jax.__version__,
            "dtype": dtype.name, "calls": calls, "repeats": repeats, "routings": ROUTINGS,
            "quick": args.quick, "train": args.train,
            "method": METHOD + ("; " + TRAIN_METHOD if args.train else "")}
    rows = []
    write_json(args.json, meta, rows)
    unit = "µs/step" if args.train else "µs/layer"
    print(f"| shape | T/device | mesh (ep x tp) | strategy | {unit} | expert µs | collective µs "
          "| 1-GPU µs | scaling eff. | tokens/s |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")

    def emit(row):
        rows.append(row)
        write_json(args.json, meta, rows)  # after each row: a cut-off run keeps its rows
        print(f"| {row['shape']} | {row['tokens_per_device']} | {row['mesh']} | {row['strategy']} "
              f"| {row['total_us']:.1f} | {row['expert_us']:.1f} | {row['collective_us']:.1f} "
              f"| {row['single_us']:.1f} | {row['scaling_efficiency']:.2f} "
              f"| {row['tokens_per_s']:.3g} |", flush=True)

    for name, shape in shapes.items():
        h, i, e, k = shape
        base = {"shape": name, "H": h, "I": i, "E": e, "k": k}
        # rbg keys: generated in place on each device's block (XLA's RngBitGenerator),
        # where threefry needed several u32 temporaries the size of the block
        # (CPU memory analysis: 8x the bf16 block), too much for a 15 GB w13 on
        # one device; they also compile faster.
        wkey, tkey = jax.random.split(jax.random.key(0, impl="rbg"))
        sets_n = max(counts)
        sets = token_sets(shape, all_devices[:sets_n], tokens, dtype, tkey, args.train)
        single = bench_single(shape, sets, dtype, calls, repeats, wkey, args.train)
        for t in tokens:
            emit({**base, "kind": "single", "devices": 1, "ep": 1, "tp": 1, "mesh": "1 device",
                  "strategy": "moe_forward", "tokens_per_device": t, "tokens": t,
                  "total_us": single[t], "expert_us": single[t], "collective_us": 0.0,
                  "single_us": single[t], "scaling_efficiency": 1.0,
                  "tokens_per_s": t / (single[t] * 1e-6)})
        for n in counts:
            if n == 1:
                continue  # the baseline above is the 1-device number
            if n != sets_n:
                sets = None  # free the previous device count's arrays first
                sets, sets_n = token_sets(shape, all_devices[:n], tokens, dtype, tkey,
                                          args.train), n
            for ep, tp in factor_pairs(n, e, i):
                if args.tp and tp not in args.tp:
                    continue
                for r in bench_mesh(shape, all_devices[:n], ep, tp, sets, args.strategies,
                                    dtype, calls, repeats, wkey, args.train):
                    t = r["tokens_per_device"]
                    emit({**base, "kind": "sharded", "devices": n, "ep": ep, "tp": tp,
                          "mesh": f"{ep}x{tp}", "strategy": r["strategy"],
                          "tokens_per_device": t, "tokens": t * n, "total_us": r["total_us"],
                          "expert_us": r["expert_us"],
                          "collective_us": r["total_us"] - r["expert_us"],
                          "single_us": single[t],
                          "scaling_efficiency": single[t] / r["total_us"],
                          "tokens_per_s": t * n / (r["total_us"] * 1e-6)})
                jax.clear_caches()
        del sets, single
        jax.clear_caches()  # one shape's arrays and executables at a time
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
