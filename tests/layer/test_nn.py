"""jax_moe.nn.MoE (Flax NNX): forward == moe_forward, from_state_dict, training."""

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import assert_close, assert_equal, fp8_checkpoint, rel_err  # noqa: E402
from jax_moe import MoEConfig, moe_forward  # noqa: E402
from jax_moe.convert import convert_moe_block  # noqa: E402
from jax_moe.nn import MoE, Buffer  # noqa: E402

BACKENDS = ["reference", "ffi"]
STATIC = ("topk", "renormalize", "activation", "is_gated", "scoring_func", "num_expert_group",
          "topk_group", "routed_scaling_factor", "backend")
# Everything runs jitted: eager moe_forward compiles each of its ~100 ops.
moe_jit = jax.jit(moe_forward, static_argnames=STATIC)
call = nnx.jit(lambda model, x: model(x))
H, I, E = 16, 8, 8

CONFIGS = {
    "qwen3": MoEConfig(num_experts=E, topk=2, hidden_size=H, intermediate_size=I),
    "qwen2": MoEConfig(num_experts=E, topk=3, hidden_size=H, intermediate_size=I,
                       renormalize=False, shared_intermediate_size=16, shared_expert_gate=True),
    "deepseek": MoEConfig(num_experts=E, topk=3, hidden_size=H, intermediate_size=I,
                          scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                          routed_scaling_factor=2.5, use_correction_bias=True,
                          shared_intermediate_size=16),
    # Every option at once (training and gradients cover all parameters).
    "all": MoEConfig(num_experts=E, topk=3, hidden_size=H, intermediate_size=I,
                     scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                     routed_scaling_factor=2.5, use_correction_bias=True,
                     shared_intermediate_size=16, shared_expert_gate=True),
}


def _arrays(model):
    """moe_forward's array arguments from the module's variables."""
    get = lambda v: None if v is None else v[...]  # noqa: E731
    return dict(w13=get(model.w13), w2=get(model.w2),
                e_score_correction_bias=get(model.e_score_correction_bias),
                shared_w13=get(model.shared_w13), shared_w2=get(model.shared_w2),
                shared_gate=get(model.shared_gate))


def _direct(model, x, dtype=None):
    """moe_forward called by hand with the module's parameters."""
    c = model.config
    a = _arrays(model)
    x2 = x.reshape(-1, c.hidden_size)
    if dtype is not None:
        x2 = x2.astype(dtype)
        a = {k: (v if v is None or k == "e_score_correction_bias" else v.astype(dtype))
             for k, v in a.items()}
    logits = jnp.dot(x2.astype(jnp.float32), model.router[...].astype(jnp.float32).T,
                     preferred_element_type=jnp.float32)
    w13, w2 = a.pop("w13"), a.pop("w2")
    out = moe_jit(x2, logits, w13, w2, backend=model.backend, **a, **c.forward_kwargs())
    return out.reshape(x.shape)


def _with_bias(model, rng):
    if model.e_score_correction_bias is not None:
        model.e_score_correction_bias.set_value(
            jnp.asarray(rng.uniform(-0.2, 0.2, model.config.num_experts), jnp.float32))
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen2", "deepseek"])  # (Qwen3's block: test_convert)
def test_forward_matches_moe_forward(name, backend, rng, seed):
    cfg = CONFIGS[name]
    model = _with_bias(MoE(cfg, rngs=nnx.Rngs(seed % 1000), backend=backend), rng)
    assert model.router.shape == (E, H) and model.w13.shape == (E, 2 * I, H)
    assert model.w2.shape == (E, H, I)
    assert (model.shared_w13 is None) == (cfg.shared_intermediate_size == 0)
    assert (model.shared_gate is None) == (not cfg.shared_expert_gate)
    assert isinstance(model.e_score_correction_bias, Buffer) == cfg.use_correction_bias
    x = jnp.asarray(rng.standard_normal((2, 5, H)), jnp.float32)
    got = call(model, x)
    assert got.shape == x.shape and got.dtype == jnp.float32
    assert_close(got, _direct(model, x), jnp.float32, f"{name} {backend}")


# The dtype handling is the module's, not the backend's: one backend suffices.
@pytest.mark.parametrize("backend", ["ffi"])
def test_dtype_and_param_dtype(backend, rng):
    cfg = CONFIGS["qwen2"]
    model = MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32,
                backend=backend)
    assert model.w13[...].dtype == jnp.float32
    x = jnp.asarray(rng.standard_normal((7, H)), jnp.float32)
    got = call(model, x)
    assert got.dtype == jnp.bfloat16
    assert_close(got, _direct(model, x, jnp.bfloat16), jnp.bfloat16, backend)
    with pytest.raises(ValueError, match="H=16"):
        model(jnp.zeros((3, H + 1)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        MoE(CONFIGS["qwen3"], rngs=nnx.Rngs(0), backend="cuda")
    with pytest.raises(TypeError, match="MoEConfig"):
        MoE({"num_experts": 8}, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="x must be an array"):
        MoE(CONFIGS["qwen3"], rngs=nnx.Rngs(0))([[0.0] * H])


def _qwen2_state_dict(rng, prefix, cfg):
    """A Qwen2-MoE block with the published names and shapes."""
    h, i, i_s = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    sd = {prefix + "gate.weight": rng.standard_normal((cfg.num_experts, h))}
    for e in range(cfg.num_experts):
        sd[f"{prefix}experts.{e}.gate_proj.weight"] = rng.standard_normal((i, h)) / 4
        sd[f"{prefix}experts.{e}.up_proj.weight"] = rng.standard_normal((i, h)) / 4
        sd[f"{prefix}experts.{e}.down_proj.weight"] = rng.standard_normal((h, i)) / 3
    sd[prefix + "shared_expert.gate_proj.weight"] = rng.standard_normal((i_s, h)) / 4
    sd[prefix + "shared_expert.up_proj.weight"] = rng.standard_normal((i_s, h)) / 4
    sd[prefix + "shared_expert.down_proj.weight"] = rng.standard_normal((h, i_s)) / 3
    sd[prefix + "shared_expert_gate.weight"] = rng.standard_normal((1, h)) / 4
    return {k: v.astype(np.float32) for k, v in sd.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_state_dict(backend, rng):
    cfg = CONFIGS["qwen2"]
    prefix = "model.layers.0.mlp."
    sd = _qwen2_state_dict(rng, prefix, cfg)
    model = MoE.from_state_dict(cfg, sd, prefix=prefix, backend=backend)
    a = convert_moe_block(sd, prefix=prefix)
    assert_equal(model.router[...], a["router"], "router")
    for k in ("w13", "w2", "shared_w13", "shared_w2", "shared_gate"):
        assert_equal(getattr(model, k)[...], a[k], k)
    x = jnp.asarray(rng.standard_normal((2, 5, H)), jnp.float32)
    x2 = x.reshape(-1, H)
    want = moe_jit(x2, jnp.dot(x2, a["router"].T, preferred_element_type=jnp.float32),
                       a["w13"], a["w2"], shared_w13=a["shared_w13"], shared_w2=a["shared_w2"],
                       shared_gate=a["shared_gate"], backend=backend, **cfg.forward_kwargs())
    assert_close(call(model, x), want.reshape(x.shape), jnp.float32, backend)
    # param_dtype casts the checkpoint.
    half = MoE.from_state_dict(cfg, sd, prefix=prefix, param_dtype=jnp.bfloat16,
                               dtype=jnp.bfloat16, backend=backend)
    assert half.w13[...].dtype == jnp.bfloat16 and call(half, x).dtype == jnp.bfloat16


def test_from_state_dict_mismatch(rng):
    cfg = CONFIGS["qwen2"]
    sd = _qwen2_state_dict(rng, "", cfg)
    no_shared = MoEConfig(num_experts=E, topk=3, hidden_size=H, intermediate_size=I)
    with pytest.raises(ValueError, match="shared_w13"):
        MoE.from_state_dict(no_shared, sd)
    wider = MoEConfig(num_experts=E, topk=3, hidden_size=H, intermediate_size=2 * I,
                      shared_intermediate_size=16, shared_expert_gate=True)
    with pytest.raises(ValueError, match="w13"):
        MoE.from_state_dict(wider, sd)
    with pytest.raises(KeyError, match="e_score_correction_bias"):
        MoE.from_state_dict(CONFIGS["deepseek"], sd, layout="qwen")
    del sd["experts.2.down_proj.weight"]
    with pytest.raises(KeyError, match="experts.2.down_proj.weight"):
        MoE.from_state_dict(cfg, sd)


def _train(cfg, backend, steps=12, lr=3e-2):
    teacher = _with_bias(MoE(cfg, rngs=nnx.Rngs(1), backend="reference"),
                         np.random.default_rng(1))
    model = MoE(cfg, rngs=nnx.Rngs(2), backend=backend)
    model.e_score_correction_bias.set_value(teacher.e_score_correction_bias[...])
    x = jax.random.normal(jax.random.key(3), (64, H), jnp.float32)
    y = call(teacher, x)
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        # Plain jax.grad over the parameters (nnx.value_and_grad would do the same).
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params):
            return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        opt.update(model, grads)
        return loss, grads

    losses, first_grads = [], None
    for _ in range(steps):
        loss, grads = step(model, opt, x, y)
        losses.append(float(loss))
        first_grads = grads if first_grads is None else first_grads
    return model, teacher, losses, first_grads


def test_training_reduces_loss():
    """A few optax steps on a toy regression (fit a random teacher MoE) on
    both backends, gradients by jax.grad: the loss goes down; the ffi
    backend's gradients (from its backward kernels) and trajectory are the
    reference's to f32 rounding; the Buffer (correction bias) is not trained."""
    cfg = CONFIGS["all"]
    runs, grads = {}, {}
    for backend in BACKENDS:
        model, teacher, losses, grads[backend] = _train(cfg, backend)
        assert all(np.isfinite(losses)), losses
        assert losses[-1] < 0.5 * losses[0], (backend, losses)
        assert_equal(model.e_score_correction_bias[...], teacher.e_score_correction_bias[...],
                     "bias")
        runs[backend] = losses
    ref, ffi = (jax.tree.leaves(grads[b]) for b in BACKENDS)
    assert len(ref) == len(ffi) == 6  # router, w13, w2, shared_w13, shared_w2, shared_gate
    for r, f in zip(ref, ffi):
        assert float(jnp.max(jnp.abs(r))) > 0
        assert_close(f, r, jnp.float32, "grad")
    np.testing.assert_allclose(runs["ffi"], runs["reference"], rtol=1e-4)


def test_from_fp8_state_dict(rng):
    """An FP8 checkpoint (e4m3 weights with 128 x 128 block scales) loads
    dequantised to param_dtype, with the values convert_moe_block gives."""
    import ml_dtypes

    cfg = CONFIGS["deepseek"]
    sd = {"gate.weight": rng.standard_normal((E, H)).astype(np.float32) / 4,
          "gate.e_score_correction_bias": rng.uniform(0, 0.3, E).astype(np.float32)}
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    mods = [f"experts.{e}" for e in range(E)] + ["shared_experts"]
    for mod in mods:
        for proj, shape in shapes.items():
            if mod == "shared_experts":
                shape = (16, H) if proj != "down_proj" else (H, 16)
            values = (rng.standard_normal(shape) * 100).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
            sd[f"{mod}.{proj}.weight"] = values
            sd[f"{mod}.{proj}.weight_scale_inv"] = np.full((1, 1), 2e-3, np.float32)
    model = MoE.from_state_dict(cfg, sd, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    a = convert_moe_block(sd, dtype=jnp.bfloat16)
    for k in ("w13", "w2", "shared_w13", "shared_w2"):
        assert getattr(model, k)[...].dtype == jnp.bfloat16
        assert_equal(getattr(model, k)[...], a[k], k)
    want = np.asarray(sd["experts.3.down_proj.weight"], np.float32) * np.float32(2e-3)
    assert_equal(model.w2[3], want.astype(jnp.bfloat16), "w2[3] = values x scale")
    out = call(model, jnp.asarray(rng.standard_normal((4, H)), jnp.bfloat16))
    assert out.shape == (4, H) and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


def test_from_fp8_state_dict_kept_fp8(rng):
    """keep_fp8: the routed experts stay e4m3 with their block scales, held
    as Buffers (not Params: not trained), and the forward runs moe_forward's
    fp8 path with them."""
    e, h, i = 4, 64, 128
    cfg = MoEConfig(num_experts=e, topk=2, hidden_size=h, intermediate_size=i,
                    scoring_func="sigmoid", use_correction_bias=True)
    sd = fp8_checkpoint(rng, e, h, i)
    model = MoE.from_state_dict(cfg, sd, layout="deepseek", param_dtype=jnp.bfloat16,
                                dtype=jnp.bfloat16, keep_fp8=True)
    a = convert_moe_block(sd, layout="deepseek", dtype=jnp.bfloat16, keep_fp8=True)
    for k in ("w13", "w2", "w13_scale", "w2_scale"):
        assert isinstance(getattr(model, k), Buffer), k
        assert_equal(getattr(model, k)[...], a[k], k)
    assert model.w13[...].dtype == jnp.float8_e4m3fn
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert len(params) == 1  # the router only
    x = jnp.asarray(rng.standard_normal((6, h)), jnp.bfloat16)
    got = call(model, x)
    logits = x.astype(jnp.float32) @ a["router"].astype(jnp.float32).T
    want = moe_forward(x, logits, a["w13"], a["w2"], e_score_correction_bias=a[
        "e_score_correction_bias"], w13_scale=a["w13_scale"], w2_scale=a["w2_scale"],
        **cfg.forward_kwargs())
    assert_equal(got, want, "the module's forward")
    # Fine-tuning around the frozen fp8 experts: the router's gradient and
    # the input's, on the kernels as on the twin.
    twin = MoE.from_state_dict(cfg, sd, layout="deepseek", param_dtype=jnp.bfloat16,
                               dtype=jnp.bfloat16, keep_fp8=True, backend="reference")

    def loss(m, x):
        return jnp.sum(m(x).astype(jnp.float32) ** 2)

    grads = {}
    for name, m in (("ffi", model), ("reference", twin)):
        g_router, g_x = nnx.grad(loss, argnums=(0, 1))(m, x)
        grads[name] = jax.tree.leaves(g_router) + [g_x]
    assert len(grads["ffi"]) == 2  # the router's, x's
    for f, r in zip(grads["ffi"], grads["reference"]):
        assert float(jnp.max(jnp.abs(r.astype(jnp.float32)))) > 0
        assert rel_err(f, r) <= 3e-2
