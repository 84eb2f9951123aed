"""ops.moe_decode (the routed layer for one token in one kernel) against its
twin reference.moe_decode: every kernel path, ties and NaN logits, what it
rejects. Runs on the default backend: the CPU handler here, the CUDA kernel
under JAX_PLATFORMS=cuda. moe_forward's use of it is in
layer/test_moe_forward.py, the contract on both backends in
test_conformance.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import DTYPE_IDS, assert_close, assert_equal, mlp_weights, normal, router_logits
from jax_moe import ops, reference

DTYPES = [jnp.bfloat16, jnp.float16]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS[1:])


# (H, I, E, topk, logits dtype, keywords). The kernel's paths: I / 256 = 1..4
# (its act-register templates); H below the 2048 the x registers hold;
# topk = E; one expert; topk = 6 (warps split unevenly over slots); E not a
# multiple of 32 (100); H = 2048 with I = 1024 and k = 8, whose w2 rows do not fit
# in an H200 block's shared memory at once (two passes); bf16 / f16 logits;
# renormalize off with a scale.
CASES = [
    (256, 256, 4, 2, jnp.float32, {}),
    (512, 512, 8, 8, jnp.float32, {}),
    (256, 768, 1, 1, jnp.float32, {}),
    (512, 512, 37, 6, jnp.bfloat16, {"renormalize": False, "routed_scaling_factor": 2.5}),
    (2048, 768, 16, 8, jnp.float32, {}),
    (2048, 1024, 8, 8, jnp.float16, {}),
    (512, 256, 100, 3, jnp.float32, {"routed_scaling_factor": 0.5}),
]
CASE_IDS = ["small", "topk_eq_E", "one_expert", "k6_E37_no_renorm", "qwen3_30b_like",
            "I1024_two_passes", "E100"]


@dtypes
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_moe_decode_matches_reference(rng, case, dtype):
    hidden, inter, experts, k, logit_dtype, kw = case
    x = normal(rng, (1, hidden), dtype)
    logits = router_logits(rng, 1, experts, logit_dtype)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, dtype)
    got = jax.jit(lambda *a: ops.moe_decode(*a, k, **kw))(x, logits, w13, w2)
    assert got.shape == (1, hidden) and got.dtype == dtype
    want = reference.moe_decode(x, logits, w13, w2, k, **kw)
    assert_close(got, want, dtype, "vs reference")
    assert np.any(np.asarray(got, np.float32) != 0.0)
    # The same bits run to run (fixed summation order everywhere).
    assert_equal(ops.moe_decode(x, logits, w13, w2, k, **kw), got, "rerun")


@pytest.mark.sanitize
@pytest.mark.parametrize("logits_kind", ["ties", "one_nan", "all_nan"])
def test_moe_decode_ties_and_nan_logits(rng, logits_kind):
    # Equal logits: the lowest ids win, as in the router. A NaN logit is
    # -inf, as in the router; a row of nothing but NaN gives NaN weights (a
    # softmax of nothing but -inf) while the picks stay valid experts (no read
    # out of bounds).
    hidden, inter, experts, k = 256, 256, 8, 3
    x = normal(rng, (1, hidden), jnp.bfloat16)
    w13, w2 = mlp_weights(rng, experts, hidden, inter, jnp.bfloat16)
    if logits_kind == "ties":
        logits = jnp.zeros((1, experts), jnp.float32).at[0, 5].set(1.0)
        got = ops.moe_decode(x, logits, w13, w2, k)
        assert_close(got, reference.moe_decode(x, logits, w13, w2, k), jnp.bfloat16, "ties")
        # The picks are 5, 0, 1: the same bits as when 0 and 1 win outright
        # (renormalised weights depend on the picked logits only).
        clear = jnp.full((1, experts), -1.0, jnp.float32).at[0, jnp.array([5, 0, 1])].set(
            jnp.array([1.0, 0.0, 0.0]))
        assert_equal(got, ops.moe_decode(x, clear, w13, w2, k), "ties to the lower ids")
    elif logits_kind == "one_nan":
        logits = router_logits(rng, 1, experts, jnp.float32).at[0, 2].set(10.0)
        got = ops.moe_decode(x, logits.at[0, 2].set(jnp.nan), w13, w2, k)
        assert_equal(got, ops.moe_decode(x, logits.at[0, 2].set(-jnp.inf), w13, w2, k),
                     "NaN is -inf")
        assert_close(got, reference.moe_decode(x, logits.at[0, 2].set(jnp.nan), w13, w2, k),
                     jnp.bfloat16, "NaN vs reference")
    else:
        logits = router_logits(rng, 1, experts, jnp.float32) * jnp.nan
        got = np.asarray(ops.moe_decode(x, logits, w13, w2, k), np.float32)
        assert got.shape == (1, hidden) and np.all(np.isnan(got))


def test_moe_decode_rejects_what_it_cannot_take():
    def sds(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    def call(x, logits, w13, w2, k, **kw):
        return jax.eval_shape(lambda *a: ops.moe_decode(*a, k, **kw), x, logits, w13, w2)

    def layer(hidden=256, inter=256, experts=4, tokens=1, dtype=jnp.bfloat16):
        return (sds((tokens, hidden), dtype), sds((tokens, experts), jnp.float32),
                sds((experts, 2 * inter, hidden), dtype), sds((experts, hidden, inter), dtype))

    assert ops.moe_decode_supported(*layer(), 2)
    bad = [
        (layer(tokens=2), 2, "one token"),
        (layer(dtype=jnp.float32), 2, "bfloat16 or float16"),
        (layer(hidden=200), 2, "H a multiple of 256"),
        (layer(hidden=2304), 2, "H a multiple of 256"),
        (layer(inter=128), 2, "I a multiple of 256"),
        (layer(inter=1280), 2, "I a multiple of 256"),
        (layer(experts=16), 9, "topk <= 8"),
        (layer(experts=1025), 2, "at most 1024 experts"),
    ]
    for args, k, msg in bad:
        assert not ops.moe_decode_supported(*args, k), msg
        for mod in (ops, reference):
            with pytest.raises(ValueError, match=msg):
                if mod is ops:
                    call(*args, k)
                else:
                    jax.eval_shape(lambda *a: reference.moe_decode(*a, k), *args)
    x, logits, w13, w2 = layer()
    with pytest.raises(ValueError, match="w2 must be"):
        call(x, logits, w13, sds((4, 256, 512)), 2)
    with pytest.raises(ValueError, match="topk"):
        call(x, logits, w13, w2, 5)
    with pytest.raises(TypeError, match="routed_scaling_factor"):
        call(x, logits, w13, w2, 2, routed_scaling_factor=None)
