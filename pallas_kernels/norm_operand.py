"""Zero-centred RMSNorm that also writes the FP8 decode kernel's x operand, in one launch.

    y[t] = bf16( x[t] / sqrt(mean(x[t]^2) + eps) * (1 + w) )            (qmtp.layers.rms_norm)

and, from those bf16 rows, what `fp8_matmul` would build from y before its decode kernel
(fp8_kernels._f16_pieces / _f16_scaled, the forms of DecodeConfig.x_f16 / x_f16_scaled):

    form "pieces": f16 rows [hi; lo] [2M, E] with y = 2^16 hi + lo
    form "scaled": f16 rows y * 2^-e_t [M, E] and the row scales 2^e_t [M, 1] f32

Why: at a layer boundary of a decode step XLA runs the norm's reduction, its normalization and the
pieces as three launches of ~1.5-2.6 us each, latency-bound on 5120 values per row (session 16's
trace of the 27B step: ~1.4 ms of such glue per 9.0 ms step); here one launch does all three, each
row spread over several programs (SLICE).
The pieces are the same bits as the XLA helpers give for the same y (the rounding to the 2^-8 grid
is done with the add-and-subtract of 2^23, exact round-half-even for |v| < 2^23; larger v are
integers already, and the Triton lowering has no round). `rms_norm_operand_ref` is the jnp twin.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._vma import align
from pallas_kernels.fp8_config import next_pow2
from pallas_kernels.fp8_kernels import _F16_SCALED_CLAMP, _F16_SCALED_TOP, _X_F16_GRID, X_F16_HI, _f16_pieces, _f16_scaled

FORMS = ("pieces", "scaled")
_ROUND_MAGIC = 2.0 ** 23  # f32 values of magnitude >= 2^23 are integers
_F32_MANTISSA = 2 ** 23  # one exponent step in an f32's bits
_F32_BIAS = 127


def _check(x: jax.Array, w: jax.Array, form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"rms_norm_operand: form={form!r}, expected one of {FORMS}")
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"rms_norm_operand: x must be [M, E] bfloat16, got {x.shape} {x.dtype}")
    if w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm_operand: w {w.shape} does not match x's last dim {x.shape[1]}")


def rms_norm_operand_ref(x: jax.Array, w: jax.Array, eps: float, form: str):
    """(y [M, E] bf16, rows f16 ([2M, E] pieces or [M, E] scaled), row_scale [M, 1] f32 or None)."""
    _check(x, w, form)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = (y * (1.0 + w.astype(jnp.float32))).astype(jnp.bfloat16)
    if form == "scaled":
        rows, row_scale = _f16_scaled(y)
        return y, rows, row_scale
    return y, _f16_pieces(y).reshape(2 * x.shape[0], x.shape[1]), None


# Lanes per program. A program first reads its whole row (x and w, from L2 after the first) for the
# row's statistics, then writes only its slice: one program per row did all 5120 lanes' arithmetic on
# one SM and made the 64-layer 27B step slower, not faster (8.99 against 8.87 ms, session 16).
SLICE = 512


def rms_norm_operand(x: jax.Array, w: jax.Array, eps: float, form: str, *, interpret: bool = False,
                     slice_lanes: int | None = None, num_warps: int = 4):
    """rms_norm_operand_ref as one Pallas launch: grid (M, cdiv(E, slice_lanes)) (default SLICE)."""
    _check(x, w, form)
    m, e = x.shape
    if m == 0:
        return rms_norm_operand_ref(x, w, eps, form)
    lanes = min(next_pow2(e), slice_lanes or SLICE)
    if lanes & (lanes - 1):
        raise ValueError(f"rms_norm_operand: slice_lanes={slice_lanes} must be a power of two")
    return _launch(x, w, eps=float(eps), form=form, lanes=lanes, interpret=interpret, num_warps=num_warps)


@functools.partial(jax.jit, static_argnames=("eps", "form", "lanes", "interpret", "num_warps"))
def _launch(x, w, *, eps, form, lanes, interpret, num_warps):
    m, e = x.shape
    rows = 2 * m if form == "pieces" else m
    (x, w), out = align(x, w)
    shapes = [out((m, e), jnp.bfloat16), out((rows, e), jnp.float16)]
    if form == "scaled":
        shapes.append(out((m, 1), jnp.float32))
    got = pl.pallas_call(
        functools.partial(_kernel, m=m, e=e, eps=eps, form=form, lanes=lanes),
        out_shape=tuple(shapes),
        grid=(m, -(-e // lanes)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rms_norm_operand",
    )(x, w)
    return (*got, None) if form == "pieces" else tuple(got)


def _round_half_even(v):
    """round(v) to an integer, ties to even, in f32 arithmetic (|v| < 2^23: v + 2^23 has unit ulp)."""
    c = jnp.where(v >= 0, _ROUND_MAGIC, -_ROUND_MAGIC)
    return jnp.where(jnp.abs(v) < _ROUND_MAGIC, (v + c) - c, v)


def _pow2(k):
    """2.0^k as f32 for int32 k in [-126, 127], built from its bits."""
    return jax.lax.bitcast_convert_type((k + _F32_BIAS) * _F32_MANTISSA, jnp.float32)


def _kernel(x_ref, w_ref, y_ref, rows_ref, *scale_ref, m, e, eps, form, lanes):
    # x_ref [M, E] bf16; w_ref [E]; y_ref [M, E] bf16; rows_ref [2M, E] (pieces) or [M, E] (scaled) f16;
    # scale_ref: ([M, 1] f32,) for the scaled form. Program (r, j): row r's lanes [j * lanes, (j + 1) * lanes).
    ep = next_pow2(e)  # the whole row as one power-of-two block, lanes past E masked
    r, j = pl.program_id(0), pl.program_id(1)
    l0 = pl.multiple_of(j * lanes, lanes)

    def load(ref, idx, n, start):  # [n] lanes from `start` of a row; past E read as 0
        ok = start + jnp.arange(n) < e if (n != e or e % lanes) else None
        idx = (*idx, pl.ds(start, n))
        return plgpu.load(ref.at[idx]) if ok is None else plgpu.load(ref.at[idx], mask=ok, other=0.0)

    def normed(n, start):  # bf16( x * rsqrt(mean(x^2) + eps) * (1 + w) ) on [n] lanes
        return (load(x_ref, (r,), n, start).astype(jnp.float32) * inv_rms
                * (1.0 + load(w_ref, (), n, start).astype(jnp.float32))).astype(jnp.bfloat16)

    def store(ref, row, v):
        ok = l0 + jnp.arange(lanes) < e if e % lanes else None
        plgpu.store(ref.at[row, pl.ds(l0, lanes)], v, mask=ok)

    x_row = load(x_ref, (r,), ep, 0).astype(jnp.float32)  # [EP]
    inv_rms = jax.lax.rsqrt(jnp.sum(x_row * x_row) / e + eps)
    y = normed(lanes, l0)  # [lanes] this program's slice
    store(y_ref, r, y)
    yf = y.astype(jnp.float32)
    if form == "pieces":  # fp8_kernels._f16_pieces
        hi_scaled = _round_half_even(yf * (1.0 / _X_F16_GRID)) * _X_F16_GRID
        store(rows_ref, r, (hi_scaled * (1.0 / X_F16_HI)).astype(jnp.float16))
        store(rows_ref, m + r, (yf - hi_scaled).astype(jnp.float16))
        return
    # fp8_kernels._f16_scaled over the whole row's normed values: e = clip(top - 15) with amax < 2^top
    # (frexp's exponent; 0 for 0)
    amax = jnp.max(jnp.abs(normed(ep, 0).astype(jnp.float32)))
    amax = jnp.where(amax < jnp.inf, amax, 1.0)  # inf / NaN rows: as frexp(1.0)
    biased = jax.lax.bitcast_convert_type(amax, jnp.int32) // _F32_MANTISSA  # amax >= 0: the exponent bits
    top = jnp.where(amax == 0.0, 0, biased - (_F32_BIAS - 1))
    ex = jnp.clip(top - _F16_SCALED_TOP, -_F16_SCALED_CLAMP, _F16_SCALED_CLAMP)
    store(rows_ref, r, (yf * _pow2(-ex)).astype(jnp.float16))

    @pl.when(j == 0)
    def _():
        plgpu.store(scale_ref[0].at[r, pl.ds(0, 1)], jnp.full((1,), _pow2(ex), jnp.float32))
