"""Regenerate the grouped GEMM's tuning table on the current GPU.

    python -m jax_moe.tune [--out FILE] [--shapes NAME ...] [--tokens T ...] [--fp8]

For each model shape (H, I, E, k) it times both expert GEMMs of the layer
(gate/up: N = 2I, K = H; down: N = H, K = I) at M = T * k rows for every
token count T, with every tile_m (256 only where the sm90 kernel runs, 16
instead of 8 where the TMA decode kernel does),
under random top-k routings (several, rotated per call), and keeps the
fastest tile per M (``best_tile``: the rule's own choice,
tuning.default_tile_m, stays unless another tile is more than NOISE faster;
at small M a call's fixed costs hide the kernels' differences, and noise
would pick at random). The JSON it writes is what jax_moe.tuning reads: put
it in jax_moe/tuning_tables/<device kind>.json (or point JAX_MOE_TUNING_DIR
at its folder).

With --fp8 it times ops.group_gemm_fp8 instead (the weights quantised to
block-scaled e4m3, bf16 x) with its tiles (tuning.FP8_TILE_M: the decode
form up to 8 rows per expert, the Hopper kernel's 64 and 128 where it runs)
and writes the table's "group_gemm_fp8" section. Sections that a run does
not time are kept from an existing --out file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jax_moe import fp8, ops, reference, tuning

SHAPES = tuning.MODEL_SHAPES  # name: (H, I, E, k)
TOKENS = (1, 16, 128, 1024, 8192)
ROUTINGS = 4
NOISE = 0.03  # relative margin a tile must beat the rule's choice by


def best_tile(us: dict, rule: int) -> int:
    """The fastest tile of {tile: µs}, or `rule` when it is within NOISE."""
    best = min(us, key=us.get)
    return rule if rule in us and us[rule] <= (1 + NOISE) * us[best] else best


def _sizes(key, tokens, experts, topk):
    """expert_sizes of ROUTINGS random softmax top-k routings: (R, E)."""
    logits = jax.random.normal(key, (ROUTINGS, tokens, experts), jnp.float32)
    ids = jax.vmap(lambda lg: reference.topk_softmax(lg, topk)[1])(logits)
    return jax.vmap(lambda i: reference.moe_compute_token_index(i, experts)[2])(ids)


def gemm_loop(tile_m: int, calls: int, fp8_weights: bool = False):
    """The jitted program tune times: `calls` group_gemm calls, call i with
    routing sizes[i % R]. Straight-line (a Python loop): XLA's GPU while loop
    would check its condition on the host every trip. Each call's input
    carries one element of the previous call's output: calls with the same
    routing would otherwise be identical, and XLA would run them once (CSE)."""

    @jax.jit
    def loop(x, w, sizes):
        for i in range(calls):
            s = sizes[i % sizes.shape[0]]
            out = (ops.group_gemm_fp8(x, *w, s, tile_m=tile_m) if fp8_weights
                   else ops.group_gemm(x, w, s, tile_m=tile_m))
            x = x.at[0, 0].set(out[0, 0])
        return x[0, 0]

    return loop


def time_gemm(x, w, sizes, tile_m, calls, repeats) -> float:
    """Median µs per call over `repeats` runs of gemm_loop (w: the weights,
    or a (codes, scales) pair for the fp8 GEMM)."""
    loop = gemm_loop(tile_m, calls, isinstance(w, tuple))
    loop(x, w, sizes).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loop(x, w, sizes).block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON to write (default: ./<device kind>.json)")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiles", nargs="*", type=int, default=None,
                   choices=sorted(set(tuning.TILE_M) | set(tuning.FP8_TILE_M)),
                   help="tile_m candidates to time (default: all of the GEMM's; a subset "
                        "writes a table that only knows those)")
    p.add_argument("--fp8", action="store_true",
                   help="time group_gemm_fp8 (block-scaled e4m3 weights, bf16 x)")
    args = p.parse_args(argv)

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print("jax_moe.tune needs a GPU (the table is per GPU model)", file=sys.stderr)
        return 2
    tune_section = _tune_fp8 if args.fp8 else _tune_bf16
    section, table, timings = tune_section(args)
    out = pathlib.Path(args.out or tuning.table_file_name(dev.device_kind))
    data = json.loads(out.read_text()) if out.exists() else {}  # keep what is not re-timed
    suffix = "_fp8" if args.fp8 else ""  # each section's date and timings
    data.update({"device": dev.device_kind, "date" + suffix: datetime.date.today().isoformat(),
                 "jax": jax.__version__, "hardware": tuning.hardware(), section: table,
                 "timings_us" + suffix: timings})
    tmp = out.with_suffix(".tmp")  # never leave a half-written table behind
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


def _tune_bf16(args):
    """("group_gemm", table, timings) for group_gemm."""
    dtype = jnp.dtype(args.dtype)
    all_tiles = args.tiles or list(tuning.TILE_M)

    def weights(w):
        return w.astype(dtype)

    def candidates(m, e, n, kk):
        # The decode tiles re-read an expert's weights per 8 or 16 rows: not
        # candidates once experts average more than 32 rows. 256 only where
        # the sm90 kernel runs (elsewhere it is 128 again), 16 only where the
        # TMA decode kernel can (elsewhere it is 8), and there not 8 (16 is the
        # 8 kernel at the launches too small for it, and the lookup turns a
        # table's 8 into 16).
        sm90, tma = tuning.sm90_usable(n, kk, dtype), tuning.tma_decode_usable(kk, dtype)
        tiles = [tl for tl in all_tiles
                 if (tl not in (8, tuning.TMA_TILE) or m <= 32 * e)
                 and (tl != tuning.SM90_TILE or sm90)
                 and (tl != tuning.TMA_TILE or tma) and (tl != 8 or not tma)]
        return tiles, tuning.default_tile_m(m, e, sm90=sm90, tma=tma)

    return "group_gemm", *_tune(args, dtype, weights, candidates, "")


def _tune_fp8(args):
    """("group_gemm_fp8", table, timings) for group_gemm_fp8, bf16 x."""
    dtype = jnp.dtype(jnp.bfloat16)
    all_tiles = args.tiles or list(tuning.FP8_TILE_M)

    def candidates(m, e, n, kk):
        # The decode form re-reads an expert's weights per 8 rows: not a
        # candidate beyond 8 rows an expert; 64 and 128 only where the Hopper
        # kernel runs (elsewhere both are the portable kernel).
        sm90 = tuning.fp8_sm90_usable(n, kk, dtype)
        tiles = [tl for tl in all_tiles
                 if (tl == 8 and m <= 8 * e and tuning.fp8_decode_runs(8, e, kk))
                 or (tl in (64, 128) and sm90)]
        return tiles, tuning.default_fp8_tile_m(m, e)

    return "group_gemm_fp8", *_tune(args, dtype, jax.jit(fp8.quantize_blocks), candidates,
                                    "fp8 ")


def _tune(args, dtype, weights, candidates, label):
    """(table, timings) over both GEMMs of each shape and each token count:
    weights(w f32) gives the GEMM's weights, candidates(m, E, N, K) the tiles
    to time and the rule's choice."""
    table, timings = {}, {}
    key = jax.random.PRNGKey(0)
    for name in args.shapes:
        h, i, e, k = SHAPES[name]
        for n, kk in ((2 * i, h), (h, i)):
            key, kw, kx, kr = jax.random.split(key, 4)
            w = weights(jax.random.normal(kw, (e, n, kk), jnp.float32) * kk**-0.5)
            tkey = tuning.table_key(e, n, kk, dtype)
            entries, per_m = [], {}
            for t in args.tokens:
                m = t * k
                tiles, rule = candidates(m, e, n, kk)
                if not tiles:
                    print(f"{name:16s} {label}{tkey:28s} M={m:6d} no candidate tile", flush=True)
                    continue
                x = jax.random.normal(kx, (m, kk), jnp.float32).astype(dtype)
                sizes = _sizes(kr, t, e, k)
                us = {tile: time_gemm(x, w, sizes, tile, args.calls, args.repeats)
                      for tile in tiles}
                best = best_tile(us, rule)
                entries.append([m, best])
                per_m[m] = us
                print(f"{name:16s} {label}{tkey:28s} M={m:6d} " +
                      " ".join(f"{tile}:{v:9.1f}" for tile, v in us.items()) +
                      f"  -> {best}", flush=True)
                del x
            if entries:
                table[tkey] = entries
                timings[tkey] = per_m
            del w
    return table, timings


if __name__ == "__main__":
    sys.exit(main())
