"""Prints the optimized HLO around the causal max_seqlen reshape path of
prefill_attention (B sequences of M tokens packed into N = B * M): the
attention call, jax_moe_fill_rows, and any copy between them. A copy of the
attention output ahead of fill_rows (which aliases its operand) would cost a
pass over the output; run on the GPU to see what XLA does there.

    python3 scripts/prefill_hlo.py [B M]
"""
import re
import sys

import jax
import jax.numpy as jnp

from jax_moe import attention

b, m = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (1, 4096)
hq, hkv, d = 32, 8, 128
n = b * m
q = jnp.zeros((n, hq, d), jnp.bfloat16)
k = jnp.zeros((n, hkv, d), jnp.bfloat16)
cu = jnp.arange(b + 1, dtype=jnp.int32) * m
f = jax.jit(lambda q, k, v, cu: attention.prefill_attention(q, k, v, cu, max_seqlen=m))
print("path:", attention.prefill_path(q, k, k, cu, max_seqlen=m), "on", jax.devices()[0])
hlo = f.lower(q, k, k, cu).compile().as_text()
for line in hlo.splitlines():
    if re.search(r"custom-call|copy\(|copy-start|fusion\(", line) and "ENTRY" not in line:
        print(line.strip()[:220])
