"""Edge cases the property suite (tests/property/) found, kept as plain
tests: bf16 prefill with one head and one row under jit on XLA:CPU, and the
twins with no tokens at all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import PREFILL_RTOL, prefill_np
from common import assert_close, assert_equal, normal
from jax_moe import attention, attention_reference


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 8), (1, 2, 16)], ids=str)
def test_prefill_bf16_small_jit(rng, shape, causal):
    """bf16 with one head or one row compiled to an elementwise bf16 x bf16
    -> f32 dot that XLA:CPU cannot emit."""
    n = shape[0]
    q, k, v = (normal(rng, shape, jnp.bfloat16) for _ in range(3))
    cu = jnp.asarray([0, n], jnp.int32)
    fn = jax.jit(attention.prefill_attention, static_argnames="causal")
    out = fn(q, k, v, cu, causal=causal)
    assert out.dtype == jnp.bfloat16
    want = prefill_np(q, k, v, cu, causal, 1.0 / np.sqrt(shape[2]))
    assert_close(out, want, jnp.bfloat16, "prefill bf16", rtol=PREFILL_RTOL[jnp.dtype(jnp.bfloat16)])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_twins_without_tokens(jit):
    """N = 0: the prefill twin and the dispatch twin return empty outputs
    (they used to reduce over no rows)."""
    q = jnp.zeros((0, 2, 8), jnp.float32)
    cu = jnp.asarray([0, 0], jnp.int32)
    pages = jnp.zeros((4, 2, 2, 8), jnp.float32)
    prefill = attention_reference.prefill_attention
    dispatch = attention_reference.attention_dispatch
    if jit:
        prefill, dispatch = jax.jit(prefill), jax.jit(dispatch)
    assert_equal(prefill(q, q, q, cu), q, "prefill twin")
    out, kp, vp = dispatch(q, q, q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                           jnp.ones((1,), jnp.int32), cu, jnp.asarray([False]),
                           jnp.zeros((0,), jnp.int32))
    assert_equal(out, q, "dispatch twin")
    assert_equal(kp, pages, "dispatch twin's k cache")
    # the kernels' path agrees
    assert_equal(attention.prefill_attention(q, q, q, cu), q, "prefill")
