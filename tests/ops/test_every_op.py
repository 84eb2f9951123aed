"""What holds for every op alike: the extension registers each FFI target on
each built platform, each op lowers to its custom call, vmap equals a loop
over the batch, and (gpu) the CUDA handlers match the CPU ones, on one
moderate random case per op (op_case)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from common import (DTYPE_IDS, FLOAT_DTYPES, assert_close, assert_equal, normal, on_cpu,
                    random_ids, split_rows)
from jax_moe import fp8, ops

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)


def test_every_target_registered_for_every_built_platform():
    from jax_moe._ffi import HAS_CUDA, _ext
    regs = _ext.registrations()
    want = {"jax_moe_route", "jax_moe_token_index", "jax_moe_expand",
            "jax_moe_group_gemm", "jax_moe_expert_mlp", "jax_moe_activation", "jax_moe_combine",
            "jax_moe_moe_layer", "jax_moe_moe_decode", "jax_moe_write_kv", "jax_moe_paged_decode",
            "jax_moe_fill_rows", "jax_moe_group_gemm_wgrad", "jax_moe_combine_bwd",
            "jax_moe_activation_grad", "jax_moe_activation_scaled_grad", "jax_moe_group_gemm_fp8",
            "jax_moe_moe_decode_fp8", "jax_moe_group_gemm_act"}
    assert set(regs) == ({"cpu", "CUDA"} if HAS_CUDA else {"cpu"})
    for platform, targets in regs.items():
        assert set(targets) == want, platform


def test_host_platform_has_eight_devices():
    # conftest.py sets --xla_force_host_platform_device_count=8 for shard_map tests.
    assert len(jax.devices("cpu")) == 8


TARGETS = {
    "topk_softmax": "jax_moe_route",
    "token_index": "jax_moe_token_index",
    "expand": "jax_moe_expand",
    "group_gemm": "jax_moe_group_gemm",
    "expert_mlp": "jax_moe_expert_mlp",
    "gated_act": "jax_moe_activation",
    "combine": "jax_moe_combine",
    "moe_layer": "jax_moe_moe_layer",
    "group_gemm_fp8": "jax_moe_group_gemm_fp8",
}


def op_case(name, rng, dtype, batch=None):
    """(fn, args) for one op on a moderate random input; with batch=B every
    argument gets a leading batch axis of size B (fresh data per element)."""
    tokens, k, experts, hidden, inter = 48, 2, 8, 72, 13
    lead = () if batch is None else (batch,)
    per = range(batch or 1)

    def stack(make):
        arrays = [make() for _ in per]
        return arrays[0] if batch is None else jnp.stack([jnp.asarray(a) for a in arrays])

    def index():
        return oracle.token_index(random_ids(rng, tokens, k, experts), experts)

    if name == "topk_softmax":
        return functools.partial(ops.topk_softmax, topk=k, renormalize=True), (
            normal(rng, lead + (tokens, experts), dtype, 2.0),)
    if name == "token_index":
        return functools.partial(ops.moe_compute_token_index, num_experts=experts), (
            stack(lambda: random_ids(rng, tokens, k, experts)),)
    if name == "expand":
        return functools.partial(ops.moe_expand_input, topk=k), (
            normal(rng, lead + (tokens, hidden), dtype), stack(lambda: index()[1]))
    if name == "group_gemm":
        m = tokens * k
        return ops.group_gemm, (
            normal(rng, lead + (m, hidden), dtype),
            normal(rng, lead + (experts, 2 * inter, hidden), dtype, 1 / np.sqrt(hidden)),
            stack(lambda: split_rows(rng, m, experts, "empty_middle")))
    if name == "group_gemm_fp8":
        m = tokens * k
        pairs = [fp8.quantize_blocks(normal(rng, (experts, 2 * inter, hidden), jnp.float32,
                                            1 / np.sqrt(hidden))) for _ in per]

        def pick(j):  # the weights' codes (0) or block scales (1)
            return pairs[0][j] if batch is None else jnp.stack([p[j] for p in pairs])
        return ops.group_gemm_fp8, (
            normal(rng, lead + (m, hidden), dtype), pick(0), pick(1),
            stack(lambda: split_rows(rng, m, experts, "empty_middle")))
    if name == "expert_mlp":
        idx = [index() for _ in per]  # sizes and dst_to_src of one routing per element

        def part(j):
            return idx[0][j] if batch is None else jnp.stack([jnp.asarray(i[j]) for i in idx])
        return functools.partial(ops.expert_mlp, topk=k), (
            normal(rng, lead + (tokens, hidden), dtype),
            normal(rng, lead + (experts, 2 * inter, hidden), dtype, 1 / np.sqrt(hidden)),
            normal(rng, lead + (experts, hidden, inter), dtype, 1 / np.sqrt(inter)),
            part(2), part(1))
    if name.startswith("gated_act"):
        activation = name.split(":")[1] if ":" in name else "silu"
        return functools.partial(ops.gated_activation, activation=activation), (
            normal(rng, lead + (tokens * k, 2 * inter), dtype, 2.0),)
    if name == "combine":
        return ops.moe_combine, (
            normal(rng, lead + (tokens * k, hidden), dtype),
            jnp.asarray(rng.random(lead + (tokens, k)), jnp.float32),
            stack(lambda: index()[0]))
    if name == "moe_layer":
        return functools.partial(ops.moe_layer, topk=k), (
            normal(rng, lead + (tokens, hidden), dtype),
            normal(rng, lead + (tokens, experts), jnp.float32, 2.0),
            normal(rng, lead + (experts, 2 * inter, hidden), dtype, 1 / np.sqrt(hidden)),
            normal(rng, lead + (experts, hidden, inter), dtype, 1 / np.sqrt(inter)))
    raise ValueError(name)


OP_NAMES = list(TARGETS)


def _compare(got, want, dtype, what):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if jnp.issubdtype(g.dtype, jnp.integer):
            assert_equal(g, w, f"{what}[{i}]")
        else:
            assert_close(g, w, g.dtype, f"{what}[{i}]")


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_lowers_to_its_custom_call(rng, name):
    fn, args = op_case(name, rng, jnp.float32)
    text = jax.jit(fn).lower(*args).as_text()
    targets = set(re.findall(r"custom_call\s*@(\w+)", text))
    assert TARGETS[name] in targets, f"{name}: custom calls in the lowered module: {targets}"


# ------------------------------------------------------------------------- vmap

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", OP_NAMES + ["gated_act:gelu"])
def test_vmap_matches_loop(rng, name, dtype):
    batch = 3
    fn, args = op_case(name, rng, dtype, batch=batch)
    got = jax.vmap(fn)(*args)
    for b in range(batch):
        want = fn(*(a[b] for a in args))
        got_b = jax.tree.map(lambda g: g[b], got)
        _compare(got_b, want, dtype, f"{name}, batch element {b}")


def test_vmap_group_gemm_shared_weights(rng):
    # x and expert_sizes batched, one weight tensor for the whole batch.
    fn, (x, w, sizes) = op_case("group_gemm", rng, jnp.float32, batch=3)
    got = jax.vmap(fn, in_axes=(0, None, 0))(x, w[0], sizes)
    for b in range(3):
        assert_close(got[b], fn(x[b], w[0], sizes[b]), jnp.float32, f"batch element {b}")


# ------------------------------------------------------------- GPU against CPU

@pytest.mark.gpu
@pytest.mark.sanitize
@dtypes
@pytest.mark.parametrize("name", OP_NAMES + ["gated_act:gelu", "gated_act:gelu_tanh"])
def test_cuda_matches_cpu_ffi(rng, name, dtype):
    fn, args = op_case(name, rng, dtype)
    got = jax.block_until_ready(fn(*args))
    assert all(leaf.devices() == {jax.devices()[0]} for leaf in jax.tree.leaves(got)), \
        "the op did not run on the GPU"
    want = on_cpu(fn, *args)
    assert all(leaf.devices() == {jax.devices("cpu")[0]} for leaf in jax.tree.leaves(want))
    _compare(got, want, dtype, f"{name}: CUDA vs CPU")
