"""The FP8 weight layouts the kernels read: the checkpoint's [O, I], or tiled for the decode kernel.

tile_weight's [O / tr, I / 128, tr, 128] makes each [tr, 128] chunk, and a program's chunks along I, one
contiguous run (in [O, I] a chunk is tr runs of 128 bytes): the 27B step's FP8 launches run 1-3% faster.
"""

from __future__ import annotations

import jax

BLOCK = 128  # the scale block's width: a chunk's columns
TILE_ROWS = 128  # 64-row programs read half a tile, 128-row ones a whole (joining two 64-row tiles: 2.2x slower)
# O no multiple of TILE_ROWS: tiles of the decode program's height (TP2 shards of 192 rows, small models).
MIN_TILE_ROWS = 64


def tile_rows_for(o: int, i: int) -> int | None:
    """[O, I]'s tile height: TILE_ROWS, else MIN_TILE_ROWS, dividing O; None ([O, I]) if neither or I % 128."""
    if i % BLOCK:
        return None
    return next((rows for rows in (TILE_ROWS, MIN_TILE_ROWS) if o % rows == 0), None)


def tile_weight(w: jax.Array, block_o: int = TILE_ROWS, block_i: int = BLOCK) -> jax.Array:
    """[O, I] -> [O / block_o, I / block_i, block_o, block_i] (block_i: the read floor tiles int32 words)."""
    o, i = w.shape
    if o % block_o or i % block_i:
        raise ValueError(f"tile_weight: w {w.shape} needs O a multiple of {block_o} and I of {block_i}")
    return w.reshape(o // block_o, block_o, i // block_i, block_i).transpose(0, 2, 1, 3)


_tile = jax.jit(tile_weight, static_argnames=("block_o", "block_i"))


def tile_as_loaded(w: jax.Array) -> jax.Array:
    """[O, I] -> w as the engine lays it out (tile_rows_for), for the benches."""
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
