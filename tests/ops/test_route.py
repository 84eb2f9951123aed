"""Step 1, the router: ops.topk_softmax and ops.route (one FFI call each)
against reference.route and the numpy oracle, and both against a plain numpy
DeepSeek-V3 router written from its published definition
(oracle.deepseek_v3_route).

Scoring (softmax / sigmoid) x correction bias x group-limited top-k x
renormalize x routed_scaling_factor; ties, signed zeros, masked and NaN
logits, T = 0 and 1, every logits dtype, jit and vmap. Ids must match
exactly; weights to f32 rounding. The argument errors are in test_errors.py,
the contract on both backends at the edges in test_conformance.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, on_cpu, ref
from jax_moe import ops, reference

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


# ------------------------------------------------------------- topk_softmax

TOPK_SHAPES = [  # (T, E, k)
    (1, 1, 1),      # one token, one expert
    (1, 8, 8),      # topk = E
    (5, 8, 1),
    (33, 8, 2),
    (130, 64, 6),
    (257, 13, 13),  # odd E, topk = E
    (64, 160, 8),
    (32, 256, 8),
    (8, 1000, 10),
    (3, 100, 100),  # topk = E > 32: each lane of the CUDA warp holds several picks
    (4, 3072, 40),  # the most experts the CUDA router takes, k > 32
]


@dtypes
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", TOPK_SHAPES, ids=str)
def test_topk_softmax(rng, shape, dtype, renormalize):
    tokens, experts, k = shape
    logits = normal(rng, (tokens, experts), dtype, scale=2.0)
    weights, ids = ops.topk_softmax(logits, k, renormalize)
    assert weights.shape == (tokens, k) and weights.dtype == jnp.float32
    assert ids.shape == (tokens, k) and ids.dtype == jnp.int32

    ref_w, ref_ids = ref.topk_softmax(logits, k, renormalize)
    np_w, np_ids = oracle.topk_softmax(logits, k, renormalize)
    # Low-precision logits can tie; both sides break ties to the lower id, so ids match exactly.
    assert_equal(ids, ref_ids, "ids vs reference")
    assert_equal(ids, np_ids, "ids vs numpy oracle")
    # The weights are f32 whatever the logits' dtype (bf16/f16 logits convert exactly).
    assert_close(weights, ref_w, jnp.float32, "weights vs reference")
    assert_close(weights, np_w, jnp.float32, "weights vs numpy oracle")
    if renormalize:
        np.testing.assert_allclose(np.asarray(weights).sum(axis=1), 1.0, rtol=1e-5)


@dtypes
def test_topk_with_many_ties_matches_stable_sort(rng, dtype):
    # Integer logits from a small range: most rows have ties at the k-th place.
    logits = jnp.asarray(rng.integers(-2, 3, size=(300, 16)), dtype)
    np_w, np_ids = oracle.topk_softmax(logits, 5, True)
    for fn in (ops.topk_softmax, ref.topk_softmax):
        weights, ids = fn(logits, 5, True)
        assert_equal(ids, np_ids, f"{fn}: ids vs stable argsort")
        assert_close(weights, np_w, jnp.float32, f"{fn}: weights")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_topk_softmax_many_tokens(rng, dtype):
    tokens, experts, k = 20_000, 16, 4  # T*k = 80,000 > 65,536
    logits = normal(rng, (tokens, experts), dtype, scale=2.0)
    weights, ids = ops.topk_softmax(logits, k)
    np_w, np_ids = oracle.topk_softmax(logits, k)
    assert_equal(ids, np_ids, "ids")
    assert_close(weights, np_w, jnp.float32, "weights")


@dtypes
def test_topk_large_logits(rng, dtype):
    # |logits| up to ~4000: the softmax must subtract the row max (no overflow).
    logits = normal(rng, (64, 16), dtype, scale=1000.0)
    weights, ids = ops.topk_softmax(logits, 4, False)
    np_w, np_ids = oracle.topk_softmax(logits, 4, False)
    assert_equal(ids, np_ids, "ids")
    assert_close(weights, np_w, jnp.float32, "weights")


def test_vmap_nested_topk(rng):
    logits = normal(rng, (2, 3, 10, 8), jnp.float32)
    fn = functools.partial(ops.topk_softmax, topk=3)
    weights, ids = jax.vmap(jax.vmap(fn))(logits)
    for a in range(2):
        for b in range(3):
            w, i = fn(logits[a, b])
            assert_equal(ids[a, b], i)
            assert_close(weights[a, b], w, jnp.float32)


# ------------------------------------------------------------- route

STATIC = ("topk", "scoring_func", "renormalize", "num_expert_group", "topk_group",
          "routed_scaling_factor")
# One compile per static configuration (jnp op by op would be slow).
ref_route = jax.jit(reference.route, static_argnames=STATIC)
ops_route = jax.jit(ops.route, static_argnames=STATIC)


def bias_for(rng, experts, scale=0.1, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(experts) * scale, dtype)


# Random logits meet a rounding hazard that is not a bug: when two choice
# values (or two group scores) differ by an ulp or so, the last bit of exp,
# which differs between the CUDA kernel, XLA and numpy, decides the pick.
# Random tests therefore draw rows whose decisions all have a clear margin, or
# exact ties (equal inputs, decided by the lower id everywhere); the tie tests
# make ties on purpose.
MARGIN = 1e-5


def _decisive_rows(logits, k, scoring_func="softmax", e_score_correction_bias=None,
                   num_expert_group=None, topk_group=None, **_):
    """(rows,) bool: each decision of the row (the topk_group-th group against
    the next, the k-th eligible expert against the next) has a float64 margin
    of 0 (an exact tie) or more than MARGIN relative to the larger value."""
    x = np.asarray(logits).astype(np.float64).reshape(-1, np.shape(logits)[-1])
    experts = x.shape[1]
    bias, groups = e_score_correction_bias, num_expert_group or 1
    if bias is None and groups == 1:  # the choice is on the logits themselves: exact
        return np.ones(len(x), bool)
    if scoring_func == "softmax":
        z = np.exp(x - x.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-x))
    choice = scores if bias is None else scores + np.asarray(bias).astype(np.float64)

    def clear(sorted_desc, i):  # margin between entries i - 1 and i of each row
        if i >= sorted_desc.shape[1]:
            return np.ones(len(sorted_desc), bool)
        gap = sorted_desc[:, i - 1] - sorted_desc[:, i]
        return (gap == 0) | (gap > MARGIN * np.abs(sorted_desc[:, i - 1]))

    ok = np.ones(len(x), bool)
    if groups > 1:
        per = experts // groups
        grouped = -np.sort(-choice.reshape(len(x), groups, per), axis=2)
        group_score = grouped[:, :, :min(2, per)].sum(axis=2)
        order = np.argsort(-group_score, axis=1, kind="stable")
        ok &= clear(np.take_along_axis(group_score, order, axis=1), topk_group)
        keep = np.zeros((len(x), groups), bool)
        np.put_along_axis(keep, order[:, :topk_group], True, axis=1)
        choice = np.where(np.repeat(keep, per, axis=1), choice, -np.inf)
    return ok & clear(-np.sort(-choice, axis=1), k)


def decisive_logits(rng, shape, dtype, k, scale=2.0, **route_kw):
    """normal(rng, shape, dtype, scale) with every row redrawn until its
    routing decisions are clear (_decisive_rows)."""
    x = np.array(normal(rng, shape, dtype, scale)).reshape(-1, shape[-1])  # a writable copy
    for _ in range(100):
        bad = ~_decisive_rows(x, k, **route_kw)
        if not bad.any():
            return jnp.asarray(x.reshape(shape), dtype)
        x[bad] = np.asarray(normal(rng, (int(bad.sum()), shape[-1]), dtype, scale))
    raise AssertionError("could not draw logits with clear routing decisions")


def test_decisive_rows_flags_near_ties_only():
    # Row 0: groups {0, 1} score 1e-9 apart (a near tie, redrawn); row 1: an
    # exact tie from equal logits (kept: every implementation picks the
    # lower id); row 2: clear margins.
    logits = np.array([[1.0, 0.5, 1.0 + 1e-9, 0.5],
                       [1.0, 0.5, 1.0, 0.5],
                       [2.0, 0.5, 1.0, 0.25]])
    kw = dict(scoring_func="sigmoid", num_expert_group=2, topk_group=1)
    assert _decisive_rows(logits, 2, **kw).tolist() == [False, True, True]
    # Without bias or groups the choice is on the logits: nothing to round.
    assert _decisive_rows(logits, 1, scoring_func="sigmoid").all()


def check(logits, k, what="", **kw):
    """ops.route (eager and jitted) == reference.route: ids exactly, weights to f32 rounding."""
    weights, ids = ops.route(logits, k, **kw)
    tokens = logits.shape[0]
    assert weights.shape == (tokens, k) and weights.dtype == jnp.float32
    assert ids.shape == (tokens, k) and ids.dtype == jnp.int32
    ref_w, ref_ids = ref_route(logits, k, **kw)
    assert_equal(ids, ref_ids, f"{what} ids vs reference")
    assert_close(weights, ref_w, jnp.float32, f"{what} weights vs reference")
    jit_w, jit_ids = ops_route(logits, k, **kw)
    assert_equal(jit_ids, ids, f"{what} jit ids")
    assert_equal(jit_w, weights, f"{what} jit weights")
    return weights, ids


# ------------------------------------------------------------- the full grid

CONFIGS = {  # id: (T, E, k, num_expert_group, topk_group) for the grouped runs
    "deepseek_v3": (64, 256, 8, 8, 4),
    "small": (33, 8, 3, 4, 2),
}


@pytest.mark.parametrize("renormalize,scale", [(True, 1.0), (False, 2.5), (True, 2.5)],
                         ids=["renorm", "scaled", "renorm_scaled"])
@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "grouped"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_route_matches_reference(rng, config, scoring, with_bias, grouped, renormalize, scale):
    tokens, experts, k, groups, tg = CONFIGS[config]
    kw = dict(scoring_func=scoring, renormalize=renormalize, routed_scaling_factor=scale)
    if with_bias:
        kw["e_score_correction_bias"] = bias_for(rng, experts)
    if grouped:
        kw.update(num_expert_group=groups, topk_group=tg)
    logits = decisive_logits(rng, (tokens, experts), jnp.float32, k, **kw)
    weights, ids = check(logits, k, config, **kw)
    ids = np.asarray(ids)
    assert np.all((ids >= 0) & (ids < experts))
    assert all(len(set(row)) == k for row in ids.tolist()), "ids distinct within a row"
    if grouped:
        per = experts // groups
        assert all(len(set(g)) <= tg for g in (ids // per).tolist()), "at most topk_group groups"
    if renormalize:
        np.testing.assert_allclose(np.asarray(weights).sum(axis=1), scale, rtol=1e-5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["deepseek", "qwen"])
def test_route_logit_dtypes(rng, kind, dtype):
    # bf16/f16 logits convert exactly; many of them are equal (ties).
    if kind == "deepseek":
        kw = dict(scoring_func="sigmoid", num_expert_group=8, topk_group=3,
                  e_score_correction_bias=bias_for(rng, 64, dtype=dtype),
                  routed_scaling_factor=2.5)
    else:
        kw = dict(scoring_func="softmax", renormalize=False)
    check(decisive_logits(rng, (48, 64), dtype, 6, **kw), 6, kind, **kw)


# ------------------------------------------------------ small groups, edges

@pytest.mark.parametrize("groups,tg,k", [
    (4, 1, 2),   # k = topk_group * per: the one kept group, whole
    (4, 4, 8),   # every group kept, k = E
    (4, 2, 4),   # k = topk_group * per
    (8, 3, 3),   # one expert per group: the group score is its one choice value
    (2, 1, 4),   # half the experts
    (1, 1, 5),   # num_expert_group=1: not group-limited
])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_small_groups(rng, scoring, with_bias, groups, tg, k):
    experts = 8
    kw = dict(scoring_func=scoring, num_expert_group=groups, topk_group=tg)
    if with_bias:
        kw["e_score_correction_bias"] = bias_for(rng, experts, scale=0.3)
    _, ids = check(decisive_logits(rng, (40, experts), jnp.float32, k, **kw), k, **kw)
    per = experts // groups
    assert all(len(set(g)) <= tg for g in (np.asarray(ids) // per).tolist())


@pytest.mark.sanitize
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_small_grouped_bias(rng, scoring):
    kw = dict(scoring_func=scoring, num_expert_group=4, topk_group=2,
              e_score_correction_bias=bias_for(rng, 8), routed_scaling_factor=1.5)
    check(decisive_logits(rng, (5, 8), jnp.float32, 4, **kw), 4, **kw)


@pytest.mark.sanitize
def test_route_largest_shared_layout(rng):
    # 3072 experts in 3072 groups with k = 3072: the CUDA router's per-warp
    # keys, group keys and picks at their largest (one warp per block).
    # Logits a permutation of evenly spaced values: every pick is clear.
    kw = dict(scoring_func="sigmoid", num_expert_group=3072, topk_group=3072)
    grid = np.linspace(-3.0, 3.0, 3072, dtype=np.float32)
    logits = jnp.asarray(np.stack([rng.permutation(grid) for _ in range(2)]))
    _, ids = check(logits, 3072, **kw)
    assert all(sorted(r) == list(range(3072)) for r in np.asarray(ids).tolist())


@pytest.mark.sanitize
@pytest.mark.parametrize("tokens", [0, 1])
def test_route_one_and_no_tokens(rng, tokens):
    kw = dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4,
              e_score_correction_bias=bias_for(rng, 256), routed_scaling_factor=2.5)
    check(decisive_logits(rng, (tokens, 256), jnp.float32, 8, scale=1.0, **kw), 8, **kw)
    check(normal(rng, (tokens, 16), jnp.bfloat16), 4)


def test_topk_softmax_is_route_softmax(rng):
    logits = normal(rng, (20, 16), jnp.bfloat16, scale=2.0)
    for renormalize in (True, False):
        w, i = ops.topk_softmax(logits, 4, renormalize)
        rw, ri = ops.route(logits, 4, renormalize=renormalize)
        assert_equal(i, ri)
        assert_equal(w, rw)


# ----------------------------------------------------------------- ties

@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "grouped"])
def test_route_ties(rng, grouped, scoring, with_bias):
    # Small integer logits and quarter biases: most rows tie at the k-th
    # expert and between groups; ties go to the lower expert / group. Equal
    # choice values must come from equal (logit, bias) pairs only, computed
    # the same way everywhere; a tie in exact arithmetic between different
    # terms would be decided by exp's last bit, which differs between
    # implementations. Hence logits >= 0 (sigmoid(x) + sigmoid(-x) ==
    # 2 * sigmoid(0)), and with groups one bias per group: (s0 + b) + (s1 + c)
    # and (s1 + b) + (s0 + c) are equal sums that round differently.
    logits = jnp.asarray(rng.integers(0, 4, size=(200, 16)), jnp.float32)
    kw = dict(scoring_func=scoring)
    if with_bias:
        bias = rng.integers(-2, 3, size=4 if grouped else 16) / 4
        kw["e_score_correction_bias"] = jnp.asarray(np.repeat(bias, 16 // bias.size), jnp.float32)
    if grouped:
        kw.update(num_expert_group=4, topk_group=2)
    check(logits, 5, **kw)


@pytest.mark.parametrize("kw", [
    {}, dict(scoring_func="sigmoid"),
    dict(e_score_correction_bias=jnp.zeros(16)),
    dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2),
    dict(num_expert_group=16, topk_group=3, e_score_correction_bias=jnp.zeros(16)),
], ids=["softmax", "sigmoid", "zero_bias", "sigmoid_grouped", "per1_grouped"])
def test_route_all_equal_logits_pick_lowest_ids(rng, kw):
    value = rng.standard_normal((9, 1))
    logits = jnp.asarray(np.broadcast_to(value, (9, 16)), jnp.float32)
    _, ids = check(logits, 3, **kw)
    assert_equal(ids, np.broadcast_to(np.arange(3, dtype=np.int32), (9, 3)))


def test_route_signed_zeros_order_as_top_k():
    # lax.top_k orders -0 below +0 (a total order): the kernels do too.
    logits = jnp.asarray([[-0.0, 0.0, -0.0, 0.0, -1.0]] * 3, jnp.float32)
    _, ids = check(logits, 3)
    assert_equal(ids, np.broadcast_to(np.asarray([1, 3, 0], np.int32), (3, 3)))


# ------------------------------------------------------ masked / NaN logits

@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_masked_and_nan_logits(rng, scoring):
    # -inf and NaN logits (NaN is -inf to the router) with bias and groups.
    logits = rng.standard_normal((60, 16)).astype(np.float32) * 2
    at = rng.random((60, 16))
    logits[at < 0.2] = -np.inf
    logits[at > 0.85] = np.nan
    logits[:, 0] = rng.standard_normal(60)  # at least one finite logit a row
    check(jnp.asarray(logits), 4, scoring_func=scoring, num_expert_group=4, topk_group=2,
          e_score_correction_bias=bias_for(rng, 16))
    check(jnp.asarray(logits), 2, scoring_func=scoring)


def test_route_all_masked_softmax_row(rng, on_gpu):
    # A softmax row of nothing but -inf has NaN scores: the weights are NaN,
    # the ids still distinct and in range. On the CPU the choice order equals
    # reference.route's there too (NaN choice values rank below -inf).
    logits = normal(rng, (6, 16), jnp.float32)
    logits = logits.at[2].set(-jnp.inf).at[4].set(jnp.nan)
    kw = dict(num_expert_group=4, topk_group=2, e_score_correction_bias=bias_for(rng, 16))
    weights, ids = ops.route(logits, 5, **kw)
    ids = np.asarray(ids)
    assert np.all((ids >= 0) & (ids < 16)) and all(len(set(r)) == 5 for r in ids.tolist())
    assert np.all(np.isnan(np.asarray(weights)[[2, 4]]))
    ok = np.ones(6, bool)
    ok[[2, 4]] = False
    ref_w, ref_ids = ref_route(logits, 5, **kw)
    assert_equal(ids[ok], np.asarray(ref_ids)[ok])
    assert_close(np.asarray(weights)[ok], np.asarray(ref_w)[ok], jnp.float32)
    if not on_gpu:
        assert_equal(ids, ref_ids, "degenerate rows, CPU")


# --------------------------------------- DeepSeek-V3, from its definition

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_route_matches_deepseek_v3_definition(rng, dtype):
    tokens, experts, k, n_group, topk_group, scale = 32, 256, 8, 8, 4, 2.5
    bias = bias_for(rng, experts)
    logits = decisive_logits(rng, (tokens, experts), dtype, k, scoring_func="sigmoid",
                             e_score_correction_bias=bias, num_expert_group=n_group,
                             topk_group=topk_group)
    np_w, np_ids = oracle.deepseek_v3_route(logits, bias, k, n_group, topk_group, scale)
    for name, fn in (("ops", ops.route), ("reference", ref_route)):
        weights, ids = fn(logits, k, scoring_func="sigmoid", num_expert_group=n_group,
                          topk_group=topk_group, e_score_correction_bias=bias,
                          routed_scaling_factor=scale)
        assert_equal(ids, np_ids, f"{name}: ids vs the DeepSeek-V3 definition")
        assert_close(weights, np_w, jnp.float32, f"{name}: weights", rtol=1e-6)


# ------------------------------------------------------------------ vmap

@pytest.mark.sanitize
@pytest.mark.parametrize("bias_axis", [None, 0, "none"], ids=["shared_bias", "batched_bias", "no_bias"])
def test_route_vmap_matches_loop(rng, bias_axis):
    batch, tokens, experts, k = 3, 7, 16, 4
    bias = bias_for(rng, experts, scale=0.3)
    if bias_axis == 0:
        bias = jnp.stack([bias_for(rng, experts, scale=0.3) for _ in range(batch)])
    kw = dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.0)

    def bias_of(b):  # the bias batch element b routes with
        return None if bias_axis == "none" else bias if bias_axis is None else bias[b]

    logits = jnp.stack([decisive_logits(rng, (tokens, experts), jnp.float32, k, **kw,
                                        e_score_correction_bias=bias_of(b))
                        for b in range(batch)])
    if bias_axis == "none":
        fn = lambda x: ops.route(x, k, **kw)  # noqa: E731
        got = jax.vmap(fn)(logits)
        want = [fn(logits[b]) for b in range(batch)]
    else:
        fn = lambda x, b: ops.route(x, k, e_score_correction_bias=b, **kw)  # noqa: E731
        got = jax.jit(jax.vmap(fn, in_axes=(0, bias_axis)))(logits, bias)
        want = [fn(logits[b], bias if bias_axis is None else bias[b]) for b in range(batch)]
    for b in range(batch):
        assert_equal(got[1][b], want[b][1], f"ids, batch element {b}")
        assert_close(got[0][b], want[b][0], jnp.float32, f"weights, batch element {b}")
        ref_w, ref_ids = reference.route(logits[b], k, e_score_correction_bias=bias_of(b), **kw)
        assert_equal(got[1][b], ref_ids, f"ids vs reference, batch element {b}")


def test_route_nested_vmap_with_bias(rng):
    logits = normal(rng, (2, 3, 5, 32), jnp.bfloat16, scale=2.0)
    bias = jnp.stack([bias_for(rng, 32) for _ in range(2)])  # per outer element
    fn = lambda x, b: ops.route(x, 6, scoring_func="softmax", num_expert_group=8,  # noqa: E731
                                topk_group=3, e_score_correction_bias=b)
    weights, ids = jax.vmap(lambda xs, b: jax.vmap(lambda x: fn(x, b))(xs))(logits, bias)
    for a in range(2):
        for b in range(3):
            w, i = fn(logits[a, b], bias[a])
            assert_equal(ids[a, b], i)
            assert_close(weights[a, b], w, jnp.float32)


def test_route_vmap_no_tokens(rng):
    fn = lambda x, b: ops.route(x, 2, e_score_correction_bias=b)  # noqa: E731
    w, i = jax.vmap(fn, in_axes=(0, None))(jnp.zeros((3, 0, 8)), bias_for(rng, 8))
    assert w.shape == (3, 0, 2) and i.shape == (3, 0, 2)


# ------------------------------------------------------- GPU against CPU

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["deepseek", "qwen_bf16"])
def test_route_cuda_matches_cpu(rng, kind):
    if kind == "deepseek":
        bias = bias_for(rng, 256)
        kw = dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)
        k = 8
        logits = decisive_logits(rng, (300, 256), jnp.float32, k, e_score_correction_bias=bias, **kw)
    else:
        logits = normal(rng, (300, 128), jnp.bfloat16, scale=2.0)
        bias, kw, k = None, dict(renormalize=True), 8

    def fn(x, b):
        return ops.route(x, k, e_score_correction_bias=b, **kw)

    got_w, got_ids = jax.block_until_ready(fn(logits, bias))
    assert got_ids.devices() == {jax.devices()[0]}, "the op did not run on the GPU"
    want_w, want_ids = on_cpu(fn, logits, bias)
    assert_equal(np.asarray(got_ids), np.asarray(want_ids), "ids, CUDA vs CPU")
    assert_close(np.asarray(got_w), np.asarray(want_w), jnp.float32, "weights, CUDA vs CPU")
