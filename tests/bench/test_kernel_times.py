"""tools/kernel_times.py's reading of a trace, on synthetic events: only the
GPU streams' kernels count (not the host, not XLA's module and op lines),
a kernel that starts inside the previous one on its stream (PDL) counts
from that one's end, and a stream's idle time is charged to the kernel
after it; each call's span runs from one start of the chain's first kernel
to the next."""

import importlib.util
import os

import pytest

from common import ROOT


@pytest.fixture(scope="module")
def kt():
    spec = importlib.util.spec_from_file_location(
        "kernel_times", os.path.join(ROOT, "tools", "kernel_times.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_only_the_gpu_streams_count(kt):
    trace = {"traceEvents": [
        _meta(1, "/host:CPU"), _meta(1, "python3", 10),
        _meta(2, "/device:GPU:0"), _meta(2, "Stream #13(Compute)", 20),
        _meta(2, "XLA Modules", 21),
        _x(1, 10, "host work", 0, 50), _x(2, 20, "gemm", 0, 40), _x(2, 21, "jit_run", 0, 100)]}
    assert [e["name"] for e in kt.gpu_kernel_events(trace)] == ["gemm"]


def test_overlapping_launches_count_once(kt):
    events = [_x(2, 20, "gemm", 0, 40),
              _x(2, 20, "act", 10, 35),      # launched early: waits until 40, ends at 45
              _x(2, 20, "combine", 50, 5),   # after a gap of 5
              _x(2, 20, "gemm", 60, 40),
              _x(2, 21, "copy", 0, 7)]       # another stream: its own timeline
    total, count, idle = kt.kernel_times(events)
    assert total == {"gemm": 80.0, "act": 5.0, "combine": 5.0, "copy": 7.0}
    assert count == {"gemm": 2, "act": 1, "combine": 1, "copy": 1}
    # combine waited 5 after act's end (45 -> 50), the second gemm 5 after
    # combine's (55 -> 60); the early-launched act and the other stream none
    assert idle == {"gemm": 5.0, "act": 0.0, "combine": 5.0, "copy": 0.0}


def test_call_spans(kt):
    events = [_x(2, 20, "route", 0, 5), _x(2, 20, "gemm", 5, 40),
              _x(2, 20, "route", 50, 5), _x(2, 20, "gemm", 55, 60)]
    assert kt.call_spans(events, 2) == [50.0, 65.0]
    assert kt.call_spans(events, 3) is None  # the first kernel does not run once a call
    assert kt.call_spans([], 1) is None


def test_long_names_that_share_a_head_keep_where_they_differ(kt):
    head = "_ZN7cutlass13device_kernel" + "x" * 200
    wide, narrow = head + "Li128EE_Cooperative" + "y" * 50, head + "Li64EE_Pingpong" + "y" * 50
    alone, short = "z" * 300, "copy"
    labels = kt.short_names([wide, narrow, alone, short], width=100)
    assert labels[short] == "copy"
    assert labels[alone] == "z" * 100
    assert labels[wide] != labels[narrow]
    assert "Li128EE_Cooperative" in labels[wide] and "Li64EE_Pingpong" in labels[narrow]
    assert labels[wide].startswith("_ZN7cutlass13device_kernel")
    assert all(len(v) <= 100 for v in labels.values())
