"""Helpers shared by the test modules: dtypes, tolerances, random inputs,
the jitted reference ops, and the GEMM inputs of the group_gemm, expert_mlp
and moe_layer tests."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import fp8, reference

# The repository root (tests/ is one level below it).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]

# Tolerances, relative. Wherever two implementations are compared, both
# accumulate in f32 and round once to the output dtype, so they can differ by
# one unit in the last place of that dtype (a rounding flip), plus f32
# accumulation-order noise:
#   bf16: 8 significant bits, one ulp is 2^-8..2^-7 (3.9e-3..7.8e-3) of |x|  -> 1e-2
#   f16: 11 significant bits, one ulp is 2^-11..2^-10 (4.9e-4..9.8e-4)       -> 2e-3
#   f32: no final rounding gap, only summation order (~sqrt(K) * 2^-24)      -> 1e-5
# Per element we allow |a - b| <= rtol * (|b| + rms(b)), the rms over the rows
# of b that are not all zero: it absorbs results that are small only because
# of cancellation (a dot product of random signs near zero), whose absolute
# error scales with the operands, not with the result; rows that a GEMM left
# unplaced (zero) would only shrink it.
RTOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}


def rtol_for(dtype):
    return RTOL[jnp.dtype(dtype)]


def to_f64(a):
    return np.asarray(a).astype(np.float64)


# Half the spacing of the dtype's subnormals: how far a correctly rounded
# result below the smallest normal may be from the exact value, however small
# rtol is (f16's subnormals are 2^-24 apart, near the outputs of tests with
# tiny values; f32's and bf16's are far below any result here).
SUBNORMAL_HALF_ULP = {jnp.dtype(jnp.float32): 2.0**-150, jnp.dtype(jnp.bfloat16): 2.0**-134,
                      jnp.dtype(jnp.float16): 2.0**-25}


def assert_close(actual, desired, dtype, what="", rtol=None, atol=0.0):
    """Per-element comparison with the dtype's tolerance (see RTOL); `atol`
    (scalar or per element) is added to the bound, and so is half the
    dtype's subnormal spacing (SUBNORMAL_HALF_ULP)."""
    a, d = to_f64(actual), to_f64(desired)
    assert a.shape == d.shape, f"{what}: shape {a.shape} != {d.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values in the result"
    rtol = rtol_for(dtype) if rtol is None else rtol
    scale = 0.0  # the rms over the rows that hold anything (RTOL's comment)
    if d.size:
        rows = d.reshape(-1, d.shape[-1]) if d.ndim >= 2 else d.reshape(1, -1)
        held = rows[np.any(rows != 0, axis=1)]
        scale = np.sqrt(np.mean(held**2)) if held.size else 0.0
    err = np.abs(a - d)
    bound = rtol * (np.abs(d) + scale) + atol + SUBNORMAL_HALF_ULP[jnp.dtype(dtype)]
    bad = err > bound
    if np.any(bad):
        idx = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.size} elements differ beyond rtol={rtol}; "
            f"first at {idx}: got {a[idx]!r}, want {d[idx]!r} (max abs err {err.max():.3g}, "
            f"rms of desired {scale:.3g})")


def rel_err(actual, desired):
    """||a - b|| / ||b|| over the whole array (float64)."""
    a, d = to_f64(actual), to_f64(desired)
    return float(np.linalg.norm(a - d) / max(np.linalg.norm(d), 1e-30))


def assert_equal(actual, desired, what=""):
    """Exact equality (integers, or float copies), bit patterns for floats."""
    a, d = np.asarray(actual), np.asarray(desired)
    assert a.shape == d.shape, f"{what}: shape {a.shape} != {d.shape}"
    assert a.dtype == d.dtype, f"{what}: dtype {a.dtype} != {d.dtype}"
    if a.dtype.kind == "f" or a.dtype.name in ("bfloat16",):
        a = a.view(np.dtype(f"u{a.dtype.itemsize}"))
        d = d.view(np.dtype(f"u{d.dtype.itemsize}"))
    if not np.array_equal(a, d):
        bad = np.argwhere(a != d)
        raise AssertionError(
            f"{what}: {len(bad)}/{a.size} entries differ; first at {tuple(bad[0])}: "
            f"got {a[tuple(bad[0])]!r}, want {d[tuple(bad[0])]!r}")


def normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype=dtype)


def random_ids(rng, tokens, topk, num_experts, allowed=None):
    """(T, k) int32 ids, distinct within a row (as the router makes them), drawn
    only from `allowed` experts (default: all) with random preferences."""
    scores = rng.gumbel(size=(tokens, num_experts)) + rng.normal(size=num_experts)
    if allowed is not None:
        mask = np.zeros(num_experts, bool)
        mask[list(allowed)] = True
        assert mask.sum() >= topk
        scores = np.where(mask, scores, -np.inf)
    return np.argsort(-scores, axis=1, kind="stable")[:, :topk].astype(np.int32)


def routing_allowed(pattern, num_experts, topk, rng):
    """The experts a routing pattern may use (None: all of them)."""
    e = num_experts
    if pattern == "uniform":
        return None
    if pattern == "one_set":  # every token on the same k experts (k=1: one expert)
        return rng.choice(e, size=topk, replace=False)
    if pattern == "empty_edges":  # first, a middle and the last expert get nothing
        empty = {0, e // 2, e - 1}
        allowed = [i for i in range(e) if i not in empty]
        return allowed if len(allowed) >= topk else None
    raise ValueError(pattern)


def router_logits(rng, tokens, num_experts, dtype, allowed=None):
    """Random logits; experts outside `allowed` are pushed far down so they are
    never picked (as long as topk <= len(allowed))."""
    logits = rng.standard_normal((tokens, num_experts)) * 2.0
    if allowed is not None:
        mask = np.zeros(num_experts, bool)
        mask[list(allowed)] = True
        logits = np.where(mask, logits, logits - 40.0)
    return jnp.asarray(logits, dtype=dtype)


def split_rows(rng, rows, num_experts, pattern):
    """expert_sizes (E,) int32 for group_gemm: a random split of `rows` (or fewer)."""
    e = num_experts
    used = rows
    allowed = np.ones(e, bool)
    if pattern == "random":
        pass
    elif pattern == "partial":  # sum(sizes) < M: the tail rows must come out zero
        used = int(rng.integers(0, rows)) if rows > 0 else 0
    elif pattern == "empty_first":
        allowed[0] = False
    elif pattern == "empty_middle":
        allowed[e // 2] = False
    elif pattern == "empty_last":
        allowed[-1] = False
    elif pattern == "empty_first_middle_last":
        allowed[[0, e // 2, e - 1]] = False
    elif pattern == "all_in_one":
        allowed[:] = False
        allowed[rng.integers(e)] = True
    elif pattern == "none":
        used = 0
    else:
        raise ValueError(pattern)
    if not allowed.any():  # E too small for the pattern: fall back to all experts
        allowed[:] = True
    p = allowed / allowed.sum()
    return rng.multinomial(used, p).astype(np.int32)


# The reference ops, jitted once (their static arguments named), so that
# the many shapes of the grids cost one compile each instead of one per jnp op.
ref = type("ref", (), {})()
ref.topk_softmax = jax.jit(reference.topk_softmax, static_argnames=("topk", "renormalize"))
ref.moe_compute_token_index = jax.jit(
    reference.moe_compute_token_index,
    static_argnames=("num_experts", "start_expert", "num_local_experts"))
ref.moe_expand_input = jax.jit(reference.moe_expand_input, static_argnames=("topk",))
ref.group_gemm = jax.jit(reference.group_gemm)
ref.gated_activation = jax.jit(reference.gated_activation, static_argnames=("activation",))
ref.expert_mlp = jax.jit(reference.expert_mlp,
                         static_argnames=("topk", "activation", "is_gated", "tile_m"))
ref.moe_combine = jax.jit(reference.moe_combine)
ref.moe_layer = jax.jit(reference.moe_layer, static_argnames=(
    "topk", "scoring_func", "renormalize", "num_expert_group", "topk_group",
    "routed_scaling_factor", "activation", "is_gated", "tile_m"))


# ---- GEMM inputs (group_gemm, expert_mlp, moe_layer) ------------------------

def gemm_inputs(rng, shape, pattern, dtype):
    """x (M, K), w (E, N, K) and expert_sizes (a split of M by `pattern`) for
    shape (M, K, N, E)."""
    m, k, n, experts = shape
    x = normal(rng, (m, k), dtype)
    w = normal(rng, (experts, n, k), dtype, scale=1.0 / np.sqrt(k))
    return x, w, jnp.asarray(split_rows(rng, m, experts, pattern))


def gather_rows(rng, tokens, topk, experts, extra_invalid=True):
    """dst_to_src of a random routing, plus -1 and out-of-range entries."""
    ids = jnp.asarray(random_ids(rng, tokens, topk, experts))
    _, dst_to_src, sizes = ref.moe_compute_token_index(ids, num_experts=experts)
    d2s = np.asarray(dst_to_src).copy()
    if extra_invalid and d2s.size >= 3:
        d2s[rng.integers(d2s.size)] = -1
        d2s[rng.integers(d2s.size)] = tokens * topk      # one past the last valid entry
        d2s[rng.integers(d2s.size)] = -(1 << 30)
    return jnp.asarray(d2s), sizes


def mlp_weights(rng, experts, hidden, inter, dtype, gated=True):
    """w13 (E, 2I or I, H) and w2 (E, H, I), scaled to keep outputs O(1)."""
    up = 2 * inter if gated else inter
    return (normal(rng, (experts, up, hidden), dtype, scale=hidden**-0.5),
            normal(rng, (experts, hidden, inter), dtype, scale=inter**-0.5))


# expert_sizes outside the contract (for 64 rows, 4 experts): each GEMM path
# must clamp them as reference.py does.
BAD_SIZES = {"oversized_first": [90, 5, 0, 0], "negative": [5, -3, 70, 20],
             "negative_first_oversized_last": [-5, 10, 4, 100], "sum_past_m": [30, 30, 30, 30],
             "sum_past_int32": [3, 2**31 - 1, 5, 2**31 - 1]}


def on_cpu(fn, *args, **kwargs):
    """Runs fn with its array arguments on the CPU backend (the CPU FFI handlers)."""
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(a, cpu) if isinstance(a, (jax.Array, np.ndarray)) else a
            for a in args]
    with jax.default_device(cpu):
        out = fn(*args, **kwargs)
        return jax.block_until_ready(out)


def lax_ragged(lhs, rhs, sizes):
    """jax.lax.ragged_dot (rhs (G, K, N)) on sizes cut at M (its contract:
    they sum to at most M), f32 accumulation, rows past the groups zero (some
    backends leave them undefined): the oracle of jax_moe.ragged_dot."""
    m = lhs.shape[0]
    end = jnp.minimum(jnp.cumsum(sizes), m)
    cut = end - jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
    out = jax.lax.ragged_dot(lhs, rhs, cut, preferred_element_type=jnp.float32)
    rows = jnp.arange(m) < end[-1]
    return jnp.where(rows[:, None], out, 0).astype(lhs.dtype)


@functools.partial(jax.jit, static_argnames=("fn",))
def value_and_grads(fn, lhs, rhs, sizes, ct):
    """fn(lhs, rhs, sizes) and its gradients in lhs and rhs for the cotangent ct."""
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    return (out,) + vjp(ct)


def fp8_checkpoint(rng, experts, hidden, inter):
    """A DeepSeek-V3-layout FP8 MoE block as a state dict: the router (f32,
    scaled by 1/4) and the correction bias, each routed expert's projections
    quantised by jax_moe.fp8 (e4m3 ``weight`` beside its 128 x 128
    ``weight_scale_inv``), drawn with variance 1/fan_in."""
    sd = {"gate.weight": rng.standard_normal((experts, hidden)).astype(np.float32) / 4,
          "gate.e_score_correction_bias": rng.uniform(0, 0.3, experts).astype(np.float32)}
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            codes, scales = fp8.quantize_blocks(jnp.asarray(
                rng.standard_normal(shape) * shape[1] ** -0.5, jnp.float32))
            sd[f"experts.{e}.{proj}.weight"] = np.asarray(codes)
            sd[f"experts.{e}.{proj}.weight_scale_inv"] = np.asarray(scales)
    return sd
