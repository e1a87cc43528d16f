"""The FP8 block matmul's Pallas kernel bodies (Triton lowering; `interpret=True` on the CPU), launched and
checked by fp8_matmul.py. Both walk I in chunks of BLOCK = 128 columns, factoring out the block scale:

    y[t, o] = sum_c scale[o // 128, c] * (sum_{i in chunk c} x[t, i] * float(w[o, i]))

Products are exact: E4M3 is exact in f16 and bf16, a 16-bit x times it is exact in f32, and x enters as
pieces summing to it exactly (bf16 x: `_f16_pieces` or `_f16_scaled`; f32 x: `_bf16_pieces`). Tiles are
powers of two (Triton); ragged O, I, M get masked loads (lanes 0) and stores only where a shape is ragged.

Decode (M <= DECODE_MAX_ROWS): grid (row blocks of all weights, split_k); a program streams BO rows of one
weight (BO divides 128: one scale row) in [BO, 128] chunks into an f32 [BM, BO] ([BO, BM] with swap_ab)
accumulator, BM = max(16, pow2(M)). XLA sums the partials [split_k, M, O] in a fixed order (no atomics),
combining f16 pieces or row scales before the one rounding. act_quant: E4M3 x (zero-padded to BM rows and
whole chunks) and W enter the dot unconverted (FP8 wgmma, _fp8_dot.py), scaled by W's and x's scales.
Prefill: grid (cdiv(M, BM), cdiv(O, BN), split_k), M-blocks fastest so programs sharing a W tile run together
(W read from HBM about once). W is [O, I] or tile_weight's [O / tr, I / 128, tr, 128]: a program reads a
slice of one tile (tr a multiple of BO or BN) or, in the GEMM, whole tiles joined (BN a multiple of tr).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8_config import BLOCK, DOT_MIN, DecodeConfig, PrefillConfig, cdiv, next_pow2


def _bf16_pieces(x: jax.Array) -> list[jax.Array]:
    """bf16 x -> [x]; f32 x -> [hi, mid, lo] bf16 with hi + mid + lo == x (each residual is exact)."""
    if x.dtype == jnp.bfloat16:
        return [x]
    x = x.astype(jnp.float32)
    pieces = []
    for _ in range(3):
        p = x.astype(jnp.bfloat16)
        pieces.append(p)
        x = x - p.astype(jnp.float32)
    return pieces


# x = X_F16_HI * hi + lo (f16 hi, lo; 2^16 hi: x rounded to the 2^-8 grid), exact for bf16 2^-17 <= |x| < 2^32.
# Rounded by explicit f32 arithmetic: XLA on the GPU may drop a narrowing convert read back, which made lo 0.
X_F16_HI = 2.0 ** 16
_X_F16_GRID = 2.0 ** -8  # X_F16_HI times f16's smallest subnormal


def _f16_pieces(x2: jax.Array) -> jax.Array:
    """[M, I] bf16 -> [2, M, I] float16 (hi, lo) with x = X_F16_HI * hi + lo (see X_F16_HI)."""
    xf = x2.astype(jnp.float32)
    hi_scaled = jnp.round(xf * (1.0 / _X_F16_GRID)) * _X_F16_GRID  # exact f32 ops: scalings by powers of 2
    hi = (hi_scaled * (1.0 / X_F16_HI)).astype(jnp.float16)  # representable: no rounding happens
    lo = (xf - hi_scaled).astype(jnp.float16)
    return jnp.stack([hi, lo])


# The scaled piece: row r times 2^-e_r (largest |x| in [2^14, 2^15)) converts to f16 exactly for every x within
# 2^32 of its row's largest; e_r is clamped to [-100, 100] (2^-e_r finite); inf / NaN propagate.
_F16_SCALED_TOP = 15  # the scaled row's largest |x| < 2^15 (f16's largest finite value is ~2^16)
_F16_SCALED_CLAMP = 100


def _f16_scaled(x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[M, I] bf16 -> ([M, I] float16 x * 2^-e, [M, 1] f32 2^e) with e per row (see _F16_SCALED_TOP)."""
    xf = x2.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1, keepdims=True)  # [M, 1]
    _, top = jnp.frexp(jnp.where(jnp.isfinite(amax), amax, 1.0))  # amax < 2^top (0 -> 0)
    e = jnp.clip(top - _F16_SCALED_TOP, -_F16_SCALED_CLAMP, _F16_SCALED_CLAMP)
    return (xf * jnp.ldexp(jnp.float32(1.0), -e)).astype(jnp.float16), jnp.ldexp(jnp.float32(1.0), e)


def _dot_sum(a_pieces, b, *, swap: bool) -> jax.Array:
    """sum_p a_p @ b^T ([R, 128] x [C, 128] -> [R, C] f32), or b @ a_p^T when swap."""
    out = None
    for a in reversed(a_pieces):  # smallest piece first
        d = plgpu.dot(b, a, trans_b=True) if swap else plgpu.dot(a, b, trans_b=True)
        out = d if out is None else out + d
    return out


def _mask2(rows, cols):
    """Outer AND of optional [R] and [C] validity vectors (None: all valid)."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return cols[None, :]
    if cols is None:
        return rows[:, None]
    return rows[:, None] & cols[None, :]


def _load_x(ref, mask):
    """Activation tile; lanes outside `mask` (None: all valid) read as 0."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)


def _load_w(ref, mask, dtype):
    """FP8 weight tile converted to `dtype` (exact); lanes outside `mask` are 0. The masked load
    has no `other` (the lowering cannot build an FP8 constant), so the select runs after the cast."""
    if mask is None:
        return plgpu.load(ref).astype(dtype)
    return jnp.where(mask, plgpu.load(ref, mask=mask).astype(dtype), 0.0)


def _load_w_fp8(ref, rows_ok, cols_ok):
    """FP8 weight tile for an FP8 dot, not converted. Rows past O may hold anything (never stored); columns
    past I must be 0 (0 * NaN is not): those tiles come as uint8 bits, loaded with fill 0 and bitcast back."""
    if cols_ok is None:
        return plgpu.load(ref) if rows_ok is None else plgpu.load(ref, mask=rows_ok[:, None])
    bits = plgpu.load(ref, mask=_mask2(rows_ok, cols_ok), other=0)
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)


def _decode_kernel(*refs, m, os, i, bm, cfg: DecodeConfig, chunks_per_split, x_f16: bool, x_fp8: bool):
    # refs: x [M, I] (x_fp8: [BM, I_pad], zero-padded, then its scales [GI, BM]); n weights [O_j, I] (x_fp8,
    # ragged I: uint8 bits); n scale grids [GO_j, GI]; n outputs [split_k, M, O_j]; row blocks run over the n.
    n = len(os)
    x_ref, refs = refs[0], refs[1:]
    sx_ref, refs = (refs[0], refs[1:]) if x_fp8 else (None, refs)
    w_refs, s_refs, o_refs = refs[:n], refs[n:2 * n], refs[2 * n:]
    po, pk = pl.program_id(0), pl.program_id(1)
    body = functools.partial(_decode_program, m=m, i=i, bm=bm, cfg=cfg, chunks_per_split=chunks_per_split,
                             x_f16=x_f16, sx_ref=sx_ref)
    if n == 1:
        body(x_ref, w_refs[0], s_refs[0], o_refs[0], po, pk, o=os[0])
        return
    start = 0
    for w_ref, s_ref, o_ref, o in zip(w_refs, s_refs, o_refs, os):
        blocks = cdiv(o, cfg.block_o)
        pl.when((po >= start) & (po < start + blocks))(
            functools.partial(body, x_ref, w_ref, s_ref, o_ref, po - start, pk, o=o))
        start += blocks


def _decode_program(x_ref, w_ref, s_ref, o_ref, po, pk, *, m, o, i, bm, cfg: DecodeConfig, chunks_per_split,
                    x_f16: bool, sx_ref=None):
    # x_ref [M, I]; w_ref [O, I] or tiled; s_ref [GO, GI]; o_ref [split_k, M, O]; po: row block; sx_ref [GI, BM]
    bo = cfg.block_o
    tiled = len(w_ref.shape) == 4
    tr = w_ref.shape[2] if tiled else bo  # tiled: tr a multiple of bo (fp8_matmul._fit_tiles)
    o0 = pl.multiple_of(po * bo, bo)
    srow = po // (BLOCK // bo)  # bo divides 128: the program's rows share one scale row
    n_chunks = cdiv(i, BLOCK)
    rows_ok = (o0 + jnp.arange(bo)) < o if o % bo else None
    groups = bm // DOT_MIN if cfg.row_groups and sx_ref is None else 1
    gm = bm // groups  # x rows per dot

    def group(g):  # (rows, validity or None) of x's row group g
        return pl.ds(g * gm, gm), (g * gm + jnp.arange(gm)) < m if (g + 1) * gm > m else None

    o_major = cfg.swap_ab  # dot accumulators [bo, gm] instead of [gm, bo]
    c0 = pk * chunks_per_split
    if cfg.scale_preload:  # this program's scales [run] in registers, lanes past the row's end 0
        lanes = jnp.arange(max(next_pow2(chunks_per_split), 2))
        s_run = plgpu.load(s_ref.at[srow, pl.ds(c0, lanes.shape[0])], mask=c0 + lanes < n_chunks, other=0.0)

    def load_w(c, k0, cols_ok, dtype):  # chunk c's [bo, 128] weight rows as dtype (None: E4M3, for an FP8 dot)
        if tiled:  # the program's rows of one tile (all of it where bo = tr); no mask: whole tiles
            tile = w_ref.at[po, c] if tr == bo else w_ref.at[o0 // tr, c, pl.ds(pl.multiple_of(o0 % tr, bo), bo)]
            return plgpu.load(tile) if dtype is None else _load_w(tile, None, dtype)
        tile = w_ref.at[pl.ds(o0, bo), pl.ds(k0, BLOCK)]
        return _load_w_fp8(tile, rows_ok, cols_ok) if dtype is None else _load_w(tile, _mask2(rows_ok, cols_ok), dtype)

    def chunk(c, accs):
        k0 = pl.multiple_of(c * BLOCK, BLOCK)
        cols_ok = (k0 + jnp.arange(BLOCK)) < i if i % BLOCK else None
        if cfg.scale_preload:  # exact: a sum of one selected value and zeros
            s = jnp.sum(jnp.where(lanes == c - c0, s_run, 0.0))
        else:
            s = s_ref[srow, c]
        if sx_ref is not None:  # E4M3 x E4M3 on the tensor cores; x is zero-padded (no x mask)
            xc = plgpu.load(x_ref.at[pl.ds(0, bm), pl.ds(k0, BLOCK)])
            wc = load_w(c, k0, cols_ok, None)
            sx = plgpu.load(sx_ref.at[c, pl.ds(0, bm)])  # [BM] this chunk's activation scales
            if o_major:
                return (accs[0] + plgpu.dot(wc, xc, trans_b=True) * (sx[None, :] * s),)
            return (accs[0] + plgpu.dot(xc, wc, trans_b=True) * (sx[:, None] * s),)
        wc = load_w(c, k0, cols_ok, jnp.float16 if x_f16 else jnp.bfloat16)
        out = []
        for g, acc in enumerate(accs):
            rows, m_ok = group(g)
            xc = _load_x(x_ref.at[rows, pl.ds(k0, BLOCK)], _mask2(m_ok, cols_ok))
            out.append(acc + _dot_sum([xc] if x_f16 else _bf16_pieces(xc), wc, swap=o_major) * s)
        return tuple(out)

    accs = tuple(jnp.zeros((bo, gm) if o_major else (gm, bo), jnp.float32) for _ in range(groups))
    accs = jax.lax.fori_loop(c0, jnp.minimum(c0 + chunks_per_split, n_chunks), chunk, accs)
    for g, acc in enumerate(accs):
        rows, m_ok = group(g)
        acc = acc.T if o_major else acc
        plgpu.store(o_ref.at[pk, rows, pl.ds(o0, bo)], acc.astype(o_ref.dtype), mask=_mask2(m_ok, rows_ok))


def _prefill_kernel(*refs, m, o, i, cfg: PrefillConfig, chunks_per_split):
    # x_ref [M, I] (x_f16_scaled: the f16 piece; rs_ref [M] its row scales); w_ref; s_ref; o_ref [split_k, M, O]
    x_ref, w_ref, s_ref = refs[:3]
    rs_ref, o_ref = refs[3:] if cfg.x_f16_scaled else (None, refs[3])
    w_dtype = jnp.float16 if cfg.x_f16_scaled else jnp.bfloat16
    bm, bn = cfg.block_m, cfg.block_n
    pm, pn, pk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = pl.multiple_of(pm * bm, bm)
    n0 = pl.multiple_of(pn * bn, bn)
    srow = pn // (BLOCK // bn)
    m_ok = (m0 + jnp.arange(bm)) < m if m % bm else None
    n_ok = (n0 + jnp.arange(bn)) < o if o % bn else None
    tiled = len(w_ref.shape) == 4

    def w_block(c, k0, wm):  # the program's [bn, 128] weight rows of chunk c
        if not tiled:
            return _load_w(w_ref.at[pl.ds(n0, bn), pl.ds(k0, BLOCK)], wm, w_dtype)
        tr = w_ref.shape[2]  # rows per tile: bn spans whole tiles, or lies inside one
        if bn >= tr:
            tiles = plgpu.load(w_ref.at[pl.ds(pn * (bn // tr), bn // tr), c])  # [bn / tr, tr, 128]
            return tiles.reshape(bn, BLOCK).astype(w_dtype)
        return _load_w(w_ref.at[n0 // tr, c, pl.ds(pl.multiple_of(n0 % tr, bn), bn)], None, w_dtype)

    def body(c, acc):
        k0 = pl.multiple_of(c * BLOCK, BLOCK)
        cols_ok = (k0 + jnp.arange(BLOCK)) < i if i % BLOCK else None
        xc = _load_x(x_ref.at[pl.ds(m0, bm), pl.ds(k0, BLOCK)], _mask2(m_ok, cols_ok))
        pieces = [xc] if cfg.x_f16_scaled else _bf16_pieces(xc)
        return acc + _dot_sum(pieces, w_block(c, k0, _mask2(n_ok, cols_ok)), swap=False) * s_ref[srow, c]

    c0 = pk * chunks_per_split
    c1 = jnp.minimum(c0 + chunks_per_split, cdiv(i, BLOCK))
    acc = jax.lax.fori_loop(c0, c1, body, jnp.zeros((bm, bn), jnp.float32))
    if rs_ref is not None:  # back to x's scale: exact, a power of two per row
        rows = rs_ref.at[pl.ds(m0, bm)]
        acc = acc * (plgpu.load(rows) if m_ok is None else plgpu.load(rows, mask=m_ok, other=1.0))[:, None]
    plgpu.store(o_ref.at[pk, pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=_mask2(m_ok, n_ok))
