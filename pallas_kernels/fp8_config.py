"""Tile configurations of the FP8 block matmul kernels (fp8_kernels.py, launched by fp8_matmul.py), their
limits, and the heuristics that choose one per launch of M rows, O output rows (summed over the weights
of a shared launch) and I input features.

Up to DECODE_MAX_ROWS rows stream W on the decode grid (DecodeConfig), more rows run the GEMM
(PrefillConfig). Every choice below was measured on the H200 at the Qwen3.5-27B shapes (figures in
WORKSPACE.md); each keeps its one-line reason here.
"""

from __future__ import annotations

import dataclasses

BLOCK = 128  # the scale block: 128 x 128 weights share one scale; both kernels walk I in chunks of it
DOT_MIN = 16  # smallest M / N / K of a Triton dot
SM_COUNT = 132  # H200 streaming multiprocessors: the split-K heuristics' occupancy target
# The decode kernel's row limit ([64, BM <= 128] f32 accumulator) and the dispatch's: on the decode grid
# each weight chunk converts to f16 once for all rows, where the GEMM converts it once per 64 rows.
DECODE_MAX_ROWS = 128
# From 9 rows bf16 x enters as one scaled f16 piece per row: two pieces per row no longer fit the
# 16-row dot, and one piece halves the dot work (below, two pieces per row cost nothing extra).
X_F16_SCALED_MIN_ROWS = DOT_MIN // 2 + 1
# Programs per SM the few-row split-K aims for: wide launches stream at 2 (8 chunks per program and
# more), narrow ones (o_proj / out_proj, mlp_down) are latency-bound and want 4 (split-K 8 on the 27B).
WIDE_PROGRAMS_PER_SM = 2
NARROW_PROGRAMS_PER_SM = 4
NARROW_NUM_STAGES = 3  # narrow launches' programs are short: fewer loads in the prologue (3 beat 4 and 2)
# 33-128 rows (a batched verify of 9-32 slots at K=3): 3 stages (a stage holds the weight chunk and the
# x slice: 3 fit at 64 rows, and 3 beat 2 and 4 at 128), split-K 8 where each run keeps >= 16 chunks.
VERIFY_MIN_ROWS = 33
VERIFY_STAGES = 3
# At 33-64 rows a wide launch on 128-row tiles runs 128-row programs (8 warps): half the x slices read
# from L2 per weight byte. Narrow launches, joined 64-row tiles and 65-128 rows measured slower with them.
VERIFY_WIDE_BLOCK_O = 128
VERIFY_WIDE_MAX_ROWS = 64
# The GEMM splits I until its grid has this many programs: a batched verify's few output tiles on a
# narrow weight would otherwise leave most SMs idle (o_proj: 40 tiles on 132 SMs).
GEMM_SPLIT_PROGRAMS = SM_COUNT


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Few-row (decode / verify) tile config. block_o: W rows per program (a power of two in [16, 128]);
    split_k: programs along I, each summing a contiguous run of 128-column chunks (f32 partials summed
    by XLA in a fixed order); swap_ab: dot(W, x^T) (W on the dot's M side) instead of dot(x, W^T);
    num_warps / num_stages: Triton launch parameters (stages pipeline the chunk loop's loads);
    scale_preload: load the program's run of block scales as one vector before the loop instead of one
    scalar load per chunk (a load the pipeliner does not prefetch); x_f16 (bf16 x): x enters as two f16
    pieces per row, x = 2^16 hi + lo (`fp8_kernels._f16_pieces`), so each weight chunk converts E4M3 ->
    f16 (one instruction per two weights) instead of -> bf16 (about three per weight); x_f16_scaled (with
    x_f16): one f16 piece per row scaled by a power of two (`fp8_kernels._f16_scaled`), M dot rows
    instead of 2M; exact for every value within 2^32 of its row's largest."""

    block_o: int = 64
    split_k: int = 1
    swap_ab: bool = True
    num_warps: int = 4
    num_stages: int = 4
    scale_preload: bool = False
    x_f16: bool = False
    x_f16_scaled: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Many-row GEMM tile config: block_m x block_n output tiles (powers of two, block_m >= 16,
    16 <= block_n <= 128 so a tile has one scale row), K chunk = 128 (one scale column); split_k:
    programs along I per output tile, each summing a contiguous run of chunks into f32 partials
    [split_k, M, O] that XLA sums in a fixed order (1: each program writes its tile, rounded, itself);
    x_f16_scaled (bf16 x): one f16 piece per row scaled by a power of two, so each weight chunk converts
    E4M3 -> f16 instead of -> bf16 (the GEMM is conversion-bound at a verify's rows)."""

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
    """(chunks per program, programs) when n_chunks are split into at most `splits` contiguous runs of
    equal length: fewer programs where a run would be left empty (48 chunks in 8 -> 6 each, 8; 12 in
    8 -> 2 each, 6)."""
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
    """A launch of O output rows is wide when its 64-row blocks alone fill the SMs (gate + up, q + k + v,
    in_proj in the 27B step); narrow ones (o_proj / out_proj, mlp_down) need split-K to fill them."""
    return cdiv(o, 64) >= SM_COUNT


def decode_config(m: int, o: int, i: int, tile_rows: int | None = None) -> DecodeConfig:
    """The decode grid's config for M <= DECODE_MAX_ROWS rows. bf16 x takes two f16 pieces per row at
    1-8 rows, one scaled piece from 9. 1-16 rows: 64-row programs with x on the dot's M side (its
    rows fit the dot's 16), preloaded scales, split-K doubled (up to 8, runs of >= 4 chunks) until the
    grid has WIDE / NARROW_PROGRAMS_PER_SM programs per SM, at least 2 from 16 chunks; narrow launches
    NARROW_NUM_STAGES. 17-128 rows (a batched verify): W on the dot's M side, split-K 4 (runs of >= 4
    chunks); from VERIFY_MIN_ROWS VERIFY_STAGES and split-K 8 where runs keep >= 16 chunks, and at up to
    VERIFY_WIDE_MAX_ROWS a wide launch on tiles of a multiple of VERIFY_WIDE_BLOCK_O rows (tile_rows;
    None: the checkpoint layout) runs programs of that many rows."""
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
    """The decode config of E4M3 activations (fp8_matmul's act_quant): decode_config's tiles with W on the
    dot's M side (Triton's FP8 wgmma needs 64 rows per warpgroup there), x taken as it is (no f16
    pieces) and the 4 stages those tiles were measured with."""
    return dataclasses.replace(decode_config(m, o, i), swap_ab=True, x_f16=False, x_f16_scaled=False, num_stages=4)


def prefill_config(m: int, o: int, i: int) -> PrefillConfig:
    """The GEMM's tiles: 32 x 128 (4 warps) up to 32 rows, 64 x 128 (4 warps) up to 256 (32 x 128 with 4
    stages measured slower at a verify's rows), 128 x 128 (8 warps) above, 3 stages; split_k (a power of
    two, runs of >= 4 chunks) while the grid has fewer than GEMM_SPLIT_PROGRAMS programs; bf16 x as one
    scaled f16 piece per row."""
    block_m, warps = (32, 4) if m <= 32 else (64, 4) if m <= 256 else (128, 8)
    tiles, n_chunks = cdiv(m, block_m) * cdiv(o, BLOCK), cdiv(i, BLOCK)
    split = 1
    while tiles * split < GEMM_SPLIT_PROGRAMS and n_chunks >= 8 * split:
        split *= 2
    return PrefillConfig(block_m=block_m, block_n=BLOCK, num_warps=warps, num_stages=3, split_k=split,
                         x_f16_scaled=True)


def default_config(m: int, o: int, i: int, tile_rows: int | None = None) -> DecodeConfig | PrefillConfig:
    """The decode grid up to DECODE_MAX_ROWS rows, the GEMM above; tile_rows as decode_config's."""
    if m <= DECODE_MAX_ROWS:
        return decode_config(m, o, i, tile_rows=tile_rows)
    return prefill_config(m, o, i)
