"""Pure layer functions of the Qwen3.5 / Qwen3-Next decoder (MODEL_SPEC §3).

All functions take B sequences of T new tokens: x [B, T, E] in the compute dtype, `n_valid` [B]
(tokens t >= n_valid[b] are right-padding: they change no state), and the per-layer params / state
slices. Head counts are read from array shapes, never from the config, so the same functions run
on one device and on a tensor-parallel shard (local heads); row-parallel projections (o_proj,
out_proj, mlp_down) return f32 partial sums that `tp.all_reduce` adds (identity on one device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qmtp import ops, tp

F32 = jnp.float32


# ---- norms (§3.1, §3.2) ------------------------------------------------------------------------
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), in f32, cast back to x's dtype."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(F32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """GDN output norm (plain weight, not 1 + w): x / sqrt(mean(x^2) + eps) * w * silu(z), in f32."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y * w.astype(F32) * jax.nn.silu(z.astype(F32))


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
def mlp(p: dict, x: jax.Array, impl: str) -> jax.Array:
    """SwiGLU: down(silu(x @ gate.T) * (x @ up.T))."""
    gate, up = ops.linear_many(x, (p["mlp_gate"], p["mlp_up"]), impl)
    return row_parallel((jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(x.dtype), p["mlp_down"], impl)


def row_parallel(x: jax.Array, w, impl: str) -> jax.Array:
    """x @ W.T for a projection whose input dim may be split across shards: f32 partial sums,
    reduced across shards, rounded once to x's dtype (as one device rounds its accumulator once)."""
    return tp.all_reduce(ops.linear(x, w, impl, out_dtype=F32)).astype(x.dtype)


# ---- paged KV ----------------------------------------------------------------------------------
def write_kv(pages: jax.Array, page_table: jax.Array, positions: jax.Array, valid: jax.Array,
             new: jax.Array) -> jax.Array:
    """Scatters new [B, T, Hkv, D] into pages [P, S, Hkv, D] at `positions` [B, T] where `valid`.

    Invalid tokens, and positions beyond the page table, are dropped (never written)."""
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
                                       unique_indices=ops.KV_SCATTER_UNIQUE)
    return out.reshape(pages.shape)


# ---- gated full attention (§3.5) ---------------------------------------------------------------
def attention(p: dict, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
              lengths: jax.Array, n_valid: jax.Array, *, eps: float, rotary_dim: int, theta: float,
              impl: str):
    """Gated GQA attention of T new tokens at positions lengths + t over the paged KV.

    Returns (out [B, T, E], k_pages', v_pages'). q_proj rows are per head [query | gate]."""
    b, t, _ = x.shape
    d = p["q_norm"].shape[-1]
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    valid = jnp.arange(t)[None] < n_valid[:, None]  # [B, T]
    qg, k, v = ops.linear_many(x, (p["q_proj"], p["k_proj"], p["v_proj"]), impl)
    qg = qg.reshape(b, t, -1, 2 * d)  # [B, T, Hq, 2D]
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, -1)  # [B, T, Hq, D], [B, T, Hq*D]
    k, v = k.reshape(b, t, -1, d), v.reshape(b, t, -1, d)  # [B, T, Hkv, D]
    q = rope(rms_norm(q, p["q_norm"], eps), positions, rotary_dim, theta)
    k = rope(rms_norm(k, p["k_norm"], eps), positions, rotary_dim, theta)
    k_pages = write_kv(k_pages, page_table, positions, valid, k)
    v_pages = write_kv(v_pages, page_table, positions, valid, v)
    o = ops.paged_attention_op(q, k_pages, v_pages, page_table, positions, lengths + n_valid,
                               scale=d ** -0.5, impl=impl)  # [B, T, Hq, D]
    o = (o.reshape(b, t, -1).astype(F32) * jax.nn.sigmoid(gate.astype(F32))).astype(x.dtype)
    return row_parallel(o, p["o_proj"], impl), k_pages, v_pages


# ---- Gated DeltaNet (§3.6) ---------------------------------------------------------------------
def causal_conv(u: jax.Array, conv_state: jax.Array, w: jax.Array, n_valid: jax.Array):
    """Depthwise causal conv + SiLU over time. u [B, T, C]; conv_state [B, W-1, C] (previous inputs);
    w [C, W] (tap W-1 multiplies the current token).

    y_t[c] = silu(sum_i w[c, i] * u_{t-W+1+i}[c]); returns (y [B, T, C] f32, new state = the last W-1
    inputs up to each sequence's last valid token, window [B, W-1+T, C] = [state | u])."""
    width = w.shape[1]
    t = u.shape[1]
    window = jnp.concatenate([conv_state.astype(u.dtype), u], axis=1)  # [B, W-1+T, C]
    w32 = w.astype(F32)
    acc = sum(window[:, i:i + t].astype(F32) * w32[:, i] for i in range(width))
    return jax.nn.silu(acc), conv_window_state(window, n_valid, width).astype(conv_state.dtype), window


def conv_window_state(window: jax.Array, n_keep: jax.Array, width: int) -> jax.Array:
    """Conv state after the first n_keep [B] new tokens: window[b, n_keep + (0 .. W-2)] (inputs
    n_keep-W+1 .. n_keep-1 of the new tokens, reaching back into the old state)."""
    idx = n_keep[:, None] + jnp.arange(width - 1)[None]  # [B, W-1]
    return jnp.take_along_axis(window, idx[:, :, None], axis=1)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def conv_qkv(mixed: jax.Array, conv_state: jax.Array, w: jax.Array, n_valid: jax.Array, key_heads: int,
             dk: int, dv: int):
    """causal_conv of the raw in_proj_qkv output mixed [B, T, C] and its split into the recurrence
    inputs: ((q, k [B, T, Hk, Dk] L2-normalised, q scaled by Dk^-0.5; v [B, T, Hv, Dv]) f32, new conv
    state, window)."""
    b, t, _ = mixed.shape
    key_dim = key_heads * dk
    y, new_conv, window = causal_conv(mixed, conv_state, w, n_valid)  # y f32 [B, T, C]
    q = l2_normalize(y[..., :key_dim].reshape(b, t, key_heads, dk)) * dk ** -0.5
    k = l2_normalize(y[..., key_dim:2 * key_dim].reshape(b, t, key_heads, dk))
    v = y[..., 2 * key_dim:].reshape(b, t, -1, dv)
    return (q, k, v), new_conv, window


def gated_deltanet(p: dict, x: jax.Array, conv_state: jax.Array, ssm_state: jax.Array,
                   n_valid: jax.Array, *, eps: float, impl: str,
                   chunked: bool, return_replay: bool = False, gdn_slots=None):
    """Gated DeltaNet mixer. x [B, T, E]; conv_state [B, W-1, C]; ssm_state [B, Hv, Dk, Dv], or with
    gdn_slots int [B] both slotted, [Ns, B, W-1, C] and [Ns, B, Hv, Dk, Dv] (ops.GDN_STATE_SLOTS): row b
    starts from slot gdn_slots[b] and the state after each token t goes to slot (gdn_slots[b] + 1 + t)
    mod Ns (pallas_kernels/gdn_conv.py; the conv kernel or, for impl="ref", its jnp twin).

    Returns (out [B, T, E], conv_state', ssm_state'[, replay]). `replay` holds what rebuilds the
    state after any prefix of the T tokens without running the layer again (speculative commit):
    window [B, W-1+T, C] and the recurrence inputs q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] with g, beta
    [B, T, Hv] or, when the gates run inside the kernel (ops.GDN_GATES_IN_KERNEL), the raw a, b [B, T, Hv]
    with A_log and dt_bias [Hv]; when the conv runs inside the kernel as well (ops.GDN_CONV_IN_KERNEL),
    the kernel's inputs: the raw mixed [B, T, C], the old conv state [B, W-1, C], the conv weight
    [C, W] and a, b (or ba [B, T, 2 Hv] = [b | a] from in_proj_ba), A_log, dt_bias."""
    b, t, _ = x.shape
    hv = p["A_log"].shape[-1]
    dk, dv = ssm_state.shape[-2:]
    key_heads = (p["conv"].shape[0] - hv * dv) // (2 * dk)  # conv channels are q | k | v
    mixed, z = ops.linear_many(x, (p["in_proj_qkv"], p["in_proj_z"]), impl)  # [B, T, C] with C = q | k | v
    z = z.reshape(b, t, hv, dv)
    ba = None
    if "in_proj_ba" in p:  # both gate projections in one (qmtp.api.fuse_gate_projections): one launch, not two
        ba = ops.linear(x, p["in_proj_ba"], impl)  # [B, T, 2 Hv] = [b | a]
        b_raw, a_raw = ba[..., :hv], ba[..., hv:]
    else:
        b_raw = ops.linear(x, p["in_proj_b"], impl)  # [B, T, Hv]
        a_raw = ops.linear(x, p["in_proj_a"], impl)
    raw_gates = {"a": a_raw, "b": b_raw, "A_log": p["A_log"], "dt_bias": p["dt_bias"]}
    if not chunked and (gdn_slots is not None or ops.gdn_conv_in_kernel(impl)):
        # conv, norms, gates, padding and recurrence: one kernel (or its jnp twin for a slotted impl="ref"
        # state); the kernel reads ba's halves in place (slicing it would be two launches per layer on the GPU)
        gates = {"a": None, "b": None, "ba": ba} if ba is not None else {"a": a_raw, "b": b_raw}
        o, ssm, new_conv = ops.gdn_conv_recurrence(mixed, conv_state, p["conv"], a_log=p["A_log"],
                                                   dt_bias=p["dt_bias"], state=ssm_state, n_valid=n_valid,
                                                   impl=impl, state_kept=return_replay, slots=gdn_slots, **gates)
        # commit_gdn runs the same kernel from the old conv / ssm state with n_valid = the accepted length
        # (slotted, every token's state is in its slot already and nothing asks for the replay)
        replay = {"mixed": mixed, "conv": conv_state, "conv_w": p["conv"], "A_log": p["A_log"],
                  "dt_bias": p["dt_bias"], **gates}
    else:
        (q, k, v), new_conv, window = conv_qkv(mixed, conv_state, p["conv"], n_valid, key_heads, dk, dv)
        if not chunked and ops.gdn_gates_in_kernel(impl):  # gates and the padding select inside the kernel
            o, ssm = ops.gdn_recurrence_gated(q, k, v, a_raw, b_raw, p["A_log"], p["dt_bias"], ssm_state, n_valid,
                                              impl=impl)
            # commit_gdn runs the same kernel with n_valid = the accepted length
            replay = {"window": window, "q": q, "k": k, "v": v, **raw_gates}
        else:
            valid = jnp.arange(t)[None] < n_valid[:, None]  # [B, T]
            g, beta = ops.gdn_gates(a_raw, b_raw, p["A_log"], p["dt_bias"])  # g: log-decay <= 0
            beta, g = jnp.where(valid[..., None], beta, 0.0), jnp.where(valid[..., None], g, 0.0)
            # padding must not touch the state even if its inputs are not finite: zero k and v as well
            k, v = jnp.where(valid[:, :, None, None], k, 0.0), jnp.where(valid[:, :, None, None], v, 0.0)
            recurrence = ops.gdn_chunked if chunked else ops.gdn_recurrence
            o, ssm = recurrence(q, k, v, g, beta, ssm_state, impl=impl)
            replay = {"window": window, "q": q, "k": k, "v": v, "g": g, "beta": beta}
    o = gated_rms_norm(o, z, p["gdn_norm"], eps).astype(x.dtype).reshape(b, t, hv * dv)
    result = (row_parallel(o, p["out_proj"], impl), new_conv, ssm.astype(ssm_state.dtype))
    if return_replay:
        return result + (replay,)
    return result
