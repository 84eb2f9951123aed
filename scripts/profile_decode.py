"""One paged-decode call for a profiler (ncu / nsys): bf16, Hq=32, Hkv=8,
D=128, page 16, pages in random order.

    ncu --kernel-name regex:DecodeSplit --launch-count 1 python3 scripts/profile_decode.py [B L [split]]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import attention

b, length = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (64, 4096)
split = int(sys.argv[3]) if len(sys.argv) > 3 else None
hq, hkv, d, ps = 32, 8, 128, 16
rng = np.random.default_rng(0)
pages = b * length // ps
key = jax.random.PRNGKey(0)
q = jax.random.normal(key, (b, hq, d), jnp.bfloat16)
kp = jax.random.normal(key, (pages, ps, hkv, d), jnp.bfloat16)
vp = jax.random.normal(jax.random.PRNGKey(1), (pages, ps, hkv, d), jnp.bfloat16)
table = jnp.asarray(rng.permutation(pages).astype(np.int32).reshape(b, length // ps))
lengths = jnp.full((b,), length, jnp.int32)
f = jax.jit(lambda *a: attention.paged_decode_attention(*a, split_tokens=split))
for _ in range(3):
    f(q, kp, vp, table, lengths).block_until_ready()
print("done", b, length, split)
