"""FP8 E4M3 block-scaled matmul: y[t, o] = sum_i x[t, i] * w[o, i] * scale[o // 128, i // 128].

w [O, I] float8_e4m3fn (or fp8_layout.tile_weight's tiles), scale [ceil(O/128), ceil(I/128)] f32 (ragged
last blocks use their block's scale), x [..., I] bf16 or f32, f32 accumulation, output in `out_dtype`.
`fp8_matmul_ref` is the jnp reference; `fp8_matmul` its Pallas twin (kernels in fp8_kernels.py, configs in
fp8_config.py); act_quant=True runs on E4M3 activations (fp8_act_quant.py: an approximation of x).
`bf16_matmul` runs bf16 weights on the same kernels (unit scales).

row_invariant=True: a row's output does not depend on how many rows share the call (fp8_config.
row_invariant_config: one tile config per weight shape at every M, the decode kernel's rows in DOT_MIN-row
dots, launches of DECODE_MAX_ROWS rows at most), so a token decoded alone, inside a verify pass or inside a
batch gets the same bits, up to fp8_config.ROW_INVARIANT_GEMM_MIN_ROWS rows per call.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _fp8_dot, fp8_act_quant, fp8_config, fp8_dequant
from pallas_kernels._vma import align
from pallas_kernels.fp8_config import (BLOCK, DECODE_MAX_ROWS, DOT_MIN, DecodeConfig, PrefillConfig, cdiv,
                                       default_config, next_pow2)
from pallas_kernels.fp8_kernels import X_F16_HI, _decode_kernel, _f16_pieces, _f16_scaled, _prefill_kernel
from pallas_kernels.fp8_layout import untile_weight, weight_shape

_fp8_dot.install()  # E4M3 x E4M3 dots (act_quant) may use Hopper's FP8 wgmma: see _fp8_dot


def _check(x: jax.Array, w: jax.Array, scale: jax.Array) -> None:
    if w.ndim not in (2, 4) or (w.ndim == 4 and w.shape[3] != BLOCK) or x.shape[-1] != weight_shape(w)[1]:
        raise ValueError(f"fp8_matmul: x {x.shape} and w {w.shape} need x[..., I] and w[O, I] "
                         f"(or tile_weight's [O / bo, I / {BLOCK}, bo, {BLOCK}])")
    o, i = weight_shape(w)
    grid = (cdiv(o, BLOCK), cdiv(i, BLOCK))
    if tuple(scale.shape) != grid:
        raise ValueError(f"fp8_matmul: scale {scale.shape} is not the {BLOCK}x{BLOCK} grid {grid} of w {w.shape}")


def _check_dtypes(x, w, scale, out_dtype, w_dtype=jnp.float8_e4m3fn) -> None:
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"fp8_matmul: x has dtype {x.dtype}; bfloat16 or float32 needed")
    if w.dtype != w_dtype:
        raise ValueError(f"fp8_matmul: w has dtype {w.dtype}; {jnp.dtype(w_dtype).name} needed")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"fp8_matmul: scale has dtype {scale.dtype}; floating point needed")
    if out_dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"fp8_matmul: out_dtype {out_dtype} is not bfloat16, float16 or float32")


def _check_int32(m: int, o: int, i: int, split: int) -> None:
    if max(m * i, o * i, split * m * o) >= 2**31:
        raise ValueError(f"fp8_matmul: M={m}, O={o}, I={i}, split_k={split}: the kernels index with int32 "
                         "offsets; split the call so that M*I, O*I and split_k*M*O stay below 2^31")


def dequantize_ref(w: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """[O, I] E4M3 + scale grid -> [O, I] in `dtype` (materializes the whole weight)."""
    o, i = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=-2), BLOCK, axis=-1)[..., :o, :i]
    return (w.astype(jnp.float32) * s).astype(dtype)


def fp8_matmul_ref(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """Reference: dequantize to f32, then x @ W.T with f32 accumulation (w in either layout)."""
    _check(x, w, scale)
    out_dtype = out_dtype or x.dtype
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dequantize_ref(untile_weight(w), scale),
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def dequantize_for_dot(w: jax.Array, scale: jax.Array, dtype, *, interpret: bool = False) -> jax.Array:
    """W [O, I] (either layout) dequantized into `dtype` for an XLA dot: fp8_dequant's kernel where it reads
    w's layout (XLA's own fusion of the tiles ran at ~1/3 of copy), else dequantize_ref behind an
    optimization barrier (fused into the dot, it ran ~10x slower)."""
    if fp8_dequant.tile_rows(w) is not None:
        return fp8_dequant.dequantize(w, scale, dtype, interpret=interpret)
    return jax.lax.optimization_barrier(dequantize_ref(untile_weight(w), scale, dtype))


def fp8_matmul_dequant_dot(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None, *,
                           interpret: bool = False) -> jax.Array:
    """Many rows (long prefills): W dequantized once into x's dtype (one rounding per weight; exact for f32
    x), then one XLA dot with f32 accumulation (XLA's bf16 dot beats the Pallas GEMM at large M)."""
    _check(x, w, scale)
    out_dtype = out_dtype or x.dtype
    deq = dequantize_for_dot(w, scale, x.dtype, interpret=interpret)  # [O, I]
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    y = jnp.einsum("...i,oi->...o", x, deq, preferred_element_type=jnp.float32, precision=precision)
    return y.astype(out_dtype)


def fp8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None, *, interpret: bool = False,
               config: DecodeConfig | PrefillConfig | None = None, act_quant: bool = False,
               row_invariant: bool = False) -> jax.Array:
    """Pallas twin of `fp8_matmul_ref` (x's leading dims flattened to M rows; any O, I, M); `config` overrides
    fp8_config.default_config (row_invariant_config with row_invariant); act_quant: the decode kernel on E4M3
    x (twin fp8_act_quant.fp8_matmul_act_ref)."""
    return fp8_matmul_many(x, (w,), (scale,), out_dtype, interpret=interpret, config=config, act_quant=act_quant,
                           row_invariant=row_invariant)[0]


def bf16_matmul(x: jax.Array, w: jax.Array, out_dtype=None, *, interpret: bool = False,
                config: DecodeConfig | PrefillConfig | None = None, row_invariant: bool = False) -> jax.Array:
    """y = x @ w.T for bf16 w [O, I] on fp8_matmul's kernels (every scale 1; W enters the dot as it is),
    f32 accumulation; its twin is XLA's dot with f32 accumulation."""
    if w.ndim != 2:
        raise ValueError(f"bf16_matmul: w {w.shape}: an [O, I] weight needed")
    ones = jnp.ones((cdiv(w.shape[0], BLOCK), cdiv(w.shape[1], BLOCK)), jnp.float32)
    return _matmul_many(x, (w,), (ones,), out_dtype, interpret=interpret, config=config, act_quant=False,
                        row_invariant=row_invariant, w_dtype=jnp.bfloat16)[0]


def fp8_matmul_many(x: jax.Array, ws, scales, out_dtype=None, *, interpret: bool = False,
                    config: DecodeConfig | PrefillConfig | None = None, act_quant: bool = False,
                    row_invariant: bool = False) -> tuple[jax.Array, ...]:
    """(fp8_matmul(x, w_j, scale_j) for each j). Few rows: one launch over all the weights (small projections
    fill the GPU with the large ones), configured for the summed O. Many rows: one GEMM per weight."""
    return _matmul_many(x, ws, scales, out_dtype, interpret=interpret, config=config, act_quant=act_quant,
                        row_invariant=row_invariant, w_dtype=jnp.float8_e4m3fn)


def _matmul_many(x, ws, scales, out_dtype, *, interpret, config, act_quant, row_invariant, w_dtype):
    """fp8_matmul_many for weights of w_dtype: E4M3, or bf16 (bf16_matmul: every scale 1)."""
    ws, scales = tuple(ws), tuple(scales)
    if not ws or len(ws) != len(scales):
        raise ValueError(f"fp8_matmul_many: {len(ws)} weights and {len(scales)} scale grids; one of each per projection")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    for w, scale in zip(ws, scales):
        _check(x, w, scale)
        _check_dtypes(x, w, scale, out_dtype, w_dtype)
    lead, i, os = x.shape[:-1], x.shape[-1], tuple(weight_shape(w)[0] for w in ws)
    m = math.prod(lead)
    if m == 0 or i == 0 or 0 in os:
        return tuple(jnp.zeros((*lead, o), out_dtype) for o in os)
    fp8_w = w_dtype == jnp.float8_e4m3fn
    if row_invariant and act_quant:
        raise ValueError("fp8_matmul: row_invariant has no act_quant form")
    if row_invariant and config is None and DECODE_MAX_ROWS < m < fp8_config.ROW_INVARIANT_GEMM_MIN_ROWS:
        # one decode launch per DECODE_MAX_ROWS rows: each row keeps the sums it has in a launch of its own
        x2 = x.reshape(m, i)
        pieces = [_matmul_many(x2[r:r + DECODE_MAX_ROWS], ws, scales, out_dtype, interpret=interpret, config=None,
                               act_quant=False, row_invariant=True, w_dtype=w_dtype)
                  for r in range(0, m, DECODE_MAX_ROWS)]
        return tuple(jnp.concatenate(ys).reshape(*lead, o) for ys, o in zip(zip(*pieces), os))
    if config is None and act_quant and m <= DECODE_MAX_ROWS:
        config = fp8_config.act_quant_config(m, sum(os), i)
    chosen = config is None  # a GEMM then takes each weight's own config
    gemm_config = fp8_config.row_invariant_config if row_invariant else fp8_config.prefill_config
    if config is None:
        config = (fp8_config.row_invariant_config(m, sum(os), i) if row_invariant
                  else default_config(m, sum(os), i, tile_rows=tile_rows(ws)))
    fp8_config.check_config(config, m)
    ws = _fit_tiles(ws, config)
    x2, scales = x.reshape(m, i), tuple(s.astype(jnp.float32) for s in scales)
    # f16 pieces for bf16 x times E4M3 w (exact in f16); f32 x, or bf16 w, keep exact bf16 pieces
    bf16_x = x.dtype == jnp.bfloat16 and fp8_w
    if isinstance(config, PrefillConfig):
        if act_quant:
            raise ValueError(f"fp8_matmul: act_quant runs on the decode kernel (M <= {DECODE_MAX_ROWS} rows "
                             f"with a DecodeConfig), got M={m} with {config}")
        configs = [gemm_config(m, o, i) if chosen else config for o in os]
        configs = [dataclasses.replace(c, x_f16_scaled=c.x_f16_scaled and bf16_x) for c in configs]
        x_args = (x2,)
        if any(c.x_f16_scaled for c in configs):
            x_f, row_scale = _f16_scaled(x2)  # [M, I] f16, [M, 1] f32, made once for all weights
            x_args = (x_f, row_scale[:, 0])
        return tuple(_prefill_call(x_args if c.x_f16_scaled else (x2,), w, s, out_dtype, c, interpret).reshape(*lead, o)
                     for w, s, c, o in zip(ws, scales, configs, os))
    if act_quant:
        return _act_quant_call(x2, ws, scales, lead, out_dtype, config, interpret)
    # x_f16: 2M f16 rows [hi; lo], combined by XLA as 2^16 hi + lo; x_f16_scaled: M rows, scaled back
    x_f16 = config.x_f16 and bf16_x
    scaled = x_f16 and config.x_f16_scaled
    m_k = 2 * m if x_f16 and not scaled else m  # rows the kernel multiplies
    if m_k > DECODE_MAX_ROWS:
        raise ValueError(f"fp8_matmul: DecodeConfig(x_f16=True) is for M <= {DECODE_MAX_ROWS // 2} rows "
                         f"(two f16 pieces per row; x_f16_scaled takes {DECODE_MAX_ROWS}), got M={m}")
    if scaled:
        x2, row_scale = _f16_scaled(x2)  # [M, I] f16, [M, 1] f32
    elif x_f16:
        x2 = _f16_pieces(x2).reshape(m_k, i)
    split = fp8_config.chunk_runs(cdiv(i, BLOCK), config.split_k)[1]
    part_dtype = out_dtype if split == 1 and not x_f16 else jnp.float32
    bm = cdiv(m_k, DOT_MIN) * DOT_MIN if config.row_groups else max(DOT_MIN, next_pow2(m_k))
    if config.row_groups:  # whole groups of rows in and out (zeros past M)
        x2 = jnp.pad(x2, ((0, bm - m_k), (0, 0)))
    ys = _decode_call((x2,), ws, scales, m=m_k, i=i, bm=bm, part_dtype=part_dtype,
                      config=config, interpret=interpret, x_f16=x_f16, name="fp8_matmul_decode")
    ys = tuple(y[:, :m_k] for y in ys)
    if scaled:  # [split, M, O] -> 2^e_r sum_s y_s (exact: a power of two)
        return tuple((_split_sum(y) * row_scale).astype(out_dtype).reshape(*lead, o) for y, o in zip(ys, os))
    if x_f16:  # [split, 2M, O] -> sum_s 2^16 hi_s + lo_s
        return tuple(_split_sum(y[:, :m] * X_F16_HI + y[:, m:]).astype(out_dtype).reshape(*lead, o)
                     for y, o in zip(ys, os))
    return tuple(_split_sum(y).astype(out_dtype).reshape(*lead, o) for y, o in zip(ys, os))


def _split_sum(y: jax.Array) -> jax.Array:
    """[split, ...] partials -> their sum, added in split order (one fixed order, whatever the shape)."""
    return functools.reduce(jnp.add, [y[s] for s in range(y.shape[0])])


def tile_rows(ws) -> int | None:
    """The tile height every weight of a launch reads whole (the smallest); None if any weight is [O, I]."""
    if any(w.ndim != 4 for w in ws):
        return None
    return min(w.shape[2] for w in ws)


def _fit_tiles(ws, config):
    """Tiled weights the launch can read (decode: slices of one tile, joining tiles ran 2.2x slower; GEMM: a
    slice of one tile or whole tiles, O a multiple of block_n); others untiled to [O, I], a copy per call."""
    decode = isinstance(config, DecodeConfig)
    rows = config.block_o if decode else config.block_n

    def readable(w) -> bool:
        if w.ndim == 2:
            return True
        tr = w.shape[2]
        return tr % rows == 0 if decode else weight_shape(w)[0] % rows == 0 and (rows % tr == 0 or tr % rows == 0)

    return tuple(w if readable(w) else untile_weight(w) for w in ws)


def _decode_call(x_args: tuple, ws, scales, *, m: int, i: int, bm: int, part_dtype, config: DecodeConfig,
                 interpret: bool, x_f16: bool, name: str) -> tuple[jax.Array, ...]:
    """The decode kernel's launch over all weights: x_args are x [M, I] alone, or (x_q, s_x) with E4M3
    activations; returns the partials [split, rows, O_j] per weight (rows: M, or BM for E4M3 x)."""
    cps, split = fp8_config.chunk_runs(cdiv(i, BLOCK), config.split_k)
    os = tuple(weight_shape(w)[0] for w in ws)
    x_fp8 = len(x_args) == 2
    # the kernel indexes x's rows up to BM and, with E4M3 x, whole 128-column chunks
    _check_int32(bm if x_fp8 else m, max(os), cdiv(i, BLOCK) * BLOCK if x_fp8 else i, split)
    if config.scale_preload and interpret:
        # the CPU interpreter clamps a slice past the row (the GPU never reads those masked lanes): pad
        width = (split - 1) * cps + max(next_pow2(cps), 2)
        scales = tuple(jnp.pad(s, ((0, 0), (0, max(width - s.shape[1], 0)))) for s in scales)
    return _decode_launch(tuple(x_args), tuple(ws), tuple(scales), os=os, m=m, i=i, bm=bm, cps=cps, split=split,
                          out_rows=bm if x_fp8 or config.row_groups else m, part_dtype=jnp.dtype(part_dtype), config=config,
                          interpret=interpret, x_f16=x_f16, name=name)


# jitted: a pass's launches of one shape and config (64 layers' gate / up, ...) trace and lower once (~8x faster)
@functools.partial(jax.jit, static_argnames=("os", "m", "i", "bm", "cps", "split", "out_rows", "part_dtype", "config",
                                             "interpret", "x_f16", "name"))
def _decode_launch(x_args, ws, scales, *, os, m, i, bm, cps, split, out_rows, part_dtype, config, interpret, x_f16,
                   name):
    kernel = functools.partial(_decode_kernel, m=m, os=os, i=i, bm=bm, cfg=config, chunks_per_split=cps,
                               x_f16=x_f16, x_fp8=len(x_args) == 2)
    args, out = align(*x_args, *ws, *scales)
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out((split, out_rows, o), part_dtype) for o in os),
        grid=(sum(cdiv(o, config.block_o) for o in os), split),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*args)


def _act_quant_call(x2, ws, scales, lead, out_dtype, config: DecodeConfig, interpret: bool):
    """The decode kernel on E4M3 x, quantized by XLA, zero-padded to BM rows and whole chunks, its scales
    transposed to [GI, BM] (one contiguous row per chunk); the f32 partials [split, BM, O] summed by XLA."""
    (m, i), os = x2.shape, tuple(weight_shape(w)[0] for w in ws)
    bm = max(DOT_MIN, next_pow2(m))
    x_q, s_x = fp8_act_quant.quantize_groups(x2)  # [M, GI * 128] (zero past I), [M, GI]
    x_q = jnp.pad(x_q, ((0, bm - m), (0, 0)))  # E4M3 zeros
    s_x = jnp.pad(s_x, ((0, bm - m), (0, 0))).T  # [GI, BM]
    if i % BLOCK:  # ragged I: the weights' bits, so the kernel can fill the columns past I with 0
        ws = tuple(jax.lax.bitcast_convert_type(w, jnp.uint8) for w in ws)
    ys = _decode_call((x_q, s_x), ws, scales, m=m, i=i, bm=bm, part_dtype=jnp.float32, config=config,
                      interpret=interpret, x_f16=False, name="fp8_matmul_decode_a8")
    return tuple(_split_sum(y[:, :m]).astype(out_dtype).reshape(*lead, o) for y, o in zip(ys, os))


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))  # see _decode_launch
def _prefill_call(x_args, w, scale, out_dtype, config: PrefillConfig, interpret: bool) -> jax.Array:
    """The GEMM of x_args = (x [M, I],) or, x_f16_scaled, (f16 piece, row scales [M]), with this weight's config."""
    (m, i), o = x_args[0].shape, weight_shape(w)[0]
    cps, split = fp8_config.chunk_runs(cdiv(i, BLOCK), config.split_k)
    _check_int32(m, o, i, split)
    kernel = functools.partial(_prefill_kernel, m=m, o=o, i=i, cfg=config, chunks_per_split=cps)
    (x_f, w, scale, *row_scale), out = align(x_args[0], w, scale, *x_args[1:])
    y = pl.pallas_call(
        kernel,
        out_shape=out((split, m, o), out_dtype if split == 1 else jnp.float32),  # [split, M, O]
        grid=(cdiv(m, config.block_m), cdiv(o, config.block_n), split),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fp8_matmul_prefill",
    )(x_f, w, scale, *row_scale)
    return _split_sum(y).astype(out_dtype)
