"""The FP8 weights of a model loaded for the Pallas kernels, in the kernels' tiled layout.

`tile_fp8_weights` gives each `Fp8Block` whose weight is [O, I] with O a multiple of tr = 128 (else of
tr = 64) and I of 128 on every device (its TP shard) the layout of pallas_kernels.fp8_layout,
[O / tr, I / 128, tr, 128]; scales, bf16 weights and other shapes stay. Every kernel and reference
takes either layout (a tile is one contiguous run for the decode kernel), so only speed changes.
Under TP a split along O or I stays on the same dim of the tiled weight, so each device tiles its
own shard in place; the old weight is donated, so memory grows by one weight at a time.
"""

from __future__ import annotations

import functools

import jax

from qmtp.model import shard_layout
from qmtp.model.fp8 import Fp8Block
from qmtp.runtime import ops, tp


def tile_rows(block: Fp8Block, dim: int | None = None, n: int = 1) -> int | None:
    """The rows of the tiles `block` (split n ways along dim under TP) takes on every device
    (ops.tile_rows_for of its shard), or None: it keeps the checkpoint layout."""
    if block.weight.ndim != 2:  # tiled already (or stacked)
        return None
    local = list(block.weight.shape)
    if dim is not None:
        if local[dim] % n:  # does not split
            return None
        local[dim] //= n
    return ops.tile_rows_for(*local)


def tile_fp8_weights(params: dict, mesh=None, donate: bool = True) -> dict:
    """The tree with every tileable Fp8Block's weight tiled (module doc); mesh: the TP mesh, if any;
    donate: free each old weight as its tiled copy is made (False keeps `params` usable)."""
    n = 1 if mesh is None else mesh.size

    @functools.cache
    def tiler(dim, rows):
        fn = functools.partial(ops.tile_weight, rows=rows)
        if mesh is None:
            return jax.jit(fn, donate_argnums=(0,) if donate else ())
        return tp.map_split_shards(fn, mesh, dim, 2, 4, donate=donate)  # each device tiles its own shard

    def tile(path, leaf):
        if not isinstance(leaf, Fp8Block):
            return leaf
        dim = shard_layout.split_dim(tp.leaf_key(path)) if mesh is not None else None
        rows = tile_rows(leaf, dim, n)
        return leaf if rows is None else Fp8Block(tiler(dim, rows)(leaf.weight), leaf.scale)

    return jax.tree_util.tree_map_with_path(tile, params, is_leaf=lambda x: isinstance(x, Fp8Block))
