"""The read-floor kernel of `pallas_kernels.bench --parts=fp8_launches` (pallas_kernels/bench/read_floor.py):
its partial row sums against the numpy twin, so a kernel that skipped bytes (a mask or split bug) fails."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.bench import read_floor as rf
from h200_lowering import attr_int, lower_for_h200, triton_calls


@pytest.mark.parametrize("rows,cols,cfg", [
    (128, 96, rf.ReadConfig()),  # whole tiles, three chunks over eight splits: empty splits dropped
    (130, 75, rf.ReadConfig(split=2)),  # ragged rows and columns
    (70, 300, rf.ReadConfig(block_rows=32, block_cols=64, split=4)),
    (128, 256, rf.ReadConfig(tiled=True)),  # tiled words: each [64, 32] tile one contiguous run
    (128, 256, rf.ReadConfig(block_cols=128, split=8, num_stages=3, tiled=True)),
])
def test_read_floor_sums_every_word(rows, cols, cfg):
    rng = np.random.default_rng(rows + cols)
    w = rng.integers(-2**31, 2**31, size=(rows, cols), dtype=np.int64).astype(np.int32)
    salt = 7
    words = rf.tile_words(jnp.asarray(w), cfg) if cfg.tiled else jnp.asarray(w)
    parts = np.asarray(rf.read_floor(words, jnp.asarray([salt], jnp.int32), cfg, interpret=True))
    split = parts.shape[0]
    assert parts.shape == (split, rows) and 1 <= split <= cfg.split
    total = parts.astype(np.int64).sum(axis=0) - (split - 1) * salt  # each partial carries the salt once
    np.testing.assert_array_equal(((total + 2**31) % 2**32 - 2**31).astype(np.int32), rf.read_floor_ref(w, salt))


def test_read_floor_ref_wraps_like_int32():
    w = np.array([[2**31 - 1, 1]], np.int32)
    assert rf.read_floor_ref(w, 0)[0] == -2**31


def test_words_for_covers_the_launch_bytes():
    shapes = [(272, 300), (130, 300)]
    rows, cols = rf.words_for(shapes)
    assert rows * cols * 4 >= sum(o * i for o, i in shapes) and (rows, cols) == (402, 75)


def test_floor_figures_on_cpu():
    configs = rf.CONFIGS[:2] + rf.TILED_CONFIGS[:1]
    got = rf.floor_figures([(64, 512)], 2, 1.0, reps=1, trials=1, interpret=True, configs=configs)
    assert set(got["configs"]) == {repr(c) for c in configs} and got["best"] in got["configs"]
    assert got["by"] == "s_per_call" and got["share_of_copy"] > 0  # no device time on the CPU
    # a tiled config that does not fit the words (128 columns of 4 bytes, not a multiple of 128) is left out
    got = rf.floor_figures([(64, 384)], 2, 1.0, reps=1, trials=1, interpret=True,
                           configs=rf.CONFIGS[:1] + (rf.ReadConfig(block_cols=128, tiled=True),))
    assert set(got["configs"]) == {repr(rf.CONFIGS[0])}


def test_tiled_words_are_checked():
    with pytest.raises(ValueError, match=r"tiled words \(2, 3, 64, 16\) do not match"):
        rf.read_floor(jnp.zeros((2, 3, 64, 16), jnp.int32), jnp.zeros((1,), jnp.int32), rf.ReadConfig(tiled=True),
                      interpret=True)


# o_proj's bytes as [5120, 1536] int32: the grid of each config, worked out by hand (1536 words in
# chunks of 32 / 128 / 64 = 48 / 12 / 24 chunks; 12 chunks in 8 runs -> 2 each -> 6 programs)
O_PROJ_GRIDS = [(80, 8), (80, 4), (80, 16), (80, 4), (80, 6), (40, 8)]


O_PROJ_TILED_GRIDS = [(80, 8), (80, 8), (80, 6)]


@pytest.mark.parametrize("cfg,grid", list(zip(rf.CONFIGS + rf.TILED_CONFIGS, O_PROJ_GRIDS + O_PROJ_TILED_GRIDS)))
def test_read_floor_lowers_for_h200(cfg, grid):
    """Every floor config compiles to one Triton kernel with the expected grid, at o_proj's bytes."""
    rows, cols = rf.words_for([(5120, 6144)])
    assert (rows, cols) == (5120, 1536)
    shape = (rows // cfg.block_rows, cols // cfg.block_cols, cfg.block_rows, cfg.block_cols) if cfg.tiled else (rows, cols)
    args = (jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    [(tcfg, ir_text)] = triton_calls(lower_for_h200(lambda w, s: rf.read_floor(w, s, cfg), args))
    assert tuple(attr_int(tcfg, f"grid_{a}") for a in "xy") == grid
    assert attr_int(tcfg, "num_warps") == cfg.num_warps and "scf.for" in ir_text
