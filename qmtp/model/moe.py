"""The sparse mixture-of-experts MLP of Qwen3-Next and Qwen3.5-MoE (MODEL_SPEC §3.4), as HF transformers
computes it (`Qwen3NextSparseMoeBlock`, `Qwen3_5MoeSparseMoeBlock`), for T tokens x [T, H]:

    p      = softmax_f32(x @ router.T)                         [T, E]
    (w, e) = top_k(p, k)  (ties: the lower expert first);  w /= sum(w) if norm_topk_prob
    w      = w in x's dtype
    routed = sum over experts e = 0, 1, .. E-1 in that order of w_{t,e} * SwiGLU_e(x_t), for the tokens t
             that chose e (each term rounded to x's dtype, then added to the running sum in x's dtype)
    out    = routed + sigmoid(x @ shared_gate.T) * SwiGLU_shared(x)   (one scalar gate per token)

SwiGLU_e(x) = down_e(silu(x @ gate_e.T) * (x @ up_e.T)), the experts' weights stacked: gate_up [E, 2I, H]
(the gate's I rows, then the up's; the fused layout of Qwen3.5-MoE checkpoints), down [E, H, I].

Params of one block (a decoder layer's dict, qmtp/model/params.py): router [E, H], experts_gate_up
[E, 2I, H], experts_down [E, H, I] (arrays or stacked Fp8Blocks), shared_mlp_gate / shared_mlp_up [S, H],
shared_mlp_down [H, S], shared_gate [1, H] (the loader joins router and shared_gate into router_gate
[E + 1, H]: `router_logits`). Under tensor parallelism each device holds a contiguous share
of every expert's width (and of the shared expert's): the down projections' partial sums are reduced
across devices (qmtp/model/shard_layout.py), so the same code runs on a shard.

`sparse_moe` runs the routed form: the (token, chosen expert) pairs grouped by expert into blocks of
rows, one expert per block (`group_rows`), through the grouped expert matmul
(ops.expert_matmul), so a step reads only the chosen experts' weights. `sparse_moe_ref` is the
reference form: every expert over every token (a lax.scan over the experts), the unchosen ones' terms
dropped; E / k times the work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qmtp.model import layers
from qmtp.model.config import ModelConfig
from qmtp.runtime import ops, tp
from qmtp.runtime.kernel_config import KernelConfig

F32 = jnp.float32
BLOCK_ROWS = ops.EXPERT_BLOCK_ROWS  # rows of a block up to COMPARE_MAX_PAIRS pairs (decode, verify)
COMPARE_MAX_PAIRS = 1024  # group_rows by comparisons up to here: a batch of 32 verifying K = 3 at top-8
# Rows of a block past COMPARE_MAX_PAIRS (prefills): a block reads its expert's weight once, so taller
# blocks read the weights fewer times and give the tensor cores taller tiles, at the cost of the padding
# up to a block boundary in each expert's group. A 2048-token prefill chunk's expert matmuls (gate_up +
# down, 35B-A3B shapes, H100): 16 rows 1211 us, 32 rows 1078, 64 rows 1278, 128 rows 1721.
PREFILL_BLOCK_ROWS = 32


def block_rows_for(pairs: int) -> int:
    """Rows per block of group_rows for `pairs` (token, expert) pairs."""
    return BLOCK_ROWS if pairs <= COMPARE_MAX_PAIRS else PREFILL_BLOCK_ROWS


def _blocks(pairs: int, n_experts: int) -> tuple[int, int]:
    """(BR, NB) of group_rows' layout for `pairs` pairs: rows per block, and the most blocks any routing
    needs (ceil(P / BR) + min(X, P): each expert's group may start a block it leaves part empty)."""
    block_rows = block_rows_for(pairs)
    return block_rows, -(-pairs // block_rows) + min(n_experts, pairs)


def router_logits(p: dict, x2: jax.Array, kernels: KernelConfig):
    """(router logits [T, X], shared-expert gate logit [T, 1]) in x2's dtype, as the linears give them: one
    projection where the loader joined the two (router_gate = [router | shared_gate], load.fuse_router_gates:
    one launch fewer per MoE layer), else one each (a tree as the checkpoint or the trainer holds it)."""
    if "router_gate" in p:
        both = ops.linear(x2, p["router_gate"], kernels)  # [T, X + 1]
        return both[:, :-1], both[:, -1:]
    return ops.linear(x2, p["router"], kernels), ops.linear(x2, p["shared_gate"], kernels)


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool, kernels: KernelConfig):
    """(w [T, k] in the logits' dtype, e [T, k] int32): each token's k experts of highest router
    probability and their weights (module doc), from the router logits [T, X]."""
    probs = ops.fenced(kernels, softmax_fixed_order, logits.astype(F32))  # [T, E]
    w, e = jax.lax.top_k(probs, top_k)  # descending; equal probabilities: the lower expert first
    if norm_topk_prob:
        w = ops.fenced(kernels, lambda v: v / fixed_order_sum(v), w)
    return w.astype(logits.dtype), e.astype(jnp.int32)


def fixed_order_sum(z: jax.Array) -> jax.Array:
    """sum over the last axis [..., n] -> [..., 1], added in one fixed order (pairwise halving, zero-padded
    to a power of two): elementwise adds, no reduction whose order XLA could change with the row count."""
    width = 1 << (z.shape[-1] - 1).bit_length()
    total = jnp.pad(z, [(0, 0)] * (z.ndim - 1) + [(0, width - z.shape[-1])])
    while total.shape[-1] > 1:
        half = total.shape[-1] // 2
        total = total[..., :half] + total[..., half:]
    return total


def softmax_fixed_order(logits: jax.Array) -> jax.Array:
    """softmax over the last axis [..., E] in f32, its sum in one fixed order (fixed_order_sum), so a
    token's probabilities do not depend on how many tokens share the array: XLA's reduction over E
    changes order with the row count (on the CPU, E = 256, from 16 rows)."""
    # max: exact in any order. The barrier keeps the max's reduction out of the exp's fusion: fused,
    # exp(logits - max) gave other bits for a token alone than among 16 (CPU)
    z = jnp.exp(jax.lax.optimization_barrier(logits - jnp.max(logits, axis=-1, keepdims=True)))
    return z / fixed_order_sum(z)


def group_rows(experts: jax.Array, n_experts: int):
    """The row blocks of the grouped matmul for the pairs p = t * k + j of experts [T, k] (token t's j-th
    expert), BR = block_rows_for(P) rows each: (row [P] int32, the row pair p takes; block_expert [NB]
    int32, each block's expert, -1 for blocks past the last group; row_pair [NB * BR] int32, the pair in
    each row, -1 for an empty row). Each expert's pairs take consecutive rows from a block boundary, in
    pair order; NB = ceil(P / BR) + min(X, P), the most blocks any routing needs.

    Up to COMPARE_MAX_PAIRS pairs (decode and verify) every index comes from comparisons and sums, which
    XLA fuses into a few kernels; more pairs (prefill) sort them by expert instead, as the [P, P]
    comparisons would cost more than the sort."""
    flat = experts.reshape(-1)  # [P]
    pairs = flat.shape[0]
    pair_ids = jnp.arange(pairs, dtype=jnp.int32)
    block_rows, n_blocks = _blocks(pairs, n_experts)
    counts = jnp.sum(flat[:, None] == jnp.arange(n_experts)[None], axis=0, dtype=jnp.int32)  # [X]
    padded = -(-counts // block_rows) * block_rows
    # padded_start[x] = sum of padded over the experts before x, as a masked sum (no scan)
    padded_start = jnp.sum(jnp.where(jnp.arange(n_experts)[None] < jnp.arange(n_experts)[:, None], padded[None], 0),
                           axis=1, dtype=jnp.int32)  # [X]
    row_ids = jnp.arange(n_blocks * block_rows, dtype=jnp.int32)
    if pairs <= COMPARE_MAX_PAIRS:
        earlier_same = (flat[None] == flat[:, None]) & (pair_ids[None] < pair_ids[:, None])  # [P, P]
        row = padded_start[flat] + jnp.sum(earlier_same, axis=1, dtype=jnp.int32)  # [P]
        # the one pair whose row it is, else -1
        row_pair = jnp.sum(jnp.where(row[None] == row_ids[:, None], pair_ids[None] + 1, 0), axis=1) - 1
    else:
        order = jnp.argsort(flat, stable=True)  # pairs by expert
        by_expert = flat[order]
        in_group = pair_ids - (jnp.cumsum(counts) - counts)[by_expert]  # place within its group, by expert
        row = padded_start[flat] + jnp.zeros((pairs,), jnp.int32).at[order].set(in_group)
        row_pair = jnp.full(row_ids.shape, -1, jnp.int32).at[row].set(pair_ids)
    block_start = jnp.arange(n_blocks, dtype=jnp.int32) * block_rows
    padded_end = padded_start + padded
    owner = jnp.searchsorted(padded_end, block_start, side="right", method="compare_all").astype(jnp.int32)
    block_expert = jnp.where(block_start < padded_end[-1], owner, -1)
    return row, block_expert, row_pair.astype(jnp.int32)


def one_token_rows(experts: jax.Array, n_experts: int):
    """group_rows for one token, experts [1, k] ascending and distinct (as by_expert_index leaves a
    token's): pair j alone in block j at row j * BR, then the unused blocks, the layout group_rows gives
    them, but built from constants and the experts themselves, with no counting or search (decode at
    batch 1: fewer small launches per MoE layer)."""
    k = experts.shape[-1]
    block_rows, n_blocks = _blocks(k, n_experts)
    row = jnp.arange(k, dtype=jnp.int32) * block_rows  # [k]
    block_expert = jnp.full((n_blocks,), -1, jnp.int32).at[:k].set(experts.reshape(-1).astype(jnp.int32))
    row_ids = jnp.arange(n_blocks * block_rows, dtype=jnp.int32)
    row_pair = jnp.where((row_ids % block_rows == 0) & (row_ids < k * block_rows), row_ids // block_rows, -1)
    return row, block_expert, row_pair


def sparse_moe(p: dict, x: jax.Array, *, top_k: int, norm_topk_prob: bool, kernels: KernelConfig) -> jax.Array:
    """The block's output [..., H] for x [..., H] (module doc), routed: each token's terms added in its
    experts' index order, as the reference adds them."""
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, h)  # [T, H]
    n_experts, two_i = p["experts_gate_up"].shape[:2]
    logits, gate = router_logits(p, x2, kernels)
    w, e = by_expert_index(*route(logits, top_k, norm_topk_prob, kernels))  # [T, k]
    row, block_expert, row_pair = (one_token_rows if x2.shape[0] == 1 else group_rows)(e, n_experts)
    rows = jnp.where((row_pair >= 0)[:, None], x2[jnp.maximum(row_pair, 0) // top_k], 0)  # [R, H]
    gate_up = ops.expert_matmul(rows, block_expert, p["experts_gate_up"], kernels, out_dtype=x.dtype)  # [R, 2I]
    act = ops.swiglu(gate_up[:, :two_i // 2], gate_up[:, two_i // 2:], kernels, x.dtype)  # [R, I]
    # [R, H]: f32 partial sums over this shard's share of each expert's width (tensor parallelism),
    # reduced, then rounded once as one device rounds its accumulator
    y = tp.all_reduce(ops.expert_matmul(act, block_expert, p["experts_down"], kernels, out_dtype=F32))
    y = y.astype(x.dtype)[row]  # [P, H]
    routed = ops.fenced(kernels, _weighted_sum, y.reshape(-1, top_k, h), w)
    return (routed + _shared(p, x2, gate, kernels)).reshape(lead + (h,))


def by_expert_index(w: jax.Array, e: jax.Array):
    """(w, e) [T, k] with each token's pairs reordered by expert index (a token's k experts are distinct):
    pair j goes to place rank_j = #{j' : e_j' < e_j}, picked by comparisons (no sort)."""
    k = e.shape[-1]
    rank = jnp.sum(e[:, None, :] < e[:, :, None], axis=-1)  # [T, k]
    pick = rank[:, None, :] == jnp.arange(k)[None, :, None]  # [T, place, j]: the pair that goes to place
    take = lambda v: jnp.sum(jnp.where(pick, v[:, None, :], 0), axis=-1, dtype=v.dtype)  # noqa: E731 one nonzero term
    return take(w), take(e)


def _weighted_sum(y: jax.Array, w: jax.Array) -> jax.Array:
    """sum_j w[t, j] y[t, j] [T, H] for y [T, k, H], w [T, k]: each term rounded to y's dtype, added in j order."""
    terms = (y * w[..., None]).astype(y.dtype)
    out = terms[:, 0]
    for j in range(1, terms.shape[1]):
        out = out + terms[:, j]
    return out


def _shared(p: dict, x2: jax.Array, gate: jax.Array, kernels: KernelConfig) -> jax.Array:
    """sigmoid(gate) * SwiGLU_shared(x) [T, H] in x's dtype (the gating fenced); gate = x @ shared_gate.T [T, 1]."""
    shared_mlp = {k: p["shared_" + k] for k in ("mlp_gate", "mlp_up", "mlp_down")}
    return ops.fenced(kernels, _gated, gate, layers.mlp(shared_mlp, x2, kernels))


def _gated(gate: jax.Array, y: jax.Array) -> jax.Array:
    """sigmoid(gate) [T, 1], rounded to y's dtype, times y [T, H], in y's dtype."""
    return (jax.nn.sigmoid(gate.astype(F32)).astype(y.dtype) * y).astype(y.dtype)


def sparse_moe_ref(p: dict, x: jax.Array, *, top_k: int, norm_topk_prob: bool, kernels: KernelConfig) -> jax.Array:
    """The block's output [..., H] for x [..., H], every expert over every token (module doc)."""
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, h)  # [T, H]
    n_experts, two_i = p["experts_gate_up"].shape[:2]
    logits, gate = router_logits(p, x2, kernels)
    w, e = route(logits, top_k, norm_topk_prob, kernels)
    # [T, E]: which experts a token chose, and their weights (0 elsewhere)
    at = (jnp.arange(x2.shape[0])[:, None], e)
    chosen = jnp.zeros((x2.shape[0], n_experts), bool).at[at].set(True)
    weight = jnp.zeros(chosen.shape, x.dtype).at[at].set(w)

    def expert(acc, xs):
        gate_up, down, sel, wt = xs  # [2I, H], [H, I], [T], [T]
        g, u = jnp.split(ops.linear(x2, gate_up, kernels), [two_i // 2], axis=-1)
        y = layers.row_parallel(ops.swiglu(g, u, kernels, x.dtype), down, kernels)
        term = (y * wt[:, None]).astype(x.dtype)
        return jnp.where(sel[:, None], acc + term, acc), None  # tokens that did not choose it add nothing

    routed, _ = jax.lax.scan(expert, jnp.zeros_like(x2),
                             (p["experts_gate_up"], p["experts_down"], chosen.T, weight.T))
    return (routed + _shared(p, x2, gate, kernels)).reshape(lead + (h,))


def mlp(cfg: ModelConfig, p: dict, x: jax.Array, kernels: KernelConfig) -> jax.Array:
    """A decoder layer's MLP over x [..., H]: the sparse MoE block where the layer has a router (the
    config's MoE layers, qmtp/model/params.py), else the dense SwiGLU."""
    if "router" not in p and "router_gate" not in p:
        return layers.mlp(p, x, kernels)
    return sparse_moe(p, x, top_k=cfg.moe.top_k, norm_topk_prob=cfg.moe.norm_topk_prob, kernels=kernels)
