"""benchmarks/bench_sharded.py --quick on the 8 CPU host devices: one row per
mesh factorisation of 8, strategy and tokens-per-device, plus the 1-device
baseline rows, all with positive times; with --train, the same for training
steps on 4 of the devices, for the meshes --tp picks. The expert-only forward
chain runs every call on its rows, with no collective."""

import json
import os
import subprocess
import sys

from common import ROOT

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]  # every ep x tp = 8 (tiny: E=8, I=32)
STRATEGIES = ["allgather", "all_to_all"]
TOKENS = [1, 16, 100]  # --quick's tokens per device


def run_quick(tmp_path, *extra, timeout=170):
    """bench_sharded.py --quick on 8 CPU host devices -> (its JSON, stdout)."""
    path = tmp_path / "bench_sharded.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # 8 host devices even on a GPU machine
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
    proc = subprocess.run([sys.executable, "benchmarks/bench_sharded.py", "--quick", *extra,
                           "--json", str(path)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(path.read_text()), proc.stdout


def test_bench_sharded_quick(tmp_path):
    data, stdout = run_quick(tmp_path)
    assert data["meta"]["devices"] == 8 and data["meta"]["quick"]
    rows = data["rows"]

    single = {r["tokens_per_device"]: r for r in rows if r["kind"] == "single"}
    assert sorted(single) == TOKENS
    sharded = {(r["ep"], r["tp"], r["strategy"], r["tokens_per_device"]): r
               for r in rows if r["kind"] == "sharded"}
    want = {(ep, tp, s, t) for ep, tp in MESHES for s in STRATEGIES for t in TOKENS}
    assert set(sharded) == want
    assert len(rows) == len(single) + len(want)  # no duplicates

    for (ep, tp, s, t), r in sharded.items():
        assert r["devices"] == 8 and r["tokens"] == 8 * t and r["mesh"] == f"{ep}x{tp}"
        assert r["total_us"] > 0 and r["expert_us"] > 0 and r["single_us"] > 0
        assert r["collective_us"] == r["total_us"] - r["expert_us"]
        assert r["single_us"] == single[t]["total_us"]
        assert r["scaling_efficiency"] > 0 and r["tokens_per_s"] > 0
    # the markdown table: a header and one line per row
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)
    assert "µs/layer" in table[0] and not data["meta"]["train"]


def test_bench_sharded_train_quick(tmp_path):
    data, stdout = run_quick(tmp_path, "--train", "--tokens", "16", "--device-counts", "4",
                             "--tp", "1", "4")
    assert data["meta"]["train"] and "training steps" in data["meta"]["method"]
    rows = data["rows"]
    single = [r for r in rows if r["kind"] == "single"]
    assert len(single) == 1 and single[0]["total_us"] > 0
    sharded = {(r["ep"], r["tp"], r["strategy"]): r for r in rows if r["kind"] == "sharded"}
    # --tp 1 4: the meshes 4x1 and 1x4 of the three factorisations of 4
    assert set(sharded) == {(ep, tp, s) for ep, tp in [(4, 1), (1, 4)] for s in STRATEGIES}
    for r in sharded.values():
        assert r["devices"] == 4 and r["tokens"] == 4 * 16
        assert r["total_us"] > 0 and r["expert_us"] > 0
        assert r["single_us"] == single[0]["total_us"]
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert "µs/step" in table[0] and len(table) == 1 + len(rows)


def test_expert_loop_runs_every_call_on_its_rows(monkeypatch):
    # The expert-only forward chain gives every call the post-dispatch rows xg
    # (fed back, a random-weight layer's output shrinks to zeros), makes its
    # logits wait for the previous output and compiles to no collective: with
    # R routings, call R repeats call 0's routing on xg, so a chain of R + 1
    # calls ends where one call does.
    import importlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_moe import parallel
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    bs = importlib.import_module("bench_sharded")
    h, i, e, k = bs.QUICK_SHAPES["tiny"]
    devices = jax.devices("cpu")[:8]
    a = bs.token_sets((h, i, e, k), devices, [16], jnp.float32, jax.random.PRNGKey(0))[16]
    mesh = Mesh(np.asarray(devices).reshape(4, 2), ("ep", "tp"))
    sh = parallel.moe_shardings(mesh)
    stacked = NamedSharding(mesh, P(None, ("ep", "tp"), None))
    w = bs.random_arrays(jax.random.PRNGKey(1), {
        "w13": ((e, 2, i, h), jnp.float32, h**-0.5, sh["w13"]),
        "w2": ((e, h, i), jnp.float32, i**-0.5, sh["w2"])})
    x, xg = bs.relabel(a["x"], sh["hidden_states"]), bs.relabel(a["xg"], sh["hidden_states"])
    logits = bs.relabel(a["logits"], stacked)
    args = (xg, logits, *[bs.relabel(r, stacked) for r in a["routing"]], w["w13"], w["w2"])
    plan = parallel._make_plan(x, jax.ShapeDtypeStruct(logits.shape[1:], logits.dtype),
                               w["w13"], w["w2"], k, mesh, "ep", "tp", True, "silu", None,
                               "ffi", "allgather")
    one = bs.expert_loop(plan, 1)
    many = bs.expert_loop(plan, logits.shape[0] + 1)
    np.testing.assert_array_equal(np.asarray(many(*args)), np.asarray(one(*args)))
    assert np.abs(np.asarray(one(*args))).max() > 0.1
    hlo = many.lower(*args).compile().as_text()
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter"):
        assert op not in hlo, op
