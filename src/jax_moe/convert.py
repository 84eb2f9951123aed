"""Hugging Face MoE checkpoints -> jax_moe arrays and MoEConfig.

``convert_moe_block`` turns the state dict of one MoE block (the ``mlp`` /
``block_sparse_moe`` module of a decoder layer) into the arrays that
``moe_forward`` takes; ``config_from_hf`` turns a model's ``config.json``
into a ``MoEConfig``. Supported layouts (the published parameter names):

* ``"qwen"`` (Qwen2-MoE, Qwen3-MoE)::

    gate.weight                      (E, H)
    experts.{e}.gate_proj.weight     (I, H)
    experts.{e}.up_proj.weight       (I, H)
    experts.{e}.down_proj.weight     (H, I)
    shared_expert.{gate,up}_proj.weight (I_s, H), shared_expert.down_proj.weight (H, I_s)
    shared_expert_gate.weight        (1, H)          (Qwen2-MoE only)

* ``"mixtral"``: ``gate.weight``; ``experts.{e}.w1.weight`` (gate, (I, H)),
  ``experts.{e}.w3.weight`` (up, (I, H)), ``experts.{e}.w2.weight`` (down, (H, I)).

* ``"deepseek"`` (DeepSeek-V3): ``gate.weight``, ``gate.e_score_correction_bias``
  (E,); ``experts.{e}.{gate,up,down}_proj.weight``;
  ``shared_experts.{gate,up,down}_proj.weight``.

In every layout the routed experts may also come already fused, as newer
transformers releases store them: ``experts.gate_up_proj`` (E, 2*I, H) =
concat(gate, up) and ``experts.down_proj`` (E, H, I).

Block-scaled fp8 weights (``weight`` in float8_e4m3fn beside its
``weight_scale_inv``) are dequantised on the host to the requested dtype.

The router is not applied here: the model computes ``router_logits = x @
router.T`` (in f32 for DeepSeek-V3) and passes them to ``moe_forward``.
"""

from __future__ import annotations

import operator
import re
import sys
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jax_moe import _checks, fp8
from jax_moe.layer import MoEConfig

__all__ = ["convert_moe_block", "config_from_hf", "detect_layout", "LAYOUTS"]

LAYOUTS = ("qwen", "mixtral", "deepseek")

# (gate, up, down) parameter names of one routed expert.
_EXPERT_PROJ = {
    "qwen": ("gate_proj", "up_proj", "down_proj"),
    "deepseek": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
# The shared expert's module name (None: the layout has none).
_SHARED = {"qwen": "shared_expert", "deepseek": "shared_experts", "mixtral": None}
# Top-level names that belong to a MoE block: every key under the prefix that
# starts with one of these must be consumed (quantisation scales or biases
# that this converter does not understand are an error, not silently dropped).
_BLOCK_ROOTS = ("gate.", "experts.", "shared_expert.", "shared_experts.", "shared_expert_gate.")
# The block's names that do not end in ".weight".
_NON_WEIGHT_NAMES = {"gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj"}
_EXPERT_KEY = re.compile(r"^experts\.(\d+)\.")


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


class _Block:
    """The state dict seen through the prefix, with checked access."""

    def __init__(self, state_dict, prefix: str, dequantize_to=None):
        if not (hasattr(state_dict, "keys") and hasattr(state_dict, "__getitem__")):
            raise TypeError(
                f"state_dict must be a mapping of names to arrays, got {type(state_dict).__name__}")
        self.sd = state_dict
        self.prefix = prefix
        self.local = [k[len(prefix):] for k in state_dict.keys()
                      if isinstance(k, str) and k.startswith(prefix)]
        self.names = set(self.local)
        self.used: set[str] = set()
        self.dequantize_to = dequantize_to  # the dtype fp8 weights become (None: an error)

    def full(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, shape=None, rank: int | None = None, what: str = "",
            raw_fp8: bool = False) -> np.ndarray:
        """The array `name` as numpy, checked against `shape` (None entries:
        any); an fp8 weight dequantised unless raw_fp8 (its codes as stored)."""
        key = self.full(name)
        if name not in self.names:
            hint = f" ({what})" if what else ""
            raise KeyError(f"missing key {key!r}{hint}")
        arr = _as_numpy(self.sd[key], key)
        self.used.add(name)
        if arr.dtype == fp8.FP8 and not raw_fp8:
            arr = self._dequantized(name, arr)
        if shape is not None:
            rank = len(shape)
        if rank is not None and arr.ndim != rank:
            want = _shape_str(["?" if s is None else s for s in shape]) if shape else f"rank {rank}"
            raise ValueError(f"{key!r} has shape {arr.shape}, expected {want}")
        if shape is not None and any(w is not None and w != s for w, s in zip(shape, arr.shape)):
            want = _shape_str(["?" if s is None else s for s in shape])
            raise ValueError(f"{key!r} has shape {arr.shape}, expected {want}")
        return arr

    def block_scales(self, name: str, values: np.ndarray) -> np.ndarray:
        """The f32 128 x 128 block scales (`name`_scale_inv) of fp8 weight `name`."""
        key, scale_name = self.full(name), name + "_scale_inv"
        if values.ndim != 2:
            raise ValueError(f"{key!r} is float8_e4m3fn with shape {values.shape}: block-scaled "
                             f"fp8 weights are read per expert (rank 2) only")
        if scale_name not in self.names:
            raise KeyError(f"missing key {self.full(scale_name)!r}: {key!r} is float8_e4m3fn "
                           f"and needs its 128 x 128 block scales")
        n, k = values.shape
        return self.get(scale_name, (fp8.blocks(n), fp8.blocks(k)),
                        what="the weight's 128 x 128 block scales").astype(np.float32)

    def _dequantized(self, name: str, values: np.ndarray) -> np.ndarray:
        """An fp8 weight times its 128 x 128 block scales (`name`_scale_inv),
        in self.dequantize_to."""
        key = self.full(name)
        scales = self.block_scales(name, values)
        if self.dequantize_to is None:
            raise ValueError(f"{key!r} is a block-scaled fp8 weight: pass dtype= (e.g. "
                             f"jnp.bfloat16) to convert it dequantised, or keep_fp8=True")
        n, k = values.shape
        full = np.repeat(np.repeat(scales, fp8.BLOCK, axis=0), fp8.BLOCK, axis=1)[:n, :k]
        return (values.astype(np.float32) * full).astype(self.dequantize_to)


def _as_numpy(value, key: str) -> np.ndarray:
    """numpy view/copy of an array-like (numpy, jax, torch, anything with
    __array__); torch bfloat16 goes through float32 (exact)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor (torch not imported)
        value = value.detach().cpu()
        if str(getattr(value, "dtype", "")) == "torch.bfloat16":
            value = value.float().numpy().astype(jnp.bfloat16)
        elif str(getattr(value, "dtype", "")) == "torch.float8_e4m3fn":  # numpy has no fp8
            value = value.view(sys.modules["torch"].uint8).numpy().view(fp8.FP8)
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - re-raised with the key's name
        raise TypeError(f"{key!r}: cannot be converted to an array ({e})") from e
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(f"{key!r} must hold floating-point values, got dtype {arr.dtype}")
    return arr


def detect_layout(state_dict, *, prefix: str = "") -> str:
    """The layout ("qwen" | "mixtral" | "deepseek") of the MoE block under
    `prefix`, from its key names. Fused experts without a shared expert or a
    correction bias are the same in every layout; they are reported as "qwen"."""
    return _detect(_Block(state_dict, _norm_prefix(prefix)))


def _norm_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {prefix!r}")
    return prefix + "." if prefix and not prefix.endswith(".") else prefix


def _detect(b: _Block) -> str:
    names = b.names
    if ("gate.e_score_correction_bias" in names
            or any(n.startswith("shared_experts.") for n in names)):
        return "deepseek"
    if any(re.match(r"^experts\.\d+\.w[123]\.weight$", n) for n in names):
        return "mixtral"
    if (any(re.match(r"^experts\.\d+\.(gate|up|down)_proj\.weight$", n) for n in names)
            or any(n.startswith(("shared_expert.", "shared_expert_gate.")) for n in names)
            or "experts.gate_up_proj" in names):
        return "qwen"
    found = sorted(names)[:8]
    raise ValueError(
        f"cannot detect the MoE layout under prefix {b.prefix!r}: expected keys such as "
        f"{b.full('gate.weight')!r} and {b.full('experts.0.gate_proj.weight')!r} (Qwen, DeepSeek) "
        f"or {b.full('experts.0.w1.weight')!r} (Mixtral); found "
        f"{[b.full(n) for n in found] if found else 'no keys with that prefix'}"
        f"{' ...' if len(names) > 8 else ''}")


def _result_dtype(arrays, dtype):
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.result_type(*[a.dtype for a in arrays])


def _routed_experts(b: _Block, layout: str, num_experts: int, hidden: int, dtype,
                    keep_fp8: bool = False):
    """(w13 (E, 2I, H), w2 (E, H, I)) as numpy arrays; with keep_fp8 and fp8
    experts, (w13, w2, w13_scale, w2_scale) with the codes as stored."""
    fused = b.has("experts.gate_up_proj") or b.has("experts.down_proj")
    indices = sorted({int(m.group(1)) for n in b.names if (m := _EXPERT_KEY.match(n))})
    if fused:
        if indices:
            raise ValueError(
                f"{b.full('experts.gate_up_proj')!r} (fused experts) and per-expert keys such as "
                f"{b.full(f'experts.{indices[0]}.')!r}... are both present; give one or the other")
        gate_up = b.get("experts.gate_up_proj", (num_experts, None, hidden),
                        what="fused (E, 2*I, H) gate and up projections")
        if gate_up.shape[1] % 2:
            raise ValueError(f"{b.full('experts.gate_up_proj')!r} has shape {gate_up.shape}, "
                             f"expected (E={num_experts}, 2*I, H={hidden}) with an even 2*I")
        inter = gate_up.shape[1] // 2
        down = b.get("experts.down_proj", (num_experts, hidden, inter),
                     what="fused (E, H, I) down projections")
        out_dtype = _result_dtype([gate_up, down], dtype)
        return gate_up.astype(out_dtype, copy=False), down.astype(out_dtype, copy=False)

    g_name, u_name, d_name = _EXPERT_PROJ[layout]
    if not indices:
        raise KeyError(f"missing key {b.full(f'experts.0.{g_name}.weight')!r}: no routed experts "
                       f"found under {b.full('experts.')!r} (layout {layout!r})")
    extra = [i for i in indices if i >= num_experts]
    if extra:
        raise ValueError(
            f"found expert {extra[0]} ({b.full(f'experts.{extra[0]}.')!r}...) but "
            f"{b.full('gate.weight')!r} has E={num_experts} rows: experts must be numbered "
            f"0..{num_experts - 1}")
    missing = sorted(set(range(num_experts)) - set(indices))
    if missing:
        raise KeyError(
            f"missing key {b.full(f'experts.{missing[0]}.{g_name}.weight')!r}: experts must be "
            f"numbered 0..{num_experts - 1} without gaps ({b.full('gate.weight')!r} has "
            f"E={num_experts} rows), missing expert(s) {missing[:8]}")

    first = b.get(f"experts.0.{g_name}.weight", (None, hidden), what="expert 0's gate projection",
                  raw_fp8=keep_fp8)
    if keep_fp8 and first.dtype == fp8.FP8:
        return _routed_experts_fp8(b, num_experts, hidden, (g_name, u_name, d_name), first)
    inter = first.shape[0]
    out_dtype = first.dtype if dtype is None else dtype
    # Filled expert by expert: a lazily loading state dict never holds more
    # than one expert's arrays besides the result.
    w13 = np.empty((num_experts, 2 * inter, hidden), out_dtype)
    w2 = np.empty((num_experts, hidden, inter), out_dtype)
    for e in range(num_experts):
        for name, shape, dst in ((g_name, (inter, hidden), w13[e, :inter]),
                                 (u_name, (inter, hidden), w13[e, inter:]),
                                 (d_name, (hidden, inter), w2[e])):
            key = f"experts.{e}.{name}.weight"
            a = first if e == 0 and name == g_name else b.get(key, shape)
            if dtype is None and a.dtype != out_dtype:
                raise ValueError(
                    f"{b.full(key)!r} is {a.dtype} but {b.full(f'experts.0.{g_name}.weight')!r} "
                    f"is {out_dtype}: pass dtype= to convert mixed-precision experts")
            dst[...] = a
    return w13, w2


def _routed_experts_fp8(b: _Block, num_experts: int, hidden: int, names, first):
    """The routed experts kept in fp8: w13 (E, 2I, H) and w2 (E, H, I) codes,
    w13_scale (E, 2I/128, ceil(H/128)) and w2_scale (E, ceil(H/128),
    ceil(I/128)). The gate's and the up projection's block rows stack into
    w13's only when I is a multiple of 128 (else a block would straddle them)."""
    g_name, u_name, d_name = names
    inter = first.shape[0]
    if inter % fp8.BLOCK:
        raise ValueError(
            f"{b.full(f'experts.0.{g_name}.weight')!r} has I={inter} rows: keep_fp8 stacks the "
            f"gate and up projections' 128-row scale blocks into w13's, so I must be a multiple "
            f"of {fp8.BLOCK} (convert with dtype= and keep_fp8=False to dequantise)")
    ib, hb = inter // fp8.BLOCK, fp8.blocks(hidden)
    w13 = np.empty((num_experts, 2 * inter, hidden), fp8.FP8)
    w2 = np.empty((num_experts, hidden, inter), fp8.FP8)
    s13 = np.empty((num_experts, 2 * ib, hb), np.float32)
    s2 = np.empty((num_experts, hb, fp8.blocks(inter)), np.float32)
    for e in range(num_experts):
        for name, shape, dst, sdst in ((g_name, (inter, hidden), w13[e, :inter], s13[e, :ib]),
                                       (u_name, (inter, hidden), w13[e, inter:], s13[e, ib:]),
                                       (d_name, (hidden, inter), w2[e], s2[e])):
            key = f"experts.{e}.{name}.weight"
            a = first if e == 0 and name == g_name else b.get(key, shape, raw_fp8=True)
            if a.dtype != fp8.FP8:
                raise ValueError(f"{b.full(key)!r} is {a.dtype} but keep_fp8 found expert 0 in "
                                 f"float8_e4m3fn: every routed expert must be fp8 to keep fp8")
            dst[...] = a
            sdst[...] = b.block_scales(key, a)
    return w13, w2, s13, s2


def _shared_expert(b: _Block, name: str, hidden: int, dtype):
    """(shared_w13 (2*I_s, H), shared_w2 (H, I_s)) of the module `name`."""
    g = b.get(f"{name}.gate_proj.weight", (None, hidden), what="shared expert's gate projection")
    inter = g.shape[0]
    u = b.get(f"{name}.up_proj.weight", (inter, hidden))
    d = b.get(f"{name}.down_proj.weight", (hidden, inter))
    out_dtype = _result_dtype([g, u, d], dtype)
    return (np.concatenate([g, u], axis=0).astype(out_dtype, copy=False),
            d.astype(out_dtype, copy=False))


def _unrecognised(b: _Block, layout: str, names) -> None:
    bad = sorted(n for n in names if n.startswith(_BLOCK_ROOTS))
    if bad:
        raise ValueError(
            f"unrecognised keys in the {layout!r} MoE block: {[b.full(n) for n in bad[:8]]}"
            f"{' ...' if len(bad) > 8 else ''} (biases are not supported, nor quantisation "
            f"scales other than a float8_e4m3fn weight's own `weight_scale_inv`)")


def convert_moe_block(state_dict: Mapping, *, prefix: str = "", layout: str | None = None,
                      dtype=None, keep_fp8: bool = False) -> dict:
    """One Hugging Face MoE block's weights -> ``moe_forward``'s arrays.

    state_dict: a mapping name -> array-like (numpy, jax, torch, anything with
    ``__array__``), e.g. a model's full ``state_dict()`` or a safetensors
    shard loaded as a dict. prefix: prepended to every name, e.g.
    ``"model.layers.3.mlp."`` (a missing final "." is added). layout: "qwen"
    | "mixtral" | "deepseek" or None to detect it from the names (see the
    module docstring for each layout's names and shapes). dtype: float32,
    bfloat16 or float16, every output cast to it (default: keep the
    checkpoint's dtype);
    ``e_score_correction_bias`` is always float32.

    Returns a dict of jax arrays::

        router                   (E, H)      router_logits = x @ router.T
        w13                      (E, 2I, H)  concat(gate_proj, up_proj) per expert
        w2                       (E, H, I)   down_proj per expert
        e_score_correction_bias  (E,)        DeepSeek-V3 only
        shared_w13               (2I_s, H)   with a shared expert (Qwen2-MoE, DeepSeek-V3)
        shared_w2                (H, I_s)
        shared_gate              (H,)        Qwen2-MoE's shared_expert_gate

    Raises KeyError for a missing name (experts must be numbered 0..E-1, E
    being gate.weight's rows), ValueError for a misshapen array, an unknown
    layout or an unrecognised key of the block (a bias, say), TypeError for a
    non-float array. Every message names the full key and, for shapes, the
    expected shape.

    FP8 checkpoints (DeepSeek-V3, Qwen3-MoE FP8): a ``float8_e4m3fn`` weight
    with its ``weight_scale_inv`` (one f32 scale per 128 x 128 block, shape
    (ceil(rows/128), ceil(cols/128))) is converted dequantised (value x its
    block's scale, computed in f32) to `dtype`, which must then be given.
    With keep_fp8=True the routed experts stay fp8 instead: ``w13`` and
    ``w2`` hold the checkpoint's float8_e4m3fn codes and the result gains
    ``w13_scale`` (E, 2I/128, ceil(H/128)) and ``w2_scale`` (E, ceil(H/128),
    ceil(I/128)), ``moe_forward``'s arguments of those names (I must be a
    multiple of 128). The router and shared experts are still converted to
    `dtype` (dequantised where fp8).
    """
    if not isinstance(keep_fp8, bool):
        raise TypeError(f"keep_fp8 must be a bool, got {type(keep_fp8).__name__}")
    prefix = _norm_prefix(prefix)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None (detect), got {layout!r}")
    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, bfloat16 or float16 (moe_forward's float "
                            f"weights; keep_fp8=True keeps fp8 experts), got {dtype}")
    b = _Block(state_dict, prefix, dtype)
    if layout is None:
        layout = _detect(b)

    # Fail fast (before reading any expert) on biases and other unknown keys.
    weight_like = (".weight", ".weight_scale_inv")
    _unrecognised(b, layout, [n for n in b.names if not n.endswith(weight_like)
                              and n not in _NON_WEIGHT_NAMES])

    router = b.get("gate.weight", rank=2, what="router weight (E, H)")
    num_experts, hidden = router.shape
    out = {"router": router}
    if layout == "deepseek" and b.has("gate.e_score_correction_bias"):
        bias = b.get("gate.e_score_correction_bias", (num_experts,))
        out["e_score_correction_bias"] = bias.astype(np.float32)

    routed = _routed_experts(b, layout, num_experts, hidden, dtype, keep_fp8)
    out["w13"], out["w2"] = routed[:2]
    if len(routed) == 4:
        out["w13_scale"], out["w2_scale"] = routed[2:]

    shared = _SHARED[layout]
    if shared is not None and any(n.startswith(shared + ".") for n in b.names):
        out["shared_w13"], out["shared_w2"] = _shared_expert(b, shared, hidden, dtype)
    if layout == "qwen":
        has_shared = "shared_w13" in out
        if has_shared or b.has("shared_expert_gate.weight"):
            if not has_shared:  # a gate without the expert it gates
                b.get("shared_expert.gate_proj.weight", what="the shared expert that "
                      "shared_expert_gate.weight gates")
            gate = b.get("shared_expert_gate.weight", (1, hidden),
                         what="Qwen2-MoE shared expert gate")
            out["shared_gate"] = gate.reshape(hidden)

    _unrecognised(b, layout, b.names - b.used)

    result = {}
    for name, arr in out.items():
        if name in ("e_score_correction_bias", "w13_scale", "w2_scale"):
            result[name] = jnp.asarray(arr, jnp.float32)
        elif arr.dtype == fp8.FP8:  # kept fp8 codes: never cast
            result[name] = jnp.asarray(arr)
        elif dtype is not None:
            result[name] = jnp.asarray(arr, dtype)
        else:
            result[name] = jnp.asarray(arr)
    return result


# ---------------------------------------------------------------- config

_ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}
# norm_topk_prob's default where the config omits it (the transformers config classes' defaults).
_RENORMALIZE_DEFAULT = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": False,
                        "deepseek_v3": True, "deepseek_v2": False}


def _first(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def config_from_hf(hf_config) -> MoEConfig:
    """A Hugging Face model config (``config.json`` as a dict, or a
    ``PretrainedConfig``) -> the MoEConfig of its MoE blocks.

    Fields read: num_experts | num_local_experts | n_routed_experts;
    num_experts_per_tok; hidden_size; moe_intermediate_size |
    intermediate_size; norm_topk_prob (default per model_type: Mixtral
    renormalises, Qwen2/3-MoE do not unless set, DeepSeek-V3 does);
    scoring_func (DeepSeek-V3: sigmoid); n_group / topk_group (group-limited
    routing with topk_method "noaux_tc"); routed_scaling_factor; hidden_act;
    the shared expert: shared_expert_intermediate_size (Qwen2-MoE, gated by
    sigmoid(x @ shared_expert_gate)) or n_shared_experts *
    moe_intermediate_size (DeepSeek-V3, ungated). DeepSeek-V3's
    e_score_correction_bias is expected (use_correction_bias) for
    model_type "deepseek_v3" or topk_method "noaux_tc".
    """
    if hasattr(hf_config, "to_dict") and not isinstance(hf_config, Mapping):
        hf_config = hf_config.to_dict()
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"hf_config must be a dict (config.json) or have to_dict(), "
                        f"got {type(hf_config).__name__}")
    cfg = dict(hf_config)
    if cfg.get("hidden_size") is None and isinstance(cfg.get("text_config"), Mapping):
        cfg = dict(cfg["text_config"])  # multimodal wrappers keep the language model here
    model_type = cfg.get("model_type", "")

    def need(*names):
        value = _first(cfg, *names)
        if value is None:
            raise KeyError(f"hf_config has none of {names} (model_type {model_type!r})")
        return value

    def integer(value, name):  # 8.5 or "8" is an error, never truncated or parsed
        try:
            if not isinstance(value, bool):
                return operator.index(value)
        except TypeError:
            pass
        raise TypeError(f"hf_config[{name!r}] must be an int, got {value!r}")

    def key_of(*names):
        return next(n for n in names if cfg.get(n) is not None)

    names = ("num_experts", "num_local_experts", "n_routed_experts")
    num_experts = integer(need(*names), key_of(*names))
    topk = integer(need("num_experts_per_tok"), "num_experts_per_tok")
    hidden = integer(need("hidden_size"), "hidden_size")
    names = ("moe_intermediate_size", "intermediate_size")
    inter = integer(need(*names), key_of(*names))

    act_name = _first(cfg, "hidden_act", "hidden_activation", default="silu")
    if act_name not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_act {act_name!r} is not supported (one of {sorted(_ACTIVATIONS)})")

    renormalize = cfg.get("norm_topk_prob")
    if renormalize is None:
        renormalize = _RENORMALIZE_DEFAULT.get(model_type, True)
    elif not isinstance(renormalize, bool):  # a string "false" would read as True
        raise TypeError(f"hf_config['norm_topk_prob'] must be true or false, got {renormalize!r}")

    topk_method = cfg.get("topk_method")
    scoring = cfg.get("scoring_func") or ("sigmoid" if model_type == "deepseek_v3" else "softmax")
    groups = cfg.get("n_group")
    topk_group = cfg.get("topk_group")
    if topk_method == "group_limited_greedy":
        raise ValueError(
            "topk_method 'group_limited_greedy' (DeepSeek-V2: group score = max) is not supported; "
            "jax_moe's group score is the sum of each group's top-2 (DeepSeek-V3's 'noaux_tc')")
    if topk_method == "greedy" or groups is None or integer(groups, "n_group") <= 1:
        groups = topk_group = None
    else:
        groups = integer(groups, "n_group")
        topk_group = integer(topk_group if topk_group is not None else groups, "topk_group")
    use_bias = model_type == "deepseek_v3" or topk_method == "noaux_tc"

    scale = cfg.get("routed_scaling_factor")
    if scale is None:
        scale = 2.5 if model_type == "deepseek_v3" else 1.0
    scale = _checks.static_float(scale, "hf_config['routed_scaling_factor']")

    shared, gated_shared = 0, False
    if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE (Qwen3-Next): sigmoid-gated
        shared = integer(cfg["shared_expert_intermediate_size"], "shared_expert_intermediate_size")
        gated_shared = True
    elif cfg.get("n_shared_experts"):  # DeepSeek-V2/V3
        shared = integer(cfg["n_shared_experts"], "n_shared_experts") * inter

    return MoEConfig(
        num_experts=num_experts, topk=topk, hidden_size=hidden, intermediate_size=inter,
        is_gated=True, renormalize=renormalize, hidden_act=_ACTIVATIONS[act_name],
        scoring_func=scoring, num_expert_group=groups, topk_group=topk_group,
        routed_scaling_factor=scale, use_correction_bias=use_bias,
        shared_intermediate_size=shared, shared_expert_gate=gated_shared)
