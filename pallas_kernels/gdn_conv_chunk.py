"""The body of `gdn_conv.gdn_conv_recurrence` for 2 <= T <= 8 tokens in one chunk (config form "chunk").

The sequential body (gdn_conv._conv_kernel) runs the tokens as a chain: each token's S^T k_t and
S^T q_t are cross-warp reductions that wait for the previous token's update, and each token's loads
wait for them. This body runs the same math with no chain (the WY form of gdn.gdn_chunked_ref over
one chunk): every token's inputs are loaded and convolved at once as [TP, n] tiles (TP = 16 rows, T
of them real, so every product below can be a Triton dot), and the state tile S0 [Dk, BV] is read
by two dots. With gamma = cumsum(g) over the tokens and Gam[t, s] = exp(gamma_t - gamma_s) (s <= t):

    L   = strict_lower(beta_t (k_t . k_s) Gam[t, s])                          [TP, TP]
    U   = (I + L)^-1 diag(beta) (V - diag(exp gamma) K S0)                    [TP, BV]
    O   = diag(exp gamma) Q S0 + (lower(Q K^T) * Gam) U                       [TP, BV]
    S_T = exp(gamma_T) S0 + (K * exp(gamma_T - gamma))^T U                    [Dk, BV]

which is the recurrence of gdn.py unrolled: u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t) expands to row
t of U, o_t = S_t^T q_t to row t of O. L is strictly lower triangular with rows only for the T <= 8
real tokens, so L^8 = 0 and (I + L)^-1 = (I - L)(I + L^2)(I + L^4) exactly in exact arithmetic (three
16 x 16 dots, no per-row solve). Rows t >= n_valid (padding, possibly NaN) are selected to k = q = v = 0,
g = beta = 0 before any product: their u is 0, they add nothing to S, and with n_valid = 0 the state
comes back as exp(0) S0 + 0 = S0. Every dot runs in f32 (Triton's IEEE mode, or three TF32 passes with chunk_precision "tf32x3"), so
the result matches the sequential form to f32 rounding, not bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
# Dot precisions by config.chunk_precision: "ieee" (f32 FMAs) or "tf32x3" (three TF32 tensor-core
# passes, ~f32 accuracy; the CPU interpreter runs it as ieee)
PRECISIONS = {"ieee": jax.lax.Precision.HIGHEST, "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}
# Rows of every per-token tile: Triton dots need >= 16 on each side; T <= MAX_CHUNK_TOKENS are real.
CHUNK_ROWS = 16
# (I + L)^-1 as (I - L)(I + L^2)(I + L^4) needs L^8 = 0: at most 8 real tokens.
MAX_CHUNK_TOKENS = 8


def precision_of(name: str, interpret: bool):
    if name not in PRECISIONS:
        raise ValueError(f"gdn_conv_recurrence: chunk_precision {name!r} is not one of {tuple(PRECISIONS)}")
    return PRECISIONS["ieee" if interpret else name]


def _l2(x, eps: float):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def chunk_kernel(mixed_ref, conv_ref, w_ref, a_ref, b_ref, alog_ref, dtb_ref, n_ref, s_ref,
                 o_ref, s_out_ref, conv_out_ref, *, n_tokens: int, key_heads: int, r: int, dv: int, scale: float,
                 l2_eps: float, precision):
    # Refs as gdn_conv._conv_kernel: mixed_ref [T, C]; conv_ref, conv_out_ref [W-1, C]; w_ref [C, W];
    # a_ref, b_ref [T]; alog_ref, dtb_ref, n_ref scalars; s_ref, s_out_ref [Dk, BV]; o_ref [T, BV].
    _dot = lambda x, y: jnp.dot(x, y, precision=precision, preferred_element_type=F32)  # noqa: E731
    dk, bv = s_ref.shape
    width = w_ref.shape[1]
    hist = width - 1  # conv-state rows ahead of the tokens in the window
    ih, iv = pl.program_id(1), pl.program_id(2)
    kh = ih // r
    groups = ((kh * dk, dk), ((key_heads + kh) * dk, dk), (2 * key_heads * dk + ih * dv + iv * bv, bv))  # q, k, v
    rows = jnp.arange(CHUNK_ROWS, dtype=jnp.int32)  # token t of each tile row (rows >= T are not tokens)
    n_valid = n_ref[()]
    valid = rows < n_valid  # [TP]

    def window_rows(idx, off: int, n: int):
        """Window rows idx [TP] (window = [conv state (W-1 rows) | the T tokens]) of channels off .. off+n,
        f32 after rounding the conv-state rows to mixed's dtype (as the ref joins them). Both loads use
        clamped, in-range row indices; the select keeps the right one."""
        old = conv_ref[jnp.clip(idx, 0, hist - 1), pl.ds(off, n)].astype(mixed_ref.dtype).astype(F32)
        new = mixed_ref[jnp.clip(idx - hist, 0, n_tokens - 1), pl.ds(off, n)].astype(F32)
        return jnp.where((idx < hist)[:, None], old, new)

    ys = []
    for off, n in groups:
        taps = [w_ref[pl.ds(off, n), i].astype(F32) for i in range(width)]
        acc = sum(window_rows(rows + i, off, n) * taps[i][None, :] for i in range(width))  # [TP, n]
        ys.append(jax.nn.silu(acc))
    live = valid[:, None]
    q = jnp.where(live, _l2(ys[0], l2_eps) * scale, 0.0)  # [TP, Dk]
    k = jnp.where(live, _l2(ys[1], l2_eps), 0.0)  # [TP, Dk]
    v = jnp.where(live, ys[2], 0.0)  # [TP, BV]

    gate_rows = jnp.clip(rows, 0, n_tokens - 1)
    x = a_ref[gate_rows].astype(F32) + dtb_ref[()].astype(F32)
    softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
    g = jnp.where(valid, -jnp.exp(alog_ref[()].astype(F32)) * softplus, 0.0)  # [TP] log-decay
    beta = jnp.where(valid, 1.0 / (1.0 + jnp.exp(-b_ref[gate_rows].astype(F32))), 0.0)  # [TP]

    row, col = rows[:, None], rows[None, :]
    gamma = jnp.sum(jnp.where(col <= row, g[None, :], 0.0), axis=1)  # [TP] inclusive cumsum
    total = jnp.sum(g)  # gamma of the last token (padding adds 0)
    gam = jnp.exp(jnp.where(col <= row, gamma[:, None] - gamma[None, :], -jnp.inf))  # [TP, TP], 0 above
    lmat = jnp.where(col < row, beta[:, None] * _dot(k, k.T) * gam, 0.0)  # [TP, TP] strictly lower
    eye = (row == col).astype(F32)
    l2 = _dot(lmat, lmat)
    inv = _dot(_dot(eye - lmat, eye + l2), eye + _dot(l2, l2))  # (I + L)^-1

    s0 = s_ref[...].astype(F32)  # [Dk, BV]
    decay = jnp.exp(gamma)[:, None]  # [TP, 1]
    u = _dot(inv, beta[:, None] * (v - decay * _dot(k, s0)))  # [TP, BV]
    qk = jnp.where(col <= row, _dot(q, k.T) * gam, 0.0)  # [TP, TP]
    o = decay * _dot(q, s0) + _dot(qk, u)  # [TP, BV]
    k_tail = k * jnp.exp(total - gamma)[:, None]  # [TP, Dk]
    s_out_ref[...] = (jnp.exp(total) * s0 + _dot(k_tail.T, u)).astype(s_out_ref.dtype)
    # o_ref has T rows: the TP rows go out through a masked store (rows >= T touch no memory)
    plgpu.store(o_ref.at[pl.ds(0, CHUNK_ROWS)], o.astype(o_ref.dtype), mask=(rows < n_tokens)[:, None])

    # The conv state after n_valid tokens: window rows n_valid .. n_valid + W-2.
    def store(group):
        off, n = groups[group]
        for i in range(hist):
            idx = jnp.full((1,), n_valid + i, jnp.int32)
            conv_out_ref[pl.ds(i, 1), pl.ds(off, n)] = window_rows(idx, off, n).astype(conv_out_ref.dtype)

    store(2)  # the v slice belongs to this program alone
    # q and k channels: one program per key head writes them (gdn_conv._conv_kernel says why).
    @pl.when((ih % r == 0) & (iv == 0))
    def _():
        store(0)
        store(1)
