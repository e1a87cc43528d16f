"""Attention of T queries per sequence over a paged KV cache (GQA, causal, lengths-masked).

    o[b, t, h] = sum_j softmax_j(q[b, t, h] . k_j * scale) v_j     over key positions j with
                 j < kv_lengths[b] and j <= q_positions[b, t]

where key position j of sequence b lives in page page_table[b, j // S], slot j % S, and query head
h reads KV head h // (Hq / Hkv). Shapes: q [B, T, Hq, D]; k_pages, v_pages [P, S, Hkv, D];
page_table [B, Pmax] int32; q_positions [B, T] int32; kv_lengths [B] int32 -> o [B, T, Hq, D].
Slots outside the mask may hold anything (NaN included): they never reach the output.
This file holds the pure-jnp reference; the Pallas kernel joins it (issue 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(q, k_pages, v_pages, page_table, q_positions, kv_lengths) -> None:
    b, t, hq, d = q.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[-1] != d:
        raise ValueError(f"paged_attention: k_pages {k_pages.shape} / v_pages {v_pages.shape} must be "
                         f"[P, S, Hkv, {d}]")
    if hq % k_pages.shape[2]:
        raise ValueError(f"paged_attention: Hq={hq} is not a multiple of Hkv={k_pages.shape[2]}")
    if page_table.shape[0] != b or q_positions.shape != (b, t) or kv_lengths.shape != (b,):
        raise ValueError(f"paged_attention: page_table {page_table.shape}, q_positions {q_positions.shape}, "
                         f"kv_lengths {kv_lengths.shape} do not match q {q.shape}")


def paged_attention_ref(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale: float):
    """Reference: gather each sequence's pages into a contiguous [Pmax*S] context, mask, softmax in f32."""
    _check(q, k_pages, v_pages, page_table, q_positions, kv_lengths)
    b, t, hq, d = q.shape
    _, s, hkv, _ = k_pages.shape
    n_ctx = page_table.shape[1] * s
    keys = k_pages[page_table].reshape(b, n_ctx, hkv, d)  # [B, N, Hkv, D]
    vals = v_pages[page_table].reshape(b, n_ctx, hkv, d)
    pos = jnp.arange(n_ctx, dtype=jnp.int32)
    valid = (pos[None, None, :] < kv_lengths[:, None, None]) & (pos[None, None, :] <= q_positions[:, :, None])
    vals = jnp.where((pos[None, :] < kv_lengths[:, None])[:, :, None, None], vals, 0)  # NaN-safe
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bnkd->bkgtn", qg, keys.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    scores = jnp.where(valid[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(valid[:, None, None], probs, 0.0)  # rows with no valid key give 0, not NaN
    o = jnp.einsum("bkgtn,bnkd->btkgd", probs, vals.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return o.reshape(b, t, hq, d).astype(q.dtype)
