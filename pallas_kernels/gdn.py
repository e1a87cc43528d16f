"""Gated delta rule (Gated DeltaNet recurrence), MODEL_SPEC §3.6 steps 4-7: the pure-jnp references.

Per value head h (key head h // r, r = Hv / Hk), state S in R^{Dk x Dv} (f32), per token t:

    S   <- exp(g_t) * S
    u    = v_t - S^T k_t                 (delta: value minus the current prediction)
    S   <- S + k_t (beta_t * u)^T         (rank-1 update)
    o_t  = S^T q_t                        (read with the updated state)

Inputs (conv'd, L2-normalised, q scaled by Dk^-0.5): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (log-decay
<= 0), beta [B, T, Hv] f32; state [B, Hv, Dk, Dv] f32. A token with g = beta = 0 leaves the state unchanged
(how callers mask padding). Outputs o [B, T, Hv, Dv] f32, the final state and, with return_states, the
state after every token [B, T, Hv, Dk, Dv]. The fused decode / verify kernel is gdn_conv.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
WY_CHUNK = 64  # tokens per chunk of the prefill's WY form


def _expand_heads(x: jax.Array, hv: int, axis: int = 2) -> jax.Array:
    """[B, T, Hk, D] -> [B, T, Hv, D] (heads on `axis`): each key head repeated r times consecutively (h // r)."""
    return jnp.repeat(x, hv // x.shape[axis], axis=axis)


def _check(q, k, v, g, beta, state) -> None:
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (b, t) or hv % hk:
        raise ValueError(f"gdn: q {q.shape}, k {k.shape}, v {v.shape} need q,k [B,T,Hk,Dk], v [B,T,Hv,Dv], Hk | Hv")
    if g.shape != (b, t, hv) or beta.shape != (b, t, hv) or state.shape != (b, hv, dk, dv):
        raise ValueError(f"gdn: g {g.shape}, beta {beta.shape}, state {state.shape} do not match q/v")


def gdn_recurrence_ref(q, k, v, g, beta, state, return_states: bool = False):
    """Token-by-token recurrence (lax.scan over T)."""
    _check(q, k, v, g, beta, state)
    hv = v.shape[2]
    f32 = lambda x: x.astype(jnp.float32)
    q, k = f32(_expand_heads(q, hv)), f32(_expand_heads(k, hv))
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, f32(v), f32(g), f32(beta)))

    def step(s, inputs):
        q_t, k_t, v_t, g_t, b_t = inputs  # [B, H, Dk], [B, H, Dk], [B, H, Dv], [B, H], [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        u = v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * u, precision=HIGHEST)
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)
        return s, (o_t, s) if return_states else (o_t, None)

    final, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs)
    o = jnp.moveaxis(o, 0, 1)
    if return_states:
        return o, final, jnp.moveaxis(states, 0, 1)
    return o, final


def gdn_chunked_ref(q, k, v, g, beta, state, chunk: int = WY_CHUNK):
    """Chunked WY form (the prefill path: sequential over chunks, parallel inside). Per chunk (local i, j),
    gamma = cumsum(g), Gam_ij = exp(gamma_i - gamma_j):

        L   = strict_lower(beta_i k_i.k_j Gam_ij);  Tm = (I + L)^-1
        U   = Tm diag(beta) V;                      W = Tm diag(beta exp(gamma)) K
        Vn  = U - W S
        O   = (Q * exp(gamma)) S + ((Q K^T) * Gam * [i >= j]) Vn
        S  <- exp(gamma_C) S + (K * exp(gamma_C - gamma))^T Vn

    T is padded to a multiple of `chunk` with g = beta = 0 tokens, which leave S unchanged. The chunk-parallel
    part is `wy_chunk_inputs`, the sequential part `wy_chunk_states_ref` (its kernel: gdn_chunked.py), then
    every chunk's O at once (`wy_chunk_outputs`)."""
    qg, qk, u, w, kd, decay = wy_chunk_inputs(q, k, v, g, beta, state, chunk)
    vn, entering, final = wy_chunk_states_ref(u, w, kd, decay, state.astype(jnp.float32))
    return wy_chunk_output(wy_chunk_outputs(qg, qk, vn, entering), q.shape[1]), final


def wy_chunk_inputs(q, k, v, g, beta, state, chunk: int):
    """The chunk-parallel half of `gdn_chunked_ref`: for each chunk n of C = `chunk` tokens (T zero-padded to
    N * C), with [B, Hv, N, C, ...] f32 outputs (key heads repeated to the value heads), its four products in
    f32 (Precision.HIGHEST; three TF32 products each were no faster: H100, 4,096 tokens, chunk 64: 1.24 vs
    1.22 ms a layer, `gpu_check.sh gdn_prefill`):

        qg = Q * exp(gamma)                      [.., C, Dk]   (reads the state entering the chunk)
        qk = (Q K^T) * Gam * [i >= j]            [.., C, C]
        u  = U,  w = W                           [.., C, Dv], [.., C, Dk]
        kd = K * exp(gamma_C - gamma)            [.., C, Dk]   (writes the state leaving it)
        decay = exp(gamma_C)                     [B, Hv, N]"""
    _check(q, k, v, g, beta, state)
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    n = -(-t // chunk)
    pad = n * chunk - t

    def prep(x):  # [B, T, H, ...] -> [B, H, N, C, ...] f32, zero-padded
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, n, chunk) + x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    value_heads = functools.partial(_expand_heads, hv=hv, axis=1)  # [B, Hk, ...] -> [B, Hv, ...]
    qc_heads, kc_heads = prep(q), prep(k)  # [B, Hk, N, C, Dk]
    qc, kc = value_heads(qc_heads), value_heads(kc_heads)  # [B, Hv, N, C, Dk]
    vc, gc, bc = prep(v), prep(g), prep(beta)  # [B,H,N,C,Dv], [B,H,N,C], [B,H,N,C]
    gamma = jnp.cumsum(gc, axis=-1)
    lower_incl = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    diff = gamma[..., :, None] - gamma[..., None, :]
    gam = jnp.exp(jnp.where(lower_incl, diff, -jnp.inf))  # [B,H,N,C,C], 0 above the diagonal
    # K K^T and Q K^T depend on the key head only: once per key head, then repeated to its value heads
    kk = value_heads(jnp.einsum("...id,...jd->...ij", kc_heads, kc_heads, precision=HIGHEST))
    lmat = jnp.where(strict, bc[..., :, None] * kk * gam, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    tm = jax.scipy.linalg.solve_triangular(eye + lmat, jnp.broadcast_to(eye, lmat.shape), lower=True,
                                           unit_diagonal=True)
    u = jnp.einsum("...ij,...jd->...id", tm, bc[..., None] * vc, precision=HIGHEST)
    w = jnp.einsum("...ij,...jd->...id", tm, (bc * jnp.exp(gamma))[..., None] * kc, precision=HIGHEST)
    qk = jnp.where(lower_incl, value_heads(jnp.einsum("...id,...jd->...ij", qc_heads, kc_heads,
                                                      precision=HIGHEST)) * gam, 0.0)
    last = gamma[..., -1:]  # [B, H, N, 1]
    qg = qc * jnp.exp(gamma)[..., None]
    kd = kc * jnp.exp(last - gamma)[..., None]
    return qg, qk, u, w, kd, jnp.exp(last[..., 0])


def wy_chunk_states_ref(u, w, kd, decay, state):
    """The sequential half of `gdn_chunked_ref` over the chunks of `wy_chunk_inputs` ([B, H, N, ...]), from
    state [B, H, Dk, Dv] f32: per chunk Vn = u - w S, S <- decay S + kd^T Vn. Returns (Vn [B, H, N, C, Dv],
    the state entering each chunk [B, H, N, Dk, Dv], the final state), f32."""
    def step(s, xs):
        u_c, w_c, kd_c, decay_c = xs  # s: [B, H, Dk, Dv]
        vn = u_c - jnp.einsum("bhcd,bhdv->bhcv", w_c, s, precision=HIGHEST)
        return decay_c[..., None, None] * s + jnp.einsum("bhcd,bhcv->bhdv", kd_c, vn, precision=HIGHEST), (vn, s)

    chunks = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, kd, decay))  # [N, B, H, ...]
    final, (vn, entering) = jax.lax.scan(step, state, chunks)
    return jnp.moveaxis(vn, 0, 2), jnp.moveaxis(entering, 0, 2), final


def wy_chunk_outputs(qg, qk, vn, entering):
    """O [B, H, N, C, Dv] = qg S_n + qk Vn for every chunk at once, from the state entering each chunk
    (entering [B, H, N, Dk, Dv]) and Vn of the chain."""
    return (jnp.einsum("bhncd,bhndv->bhncv", qg, entering, precision=HIGHEST)
            + jnp.einsum("bhnij,bhnjv->bhniv", qk, vn, precision=HIGHEST))


def wy_chunk_output(o: jax.Array, t: int) -> jax.Array:
    """O [B, H, N, C, Dv] of a chunk scan -> o [B, T, H, Dv] (the padding tokens dropped)."""
    b, h, n, c, dv = o.shape
    return jnp.moveaxis(o.reshape(b, h, n * c, dv), 1, 2)[:, :t]


def gdn_gates_ref(a, b, a_log, dt_bias):
    """Step 4: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias): a, b [B, T, Hv] (any float dtype),
    A_log, dt_bias [Hv] -> (g, beta) [B, T, Hv] f32."""
    f32 = lambda x: x.astype(jnp.float32)
    beta = jax.nn.sigmoid(f32(b))
    g = -jnp.exp(f32(a_log)) * jax.nn.softplus(f32(a) + f32(dt_bias))
    return g, beta
