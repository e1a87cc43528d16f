"""Grouped expert matmul of the sparse MoE block (qmtp/model/moe.py): rows in blocks of BR rows (BR = rows /
blocks: BLOCK_ROWS at decode and verify, more for prefills), each block multiplied by one expert's weight,
the experts' weights stacked:

    y[r, o] = sum_i x[r, i] W[e_b, o, i]     for the rows r of block b, e_b = block_expert[b]
                                            (e_b = -1: an unused block, y = 0, no weight read)

W: [X, O, I] E4M3 with the scale grid [X, ceil(O/128), ceil(I/128)] (W = q * scale per 128 x 128 block),
or [X, O, I] in bf16 / f32 (no scales). A launch reads each block's expert once per block_o outputs: at
decode the k experts a token chose, not the X of the layer.

One program per (row block, block_o outputs) sums the 128-column chunks of I in order, each chunk's dot
(bf16 pieces of x against bf16 pieces of the weight, f32 accumulation; E4M3 and bf16 are one exact
piece, f32 three) times its scale in f32: a row's result depends on its own x, its expert and that order
only, so it is the same whatever other rows share the launch (row-invariant, as
KernelConfig.deterministic needs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8_config import BLOCK, cdiv
from pallas_kernels.fp8_kernels import _bf16_pieces, _dot_sum, _load_w, _load_x, _mask2
from pallas_kernels.fp8_matmul import _split_sum, dequantize_ref

BLOCK_ROWS = 16  # rows per block at decode and verify: the tensor cores' smallest dot


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    """block_o outputs per program (a power of two dividing 128: the program's outputs share one scale
    row); split_k: the 128-column chunks of I in that many consecutive runs, one program each, their f32
    partial sums added in run order afterwards (the same order at every row count); the Triton warps and
    pipeline stages of a program."""

    block_o: int = 32
    split_k: int = 2
    num_warps: int = 4
    num_stages: int = 2


# The fastest of the 27 candidate tiles over the 35B-A3B decode and verify cases (`python -m pallas_kernels.bench
# --parts=moe --moe_sweep`, H100): 74.2 us for the four against 93.9 for block_o=64, split_k=1, 3 stages.
EXPERT_MATMUL_CONFIG = ExpertMatmulConfig()


def _check(x, block_expert, w, scale):
    rows, i = x.shape
    if w.ndim != 3 or w.shape[2] != i:
        raise ValueError(f"expert_matmul: x {x.shape} needs stacked weights [X, O, {i}], got {w.shape}")
    if block_expert.ndim != 1 or block_expert.shape[0] == 0 or rows % block_expert.shape[0]:
        raise ValueError(f"expert_matmul: x has {rows} rows, not a whole number of rows for each of the "
                         f"{block_expert.shape} blocks")
    block_rows = rows // block_expert.shape[0]
    if block_rows < BLOCK_ROWS or block_rows & (block_rows - 1):
        raise ValueError(f"expert_matmul: {block_rows} rows per block, needs a power of two >= {BLOCK_ROWS}")
    fp8 = w.dtype == jnp.float8_e4m3fn
    if fp8 != (scale is not None):
        raise ValueError("expert_matmul: E4M3 weights come with a scale grid, other weights without")
    if fp8 and scale.shape != (w.shape[0], cdiv(w.shape[1], BLOCK), cdiv(i, BLOCK)):
        raise ValueError(f"expert_matmul: scale grid {scale.shape} for weights {w.shape}")


def expert_matmul_ref(x: jax.Array, block_expert: jax.Array, w: jax.Array, scale: jax.Array | None,
                      out_dtype=None) -> jax.Array:
    """The reference: each block's expert gathered and dequantized to f32, one einsum, f32 accumulation.
    x [NB * BR, I], block_expert int32 [NB] -> y [NB * BR, O] in out_dtype (x's)."""
    _check(x, block_expert, w, scale)
    nb, (_, o, i) = block_expert.shape[0], w.shape
    e = jnp.maximum(block_expert, 0)
    wb = dequantize_ref(w[e], scale[e]) if scale is not None else w[e].astype(jnp.float32)  # [NB, O, I]
    y = jnp.einsum("bri,boi->bro", x.reshape(nb, -1, i).astype(jnp.float32), wb,
                   precision=jax.lax.Precision.HIGHEST)
    y = jnp.where(block_expert[:, None, None] >= 0, y, 0.0)
    return y.reshape(x.shape[0], o).astype(out_dtype or x.dtype)


def expert_matmul(x: jax.Array, block_expert: jax.Array, w: jax.Array, scale: jax.Array | None,
                  out_dtype=None, interpret: bool = False, config: ExpertMatmulConfig | None = None) -> jax.Array:
    """The Pallas kernel (module doc); arguments and result as expert_matmul_ref."""
    _check(x, block_expert, w, scale)
    config = config or EXPERT_MATMUL_CONFIG
    if (config.block_o < 1 or BLOCK % config.block_o or config.split_k < 1 or config.num_warps < 1
            or config.num_stages < 1):
        raise ValueError(f"expert_matmul: bad config {config}: block_o must be a power of two dividing {BLOCK}, "
                         "the other fields >= 1")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if scale is None:  # every block scale 1: one kernel for E4M3 and wider weights
        scale = jnp.ones((w.shape[0], cdiv(w.shape[1], BLOCK), cdiv(x.shape[1], BLOCK)), jnp.float32)
    return _launch(x, block_expert.astype(jnp.int32), w, scale.astype(jnp.float32), out_dtype=out_dtype,
                   interpret=interpret, config=config)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def _launch(x, block_expert, w, scale, *, out_dtype, interpret, config):
    rows, i = x.shape
    o = w.shape[1]
    chunks = cdiv(i, BLOCK)
    per_split = cdiv(chunks, config.split_k)
    split = cdiv(chunks, per_split)  # no empty run
    y = pl.pallas_call(
        functools.partial(_kernel, o=o, i=i, block_rows=rows // block_expert.shape[0], block_o=config.block_o,
                          per_split=per_split, split=split),
        out_shape=jax.ShapeDtypeStruct((split, rows, o), jnp.float32 if split > 1 else out_dtype),
        grid=(block_expert.shape[0], cdiv(o, config.block_o), split),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="moe_expert_matmul",
    )(block_expert, x, w, scale)
    return _split_sum(y).astype(out_dtype)  # the runs' partials in run order


def _kernel(e_ref, x_ref, w_ref, s_ref, o_ref, *, o, i, block_rows, block_o, per_split, split):
    # e_ref [NB]; x_ref [NB * BR, I]; w_ref [X, O, I]; s_ref [X, GO, GI]; o_ref [split, NB * BR, O]
    pb, po, ps = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = e_ref[pb]
    r0 = pl.multiple_of(pb * block_rows, block_rows)
    o0 = pl.multiple_of(po * block_o, block_o)
    srow = po // (BLOCK // block_o)  # block_o divides 128: the program's outputs share one scale row
    rows_ok = (o0 + jnp.arange(block_o)) < o if o % block_o else None
    out = o_ref.at[ps, pl.ds(r0, block_rows), pl.ds(o0, block_o)]
    e = jnp.maximum(expert, 0)
    wide = w_ref.dtype == jnp.float32  # f32 weights: three bf16 pieces, like f32 x

    def chunk(c, acc):
        k0 = pl.multiple_of(c * BLOCK, BLOCK)
        cols_ok = (k0 + jnp.arange(BLOCK)) < i if i % BLOCK else None
        xc = _load_x(x_ref.at[pl.ds(r0, block_rows), pl.ds(k0, BLOCK)], _mask2(None, cols_ok))
        wc = _load_w(w_ref.at[e, pl.ds(o0, block_o), pl.ds(k0, BLOCK)], _mask2(rows_ok, cols_ok),
                     jnp.float32 if wide else jnp.bfloat16)
        x_pieces = _bf16_pieces(xc)
        dots = [_dot_sum(x_pieces, w_piece, swap=False) for w_piece in (_bf16_pieces(wc) if wide else [wc])]
        return acc + functools.reduce(jnp.add, dots[::-1]) * s_ref[e, srow, c]

    @pl.when(expert >= 0)
    def _():
        first = ps * per_split  # this program's run of chunks
        last = jnp.minimum(first + per_split, cdiv(i, BLOCK))
        acc = jax.lax.fori_loop(first, last, chunk, jnp.zeros((block_rows, block_o), jnp.float32))
        plgpu.store(out, acc.astype(o_ref.dtype), mask=_mask2(None, rows_ok))

    @pl.when(expert < 0)
    def _():
        plgpu.store(out, jnp.zeros((block_rows, block_o), o_ref.dtype), mask=_mask2(None, rows_ok))
