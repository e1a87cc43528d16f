"""Pure layer functions of the Qwen3.5 / Qwen3-Next decoder (MODEL_SPEC §3).

B sequences of T new tokens: x [B, T, E] in the compute dtype, `n_valid` [B] (tokens t >= n_valid[b]
are right-padding and change no state), per-layer params / state. Head counts come from array shapes,
so the same code runs on a tensor-parallel shard; row-parallel projections (o_proj, out_proj, mlp_down)
are summed across shards by `tp.all_reduce` (identity on one device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qmtp.runtime import ops, tp
from qmtp.runtime.kernel_config import KernelConfig

F32 = jnp.float32
# Passes of at least this many tokens (prefill) run GDN in the chunked WY form; shorter ones the
# per-token recurrence (exact per position, cheap for T <= K+1).
CHUNKED_GDN_MIN_TOKENS = 16


# ---- norms (§3.1, §3.2) ------------------------------------------------------------------------
def rms_norm(x: jax.Array, w: jax.Array, eps: float, kernels: KernelConfig | None = None) -> jax.Array:
    """Zero-centred RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), in f32, cast back to x's dtype
    (ops.rms_norm: row-invariant under kernels.deterministic)."""
    return ops.rms_norm(x, w, eps, kernels, plus_one=True)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float,
                   kernels: KernelConfig | None = None, out_dtype=F32) -> jax.Array:
    """GDN output norm (plain weight, not 1 + w): x / sqrt(mean(x^2) + eps) * w * silu(z), in f32, rounded
    once to out_dtype."""
    return ops.rms_norm(x, w, eps, kernels, plus_one=False, z=z, out_dtype=out_dtype)


# ---- rotary embedding (§3.5) -------------------------------------------------------------------
def rope(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Partial NeoX (rotate-half) RoPE on dims [0, R) of each head; x [B, T, H, D], positions [B, T].

    inv_freq[j] = theta^(-2j/R); angle = pos * inv_freq; with x1 = x[:R/2], x2 = x[R/2:R]:
    [x1 cos - x2 sin, x2 cos + x1 sin]; dims [R, D) pass through."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=F32) * 2.0 / rotary_dim))  # [R/2]
    angles = positions.astype(F32)[..., None] * inv_freq  # [B, T, R/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(F32)
    x1, x2, rest = x32[..., :half], x32[..., half:rotary_dim], x32[..., rotary_dim:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


# ---- MLP (§3.4) --------------------------------------------------------------------------------
def mlp(p: dict, x: jax.Array, kernels: KernelConfig) -> jax.Array:
    """SwiGLU: down(silu(x @ gate.T) * (x @ up.T))."""
    gate, up = ops.linear_many(x, (p["mlp_gate"], p["mlp_up"]), kernels)
    return row_parallel(ops.swiglu(gate, up, kernels, x.dtype), p["mlp_down"], kernels)


def row_parallel(x: jax.Array, w, kernels: KernelConfig) -> jax.Array:
    """x @ W.T for a projection whose input dim may be split across shards: f32 partial sums,
    reduced across shards, rounded once to x's dtype (as one device rounds its accumulator once)."""
    return tp.all_reduce(ops.linear(x, w, kernels, out_dtype=F32)).astype(x.dtype)


# ---- paged KV ----------------------------------------------------------------------------------
def write_kv(pages: jax.Array, page_table: jax.Array, positions: jax.Array, valid: jax.Array,
             new: jax.Array) -> jax.Array:
    """Scatters new [B, T, Hkv, D] into pages [P, S, Hkv, D] at `positions` [B, T] where `valid`;
    invalid tokens and positions beyond the page table are dropped (never written)."""
    n_pages, page_size = pages.shape[:2]
    slot = positions // page_size
    in_table = slot < page_table.shape[1]
    page = jnp.take_along_axis(page_table, jnp.minimum(slot, page_table.shape[1] - 1), axis=1)
    # dropped tokens get distinct out-of-range rows, so every index is unique (sequences own their pages)
    dropped = n_pages * page_size + jnp.arange(positions.size, dtype=positions.dtype).reshape(positions.shape)
    flat = jnp.where(valid & in_table, page * page_size + positions % page_size, dropped)
    out = pages.reshape((n_pages * page_size,) + pages.shape[2:])
    # unique_indices: XLA may write the rows in parallel with plain stores, without ordering the updates
    out = out.at[flat.reshape(-1)].set(new.reshape((-1,) + new.shape[2:]).astype(pages.dtype), mode="drop",
                                       unique_indices=True)
    return out.reshape(pages.shape)


# ---- gated full attention (§3.5) ---------------------------------------------------------------
def attention(p: dict, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
              lengths: jax.Array, n_valid: jax.Array, *, eps: float, rotary_dim: int, theta: float,
              kernels: KernelConfig):
    """Gated GQA attention of T new tokens at positions lengths + t over the paged KV -> (out [B, T, E],
    k_pages', v_pages'). q_proj rows are per head [query | gate]."""
    b, t, _ = x.shape
    d = p["q_norm"].shape[-1]
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    valid = jnp.arange(t)[None] < n_valid[:, None]  # [B, T]
    qg, k, v = ops.linear_many(x, (p["q_proj"], p["k_proj"], p["v_proj"]), kernels)
    qg = qg.reshape(b, t, -1, 2 * d)  # [B, T, Hq, 2D]
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, -1)  # [B, T, Hq, D], [B, T, Hq*D]
    k, v = k.reshape(b, t, -1, d), v.reshape(b, t, -1, d)  # [B, T, Hkv, D]
    q = ops.fenced(kernels, lambda h, pos: rope(h, pos, rotary_dim, theta), rms_norm(q, p["q_norm"], eps, kernels),
                   positions)
    k = ops.fenced(kernels, lambda h, pos: rope(h, pos, rotary_dim, theta), rms_norm(k, p["k_norm"], eps, kernels),
                   positions)
    k_pages = write_kv(k_pages, page_table, positions, valid, k)
    v_pages = write_kv(v_pages, page_table, positions, valid, v)
    o = ops.paged_attention_op(q, k_pages, v_pages, page_table, positions, lengths + n_valid,
                               scale=d ** -0.5, kernels=kernels)  # [B, T, Hq, D]
    o = ops.fenced(kernels, lambda o, g: (o.astype(F32) * jax.nn.sigmoid(g.astype(F32))).astype(x.dtype),
                   o.reshape(b, t, -1), gate)
    return row_parallel(o, p["o_proj"], kernels), k_pages, v_pages


# ---- Gated DeltaNet (§3.6) ---------------------------------------------------------------------
def causal_conv(u: jax.Array, conv_state: jax.Array, w: jax.Array, n_valid: jax.Array):
    """Depthwise causal conv + SiLU: u [B, T, C], conv_state [B, W-1, C] (previous inputs), w [C, W]
    (tap W-1 on the current token); y_t[c] = silu(sum_i w[c, i] * u_{t-W+1+i}[c]). Returns (y [B, T, C]
    f32, new state = window[b, n_valid + (0 .. W-2)] of the window [state | u])."""
    width, t = w.shape[1], u.shape[1]
    window = jnp.concatenate([conv_state.astype(u.dtype), u], axis=1)  # [B, W-1+T, C]
    w32 = w.astype(F32)
    acc = sum(window[:, i:i + t].astype(F32) * w32[:, i] for i in range(width))
    idx = n_valid[:, None] + jnp.arange(width - 1)[None]  # [B, W-1]
    return jax.nn.silu(acc), jnp.take_along_axis(window, idx[:, :, None], axis=1).astype(conv_state.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def conv_qkv(mixed: jax.Array, conv_state: jax.Array, w: jax.Array, n_valid: jax.Array, key_heads: int,
             dk: int, dv: int):
    """causal_conv of in_proj_qkv's output mixed [B, T, C], split: ((q, k [B, T, Hk, Dk] L2-normalised,
    q scaled by Dk^-0.5; v [B, T, Hv, Dv]) f32, new conv state)."""
    b, t, _ = mixed.shape
    key_dim = key_heads * dk
    y, new_conv = causal_conv(mixed, conv_state, w, n_valid)  # y f32 [B, T, C]
    q = l2_normalize(y[..., :key_dim].reshape(b, t, key_heads, dk)) * dk ** -0.5
    k = l2_normalize(y[..., key_dim:2 * key_dim].reshape(b, t, key_heads, dk))
    v = y[..., 2 * key_dim:].reshape(b, t, -1, dv)
    return (q, k, v), new_conv


def gated_deltanet(p: dict, x: jax.Array, conv_state: jax.Array, ssm_state: jax.Array,
                   n_valid: jax.Array, *, eps: float, kernels: KernelConfig, gdn_slots=None):
    """Gated DeltaNet mixer -> (out [B, T, E], conv_state', ssm_state'). x [B, T, E]; conv_state
    [B, W-1, C]; ssm_state [B, Hv, Dk, Dv] f32, or with gdn_slots int [B] both in the slot ring,
    [Ns, B, W-1, C] and [Ns, B, Hv, Dk, Dv]: row b starts from slot gdn_slots[b] and the state after
    token t goes to slot (gdn_slots[b] + 1 + t) mod Ns. Passes shorter than CHUNKED_GDN_MIN_TOKENS
    run conv, norms, gates and the per-token recurrence in one kernel (ops.gdn_conv_recurrence)."""
    b, t, _ = x.shape
    hv = p["A_log"].shape[-1]
    dk, dv = ssm_state.shape[-2:]
    mixed, z = ops.linear_many(x, (p["in_proj_qkv"], p["in_proj_z"]), kernels)  # [B, T, C] with C = q | k | v
    z = z.reshape(b, t, hv, dv)
    if "in_proj_ba" in p:  # both gate projections joined at load (checkpoint.fuse_gate_projections)
        ba = ops.linear(x, p["in_proj_ba"], kernels)  # [B, T, 2 Hv] = [b | a]
    else:  # a tree as a checkpoint or the trainer holds it
        ba = jnp.concatenate([ops.linear(x, p["in_proj_b"], kernels), ops.linear(x, p["in_proj_a"], kernels)], -1)
    if gdn_slots is not None or t < CHUNKED_GDN_MIN_TOKENS:
        # the kernel reads ba's halves in place (slicing it would be two launches per layer on the GPU)
        o, ssm, new_conv = ops.gdn_conv_recurrence(mixed, conv_state, p["conv"], ba, p["A_log"], p["dt_bias"],
                                                   ssm_state, n_valid, kernels, slots=gdn_slots)
    else:
        key_heads = (p["conv"].shape[0] - hv * dv) // (2 * dk)  # conv channels are q | k | v
        (q, k, v), new_conv = conv_qkv(mixed, conv_state, p["conv"], n_valid, key_heads, dk, dv)
        valid = (jnp.arange(t)[None] < n_valid[:, None])[..., None]  # [B, T, 1]
        g, beta = ops.gdn_gates(ba[..., hv:], ba[..., :hv], p["A_log"], p["dt_bias"])  # g: log-decay <= 0
        beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)
        # padding must not touch the state even if its inputs are not finite: zero k and v as well
        k, v = jnp.where(valid[..., None], k, 0.0), jnp.where(valid[..., None], v, 0.0)
        o, ssm = ops.gdn_chunked(q, k, v, g, beta, ssm_state, kernels)
    # rounded to x's dtype by the norm kernel itself: with the convert left to XLA (fused into out_proj's
    # input preparation), a decode step's out_proj gave other bits than the same token's in a verify
    # (H100, --deterministic); with it in the kernel they agree
    o = gated_rms_norm(o, z, p["gdn_norm"], eps, kernels, out_dtype=x.dtype).reshape(b, t, hv * dv)
    return row_parallel(o, p["out_proj"], kernels), new_conv, ssm.astype(ssm_state.dtype)
