"""Property tests of moe_forward_sharded on the 8 host devices of
tests/conftest.py (or 8 GPUs) against moe_forward on one device: random
meshes, strategies, token counts and routings; small sizes (8 devices share
the cores)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st
from jax.sharding import Mesh

import jax_moe
from common import normal, rel_err
from property_common import MARKS, NORM_TOL, ROUTINGS, routing_logits, seeds, sizes

pytestmark = MARKS

# Under JAX_PLATFORMS=cuda with fewer than 8 GPUs, the 8 host CPU devices.
DEVICES = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
STATIC = ("topk", "renormalize", "activation", "scoring_func", "num_expert_group", "topk_group",
          "routed_scaling_factor")
single = jax.jit(jax_moe.moe_forward, static_argnames=STATIC)
sharded = jax.jit(jax_moe.moe_forward_sharded, static_argnames=STATIC + ("mesh", "strategy"))


@given(seed=seeds, tokens=sizes(40), ep_tp=st.sampled_from([(8, 1), (4, 2), (2, 4), (1, 8),
                                                             (2, 2), (1, 1)]),
       experts_per_rank=st.integers(1, 2), k=st.integers(1, 3),
       routing=st.sampled_from(ROUTINGS), strategy=st.sampled_from(["allgather", "all_to_all"]),
       renormalize=st.booleans(), activation=st.sampled_from(["silu", "gelu"]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_matches_single_device(seed, tokens, ep_tp, experts_per_rank, k, routing, strategy,
                               renormalize, activation, dtype):
    ep, tp = ep_tp
    experts = ep * experts_per_rank
    k = experts if routing == "topk_all" else min(k, experts)
    hidden, inter = 24, 4 * tp
    rng = np.random.default_rng(seed)
    x = normal(rng, (tokens, hidden), dtype)
    logits = routing_logits(rng, tokens, experts, routing)
    w13 = normal(rng, (experts, 2 * inter, hidden), dtype, hidden**-0.5)
    w2 = normal(rng, (experts, hidden, inter), dtype, inter**-0.5)
    kw = dict(topk=k, renormalize=renormalize, activation=activation)
    with jax.default_device(DEVICES[0]):
        want = single(x, logits, w13, w2, **kw)
    mesh = Mesh(np.asarray(DEVICES[:ep * tp]).reshape(ep, tp), ("ep", "tp"))
    got = sharded(x, logits, w13, w2, mesh=mesh, strategy=strategy, **kw)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    err = rel_err(got, want)
    assert err <= NORM_TOL[jnp.dtype(dtype)], f"sharded vs one device: relative error {err:.3g}"
