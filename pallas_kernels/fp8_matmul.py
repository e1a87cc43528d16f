"""FP8 E4M3 block-scaled matmul: y[t, o] = sum_i x[t, i] * w[o, i] * scale[o // 128, i // 128].

Layout: w [O, I] float8_e4m3fn as the checkpoint stores it, scale [ceil(O/128), ceil(I/128)] f32
(ragged last blocks use their block's scale), x [..., I] bf16 or f32, f32 accumulation, output in
`out_dtype`. This file holds the pure-jnp reference; the Pallas kernels join it (issue 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128


def _check(x: jax.Array, w: jax.Array, scale: jax.Array) -> None:
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_matmul: x {x.shape} and w {w.shape} need x[..., I] and w[O, I]")
    grid = (-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK))
    if tuple(scale.shape) != grid:
        raise ValueError(f"fp8_matmul: scale {scale.shape} is not the {BLOCK}x{BLOCK} grid {grid} of w {w.shape}")


def dequantize_ref(w: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """[O, I] E4M3 + scale grid -> [O, I] in `dtype` (materializes the whole weight)."""
    o, i = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=-2), BLOCK, axis=-1)[..., :o, :i]
    return (w.astype(jnp.float32) * s).astype(dtype)


def fp8_matmul_ref(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """Reference: dequantize to f32, then x @ W.T with f32 accumulation."""
    _check(x, w, scale)
    out_dtype = out_dtype or x.dtype
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dequantize_ref(w, scale),
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)
