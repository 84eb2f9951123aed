"""The fp8 grouped GEMM on the activation of the previous GEMM's rows (the fp8
layer's second GEMM): where Hopper's kernel runs (bf16, N a multiple of 8, K
of 16, more than the decode form's rows), its prep kernel applies the
activation as it quantises each row; elsewhere the activation op runs first.
Either way the bits of the activation op then the GEMM, the twin's values and
gradient, NaN and infinity kept in their row."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import normal, on_cpu, rel_err
from jax_moe import fp8, ops, reference, tuning
from jax_moe.ops._common import sds
from jax_moe.ops.group_gemm_fp8 import _group_gemm_fp8

# f32: the kernels' expf, erff and tanhf differ from XLA's by ulps, which can
# move an e4m3 rounding of the activation's output (up to 2^-4 of a value;
# up to 6e-4 over a case on an H100).
TOL = {jnp.float32: 2e-3, jnp.bfloat16: 1e-2}

# (m, n, k, sizes, tile_m): Hopper's 64-row tiles; its 128-row tiles with
# the 64-row tail launch (an expert of 64 rows, experts ending 64, 1 and 16
# rows past a whole tile); the tile rule on K = 144 (a last scale block of
# 16 channels, a warp's passes past K); rows past the groups (all but the
# last); the decode form's rows (at most 2 an expert); K not a multiple of 16
# (the portable kernel).
SHAPES = {"tma": (150, 200, 272, (20, 0, 110), 64),
          "tma_split": (530, 136, 272, (64, 0, 192, 129, 144), 128),
          "tma_rule": (400, 136, 144, (150, 0, 240), None),
          "skinny": (6, 200, 272, (3, 0, 2), None),
          "offgrid": (65, 65, 129, (20, 0, 45), None)}


def _case(rng, shape, dtype, gated, bad=False):
    m, n, k, sizes, tile = SHAPES[shape]
    h = np.array(normal(rng, (m, (2 if gated else 1) * k), jnp.float32, 2.0))
    if bad:  # a NaN in one row's gate, an infinity in another's up (or its only half)
        h[1, 3] = np.nan
        h[4, k + 2 if gated else 2] = np.inf
    w, ws = fp8.quantize_blocks(normal(rng, (len(sizes), n, k), jnp.float32, k**-0.5))
    return jnp.asarray(h, dtype), w, ws, jnp.asarray(sizes, jnp.int32), tile


def _split(h, w, ws, sizes, tile, activation, gated):
    act = ops.gated_activation if gated else ops.activation
    return _group_gemm_fp8(act(h, activation), w, ws, sizes, tile)


def _fused(h, w, ws, sizes, tile, activation, gated):
    return _group_gemm_fp8(h, w, ws, sizes, tile, activation=activation, gated=gated)


@pytest.mark.sanitize
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_equals_activation_then_gemm(rng, dtype, shape, activation, gated, bad):
    h, w, ws, sizes, tile = _case(rng, shape, dtype, gated, bad)
    args = (h, w, ws, sizes)
    fused = jax.jit(lambda *a: _fused(*a, tile, activation, gated))
    got = np.asarray(fused(*args), np.float64)
    split = np.asarray(jax.jit(lambda *a: _split(*a, tile, activation, gated))(*args), np.float64)
    np.testing.assert_array_equal(got, split)  # the same bits (NaN where NaN)
    want = np.asarray(on_cpu(lambda *a: reference._group_gemm_fp8(
        *a, activation=activation, gated=gated), *args), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    assert rel_err(got[fin], want[fin]) <= TOL[dtype]
    m = h.shape[0]
    owned = min(sum(max(int(s), 0) for s in np.asarray(sizes)), m)
    assert not np.any(got[owned:])  # rows past the groups
    if bad:  # the two bad rows are NaN, every other row finite
        assert np.all(np.isnan(got[[1, 4]]))
        assert np.all(np.isfinite(np.delete(got, [1, 4], axis=0)))
    np.testing.assert_array_equal(np.asarray(fused(*args), np.float64), got)


@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu_tanh", False)])
@pytest.mark.parametrize("shape", ["tma", "tma_split", "offgrid"])
def test_gradient_through_the_activation_matches_the_twin(rng, shape, activation, gated):
    h, w, ws, sizes, tile = _case(rng, shape, jnp.bfloat16, gated)
    cot = normal(rng, (h.shape[0], w.shape[1]), jnp.bfloat16)

    def grad(fn, h, w, ws, sizes, cot):
        def loss(h):
            out = fn(h, w, ws, sizes)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))
        return jax.jit(jax.grad(loss))(h)

    got = np.asarray(grad(lambda *a: _fused(*a, tile, activation, gated), h, w, ws, sizes, cot),
                     np.float64)
    split = np.asarray(grad(lambda *a: _split(*a, tile, activation, gated), h, w, ws, sizes, cot),
                       np.float64)
    np.testing.assert_array_equal(got, split)
    want = np.asarray(on_cpu(grad, lambda *a: reference._group_gemm_fp8(
        *a, activation=activation, gated=gated), h, w, ws, sizes, cot), np.float64)
    assert got.shape == want.shape == h.shape
    assert rel_err(got, want) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("shape", ["tma", "skinny", "offgrid"])
def test_activation_fused_only_where_the_hopper_kernel_runs(rng, shape):
    h, w, ws, sizes, tile = _case(rng, shape, jnp.bfloat16, True)
    text = jax.jit(lambda *a: _fused(*a, tile, "silu", True)).lower(h, w, ws, sizes).as_text()
    m, n, k = h.shape[0], w.shape[1], w.shape[2]
    hopper = (tuning.fp8_sm90_usable(n, k, h.dtype) and not tuning.fp8_decode_runs(
        tuning.group_gemm_fp8_tile_m(m, w.shape[0], n, k, h.dtype, tile), w.shape[0], k))
    assert len(re.findall(r"jax_moe_group_gemm_fp8\b", text)) == 1
    assert len(re.findall(r"jax_moe_activation\b", text)) == (0 if hopper else 1)
    if shape != "tma":
        assert not hopper  # the decode form and K % 16 != 0 never take it


def _ffi(h, w, ws, sizes, activation, gated):
    """The custom call with its attributes as given (no Python checks)."""
    call = jax.ffi.ffi_call("jax_moe_group_gemm_fp8",
                            (sds((h.shape[0], w.shape[1]), h.dtype), sds((0,), jnp.uint8)),
                            vmap_method="sequential")
    return call(h, w, ws, sizes, jnp.zeros((0,), jnp.int32), gather=False, topk=np.int64(1),
                tile_m=np.int64(0), activation=np.int64(activation), gated=gated)[0]


@pytest.mark.parametrize("case", ["cpu", "code", "minus_two", "width"])
def test_handler_refuses_what_it_cannot_run(rng, case):
    # On the CPU the handler runs no fused activation; on every platform it
    # refuses an unknown code and an x whose width is not 2K (gated).
    h, w, ws, sizes, _ = _case(rng, "tma", jnp.bfloat16, True)
    activation, gated, match = {"cpu": (0, True, "CUDA-only"),
                                "code": (3, True, "unknown activation code"),
                                "minus_two": (-2, True, "activation must be -1"),
                                "width": (0, True, r"\(M, 2K\)")}[case]
    if case == "width":
        h = h[:, :-16]
    with pytest.raises(Exception, match=match):
        on_cpu(_ffi, h, w, ws, sizes, activation, gated)
