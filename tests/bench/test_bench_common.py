"""benchmarks/_bench_common.per_call_seconds: the slope between a long and a
short program cancels a fixed per-program cost. Program times are faked (a
program of n calls "takes" fixed + n * per seconds, with a different fixed
cost on every run) so that the test checks the arithmetic, not the clock."""

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

from common import ROOT


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


@pytest.mark.parametrize("dependent", [False, True], ids=["independent", "dependent"])
def test_after_keeps_every_call_routing(bench_common, dependent):
    # A chain of 12 layer calls whose logits rotate among 4 draws. Logits that
    # do not depend on the chain let XLA deduplicate the router and token
    # index to one call per draw; after() makes every call route.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_moe import ops
    calls, draws, experts = 12, 4, 8

    def layer(h, logits, w13, w2):
        weights, ids = ops.route(logits, 2)
        src_to_dst, dst_to_src, sizes = ops.moe_compute_token_index(ids, experts)
        return ops.moe_combine(ops.expert_mlp(h, w13, w2, sizes, dst_to_src, 2), weights,
                               src_to_dst)

    def run(x, lg, w13, w2):
        def body(i, h):
            logits = lg[i % draws]
            return layer(h, bench_common.after(logits, h) if dependent else logits, w13, w2)
        return bench_common.chain(body, calls, x)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    lg = jnp.asarray(rng.standard_normal((draws, 4, experts)), jnp.float32)
    w13 = jnp.asarray(rng.standard_normal((experts, 8, 16)) * 0.2, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((experts, 16, 4)) * 0.2, jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        hlo = jax.jit(run).lower(x, lg, w13, w2).compile().as_text()
        out = jax.jit(run)(x, lg, w13, w2)
    routers = hlo.count('custom_call_target="jax_moe_route"')
    assert routers == (calls if dependent else draws)
    h = x
    for i in range(calls):  # after() does not change the values
        h = layer(h, lg[i % draws], w13, w2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(h))


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_bench_moe_token_slices_give_the_same_layer(monkeypatch, backend):
    # bench_moe's fallback for a pure-JAX path that cannot compile the whole
    # batch: the layer on token slices (lax.map) must compute the same chain.
    import jax
    import jax.numpy as jnp
    import numpy as np
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    bench_moe = importlib.import_module("bench_moe")
    rng = np.random.default_rng(1)
    t, h, i, e, k = 8, 16, 8, 4, 2
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    lg = jnp.asarray(rng.standard_normal((3, t, e)), jnp.float32)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.2, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) * 0.2, jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        outs = [np.asarray(bench_moe.make_loop(backend, k, 5, {}, chunks)(x, lg, w13, w2, None))
                for chunks in (1, 2, 4)]
    assert np.abs(outs[0]).max() > 0
    for got in outs[1:]:
        np.testing.assert_allclose(got, outs[0], rtol=1e-5, atol=1e-6)


def test_bench_moe_chain_gives_every_call_x(monkeypatch):
    # Every call of bench_moe's chain takes the benchmark's rows x (the
    # previous output, fed back, would shrink to zeros: random weights, no
    # residual), waits for the previous call and routes on its own: the chain
    # ends with the layer of x under its last call's logits, and a program of
    # n calls holds n times one call's custom calls (none hoisted or shared).
    import jax
    import jax.numpy as jnp
    import numpy as np
    import jax_moe
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    bench_moe = importlib.import_module("bench_moe")
    rng = np.random.default_rng(2)
    t, h, i, e, k, draws, calls = 8, 16, 8, 4, 2, 3, 5
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    lg = jnp.asarray(rng.standard_normal((draws, t, e)), jnp.float32)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.2, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) * 0.2, jnp.float32)

    def kernels(n):
        hlo = bench_moe.make_loop("ffi", k, n, {}).lower(x, lg, w13, w2, None).compile().as_text()
        return hlo.count('custom_call_target="jax_moe_')

    with jax.default_device(jax.devices("cpu")[0]):
        out = bench_moe.make_loop("ffi", k, calls, {})(x, lg, w13, w2, None)
        want = jax_moe.moe_forward(x, lg[(calls - 1) % draws], w13, w2, k, backend="ffi")
        one, many = kernels(1), kernels(calls)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert np.abs(np.asarray(out)).max() > 0.1
    assert one > 0 and many == calls * one


@pytest.mark.parametrize("script, argv", [
    ("bench_moe", ["--ref-chunks", "0"]), ("bench_moe", ["--calls", "0"]),
    ("bench_moe", ["--ref-calls", "-1"]), ("bench_moe", ["--repeats", "0"]),
    ("bench_moe", ["--tokens", "16", "0"]), ("bench_moe", ["--shapes", "qwen3_30b"]),
    ("bench_attention", ["--calls", "0"]), ("bench_attention", ["--decode-splits", "512,x"]),
    ("bench_attention", ["--decode-splits", "0"]), ("bench_sharded", ["--device-counts", "0"]),
    ("bench_sharded", ["--tokens", "-4"])])
def test_benches_reject_bad_arguments(script, argv):
    # Refused by argparse (exit 2, the flag named) before any device work.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{script}.py"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert argv[0] in proc.stderr.splitlines()[-1]
    assert proc.stdout == ""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", None])
def test_random_weights_per_expert_draws(bench_common, dtype):
    # Shapes and dtypes as asked, N(0, scale²) values, experts drawn apart
    # (not one expert repeated); fp8 gives codes and one scale per 128 x 128
    # block that dequantise to the same spread. 9 experts: a batch of 8 and one.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_moe import fp8

    e, n, k, scale = 9, 200, 136, 0.05
    got = bench_common.random_weights(jax.random.PRNGKey(3), (e, n, k), scale,
                                      None if dtype is None else jnp.dtype(dtype))
    if dtype is None:
        codes, scales = got
        assert codes.dtype == jnp.float8_e4m3fn and codes.shape == (e, n, k)
        assert scales.dtype == jnp.float32 and scales.shape == (e, 2, 2)
        w = np.asarray(fp8.dequantize_blocks(codes, scales))
    else:
        assert got.dtype == jnp.dtype(dtype) and got.shape == (e, n, k)
        w = np.asarray(got, np.float32)
    assert abs(w.std() / scale - 1) < 0.02 and abs(w.mean()) < 0.01 * scale
    assert all(not np.array_equal(w[0], w[j]) for j in range(1, e))
    assert 0.9 < w[8].std() / scale < 1.1  # the last, partial batch is drawn too
