"""Chunked Gated DeltaNet prefill (MODEL_SPEC §3.6 step 7, chunked form): the Pallas (Triton) twin of
`gdn.gdn_chunked_ref`, with its signature and semantics (the math: that function's docstring; per chunk of C
tokens, gamma = cumsum(g), L = strict_lower(beta_i k_i.k_j Gam_ij), Tm = (I + L)^-1, U = Tm diag(beta) V,
W = Tm diag(beta exp(gamma)) K, Vn = U - W S, O = (Q exp(gamma)) S + ((Q K^T) Gam [i >= j]) Vn,
S <- exp(gamma_C) S + (K exp(gamma_C - gamma))^T Vn). q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta
[B, T, Hv]; state [B, Hv, Dk, Dv] -> (o [B, T, Hv, Dv] f32, final state f32); value head h reads key head
h // (Hv / Hk). Tokens past T (the last chunk's tail) are masked loads of 0 (g = beta = 0: S unchanged).

Kernel grid (B, Hv, Dv / BV): program (b, h, j) keeps the f32 tile S[b, h, :, j BV:(j+1) BV] ([Dk, BV]) in
registers (the columns of S evolve independently) and walks the chunks in order (one scf.for); per chunk it
loads q, k [C, Dk] (key head h // r), v [C, BV], g, beta [C], and everything is a [C, *] tile: C = 64 rows
feed 2-D dots with M, N, K >= 16. All dots are IEEE f32 (Precision.HIGHEST): the prefill state must track
the per-token recurrence. The Dv / BV programs of a head each redo the S-independent part (L, Tm, W)
instead of reading it from a second kernel through HBM (FLA's split); the tile config is not tuned yet.

Tm, the inverse of the unit lower triangular I + L, by blocked forward substitution with 16 x 16 blocks
(as FLA's solve_tril; backward stable, no power series of L whose terms could grow and cancel):
  1. the nb = C / 16 diagonal blocks D_i = I + L_ii, all at once as a [nb, 16, 16] tile, by row-wise
     forward substitution, a 15-step loop: row m of D_i^-1 = e_m - sum_{j<m} L_ii[m, j] row j;
  2. with Dinv = blockdiag(D_i^-1) and M = Dinv L_off (L_off: the blocks below the diagonal, M^nb = 0),
     Tm = (I + M)^-1 Dinv, by nb - 1 steps X <- Dinv - M X from X = Dinv: after step s the first s + 1
     block rows of X are final, those of block forward substitution, X_ij = D_i^-1 (delta_ij - sum_k L_ik X_kj)
     (D_i^-1 L_ik formed first).
Register tiles are not sliceable in Triton, so the blocks are reshapes and masks of the [C, C] tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gdn
from pallas_kernels._vma import align
from pallas_kernels.fp8_config import is_pow2

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
SUB = 16  # rows of a diagonal block of the solve: the smallest tile a Triton dot takes


@dataclasses.dataclass(frozen=True)
class ChunkedConfig:
    """block_v: Dv columns of the state per program (a power of two >= 16, shrunk to Dv)."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1  # the chunk loop carries S: nothing to prefetch across iterations

    def __post_init__(self):
        if not is_pow2(self.block_v) or self.block_v < 16 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"ChunkedConfig: {self} needs block_v a power of two >= 16, num_warps and "
                             "num_stages >= 1")


CHUNKED_CONFIG = ChunkedConfig()


def _dot(a, b, **kw):
    return plgpu.dot(a, b, precision=HIGHEST, **kw)


def _unit_lower_inverse(lmat: jax.Array) -> jax.Array:
    """(I + lmat)^-1 for a strictly lower triangular [C, C] lmat, C a multiple of SUB (see the docstring)."""
    c = lmat.shape[0]
    nb = c // SUB
    iota = lambda shape, dim: jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    same4 = iota((nb, SUB, nb, SUB), 0) == iota((nb, SUB, nb, SUB), 2)
    diag = jnp.sum(jnp.where(same4, lmat.reshape(nb, SUB, nb, SUB), 0.0), axis=2)  # [nb, SUB, SUB]: L_ii
    row = iota((nb, SUB, SUB), 1)

    def substitute(m, x):  # x: rows < m final, rows >= m still identity rows
        l_m = jnp.sum(jnp.where(row == m, diag, 0.0), axis=1)  # [nb, SUB]: row m of each L_ii
        return jnp.where(row == m, x - jnp.sum(l_m[:, :, None] * x, axis=1)[:, None, :], x)

    eye = (iota((nb, SUB, SUB), 1) == iota((nb, SUB, SUB), 2)).astype(F32)
    inv = jax.lax.fori_loop(1, SUB, substitute, eye)  # row 0 of a unit lower triangular inverse is e_0
    dinv = jnp.where(same4, inv[:, :, None, :], 0.0).reshape(c, c)  # blockdiag(D_i^-1)
    if nb == 1:
        return dinv
    blk = jax.lax.iota(jnp.int32, c) // SUB
    m = _dot(dinv, jnp.where(blk[:, None] > blk[None, :], lmat, 0.0))
    x = dinv
    for _ in range(nb - 1):
        x = dinv - _dot(m, x)
    return x


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, t: int, chunk: int):
    # q_ref, k_ref [T, Dk]; v_ref, o_ref [T, BV]; g_ref, beta_ref [T]; s refs [Dk, BV]
    dk, bv = s_ref.shape
    rows = jax.lax.iota(jnp.int32, chunk)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]

    def body(n, s):
        start = n * chunk
        ok = start + rows < t  # the last chunk's tail past T: loads of 0 (g = beta = 0), no stores
        tile = lambda ref, w: plgpu.load(ref.at[pl.ds(start, chunk), :], mask=jnp.broadcast_to(
            ok[:, None], (chunk, w)), other=0.0).astype(F32)
        q, k, v = tile(q_ref, dk), tile(k_ref, dk), tile(v_ref, bv)
        g = plgpu.load(g_ref.at[pl.ds(start, chunk)], mask=ok, other=0.0).astype(F32)
        beta = plgpu.load(beta_ref.at[pl.ds(start, chunk)], mask=ok, other=0.0).astype(F32)
        gamma = jnp.cumsum(g)
        last = jnp.sum(jnp.where(rows == chunk - 1, gamma, 0.0))  # gamma_C (register tiles are not indexable)
        # Gam_ij = exp(gamma_i - gamma_j) on and below the diagonal; -inf above keeps exp from overflowing
        gam = jnp.exp(jnp.where(incl, gamma[:, None] - gamma[None, :], -jnp.inf))
        lmat = jnp.where(strict, beta[:, None] * _dot(k, k, trans_b=True) * gam, 0.0)
        tm = _unit_lower_inverse(lmat)
        u = _dot(tm, beta[:, None] * v)  # [C, BV]
        w = _dot(tm, (beta * jnp.exp(gamma))[:, None] * k)  # [C, Dk]
        vn = u - _dot(w, s)
        qk = jnp.where(incl, _dot(q, k, trans_b=True) * gam, 0.0)
        o = _dot(q * jnp.exp(gamma)[:, None], s) + _dot(qk, vn)
        plgpu.store(o_ref.at[pl.ds(start, chunk), :], o.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(ok[:, None], (chunk, bv)))
        return jnp.exp(last) * s + _dot(k * jnp.exp(last - gamma)[:, None], vn, trans_a=True)

    s = jax.lax.fori_loop(0, pl.cdiv(t, chunk), body, s_ref[...].astype(F32))
    s_out_ref[...] = s.astype(s_out_ref.dtype)


def _validate(q, k, v, g, beta, state, chunk, config) -> None:
    for name, a, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3),
                        ("state", state, 4)):
        if getattr(a, "ndim", None) != nd:
            raise ValueError(f"gdn_chunked: {name} must have {nd} dims, got shape {getattr(a, 'shape', a)}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"gdn_chunked: {name} has dtype {a.dtype}; floating point needed")
    gdn._check(q, k, v, g, beta, state)
    dk, dv = q.shape[3], v.shape[3]
    for name, d in (("Dk (q, k axis 3)", dk), ("Dv (v axis 3)", dv)):
        if d < 16 or not is_pow2(d):
            raise ValueError(f"gdn_chunked: {name} = {d} must be a power of two >= 16 (Triton tiles); "
                             f"q {q.shape}, v {v.shape}")
    if not isinstance(chunk, int) or chunk < SUB or not is_pow2(chunk):
        raise ValueError(f"gdn_chunked: chunk = {chunk!r} must be a power of two >= {SUB}")
    if not isinstance(config, ChunkedConfig):
        raise ValueError(f"gdn_chunked: config must be a ChunkedConfig, got {type(config).__name__}")


def gdn_chunked(q, k, v, g, beta, state, *, chunk: int = 64, interpret: bool = False,
                config: ChunkedConfig | None = None):
    """Pallas twin of `gdn.gdn_chunked_ref` (see the module docstring); Dk, Dv and chunk powers of two >= 16."""
    config = CHUNKED_CONFIG if config is None else config
    _validate(q, k, v, g, beta, state, chunk, config)
    return _gdn_chunked(q, k, v, g, beta, state, chunk=chunk, interpret=bool(interpret), config=config)


# jitted: the GDN layers of a prefill pass trace and lower the kernel once
@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "config"))
def _gdn_chunked(q, k, v, g, beta, state, *, chunk: int, interpret: bool, config: ChunkedConfig):
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    state = state.astype(F32)
    if t == 0:
        return jnp.zeros((b, 0, hv, dv), F32), state
    r = hv // hk
    bv = min(config.block_v, dv)
    sq = pl.squeezed
    qk_spec = pl.BlockSpec((sq, t, sq, dk), lambda ib, ih, iv: (ib, 0, ih // r, 0))
    tv_spec = pl.BlockSpec((sq, t, sq, bv), lambda ib, ih, iv: (ib, 0, ih, iv))
    gate_spec = pl.BlockSpec((sq, t, sq), lambda ib, ih, iv: (ib, 0, ih))
    s_spec = pl.BlockSpec((sq, sq, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv))
    args, out = align(q, k, v, g, beta, state)
    return pl.pallas_call(
        functools.partial(_kernel, t=t, chunk=chunk),
        out_shape=(out((b, t, hv, dv), F32), out(state.shape, F32)),
        grid=(b, hv, dv // bv),
        in_specs=[qk_spec, qk_spec, tv_spec, gate_spec, gate_spec, s_spec],
        out_specs=[tv_spec, s_spec],
        input_output_aliases={5: 1},  # in place where the caller's state is dead afterwards
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_chunked",
    )(*args)
