"""The FP8 weight layouts the kernels read: the checkpoint's [O, I], or tiled for the decode kernel.

tile_weight's layout [O / bo, I / 128, bo, 128] puts every [bo, 128] chunk the decode kernel reads
in one contiguous run of bo * 128 bytes, and a program's run of chunks along I one after another;
in the checkpoint's layout a chunk is bo runs of 128 bytes, I bytes apart. Measured on the H200
(session 17, `pallas_kernels.bench --parts=fp8_launches --fp8_launch_layouts=checkpoint,tiled`):
the 27B step's FP8 launches by kernel time 7.10 -> 6.91 ms at 1 row, 7.22 -> 7.06 at 4, 7.25 ->
7.18 at 16.
"""

from __future__ import annotations

import functools

import jax

BLOCK = 128  # the scale block's width: a chunk's columns
# Rows per tile (ops setting fp8_tile_rows: 64 or 128). 128-row tiles serve both program heights: a
# 64-row program (the decode kernel's block_o at 1-32 rows, the narrow launches' at 33-128, every
# launch's at 65-128) reads half a tile, still one contiguous run, and a 128-row program (the wide
# launches at 33-64 rows, fp8_config.VERIFY_WIDE_BLOCK_O) one whole tile, with no [2, 64, 128] join,
# which the H200 ran 2.2x slower than 64-row programs (Session 20 decisions (3)). Measured on the H200
# (session 21, `pallas_kernels.bench --parts=fp8_launches`, the 27B step's FP8 launches by kernel time
# on 64- against 128-row tiles): 6.86 / 7.00 / 7.10 ms against 6.83 / 6.99 / 7.10 at 1 / 4 / 16 rows
# (64-row programs: the same), 11.75 / 13.39 against 11.24 / 12.10 at 40 / 64 (the wide launches on
# 128-row programs), 22.07 / 94.54 against 22.10 / 94.21 at 128 / 512 (the GEMM at 512 reads whole
# tiles where it joined two). A weight whose O is no multiple of 128 takes MIN_TILE_ROWS-row tiles.
TILE_ROWS = 128
# A weight whose O is no multiple of TILE_ROWS takes tiles of this many rows where it can (the decode
# kernel's block_o at 1-32 rows): TP2 shards of 192 rows, small models' projections, kept on the
# layout they had before 128-row tiles.
MIN_TILE_ROWS = 64


def tile_rows_for(o: int, i: int) -> int | None:
    """The tile height qmtp.load and the benches give an [O, I] weight: TILE_ROWS where O is a multiple
    of it, else MIN_TILE_ROWS where O is a multiple of that; None (the checkpoint layout) where neither
    divides O or I is no multiple of BLOCK."""
    if i % BLOCK:
        return None
    return next((rows for rows in (TILE_ROWS, MIN_TILE_ROWS) if o % rows == 0), None)


def tile_weight(w: jax.Array, block_o: int | None = None, block_i: int = BLOCK) -> jax.Array:
    """[O, I] -> [O / block_o, I / block_i, block_o, block_i]: every [block_o, 128] chunk the decode
    kernel reads is one contiguous run of bytes, and a program's run of chunks along I is contiguous
    too (in the checkpoint's layout a chunk is block_o runs of 128 bytes, I bytes apart). O must be a
    multiple of block_o and I of block_i (every 27B shape is, for the kernels' 64 x 128); the read
    floor tiles its int32 words with other blocks. block_o None: TILE_ROWS at the call."""
    block_o = block_o or TILE_ROWS
    o, i = w.shape
    if o % block_o or i % block_i:
        raise ValueError(f"tile_weight: w {w.shape} needs O a multiple of {block_o} and I of {block_i}")
    return w.reshape(o // block_o, block_o, i // block_i, block_i).transpose(0, 2, 1, 3)


@functools.lru_cache(maxsize=None)
def _tiler(rows: int):
    # the tile height bound before the jit: a trace that read TILE_ROWS would be reused after a change
    return jax.jit(functools.partial(tile_weight, block_o=rows))


def tile_as_loaded(w: jax.Array) -> jax.Array:
    """[O, I] -> w in the tiles qmtp.load gives it (tile_rows_for), or w as it is where it keeps the
    checkpoint layout: the benches' way of timing the layout the engine runs."""
    rows = tile_rows_for(*w.shape)
    return w if rows is None else _tiler(rows)(w)


def untile_weight(w: jax.Array) -> jax.Array:
    """The inverse of tile_weight: [O / bo, I / 128, bo, 128] -> [O, I]; any other w comes back as it is."""
    if w.ndim != 4:
        return w
    n_o, n_c, bo, blk = w.shape
    return w.transpose(0, 2, 1, 3).reshape(n_o * bo, n_c * blk)


def weight_shape(w: jax.Array) -> tuple[int, ...]:
    """(O, I) of a weight in either layout (tile_weight's or the checkpoint's; any other shape as it is)."""
    if w.ndim == 4:
        return w.shape[0] * w.shape[2], w.shape[1] * w.shape[3]
    return tuple(w.shape)
