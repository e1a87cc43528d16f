"""The target model: B sequences x T new tokens through every decoder layer (MODEL_SPEC §3.3).

    x0 = embed[ids];  per layer: h = x + Mixer(norm_in(x)); x = h + MLP(norm_post(h))
    hidden = final_norm(x);  logits = hidden @ lm_head.T

The mixer is Gated DeltaNet or gated attention per `cfg.layer_types`, with per-layer params and
state (params["gdn"][j], state.ssm[j], ...). Token t of sequence b sits at position state.lengths[b] + t;
tokens t >= n_valid[b] are padding and change nothing (no KV write, no GDN/conv update, no length increment).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qmtp.model import layers, moe
from qmtp.model.config import FULL, LINEAR, ModelConfig
from qmtp.runtime import ops, tp
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.runtime.state import DecodeState, PagedKV


def lm_head(params: dict) -> jax.Array:
    return params["lm_head"] if "lm_head" in params else params["embed"]


def logits_from_hidden(params: dict, hidden: jax.Array, kernels: KernelConfig) -> jax.Array:
    """[..., E] post-final-norm hidden -> f32 logits [..., V] (f32 accumulation, no rounding)."""
    hidden = tp.check_replicated(hidden, "the hidden state before the lm_head")
    return ops.linear(hidden, lm_head(params), kernels, out_dtype=jnp.float32)


def draft_logits(params: dict, hidden: jax.Array, kernels: KernelConfig) -> jax.Array:
    """Logits of an MTP draft: through params["mtp"]["draft_head"] (an FP8 copy of the lm_head, or its
    rows of a draft vocabulary: [..., Vs]) where loaded, else the lm_head. Only drafts use it: the
    verify pass keeps the exact lm_head, so tokens never change."""
    head = params.get("mtp", {}).get("draft_head")
    if head is None:
        return logits_from_hidden(params, hidden, kernels)
    return ops.linear(tp.check_replicated(hidden, "the MTP hidden state"), head, kernels, out_dtype=jnp.float32)


def draft_token(params: dict, hidden: jax.Array, kernels: KernelConfig) -> jax.Array:
    """Greedy draft token ids [...] int32 from MTP hidden [..., E]: the argmax of draft_logits (across
    vocabulary shards under TP), mapped through params["mtp"]["draft_vocab"] where the head has its rows."""
    index = tp.greedy_argmax(draft_logits(params, hidden, kernels))
    vocab = params.get("mtp", {}).get("draft_vocab")
    return index if vocab is None else jnp.take(vocab, index)


def decoder_layer(cfg: ModelConfig, p: dict, x: jax.Array, mixer, kernels: KernelConfig, taps=None) -> tuple:
    """Pre-norm residual block around `mixer(normed x) -> (out, *new_state)`; taps (see `forward`), a
    (dict, layer index) pair, receives the mixer's output, the MLP's normed input and its output."""
    out, *new_state = mixer(layers.rms_norm(x, p["input_norm"], cfg.rms_norm_eps, kernels))
    h = x + out
    normed = layers.rms_norm(h, p["post_norm"], cfg.rms_norm_eps, kernels)
    mlp_out = moe.mlp(cfg, p, normed, kernels)
    if taps is not None:
        record, i = taps
        record[f"layer {i} mixer"], record[f"layer {i} mlp input"], record[f"layer {i} mlp"] = out, normed, mlp_out
    return h + mlp_out, new_state


def _layer_inputs(params: dict, state: DecodeState, kind: str, j: int) -> tuple[dict, tuple]:
    """The j-th layer of `kind`'s params and state: (conv, ssm) for GDN, (k pages, v pages) for attention."""
    if kind == LINEAR:
        return params["gdn"][j], (state.conv[j], state.ssm[j])
    return params["attn"][j], (state.kv.k[j], state.kv.v[j])


def _layer(cfg: ModelConfig, kind: str, p: dict, x: jax.Array, layer_state: tuple, page_table: jax.Array,
           lengths: jax.Array, n_valid: jax.Array, kernels: KernelConfig, gdn_slots=None, taps=None):
    """One decoder layer of `kind` over x [B, T, E] at positions lengths + t -> (x', its new state tuple)."""
    eps = cfg.rms_norm_eps
    if kind == LINEAR:
        mixer = lambda h: layers.gated_deltanet(  # noqa: E731
            p, h, *layer_state, n_valid, eps=eps, kernels=kernels, gdn_slots=gdn_slots)
    else:
        mixer = lambda h: layers.attention(  # noqa: E731
            p, h, *layer_state, page_table, lengths, n_valid, eps=eps, rotary_dim=cfg.rotary_dim,
            theta=cfg.rope_theta, kernels=kernels)
    x, new_state = decoder_layer(cfg, p, x, mixer, kernels, taps)
    return x, tuple(new_state)


def _with_layer_states(state: DecodeState, new: dict, n_valid: jax.Array) -> DecodeState:
    """state after a pass: new[kind] holds each layer's new state tuple, in layer order per kind."""
    (convs, ssms), (ks, vs) = (tuple(zip(*new[kind])) or ((), ()) for kind in (LINEAR, FULL))
    return dataclasses.replace(state, kv=PagedKV(ks, vs), conv=convs, ssm=ssms, lengths=state.lengths + n_valid)


def forward(cfg: ModelConfig, params: dict, state: DecodeState, tokens: jax.Array, n_valid: jax.Array,
            kernels: KernelConfig, gdn_slots=None, taps: dict | None = None):
    """Runs the target over tokens [B, T] (right-padded to n_valid [B]) -> (hidden [B, T, E]
    post-final-norm, new state); the caller takes logits (`logits_from_hidden`) where it needs them.
    gdn_slots int [B]: state.conv / state.ssm are the slot ring (layers.gated_deltanet).
    taps: a dict that receives every layer's mixer output, MLP input and MLP output [B, T, E] ("layer i
    mixer", "layer i mlp input", "layer i mlp"), for a caller that returns it from its traced function
    (where a row's numbers change: tests/test_row_invariance_model.py)."""
    x = tp.embed_lookup(params["embed"], tokens)  # [B, T, E]
    new = {LINEAR: [], FULL: []}  # per kind, each layer's new (conv, ssm) / (k, v)
    for i, kind in enumerate(cfg.layer_types):
        p, layer_state = _layer_inputs(params, state, kind, len(new[kind]))
        x, layer_state = _layer(cfg, kind, p, x, layer_state, state.page_table, state.lengths, n_valid, kernels,
                                gdn_slots, None if taps is None else (taps, i))
        new[kind].append(layer_state)
    hidden = layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, kernels)
    return hidden, _with_layer_states(state, new, n_valid)


def forward_by_layer(cfg: ModelConfig, params: dict, state: DecodeState, tokens: jax.Array, n_valid: jax.Array,
                     kernels: KernelConfig, chunk: int):
    """`forward` over a prompt of whole chunks, tokens [B, N * chunk], one layer at a time: each layer runs
    the N chunks in a lax.scan, chunk c after the KV and GDN/conv state that chunk c - 1 left, on weights
    prepared once for the layer (ops.prefill_weights: FP8 projections dequantized once, not once per chunk
    as a scan of whole-model chunk passes would), each chunk's output written over its input in the
    scan's carry (one [N, B, C, E] buffer for all layers). A chunk of padding only is skipped. Each chunk of a
    layer computes what `forward` over that chunk computes for it."""
    b, t = tokens.shape
    n = t // chunk
    offsets = jnp.arange(n, dtype=jnp.int32) * chunk
    chunk_valid = jnp.clip(n_valid[None] - offsets[:, None], 0, chunk)  # [N, B] each chunk's real tokens
    starts = state.lengths[None] + jnp.minimum(n_valid[None], offsets[:, None])  # [N, B] KV length before it
    x = tp.embed_lookup(params["embed"], tokens)  # [B, T, E]
    x = x.reshape(b, n, chunk, -1).swapaxes(0, 1)  # [N, B, C, E]
    new = {LINEAR: [], FULL: []}
    for kind in cfg.layer_types:
        p, layer_state = _layer_inputs(params, state, kind, len(new[kind]))
        p = ops.prefill_weights(p, b * chunk, x.dtype, kernels)

        def one(carry, xs, kind=kind, p=p):  # chunk c of this layer, after the state chunk c - 1 left
            layer_state, x = carry
            c, nv, start = xs
            xc = x[c]

            def run(layer_state):
                y, layer_state = _layer(cfg, kind, p, xc, layer_state, state.page_table, start, nv, kernels)
                return layer_state, y
            layer_state, y = jax.lax.cond(jnp.any(nv > 0), run, lambda s: (s, jnp.zeros_like(xc)), layer_state)
            # the layer's output overwrites its input chunk in the carry: one [N, B, C, E] buffer for every
            # layer (a scan's stacked outputs kept one per layer alive: +1 [T, E] per layer on CPU and GPU)
            return (layer_state, x.at[c].set(y)), None

        (layer_state, x), _ = jax.lax.scan(one, (layer_state, x), (jnp.arange(n), chunk_valid, starts))
        new[kind].append(layer_state)
    hidden = layers.rms_norm(x.swapaxes(0, 1).reshape(b, t, -1), params["final_norm"], cfg.rms_norm_eps, kernels)
    return hidden, _with_layer_states(state, new, n_valid)


def last_valid(x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """x [B, T, ...] -> x[b, n_valid[b] - 1] : [B, ...]."""
    idx = jnp.maximum(n_valid - 1, 0)
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
