"""Bad inputs raise ValueError / TypeError naming the argument, at trace time,
before any kernel runs.

Every shape/dtype case runs twice: eagerly, and under jax.eval_shape with
abstract inputs (no data exists, so no kernel can have run: the check is a
trace-time one). Value checks (ids out of range) are eager-only by design.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import ops, reference

T, E, H, I, K = 6, 4, 8, 3, 2


def z(shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


X, LOGITS, W13, W2 = z((T, H)), z((T, E)), z((E, 2 * I, H)), z((E, H, I))
IDS = jnp.asarray(np.arange(T * K).reshape(T, K) % E, jnp.int32)
SIZES = jnp.asarray([T * K, 0, 0, 0], jnp.int32)
S2D = jnp.arange(T * K, dtype=jnp.int32)
P = functools.partial

# (id, function of the module (ops or reference) -> callable, args, exception, match)
OP_CASES = [
    # step 1
    ("topk/logits_rank", lambda m: P(m.topk_softmax, topk=K), [z((T,))], ValueError, "router_logits"),
    ("topk/logits_rank3", lambda m: P(m.topk_softmax, topk=K), [z((2, T, E))], ValueError, "router_logits"),
    ("topk/logits_int", lambda m: P(m.topk_softmax, topk=K), [z((T, E), jnp.int32)], TypeError, "router_logits"),
    ("topk/logits_complex", lambda m: P(m.topk_softmax, topk=K), [z((T, E), jnp.complex64)], TypeError, "router_logits"),
    ("topk/too_big", lambda m: P(m.topk_softmax, topk=E + 1), [LOGITS], ValueError, "topk"),
    ("topk/zero", lambda m: P(m.topk_softmax, topk=0), [LOGITS], ValueError, "topk"),
    ("topk/bool", lambda m: P(m.topk_softmax, topk=True), [LOGITS], TypeError, "topk"),
    ("gelu_and_mul/approximate_str", lambda m: P(m.gelu_and_mul, approximate="False"),
     [z((T, 2 * I))], TypeError, "approximate"),
    ("topk/negative", lambda m: P(m.topk_softmax, topk=-1), [LOGITS], ValueError, "topk"),
    ("topk/float", lambda m: P(m.topk_softmax, topk=2.0), [LOGITS], TypeError, "topk"),
    # step 2
    ("index/ids_rank", lambda m: P(m.moe_compute_token_index, num_experts=E), [IDS.reshape(-1)], ValueError, "topk_ids"),
    ("index/ids_float", lambda m: P(m.moe_compute_token_index, num_experts=E), [IDS.astype(jnp.float32)], TypeError, "topk_ids"),
    ("index/num_experts_zero", lambda m: P(m.moe_compute_token_index, num_experts=0), [IDS], ValueError, "num_experts"),
    ("index/num_experts_float", lambda m: P(m.moe_compute_token_index, num_experts=4.0), [IDS], TypeError, "num_experts"),
    ("index/start_negative", lambda m: P(m.moe_compute_token_index, num_experts=E, start_expert=-1), [IDS], ValueError, "start_expert"),
    ("index/range_past_end", lambda m: P(m.moe_compute_token_index, num_experts=E, start_expert=2, num_local_experts=3), [IDS], ValueError, "num_local_experts"),
    ("index/local_zero", lambda m: P(m.moe_compute_token_index, num_experts=E, num_local_experts=0), [IDS], ValueError, "num_local_experts"),
    # step 3
    ("expand/x_rank", lambda m: P(m.moe_expand_input, topk=K), [z((T, H, 1)), S2D], ValueError, r"\bx\b"),
    ("expand/x_int", lambda m: P(m.moe_expand_input, topk=K), [z((T, H), jnp.int32), S2D], TypeError, r"\bx\b"),
    ("expand/d2s_rank", lambda m: P(m.moe_expand_input, topk=K), [X, S2D.reshape(T, K)], ValueError, "dst_to_src"),
    ("expand/d2s_float", lambda m: P(m.moe_expand_input, topk=K), [X, S2D.astype(jnp.float32)], TypeError, "dst_to_src"),
    ("expand/topk_zero", lambda m: P(m.moe_expand_input, topk=0), [X, S2D], ValueError, "topk"),
    # steps 4, 6
    ("gemm/x_rank", lambda m: m.group_gemm, [z((T * K,)), W13, SIZES], ValueError, r"\bx\b"),
    ("gemm/w_rank", lambda m: m.group_gemm, [z((T * K, H)), W13[0], SIZES], ValueError, r"\bw\b"),
    ("gemm/sizes_rank", lambda m: m.group_gemm, [z((T * K, H)), W13, SIZES[None]], ValueError, "expert_sizes"),
    ("gemm/k_mismatch", lambda m: m.group_gemm, [z((T * K, H + 1)), W13, SIZES], ValueError, r"\bw\b"),
    ("gemm/sizes_len", lambda m: m.group_gemm, [z((T * K, H)), W13, SIZES[:-1]], ValueError, "expert_sizes"),
    ("gemm/sizes_float", lambda m: m.group_gemm, [z((T * K, H)), W13, SIZES.astype(jnp.float32)], TypeError, "expert_sizes"),
    ("gemm/dtype_mismatch", lambda m: m.group_gemm, [z((T * K, H), jnp.bfloat16), W13, SIZES], TypeError, r"\bw\b"),
    ("gemm/x_int", lambda m: m.group_gemm, [z((T * K, H), jnp.int32), W13.astype(jnp.int32), SIZES], TypeError, r"\bx\b"),
    # steps 3-6
    ("mlp/is_gated_int", lambda m: P(m.expert_mlp, topk=K, is_gated=1), [X, W13, W2, SIZES, S2D], TypeError, "is_gated must be True or False"),
    # step 5
    ("act/odd", lambda m: m.gated_activation, [z((T, 2 * I + 1))], ValueError, r"\bh\b"),
    ("act/scalar", lambda m: m.gated_activation, [z(())], ValueError, r"\bh\b"),
    ("act/int", lambda m: m.gated_activation, [z((T, 2 * I), jnp.int32)], TypeError, r"\bh\b"),
    ("act/bad_name", lambda m: P(m.gated_activation, activation="relu"), [z((T, 2 * I))], ValueError, "activation"),
    # step 7
    ("combine/y_rank", lambda m: m.moe_combine, [z((T * K,)), z((T, K)), S2D], ValueError, r"\by\b"),
    ("combine/y_int", lambda m: m.moe_combine, [z((T * K, H), jnp.int32), z((T, K)), S2D], TypeError, r"\by\b"),
    ("combine/weights_rank", lambda m: m.moe_combine, [z((T * K, H)), z((T * K,)), S2D], ValueError, "topk_weights"),
    ("combine/weights_int", lambda m: m.moe_combine, [z((T * K, H)), z((T, K), jnp.int32), S2D], TypeError, "topk_weights"),
    ("combine/s2d_len", lambda m: m.moe_combine, [z((T * K, H)), z((T, K)), S2D[:-1]], ValueError, "src_to_dst"),
    ("combine/s2d_float", lambda m: m.moe_combine, [z((T * K, H)), z((T, K)), S2D.astype(jnp.float32)], TypeError, "src_to_dst"),
]

moe = jax_moe.moe_forward
LAYER_CASES = [
    ("x_rank", dict(hidden_states=z((1, T, H))), {}, ValueError, "hidden_states"),
    ("logits_rank", dict(router_logits=z((T * E,))), {}, ValueError, "router_logits"),
    ("w13_rank", dict(w13=z((2 * I, H))), {}, ValueError, "w13"),
    ("w2_rank", dict(w2=z((E, H * I))), {}, ValueError, "w2"),
    ("E_mismatch", dict(router_logits=z((T, E + 1))), {}, ValueError, "router_logits"),
    ("T_mismatch", dict(router_logits=z((T + 1, E))), {}, ValueError, "router_logits"),
    ("H_mismatch_w13", dict(w13=z((E, 2 * I, H + 1))), {}, ValueError, "w13"),
    ("H_mismatch_x", dict(hidden_states=z((T, H + 1))), {}, ValueError, "w13"),
    ("w13_odd", dict(w13=z((E, 2 * I + 1, H))), {}, ValueError, "w13"),
    ("w2_shape", dict(w2=z((E, H, I + 1))), {}, ValueError, "w2"),
    ("w2_experts", dict(w2=z((E + 1, H, I))), {}, ValueError, "w2"),
    ("topk_too_big", {}, dict(topk=E + 1), ValueError, "topk"),
    ("topk_zero", {}, dict(topk=0), ValueError, "topk"),
    ("x_int", dict(hidden_states=z((T, H), jnp.int32)), {}, TypeError, "hidden_states"),
    ("x_complex", dict(hidden_states=z((T, H), jnp.complex64)), {}, TypeError, "hidden_states"),
    ("logits_int", dict(router_logits=z((T, E), jnp.int32)), {}, TypeError, "router_logits"),
    ("w13_dtype", dict(w13=z((E, 2 * I, H), jnp.bfloat16)), {}, TypeError, "w13"),
    ("w2_dtype", dict(w2=z((E, H, I), jnp.float16)), {}, TypeError, "w2"),
    ("activation", {}, dict(activation="swish"), ValueError, "activation"),
    ("backend", {}, dict(backend="triton"), ValueError, "backend"),
    ("shared_shape", dict(shared_expert_output=z((T, H + 1))), {}, ValueError, "shared_expert_output"),
    ("shared_output_int", dict(shared_expert_output=z((T, H), jnp.int32)), {}, TypeError, "shared_expert_output"),
    ("shared_output_bool", dict(shared_expert_output=z((T, H), bool)), {}, TypeError, "shared_expert_output"),
    ("shared_gate_shape", dict(shared_w13=z((2 * I, H)), shared_w2=z((H, I)), shared_gate=z((H, 1))),
     {}, ValueError, "shared_gate"),
    ("shared_gate_split", dict(shared_w13=z((2 * I, H)), shared_w2=z((H, I)), shared_gate=z((2, H // 2))),
     {}, ValueError, "shared_gate"),
    ("shared_gate_int", dict(shared_w13=z((2 * I, H)), shared_w2=z((H, I)), shared_gate=z((H,), jnp.int32)),
     {}, TypeError, "shared_gate"),
    ("topk_bool", {}, dict(topk=True), TypeError, "topk"),
    ("remat_str", {}, dict(remat="yes"), TypeError, "remat"),
]


def abstract(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _raises(fn, args, mode, exc, match):
    with pytest.raises(exc, match=match):
        if mode == "eager":
            fn(*args)
        else:  # abstract inputs: nothing could run, the error is a trace-time one
            jax.eval_shape(fn, *[abstract(a) for a in args])


@pytest.mark.parametrize("mode", ["eager", "eval_shape"])
@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_op_rejects(case, mode):
    _, make, args, exc, match = case
    _raises(make(ops), args, mode, exc, match)


@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_reference_rejects_the_same(case):
    # reference.py promises the same validation as ops.py.
    _, make, args, exc, match = case
    _raises(make(reference), args, "eval_shape", exc, match)


# step 1's general form, route(): group-limited top-k, correction bias, scale
# (T = 4 tokens, RE = 8 experts)
RE = 8
ROUTE_LOGITS = jnp.zeros((4, RE), jnp.float32)
ROUTE_ERROR_CASES = [  # (id, kwargs, exception, match)
    ("bad_scoring", dict(topk=2, scoring_func="relu"), ValueError, "scoring_func"),
    ("groups_not_dividing", dict(topk=2, num_expert_group=3, topk_group=1), ValueError, "num_expert_group"),
    ("groups_zero", dict(topk=2, num_expert_group=0, topk_group=1), ValueError, "num_expert_group"),
    ("groups_float", dict(topk=2, num_expert_group=4.0, topk_group=1), TypeError, "num_expert_group"),
    ("topk_group_zero", dict(topk=2, num_expert_group=4, topk_group=0), ValueError, "topk_group"),
    ("topk_group_too_big", dict(topk=2, num_expert_group=4, topk_group=5), ValueError, "topk_group"),
    ("topk_group_alone", dict(topk=2, topk_group=2), ValueError, "topk_group"),
    ("groups_alone", dict(topk=2, num_expert_group=2), ValueError, "num_expert_group"),
    ("topk_past_groups", dict(topk=5, num_expert_group=4, topk_group=2), ValueError, "topk"),
    ("bias_too_long", dict(topk=2, e_score_correction_bias=jnp.zeros(RE + 1)), ValueError, "e_score_correction_bias"),
    ("bias_rank2", dict(topk=2, e_score_correction_bias=jnp.zeros((1, RE))), ValueError, "e_score_correction_bias"),
    ("bias_int", dict(topk=2, e_score_correction_bias=jnp.zeros(RE, jnp.int32)), TypeError, "e_score_correction_bias"),
    ("scale_none", dict(topk=2, routed_scaling_factor=None), TypeError, "routed_scaling_factor"),
    ("scale_nan", dict(topk=2, routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor must be finite"),
    ("scale_inf", dict(topk=2, routed_scaling_factor=float("-inf")), ValueError, "routed_scaling_factor must be finite"),
    ("topk_too_big", dict(topk=RE + 1), ValueError, "topk"),
]


@pytest.mark.parametrize("module", [ops, reference], ids=["ops", "reference"])
@pytest.mark.parametrize("case", ROUTE_ERROR_CASES, ids=[c[0] for c in ROUTE_ERROR_CASES])
def test_route_rejects(module, case):
    _, kw, exc, match = case
    with pytest.raises(exc, match=match):
        module.route(ROUTE_LOGITS, **kw)
    # At trace time, before any kernel: the same with abstract inputs.
    with pytest.raises(exc, match=match):
        jax.eval_shape(functools.partial(module.route, **kw), ROUTE_LOGITS)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
@pytest.mark.parametrize("mode", ["eager", "eval_shape"])
@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_moe_forward_rejects(case, mode, backend):
    _, replace, kwargs, exc, match = case
    arrays = dict(hidden_states=X, router_logits=LOGITS, w13=W13, w2=W2)
    arrays.update(replace)
    kwargs = dict(dict(topk=K, backend=backend), **kwargs)
    names = list(arrays)
    fn = lambda *a: moe(**dict(zip(names, a)), **kwargs)  # noqa: E731
    _raises(fn, list(arrays.values()), mode, exc, match)


def test_moe_forward_rejects_under_jit():
    jitted = jax.jit(moe, static_argnames=("topk", "renormalize", "activation", "backend"))
    with pytest.raises(ValueError, match="router_logits"):
        jitted(X, z((T, E + 1)), W13, W2, topk=K)
    with pytest.raises(TypeError, match="w13"):
        jitted(X, LOGITS, W13.astype(jnp.float16), W2, topk=K)


@pytest.mark.parametrize("module", [ops, reference], ids=["ops", "reference"])
def test_index_rejects_2_31_ids(module):
    # 2^31 entries do not fit int32 slot numbers; checked from the shape alone.
    ids = jax.ShapeDtypeStruct((2**16, 2**15), jnp.int32)
    with pytest.raises(ValueError, match="topk_ids has 2147483648 entries"):
        jax.eval_shape(P(module.moe_compute_token_index, num_experts=E), ids)


@pytest.mark.parametrize("module", [ops, reference], ids=["ops", "reference"])
@pytest.mark.parametrize("bad", [-1, E, 1000])
def test_index_rejects_ids_out_of_range_eagerly(module, bad):
    ids = np.array(IDS)
    ids[T // 2, 1] = bad
    with pytest.raises(ValueError, match="topk_ids"):
        module.moe_compute_token_index(jnp.asarray(ids), E)


@pytest.mark.parametrize("name,args", [
    ("topk_softmax", (np.zeros((T, E), np.float64), K)),
    ("group_gemm", (np.zeros((T * K, H), np.float64), np.zeros((E, 2 * I, H), np.float64), SIZES)),
    ("gated_activation", (np.zeros((T, 2 * I), np.float64),)),
])
def test_ops_reject_float64(name, args):
    # jax's x64 mode is off, so a float64 array can only arrive as a numpy array.
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        getattr(ops, name)(*args)


def test_moe_config_rejects():
    with pytest.raises(ValueError, match="topk"):
        jax_moe.MoEConfig(num_experts=4, topk=5, hidden_size=8, intermediate_size=4)
    with pytest.raises(ValueError, match="activation"):
        jax_moe.MoEConfig(num_experts=4, topk=2, hidden_size=8, intermediate_size=4, hidden_act="relu")
    with pytest.raises(ValueError, match="hidden_size"):
        jax_moe.MoEConfig(num_experts=4, topk=2, hidden_size=0, intermediate_size=4)
    with pytest.raises(ValueError, match="routed_scaling_factor must be finite"):
        jax_moe.MoEConfig(num_experts=4, topk=2, hidden_size=8, intermediate_size=4,
                          routed_scaling_factor=float("inf"))
    with pytest.raises(ValueError, match="backend"):
        jax_moe.MoELayer(jax_moe.MoEConfig(num_experts=4, topk=2, hidden_size=8, intermediate_size=4),
                         backend="cuda")


def test_expert_count_bound_is_the_same_everywhere():
    """The CUDA kernels' expert bound is enforced before any kernel, on every platform."""
    from jax_moe import _checks
    e = _checks.MAX_EXPERTS + 1
    logits = jnp.zeros((2, e), jnp.float32)
    ids = jnp.zeros((2, 1), jnp.int32)
    for impl in (ops, reference):
        with pytest.raises(ValueError, match="router_logits' E"):
            impl.topk_softmax(logits, 2)
        with pytest.raises(ValueError, match="num_experts"):
            impl.moe_compute_token_index(ids, e)


def test_layer_array_arguments_that_are_lists():
    # Lists (no shape, no dtype) get a TypeError naming the argument, not an
    # AttributeError from deep inside.
    for key, value in (("shared_expert_output", np.zeros((T, H)).tolist()),
                       ("shared_gate", [0.0] * H)):
        shared = dict(shared_w13=z((2 * I, H)), shared_w2=z((H, I))) if key == "shared_gate" else {}
        with pytest.raises(TypeError, match=f"{key} must be an array"):
            moe(X, LOGITS, W13, W2, K, **shared, **{key: value})
    layer = jax_moe.MoELayer(jax_moe.MoEConfig(num_experts=E, topk=K, hidden_size=H,
                                               intermediate_size=I))
    with pytest.raises(TypeError, match="hidden_states must be an array"):
        layer(np.zeros((T, H)).tolist(), LOGITS, W13, W2)
    with pytest.raises(TypeError, match="w2 must be an array"):
        layer(X, LOGITS, W13, W2.tolist())


@pytest.mark.parametrize("module", [ops, reference], ids=["ops", "reference"])
def test_numpy_bools_are_bools(module):
    # np.bool_ flags read as the bools they are, everywhere a flag is taken.
    ref = module.expert_mlp(X, W13, W2, SIZES, S2D, K, is_gated=True)
    got = module.expert_mlp(X, W13, W2, SIZES, S2D, K, is_gated=np.bool_(True))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    h = jnp.asarray(np.linspace(-2, 2, T * 2 * I).reshape(T, 2 * I), jnp.float32)
    np.testing.assert_array_equal(np.asarray(module.gelu_and_mul(h, np.bool_(True))),
                                  np.asarray(module.gelu_and_mul(h, True)))
    assert not np.array_equal(np.asarray(module.gelu_and_mul(h, True)),
                              np.asarray(module.gelu_and_mul(h, False)))
    backend = "ffi" if module is ops else "reference"
    x = jnp.asarray(np.linspace(-1, 1, T * H).reshape(T, H), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(moe(x, LOGITS, W13, W2, K, remat=np.bool_(True), backend=backend)),
        np.asarray(moe(x, LOGITS, W13, W2, K, remat=True, backend=backend)))


def test_moe_config_rejects_bool_counts():
    with pytest.raises(TypeError, match="topk"):
        jax_moe.MoEConfig(num_experts=4, topk=True, hidden_size=8, intermediate_size=4)
    with pytest.raises(TypeError, match="num_experts"):
        jax_moe.MoEConfig(num_experts=np.bool_(True), topk=1, hidden_size=8, intermediate_size=4)
