"""benchmarks/bench_sharded.py --quick on the 8 CPU host devices: one row per
mesh factorisation of 8, strategy and tokens-per-device, plus the 1-device
baseline rows, all with positive times."""

import json
import os
import subprocess
import sys

from common import ROOT

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]  # every ep x tp = 8 (tiny: E=8, I=32)
STRATEGIES = ["allgather", "all_to_all"]
TOKENS = [1, 16, 100]  # --quick's tokens per device


def test_bench_sharded_quick(tmp_path):
    path = tmp_path / "bench_sharded.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # 8 host devices even on a GPU machine
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
    proc = subprocess.run([sys.executable, "benchmarks/bench_sharded.py", "--quick", "--json",
                           str(path)], capture_output=True, text=True, timeout=170, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(path.read_text())
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
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)
