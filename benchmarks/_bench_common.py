"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`,
so this sibling module is importable)."""

from __future__ import annotations

import json
import time


def wall_time(fn) -> float:
    """Seconds one call of fn takes (fn must block until the device is done)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def chain(body, calls: int, x):
    """x = body(i, x) for i in range(calls), unrolled in Python: inside jax.jit
    a straight-line program. lax.fori_loop would make an XLA while loop, whose
    GPU version checks its condition on the host every trip, a fixed cost per
    call that is not the work being timed. The calls still run back to back on
    the device, each on the previous one's output, with no host sync."""
    for i in range(calls):
        x = body(i, x)
    return x


def write_json(path, meta, rows) -> None:
    """{"meta": ..., "rows": [...]} to path; nothing when path is empty."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said once) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt
