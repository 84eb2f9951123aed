"""GPU kernel time per kernel name from a jax.profiler trace (the scripts'
shared part): `device_time(fn, calls, trace_dir)` runs fn() (which must
block) under the profiler and prints, per device line (stream), the time per
call of each kernel, largest first, and the idle gaps between them."""
import collections
import glob
import gzip
import json
import re
import sys

import jax


def device_time(fn, calls: int, trace_dir: str, top: int = 15) -> None:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        fn()
    files = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not files:
        sys.exit(f"no perfetto trace under {trace_dir}")
    events = json.load(gzip.open(sorted(files)[-1]))
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    procs = {ev["pid"]: ev["args"].get("name", "") for ev in events
             if ev.get("ph") == "M" and ev.get("name") == "process_name"}
    gpu_pids = {pid for pid, pname in procs.items() if re.search(r"GPU|gpu|device", pname)
                and not re.search(r"[Hh]ost|CPU", pname)}
    threads = {(ev["pid"], ev["tid"]): ev["args"].get("name", "") for ev in events
               if ev.get("ph") == "M" and ev.get("name") == "thread_name"}
    # A device's lines: its streams (kernels, copies) and XLA's op and module
    # annotations over them; summed per line so that nothing counts twice.
    per_line = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    spans = collections.defaultdict(list)  # line -> [(start, end)] of its events
    for ev in events:
        if ev.get("ph") == "X" and ev.get("pid") in gpu_pids and "dur" in ev:
            line = threads.get((ev["pid"], ev.get("tid")), str(ev.get("tid")))
            rec = per_line[line][ev.get("name", "?")[:90]]
            rec[0] += float(ev["dur"])
            rec[1] += 1
            spans[line].append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
    for line, per_kernel in per_line.items():
        total = sum(v[0] for v in per_kernel.values())
        # Idle time between the line's events, first start to last end: the
        # gaps that wall time per call has and the kernel sum has not.
        iv = sorted(spans[line])
        gaps, end = [], iv[0][1]
        for a, b in iv[1:]:
            if a > end:
                gaps.append(a - end)
            end = max(end, b)
        print(f"-- {line}: {total / calls:.1f} µs per call busy; first to last "
              f"{(end - iv[0][0]) / calls:.1f} µs per call, idle gaps {sum(gaps) / calls:.1f} "
              f"µs per call ({len(gaps)} gaps, largest {max(gaps, default=0.0):.1f} µs)")
        for kname, (dur, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {dur / calls:9.1f} µs  x{n / calls:4.1f}  {kname}")
