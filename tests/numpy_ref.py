"""Independent float64 numpy formulas of MODEL_SPEC §3, written from the spec (not from qmtp code).

Used only by tests: explicit loops over heads and tokens, no shared helpers with the engine.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


def gated_rms_norm(x, z, w, eps):
    x, z = np.asarray(x, np.float64), np.asarray(z, np.float64)
    silu = z / (1.0 + np.exp(-z))
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64) * silu


def rope(x, pos, rotary_dim, theta):
    """x [..., D] at integer position pos; NeoX pairs (j, j + R/2) rotated by pos * theta^(-2j/R)."""
    x = np.array(x, np.float64)
    out = x.copy()
    half = rotary_dim // 2
    for j in range(half):
        ang = pos * theta ** (-2.0 * j / rotary_dim)
        a, b = x[..., j], x[..., j + half]
        out[..., j] = a * np.cos(ang) - b * np.sin(ang)
        out[..., j + half] = b * np.cos(ang) + a * np.sin(ang)
    return out


def gdn_recurrence(q, k, v, g, beta, s0):
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; s0 [Hv, Dk, Dv] -> (o [T, Hv, Dv], s)."""
    t_len, hk, _ = q.shape
    hv = v.shape[1]
    r = hv // hk
    s = np.array(s0, np.float64)
    o = np.zeros(v.shape, np.float64)
    for t in range(t_len):
        for h in range(hv):
            kh, qh = np.float64(k[t, h // r]), np.float64(q[t, h // r])
            s[h] *= np.exp(g[t, h])
            u = v[t, h] - s[h].T @ kh
            s[h] += np.outer(kh, beta[t, h] * u)
            o[t, h] = s[h].T @ qh
    return o, s


def causal_conv(u, state, w):
    """u [T, C], state [W-1, C] previous inputs, w [C, W] -> (silu(conv) [T, C], new state [W-1, C])."""
    width = w.shape[1]
    full = np.concatenate([state, u], 0).astype(np.float64)
    y = np.zeros(u.shape, np.float64)
    for t in range(u.shape[0]):
        for i in range(width):
            y[t] += w[:, i] * full[t + i]
    return y / (1.0 + np.exp(-y)), full[-(width - 1):]


def attention(q, k, v, q_pos, scale):
    """Causal GQA over contiguous keys. q [T, Hq, D] at positions q_pos [T]; k, v [N, Hkv, D] at 0..N-1."""
    t_len, hq, d = q.shape
    hkv = k.shape[1]
    o = np.zeros((t_len, hq, d), np.float64)
    for t in range(t_len):
        n = q_pos[t] + 1
        for h in range(hq):
            kh = h // (hq // hkv)
            s = (k[:n, kh] @ q[t, h]) * scale
            p = np.exp(s - s.max())
            o[t, h] = (p / p.sum()) @ v[:n, kh]
    return o


def fp8_dequant(w, scale, block=128):
    o, i = w.shape
    out = np.zeros((o, i), np.float64)
    for bo in range(scale.shape[0]):
        for bi in range(scale.shape[1]):
            sl = (slice(bo * block, (bo + 1) * block), slice(bi * block, (bi + 1) * block))
            out[sl] = w[sl].astype(np.float64) * np.float64(scale[bo, bi])
    return out
