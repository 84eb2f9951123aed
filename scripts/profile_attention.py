"""Where the attention bench's time goes: wall time per call of `calls`
chained calls (as benchmarks/bench_attention.py times them) beside the GPU
kernel time per call from a jax.profiler trace, for the paged decode (auto
split, page 16, B=64 L=4096), dense cuDNN decode on the contiguous cache, and
causal prefill B=4 S=8192 dense (padded cuDNN) vs packed (max_seqlen reshape).

    python3 scripts/profile_attention.py [calls]
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from _trace import device_time
from jax_moe import attention

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20
hq, hkv, d = 32, 8, 128
bf = jnp.bfloat16
ks = jax.random.split(jax.random.PRNGKey(0), 3)


def report(name, step, x, *args):
    @jax.jit
    def run(x, *args):
        for _ in range(calls):
            x = step(x, *args)
        return x

    run(x, *args).block_until_ready()
    t0 = time.perf_counter()
    run(x, *args).block_until_ready()
    print(f"== {name}: wall {(time.perf_counter() - t0) / calls * 1e6:.1f} µs per call "
          f"({calls} chained calls)")
    device_time(lambda: run(x, *args).block_until_ready(), calls, f"/tmp/trace_attn_{len(name)}",
                top=6)


b, length, ps = 64, 4096, 16
q = jax.random.normal(ks[0], (b, hq, d), jnp.float32).astype(bf)
k = jax.random.normal(ks[1], (b, length, hkv, d), jnp.float32).astype(bf)
v = jax.random.normal(ks[2], (b, length, hkv, d), jnp.float32).astype(bf)
lengths = jnp.full((b,), length, jnp.int32)
report("decode dense cudnn", lambda x, k, v, n: jax.nn.dot_product_attention(
    x[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn")[:, 0], q, k, v, lengths)
pages = b * length // ps
perm = np.random.default_rng(0).permutation(pages).astype(np.int32)
table = jnp.asarray(perm.reshape(b, -1))
inv = np.argsort(perm)
kp, vp = (a.reshape(pages, ps, hkv, d)[inv] for a in (k, v))
del k, v
report("decode paged", lambda x, kp, vp, t, n: attention.paged_decode_attention(x, kp, vp, t, n),
       q, kp, vp, table, lengths)
del kp, vp

nb, s = 4, 8192
per = s // nb
q = jax.random.normal(ks[0], (s, hq, d), jnp.float32).astype(bf)
k = jax.random.normal(ks[1], (s, hkv, d), jnp.float32).astype(bf)
v = jax.random.normal(ks[2], (s, hkv, d), jnp.float32).astype(bf)
cu = jnp.asarray(np.arange(nb + 1, dtype=np.int32) * per)
report("prefill dense cudnn", lambda x, k, v: jax.nn.dot_product_attention(
    x.reshape(nb, per, hq, d), k.reshape(nb, per, hkv, d), v.reshape(nb, per, hkv, d),
    is_causal=True, implementation="cudnn").reshape(s, hq, d), q, k, v)
report("prefill packed", lambda x, k, v, cu: attention.prefill_attention(
    x, k, v, cu, causal=True, max_seqlen=per), q, k, v, cu)
