"""jax_moe.convert: Hugging Face MoE state dicts and configs -> jax_moe.

For each published layout (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3) a
random state dict with the published names and shapes is converted and
checked piece by piece, then the whole block is run both ways: a float64
numpy implementation of the model's MoE block written from its published
definition (the transformers modeling files) against moe_forward on the
converted arrays with the config from config_from_hf.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from common import assert_equal, fp8_checkpoint, rel_err
from jax_moe import MoEConfig, fp8, moe_forward
from jax_moe.convert import LAYOUTS, config_from_hf, convert_moe_block, detect_layout

BACKENDS = ["reference", "ffi"]
STATIC = ("topk", "renormalize", "activation", "is_gated", "scoring_func", "num_expert_group",
          "topk_group", "routed_scaling_factor", "backend")
moe_jit = jax.jit(moe_forward, static_argnames=STATIC)
ROUNDTRIP_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}

# Small versions of the published configs (config.json fields).
HF_CONFIGS = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                  "hidden_size": 32, "moe_intermediate_size": 16, "intermediate_size": 64,
                  "norm_topk_prob": True, "hidden_act": "silu"},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 3,
                  "hidden_size": 32, "moe_intermediate_size": 16, "intermediate_size": 64,
                  "shared_expert_intermediate_size": 24, "norm_topk_prob": False,
                  "hidden_act": "silu"},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                "hidden_size": 32, "intermediate_size": 16, "hidden_act": "silu"},
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 16, "num_experts_per_tok": 4,
                    "hidden_size": 32, "moe_intermediate_size": 8, "intermediate_size": 64,
                    "n_shared_experts": 2, "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                    "norm_topk_prob": True, "topk_method": "noaux_tc", "hidden_act": "silu"},
}
LAYOUT_OF = {"qwen3_moe": "qwen", "qwen2_moe": "qwen", "mixtral": "mixtral",
             "deepseek_v3": "deepseek"}
PREFIX = {"qwen3_moe": "model.layers.3.mlp.", "qwen2_moe": "", "mixtral":
          "model.layers.1.block_sparse_moe.", "deepseek_v3": "model.layers.5.mlp."}


class ArrayLike:
    """Neither numpy nor jax: only __array__ (as e.g. a lazily loaded tensor)."""

    def __init__(self, a):
        self._a = np.asarray(a)

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


def _dims(hf):
    e = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    i = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    return e, hf["hidden_size"], i


def make_state_dict(model, rng, dtype=np.float32, prefix="", fused=False, distractors=True):
    """A random MoE block state dict with the published names and shapes
    (values as numpy, jax and __array__-only objects, in turn)."""
    hf = HF_CONFIGS[model]
    e, h, i = _dims(hf)
    sd = {}
    wrap = [lambda a: a, jnp.asarray, ArrayLike]
    count = [0]

    def put(name, shape, scale=None):
        a = rng.standard_normal(shape) * (scale if scale is not None else shape[-1] ** -0.5)
        a = a.astype(dtype)
        sd[prefix + name] = wrap[count[0] % 3](a)
        count[0] += 1

    put("gate.weight", (e, h))
    g, u, d = ("w1", "w3", "w2") if model == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    if fused:
        put("experts.gate_up_proj", (e, 2 * i, h), h ** -0.5)
        put("experts.down_proj", (e, h, i))
    else:
        for x in range(e):
            put(f"experts.{x}.{g}.weight", (i, h))
            put(f"experts.{x}.{u}.weight", (i, h))
            put(f"experts.{x}.{d}.weight", (h, i))
    if model == "qwen2_moe":
        i_s = hf["shared_expert_intermediate_size"]
        put("shared_expert.gate_proj.weight", (i_s, h))
        put("shared_expert.up_proj.weight", (i_s, h))
        put("shared_expert.down_proj.weight", (h, i_s))
        put("shared_expert_gate.weight", (1, h))
    if model == "deepseek_v3":
        # DeepSeek-V3 keeps this buffer in float32. Non-negative here: the
        # published router masks the groups it drops with 0.0, not -inf, which
        # is the same choice as long as every eligible score + bias is > 0.
        sd[prefix + "gate.e_score_correction_bias"] = rng.uniform(0.0, 0.3, e).astype(np.float32)
        i_s = hf["n_shared_experts"] * i
        put("shared_experts.gate_proj.weight", (i_s, h))
        put("shared_experts.up_proj.weight", (i_s, h))
        put("shared_experts.down_proj.weight", (h, i_s))
    if distractors:  # the rest of a model's state dict: never read
        sd["model.embed_tokens.weight"] = rng.standard_normal((5, h)).astype(dtype)
        sd["model.layers.99.mlp.gate.weight"] = rng.standard_normal((e + 1, h)).astype(dtype)
        sd[prefix + "../odd"] = np.zeros(1, np.int32)
    return sd


def np64(sd, prefix=""):
    """The block's entries (prefix stripped) as float64 numpy."""
    return {k[len(prefix):]: np.asarray(v).astype(np.float64) for k, v in sd.items()
            if k.startswith(prefix) and jnp.issubdtype(np.asarray(v).dtype, jnp.floating)}


# ---- the published MoE blocks, in float64 numpy --------------------------

def _silu(v):
    return v / (1.0 + np.exp(-v))


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _softmax(v):
    z = np.exp(v - v.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _topk(v, k):
    """torch.topk along the last axis: (values, indices)."""
    idx = np.argsort(-v, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(v, idx, axis=-1), idx


def _mlp(x, gate, up, down):
    """Qwen2MoeMLP / MixtralBlockSparseTop2MLP / DeepseekV3MLP: down(act(gate x) * up x)."""
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def _experts(sd, x, weights, idx, names):
    """The transformers expert loop: each expert runs on the tokens that chose it."""
    g, u, d = names
    out = np.zeros_like(x)
    for e in range(int(sd["gate.weight"].shape[0])):
        tok, slot = np.nonzero(idx == e)
        if tok.size:
            y = _mlp(x[tok], sd[f"experts.{e}.{g}.weight"], sd[f"experts.{e}.{u}.weight"],
                     sd[f"experts.{e}.{d}.weight"])
            np.add.at(out, tok, weights[tok, slot][:, None] * y)
    return out


QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")


def qwen3_moe_block(sd, x, hf):
    """Qwen3MoeSparseMoeBlock: softmax over all experts, top-k, renormalise if norm_topk_prob."""
    probs = _softmax(x @ sd["gate.weight"].T)
    w, idx = _topk(probs, hf["num_experts_per_tok"])
    if hf.get("norm_topk_prob", False):
        w = w / w.sum(axis=-1, keepdims=True)
    return _experts(sd, x, w, idx, QWEN_NAMES)


def qwen2_moe_block(sd, x, hf):
    """Qwen2MoeSparseMoeBlock: Qwen3's routing (norm_topk_prob default False)
    plus sigmoid(shared_expert_gate(x)) * shared_expert(x)."""
    out = qwen3_moe_block(sd, x, hf)
    shared = _mlp(x, sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"],
                  sd["shared_expert.down_proj.weight"])
    return out + _sigmoid(x @ sd["shared_expert_gate.weight"].T) * shared


def mixtral_block(sd, x, hf):
    """Mixtral (as in the original Mistral code): top-k of the logits, softmax over those k."""
    w, idx = _topk(x @ sd["gate.weight"].T, hf["num_experts_per_tok"])
    return _experts(sd, x, _softmax(w), idx, ("w1", "w3", "w2"))


def deepseek_v3_block(sd, x, hf):
    """DeepseekV3MoE: sigmoid scores; the choice on scores + e_score_correction_bias
    among the topk_group groups with the highest top-2 sums; weights = the
    chosen scores, normalised, times routed_scaling_factor; plus the shared experts."""
    e = hf["n_routed_experts"]
    n_group, topk_group, k = hf["n_group"], hf["topk_group"], hf["num_experts_per_tok"]
    scores = _sigmoid(x @ sd["gate.weight"].T)
    choice = scores + sd["gate.e_score_correction_bias"][None, :]
    grouped = choice.reshape(-1, n_group, e // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
    _, group_idx = _topk(group_scores, topk_group)
    group_mask = np.zeros_like(group_scores)
    np.put_along_axis(group_mask, group_idx, 1.0, axis=-1)
    score_mask = np.repeat(group_mask, e // n_group, axis=-1)
    choice = np.where(score_mask > 0, choice, 0.0)
    _, idx = _topk(choice, k)
    w = np.take_along_axis(scores, idx, axis=-1)
    if hf.get("norm_topk_prob", True):
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    w = w * hf["routed_scaling_factor"]
    out = _experts(sd, x, w, idx, QWEN_NAMES)
    return out + _mlp(x, sd["shared_experts.gate_proj.weight"], sd["shared_experts.up_proj.weight"],
                      sd["shared_experts.down_proj.weight"])


HF_BLOCKS = {"qwen3_moe": qwen3_moe_block, "qwen2_moe": qwen2_moe_block,
             "mixtral": mixtral_block, "deepseek_v3": deepseek_v3_block}


# ---- conversion, piece by piece ------------------------------------------

@pytest.mark.parametrize("model", list(HF_CONFIGS))
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pieces(model, dtype, rng):
    prefix = PREFIX[model]
    sd = make_state_dict(model, rng, dtype=dtype, prefix=prefix)
    assert detect_layout(sd, prefix=prefix) == LAYOUT_OF[model]
    out = convert_moe_block(sd, prefix=prefix)
    p = {k[len(prefix):]: np.asarray(v) for k, v in sd.items() if k.startswith(prefix)}
    e, h, i = _dims(HF_CONFIGS[model])
    g, u, d = ("w1", "w3", "w2") if model == "mixtral" else QWEN_NAMES
    want = {"router", "w13", "w2"}
    assert out["w13"].shape == (e, 2 * i, h) and out["w2"].shape == (e, h, i)
    assert_equal(out["router"], p["gate.weight"], "router")
    for x in range(e):
        assert_equal(out["w13"][x, :i], p[f"experts.{x}.{g}.weight"], f"w13[{x}] gate")
        assert_equal(out["w13"][x, i:], p[f"experts.{x}.{u}.weight"], f"w13[{x}] up")
        assert_equal(out["w2"][x], p[f"experts.{x}.{d}.weight"], f"w2[{x}]")
    shared = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}.get(model)
    if shared:
        want |= {"shared_w13", "shared_w2"}
        assert_equal(out["shared_w13"], np.concatenate(
            [p[f"{shared}.gate_proj.weight"], p[f"{shared}.up_proj.weight"]]), "shared_w13")
        assert_equal(out["shared_w2"], p[f"{shared}.down_proj.weight"], "shared_w2")
    if model == "qwen2_moe":
        want.add("shared_gate")
        assert_equal(out["shared_gate"], p["shared_expert_gate.weight"].reshape(h), "shared_gate")
    if model == "deepseek_v3":
        want.add("e_score_correction_bias")
        assert_equal(out["e_score_correction_bias"], p["gate.e_score_correction_bias"], "bias")
    assert set(out) == want
    assert all(isinstance(v, jax.Array) for v in out.values())


@pytest.mark.parametrize("model", list(HF_CONFIGS))
def test_fused_experts_and_forced_layout(model, rng):
    """transformers' fused experts (experts.gate_up_proj (E, 2I, H), experts.down_proj
    (E, H, I)) give the same arrays as the per-expert names; layout can be forced."""
    sd = make_state_dict(model, rng, distractors=False)
    out = convert_moe_block(sd, layout=LAYOUT_OF[model])
    fused = {k: v for k, v in sd.items() if not k.startswith("experts.")}
    fused["experts.gate_up_proj"] = np.asarray(out["w13"])
    fused["experts.down_proj"] = np.asarray(out["w2"])
    again = convert_moe_block(fused, layout=LAYOUT_OF[model])
    assert set(again) == set(out)
    for k in out:
        assert_equal(again[k], out[k], k)
    if model in ("qwen3_moe", "mixtral"):  # nothing in the names tells them apart
        assert detect_layout(fused) == "qwen"


def test_dtype_cast(rng):
    sd = make_state_dict("deepseek_v3", rng)
    out = convert_moe_block(sd, dtype=jnp.bfloat16)
    for k, v in out.items():
        assert v.dtype == (jnp.float32 if k == "e_score_correction_bias" else jnp.bfloat16), k
    ref = convert_moe_block(sd)
    assert_equal(out["w13"], ref["w13"].astype(jnp.bfloat16), "w13")


def test_prefix_without_dot(rng):
    sd = make_state_dict("qwen3_moe", rng, prefix="model.layers.3.mlp.")
    a = convert_moe_block(sd, prefix="model.layers.3.mlp")
    b = convert_moe_block(sd, prefix="model.layers.3.mlp.")
    for k in a:
        assert_equal(a[k], b[k], k)


# ---- round trip: the published block vs moe_forward on the converted arrays

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("model", list(HF_CONFIGS))
def test_roundtrip(model, dtype, backend, rng):
    hf = HF_CONFIGS[model]
    prefix = PREFIX[model]
    tokens = 24
    sd = make_state_dict(model, rng, dtype=dtype, prefix=prefix)
    x = np.asarray(rng.standard_normal((tokens, hf["hidden_size"])).astype(dtype))
    want = HF_BLOCKS[model](np64(sd, prefix), x.astype(np.float64), hf)

    cfg = config_from_hf(hf)
    a = convert_moe_block(sd, prefix=prefix)
    xj = jnp.asarray(x)
    # The model computes the router logits; jax_moe takes them (here in f32).
    logits = jnp.dot(xj.astype(jnp.float32), a["router"].astype(jnp.float32).T,
                     precision="highest")
    got = moe_jit(xj, logits, a["w13"], a["w2"],
                      e_score_correction_bias=a.get("e_score_correction_bias"),
                      shared_w13=a.get("shared_w13"), shared_w2=a.get("shared_w2"),
                      shared_gate=a.get("shared_gate"), backend=backend, **cfg.forward_kwargs())
    assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
    err = rel_err(got, want)
    assert err < ROUNDTRIP_TOL[jnp.dtype(dtype)], f"{model} {backend}: rel err {err:.3g}"


# ---- config_from_hf ------------------------------------------------------

def test_config_small():
    c = config_from_hf(HF_CONFIGS["qwen3_moe"])
    assert c == MoEConfig(num_experts=8, topk=2, hidden_size=32, intermediate_size=16,
                          renormalize=True)
    c = config_from_hf(HF_CONFIGS["qwen2_moe"])
    assert (c.renormalize, c.shared_intermediate_size, c.shared_expert_gate) == (False, 24, True)
    c = config_from_hf(HF_CONFIGS["mixtral"])
    assert (c.num_experts, c.intermediate_size, c.renormalize) == (8, 16, True)
    c = config_from_hf(HF_CONFIGS["deepseek_v3"])
    assert c == MoEConfig(num_experts=16, topk=4, hidden_size=32, intermediate_size=8,
                          renormalize=True, scoring_func="sigmoid", num_expert_group=4,
                          topk_group=2, routed_scaling_factor=2.5, use_correction_bias=True,
                          shared_intermediate_size=16)


def test_config_published():
    """The MoE fields of the published config.json files."""
    qwen3 = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
             "norm_topk_prob": True, "hidden_act": "silu", "decoder_sparse_step": 1,
             "mlp_only_layers": []}  # Qwen3-30B-A3B
    assert config_from_hf(qwen3) == MoEConfig(num_experts=128, topk=8, hidden_size=2048,
                                              intermediate_size=768, renormalize=True)
    qwen2 = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
             "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
             "hidden_act": "silu"}  # Qwen1.5-MoE-A2.7B
    assert config_from_hf(qwen2) == MoEConfig(
        num_experts=60, topk=4, hidden_size=2048, intermediate_size=1408, renormalize=False,
        shared_intermediate_size=5632, shared_expert_gate=True)
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
               "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu"}
    assert config_from_hf(mixtral) == MoEConfig(num_experts=8, topk=2, hidden_size=4096,
                                                intermediate_size=14336, renormalize=True)
    dsv3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
            "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "norm_topk_prob": True,
            "hidden_act": "silu", "first_k_dense_replace": 3}
    assert config_from_hf(dsv3) == MoEConfig(
        num_experts=256, topk=8, hidden_size=7168, intermediate_size=2048, renormalize=True,
        scoring_func="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5,
        use_correction_bias=True, shared_intermediate_size=2048)


def test_config_defaults_and_errors():
    # Defaults by model_type where the config omits a field.
    base = {"hidden_size": 8, "num_experts_per_tok": 2}
    assert config_from_hf({**base, "model_type": "qwen2_moe", "num_experts": 4,
                           "moe_intermediate_size": 4}).renormalize is False
    assert config_from_hf({**base, "model_type": "mixtral", "num_local_experts": 4,
                           "intermediate_size": 4}).renormalize is True
    c = config_from_hf({**base, "model_type": "deepseek_v3", "n_routed_experts": 4,
                        "moe_intermediate_size": 4})
    assert c.scoring_func == "sigmoid" and c.routed_scaling_factor == 2.5
    assert c.use_correction_bias
    assert config_from_hf({**base, "num_experts": 4, "moe_intermediate_size": 4,
                           "hidden_act": "gelu_pytorch_tanh"}).hidden_act == "gelu_tanh"
    with pytest.raises(KeyError, match="num_local_experts"):
        config_from_hf({**base, "intermediate_size": 4})
    with pytest.raises(ValueError, match="relu"):
        config_from_hf({**base, "num_experts": 4, "intermediate_size": 4, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="group_limited_greedy"):
        config_from_hf({**base, "model_type": "deepseek_v2", "n_routed_experts": 4,
                        "moe_intermediate_size": 4, "topk_method": "group_limited_greedy",
                        "n_group": 2, "topk_group": 1})


# ---- broken state dicts ----------------------------------------------------

P = "model.layers.2.mlp."


def _qwen(rng):
    return make_state_dict("qwen2_moe", rng, prefix=P, distractors=False)


def _raises(exc, key, fn):
    with pytest.raises(exc, match=re.escape(key)) as info:
        fn()
    return str(info.value)


def test_missing_expert_weight(rng):
    sd = _qwen(rng)
    del sd[P + "experts.3.up_proj.weight"]
    _raises(KeyError, P + "experts.3.up_proj.weight", lambda: convert_moe_block(sd, prefix=P))


def test_missing_router(rng):
    sd = _qwen(rng)
    del sd[P + "gate.weight"]
    _raises(KeyError, P + "gate.weight", lambda: convert_moe_block(sd, prefix=P))


def test_wrong_shape(rng):
    sd = _qwen(rng)
    e, h, i = _dims(HF_CONFIGS["qwen2_moe"])
    sd[P + "experts.2.down_proj.weight"] = np.zeros((h, i + 1), np.float32)
    msg = _raises(ValueError, P + "experts.2.down_proj.weight",
                  lambda: convert_moe_block(sd, prefix=P))
    assert f"({h}, {i})" in msg  # the expected shape
    sd = _qwen(rng)
    sd[P + "experts.5.gate_proj.weight"] = np.zeros((i + 2, h), np.float32)  # inconsistent I
    _raises(ValueError, P + "experts.5.gate_proj.weight", lambda: convert_moe_block(sd, prefix=P))
    sd = _qwen(rng)
    sd[P + "shared_expert_gate.weight"] = np.zeros((2, h), np.float32)
    _raises(ValueError, P + "shared_expert_gate.weight", lambda: convert_moe_block(sd, prefix=P))
    sd = make_state_dict("deepseek_v3", rng, distractors=False)
    sd["gate.e_score_correction_bias"] = np.zeros(3, np.float32)
    _raises(ValueError, "gate.e_score_correction_bias", lambda: convert_moe_block(sd))


def test_gap_in_expert_numbering(rng):
    sd = _qwen(rng)
    for k in [k for k in sd if k.startswith(P + "experts.4.")]:
        del sd[k]
    msg = _raises(KeyError, P + "experts.4.", lambda: convert_moe_block(sd, prefix=P))
    assert "without gaps" in msg
    # Experts renumbered past the router's E rows.
    sd = _qwen(rng)
    for k in [k for k in sd if k.startswith(P + "experts.4.")]:
        sd[k.replace("experts.4.", "experts.8.")] = sd.pop(k)
    with pytest.raises((KeyError, ValueError), match=re.escape(P + "experts.")):
        convert_moe_block(sd, prefix=P)


def test_unknown_layout(rng):
    sd = _qwen(rng)
    _raises(ValueError, "'llama'", lambda: convert_moe_block(sd, prefix=P, layout="llama"))
    # Nothing recognisable under the prefix.
    _raises(ValueError, "model.layers.7.mlp.gate.weight",
            lambda: convert_moe_block(sd, prefix="model.layers.7.mlp."))
    # A forced layout that does not match the names.
    _raises(KeyError, P + "experts.0.w1.weight",
            lambda: convert_moe_block(sd, prefix=P, layout="mixtral"))


def test_unrecognised_and_bad_keys(rng):
    sd = make_state_dict("deepseek_v3", rng, distractors=False)
    sd["experts.0.gate_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)  # FP8 scales
    _raises(ValueError, "experts.0.gate_proj.weight_scale_inv", lambda: convert_moe_block(sd))
    sd = _qwen(rng)
    del sd[P + "shared_expert_gate.weight"]
    _raises(KeyError, P + "shared_expert_gate.weight", lambda: convert_moe_block(sd, prefix=P))
    sd = _qwen(rng)
    sd[P + "experts.1.up_proj.weight"] = np.zeros((16, 32), np.int32)
    _raises(TypeError, P + "experts.1.up_proj.weight", lambda: convert_moe_block(sd, prefix=P))
    sd = _qwen(rng)  # mixed precision: only with an explicit dtype
    sd[P + "experts.3.down_proj.weight"] = np.asarray(sd[P + "experts.3.down_proj.weight"],
                                                      np.float16)
    _raises(ValueError, P + "experts.3.down_proj.weight", lambda: convert_moe_block(sd, prefix=P))
    assert convert_moe_block(sd, prefix=P, dtype=np.float32)["w2"].dtype == jnp.float32
    sd = make_state_dict("qwen3_moe", rng, distractors=False)
    sd["experts.gate_up_proj"] = np.zeros((8, 32, 32), np.float32)  # fused and per-expert
    _raises(ValueError, "experts.gate_up_proj", lambda: convert_moe_block(sd))


def test_all_layouts_listed():
    assert LAYOUTS == ("qwen", "mixtral", "deepseek")


# ---- flax stays optional ---------------------------------------------------

def test_import_does_not_need_flax():
    code = "\n".join([
        "import sys",
        "import jax_moe, jax_moe.convert",
        "assert 'flax' not in sys.modules, 'import jax_moe imported flax'",
        "sys.modules['flax'] = None  # flax missing: jax_moe.nn says what to install",
        "try:",
        "    import jax_moe.nn",
        "except ImportError as e:",
        "    print('ERR', e)",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "pip install" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("key, value, exc, match", [
    ("norm_topk_prob", "false", TypeError, "norm_topk_prob"),   # would read as True
    ("norm_topk_prob", 0, TypeError, "norm_topk_prob"),
    ("num_experts_per_tok", 2.5, TypeError, "num_experts_per_tok"),  # never truncated
    ("num_experts_per_tok", "2", TypeError, "num_experts_per_tok"),
    ("num_local_experts", 8.0, TypeError, "num_local_experts"),
    ("hidden_size", True, TypeError, "hidden_size"),
    ("routed_scaling_factor", "2.5", TypeError, "routed_scaling_factor"),
    ("n_group", 4.5, TypeError, "n_group"),
])
def test_config_rejects_mistyped_fields(key, value, exc, match):
    cfg = dict(HF_CONFIGS["mixtral"], **{key: value})
    if key == "n_group":
        cfg.update(topk_group=2, num_local_experts=8)
    with pytest.raises(exc, match=match):
        config_from_hf(cfg)


def test_config_accepts_numpy_ints():
    cfg = dict(HF_CONFIGS["mixtral"], num_experts_per_tok=np.int64(2))
    assert config_from_hf(cfg).topk == 2


@pytest.mark.parametrize("field", ["is_gated", "renormalize", "use_correction_bias",
                                   "shared_expert_gate"])
def test_moe_config_bool_fields_must_be_bools(field):
    kwargs = dict(num_experts=8, topk=2, hidden_size=32, intermediate_size=16,
                  shared_intermediate_size=8, **{field: "false"})
    with pytest.raises(TypeError, match=field):
        MoEConfig(**kwargs)


# ---- FP8 checkpoints (block-scaled float8_e4m3fn weights) -------------------

def _fp8_weight(rng, rows, cols):
    """(e4m3 values, f32 block scales) with 128 x 128 blocks; one block's
    scale 0, one huge."""
    values = (rng.standard_normal((rows, cols)) * 100).clip(-448, 448)
    values = values.astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.5, 2.0, (-(-rows // 128), -(-cols // 128))).astype(np.float32)
    scales.flat[0] = 0.0
    scales.flat[-1] = 1e30
    return values, scales


def _np_dequantized(values, scales, dtype):
    """Each value times its block's scale, in f32, then `dtype`."""
    rows, cols = values.shape
    full = np.kron(scales, np.ones((128, 128), np.float32))[:rows, :cols]
    return (values.astype(np.float32) * full).astype(dtype)


def _fp8_deepseek(rng, e=3, h=200, i=136, i_s=136):
    """A DeepSeek-V3 FP8 block: routed and shared experts in e4m3 with
    weight_scale_inv, the router and the bias as published (bf16 / f32).
    H and I are not multiples of 128."""
    sd = {"gate.weight": rng.standard_normal((e, h)).astype(jnp.bfloat16),
          "gate.e_score_correction_bias": rng.uniform(0, 0.3, e).astype(np.float32)}
    names = [(f"experts.{x}.{p}", (h, i) if p == "down_proj" else (i, h))
             for x in range(e) for p in ("gate_proj", "up_proj", "down_proj")]
    names += [(f"shared_experts.{p}", (h, i_s) if p == "down_proj" else (i_s, h))
              for p in ("gate_proj", "up_proj", "down_proj")]
    for name, shape in names:
        sd[name + ".weight"], sd[name + ".weight_scale_inv"] = _fp8_weight(rng, *shape)
    return sd


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=str)
def test_fp8_checkpoint_converted_dequantised(rng, dtype):
    sd = _fp8_deepseek(rng)
    out = convert_moe_block(sd, dtype=dtype)
    assert out["w13"].dtype == jnp.dtype(dtype) and out["w13"].shape == (3, 272, 200)
    for x in range(3):
        deq = {p: _np_dequantized(sd[f"experts.{x}.{p}.weight"],
                                  sd[f"experts.{x}.{p}.weight_scale_inv"], dtype)
               for p in ("gate_proj", "up_proj", "down_proj")}
        want13 = np.concatenate([deq["gate_proj"], deq["up_proj"]], axis=0)
        assert_equal(out["w13"][x], want13, f"w13[{x}]")
        assert_equal(out["w2"][x], deq["down_proj"], f"w2[{x}]")
    want_shared = np.concatenate([_np_dequantized(sd[f"shared_experts.{p}.weight"],
                                                  sd[f"shared_experts.{p}.weight_scale_inv"],
                                                  dtype) for p in ("gate_proj", "up_proj")])
    assert_equal(out["shared_w13"], want_shared, "shared_w13")
    # the block scaled by 0 is zero, the huge one finite
    assert not np.any(np.asarray(out["w13"][0, :128, :128], np.float32))
    assert np.all(np.isfinite(np.asarray(out["w2"], np.float32)))


def test_fp8_checkpoint_errors_name_the_key(rng):
    sd = _fp8_deepseek(rng)
    msg = _raises(ValueError, "experts.0.gate_proj.weight", lambda: convert_moe_block(sd))
    assert "dtype=" in msg  # fp8 needs an explicit dtype to dequantise to
    sd = _fp8_deepseek(rng)
    del sd["experts.1.up_proj.weight_scale_inv"]
    _raises(KeyError, "experts.1.up_proj.weight_scale_inv",
            lambda: convert_moe_block(sd, dtype=jnp.bfloat16))
    sd = _fp8_deepseek(rng)
    sd["experts.2.down_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    msg = _raises(ValueError, "experts.2.down_proj.weight_scale_inv",
                  lambda: convert_moe_block(sd, dtype=jnp.bfloat16))
    assert "(2, 2)" in msg  # the expected block grid of a (200, 136) weight
    sd = _fp8_deepseek(rng)  # a scale beside a weight that is not fp8
    sd["experts.0.down_proj.weight"] = np.zeros((200, 136), np.float32)
    _raises(ValueError, "experts.0.down_proj.weight_scale_inv",
            lambda: convert_moe_block(sd, dtype=jnp.bfloat16))


def test_fp8_checkpoint_kept_fp8(rng):
    """keep_fp8: the routed experts' codes and block scales as stored
    (gate and up stacked), the router and shared experts dequantised."""
    sd = _fp8_deepseek(rng, e=3, h=200, i=256, i_s=136)
    out = convert_moe_block(sd, dtype=jnp.bfloat16, keep_fp8=True)
    assert out["w13"].dtype == jnp.float8_e4m3fn and out["w13"].shape == (3, 512, 200)
    assert out["w2"].dtype == jnp.float8_e4m3fn and out["w2"].shape == (3, 200, 256)
    assert out["w13_scale"].shape == (3, 4, 2) and out["w2_scale"].shape == (3, 2, 2)
    for x in range(3):
        codes = {p: sd[f"experts.{x}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
        scales = {p: sd[f"experts.{x}.{p}.weight_scale_inv"]
                  for p in ("gate_proj", "up_proj", "down_proj")}
        assert_equal(out["w13"][x], np.concatenate([codes["gate_proj"], codes["up_proj"]]),
                     f"w13[{x}]")
        assert_equal(out["w13_scale"][x],
                     np.concatenate([scales["gate_proj"], scales["up_proj"]]), f"w13_scale[{x}]")
        assert_equal(out["w2"][x], codes["down_proj"], f"w2[{x}]")
        assert_equal(out["w2_scale"][x], scales["down_proj"], f"w2_scale[{x}]")
    assert out["shared_w13"].dtype == jnp.bfloat16  # dequantised, as without keep_fp8
    # The kept weights are the dequantised conversion's numbers.
    deq = convert_moe_block(sd, dtype=jnp.float32)
    assert_equal(fp8.dequantize_blocks(out["w13"], out["w13_scale"]), deq["w13"], "w13")
    assert_equal(fp8.dequantize_blocks(out["w2"], out["w2_scale"]), deq["w2"], "w2")


def test_fp8_checkpoint_round_trip_runs_the_layer(rng):
    """A small random FP8 block converted with keep_fp8 runs moe_forward on
    both backends with the same result."""
    h = 256
    sd = fp8_checkpoint(rng, 4, h, 128)
    out = convert_moe_block(sd, dtype=jnp.bfloat16, keep_fp8=True)
    x = jnp.asarray(rng.standard_normal((24, h)), jnp.bfloat16)
    logits = (x.astype(jnp.float32) @ out["router"].astype(jnp.float32).T)
    kw = dict(topk=2, scoring_func="sigmoid", e_score_correction_bias=out["e_score_correction_bias"],
              w13_scale=out["w13_scale"], w2_scale=out["w2_scale"])
    got = moe_forward(x, logits, out["w13"], out["w2"], **kw)
    want = moe_forward(x, logits, out["w13"], out["w2"], backend="reference", **kw)
    assert rel_err(got, want) <= 2e-2


def test_fp8_keep_errors(rng):
    sd = _fp8_deepseek(rng, i=136)  # I = 136: gate and up blocks would straddle
    msg = _raises(ValueError, "experts.0.gate_proj.weight",
                  lambda: convert_moe_block(sd, dtype=jnp.bfloat16, keep_fp8=True))
    assert "multiple of 128" in msg
    sd = _fp8_deepseek(rng, i=128)
    sd["experts.1.up_proj.weight"] = np.zeros((128, 200), np.float32)
    _raises(ValueError, "experts.1.up_proj.weight",
            lambda: convert_moe_block(sd, dtype=jnp.bfloat16, keep_fp8=True))
    with pytest.raises(TypeError, match="keep_fp8 must be a bool"):
        convert_moe_block(_fp8_deepseek(rng, i=128), dtype=jnp.bfloat16, keep_fp8="yes")


# ---- argument errors and the other array and config forms -------------------

class _Unreadable:
    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("the file is gone")


def test_argument_errors_name_the_argument(rng):
    sd = make_state_dict("qwen3_moe", rng, distractors=False)
    with pytest.raises(TypeError, match="state_dict must be a mapping of names to arrays, got list"):
        convert_moe_block(list(sd.values()))
    with pytest.raises(TypeError, match="prefix must be a str, got 3"):
        convert_moe_block(sd, prefix=3)
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16 .* got int32"):
        convert_moe_block(sd, dtype=np.int32)
    # Floats the layer cannot take: fp8 without scales (keep_fp8 keeps the
    # checkpoint's), float64 (jax would truncate it to float32 with a warning).
    with pytest.raises(TypeError, match="keep_fp8=True keeps fp8 experts.*float8_e4m3fn"):
        convert_moe_block(sd, dtype=jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16 .* float64"):
        convert_moe_block(sd, dtype=np.float64)
    with pytest.raises(TypeError, match="hf_config must be a dict .* got list"):
        config_from_hf([("hidden_size", 32)])


def test_broken_arrays_name_the_key(rng):
    sd = make_state_dict("qwen3_moe", rng, distractors=False)
    sd["gate.weight"] = np.zeros((8, 32, 1), np.float32)
    _raises(ValueError, "'gate.weight' has shape (8, 32, 1), expected rank 2",
            lambda: convert_moe_block(sd))
    sd = make_state_dict("qwen3_moe", rng, distractors=False)
    sd["experts.1.up_proj.weight"] = _Unreadable()
    msg = _raises(TypeError, "'experts.1.up_proj.weight': cannot be converted",
                  lambda: convert_moe_block(sd))
    assert "the file is gone" in msg
    e, h, i = _dims(HF_CONFIGS["qwen3_moe"])
    fused = make_state_dict("qwen3_moe", rng, fused=True, distractors=False)
    fused["experts.gate_up_proj"] = np.zeros((e, 2 * i + 1, h), np.float32)
    _raises(ValueError, "with an even 2*I", lambda: convert_moe_block(fused))
    # A router and nothing else under the prefix, the layout forced.
    _raises(KeyError, "no routed experts found under 'experts.'",
            lambda: convert_moe_block({"gate.weight": np.zeros((e, h), np.float32)},
                                      layout="qwen"))


def test_qwen_shared_gate_without_its_expert(rng):
    sd = _qwen(rng)
    for k in [k for k in sd if k.startswith(P + "shared_expert.")]:
        del sd[k]
    msg = _raises(KeyError, P + "shared_expert.gate_proj.weight",
                  lambda: convert_moe_block(sd, prefix=P))
    assert "shared_expert_gate.weight gates" in msg


def test_fp8_fused_experts_are_refused(rng):
    """Block-scaled fp8 weights are read per expert: the fused (E, 2I, H)
    form in fp8 is an error naming the key, not a wrong dequantisation."""
    sd = fp8_checkpoint(rng, 2, 128, 128)
    codes = np.stack([np.concatenate([sd[f"experts.{x}.gate_proj.weight"],
                                      sd[f"experts.{x}.up_proj.weight"]]) for x in range(2)])
    down = np.stack([sd[f"experts.{x}.down_proj.weight"] for x in range(2)])
    fused = {k: v for k, v in sd.items() if not k.startswith("experts.")}
    fused["experts.gate_up_proj"], fused["experts.down_proj"] = codes, down
    msg = _raises(ValueError, "'experts.gate_up_proj' is float8_e4m3fn with shape (2, 256, 128)",
                  lambda: convert_moe_block(fused, dtype=jnp.bfloat16))
    assert "per expert (rank 2) only" in msg


class _TorchLikeBf16:
    """The attributes of a CPU torch bfloat16 tensor that the converter uses
    (torch is not a dependency): detach, cpu, dtype, float().numpy()."""

    dtype = "torch.bfloat16"

    def __init__(self, a):
        self._a = np.asarray(a, np.float32)

    def detach(self):
        return self

    def cpu(self):
        return self

    def float(self):
        return self

    def numpy(self):
        return self._a


def test_torch_bfloat16_and_config_objects(rng):
    sd = make_state_dict("qwen3_moe", rng, dtype=jnp.bfloat16, distractors=False)
    want = convert_moe_block(sd)
    torch_like = {k: _TorchLikeBf16(np.asarray(v).astype(np.float32)) for k, v in sd.items()}
    got = convert_moe_block(torch_like)
    for k in want:
        assert got[k].dtype == jnp.bfloat16, k
        assert_equal(got[k], want[k], k)

    class Config:  # a transformers PretrainedConfig: to_dict()
        def to_dict(self):
            return dict(HF_CONFIGS["mixtral"])

    assert config_from_hf(Config()) == config_from_hf(HF_CONFIGS["mixtral"])
    # A multimodal wrapper keeps the language model's fields under text_config.
    wrapped = {"model_type": "wrapper", "text_config": dict(HF_CONFIGS["qwen3_moe"])}
    assert config_from_hf(wrapped) == config_from_hf(HF_CONFIGS["qwen3_moe"])
