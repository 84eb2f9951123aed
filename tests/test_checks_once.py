"""One check per call: every public entry point validates its arguments with
ONE call into jax_moe._checks and then composes unchecked implementations, so
no argument is checked twice (composite ops and the layers included); and the
backend registry rejects unknown names.

Every function of jax_moe._checks is wrapped to record its calls while one
call is traced (jax.eval_shape: shapes only, nothing runs). A call made from
outside _checks is an entry check; the building blocks (rank, dtype, static
int checks) are keyed by the argument names they are given.
"""

import collections
import functools
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_moe
from jax_moe import _checks, backends, fp8, ops, reference

# Queries on already-checked values (whether moe_decode takes a layer), not checks.
QUERIES = {"decode_limits", "is_concrete"}
# The building blocks that check one named argument.
ARGUMENT_CHECKS = {"rank", "float_dtype", "int_dtype", "same_dtype", "static_int"}

T, E, H, I, K = 4, 8, 16, 8, 2


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.fixture
def record(monkeypatch):
    """The calls into jax_moe._checks, as (function name, entry?, key): key
    holds the argument names given as strings, and static_int's value too."""
    calls = []

    def wrap(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__")
            names = tuple(a for a in args if isinstance(a, str))
            if name == "static_int":  # both halves of tile_m=(8, 64): one name, two values
                names += (args[0],)
            calls.append((name, caller != _checks.__name__, names))
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in list(vars(_checks).items()):
        # _checks' own functions and the building blocks it re-exports.
        if inspect.isfunction(fn) and fn.__module__ in (_checks.__name__,
                                                        "jax_moe._check_basics"):
            monkeypatch.setattr(_checks, name, wrap(name, fn))
    return calls


def entry_checks(calls):
    return [name for name, entry, _ in calls if entry and name not in QUERIES]


def repeated_arguments(calls):
    """(check, key) pairs made more than once."""
    seen = collections.Counter((name, names) for name, _, names in calls
                               if name in ARGUMENT_CHECKS)
    return {key: n for key, n in seen.items() if n > 1}


def assert_checked_once(calls, want: str):
    assert entry_checks(calls) == [want]
    assert not repeated_arguments(calls)


# ---- the layers ------------------------------------------------------------------

def layer_args(tokens=T, hidden=H, inter=I, dtype=jnp.float32):
    return (sds((tokens, hidden), dtype), sds((tokens, E)), sds((E, 2 * inter, hidden), dtype),
            sds((E, hidden, inter), dtype))


LAYER_KWARGS = {
    "plain": {},
    "deepseek": dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                     e_score_correction_bias=sds((E,)), routed_scaling_factor=2.5),
    "shared": dict(shared_w13=sds((2 * I, H)), shared_w2=sds((H, I)), shared_gate=sds((H,)),
                   shared_expert_output=sds((T, H))),
    "non_gated": dict(is_gated=False, activation="gelu"),
}


def _non_gated(args, kw):
    if kw.get("is_gated") is False:
        x, logits, _, w2 = args
        return (x, logits, sds((E, I, H)), w2)
    return args


@pytest.mark.parametrize("backend", ["ffi", "reference"])
@pytest.mark.parametrize("case", list(LAYER_KWARGS))
def test_moe_forward_checks_once(record, backend, case):
    kw = LAYER_KWARGS[case]
    args = _non_gated(layer_args(), kw)
    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.ShapeDtypeStruct)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    def fn(*a, **arr):
        return jax_moe.moe_forward(*a, K, backend=backend, **static, **arr)

    jax.eval_shape(fn, *args, **arrays)
    assert_checked_once(record, "forward_args")


def test_moe_forward_one_token_checks_once(record):
    # One bf16 token within moe_decode's limits: the GPU branch (moe_decode) is
    # traced too, through platform_dependent; decode_limits is only asked.
    args = layer_args(tokens=1, hidden=256, inter=256, dtype=jnp.bfloat16)
    jax.eval_shape(lambda *a: jax_moe.moe_forward(*a, K), *args)
    assert_checked_once(record, "forward_args")
    assert [name for name, entry, _ in record if entry and name in QUERIES] == ["decode_limits"]


def test_moe_forward_gradient_checks_once(record):
    # The backward runs unchecked steps: no more checks.
    def loss(x, logits, w13, w2):
        return jnp.sum(jax_moe.moe_forward(x, logits, w13, w2, K))

    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), *layer_args())
    assert_checked_once(record, "forward_args")


@pytest.mark.parametrize("module", [ops, reference], ids=["ops", "reference"])
@pytest.mark.parametrize("case", list(LAYER_KWARGS)[:2] + ["non_gated"])
def test_moe_layer_checks_once(record, module, case):
    kw = LAYER_KWARGS[case]
    args = _non_gated(layer_args(), kw)
    bias = kw.get("e_score_correction_bias")
    static = {k: v for k, v in kw.items() if k != "e_score_correction_bias"}
    jax.eval_shape(lambda *a, b=None: module.moe_layer(*a, K, e_score_correction_bias=b, **static),
                   *args, b=bias)
    assert_checked_once(record, "moe_layer_args")


def test_moe_forward_sharded_checks_once(record):
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("ep", "tp"))
    jax.eval_shape(lambda *a: jax_moe.moe_forward_sharded(*a, K, mesh=mesh), *layer_args())
    assert_checked_once(record, "forward_args")


# ---- every public op, on both backends -----------------------------------------------

M = T * K
OPS = {  # name: (args, keyword arguments, the entry check)
    "route": ((sds((T, E)), K), dict(scoring_func="sigmoid", num_expert_group=2, topk_group=1,
                                     e_score_correction_bias=None), "route_args"),
    "topk_softmax": ((sds((T, E)), K), {}, "route_args"),
    "moe_compute_token_index": ((sds((T, K), jnp.int32), E), {}, "token_index_args"),
    "moe_expand_input": ((sds((T, H)), sds((M,), jnp.int32), K), {}, "expand_args"),
    "group_gemm": ((sds((M, H)), sds((E, 2 * I, H)), sds((E,), jnp.int32)), dict(tile_m=8),
                   "group_gemm_args"),
    "group_gemm_gather": ((sds((T, H)), sds((E, 2 * I, H)), sds((E,), jnp.int32),
                           sds((M,), jnp.int32), K), dict(tile_m=32), "group_gemm_gather_args"),
    "expert_mlp": ((sds((T, H)), sds((E, 2 * I, H)), sds((E, H, I)), sds((E,), jnp.int32),
                    sds((M,), jnp.int32), K), dict(tile_m=(8, 64)), "expert_mlp_args"),
    "gated_activation": ((sds((M, 2 * I)),), {}, "activation_args"),
    "activation": ((sds((M, I)),), dict(activation="gelu_tanh"), "activation_args"),
    "silu_and_mul": ((sds((M, 2 * I)),), {}, "activation_args"),
    "gelu_and_mul": ((sds((M, 2 * I)),), dict(approximate=True), "gelu_and_mul_args"),
    "moe_combine": ((sds((M, H)), sds((T, K)), sds((M,), jnp.int32)), {}, "combine_args"),
    "moe_decode": (layer_args(tokens=1, hidden=256, inter=256, dtype=jnp.bfloat16) + (K,), {},
                   "moe_decode_args"),
    "group_gemm_wgrad": ((sds((M, 2 * I)), sds((M, H)), sds((E,), jnp.int32)), dict(topk=1),
                         "group_gemm_wgrad_args"),
    "group_gemm_fp8": ((sds((M, H)), sds((E, 2 * I, H), fp8.FP8), sds((E, 1, 1)),
                        sds((E,), jnp.int32)), {}, "group_gemm_fp8_args"),
}


@pytest.mark.parametrize("module", [ops, reference], ids=["ops", "reference"])
@pytest.mark.parametrize("name", list(OPS))
def test_each_op_checks_once(record, module, name):
    args, kw, want = OPS[name]
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)]

    def fn(*a):
        full = list(args)
        for i, v in zip(arrays, a):
            full[i] = v
        return getattr(module, name)(*full, **kw)

    jax.eval_shape(fn, *[args[i] for i in arrays])
    assert_checked_once(record, want)


def test_every_public_op_is_covered():
    assert set(OPS) | {"moe_layer", "moe_decode_supported"} == set(ops.__all__)
    assert set(reference.__all__) <= set(ops.__all__)


def test_moe_decode_supported_checks_once(record):
    assert ops.moe_decode_supported(*layer_args(tokens=1, hidden=256, inter=256,
                                                dtype=jnp.bfloat16), K)
    assert_checked_once(record, "decode_supported")


# ---- the registry ----------------------------------------------------------------------

def test_registry():
    assert set(backends.BACKENDS) == {"ffi", "reference"}
    assert backends.get("ffi") is ops and backends.get("reference") is reference
    assert jax_moe.backends is backends
    with pytest.raises(TypeError):
        backends.BACKENDS["triton"] = ops  # read-only


@pytest.mark.parametrize("lookup", [backends.get, backends.steps], ids=["get", "steps"])
def test_registry_rejects_an_unknown_backend(lookup):
    with pytest.raises(ValueError, match=r"backend must be one of \['ffi', 'reference'\], "
                                         r"got 'triton'"):
        lookup("triton")


def test_layers_reject_an_unknown_backend():
    with pytest.raises(ValueError, match="'triton'"):
        jax.eval_shape(lambda *a: jax_moe.moe_forward(*a, K, backend="triton"), *layer_args())
    config = jax_moe.MoEConfig(num_experts=E, topk=K, hidden_size=H, intermediate_size=I)
    with pytest.raises(ValueError, match="'triton'"):
        jax_moe.MoELayer(config, backend="triton")
