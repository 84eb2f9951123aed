"""benchmarks/_bench_common.per_call_seconds: the slope between a long and a
short program cancels a fixed per-program cost. Program times are faked (a
program of n calls "takes" fixed + n * per seconds, with a different fixed
cost on every run) so that the test checks the arithmetic, not the clock."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def bench_common(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "_bench_common", os.path.join(ROOT, "benchmarks", "_bench_common.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "wall_time", lambda run: run())  # run() returns its fake time
    return mod


def fake_program(fixed, per, built):
    def program(n):
        built.append(n)
        runs = iter(range(100))
        # the median over the repeats sees the fixed cost drift by up to 20%
        return lambda: fixed * (1 + 0.1 * (next(runs) % 3 - 1)) + n * per
    return program


@pytest.mark.parametrize("calls,short", [(100, 20), (20, 4), (5, 1)])
def test_slope_cancels_fixed_cost(bench_common, calls, short):
    built = []
    sec = bench_common.per_call_seconds(fake_program(5e-4, 2.7e-4, built), calls, repeats=3)
    assert sec == pytest.approx(2.7e-4, rel=1e-9)
    assert built == [calls, short]


@pytest.mark.parametrize("calls", [1, 2, 4])
def test_few_calls_time_one_program(bench_common, calls):
    built = []
    sec = bench_common.per_call_seconds(fake_program(5e-4, 2.7e-4, built), calls, repeats=3)
    assert sec == pytest.approx((5e-4 + calls * 2.7e-4) / calls, rel=1e-9)  # fixed cost included
    assert built == [calls]
