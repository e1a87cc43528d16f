"""The read floor of a launch: how fast one kernel launch can stream a given number of bytes at all.

The FP8 target judges each launch against the copy bandwidth, measured on 4 GiB. A launch of 31 MB
(o_proj / out_proj of the 27B step) is short enough that its start (programs reaching the SMs,
the first loads' latency) and its end (the last programs draining) weigh on its time. This kernel
separates that from the FP8 kernel's own costs: it reads the same number of bytes in one launch
with the same kind of grid (row blocks x K splits, a chunk loop) and does nothing with them but an
int32 sum, so its device time is the floor any single-launch kernel over those bytes faces.

    partial[s, r] = sum_{c in split s} w[r, c]   (int32, wrapping; w is the bytes viewed as int32)

The sum is returned so the loads cannot be dropped; `read_floor_ref` is its numpy twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8_config import cdiv, chunk_runs
from pallas_kernels.fp8_layout import tile_weight


@dataclasses.dataclass(frozen=True)
class ReadConfig:
    """block_rows x block_cols int32 tiles (powers of two), split programs along the columns."""

    block_rows: int = 64
    block_cols: int = 32  # 128 bytes per row: one FP8 chunk of the matmul kernel
    split: int = 8
    num_warps: int = 4
    num_stages: int = 4
    tiled: bool = False  # the words as [R / block_rows, C / block_cols, block_rows, block_cols]: a tile is contiguous


# the floor is the fastest of these: the FP8 kernel's grid (64 rows, 128 B per row and chunk) and
# larger chunks with fewer / more splits
CONFIGS = (ReadConfig(), ReadConfig(split=4), ReadConfig(split=16), ReadConfig(block_cols=128, split=4),
           ReadConfig(block_cols=128, split=8, num_stages=3), ReadConfig(block_rows=128, block_cols=64, split=8,
                                                                          num_warps=8))
# the same grids over tiled bytes (fp8_matmul.tile_weight's layout: each chunk one contiguous run)
TILED_CONFIGS = (ReadConfig(tiled=True), ReadConfig(num_stages=3, tiled=True),
                 ReadConfig(block_cols=128, split=8, num_stages=3, tiled=True))


def _read_kernel(salt_ref, w_ref, o_ref, *, rows: int, cols: int, cfg: ReadConfig, chunks_per_split: int):
    # salt_ref [1] int32 (ties the call to its loop iteration); w_ref [R, C] int32, or with cfg.tiled
    # [R / br, C / bc, br, bc]; o_ref [split, R] int32
    pr, ps = pl.program_id(0), pl.program_id(1)
    br, bc = cfg.block_rows, cfg.block_cols
    r0 = pl.multiple_of(pr * br, br)
    rows_ok = (r0 + jnp.arange(br)) < rows if rows % br else None
    n_chunks = cdiv(cols, bc)
    c0 = ps * chunks_per_split

    def chunk(c, acc):
        k0 = pl.multiple_of(c * bc, bc)
        cols_ok = (k0 + jnp.arange(bc)) < cols if cols % bc else None
        ref = w_ref.at[pr, c] if cfg.tiled else w_ref.at[pl.ds(r0, br), pl.ds(k0, bc)]
        if rows_ok is None and cols_ok is None:
            return acc + plgpu.load(ref)
        mask = (rows_ok[:, None] if rows_ok is not None else True) & (cols_ok[None, :] if cols_ok is not None else True)
        return acc + plgpu.load(ref, mask=mask, other=0)

    acc = jax.lax.fori_loop(c0, jnp.minimum(c0 + chunks_per_split, n_chunks), chunk,
                            jnp.zeros((br, bc), jnp.int32))
    out = jnp.sum(acc, axis=1) + salt_ref[0]
    plgpu.store(o_ref.at[ps, pl.ds(r0, br)], out, mask=rows_ok)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def read_floor(w: jax.Array, salt: jax.Array, cfg: ReadConfig = ReadConfig(), interpret: bool = False) -> jax.Array:
    """w [R, C] int32 (cfg.tiled: tile_words' [R / br, C / bc, br, bc]), salt [1] int32 -> partial row
    sums [split, R] int32 (plus salt), one launch."""
    if cfg.tiled:
        if w.shape[2:] != (cfg.block_rows, cfg.block_cols):
            raise ValueError(f"read_floor: tiled words {w.shape} do not match {cfg}")
        rows, cols = w.shape[0] * w.shape[2], w.shape[1] * w.shape[3]
    else:
        rows, cols = w.shape
    cps, split = chunk_runs(cdiv(cols, cfg.block_cols), cfg.split)  # as the FP8 kernel splits its chunks
    kernel = functools.partial(_read_kernel, rows=rows, cols=cols, cfg=cfg, chunks_per_split=cps)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, rows), jnp.int32),
        grid=(cdiv(rows, cfg.block_rows), split),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="read_floor",
    )(salt, w)


def read_floor_ref(w: np.ndarray, salt: int) -> np.ndarray:
    """[R] int32: the row sums of w (wrapping like int32) plus salt, what read_floor's partials sum to
    (each partial carries the salt once: subtract (split - 1) * salt from their sum)."""
    total = np.sum(w.astype(np.int64), axis=1) + salt
    return ((total + 2**31) % 2**32 - 2**31).astype(np.int32)


def tile_words(w: jax.Array, cfg: ReadConfig) -> jax.Array:
    """[R, C] -> [R / block_rows, C / block_cols, block_rows, block_cols] (the layout cfg.tiled reads):
    fp8_layout.tile_weight's layout with the config's tile."""
    return tile_weight(w, cfg.block_rows, cfg.block_cols)


def fits(cfg: ReadConfig, rows: int, cols: int) -> bool:
    """Whether cfg can read an [R, C] array: any, untiled; whole tiles only, tiled."""
    return not cfg.tiled or (rows % cfg.block_rows == 0 and cols % cfg.block_cols == 0)


def words_for(shapes) -> tuple[int, int]:
    """The [R, C] int32 array with (at least) the bytes of a launch's [O_j, I] FP8 weights (they share I)."""
    return sum(o for o, _ in shapes), cdiv(shapes[0][1], 4)


def floor_figures(shapes, n: int, copy_tb_s: float, *, reps: int, trials: int, interpret: bool = False,
                  configs=CONFIGS, seed: int = 0) -> dict:
    """The read floor of a launch over `shapes`: each config timed in one jitted loop over n distinct
    arrays (as the launch is, past the L2 cache), by wall clock and, on the GPU, by device time;
    {"configs": {repr: figures}, "best": repr, and the best's s_per_call / kernel_s_per_call /
    share_of_copy / kernel_share_of_copy}. Shares count the launch's weight bytes."""
    from pallas_kernels.bench import trace_events
    from pallas_kernels.bench.common import timed

    rows, cols = words_for(shapes)
    nbytes = sum(o * i for o, i in shapes)
    keys = jax.random.split(jax.random.key(seed), n)
    arrs = tuple(jax.lax.bitcast_convert_type(jax.random.bits(k, (rows, cols), jnp.uint32), jnp.int32) for k in keys)
    out: dict = {"configs": {}}
    laid_out = {None: arrs}  # the arrays per tile shape (None: untiled), each laid out once
    for cfg in configs:
        if not fits(cfg, rows, cols):
            continue
        tile = (cfg.block_rows, cfg.block_cols) if cfg.tiled else None
        if tile not in laid_out:
            laid_out[tile] = tuple(jax.block_until_ready(jax.jit(tile_words, static_argnums=1)(a, cfg))
                                   for a in laid_out[None])
        arrs = laid_out[tile]

        @jax.jit
        def prog(arrs, cfg=cfg):
            def body(_, salt):  # each call depends on the last (no hoisting, no reordering)
                for a in arrs:
                    salt = salt + read_floor(a, salt, cfg, interpret)[0, :1]
                return salt

            return jax.lax.fori_loop(0, reps, body, jnp.zeros((1,), jnp.int32))

        med, _ = timed(prog, arrs, trials=trials)
        per = med / (reps * n)
        fig = {"s_per_call": per, "share_of_copy": nbytes / per / 1e12 / copy_tb_s}
        got = trace_events.device_time(prog, arrs, prefix="read_floor")
        if got and got["kernel_launches"]:
            k = got["kernel_s"] / (reps * n)
            fig.update(kernel_s_per_call=k, kernel_share_of_copy=nbytes / k / 1e12 / copy_tb_s)
        out["configs"][repr(cfg)] = fig
    key = "kernel_s_per_call" if all("kernel_s_per_call" in f for f in out["configs"].values()) else "s_per_call"
    best = min(out["configs"], key=lambda c: out["configs"][c][key])
    out.update(out["configs"][best], best=best, by=key)
    return out
