"""Plain-numpy oracles, written from the seven-step contract (the table of
steps in README.md).

They never call jax_moe (neither the FFI ops nor reference.py), compute in float64
and loop in the most obvious way, so that they check reference.py as much as
the kernels. Inputs may be jax or numpy arrays of any float dtype (bf16 and
f16 convert to float64 exactly).
"""

import math

import numpy as np


def f64(a):
    return np.asarray(a).astype(np.float64)


def topk_softmax(logits, topk, renormalize=True):
    """Softmax over experts, top-k by logit, ties to the lower expert id."""
    logits = f64(logits)
    # A stable sort of the negated logits puts equal logits in ascending id order.
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :topk]
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = z / z.sum(axis=-1, keepdims=True)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(np.int32)


def route(logits, topk, scoring_func="softmax", renormalize=True, routed_scaling_factor=1.0):
    """Routing without bias or expert groups: top-k by logit (ties to the lower
    id); weights are the chosen experts' softmax or sigmoid scores,
    renormalised to sum 1 if asked, times routed_scaling_factor."""
    logits = f64(logits)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :topk]
    if scoring_func == "softmax":
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = z / z.sum(axis=-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    weights = np.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights * routed_scaling_factor, ids.astype(np.int32)


def token_index(topk_ids, num_experts, start_expert=0, num_local_experts=None):
    """Stable grouping of the flat (token, slot) entries by local expert."""
    local = num_experts - start_expert if num_local_experts is None else num_local_experts
    flat = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    n = flat.size
    src_to_dst = np.full(n, -1, np.int32)
    dst_to_src = np.full(n, -1, np.int32)
    sizes = np.zeros(local, np.int32)
    row = 0
    for e in range(local):  # expert by expert, entries in ascending flat order
        members = np.nonzero(flat == start_expert + e)[0]
        sizes[e] = members.size
        dst_to_src[row:row + members.size] = members
        src_to_dst[members] = np.arange(row, row + members.size)
        row += members.size
    return src_to_dst, dst_to_src, sizes


def expand(x, dst_to_src, topk):
    x = np.asarray(x)
    d2s = np.asarray(dst_to_src)
    out = np.zeros((d2s.size, x.shape[1]), x.dtype)
    for i, s in enumerate(d2s):
        if s >= 0:
            out[i] = x[s // topk]
    return out


def group_gemm(x, w, expert_sizes):
    """Rows of x grouped by expert: out[rows of e] = x[rows of e] @ w[e].T (float64)."""
    x, w = f64(x), f64(w)
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for e, size in enumerate(np.asarray(expert_sizes)):
        out[start:start + size] = x[start:start + size] @ w[e].T
        start += size
    return out


def group_gemm_wgrad(dy, x, expert_sizes, dst_to_src=None, topk=1):
    """dw[e] = sum over the rows r of expert e of outer(dy[r], x_r) (float64):
    expert e owns the next max(size, 0) rows, cut at M; x_r = x[r], or
    x[dst_to_src[r] // topk] (nothing where dst_to_src[r] is outside
    [0, T * topk))."""
    dy, x = f64(dy), f64(x)
    m = dy.shape[0]
    sizes = np.asarray(expert_sizes)
    out = np.zeros((sizes.size, dy.shape[1], x.shape[1]))
    start = 0
    for e, size in enumerate(sizes):
        stop = min(start + max(int(size), 0), m)
        for r in range(start, stop):
            src = r
            if dst_to_src is not None:
                s = int(dst_to_src[r])
                if not 0 <= s < x.shape[0] * topk:
                    continue
                src = s // topk
            out[e] += np.outer(dy[r], x[src])
        start = stop
    return out


_erf = np.vectorize(math.erf, otypes=[np.float64])


def activation(g, name):
    if name == "silu":
        return g / (1.0 + np.exp(-g))
    if name == "gelu":
        return 0.5 * g * (1.0 + _erf(g / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    raise ValueError(name)


def gated_activation(h, name="silu"):
    h = f64(h)
    inter = h.shape[-1] // 2
    return activation(h[..., :inter], name) * h[..., inter:]


def combine(y, topk_weights, src_to_dst):
    """out[t] = sum_j w[t, j] * y[src_to_dst[t*k + j]]; -1 entries add nothing."""
    y, w = f64(y), f64(topk_weights)
    s2d = np.asarray(src_to_dst).reshape(w.shape)
    out = np.zeros((w.shape[0], y.shape[1]))
    for j in range(w.shape[1]):  # vectorised over tokens, looped over slots
        routed = s2d[:, j] >= 0
        out[routed] += w[routed, j, None] * y[s2d[routed, j]]
    return out


def moe_forward(hidden_states, router_logits, w13, w2, topk, renormalize=True,
                activation_name="silu", shared_expert_output=None):
    """The whole layer, token by token, without any grouping or index step:
    out[t] = sum_j w[t,j] * w2[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t,j]."""
    x, w13, w2 = f64(hidden_states), f64(w13), f64(w2)
    weights, ids = topk_softmax(router_logits, topk, renormalize)
    inter = w13.shape[1] // 2
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk):
            e = ids[t, j]
            h = w13[e] @ x[t]
            a = activation(h[:inter], activation_name) * h[inter:]
            out[t] += weights[t, j] * (w2[e] @ a)
    if shared_expert_output is not None:
        out += f64(shared_expert_output)
    return out


def deepseek_v3_route(logits, bias, topk, n_group, topk_group, route_scale):
    """DeepSeek-V3's gate (sigmoid scoring, noaux_tc), in float64 numpy:
    scores = sigmoid(logits); the choice adds the correction bias; a group's
    score is the sum of its two best biased scores; experts outside the
    topk_group best groups are masked with -inf; top-k of the biased scores;
    weights are the unbiased scores of the chosen experts, normalised to sum
    1, times route_scale."""
    logits = np.asarray(logits).astype(np.float64)
    bias = np.asarray(bias).astype(np.float64)
    tokens, experts = logits.shape
    scores = 1.0 / (1.0 + np.exp(-logits))
    biased = scores + bias
    ids = np.zeros((tokens, topk), np.int32)
    weights = np.zeros((tokens, topk))
    for t in range(tokens):
        groups = biased[t].reshape(n_group, -1)
        group_score = np.array([sum(sorted(g)[-2:]) for g in groups])
        best_groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        masked = np.full(experts, -np.inf)
        for g in best_groups:
            lo = g * (experts // n_group)
            masked[lo:lo + experts // n_group] = biased[t, lo:lo + experts // n_group]
        chosen = sorted(range(experts), key=lambda e: (-masked[e], e))[:topk]
        w = scores[t, chosen]
        ids[t] = chosen
        weights[t] = w / w.sum() * route_scale
    return weights, ids
