"""Trains a small jax_moe.nn.MoE (Flax NNX) on a toy regression with optax.

A student MoE learns to imitate a random teacher MoE of the same shape (a
DeepSeek-V3-style block: sigmoid routing with a correction bias, group-limited
top-k, a shared expert) converted from a Hugging Face-style state dict. The
loss adds the router's load-balancing and z-losses (``MoE(...,
return_aux=True)``); on the "ffi" backend the backward pass runs on jax_moe's
kernels. Needs flax (``pip install flax``); runs in seconds on a CPU.

    python examples/train_toy.py [--steps 100] [--backend ffi|reference]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_moe.convert import config_from_hf
from jax_moe.nn import MoE


def teacher_state_dict(cfg, rng):
    """Random weights under DeepSeek-V3's names (as in a checkpoint's model.layers.N.mlp.)."""
    e, h, i, i_s = (cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                    cfg.shared_intermediate_size)
    sd = {"gate.weight": rng.standard_normal((e, h)) * h**-0.5,
          "gate.e_score_correction_bias": rng.uniform(-0.1, 0.1, e)}
    for x in range(e):
        sd[f"experts.{x}.gate_proj.weight"] = rng.standard_normal((i, h)) * h**-0.5
        sd[f"experts.{x}.up_proj.weight"] = rng.standard_normal((i, h)) * h**-0.5
        sd[f"experts.{x}.down_proj.weight"] = rng.standard_normal((h, i)) * i**-0.5
    sd["shared_experts.gate_proj.weight"] = rng.standard_normal((i_s, h)) * h**-0.5
    sd["shared_experts.up_proj.weight"] = rng.standard_normal((i_s, h)) * h**-0.5
    sd["shared_experts.down_proj.weight"] = rng.standard_normal((h, i_s)) * i_s**-0.5
    return {k: v.astype(np.float32) for k, v in sd.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--backend", default="ffi", choices=["ffi", "reference"])
    args = p.parse_args()

    # A small DeepSeek-V3-like config.json.
    cfg = config_from_hf({
        "model_type": "deepseek_v3", "hidden_size": 64, "moe_intermediate_size": 32,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "norm_topk_prob": True, "topk_method": "noaux_tc", "hidden_act": "silu"})
    print(cfg)

    teacher = MoE.from_state_dict(cfg, teacher_state_dict(cfg, np.random.default_rng(0)),
                                  backend=args.backend)
    model = MoE(cfg, rngs=nnx.Rngs(1), backend=args.backend, router_aux_loss_coef=1e-3,
                router_z_loss_coef=1e-4)
    # The correction bias is a Buffer (not trained): copy the teacher's.
    model.e_score_correction_bias.set_value(teacher.e_score_correction_bias[...])

    x = jax.random.normal(jax.random.key(2), (args.tokens, cfg.hidden_size), jnp.float32)
    y = nnx.jit(lambda m, v: m(v))(teacher, x)
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)

    def loss_fn(m):
        out, aux = m(x, return_aux=True)
        mse = jnp.mean((out - y) ** 2)
        return mse + aux["aux_loss"], (mse, aux["load_balancing_loss"])

    @nnx.jit
    def train_step(model, optimizer, x, y):
        (_, (mse, balance)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return mse, balance

    first = None
    for step in range(args.steps):
        mse, balance = (float(v) for v in train_step(model, optimizer, x, y))
        first = mse if first is None else first
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  mse {mse:.5f}  load balance {balance:.3f}")
    if not mse < first:
        raise SystemExit(f"training did not lower the loss ({first:.5f} -> {mse:.5f})")


if __name__ == "__main__":
    main()
