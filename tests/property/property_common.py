"""Hypothesis settings and strategies shared by the property tests.

Profiles (chosen from the environment when this module is imported):
  default   derandomized (the same examples every run: CI is deterministic),
            JAX_MOE_PROPERTY_EXAMPLES examples per test (default 6);
  JAX_MOE_PROPERTY_RANDOM=1  new random examples every run;
  JAX_MOE_PROPERTY_SANITIZE=1  tiny sizes and few examples (default 3), and
            every property test is marked `sanitize`, so that
            tools/run_sanitizer.py runs them under compute-sanitizer.
deadline=None everywhere: the first example of a shape includes its compile.

Tests draw a `seed` and make their arrays from a numpy Generator; the
strategies below draw the sizes, dtypes and routings, so that hypothesis
shrinks those towards the smallest failing case.
"""

import os

import hypothesis
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, strategies as st

from common import FLOAT_DTYPES

SANITIZE = os.environ.get("JAX_MOE_PROPERTY_SANITIZE") == "1"
RANDOM = os.environ.get("JAX_MOE_PROPERTY_RANDOM") == "1"
EXAMPLES = int(os.environ.get("JAX_MOE_PROPERTY_EXAMPLES") or (3 if SANITIZE else 6))

hypothesis.settings.register_profile(
    "jax_moe", max_examples=EXAMPLES, derandomize=not RANDOM, deadline=None,
    print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])
hypothesis.settings.load_profile("jax_moe")

# Marks for every property test module (pytestmark): `sanitize` in the
# sanitizer profile only, so that tools/gpu_check.sh's default sanitizer pass
# (the files with sanitize marks) leaves this folder alone.
MARKS = [pytest.mark.sanitize] if SANITIZE else []

# ||got - want|| / ||want|| bounds where two implementations round the same
# intermediates to the dtype in other orders (as tests/layer's GRAD_TOL).
NORM_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
            jnp.dtype(jnp.float16): 4e-3}


def scaled(n: int) -> int:
    """A size bound, cut down in the sanitizer profile."""
    return max(2, n // 8) if SANITIZE else n


seeds = st.integers(0, 2**32 - 1)
dtypes = st.sampled_from(FLOAT_DTYPES)


def sizes(hi: int, lo: int = 0):
    """An int in [lo, hi]: the edges lo and lo + 1 (0 and 1 by default) often,
    else any value (most not a multiple of any tile)."""
    hi = max(scaled(hi), lo + 1)
    return st.one_of(st.sampled_from([lo, lo + 1]), st.integers(lo, hi))


# Routing patterns of the (T, E) logits (see routing_logits).
ROUTINGS = ["random", "skewed", "ties", "one_expert", "topk_all"]


@st.composite
def experts_topk(draw, max_experts=9, routing=None):
    """(E, k, routing): topk_all makes k = E."""
    routing = draw(st.sampled_from(ROUTINGS)) if routing is None else routing
    e = draw(st.integers(1, scaled(max_experts)))
    k = e if routing == "topk_all" else draw(st.integers(1, min(e, 4)))
    return e, k, routing


def routing_logits(rng, tokens, experts, routing):
    """(T, E) float32 logits of a routing pattern: random; skewed (a few
    experts favoured: most tokens on them); ties (values on a coarse grid, so
    that equal logits occur: the lower expert id wins); one_expert (every
    token's first choice is the same expert); topk_all (random; k = E)."""
    if routing in ("random", "topk_all"):
        logits = rng.standard_normal((tokens, experts)) * 2.0
    elif routing == "skewed":
        logits = rng.standard_normal((tokens, experts)) + 4.0 * rng.exponential(size=experts)
    elif routing == "ties":
        logits = rng.integers(-1, 2, size=(tokens, experts)).astype(np.float64)
    elif routing == "one_expert":
        logits = rng.standard_normal((tokens, experts))
        logits[:, rng.integers(experts)] = 50.0
    else:
        raise ValueError(routing)
    return jnp.asarray(logits, jnp.float32)


@st.composite
def local_range(draw, experts):
    """(start_expert, num_local_experts): a non-empty expert range, the
    whole of it or a part (expert parallelism)."""
    start = draw(st.integers(0, experts - 1))
    return start, draw(st.integers(1, experts - start))


def split_sizes(rng, rows, groups, how):
    """(G,) int32 group sizes: "exact" sums to rows, "under" to fewer, "over"
    past rows (the last groups are cut), "one" all rows in one group."""
    if how == "one":
        out = np.zeros(groups, np.int64)
        out[rng.integers(groups)] = rows
        return out.astype(np.int32)
    total = {"exact": rows, "under": int(rng.integers(0, rows + 1)),
             "over": rows + int(rng.integers(1, rows + 3))}[how]
    return rng.multinomial(total, np.ones(groups) / groups).astype(np.int32)


SPLITS = ["exact", "under", "over", "one"]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


@st.composite
def routing_options(draw, experts, k):
    """Keyword arguments of route: scoring, renormalize, scale, and expert
    groups where E splits into groups that can still hold k experts."""
    kw = dict(scoring_func=draw(st.sampled_from(["softmax", "sigmoid"])),
              renormalize=draw(st.booleans()),
              routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 0.125])))
    groups = [g for g in range(2, experts + 1) if experts % g == 0]
    if groups and draw(st.booleans()):
        g = draw(st.sampled_from(groups))
        per = experts // g
        tg = draw(st.integers(-(-k // per), g))
        kw.update(num_expert_group=g, topk_group=tg)
    return kw
