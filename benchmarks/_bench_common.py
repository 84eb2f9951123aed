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
