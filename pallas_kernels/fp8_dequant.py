"""An FP8 weight dequantized into a dense [O, I] array for XLA's dot (long prefills):

    W[o, i] = float(w[o, i]) * scale[o // 128, i // 128]        (f32 product, one rounding into `dtype`)

w is fp8_layout.tile_weight's [O / bo, I / 128, bo, 128] E4M3 tiles (or the checkpoint's [O, I] with O a
multiple of 64 and I of 128), scale the [ceil(O / 128), I / 128] f32 grid. `dequantize_ref` (fp8_matmul) is
the jnp twin; its XLA fusion reads the tiles across their layout and ran at ~1/3 of the copy bandwidth.
Here each program reads `chunks` of a row of tiles (each [bo, 128] chunk one contiguous run in the tiled
layout) and writes them side by side into W's rows: bitwise the twin's values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._vma import align
from pallas_kernels.fp8_layout import BLOCK, MIN_TILE_ROWS, TILE_ROWS, tile_rows_for, tile_weight, weight_shape

CHUNKS = 4  # [bo, 128] chunks per program: 4 x 128-row chunks = 64 KiB read, 128 KiB written (bf16)
NUM_WARPS = 4  # a copy-like kernel: one warpgroup per program


def tile_rows(w: jax.Array) -> int | None:
    """The tile height the kernel reads w in: tile_weight's, or for [O, I] fp8_layout.tile_rows_for's; None
    where w is neither such a tiled weight nor an [O, I] one that tiles."""
    if w.ndim == 4:
        return w.shape[2] if w.shape[3] == BLOCK and w.shape[2] in (TILE_ROWS, MIN_TILE_ROWS) else None
    return tile_rows_for(*w.shape) if w.ndim == 2 else None


def dequantize(w: jax.Array, scale: jax.Array, dtype=jnp.bfloat16, *, interpret: bool = False) -> jax.Array:
    """Pallas twin of fp8_matmul.dequantize_ref(untile_weight(w), scale, dtype): [O, I] in `dtype`."""
    if w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_dequant: w has dtype {w.dtype}; float8_e4m3fn needed")
    bo = tile_rows(w)
    if bo is None:
        raise ValueError(f"fp8_dequant: w {w.shape} is neither [O, I] with O a multiple of {MIN_TILE_ROWS} and I "
                         f"of {BLOCK} nor tile_weight's [O / bo, I / {BLOCK}, bo, {BLOCK}] with bo {BLOCK} or "
                         f"{MIN_TILE_ROWS}")
    # [O / bo, I / 128, bo, 128]; an [O, I] weight is tiled by a copy first (the engine's weights are tiled at load)
    tiles = tile_weight(w, bo) if w.ndim == 2 else w
    o, i = weight_shape(w)
    if tuple(scale.shape) != (-(-o // BLOCK), i // BLOCK):
        raise ValueError(f"fp8_dequant: scale {scale.shape} is not the {BLOCK}x{BLOCK} grid of W [{o}, {i}]")
    return _launch(tiles, scale.astype(jnp.float32), dtype=jnp.dtype(dtype), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def _launch(tiles, scale, *, dtype, interpret):
    n_o, n_c, bo, _ = tiles.shape  # tiles [O / bo, I / 128, bo, 128]
    chunks = next(c for c in (CHUNKS, 2, 1) if n_c % c == 0)
    (tiles, scale), out = align(tiles, scale)
    return pl.pallas_call(
        functools.partial(_kernel, chunks=chunks, bo=bo),
        out_shape=out((n_o * bo, n_c * BLOCK), dtype),
        grid=(n_o, n_c // chunks),
        in_specs=[pl.BlockSpec((None, chunks, bo, BLOCK), lambda r, c: (r, c, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((bo, chunks * BLOCK), lambda r, c: (r, c)),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="fp8_dequant",
    )(tiles, scale)


def _kernel(w_ref, scale_ref, o_ref, *, chunks, bo):
    # w_ref [chunks, bo, 128] E4M3; scale_ref [ceil(O / 128), I / 128] f32 (whole); o_ref [bo, chunks * 128]
    r, c = pl.program_id(0), pl.program_id(1)
    scale_row = r * bo // BLOCK
    for j in range(chunks):  # static: one [bo, 128] chunk at a time
        s = scale_ref[scale_row, c * chunks + j]
        o_ref[:, j * BLOCK:(j + 1) * BLOCK] = (w_ref[j].astype(jnp.float32) * s).astype(o_ref.dtype)
