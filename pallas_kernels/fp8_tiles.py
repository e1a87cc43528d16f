"""What a tile configuration of the FP8 block matmul kernels holds (DecodeConfig for the few-row
decode grid, PrefillConfig for the many-row GEMM), the kernels' fixed limits, and the check that a
config fits M rows. Which config a launch gets, and the measured switches behind that choice, are
pallas_kernels/fp8_config.py's.
"""

from __future__ import annotations

import dataclasses

BLOCK = 128  # the scale block: 128 x 128 weights share one scale
# A DecodeConfig with the tensor-core dot serves up to this many rows ([BO, BM <= 128] f32 accumulator,
# 64 registers per thread at BO = 64 and 4 warps). fp8_config.DECODE_MAX_ROWS sets how many of them
# the dispatch sends to it (fp8_config.VERIFY_TALL_STAGES: why 65-128 rows do).
DECODE_DOT_MAX_ROWS = 128
DOT_MIN = 16  # smallest M / N / K of a Triton dot
FMA_MAX_ROWS = 8  # the CUDA-core path keeps one [block_o, 128] f32 accumulator per row in registers


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Few-row (decode / verify) tile config. block_o: W rows per program (a power of two in
    [16, 128]); split_k: programs along I, each summing a contiguous run of 128-column chunks (f32
    partials reduced by XLA); use_dot: tensor-core dot (rows padded to 16) or, for M <= 8, f32
    multiply + row sums; swap_ab: dot(W, x^T) instead of dot(x, W^T); num_warps / num_stages:
    Triton launch parameters (stages pipeline the chunk loop's loads); chunks_per_step: 128-column
    chunks loaded per loop iteration (more bytes in flight per program; a remainder runs one chunk
    at a time); scale_preload: load the program's whole run of block scales as one vector before
    the loop and select each chunk's scale in registers, instead of one scalar global load per
    chunk (a load the pipeliner does not prefetch: its latency may stall every iteration); x_f16
    (tensor-core dot, bf16 x, FP8 weights): x enters as two float16 pieces, x = 2^16 hi + lo
    (`fp8_kernels._f16_pieces`), so each weight chunk converts E4M3 -> f16 (one instruction per two weights)
    instead of E4M3 -> bf16 (which Triton builds through f16, about three per weight). Making the
    pieces inside the kernel instead (two dots per chunk on one converted weight chunk) was measured
    and removed: the 64-layer 27B step took 27.1 ms against 10.31 (H200, 2026-11-30). x_f16_scaled
    (with x_f16): x enters as one float16 piece per row instead of two, scaled by a power of two per
    row (`fp8_kernels._f16_scaled`), so the dot has M rows, not 2M: at 9-16 rows half the tensor-core
    work and half the partials; exact for every value within 2^32 of its row's largest. x_chunk_scaled
    (tensor-core dot, bf16 x, FP8 weights; instead of x_f16): x enters as it is, bf16, and each program
    makes the scaled f16 piece itself, per row and 128-column chunk (`fp8_kernels._chunk_scaled`): no
    XLA launch before the kernel makes pieces, and a plain split-K sum after it; exact for every value
    within 2^32 of the largest of its row's chunk."""

    block_o: int = 64
    split_k: int = 1
    use_dot: bool = True
    swap_ab: bool = True
    num_warps: int = 4
    num_stages: int = 4
    chunks_per_step: int = 1
    scale_preload: bool = False
    x_f16: bool = False
    x_f16_scaled: bool = False
    x_chunk_scaled: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Many-row GEMM tile config: block_m x block_n output tiles (powers of two, block_m >= 16,
    16 <= block_n <= 128 so a tile has one scale row), K chunk = 128 (one scale column); split_k:
    programs along I per output tile, each summing a contiguous run of chunks into f32 partials
    [split_k, M, O] that XLA sums in a fixed order (1: each program writes its tile, rounded, itself);
    x_f16_scaled: bf16 x enters as one f16 piece per row scaled by a power of two (the decode path's
    `fp8_kernels._f16_scaled`, exact for every value within 2^32 of its row's largest), so each weight
    chunk converts E4M3 -> f16 (one instruction per two weights) instead of -> bf16 (through f16)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    x_f16_scaled: bool = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_runs(n_chunks: int, splits: int) -> tuple[int, int]:
    """(chunks per program, programs) when n_chunks are split into at most `splits` contiguous runs of
    equal length: fewer programs where a run would be left empty (48 chunks in 8 -> 6 each, 8; 12 in
    8 -> 2 each, 6)."""
    per = cdiv(n_chunks, min(splits, n_chunks))
    return per, cdiv(n_chunks, per)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_config(config, m: int) -> None:
    """A config fit for M rows, or ValueError naming the field and its limit."""
    if isinstance(config, DecodeConfig):
        c = config
        if not (is_pow2(c.block_o) and DOT_MIN <= c.block_o <= BLOCK):
            raise ValueError(f"fp8_matmul: DecodeConfig.block_o={c.block_o} must be a power of two in [16, 128]")
        if m > DECODE_DOT_MAX_ROWS:
            raise ValueError(f"fp8_matmul: DecodeConfig is for M <= {DECODE_DOT_MAX_ROWS} rows, got M={m}")
        if not c.use_dot and m > FMA_MAX_ROWS:
            raise ValueError(f"fp8_matmul: DecodeConfig(use_dot=False) is for at most {FMA_MAX_ROWS} rows, got M={m}")
        if c.split_k < 1:
            raise ValueError(f"fp8_matmul: DecodeConfig.split_k={c.split_k} must be >= 1")
        if c.chunks_per_step < 1:
            raise ValueError(f"fp8_matmul: DecodeConfig.chunks_per_step={c.chunks_per_step} must be >= 1")
        if c.x_f16 and not c.use_dot:
            raise ValueError("fp8_matmul: DecodeConfig(x_f16=True) needs use_dot=True (the pieces feed a tensor-core dot)")
        if c.x_f16_scaled and not c.x_f16:
            raise ValueError("fp8_matmul: DecodeConfig(x_f16_scaled=True) is a form of x_f16: set x_f16=True too")
        if c.x_chunk_scaled and (c.x_f16 or not c.use_dot):
            raise ValueError("fp8_matmul: DecodeConfig(x_chunk_scaled=True) replaces x_f16 (set it False) and needs "
                             "use_dot=True")
    elif isinstance(config, PrefillConfig):
        c = config
        if not (is_pow2(c.block_m) and c.block_m >= DOT_MIN):
            raise ValueError(f"fp8_matmul: PrefillConfig.block_m={c.block_m} must be a power of two >= 16")
        if not (is_pow2(c.block_n) and DOT_MIN <= c.block_n <= BLOCK):
            raise ValueError(f"fp8_matmul: PrefillConfig.block_n={c.block_n} must be a power of two in [16, 128]")
        if c.split_k < 1:
            raise ValueError(f"fp8_matmul: PrefillConfig.split_k={c.split_k} must be >= 1")
    else:
        raise ValueError(f"fp8_matmul: config must be a DecodeConfig or PrefillConfig, got {type(config).__name__}")
    if config.num_warps < 1 or config.num_stages < 1:
        raise ValueError(f"fp8_matmul: bad config {config}: num_warps and num_stages must be >= 1")
