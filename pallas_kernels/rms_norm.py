"""Row-invariant RMSNorm: one program per row, so a row's sum of squares has one order at every row count.

    y = x / sqrt(mean(x^2) + eps) * g        g = 1 + w (zero-centred norms) or w * silu(z) (GDN output norm)

x [..., D] (any float dtype), w [D], z like x; f32 arithmetic, output in `out_dtype` (x's dtype).
XLA's fused reduction picks how threads share a row from the number of rows: on the H200 row 0 of a
[R, 5120] mean of squares changes bits from R = 33 on, of a [R, 256] one at R = 128, so a token's norm
would depend on K and on the batch. `rms_norm_rows` gives each row its own program over a power-of-two
block (x, w, z zero-padded to it: zeros add nothing to the sum); `rms_norm_rows_ref` is the jnp twin.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32


def _scaled(y: jax.Array, w: jax.Array, z, plus_one: bool) -> jax.Array:
    """y * (1 + w | w) [* silu(z)], in that order."""
    y = y * (1.0 + w.astype(F32) if plus_one else w.astype(F32))
    return y if z is None else y * jax.nn.silu(z.astype(F32))


def rms_norm_rows_ref(x: jax.Array, w: jax.Array, eps: float, *, plus_one: bool, z=None, out_dtype=None):
    """x / sqrt(mean(x^2) + eps) * (1 + w | w) [* silu(z)] in f32, as XLA reduces it."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return _scaled(y, w, z, plus_one).astype(out_dtype or x.dtype)


def rms_norm_rows(x: jax.Array, w: jax.Array, eps: float, *, plus_one: bool, z=None, out_dtype=None,
                  interpret: bool = False) -> jax.Array:
    """Pallas twin of rms_norm_rows_ref with each row's sum in one fixed order (see the module doc)."""
    d = x.shape[-1]
    if w.shape != (d,) or (z is not None and z.shape != x.shape):
        raise ValueError(f"rms_norm_rows: x {x.shape}, w {w.shape}, z {None if z is None else z.shape}: "
                         "need w [D] and z shaped like x")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead, rows = x.shape[:-1], math.prod(x.shape[:-1])
    if rows == 0:
        return jnp.zeros(x.shape, out_dtype)
    block = 1 << max(d - 1, 0).bit_length()  # Triton blocks are powers of two

    def padded(a):  # [rows, block], zeros past D
        a = a.reshape(-1, d)
        return a if block == d else jnp.pad(a, ((0, 0), (0, block - d)))

    args = (padded(x), padded(w[None])[0]) + (() if z is None else (padded(z),))
    y = _launch(args, d=d, eps=float(eps), plus_one=plus_one, out_dtype=out_dtype, interpret=interpret)
    return y[:, :d].reshape(*lead, d)


@functools.partial(jax.jit, static_argnames=("d", "eps", "plus_one", "out_dtype", "interpret"))
def _launch(args, *, d, eps, plus_one, out_dtype, interpret):
    rows, block = args[0].shape
    return pl.pallas_call(
        functools.partial(_kernel, d=d, eps=eps, plus_one=plus_one, gated=len(args) == 3),
        out_shape=jax.ShapeDtypeStruct((rows, block), out_dtype),
        grid=(rows,),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rms_norm_rows",
    )(*args)


def _kernel(*refs, d, eps, plus_one, gated):
    # x_ref [rows, block]; w_ref [block]; z_ref [rows, block] (gated); o_ref [rows, block]
    x_ref, w_ref = refs[:2]
    z_ref, o_ref = (refs[2], refs[3]) if gated else (None, refs[2])
    r = pl.program_id(0)
    x = plgpu.load(x_ref.at[r]).astype(F32)  # [block]
    y = x * jax.lax.rsqrt(jnp.sum(x * x) / d + eps)
    z = plgpu.load(z_ref.at[r]) if gated else None
    plgpu.store(o_ref.at[r], _scaled(y, plgpu.load(w_ref.at[:]), z, plus_one).astype(o_ref.dtype))
