"""Tile configs of the FP8 block matmul kernels (fp8_kernels.py), their limits, and the heuristics that
choose one per launch of M rows, O output rows (summed over a shared launch's weights), I input features:
up to DECODE_MAX_ROWS rows stream W on the decode grid (DecodeConfig), more run the GEMM (PrefillConfig).
Every choice was measured on the H200 at the Qwen3.5-27B shapes (figures in WORKSPACE.md).
"""

from __future__ import annotations

import dataclasses

BLOCK = 128  # the scale block: 128 x 128 weights share one scale; both kernels walk I in chunks of it
DOT_MIN = 16  # smallest M / N / K of a Triton dot
SM_COUNT = 132  # H200 streaming multiprocessors: the split-K heuristics' occupancy target
# Rows on the decode grid ([64, BM <= 128] f32 accumulator): it converts a W chunk once, the GEMM per 64 rows.
DECODE_MAX_ROWS = 128
# From 9 rows bf16 x is one scaled f16 piece per row: two pieces no longer fit the 16-row dot (one halves it).
X_F16_SCALED_MIN_ROWS = DOT_MIN // 2 + 1
# Programs per SM the few-row split-K aims for: wide launches stream at 2, narrow (latency-bound) ones want 4.
WIDE_PROGRAMS_PER_SM = 2
NARROW_PROGRAMS_PER_SM = 4
NARROW_NUM_STAGES = 3  # narrow launches' programs are short: fewer loads in the prologue (3 beat 4 and 2)
# 33-128 rows (a verify of 9-32 slots at K=3): 3 stages (beat 2 and 4), split-K 8 where runs keep >= 16 chunks.
VERIFY_MIN_ROWS = 33
VERIFY_STAGES = 3
# At 33-64 rows a wide launch on 128-row tiles runs 128-row programs (8 warps): half the x reads per weight byte.
VERIFY_WIDE_BLOCK_O = 128
VERIFY_WIDE_MAX_ROWS = 64
# The GEMM splits I until its grid has this many programs (a verify's o_proj: 40 tiles on 132 SMs).
GEMM_SPLIT_PROGRAMS = SM_COUNT
# row_invariant launches of fewer rows (decode steps, verify passes of batch x (K+1) rows) run the decode
# kernel, in pieces of DECODE_MAX_ROWS rows past it, so a row has the sums it has alone; from here on
# (prefill chunks) the GEMM. Its rows agree among themselves but not with the decode kernel's: a verify
# pass of 160 rows on the GEMM parted from plain decoding (27B FP8 preset, batch 32 at K=4, H100).
ROW_INVARIANT_GEMM_MIN_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Few-row tile: block_o W rows per program (a power of two in [16, 128]); split_k programs along I, each
    summing a contiguous run of chunks (f32 partials summed by XLA in a fixed order); swap_ab: dot(W, x^T)
    not dot(x, W^T); scale_preload: the run's scales as one vector before the loop (the pipeliner does not
    prefetch scalar loads); x_f16 (bf16 x): two f16 pieces per row, so W converts E4M3 -> f16 (one instruction
    per two weights, not ~3 per weight to bf16); x_f16_scaled (with x_f16): one scaled f16 piece per row;
    row_groups: x's rows enter as DOT_MIN-row dots, one per group (the same dot, so the same sums, at every M)."""

    block_o: int = 64
    split_k: int = 1
    swap_ab: bool = True
    num_warps: int = 4
    num_stages: int = 4
    scale_preload: bool = False
    x_f16: bool = False
    x_f16_scaled: bool = False
    row_groups: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Many-row GEMM tile: block_m x block_n outputs (powers of two, block_m >= 16, 16 <= block_n <= 128: one
    scale row), K chunk 128 (one scale column); split_k as DecodeConfig's (1: each program stores its rounded
    tile); x_f16_scaled (bf16 x): one scaled f16 piece per row (the GEMM is conversion-bound at a verify)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    x_f16_scaled: bool = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def chunk_runs(n_chunks: int, splits: int) -> tuple[int, int]:
    """(chunks per program, programs) of n_chunks in <= `splits` equal runs, none empty (12 in 8 -> 2 each, 6)."""
    per = cdiv(n_chunks, min(splits, n_chunks))
    return per, cdiv(n_chunks, per)


def check_config(config, m: int) -> None:
    """A config fit for M rows, or ValueError naming the field and its limit."""
    c = config
    if isinstance(c, DecodeConfig):
        if not (is_pow2(c.block_o) and DOT_MIN <= c.block_o <= BLOCK):
            raise ValueError(f"fp8_matmul: DecodeConfig.block_o={c.block_o} must be a power of two in [16, 128]")
        if m > DECODE_MAX_ROWS:
            raise ValueError(f"fp8_matmul: DecodeConfig is for M <= {DECODE_MAX_ROWS} rows, got M={m}")
        if c.x_f16_scaled and not c.x_f16:
            raise ValueError("fp8_matmul: DecodeConfig(x_f16_scaled=True) is a form of x_f16: set x_f16=True too")
    elif isinstance(c, PrefillConfig):
        if not (is_pow2(c.block_m) and c.block_m >= DOT_MIN):
            raise ValueError(f"fp8_matmul: PrefillConfig.block_m={c.block_m} must be a power of two >= 16")
        if not (is_pow2(c.block_n) and DOT_MIN <= c.block_n <= BLOCK):
            raise ValueError(f"fp8_matmul: PrefillConfig.block_n={c.block_n} must be a power of two in [16, 128]")
    else:
        raise ValueError(f"fp8_matmul: config must be a DecodeConfig or PrefillConfig, got {type(c).__name__}")
    if c.split_k < 1:
        raise ValueError(f"fp8_matmul: {type(c).__name__}.split_k={c.split_k} must be >= 1")
    if c.num_warps < 1 or c.num_stages < 1:
        raise ValueError(f"fp8_matmul: bad config {c}: num_warps and num_stages must be >= 1")


def is_wide(o: int) -> bool:
    """Wide: its 64-row blocks alone fill the SMs (gate + up, qkv, in_proj); narrow ones need split-K."""
    return cdiv(o, 64) >= SM_COUNT


def decode_config(m: int, o: int, i: int, tile_rows: int | None = None) -> DecodeConfig:
    """The decode grid's config (M <= DECODE_MAX_ROWS): to 16 rows x on the dot's M side (its 16 rows) and
    split-K for *_PROGRAMS_PER_SM, above W there; tile_rows: the weights' tile height (None: [O, I])."""
    wide = is_wide(o)
    n_chunks = cdiv(i, BLOCK)
    scaled = m >= X_F16_SCALED_MIN_ROWS
    if m > DOT_MIN:
        verify = m >= VERIFY_MIN_ROWS
        whole_tiles = bool(tile_rows) and tile_rows % VERIFY_WIDE_BLOCK_O == 0
        block_o = VERIFY_WIDE_BLOCK_O if wide and verify and m <= VERIFY_WIDE_MAX_ROWS and whole_tiles else 64
        split = 8 if verify and n_chunks >= 8 * 16 else max(1, min(4, n_chunks // 4))
        return DecodeConfig(block_o=block_o, split_k=split, swap_ab=True, x_f16=scaled, x_f16_scaled=scaled,
                            num_warps=8 if block_o > 64 else 4, num_stages=VERIFY_STAGES if verify else 4)
    per_sm = WIDE_PROGRAMS_PER_SM if wide else NARROW_PROGRAMS_PER_SM
    split = 1
    while cdiv(o, 64) * split < per_sm * SM_COUNT and split < 8 and n_chunks >= 2 * split * 4:
        split *= 2
    if n_chunks >= 16:
        split = max(split, 2)
    return DecodeConfig(block_o=64, split_k=split, swap_ab=False, scale_preload=True, x_f16=True,
                        x_f16_scaled=scaled, num_stages=4 if wide else NARROW_NUM_STAGES)


def act_quant_config(m: int, o: int, i: int) -> DecodeConfig:
    """decode_config's tiles for E4M3 x (act_quant): W on the dot's M side (FP8 wgmma needs 64 rows per
    warpgroup there), x as it is, the 4 stages they were measured with."""
    return dataclasses.replace(decode_config(m, o, i), swap_ab=True, x_f16=False, x_f16_scaled=False, num_stages=4)


def prefill_config(m: int, o: int, i: int) -> PrefillConfig:
    """The GEMM's tiles (the fastest at each row range); split_k doubled (runs of >= 4 chunks) while the
    grid has fewer than GEMM_SPLIT_PROGRAMS programs; bf16 x as one scaled f16 piece per row."""
    block_m, warps = (32, 4) if m <= 32 else (64, 4) if m <= 256 else (128, 8)
    tiles, n_chunks = cdiv(m, block_m) * cdiv(o, BLOCK), cdiv(i, BLOCK)
    split = 1
    while tiles * split < GEMM_SPLIT_PROGRAMS and n_chunks >= 8 * split:
        split *= 2
    return PrefillConfig(block_m=block_m, block_n=BLOCK, num_warps=warps, num_stages=3, split_k=split,
                         x_f16_scaled=True)


def row_invariant_config(m: int, o: int, i: int) -> DecodeConfig | PrefillConfig:
    """A config that is the same at every M of its kernel, so a row's sums do not depend on M: below
    ROW_INVARIANT_GEMM_MIN_ROWS decode_config's 16-row tile (its split-K depends on O and I only) with x in
    DOT_MIN-row groups, one dot per group (a launch holds DECODE_MAX_ROWS rows: the caller runs more in
    pieces); from there the GEMM on fixed 64 x 128 tiles, one program per output tile (no split-K)."""
    if m < ROW_INVARIANT_GEMM_MIN_ROWS:
        return dataclasses.replace(decode_config(DOT_MIN, o, i), row_groups=True)
    return PrefillConfig(block_m=64, block_n=BLOCK, num_warps=4, num_stages=3, split_k=1, x_f16_scaled=True)


def default_config(m: int, o: int, i: int, tile_rows: int | None = None) -> DecodeConfig | PrefillConfig:
    """The decode grid up to DECODE_MAX_ROWS rows, the GEMM above; tile_rows as decode_config's."""
    if m <= DECODE_MAX_ROWS:
        return decode_config(m, o, i, tile_rows=tile_rows)
    return prefill_config(m, o, i)
