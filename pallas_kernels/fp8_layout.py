"""The FP8 weight layouts the kernels read: the checkpoint's [O, I], or tiled for the decode kernel.

tile_weight's layout [O / tr, I / 128, tr, 128] puts every [tr, 128] chunk in one contiguous run of
tr * 128 bytes, and a program's run of chunks along I one after another; in the checkpoint's layout a
chunk is tr runs of 128 bytes, I bytes apart. The FP8 launches of the 27B step run 1-3% faster on it.
"""

from __future__ import annotations

import jax

BLOCK = 128  # the scale block's width: a chunk's columns
# Rows per tile: 128-row tiles serve both program heights, a 64-row program reads half a tile (still one
# contiguous run) and a 128-row program a whole one (joining two 64-row tiles per chunk ran 2.2x slower).
TILE_ROWS = 128
# A weight whose O is no multiple of TILE_ROWS takes tiles of this many rows where it can (the decode
# kernel's program height): TP2 shards of 192 rows, small models' projections.
MIN_TILE_ROWS = 64


def tile_rows_for(o: int, i: int) -> int | None:
    """The tile height an [O, I] weight is laid out in: TILE_ROWS where O is a multiple of it, else
    MIN_TILE_ROWS where O is a multiple of that; None (the checkpoint layout) where neither divides O
    or I is no multiple of BLOCK."""
    if i % BLOCK:
        return None
    return next((rows for rows in (TILE_ROWS, MIN_TILE_ROWS) if o % rows == 0), None)


def tile_weight(w: jax.Array, block_o: int = TILE_ROWS, block_i: int = BLOCK) -> jax.Array:
    """[O, I] -> [O / block_o, I / block_i, block_o, block_i]. O must be a multiple of block_o and I of
    block_i (the read floor tiles its int32 words with other blocks)."""
    o, i = w.shape
    if o % block_o or i % block_i:
        raise ValueError(f"tile_weight: w {w.shape} needs O a multiple of {block_o} and I of {block_i}")
    return w.reshape(o // block_o, block_o, i // block_i, block_i).transpose(0, 2, 1, 3)


_tile = jax.jit(tile_weight, static_argnames=("block_o", "block_i"))


def tile_as_loaded(w: jax.Array) -> jax.Array:
    """[O, I] -> w in the tiles tile_rows_for gives it, or w as it is where it keeps the checkpoint
    layout: the benches' way of timing the layout the engine runs."""
    rows = tile_rows_for(*w.shape)
    return w if rows is None else _tile(w, block_o=rows)


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
