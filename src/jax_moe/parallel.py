"""Expert and tensor parallelism: the MoE layer over a device mesh.

``moe_forward_sharded`` takes global arrays and returns the global (T, H)
output, equal to ``moe_forward`` on one device. Inside one ``jax.shard_map``:

* tokens are split over every mesh axis (data parallel over the whole mesh);
* experts are split over ``ep_axis``: device r of that axis holds experts
  [r * E_loc, (r + 1) * E_loc), E_loc = E / ep;
* the intermediate width I is split over ``tp_axis``: device s holds the s-th
  slice of *both* halves of w13 (gate[s] and up[s], so that the gated
  activation stays local) and the matching I columns of w2. Each device's w2
  GEMM is then a partial sum over I, reduced once at the end.

Every device runs its local experts through the same seven steps as
``moe_forward`` (the FFI custom calls, or jax_moe.reference; jax_moe.backends'
unchecked steps, the arguments checked once on the global shapes), so the custom calls
only ever see per-device shapes. All communication is jax.lax collectives:

* ``strategy="allgather"``: one all-gather of the tokens (with their routing)
  over the ep and tp axes, every device computes its experts / I slice for all
  gathered tokens, one reduce-scatter (``psum_scatter``) back to the token
  shards.
* ``strategy="all_to_all"``: an all-gather over tp only (when tp > 1), then
  each token is sent once to every ep rank that holds one of its experts, with
  one ``all_to_all`` into worst-case-sized (dropless) buffers, the results come
  back with a second ``all_to_all`` and are summed per token, and one
  reduce-scatter over tp (when tp > 1) sums the I slices.
* ``strategy="auto"``: "allgather" when the ep axis has at most 8 devices,
  "all_to_all" beyond. See docs/parallel.md for the reasoning and the CPU
  measurements.

Routing metadata (top-k weights and expert ids) travels inside the same
collective as the token rows, bit-cast to unsigned integers and appended as a
few extra rows, so each strategy issues exactly the collectives listed above
(docs/parallel.md counts them; tests/layer/test_parallel.py checks the HLO).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe import _checks, backends, fp8
from jax_moe._exchange import exchange

__all__ = ["moe_forward_sharded", "moe_shardings", "STRATEGIES", "AUTO_ALLGATHER_MAX_EP"]

STRATEGIES = ("auto", "allgather", "all_to_all")
# "auto" uses the all-gather strategy up to this many devices on the ep axis.
AUTO_ALLGATHER_MAX_EP = 8

_DEFAULT_AXES = {"ep_axis": "ep", "tp_axis": "tp"}
_PLAIN_ROUTING = dict(scoring_func="softmax", num_expert_group=None, topk_group=None,
                      e_score_correction_bias=None, routed_scaling_factor=1.0)

# Without the varying-axes type check: the custom calls' results carry no
# such type, so inside jax.grad their backward rules (whose cotangents do)
# would be rejected. Autodiff stays exact without it (tests/layer/test_parallel.py).
if hasattr(jax, "shard_map"):
    def _shard_map(f, mesh, in_specs, out_specs):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
else:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _legacy_shard_map

    def _shard_map(f, mesh, in_specs, out_specs):
        return _legacy_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_rep=False)


# ----------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call (hashable: the jit cache key)."""

    mesh: Mesh
    ep: str | None          # ep axis name, None when absent
    tp: str | None          # tp axis name, None when absent
    n_ep: int
    n_tp: int
    strategy: str           # "allgather" or "all_to_all" (resolved)
    tokens: int             # T (global, unpadded)
    experts: int            # E
    inter: int              # I
    routing: _checks.Routing  # checked; num_expert_group = topk_group = 1 when not grouped
    activation: str
    backend: str
    fp8: bool = False       # block-scaled float8_e4m3fn experts (w13_scale, w2_scale)
    remat: bool = False     # the backward recomputes the w13 GEMM instead of keeping it

    @property
    def topk(self):
        return self.routing.topk

    @property
    def renormalize(self):
        return self.routing.renormalize

    @property
    def token_axes(self):
        return tuple(self.mesh.axis_names)

    @property
    def local_experts(self):
        return self.experts // self.n_ep


def _resolve_axis(mesh: Mesh, name, role: str):
    """An axis name, or None for "this kind of parallelism is off".

    None turns it off explicitly. The default names ("ep", "tp") are optional:
    a mesh without them simply has no expert / tensor parallelism. Any other
    name must be an axis of the mesh.
    """
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"{role} must be a mesh axis name (str) or None, got {name!r}")
    if name in mesh.axis_names:
        return name
    if name == _DEFAULT_AXES[role]:
        return None
    raise ValueError(
        f"{role}={name!r} is not an axis of the mesh (its axes are {tuple(mesh.axis_names)}); "
        f"pass one of those names, or None to turn this parallelism off")


def _make_plan(hidden_states, router_logits, w13, w2, topk, mesh, ep_axis, tp_axis,
               renormalize, activation, shared_expert_output, backend, strategy, routing=None,
               w13_scale=None, w2_scale=None, remat=False):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    backends.get(backend)  # raises ValueError for an unknown backend
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    w13_3d = _w13_as_3d(w13)
    spec = _checks.forward_args(hidden_states, router_logits, w13_3d, w2, topk,
                                renormalize=renormalize, activation_name=activation,
                                is_gated=True, shared_expert_output=shared_expert_output,
                                w13_scale=w13_scale, w2_scale=w2_scale, remat=remat,
                                **(routing or _PLAIN_ROUTING))

    ep = _resolve_axis(mesh, ep_axis, "ep_axis")
    tp = _resolve_axis(mesh, tp_axis, "tp_axis")
    if ep is not None and ep == tp:
        raise ValueError(f"ep_axis and tp_axis must be different mesh axes, both are {ep!r}")
    n_ep = mesh.shape[ep] if ep is not None else 1
    n_tp = mesh.shape[tp] if tp is not None else 1
    experts = w13_3d.shape[0]
    inter = w13_3d.shape[1] // 2
    if experts % n_ep:
        raise ValueError(
            f"num_experts={experts} is not divisible by the size of the ep axis "
            f"({ep!r}: ep={n_ep}); expert parallelism needs E % ep == 0")
    if inter % n_tp:
        raise ValueError(
            f"intermediate_size I={inter} is not divisible by the size of the tp axis "
            f"({tp!r}: tp={n_tp}); tensor parallelism needs I % tp == 0")
    if spec.fp8 and inter % (fp8.BLOCK * n_tp):
        raise ValueError(
            f"intermediate_size I={inter} with fp8 experts must be a multiple of "
            f"{fp8.BLOCK} * tp ({tp!r}: tp={n_tp}): each device's I slice, and the gate/up "
            f"halves of w13, must hold whole 128-row scale blocks")
    if strategy == "auto":
        strategy = "allgather" if n_ep <= AUTO_ALLGATHER_MAX_EP else "all_to_all"
    return _Plan(mesh=mesh, ep=ep, tp=tp, n_ep=n_ep, n_tp=n_tp, strategy=strategy,
                 tokens=hidden_states.shape[0], experts=experts, inter=inter,
                 routing=spec.routing, activation=activation, backend=backend, fp8=spec.fp8,
                 remat=spec.remat)


def _w13_as_3d(w13):
    """w13 may be (E, 2I, H) or its (E, 2, I, H) view (gate/up on axis 1)."""
    if jnp.ndim(w13) == 4:
        e, two, inter, hidden = w13.shape
        if two != 2:
            raise ValueError(f"a 4-D w13 must be (E, 2, I, H) (gate, up), got {w13.shape}")
        return jax.ShapeDtypeStruct((e, 2 * inter, hidden), w13.dtype)
    return w13


# ------------------------------------------------------------------ public

def moe_forward_sharded(hidden_states, router_logits, w13, w2, topk: int, *, mesh: Mesh,
                        ep_axis: str | None = "ep", tp_axis: str | None = "tp",
                        renormalize: bool = True, activation: str = "silu",
                        scoring_func: str = "softmax", num_expert_group: int | None = None,
                        topk_group: int | None = None, e_score_correction_bias=None,
                        routed_scaling_factor: float = 1.0,
                        shared_expert_output=None, backend: str = "ffi",
                        strategy: str = "auto", w13_scale=None, w2_scale=None,
                        remat: bool = False):
    """``moe_forward`` over a device mesh, with expert and tensor parallelism.

    Takes and returns global arrays, with the shapes of ``moe_forward``:
    hidden_states (T, H); router_logits (T, E); w13 (E, 2*I, H) =
    concat(gate_proj, up_proj) per expert -- or the same memory viewed as
    (E, 2, I, H), which can be stored sharded over tp (see ``moe_shardings``);
    w2 (E, H, I). Returns (T, H) in hidden_states' dtype.

    mesh: a ``jax.sharding.Mesh``. Tokens are split over all of its axes; the
    experts over ``ep_axis`` (E must be divisible by its size) and I over
    ``tp_axis`` (I must be divisible by its size). Either axis may be None or
    absent from the mesh (the default names "ep"/"tp" are optional; any other
    name must be a mesh axis). T need not be divisible by the mesh size: the
    tokens are padded internally and the padding is never routed.

    Routing options (scoring_func, num_expert_group, topk_group,
    e_score_correction_bias, routed_scaling_factor) are moe_forward's; the
    router runs on each device's own tokens. Shared-expert weights and
    non-gated experts are not supported here yet: compute the shared expert
    outside and pass shared_expert_output.

    Block-scaled fp8 experts as in moe_forward (w13 and w2 float8_e4m3fn,
    w13_scale (E, 2I/128, ceil(H/128)), w2_scale (E, ceil(H/128), I/128)):
    the scales are split with their weights, so I must be a multiple of 128
    times the tp axis' size (each device's slice holds whole scale blocks).

    remat: as moe_forward's (each device's backward recomputes its w13 GEMM
    instead of keeping the output from the forward; float experts).

    strategy: "allgather", "all_to_all" or "auto" ("allgather" for ep <= 8).
    Both are dropless. Jittable: topk and every keyword argument except
    shared_expert_output, e_score_correction_bias, w13_scale and w2_scale are
    static Python values.
    Called eagerly with arrays committed to other devices (e.g. one device), it
    moves them onto the mesh.
    """
    routing = dict(scoring_func=scoring_func, num_expert_group=num_expert_group,
                   topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
                   routed_scaling_factor=routed_scaling_factor)
    plan = _make_plan(hidden_states, router_logits, w13, w2, topk, mesh, ep_axis, tp_axis,
                      renormalize, activation, shared_expert_output, backend, strategy, routing,
                      w13_scale, w2_scale, remat)
    tok = P(plan.token_axes, None) if plan.tokens % mesh.size == 0 else P()
    w13_spec = P(plan.ep, None, plan.tp, None) if jnp.ndim(w13) == 4 else P(plan.ep, None, None)
    hidden_states, router_logits, w13, w2, shared_expert_output = (
        _onto_mesh(a, mesh, spec) for a, spec in (
            (hidden_states, tok), (router_logits, tok), (w13, w13_spec),
            (w2, P(plan.ep, None, plan.tp)), (shared_expert_output, tok)))
    bias = _onto_mesh(e_score_correction_bias, mesh, P())
    scales = None
    if plan.fp8:
        scales = (_onto_mesh(w13_scale, mesh, P(plan.ep, None, None)),
                  _onto_mesh(w2_scale, mesh, P(plan.ep, None, plan.tp)))
    return _forward(hidden_states, router_logits, w13, w2, shared_expert_output, bias, scales,
                    plan=plan)


def _onto_mesh(a, mesh: Mesh, spec):
    """Eager calls: a concrete array committed to devices outside the mesh (say,
    one device) would make jit refuse the call ("incompatible devices"); move it
    onto the mesh with the layout the layer wants. Arrays already on the mesh's
    devices, numpy arrays and tracers (inside the caller's jit) pass unchanged."""
    if (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
            and a.committed and a.sharding.device_set != set(mesh.devices.flat)):
        return jax.device_put(a, NamedSharding(mesh, spec))
    return a


def moe_shardings(mesh: Mesh, ep_axis: str | None = "ep", tp_axis: str | None = "tp"):
    """The NamedShardings under which ``moe_forward_sharded`` needs no
    communication beyond its own collectives.

    Returns a dict with keys "hidden_states", "router_logits",
    "shared_expert_output", "output" (tokens split over all mesh axes),
    "w13" (for the (E, 2, I, H) view: experts over ep, I over tp), "w13_3d"
    (for the plain (E, 2I, H) layout: experts over ep, replicated over tp, since
    a device's gate and up slices are not one contiguous block of the 2I axis)
    and "w2" (experts over ep, I over tp).
    """
    ep = _resolve_axis(mesh, ep_axis, "ep_axis")
    tp = _resolve_axis(mesh, tp_axis, "tp_axis")
    tokens = NamedSharding(mesh, P(tuple(mesh.axis_names), None))
    return {
        "hidden_states": tokens,
        "router_logits": tokens,
        "shared_expert_output": tokens,
        "output": tokens,
        "w13": NamedSharding(mesh, P(ep, None, tp, None)),
        "w13_3d": NamedSharding(mesh, P(ep, None, None)),
        "w2": NamedSharding(mesh, P(ep, None, tp)),
    }


# --------------------------------------------------------- the jitted body

@functools.partial(jax.jit, static_argnames=("plan",))
def _forward(hidden_states, router_logits, w13, w2, shared, bias, scales, *, plan: _Plan):
    mesh = plan.mesh
    n_dev = mesh.size
    tokens, hidden = hidden_states.shape
    if tokens == 0:  # nothing to route (and no rows for the reduce-scatter to split)
        return jnp.zeros((0, hidden), hidden_states.dtype)
    padded = -(-tokens // n_dev) * n_dev
    if padded != tokens:
        # Padded rows are routed like any row by the router, then their ids are
        # replaced by a sentinel (see _body), so they are never placed: they
        # cost no expert work and their (zero) outputs are sliced off below.
        pad = ((0, padded - tokens), (0, 0))
        hidden_states = jnp.pad(hidden_states, pad)
        router_logits = jnp.pad(router_logits, pad)
        if shared is not None:
            shared = jnp.pad(shared, pad)
    if w13.ndim == 3:
        # A free view: device (r, s) takes experts r and I slice s of both halves.
        w13 = w13.reshape(plan.experts, 2, plan.inter, hidden)

    tok_spec = P(plan.token_axes, None)
    in_specs = [tok_spec, tok_spec, P(plan.ep, None, plan.tp, None), P(plan.ep, None, plan.tp)]
    args = [hidden_states, router_logits, w13, w2]
    if scales is not None:
        # w13's scale blocks viewed as w13 is: (E, 2, I/128, H blocks), gate and up halves.
        s13, s2 = scales
        in_specs += [P(plan.ep, None, plan.tp, None), P(plan.ep, None, plan.tp)]
        args += [s13.reshape(plan.experts, 2, -1, s13.shape[-1]), s2]
    if shared is not None:
        in_specs.append(tok_spec)
        args.append(shared)
    if bias is not None:  # replicated: every device routes its own tokens
        in_specs.append(P(None))
        args.append(bias)
    body = functools.partial(_body, plan=plan, has_shared=shared is not None,
                             has_bias=bias is not None)
    out = _shard_map(body, mesh, tuple(in_specs), tok_spec)(*args)
    return out[:tokens] if padded != tokens else out


def _body(x, logits, w13, w2, *rest, plan: _Plan, has_shared: bool, has_bias: bool):
    """One device: x (T_loc, H), logits (T_loc, E), w13 (E_loc, 2, I_loc, H),
    w2 (E_loc, H, I_loc) -> (T_loc, H); with fp8 experts their scales follow
    w2 in `rest`."""
    steps = backends.steps(plan.backend)
    t_loc, hidden = x.shape
    e_loc = plan.local_experts
    w13 = w13.reshape(e_loc, -1, hidden)  # (E_loc, 2*I_loc, H) = [gate_s; up_s]: a bitcast
    if plan.fp8:  # the weights travel on as (codes, scales) pairs
        s13, s2, *rest = rest
        w13, w2 = (w13, s13.reshape(e_loc, -1, s13.shape[-1])), (w2, s2)

    shared = rest[0] if has_shared else None
    bias = rest[-1] if has_bias else None
    weights, ids = steps.route(logits, bias, plan.routing)
    if plan.tokens % plan.mesh.size:
        # Rows past T are padding. Their ids become E, an expert no ep rank owns:
        # every moe_compute_token_index below drops them (src_to_dst = -1).
        first = jax.lax.axis_index(plan.token_axes) * t_loc
        real = first + jnp.arange(t_loc, dtype=jnp.int32) < plan.tokens
        ids = jnp.where(real[:, None], ids, jnp.int32(plan.experts))

    # The ep rank is a traced value inside shard_map (lax.axis_index), but
    # moe_compute_token_index needs a static start_expert. So the global ids are
    # shifted into this rank's frame (ids - rank * E_loc) and the op is called
    # with num_experts = E_loc: local experts land in [0, E_loc), every other
    # rank's experts (and the sentinel E) fall outside it, and the index kernels
    # drop out-of-range ids in-kernel (src_to_dst = -1, not placed; the same in
    # jax_moe.reference). The token index runs unchecked here (the arguments were
    # checked on the global shapes), so no eager range check applies.
    rank = jax.lax.axis_index(plan.ep) if plan.n_ep > 1 else 0

    if plan.strategy == "allgather":
        axes = tuple(a for a, n in ((plan.ep, plan.n_ep), (plan.tp, plan.n_tp)) if n > 1)
        xg, wg, idg = _gather_tokens(x, weights, ids, axes, plan)
        y = _local_experts(steps, xg, wg, idg - rank * e_loc, w13, w2, plan)
    else:
        axes = (plan.tp,) if plan.n_tp > 1 else ()
        xg, wg, idg = _gather_tokens(x, weights, ids, axes, plan)
        if plan.n_ep > 1:
            y = _expert_all_to_all(steps, xg, wg, idg, rank, w13, w2, plan,
                                   real_rows=plan.n_tp * t_loc)
        else:
            y = _local_experts(steps, xg, wg, idg, w13, w2, plan)
    if axes:
        # The partial sums (other ranks' experts, other I slices) meet here: one
        # reduce-scatter returns each device its own rows, fully summed.
        y = jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)
    if shared is not None:
        y = (y.astype(jnp.float32) + shared.astype(jnp.float32)).astype(y.dtype)
    return y.astype(x.dtype)


def _local_experts(steps: backends.Steps, x, weights, local_ids, w13, w2, plan: _Plan):
    """This device's experts (and I slice) for the tokens x (N, H), routed by
    local_ids (N, k) (entries outside [0, E_loc) are other ranks' and are not
    placed) -> (N, H): each token's weighted sum over its local experts.
    w13, w2: the local weights, or with fp8 experts (codes, scales) pairs.
    steps: the backend's unchecked steps (backends.steps); the arguments were
    checked once, on the global shapes, by _make_plan."""
    e_loc = plan.local_experts
    k = plan.topk
    src_to_dst, dst_to_src, sizes = steps.token_index(local_ids, e_loc, 0, e_loc)
    # A token's k ids are distinct (top-k), so at most min(k, E_loc) of them are
    # local: at most N * min(k, E_loc) rows are placed, and dst_to_src is -1
    # past them. Shorter buffers for the GEMMs when E_loc < k.
    rows = x.shape[0] * min(k, e_loc)
    if plan.fp8:  # steps 3-6 with both GEMMs on fp8 weights
        y = backends.fp8_expert_mlp(steps, x, *w13, *w2, sizes, dst_to_src[:rows], k,
                                    plan.activation, True)
        return steps.combine(y, weights, src_to_dst, dst_to_src[:rows])
    return steps.routed_experts(x, w13, w2, weights, sizes, dst_to_src[:rows],  # steps 3-7
                                src_to_dst, k, plan.activation, True, (None, None),
                                plan.remat)


def _expert_all_to_all(steps: backends.Steps, x, weights, ids, rank, w13, w2, plan: _Plan,
                       real_rows: int):
    """The all_to_all dispatch over ep. x (N, H), weights/ids (N, k) global ->
    (N, H), each token summed over all its experts (for this device's I slice).

    Each token goes once to each ep rank that owns at least one of its experts
    (with its k weights and global ids; the receiver keeps its own). A rank can
    receive at most `real_rows` tokens from one source (every real token, once),
    so the per-destination buffer has C = real_rows slots: dropless.
    """
    n_ep, e_loc, k = plan.n_ep, plan.local_experts, plan.topk
    n, hidden = x.shape
    cap = real_rows
    dest = jnp.arange(n_ep, dtype=jnp.int32)
    # (N, n_ep): does token t need rank r? (sentinel ids E map to rank n_ep: never)
    needs = jnp.any((ids // e_loc)[:, :, None] == dest[None, None, :], axis=1)
    pair_ids = jnp.where(needs, dest[None, :], jnp.int32(-1))
    # A stable counting sort of the (token, rank) pairs by rank, with the same op:
    # the pairs for rank r, in token order, are its slots 0 .. count_r - 1.
    pair_to_pos, pos_to_pair, counts = steps.token_index(pair_ids, n_ep, 0, n_ep)
    first = jnp.cumsum(counts) - counts
    slot = jnp.arange(cap, dtype=jnp.int32)
    pos = jnp.minimum(first[:, None] + slot[None, :], n * n_ep - 1)
    send_pair = jnp.where(slot[None, :] < counts[:, None], pos_to_pair[pos], -1)  # (n_ep, C)

    # Per destination C token rows and their routing (weights, global ids),
    # in one all_to_all (jax_moe._exchange).
    valid = send_pair >= 0
    send_tok = jnp.where(valid, send_pair // n_ep, 0)
    send_x = steps.expand(x, send_pair.reshape(-1), n_ep).reshape(n_ep, cap, hidden)
    send_w = jnp.where(valid[..., None], weights[send_tok], 0.0)
    send_ids = jnp.where(valid[..., None], ids[send_tok], jnp.int32(plan.experts))

    def a2a(a):  # recv[s] = what rank s sent here; its own transpose
        return jax.lax.all_to_all(a, plan.ep, 0, 0, tiled=True)

    recv_x, recv_w, recv_ids = exchange(send_x, send_w, send_ids, a2a, a2a)
    y = _local_experts(steps, recv_x.reshape(-1, hidden), recv_w.reshape(-1, k),
                       recv_ids.reshape(-1, k) - rank * e_loc, w13, w2, plan)
    back = a2a(y.reshape(n_ep, cap, hidden))

    # Token t's result from rank r is in back[r, slot of pair (t, r)]: sum over r.
    pair_rank = jnp.tile(dest, n)
    pair_slot = jnp.where(pair_to_pos >= 0, pair_rank * cap + pair_to_pos - first[pair_rank], -1)
    ones = jnp.ones((n, n_ep), jnp.float32)
    # Each pair has its own slot: the inverse map (for the backward) is a plain scatter.
    slot_pair = jnp.full((n_ep * cap,), -1, jnp.int32).at[
        jnp.where(pair_slot >= 0, pair_slot, n_ep * cap)].set(
        jnp.arange(n * n_ep, dtype=jnp.int32), mode="drop")
    return steps.combine(back.reshape(-1, hidden), ones, pair_slot, slot_pair)


# ------------------------------------------- tokens + routing in one collective

def _gather_tokens(x, weights, ids, axes, plan: _Plan):
    """All-gathers tokens and their routing over `axes` in ONE all-gather
    (jax_moe._exchange): x (T_loc, H), weights/ids (T_loc, k) -> (n * T_loc, H) and
    (n * T_loc, k), shard s's rows at block s (the order psum_scatter over
    the same axes hands back)."""
    t_loc, hidden = x.shape
    if not axes:
        return x, weights, ids
    n = math.prod(plan.mesh.shape[a] for a in axes)

    def gather(a):  # (1, R, ...) -> (n, R, ...), block s from shard s
        return jax.lax.all_gather(a[0], axes, axis=0, tiled=True).reshape(n, *a.shape[1:])

    def scatter(a):  # its transpose: each shard's block, summed over the shards
        flat = a.reshape(-1, *a.shape[2:])
        return jax.lax.psum_scatter(flat, axes, scatter_dimension=0, tiled=True)[None]

    xg, wg, idg = exchange(x[None], weights[None], ids[None], gather, scatter)
    return xg.reshape(-1, hidden), wg.reshape(-1, plan.topk), idg.reshape(-1, plan.topk)
