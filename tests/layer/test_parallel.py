"""jax_moe.moe_forward_sharded (expert + tensor parallelism over a Mesh) against
jax_moe.moe_forward on one device, on the 8 host devices of conftest.py, or
under JAX_PLATFORMS=cuda on 8 GPUs (4 where there are 4 to 7: every mesh is
then that count's).

Also: the collectives in the compiled HLO of each strategy (exact counts, so
that a stray collective such as an all-gather of the weights fails the test),
the argument errors, and the 2-process example (examples/multiprocess_moe.py).
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from common import ROOT, assert_close, assert_equal, rel_err
import jax_moe
from jax_moe import fp8, parallel
from jax_moe.parallel import moe_forward_sharded, moe_shardings

H, I, E, K = 32, 16, 8, 2  # small: 8 devices share 2 cores
STRATEGIES = ["allgather", "all_to_all"]

# The devices of the meshes (and of the single-device reference): 8 GPUs, or 4
# where JAX has 4 to 7; else the 8 host CPU devices of conftest.py.
_GPUS = jax.devices() if jax.default_backend() == "gpu" else []
DEVICES = (_GPUS[:8] if len(_GPUS) >= 8 else _GPUS[:4] if len(_GPUS) >= 4
           else jax.devices("cpu")[:8])
N = len(DEVICES)
FACTORS = [(ep, N // ep) for ep in range(N, 0, -1) if N % ep == 0]  # (N, 1) .. (1, N)
MESH_SHAPES = FACTORS + [(1, 1)]
HALF = (N // 2, 2)  # experts and tensor parallelism at once


def mesh_ids(shapes):
    return [f"ep{ep}-tp{tp}" for ep, tp in shapes]


MESH_IDS = mesh_ids(MESH_SHAPES)

_moe_forward = jax.jit(jax_moe.moe_forward,
                       static_argnames=("topk", "renormalize", "activation", "backend",
                                        "scoring_func", "num_expert_group", "topk_group",
                                        "routed_scaling_factor"))


def _single(*args, **kwargs):
    """jax_moe.moe_forward on one device of the same platform as the meshes."""
    with jax.default_device(DEVICES[0]):
        return _moe_forward(*args, **kwargs)

_sharded = jax.jit(moe_forward_sharded,
                   static_argnames=("topk", "mesh", "ep_axis", "tp_axis", "renormalize",
                                    "activation", "backend", "strategy", "scoring_func",
                                    "num_expert_group", "topk_group", "routed_scaling_factor"))


def make_mesh(ep, tp, names=("ep", "tp")):
    devices = np.asarray(DEVICES[: ep * tp]).reshape(ep, tp)
    return Mesh(devices, names)


def make_inputs(rng, tokens, dtype, routing="random", experts=E, inter=I, hidden=H):
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    logits = rng.standard_normal((tokens, experts)) * 2.0
    if routing == "uneven":  # one hot expert: in every token's top-k
        logits[:, rng.integers(experts)] += 8.0
    elif routing == "one_rank":  # the top-k of every token on the first experts
        logits[:, :K] += 8.0
    logits = jnp.asarray(logits, jnp.float32)
    w13 = jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden)) * hidden**-0.5, dtype)
    w2 = jnp.asarray(rng.standard_normal((experts, hidden, inter)) * inter**-0.5, dtype)
    return x, logits, w13, w2


# ------------------------------------------------------------- correctness

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", MESH_SHAPES, ids=MESH_IDS)
def test_matches_single_device_f32(ep, tp, strategy, rng):
    mesh = make_mesh(ep, tp)
    for tokens in (37, 64):  # not a multiple of 8, and a multiple
        for routing in ("random", "uneven", "one_rank"):
            x, logits, w13, w2 = make_inputs(rng, tokens, jnp.float32, routing)
            want = _single(x, logits, w13, w2, topk=K)
            got = _sharded(x, logits, w13, w2, K, mesh=mesh, strategy=strategy)
            what = f"T={tokens} {routing}"
            assert got.shape == want.shape and got.dtype == want.dtype, what
            assert rel_err(got, want) < 1e-5, what
            assert_close(got, want, jnp.float32, what)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", FACTORS[:3], ids=mesh_ids(FACTORS[:3]))
def test_matches_single_device_bf16(ep, tp, strategy, rng):
    # With tp > 1 each device's w2 GEMM gives a partial sum over its I slice,
    # rounded to bf16 before the reduction (as in any tensor-parallel layer), so
    # single elements can differ by ~2 bf16 ulps of the output's scale; the
    # relative error over the whole output stays near 4e-3.
    mesh = make_mesh(ep, tp)
    for routing in ("random", "uneven"):
        x, logits, w13, w2 = make_inputs(rng, 37, jnp.bfloat16, routing)
        want = _single(x, logits, w13, w2, topk=K)
        got = _sharded(x, logits, w13, w2, K, mesh=mesh, strategy=strategy)
        assert got.dtype == jnp.bfloat16
        assert rel_err(got, want) < 1e-2, routing
        assert_close(got, want, jnp.bfloat16, routing, rtol=3e-2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", FACTORS[:3] + [(1, 1)], ids=mesh_ids(FACTORS[:3] + [(1, 1)]))
def test_gradients_match_single_device(ep, tp, strategy, rng):
    """jax.grad through the sharded layer (each device's backward on the
    kernels, the collectives transposed) equals the single-device gradients,
    with DeepSeek-style routing and a token count that needs padding."""
    mesh = make_mesh(ep, tp)
    x, logits, w13, w2 = make_inputs(rng, 37, jnp.float32, "uneven")
    bias = jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((37, H)), jnp.float32)
    kw = dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2,
              routed_scaling_factor=2.5, e_score_correction_bias=bias)

    def single(*a):
        with jax.default_device(DEVICES[0]):
            return jnp.sum(jax_moe.moe_forward(*a, K, **kw) * ct)

    def sharded(*a):
        return jnp.sum(moe_forward_sharded(*a, K, mesh=mesh, strategy=strategy, **kw) * ct)

    want = jax.jit(jax.grad(single, argnums=(0, 1, 2, 3)))(x, logits, w13, w2)
    got = jax.jit(jax.grad(sharded, argnums=(0, 1, 2, 3)))(x, logits, w13, w2)
    for name, g, w in zip(("x", "router_logits", "w13", "w2"), got, want):
        assert float(jnp.linalg.norm(w)) > 0, name
        assert rel_err(g, w) < 1e-5, f"d {name}: {rel_err(g, w):.3g}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_remat_gradients_match(strategy, rng):
    """remat=True recomputes each device's w13 GEMM in the backward with the
    forward's kernel: the same gradients, bit for bit, and less kept."""
    mesh = make_mesh(*HALF)
    x, logits, w13, w2 = make_inputs(rng, 29, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((29, H)), jnp.float32)

    def loss(remat):
        return lambda *a: jnp.sum(
            moe_forward_sharded(*a, K, mesh=mesh, strategy=strategy, remat=remat) * ct)

    keep, remat = (jax.jit(jax.grad(loss(r), argnums=(0, 1, 2, 3))) for r in (False, True))
    want, got = keep(x, logits, w13, w2), remat(x, logits, w13, w2)
    for name, g, w in zip(("x", "router_logits", "w13", "w2"), got, want):
        assert float(jnp.linalg.norm(w)) > 0, name
        assert_equal(g, w)
    # The recompute is one more grouped GEMM call in the gradient program.
    calls = [f.lower(x, logits, w13, w2).as_text().count('@jax_moe_group_gemm(')
             for f in (keep, remat)]
    assert calls[1] == calls[0] + 1, calls
    with pytest.raises(TypeError, match="remat"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, remat=1)

def test_options_match_single_device(rng):
    """shared expert, renormalize=False, gelu, the reference backend, f16."""
    mesh = make_mesh(*HALF)
    x, logits, w13, w2 = make_inputs(rng, 29, jnp.float32)
    shared = jnp.asarray(rng.standard_normal((29, H)), jnp.float32)
    kw = dict(renormalize=False, activation="gelu", shared_expert_output=shared)
    want = _single(x, logits, w13, w2, topk=K, **kw)
    for strategy, backend in (("allgather", "ffi"), ("all_to_all", "ffi"),
                              ("all_to_all", "reference")):
        got = _sharded(x, logits, w13, w2, K, mesh=mesh, strategy=strategy,
                       backend=backend, **kw)
        assert_close(got, want, jnp.float32, f"{strategy} {backend}")
    x, logits, w13, w2 = make_inputs(rng, 40, jnp.float16, "uneven")
    want = _single(x, logits, w13, w2, topk=K)
    got = _sharded(x, logits, w13, w2, K, mesh=mesh, strategy="all_to_all")
    assert rel_err(got, want) < 2e-3


def test_larger_topk_and_few_tokens(rng):
    """topk > E_loc (a token has several experts on one rank) and T < devices."""
    mesh = make_mesh(N, 1)
    experts, topk = 16, 6
    for tokens in (3, 19):
        x, logits, w13, w2 = make_inputs(rng, tokens, jnp.float32, experts=experts)
        want = _single(x, logits, w13, w2, topk=topk)
        for strategy in STRATEGIES:
            got = _sharded(x, logits, w13, w2, topk, mesh=mesh, strategy=strategy)
            assert_close(got, want, jnp.float32, f"T={tokens} {strategy}")


def test_sharded_inputs_and_4d_w13(rng):
    """Inputs placed with moe_shardings, w13 as its (E, 2, I, H) view split over tp."""
    mesh = make_mesh(N // 4, 4)
    sh = moe_shardings(mesh)
    x, logits, w13, w2 = make_inputs(rng, 64, jnp.float32)
    want = _single(x, logits, w13, w2, topk=K)
    args = (jax.device_put(x, sh["hidden_states"]), jax.device_put(logits, sh["router_logits"]),
            jax.device_put(w13.reshape(E, 2, I, H), sh["w13"]), jax.device_put(w2, sh["w2"]))
    # device r of tp holds gate[:, r-th slice] and up[:, r-th slice]
    shard = next(s for s in args[2].addressable_shards if s.index[2].start == I // 4)
    np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], np.asarray(w13)[shard.index[0], I // 4:I // 2])
    np.testing.assert_array_equal(np.asarray(shard.data)[:, 1], np.asarray(w13)[shard.index[0], I + I // 4:I + I // 2])
    for strategy in STRATEGIES:
        got = _sharded(*args, K, mesh=mesh, strategy=strategy)
        assert got.sharding.is_equivalent_to(sh["output"], 2)
        assert_close(got, want, jnp.float32, strategy)


@pytest.mark.parametrize("names,shape,axes", [
    (("data",), (N,), {}),                          # no ep / tp axis at all: pure data parallel
    (("ep",), (N,), {}),                            # the default tp axis is optional
    (("dp", "ep", "tp"), (N // 4, 2, 2), {}),       # an extra data-parallel axis
    (("x", "y"), HALF, {"ep_axis": "y", "tp_axis": "x"}),  # other names, other order
    (("ep", "tp"), HALF, {"tp_axis": None}),       # tp turned off: replicated over "tp"
], ids=["data-only", "ep-only", "dp-ep-tp", "renamed", "tp-none"])
def test_other_meshes(names, shape, axes, rng):
    mesh = Mesh(np.asarray(DEVICES).reshape(shape), names)
    x, logits, w13, w2 = make_inputs(rng, 45, jnp.float32, "uneven")
    want = _single(x, logits, w13, w2, topk=K)
    for strategy in STRATEGIES:
        got = _sharded(x, logits, w13, w2, K, mesh=mesh, strategy=strategy, **axes)
        assert_close(got, want, jnp.float32, strategy)


def test_inside_user_jit_no_retrace(rng):
    """Inside a user's jit (mesh closed over) and called twice: one compile."""
    mesh = make_mesh(*HALF)
    x, logits, w13, w2 = make_inputs(rng, 64, jnp.float32)
    fn = jax.jit(lambda a, b, c, d: 2.0 * moe_forward_sharded(a, b, c, d, K, mesh=mesh))
    want = 2.0 * _single(x, logits, w13, w2, topk=K)
    assert_close(fn(x, logits, w13, w2), want, jnp.float32)
    x2, logits2, _, _ = make_inputs(rng, 64, jnp.float32, "uneven")
    assert_close(fn(x2, logits2, w13, w2), 2.0 * _single(x2, logits2, w13, w2, topk=K),
                 jnp.float32)
    if hasattr(fn, "_cache_size"):  # jax-private; routing never retraces
        assert fn._cache_size() == 1


def test_eager_inputs_committed_to_one_device(rng):
    """Arrays committed to a single device are moved onto the mesh (a plain jit
    would refuse them: "incompatible devices")."""
    mesh = make_mesh(*HALF)
    for tokens in (64, 37):
        x, logits, w13, w2 = (jax.device_put(a, DEVICES[0])
                              for a in make_inputs(rng, tokens, jnp.float32))
        want = _single(x, logits, w13, w2, topk=K)
        got = moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, strategy="all_to_all")
        assert_close(got, want, jnp.float32, f"T={tokens}")


def test_auto_strategy(monkeypatch, rng):
    x, logits, w13, w2 = make_inputs(rng, 16, jnp.float32)
    plan = parallel._make_plan(x, logits, w13, w2, K, make_mesh(N, 1), "ep", "tp", True,
                               "silu", None, "ffi", "auto")
    assert plan.strategy == "allgather"  # ep = N <= AUTO_ALLGATHER_MAX_EP
    monkeypatch.setattr(parallel, "AUTO_ALLGATHER_MAX_EP", N // 2)
    plan = parallel._make_plan(x, logits, w13, w2, K, make_mesh(N, 1), "ep", "tp", True,
                               "silu", None, "ffi", "auto")
    assert plan.strategy == "all_to_all"


# ------------------------------------------------------------ HLO collectives

COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce",
               "collective-permute", "collective-broadcast", "send", "recv")


def _group_size(line):
    """Replica group size of one collective, from either HLO spelling."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)  # {{0,1,..},{..}}
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[\d+,(\d+)\]<=", line)  # iota: [groups,size]<=[..]
    if m:
        return int(m.group(1))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)  # mesh[a=8,b=1] {a}
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2))]))
    return None


def collectives(hlo: str):
    """{op: sorted [replica group size of each instance]} of a compiled module.
    Async pairs count once (the -start half)."""
    found = {}
    for line in hlo.splitlines():
        for op in COLLECTIVES:
            if re.search(rf"[\s(]{op}(?:-start)?\(", line):
                found.setdefault(op, []).append(_group_size(line))
    return {op: sorted(sizes) for op, sizes in found.items()}


def expected_collectives(ep, tp, strategy, padded=False):
    """{op: sorted [group sizes]}: what each strategy must issue, nothing else.

    padded: T is not a multiple of the mesh size, so the (T, H) result cannot
    stay split over the devices (jax.Array shards evenly): XLA all-gathers the
    output over the whole mesh, one more all-gather."""
    want = {}
    if strategy == "allgather":
        if ep * tp > 1:
            want = {"all-gather": [ep * tp], "reduce-scatter": [ep * tp]}
    else:
        if tp > 1:
            want["all-gather"] = [tp]
            want["reduce-scatter"] = [tp]
        if ep > 1:
            want["all-to-all"] = [ep, ep]  # dispatch (tokens + routing), return
    if padded and ep * tp > 1:
        want["all-gather"] = sorted(want.get("all-gather", []) + [ep * tp])
    return want


def compiled_hlo(mesh, strategy, w13_layout="4d", tokens=64, dtype=jnp.float32):
    sh = moe_shardings(mesh)
    if w13_layout == "4d":
        w13 = jax.ShapeDtypeStruct((E, 2, I, H), dtype, sharding=sh["w13"])
    elif w13_layout == "3d":
        w13 = jax.ShapeDtypeStruct((E, 2 * I, H), dtype, sharding=sh["w13_3d"])
    else:  # a NamedSharding to test the test with
        w13 = jax.ShapeDtypeStruct((E, 2 * I, H), dtype, sharding=NamedSharding(mesh, w13_layout))
    # T rows split evenly, or (T not a multiple of the mesh) left to the function
    tok = sh["hidden_states"] if tokens % mesh.size == 0 else None
    args = (jax.ShapeDtypeStruct((tokens, H), dtype, sharding=tok),
            jax.ShapeDtypeStruct((tokens, E), jnp.float32, sharding=tok),
            w13, jax.ShapeDtypeStruct((E, H, I), dtype, sharding=sh["w2"]))
    fn = jax.jit(lambda a, b, c, d: moe_forward_sharded(a, b, c, d, K, mesh=mesh,
                                                        strategy=strategy))
    return fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", MESH_SHAPES, ids=MESH_IDS)
def test_hlo_collectives(ep, tp, strategy):
    mesh = make_mesh(ep, tp)
    want = expected_collectives(ep, tp, strategy)
    assert collectives(compiled_hlo(mesh, strategy)) == want


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hlo_collectives_3d_w13_and_padding(strategy):
    mesh = make_mesh(*HALF)
    # w13 in its plain (E, 2I, H) layout, experts over ep and replicated over tp:
    # each device slices its gate/up rows locally, no extra collective.
    assert collectives(compiled_hlo(mesh, strategy, "3d")) == expected_collectives(*HALF, strategy)
    # T = 61: padded to 64 inside, plus the all-gather of the unevenly sized output.
    assert collectives(compiled_hlo(mesh, strategy, tokens=61)) == \
        expected_collectives(*HALF, strategy, padded=True)


def test_hlo_bf16_and_a_stray_collective_is_caught():
    mesh = make_mesh(*HALF)
    assert collectives(compiled_hlo(mesh, "allgather", dtype=jnp.bfloat16)) == \
        expected_collectives(*HALF, "allgather")
    # A naive contiguous split of the 2I axis over tp puts up-rows on the gate
    # device: XLA has to move weights to build the (gate_s, up_s) slices, and the
    # count check sees it.
    hlo = compiled_hlo(mesh, "allgather", P("ep", "tp", None))
    assert collectives(hlo) != expected_collectives(*HALF, "allgather")


# ------------------------------------------------------------------ errors

def test_errors(rng):
    x, logits, w13, w2 = make_inputs(rng, 16, jnp.float32, experts=6, inter=3)
    with pytest.raises(ValueError, match=r"num_experts=6 .*ep=4"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=make_mesh(4, 1))
    with pytest.raises(ValueError, match=r"I=3 .*tp=2"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=make_mesh(2, 2))
    x, logits, w13, w2 = make_inputs(rng, 16, jnp.float32)
    mesh = make_mesh(*HALF)
    with pytest.raises(ValueError, match=r"ep_axis='experts' is not an axis of the mesh"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, ep_axis="experts")
    with pytest.raises(ValueError, match=r"tp_axis='model' is not an axis of the mesh"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, tp_axis="model")
    with pytest.raises(ValueError, match="must be different"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, ep_axis="ep", tp_axis="ep")
    with pytest.raises(ValueError, match="strategy"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, strategy="ragged")
    with pytest.raises(ValueError, match="backend"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, backend="cuda")
    with pytest.raises(TypeError, match="Mesh"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=jax.devices())
    with pytest.raises(ValueError, match="w2 must be"):  # moe_forward's own checks
        moe_forward_sharded(x, logits, w13, w2[:, :, :-1], K, mesh=mesh)
    with pytest.raises(ValueError, match=r"\(E, 2, I, H\)"):
        moe_forward_sharded(x, logits, w13.reshape(E, 4, I // 2, H), w2, K, mesh=mesh)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", FACTORS[:2], ids=mesh_ids(FACTORS[:2]))
def test_deepseek_routing_sharded(rng, ep, tp, strategy):
    """Sigmoid scores, correction bias, group-limited top-k, scaling: each
    device routes its own tokens exactly as moe_forward does."""
    x, logits, w13, w2 = make_inputs(rng, 37, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32)
    kw = dict(topk=K, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
              routed_scaling_factor=2.5)
    want = _single(x, logits, w13, w2, e_score_correction_bias=bias, **kw)
    got = _sharded(x, logits, w13, w2, mesh=make_mesh(ep, tp), strategy=strategy,
                   e_score_correction_bias=bias, **kw)
    assert rel_err(got, want) < 1e-5
    plain = _single(x, logits, w13, w2, topk=K)
    assert rel_err(plain, want) > 1e-2  # the routing options really changed the result


# ------------------------------------------------------------ 2 processes

def test_multiprocess_example():
    """examples/multiprocess_moe.py: 2 processes x 4 CPU devices, gloo."""
    script = os.path.join(ROOT, "examples", "multiprocess_moe.py")
    proc = subprocess.run([sys.executable, script, "--timeout", "150"], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "launcher: OK" in proc.stdout
    assert "MISMATCH" not in proc.stdout
    # 2 workers x 3 meshes x 2 strategies, each checking the rows it holds
    assert len(re.findall(r"rel err \S+ ok$", proc.stdout, re.M)) == 12, out[-4000:]


# ------------------------------------------------------------ one GPU, 1x1 mesh

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_gpu_mesh_uses_cuda_kernels(rng, dtype):
    """A 1x1 mesh of the GPU: the CUDA custom calls do the work and match."""
    gpu = jax.devices("gpu")[0]
    mesh = Mesh(np.asarray([gpu]).reshape(1, 1), ("ep", "tp"))
    x, logits, w13, w2 = (jax.device_put(a, gpu) for a in make_inputs(rng, 37, dtype))
    hlo = _sharded.lower(x, logits, w13, w2, topk=K, mesh=mesh).compile().as_text()
    # steps 3-6: one call, or three where the tuned tile is the sm90 kernel's
    assert ("jax_moe_expert_mlp" in hlo or "jax_moe_group_gemm" in hlo), hlo[-2000:]
    assert "jax_moe_token_index" in hlo
    got = _sharded(x, logits, w13, w2, topk=K, mesh=mesh)
    assert got.devices() == {gpu}
    with jax.default_device(gpu):
        want = _moe_forward(x, logits, w13, w2, topk=K)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", FACTORS[:2], ids=mesh_ids(FACTORS[:2]))
def test_zero_tokens(ep, tp, strategy, jit, rng):
    """No tokens: an empty output (the reduce-scatter of the allgather
    strategy cannot split zero rows, so nothing runs)."""
    x, logits, w13, w2 = make_inputs(rng, 0, jnp.float32)
    fn = _sharded if jit else moe_forward_sharded
    out = fn(x, logits, w13, w2, K, mesh=make_mesh(ep, tp), strategy=strategy)
    assert out.shape == (0, H) and out.dtype == jnp.float32


# ------------------------------------------------------------- fp8 experts

def fp8_inputs(rng, tokens, dtype, inter=256, hidden=64):
    """make_inputs with block-scaled fp8 experts: (x, logits, w13, w2, w13_scale,
    w2_scale). I = 256: two 128-row scale blocks, one per device at tp = 2."""
    x, logits, w13, w2 = make_inputs(rng, tokens, jnp.float32, inter=inter, hidden=hidden)
    (w13, s13), (w2, s2) = fp8.quantize_blocks(w13), fp8.quantize_blocks(w2)
    return x.astype(dtype), logits, w13, w2, s13, s2


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", FACTORS[:2] + [(1, 2), (1, 1)],
                         ids=mesh_ids(FACTORS[:2] + [(1, 2), (1, 1)]))
def test_fp8_matches_single_device(ep, tp, strategy, rng):
    """Each device's I slice holds whole scale blocks, so every row is
    quantised as on one device; only the order of the w2 partial sums
    differs."""
    mesh = make_mesh(ep, tp)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        x, logits, w13, w2, s13, s2 = fp8_inputs(rng, 37, dtype)
        want = _single(x, logits, w13, w2, topk=K, w13_scale=s13, w2_scale=s2)
        got = _sharded(x, logits, w13, w2, K, mesh=mesh, strategy=strategy, w13_scale=s13,
                       w2_scale=s2)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) < tol, jnp.dtype(dtype).name


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ep,tp", FACTORS[:2], ids=mesh_ids(FACTORS[:2]))
def test_fp8_gradients_match_single_device(ep, tp, strategy, rng):
    """Frozen fp8 experts: the gradients of the tokens and the router logits
    through the sharded layer equal the single-device ones."""
    mesh = make_mesh(ep, tp)
    x, logits, w13, w2, s13, s2 = fp8_inputs(rng, 37, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((37, 64)), jnp.float32)

    def single(x, logits):
        with jax.default_device(DEVICES[0]):
            return jnp.sum(jax_moe.moe_forward(x, logits, w13, w2, K, w13_scale=s13,
                                               w2_scale=s2) * ct)

    def sharded(x, logits):
        return jnp.sum(moe_forward_sharded(x, logits, w13, w2, K, mesh=mesh, strategy=strategy,
                                           w13_scale=s13, w2_scale=s2) * ct)

    want = jax.jit(jax.grad(single, argnums=(0, 1)))(x, logits)
    got = jax.jit(jax.grad(sharded, argnums=(0, 1)))(x, logits)
    for name, g, w in zip(("x", "router_logits"), got, want):
        assert float(jnp.linalg.norm(w)) > 0, name
        assert rel_err(g, w) < 1e-5, f"d {name}: {rel_err(g, w):.3g}"


def test_fp8_errors(rng):
    x, logits, w13, w2, s13, s2 = fp8_inputs(rng, 16, jnp.float32, inter=128)
    with pytest.raises(ValueError, match="multiple of 128 \\* tp"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=make_mesh(2, 2), w13_scale=s13,
                            w2_scale=s2)
    with pytest.raises(ValueError, match="pass its block scales as w2_scale"):
        moe_forward_sharded(x, logits, w13, w2, K, mesh=make_mesh(2, 1), w13_scale=s13)
