"""The target model: B sequences x T new tokens through every decoder layer (MODEL_SPEC §3.3).

    x0 = embed[ids];  per layer: h = x + Mixer(norm_in(x)); x = h + MLP(norm_post(h))
    hidden = final_norm(x);  logits = hidden @ lm_head.T

The mixer is Gated DeltaNet or gated attention per `cfg.layer_types`; layer params and state are
per-layer arrays (params["gdn"][j], state.ssm[j], ...), so no layer is sliced out of a stack. Token t of sequence b sits at position state.lengths[b] + t; tokens t >= n_valid[b]
are padding and change nothing (no KV write, no GDN/conv update, no length increment).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qmtp import layers, ops, tp
from qmtp.config import LINEAR, ModelConfig
from qmtp.state import DecodeState, PagedKV

# Prefill chunks GDN with the WY form above this many tokens; shorter calls (decode, verify) run
# the per-token recurrence, which is exact per position and cheap for T <= K+1.
CHUNKED_GDN_MIN_TOKENS = 16


def lm_head(params: dict) -> jax.Array:
    return params["lm_head"] if "lm_head" in params else params["embed"]


def logits_from_hidden(params: dict, hidden: jax.Array, impl: str) -> jax.Array:
    """[..., E] post-final-norm hidden -> f32 logits [..., V] (f32 accumulation, no rounding)."""
    return ops.linear(hidden, lm_head(params), impl, out_dtype=jnp.float32)


def draft_logits(params: dict, hidden: jax.Array, impl: str) -> jax.Array:
    """Logits of an MTP draft: through params["mtp"]["draft_head"] when the model was loaded with an
    FP8 draft head (half the bytes of the bf16 lm_head per draft step) or a draft vocabulary (then
    [..., Vs] over its ids: draft_token maps them), else the shared lm_head. Drafts are only
    proposals: the verify pass always uses the exact lm_head, so tokens never change."""
    head = params.get("mtp", {}).get("draft_head")
    if head is None:
        return logits_from_hidden(params, hidden, impl)
    return ops.linear(hidden, head, impl, out_dtype=jnp.float32)


def draft_token(params: dict, hidden: jax.Array, impl: str) -> jax.Array:
    """Greedy draft token ids [...] int32 from MTP hidden [..., E]: the argmax of draft_logits
    (across the vocabulary shards under TP), mapped through params["mtp"]["draft_vocab"] when the
    draft head holds only those rows (qmtp/draft_vocab.py)."""
    index = tp.greedy_argmax(draft_logits(params, hidden, impl))
    vocab = params.get("mtp", {}).get("draft_vocab")
    return index if vocab is None else jnp.take(vocab, index)


def decoder_layer(cfg: ModelConfig, p: dict, x: jax.Array, mixer, impl: str) -> tuple:
    """Pre-norm residual block around `mixer(normed x) -> (out, *new_state)`."""
    out, *new_state = mixer(layers.rms_norm(x, p["input_norm"], cfg.rms_norm_eps))
    h = x + out
    return h + layers.mlp(p, layers.rms_norm(h, p["post_norm"], cfg.rms_norm_eps), impl), new_state


def forward(cfg: ModelConfig, params: dict, state: DecodeState, tokens: jax.Array, n_valid: jax.Array,
            *, impl: str = "ref", return_gdn_replay: bool = False, gdn_slots=None):
    """Runs the target over tokens [B, T] (right-padded to n_valid [B]).

    Returns (hidden [B, T, E] post-final-norm, new state[, GDN replay]). Logits are taken from the
    hidden by the caller (`logits_from_hidden`) for the positions it needs. The replay (each entry
    stacked over the Lg GDN layers) lets `commit_gdn` rebuild the GDN/conv state after any prefix.
    gdn_slots int [B]: state.conv and state.ssm are slotted, [Ns, B, W-1, C] and [Ns, B, Hv, Dk, Dv] per
    layer (ops.GDN_STATE_SLOTS; speculate.slotted_state): each row reads slot gdn_slots[b] and the state
    after its token t lands in slot (gdn_slots[b] + 1 + t) mod Ns, so no replay is returned."""
    b, t = tokens.shape
    x = tp.embed_lookup(params["embed"], tokens)  # [B, T, E]
    chunked = t >= CHUNKED_GDN_MIN_TOKENS and not return_gdn_replay
    ks, vs, convs, ssms, per_token = [], [], [], [], []
    ids = {"gdn": 0, "attn": 0}
    for kind in cfg.layer_types:
        if kind == LINEAR:
            j = ids["gdn"]
            ids["gdn"] += 1
            p = params["gdn"][j]
            mixer = lambda h, p=p, j=j: layers.gated_deltanet(
                p, h, state.conv[j], state.ssm[j], n_valid, eps=cfg.rms_norm_eps, impl=impl, chunked=chunked,
                return_replay=return_gdn_replay, gdn_slots=gdn_slots)
            x, new = decoder_layer(cfg, p, x, mixer, impl)
            convs.append(new[0])
            ssms.append(new[1])
            if return_gdn_replay:
                per_token.append(new[2])
        else:
            j = ids["attn"]
            ids["attn"] += 1
            p = params["attn"][j]
            mixer = lambda h, p=p, j=j: layers.attention(
                p, h, state.kv.k[j], state.kv.v[j], state.page_table, state.lengths, n_valid,
                eps=cfg.rms_norm_eps, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta, impl=impl)
            x, new = decoder_layer(cfg, p, x, mixer, impl)
            ks.append(new[0])
            vs.append(new[1])
    hidden = layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    new_state = dataclasses.replace(
        state,
        kv=PagedKV(tuple(ks), tuple(vs)),
        conv=tuple(convs),
        ssm=tuple(ssms),
        lengths=state.lengths + n_valid,
    )
    if return_gdn_replay:
        return hidden, new_state, tuple(per_token)
    return hidden, new_state


def commit_gdn(replay: tuple, ssm0: tuple, n_keep: jax.Array, *, impl: str = "ref"):
    """GDN/conv state after the first n_keep [B] tokens of a forward that returned `replay`.

    ssm0 (Lg x [B, Hv, Dk, Dv]) is the state before that forward. Tokens t >= n_keep are masked
    (g = beta = 0 leaves the state exactly unchanged) and the per-token recurrence runs again from
    ssm0: the same arithmetic as the forward, so the result is the state the forward had after
    token n_keep - 1. A replay of the conv kernel (ops.GDN_CONV_IN_KERNEL) carries the old conv state:
    that kernel runs again from both old states and returns both. Returns (conv, ssm) tuples over
    the Lg layers."""
    convs, ssms = [], []
    for rep, s0 in zip(replay, ssm0):
        if "mixed" in rep:  # the forward ran the conv kernel (ops.GDN_CONV_IN_KERNEL): again, from the old states
            # a and b, or ba = [b | a] (qmtp.api.fuse_gate_projections) with a = b = None
            _, ssm, conv = ops.gdn_conv_recurrence(rep["mixed"], rep["conv"], rep["conv_w"], rep.get("a"),
                                                   rep.get("b"), rep["A_log"], rep["dt_bias"], s0, n_keep,
                                                   impl=impl, ba=rep.get("ba"))
            convs.append(conv)
            ssms.append(ssm.astype(s0.dtype))
            continue
        t = rep["q"].shape[1]
        width = rep["window"].shape[1] - t + 1
        convs.append(layers.conv_window_state(rep["window"], n_keep, width))
        if "a" in rep:  # the forward ran the gated kernel (ops.GDN_GATES_IN_KERNEL): the same kernel, n_keep tokens
            _, ssm = ops.gdn_recurrence_gated(rep["q"], rep["k"], rep["v"], rep["a"], rep["b"], rep["A_log"],
                                              rep["dt_bias"], s0, n_keep, impl=impl)
            ssms.append(ssm.astype(s0.dtype))
            continue
        keep = (jnp.arange(t)[None] < n_keep[:, None])[..., None]  # [B, T, 1]
        # g = beta = k = v = 0 on dropped tokens: exp(0) S + k (beta u)^T = S exactly, even for NaN inputs
        g, beta = (jnp.where(keep, rep[n], 0.0) for n in ("g", "beta"))
        k, v = (jnp.where(keep[..., None], rep[n], 0.0) for n in ("k", "v"))
        _, ssm = ops.gdn_recurrence(rep["q"], k, v, g, beta, s0, impl=impl)
        ssms.append(ssm.astype(s0.dtype))
    return tuple(convs), tuple(ssms)


def last_valid(x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """x [B, T, ...] -> x[b, n_valid[b] - 1] : [B, ...]."""
    idx = jnp.maximum(n_valid - 1, 0)
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
