"""Gated delta rule (Gated DeltaNet recurrence), MODEL_SPEC §3.6 steps 5-7.

Per value head h (key head h // r, r = Hv / Hk), state S in R^{Dk x Dv} (f32), per token t:

    S   <- exp(g_t) * S
    u    = v_t - S^T k_t                 (delta: value minus the current prediction)
    S   <- S + k_t (beta_t * u)^T         (rank-1 update)
    o_t  = S^T q_t                        (read with the updated state)

Inputs (already conv'd, L2-normalised, q scaled by Dk^-0.5): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
g (log-decay <= 0), beta [B, T, Hv] f32; state [B, Hv, Dk, Dv] f32. A token with g = 0 and beta = 0
leaves the state unchanged (how callers mask padding). Outputs o [B, T, Hv, Dv] f32 and the final
state; `gdn_recurrence_ref(..., return_states=True)` also returns the state after every token
[B, T, Hv, Dk, Dv] (for committing any accepted length in speculative decoding).

`gdn_chunked_ref` computes the same with the chunked WY form (chunk C, sequential over chunks,
parallel inside), for prefill (no kernel yet: `PYTHONPATH=. python -m pallas_kernels.bench --parts=gdn`
measures what it costs).

Kernels (generic Pallas, Triton lowering; `interpret=True` runs them on the CPU):
- `gdn_recurrence(q, k, v, g, beta, state, *, interpret, config)`: twin of `gdn_recurrence_ref`
  (o and the final state; no per-token states). Grid (B, Hv, Dv / BV); program (b, h, j) holds the
  f32 tile S[b, h, :, j*BV:(j+1)*BV] [Dk, BV] in registers for all T tokens (the Dv columns of S
  evolve independently), reads q, k [T, Dk] of key head h // r, v [T, BV], g, beta [T], writes
  o [T, BV] and the tile once. The state output aliases the state input (`input_output_aliases`):
  in place when the caller donates it. Dk must be a power of two; BV = the largest power of two
  <= config.block_v dividing Dv.
- `gdn_recurrence_gated(q, k, v, a, b, A_log, dt_bias, state, n_valid, ...)`: the same with the
  gates of §3.6 step 4 computed in the kernel (beta = sigmoid(b), g = -exp(A_log) softplus(a +
  dt_bias)) and tokens t >= n_valid[b] selected away (padding cannot reach the state even if its
  inputs are NaN); twin `gdn_recurrence_gated_ref`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._vma import align

HIGHEST = jax.lax.Precision.HIGHEST


def _expand_heads(x: jax.Array, hv: int) -> jax.Array:
    """[B, T, Hk, D] -> [B, T, Hv, D]: each key head repeated r times consecutively (h // r)."""
    return jnp.repeat(x, hv // x.shape[2], axis=2)


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


def gdn_chunked_ref(q, k, v, g, beta, state, chunk: int = 64):
    """Chunked WY form. Per chunk (local i, j), gamma = cumsum(g), Gam_ij = exp(gamma_i - gamma_j):

        L   = strict_lower(beta_i k_i.k_j Gam_ij);  Tm = (I + L)^-1
        U   = Tm diag(beta) V;                      W = Tm diag(beta exp(gamma)) K
        Vn  = U - W S
        O   = (Q * exp(gamma)) S + ((Q K^T) * Gam * [i >= j]) Vn
        S  <- exp(gamma_C) S + (K * exp(gamma_C - gamma))^T Vn

    T is padded to a multiple of `chunk` with g = beta = 0 tokens, which leave S unchanged.
    """
    _check(q, k, v, g, beta, state)
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    n = -(-t // chunk)
    pad = n * chunk - t

    def prep(x):  # [B, T, H, ...] -> [N, B, H, C, ...] f32, zero-padded
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, n, chunk) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    qc, kc = prep(_expand_heads(q, hv)), prep(_expand_heads(k, hv))
    vc, gc, bc = prep(v), prep(g), prep(beta)  # [N,B,H,C,Dv], [N,B,H,C], [N,B,H,C]
    gamma = jnp.cumsum(gc, axis=-1)
    lower_incl = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    diff = gamma[..., :, None] - gamma[..., None, :]
    gam = jnp.exp(jnp.where(lower_incl, diff, -jnp.inf))  # [N,B,H,C,C], 0 above the diagonal
    kk = jnp.einsum("...id,...jd->...ij", kc, kc, precision=HIGHEST)
    lmat = jnp.where(strict, bc[..., :, None] * kk * gam, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    tm = jax.scipy.linalg.solve_triangular(eye + lmat, jnp.broadcast_to(eye, lmat.shape), lower=True,
                                           unit_diagonal=True)
    u = jnp.einsum("...ij,...jd->...id", tm, bc[..., None] * vc, precision=HIGHEST)
    w = jnp.einsum("...ij,...jd->...id", tm, (bc * jnp.exp(gamma))[..., None] * kc, precision=HIGHEST)
    qk = jnp.where(lower_incl, jnp.einsum("...id,...jd->...ij", qc, kc, precision=HIGHEST) * gam, 0.0)

    def step(s, xs):
        q_c, k_c, u_c, w_c, qk_c, gamma_c = xs  # s: [B, H, Dk, Dv]
        vn = u_c - jnp.einsum("bhcd,bhdv->bhcv", w_c, s, precision=HIGHEST)
        o = (jnp.einsum("bhcd,bhdv->bhcv", q_c * jnp.exp(gamma_c)[..., None], s, precision=HIGHEST)
             + jnp.einsum("bhij,bhjv->bhiv", qk_c, vn, precision=HIGHEST))
        last = gamma_c[..., -1:]  # [B, H, 1]
        s = (jnp.exp(last)[..., None] * s
             + jnp.einsum("bhcd,bhcv->bhdv", k_c * jnp.exp(last - gamma_c)[..., None], vn, precision=HIGHEST))
        return s, o

    final, o = jax.lax.scan(step, state.astype(jnp.float32), (qc, kc, u, w, qk, gamma))
    o = jnp.moveaxis(o, 2, 3).swapaxes(0, 1).reshape(b, n * chunk, hv, dv)[:, :t]  # [N,B,H,C,Dv] -> [B,T,H,Dv]
    return o, final


# ----------------------------------------------------------------------------------------------
# Pallas kernel: per-token recurrence for decode / verify (T = 1 .. K+1).
#
# The Dv columns of S evolve independently (u_j, the rank-1 update of column j and o_j only read
# column j), so the grid is (B, Hv, Dv / BV): each program keeps one [Dk, BV] f32 tile of the state
# in registers across all T tokens, reading it once and writing it once. Per token it reads
# q_t, k_t [Dk] (key head h // r), v_t [BV], g_t, beta_t (scalars) and writes o_t [BV].
# The state output aliases the state input (in place when the caller donates it).
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecurrenceConfig:
    """Tile config of `gdn_recurrence`. block_v: Dv columns per program (a power of two; shrunk to
    the largest power of two dividing Dv when needed); num_warps / num_stages: Triton launch params
    (there is no K loop to pipeline, so one stage). form (read by gdn_conv.gdn_conv_recurrence only):
    "sequential" runs each token's loads, conv, norms and state update in turn; "hoisted" (T <= 8)
    loads and convolves every token before the state chain, which then takes one reduction step per
    token."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1
    form: str = "sequential"


RECURRENCE_CONFIG = RecurrenceConfig()
# Tokens up to this count are unrolled in the kernel; longer inputs run a loop over tokens.
MAX_UNROLLED_TOKENS = 8


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _block_v(dv: int, config: RecurrenceConfig) -> int:
    """Largest power of two <= config.block_v that divides Dv."""
    bv = 1
    while bv * 2 <= config.block_v and dv % (bv * 2) == 0:
        bv *= 2
    return bv


def _delta_update(s, k_t, v_t, g_t, b_t):
    """One token's state update on a [Dk, BV] f32 tile: decay, delta, rank-1 update."""
    s = s * jnp.exp(g_t)  # g = 0: exact identity
    u = v_t - jnp.sum(s * k_t[:, None], axis=0)  # [BV]
    return s + k_t[:, None] * (b_t * u)[None, :]  # k = 0 or beta = 0: adds exact zeros


def _run_tokens(token, s_ref, s_out_ref, n_tokens: int) -> None:
    """Runs token(t, s) -> s over the tokens with the state tile in registers; unrolled when short."""
    s = s_ref[...].astype(jnp.float32)
    if n_tokens <= MAX_UNROLLED_TOKENS:
        for t in range(n_tokens):
            s = token(t, s)
    else:
        s = jax.lax.fori_loop(0, n_tokens, token, s)
    s_out_ref[...] = s.astype(s_out_ref.dtype)


def _block_specs(t: int, dk: int, bv: int, r: int):
    """Grid (B, Hv, Dv/BV) blocks: q/k of key head h // r, v/o tiles, per-token gates, state tile."""
    sq = pl.squeezed
    return (pl.BlockSpec((sq, t, sq, dk), lambda ib, ih, iv: (ib, 0, ih // r, 0)),
            pl.BlockSpec((sq, t, sq, bv), lambda ib, ih, iv: (ib, 0, ih, iv)),
            pl.BlockSpec((sq, t, sq), lambda ib, ih, iv: (ib, 0, ih)),
            pl.BlockSpec((sq, sq, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv)))


def _recurrence_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, n_tokens: int):
    # q_ref, k_ref [T, Dk]; v_ref, o_ref [T, BV]; g_ref, beta_ref [T]; s_ref, s_out_ref [Dk, BV]
    f32 = jnp.float32

    def token(t, s):
        s = _delta_update(s, k_ref[t, :].astype(f32), v_ref[t, :].astype(f32), g_ref[t].astype(f32),
                          beta_ref[t].astype(f32))
        o_ref[t, :] = jnp.sum(s * q_ref[t, :].astype(f32)[:, None], axis=0).astype(o_ref.dtype)  # q never reaches s
        return s

    _run_tokens(token, s_ref, s_out_ref, n_tokens)


def _check_kernel_inputs(q, k, v, g, beta, state, config: RecurrenceConfig) -> int:
    _check(q, k, v, g, beta, state)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"gdn_recurrence: {name} has dtype {x.dtype}; floating point needed")
    dk, dv = q.shape[3], v.shape[3]
    if not _is_pow2(dk):
        raise ValueError(f"gdn_recurrence: Dk = {dk} must be a power of two (the Triton lowering "
                         "holds [Dk] and [Dk, BV] tensors, whose sizes must be powers of two)")
    if not _is_pow2(config.block_v) or config.num_warps < 1 or config.num_stages < 1:
        raise ValueError(f"gdn_recurrence: bad config {config}: block_v must be a power of two, "
                         "num_warps and num_stages >= 1")
    return _block_v(dv, config)


def gdn_recurrence(q, k, v, g, beta, state, *, interpret: bool = False,
                   config: RecurrenceConfig | None = None):
    """Pallas twin of `gdn_recurrence_ref(q, k, v, g, beta, state)` -> (o [B,T,Hv,Dv] f32, final
    state [B,Hv,Dk,Dv] f32). q, k, v may be f32 or bf16 (computed in f32).

    Dk must be a power of two; Dv any size whose tile BV (config.block_v, halved until it divides
    Dv) is a power of two, so every Dv works, odd ones with narrow tiles. The state output aliases
    the (f32) state input: donate the state under jit to update it in place."""
    config = config or RECURRENCE_CONFIG
    bv = _check_kernel_inputs(q, k, v, g, beta, state, config)
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    state = state.astype(jnp.float32)
    if t == 0:
        return jnp.zeros((b, 0, hv, dv), jnp.float32), state
    kernel = functools.partial(_recurrence_kernel, n_tokens=t)
    qk_spec, tv_spec, gate_spec, s_spec = _block_specs(t, dk, bv, r)
    (q, k, v, g, beta, state), out = align(q, k, v, g, beta, state)
    o, final = pl.pallas_call(
        kernel,
        out_shape=(out((b, t, hv, dv), jnp.float32), out((b, hv, dk, dv), jnp.float32)),
        grid=(b, hv, dv // bv),
        in_specs=[qk_spec, qk_spec, tv_spec, gate_spec, gate_spec, s_spec],
        out_specs=[tv_spec, s_spec],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_recurrence",
    )(q, k, v, g, beta, state)
    return o, final


# ----------------------------------------------------------------------------------------------
# Optional: the same kernel with the gates fused (MODEL_SPEC §3.6 step 4) and the padding mask.
#
#   beta_t = sigmoid(b_t),  g_t = -exp(A_log) * softplus(a_t + dt_bias)    (per value head, f32)
#   tokens t >= n_valid[b] leave the state exactly unchanged (a select, so even NaN q/k/v/a/b of a
#   padding token cannot reach the state); their o_t = S^T q_t is computed but meaningless.
# ----------------------------------------------------------------------------------------------


def gdn_gates_ref(a, b, a_log, dt_bias):
    """a, b [B, T, Hv] (any float dtype); a_log, dt_bias [Hv] -> (g, beta) [B, T, Hv] f32."""
    f32 = lambda x: x.astype(jnp.float32)
    beta = jax.nn.sigmoid(f32(b))
    g = -jnp.exp(f32(a_log)) * jax.nn.softplus(f32(a) + f32(dt_bias))
    return g, beta


def gdn_recurrence_gated_ref(q, k, v, a, b, a_log, dt_bias, state, n_valid, return_states: bool = False):
    """Gates + padding mask + `gdn_recurrence_ref`, as qmtp.layers.gated_deltanet does them:
    g = beta = k = v = 0 on tokens t >= n_valid [B] (so a padding token's state is the last valid one's
    exactly; return_states: also every token's state, [B, T, Hv, Dk, Dv])."""
    _check_gated(q, k, v, a, b, a_log, dt_bias, state, n_valid)
    g, beta = gdn_gates_ref(a, b, a_log, dt_bias)
    valid = jnp.arange(q.shape[1])[None] < n_valid[:, None]  # [B, T]
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    k = jnp.where(valid[..., None, None], k.astype(jnp.float32), 0.0)
    v = jnp.where(valid[..., None, None], v.astype(jnp.float32), 0.0)
    return gdn_recurrence_ref(q, k, v, g, beta, state, return_states=return_states)


def check_gate_inputs(who: str, a, b, a_log, dt_bias, n_valid, bsz: int, t: int, hv: int) -> None:
    """The raw gate projections a, b [B, T, Hv], A_log, dt_bias [Hv] and n_valid [B] (integer) of the
    kernels that compute the gates themselves; errors start with `who`."""
    if a.shape != (bsz, t, hv) or b.shape != (bsz, t, hv):
        raise ValueError(f"{who}: a {a.shape}, b {b.shape} must be [B, T, Hv] = {(bsz, t, hv)}")
    if a_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"{who}: A_log {a_log.shape}, dt_bias {dt_bias.shape} must be [Hv] = {(hv,)}")
    if n_valid.shape != (bsz,) or not jnp.issubdtype(n_valid.dtype, jnp.integer):
        raise ValueError(f"{who}: n_valid {n_valid.shape} {n_valid.dtype} must be integer [B] = {(bsz,)}")


def _check_gated(q, k, v, a, b, a_log, dt_bias, state, n_valid) -> None:
    check_gate_inputs("gdn gated", a, b, a_log, dt_bias, n_valid, *v.shape[:3])
    _check(q, k, v, a, b, state)


def _gated_kernel(q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref, n_ref, s_ref, o_ref, s_out_ref,
                  *, n_tokens: int):
    # as _recurrence_kernel; a_ref, b_ref [T]; alog_ref, dtb_ref, n_ref scalars
    f32 = jnp.float32
    decay = -jnp.exp(alog_ref[()].astype(f32))
    dt_bias = dtb_ref[()].astype(f32)
    n_valid = n_ref[()]

    def token(t, s):
        x = a_ref[t].astype(f32) + dt_bias
        softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
        b_t = 1.0 / (1.0 + jnp.exp(-b_ref[t].astype(f32)))
        new = _delta_update(s, k_ref[t, :].astype(f32), v_ref[t, :].astype(f32), decay * softplus, b_t)
        s = jnp.where(t < n_valid, new, s)  # padding: the old state, bit for bit
        o_ref[t, :] = jnp.sum(s * q_ref[t, :].astype(f32)[:, None], axis=0).astype(o_ref.dtype)
        return s

    _run_tokens(token, s_ref, s_out_ref, n_tokens)


def gdn_recurrence_gated(q, k, v, a, b, a_log, dt_bias, state, n_valid, *, interpret: bool = False,
                         config: RecurrenceConfig | None = None):
    """Pallas twin of `gdn_recurrence_gated_ref`: the gates computed in the kernel from the raw
    projections a, b [B, T, Hv] and A_log, dt_bias [Hv]; tokens t >= n_valid [B] (int) are padding.
    Returns (o [B, T, Hv, Dv] f32, final state [B, Hv, Dk, Dv] f32), the state aliased in place."""
    config = config or RECURRENCE_CONFIG
    _check_gated(q, k, v, a, b, a_log, dt_bias, state, n_valid)
    bv = _check_kernel_inputs(q, k, v, a, b, state, config)
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    state = state.astype(jnp.float32)
    if t == 0:
        return jnp.zeros((bsz, 0, hv, dv), jnp.float32), state
    sq = pl.squeezed
    qk_spec, tv_spec, gate_spec, s_spec = _block_specs(t, dk, bv, r)
    head_spec = pl.BlockSpec((sq,), lambda ib, ih, iv: (ih,))
    batch_spec = pl.BlockSpec((sq,), lambda ib, ih, iv: (ib,))
    args, out = align(q, k, v, a, b, a_log, dt_bias, n_valid.astype(jnp.int32), state)
    return pl.pallas_call(
        functools.partial(_gated_kernel, n_tokens=t),
        out_shape=(out((bsz, t, hv, dv), jnp.float32), out((bsz, hv, dk, dv), jnp.float32)),
        grid=(bsz, hv, dv // bv),
        in_specs=[qk_spec, qk_spec, tv_spec, gate_spec, gate_spec, head_spec, head_spec, batch_spec, s_spec],
        out_specs=[tv_spec, s_spec],
        input_output_aliases={8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_recurrence_gated",
    )(*args)
