"""The MTP head (MODEL_SPEC §4.1): one draft step over T tokens, with its own paged KV.

At draft position p, from the token that follows p and a hidden for p:

    e   = norm(embed[x_{p+1}]; pre_fc_norm_embedding)      zero-centred RMSNorms
    hh  = norm(h_p; pre_fc_norm_hidden)                     h_p: target post-final-norm hidden, or
                                                            the MTP's own output when drafting on
    u   = concat([e, hh]) @ fc.T                            embedding first, [2E] -> [E]
    u   = full-attention decoder layer (mtp.layers.0) at position p, KV in state.mtp_kv
    hm  = norm(u; mtp.norm)                                 the "MTP hidden"
    logits(x_{p+2}) = hm @ lm_head.T                        lm_head / embed shared with the target

The draft KV is indexed by the target's positions (lag-1: entry p is computed from x_{p+1}), so it
shares the target's page table; `start` says where the T tokens go.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qmtp.model import layers, target
from qmtp.model.config import ModelConfig
from qmtp.runtime import ops, tp
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.runtime.state import DecodeState


def check_supported(cfg: ModelConfig) -> None:
    if cfg.mtp_layers != 1:
        raise ValueError(f"mtp_num_hidden_layers={cfg.mtp_layers}: MTP speculative decoding needs a checkpoint "
                         "with exactly one MTP layer (mtp.layers.0)")


def forward(cfg: ModelConfig, params: dict, state: DecodeState, tokens: jax.Array, hidden: jax.Array,
            start: jax.Array, n_valid: jax.Array, kernels: KernelConfig):
    """MTP over tokens [B, T] (x_{p+1}) and hiddens [B, T, E] (h_p) at positions start[b] + t ->
    (MTP hidden [B, T, E] after mtp.norm, state with mtp_kv updated; lengths are the target's).
    Tokens t >= n_valid[b] write no KV."""
    mp = params["mtp"]
    eps = cfg.rms_norm_eps
    e = layers.rms_norm(tp.embed_lookup(params["embed"], tokens), mp["pre_fc_norm_embedding"], eps, kernels)  # [B, T, E]
    hh = layers.rms_norm(hidden.astype(e.dtype), mp["pre_fc_norm_hidden"], eps, kernels)
    u = ops.linear(jnp.concatenate([e, hh], axis=-1), mp["fc"], kernels)  # [B, T, E]
    p = mp["layers"][0]
    mixer = lambda h: layers.attention(p, h, state.mtp_kv.k[0], state.mtp_kv.v[0], state.page_table, start,
                                       n_valid, eps=eps, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta,
                                       kernels=kernels)
    u, (k_pages, v_pages) = target.decoder_layer(cfg, p, u, mixer, kernels)
    hm = layers.rms_norm(u, mp["norm"], eps, kernels)
    return hm, dataclasses.replace(state, mtp_kv=state.mtp_kv.replace_layer(0, k_pages, v_pages))


def shift_left(tokens: jax.Array, n_valid: jax.Array, last: jax.Array) -> jax.Array:
    """[x_0 .. x_{n-1}] -> [x_1 .. x_{n-1}, last] per sequence (the MTP's input tokens)."""
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    b = tokens.shape[0]
    return shifted.at[jnp.arange(b), jnp.maximum(n_valid - 1, 0)].set(last)
