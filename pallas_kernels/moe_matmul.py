"""Grouped expert matmul of the sparse MoE block (qmtp/model/moe.py): rows in blocks of BR rows (BR = rows /
blocks: BLOCK_ROWS at decode and verify, more for prefills), each block multiplied by one expert's weight,
the experts' weights stacked:

    y[r, o] = sum_i x[r, i] W[e_b, o, i]     for the rows r of block b, e_b = block_expert[b]
                                            (e_b = -1: an unused block: no weight read, its rows of
                                            y are not written and hold anything)

W: [X, O, I] E4M3 with the scale grid [X, ceil(O/128), ceil(I/128)] (W = q * scale per 128 x 128 block),
or [X, O, I] in bf16 / f32 (no scales). A launch reads each block's expert once per block_o outputs: at
decode the k experts a token chose, not the X of the layer.

One program per (row block, block_o outputs) sums the 128-column chunks of I in order, each chunk's dot
(bf16 pieces of x against bf16 pieces of the weight, f32 accumulation; E4M3 and bf16 are one exact
piece, f32 three) times its scale in f32: a row's result depends on its own x, its expert and that order
only, so it is the same whatever other rows share the launch (row-invariant, as
KernelConfig.deterministic needs).

Options:
  - swiglu: W = gate_up [X, 2 I', I] (the gate's I' rows, then the up's) and each program multiplies both
    halves: y[r, o] = silu(g) * u for o < I', g and u each rounded to out_dtype first (as a gate_up
    output in out_dtype would be), then f32, the product rounded to out_dtype: the expert's SwiGLU in
    the launch of its gate_up.
  - x_shared: x is [BR, I], the rows every block multiplies: the expert-major layout of small steps
    (qmtp/model/moe.py: block e is expert e's, row t of it token t's, so no grouping is computed);
  - one_run: one run of chunks per program whatever config.split_k (no split partials to add over the
    many unused blocks of an expert-major output). swiglu and x_shared imply it.
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

    block_o: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


EXPERT_MATMUL_CONFIG = ExpertMatmulConfig()


def _check(x, block_expert, w, scale, x_shared: bool = False, swiglu: bool = False):
    rows, i = x.shape
    if w.ndim != 3 or w.shape[2] != i:
        raise ValueError(f"expert_matmul: x {x.shape} needs stacked weights [X, O, {i}], got {w.shape}")
    if block_expert.ndim != 1 or block_expert.shape[0] == 0 or (not x_shared and rows % block_expert.shape[0]):
        raise ValueError(f"expert_matmul: x has {rows} rows, not a whole number of rows for each of the "
                         f"{block_expert.shape} blocks")
    if swiglu and w.shape[1] % 2:
        raise ValueError(f"expert_matmul(swiglu=True): gate_up weights {w.shape} need an even number of rows")
    if swiglu and scale is not None and (w.shape[1] // 2) % BLOCK:
        raise ValueError(f"expert_matmul(swiglu=True): E4M3 gate_up {w.shape} needs a gate of whole {BLOCK}-row "
                         "scale blocks")
    block_rows = rows if x_shared else rows // block_expert.shape[0]
    if block_rows < BLOCK_ROWS or block_rows & (block_rows - 1):
        raise ValueError(f"expert_matmul: {block_rows} rows per block, needs a power of two >= {BLOCK_ROWS}")
    fp8 = w.dtype == jnp.float8_e4m3fn
    if fp8 != (scale is not None):
        raise ValueError("expert_matmul: E4M3 weights come with a scale grid, other weights without")
    if fp8 and scale.shape != (w.shape[0], cdiv(w.shape[1], BLOCK), cdiv(i, BLOCK)):
        raise ValueError(f"expert_matmul: scale grid {scale.shape} for weights {w.shape}")


def expert_matmul_ref(x: jax.Array, block_expert: jax.Array, w: jax.Array, scale: jax.Array | None,
                      out_dtype=None, *, x_shared: bool = False, swiglu: bool = False) -> jax.Array:
    """The reference: each block's expert gathered and dequantized to f32, one einsum, f32 accumulation.
    x [NB * BR, I] ([BR, I] when x_shared), block_expert int32 [NB] -> y [NB * BR, O] (O = I' when
    swiglu) in out_dtype (x's); an unused block's rows are 0 here."""
    _check(x, block_expert, w, scale, x_shared, swiglu)
    nb, (_, o, i) = block_expert.shape[0], w.shape
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    e = jnp.maximum(block_expert, 0)
    wb = dequantize_ref(w[e], scale[e]) if scale is not None else w[e].astype(jnp.float32)  # [NB, O, I]
    xb = jnp.broadcast_to(x[None], (nb,) + x.shape) if x_shared else x.reshape(nb, -1, i)  # [NB, BR, I]
    y = jnp.einsum("bri,boi->bro", xb.astype(jnp.float32), wb, precision=jax.lax.Precision.HIGHEST)
    if swiglu:
        y = _swiglu(y[..., :o // 2], y[..., o // 2:], out_dtype)
    y = jnp.where(block_expert[:, None, None] >= 0, y, 0.0)
    return y.reshape(nb * xb.shape[1], -1).astype(out_dtype)


def _swiglu(g: jax.Array, u: jax.Array, out_dtype) -> jax.Array:
    """silu(g) * u of f32 sums g, u, each rounded to out_dtype first; f32 result."""
    g, u = (v.astype(out_dtype).astype(jnp.float32) for v in (g, u))
    return jax.nn.silu(g) * u


def expert_matmul(x: jax.Array, block_expert: jax.Array, w: jax.Array, scale: jax.Array | None,
                  out_dtype=None, interpret: bool = False, config: ExpertMatmulConfig | None = None, *,
                  x_shared: bool = False, swiglu: bool = False, one_run: bool = False) -> jax.Array:
    """The Pallas kernel (module doc); arguments and result as expert_matmul_ref (an unused block's rows
    unwritten)."""
    _check(x, block_expert, w, scale, x_shared, swiglu)
    config = config or EXPERT_MATMUL_CONFIG
    if one_run or x_shared or swiglu:
        config = dataclasses.replace(config, split_k=1)
    if (config.block_o < 1 or BLOCK % config.block_o or config.split_k < 1 or config.num_warps < 1
            or config.num_stages < 1):
        raise ValueError(f"expert_matmul: bad config {config}: block_o must be a power of two dividing {BLOCK}, "
                         "the other fields >= 1")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if scale is None:  # every block scale 1: one kernel for E4M3 and wider weights
        scale = jnp.ones((w.shape[0], cdiv(w.shape[1], BLOCK), cdiv(x.shape[1], BLOCK)), jnp.float32)
    return _launch(x, block_expert.astype(jnp.int32), w, scale.astype(jnp.float32), out_dtype=out_dtype,
                   interpret=interpret, config=config, x_shared=x_shared, swiglu=swiglu)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config", "x_shared", "swiglu"))
def _launch(x, block_expert, w, scale, *, out_dtype, interpret, config, x_shared, swiglu):
    nb, (x_rows, i) = block_expert.shape[0], x.shape
    block_rows = x_rows if x_shared else x_rows // nb
    o = w.shape[1] // 2 if swiglu else w.shape[1]  # outputs
    chunks = cdiv(i, BLOCK)
    per_split = cdiv(chunks, config.split_k)
    split = cdiv(chunks, per_split)  # no empty run
    y = pl.pallas_call(
        functools.partial(_kernel, o=o, i=i, block_rows=block_rows, block_o=config.block_o,
                          per_split=per_split, x_shared=x_shared, swiglu=swiglu),
        out_shape=jax.ShapeDtypeStruct((split, nb * block_rows, o), jnp.float32 if split > 1 else out_dtype),
        grid=(nb, cdiv(o, config.block_o), split),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="moe_expert_matmul",
    )(block_expert, x, w, scale)
    return _split_sum(y).astype(out_dtype)  # the runs' partials in run order


def _kernel(e_ref, x_ref, w_ref, s_ref, o_ref, *, o, i, block_rows, block_o, per_split, x_shared, swiglu):
    # e_ref [NB]; x_ref [NB * BR, I] ([BR, I] x_shared); w_ref [X, O (2 O swiglu), I]; s_ref [X, GO, GI];
    # o_ref [split, NB * BR, O]
    pb, po, ps = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = e_ref[pb]
    r0 = pl.multiple_of(pb * block_rows, block_rows)
    x0 = 0 if x_shared else r0
    o0 = pl.multiple_of(po * block_o, block_o)
    rows_ok = (o0 + jnp.arange(block_o)) < o if o % block_o else None
    out = o_ref.at[ps, pl.ds(r0, block_rows), pl.ds(o0, block_o)]
    e = jnp.maximum(expert, 0)
    wide = w_ref.dtype == jnp.float32  # f32 weights: three bf16 pieces, like f32 x
    # the weight rows each accumulator multiplies: [o0, o0 + block_o), and the up half's with swiglu;
    # block_o divides 128 (and with E4M3 scales, O): a program's rows share one scale row
    halves = (0, o) if swiglu else (0,)

    def chunk(c, accs):
        k0 = pl.multiple_of(c * BLOCK, BLOCK)
        cols_ok = (k0 + jnp.arange(BLOCK)) < i if i % BLOCK else None
        xc = _load_x(x_ref.at[pl.ds(x0, block_rows), pl.ds(k0, BLOCK)], _mask2(None, cols_ok))
        x_pieces = _bf16_pieces(xc)
        new = []
        for half, acc in zip(halves, accs):
            wc = _load_w(w_ref.at[e, pl.ds(half + o0, block_o), pl.ds(k0, BLOCK)], _mask2(rows_ok, cols_ok),
                         jnp.float32 if wide else jnp.bfloat16)
            dots = [_dot_sum(x_pieces, w_piece, swap=False) for w_piece in (_bf16_pieces(wc) if wide else [wc])]
            new.append(acc + functools.reduce(jnp.add, dots[::-1]) * s_ref[e, (half + o0) // BLOCK, c])
        return tuple(new)

    @pl.when(expert >= 0)
    def _():
        first = ps * per_split  # this program's run of chunks
        last = jnp.minimum(first + per_split, cdiv(i, BLOCK))
        zeros = tuple(jnp.zeros((block_rows, block_o), jnp.float32) for _ in halves)
        accs = jax.lax.fori_loop(first, last, chunk, zeros)
        y = _swiglu(*accs, o_ref.dtype) if swiglu else accs[0]
        plgpu.store(out, y.astype(o_ref.dtype), mask=_mask2(None, rows_ok))
