"""Fast, deterministic random weights for real-shape synthetic checkpoints.

A splitmix64 counter hash of (key, element index) picks 16-bit indices into a normal quantile table,
so any slice of a huge tensor can be drawn independently (in row blocks, in threads) and identically
on every machine, without drawing float64 normals for ~27 G parameters. `HashedNormal` is the lazy
tensor the checkpoint writer streams; FP8 variants draw E4M3 codes with per-block scales directly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from qmtp.model.fp8 import FP8_BLOCK, FP8_DTYPE, Fp8Block, scale_grid

# --------------------------------------------------------------------------------------------------
# fast draws: splitmix64 counter hash -> 16-bit index -> quantile table
# --------------------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_BLOCK_SALT = 0x5851F42D4C957F2D  # separates the per-block stream from the per-element one
_CHUNK = 1 << 20  # elements per work item (a multiple of 4: four 16-bit words per uint64)
FAST_CODE_STD = 64.0  # std of the E4M3 codes; table max ~4.2 sigma = 267 < 448
_SCALE_FACTORS = np.array([0.85, 0.95, 1.05, 1.15])  # per-block scale variation (rms ~1.0)


def _round_significant(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 array: x rounded to `bits` significant bits."""
    mantissa, exponent = np.frexp(np.asarray(x, np.float64))  # mantissa in [0.5, 1)
    return np.ldexp(np.round(mantissa * 2.0 ** bits) / 2.0 ** bits, exponent).astype(np.float32)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """In-place splitmix64 finalizer over a uint64 array (wrapping arithmetic)."""
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def _hash_words(start: int, count: int, key: int) -> np.ndarray:
    """[count] uint64: splitmix64(key + i * golden) for i in [start, start + count)."""
    z = np.arange(start, start + count, dtype=np.uint64)
    z *= _GOLDEN
    z += np.uint64(key)
    return _splitmix64(z)


@functools.lru_cache(maxsize=1)
def _unit_normal_table() -> np.ndarray:
    """[65536] float64: N(0,1) quantiles at (k + 0.5) / 65536, exactly antisymmetric."""
    nd = statistics.NormalDist()
    upper = np.array([nd.inv_cdf((k + 0.5) / 65536) for k in range(32768, 65536)])
    return np.concatenate([-upper[::-1], upper])


def _fill_from_table(table: np.ndarray, start: int, count: int, key: int) -> np.ndarray:
    """[count] array of table.dtype: element k (k in [start, start + count)) of the stream of `key`
    is table[16-bit word k of the hash words], i.e. lane k % 4 of word k // 4 (little-endian)."""
    out = np.empty(count, table.dtype)
    first = start - start % 4  # streams are cut at word boundaries

    def work(lo: int) -> None:  # absolute element range [lo, hi) of the stream, lo % 4 == 0
        hi = min(start + count, lo + _CHUNK)
        words = _hash_words(lo // 4, (hi - lo + 3) // 4, key).astype("<u8", copy=False)
        lanes = words.view("<u2")[max(start - lo, 0): hi - lo]
        out[max(lo - start, 0): hi - start] = table[lanes]

    starts = range(first, start + count, _CHUNK)
    if len(starts) <= 2:
        for lo in starts:
            work(lo)
    else:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            list(pool.map(work, starts))
    return out


@functools.lru_cache(maxsize=64)
def _table(std: float, fp8: bool) -> np.ndarray:
    """[65536] N(0, std) quantiles as E4M3 codes (uint8) or bf16 bits (uint16)."""
    if fp8:
        return (_unit_normal_table() * std).astype(FP8_DTYPE).view(np.uint8)
    return (_unit_normal_table() * std).astype(ml_dtypes.bfloat16).view(np.uint16)


@dataclasses.dataclass(frozen=True)
class HashedNormal:
    """A lazily drawn 2-D N(0, std) tensor of the fast path; any row range can be drawn on its own.

    fp8=False: bfloat16 values. fp8=True: an FP8 block weight, E4M3 codes ~ E4M3(N(0, 64)) with one
    code per [block, block] tile (at a hashed position inside its valid, possibly ragged, part) set
    to +-448, so `quantize_np(dequantize_np(codes, scale))` gives back (codes, scale) exactly, and
    scale[b] = std/64 * f_b (f_b in {0.85, 0.95, 1.05, 1.15} hashed per block) rounded to 4
    significant bits, so code * scale (<= 8 significant bits) is exact in bf16.
    Rows >= live_rows (if set) are zero (vocabulary padding of lm_head).
    """

    shape: tuple[int, int]
    std: float
    key: int
    fp8: bool = False
    live_rows: int | None = None

    def __post_init__(self):
        if self.fp8 and self.live_rows is not None:
            raise ValueError("HashedNormal: zero padding rows (live_rows) are for bf16 tensors only")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(FP8_DTYPE if self.fp8 else ml_dtypes.bfloat16)

    @property
    def zero_from(self) -> int:
        """First row that is all zeros (the row count when none is)."""
        return self.shape[0] if self.live_rows is None else min(self.live_rows, self.shape[0])

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) in `self.dtype` (E4M3 codes with their +-448 markers, or bf16)."""
        o, i = self.shape
        out = np.zeros((hi - lo, i), np.uint8 if self.fp8 else np.uint16)
        live_hi = min(hi, self.zero_from)
        if live_hi > lo:
            table = _table(FAST_CODE_STD if self.fp8 else self.std, self.fp8)
            out[: live_hi - lo] = _fill_from_table(table, lo * i, (live_hi - lo) * i, self.key).reshape(-1, i)
        if self.fp8:
            r, c, code, _ = self._blocks()
            sel = (r >= lo) & (r < hi)
            out[r[sel] - lo, c[sel]] = code[sel]
        return out.view(self.dtype)

    @property
    def scale(self) -> np.ndarray:
        """[ceil(O/128), ceil(I/128)] float32 block scales (fp8 only)."""
        return self._blocks()[3]

    def materialize(self) -> np.ndarray | Fp8Block:
        """The whole tensor: a bf16 array, or an `Fp8Block` of codes and scales."""
        codes = self.rows(0, self.shape[0])
        return Fp8Block(weight=codes, scale=self.scale) if self.fp8 else codes

    def _blocks(self, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per block (flattened [Go*Gi]): row, column and uint8 code of its +-448 marker; scale [Go, Gi]."""
        o, i = self.shape
        go, gi = scale_grid(o, i, block)
        bits = _hash_words(0, go * gi, self.key ^ _BLOCK_SALT).reshape(go, gi)  # [Go, Gi] per-block randomness
        bo, bi = np.meshgrid(np.arange(go), np.arange(gi), indexing="ij")  # [Go, Gi] block coordinates
        heights = np.minimum(block, o - bo * block).astype(np.uint64)  # valid rows of each (ragged) block
        widths = np.minimum(block, i - bi * block).astype(np.uint64)
        rows = bo * block + ((bits & np.uint64(0xFFFF)) % heights).astype(np.int64)
        cols = bi * block + (((bits >> np.uint64(16)) & np.uint64(0xFFFF)) % widths).astype(np.int64)
        negative = ((bits >> np.uint64(32)) & np.uint64(1)).astype(np.uint8)
        codes = np.uint8(0x7E) | (negative << np.uint8(7))  # E4M3 +-448
        factor = _SCALE_FACTORS[((bits >> np.uint64(40)) & np.uint64(3)).astype(np.int64)]
        scale = _round_significant(self.std / FAST_CODE_STD * factor, 4)  # [Go, Gi] float32
        return rows.ravel(), cols.ravel(), codes.ravel(), scale


WeightValue = np.ndarray | Fp8Block | HashedNormal  # float array (bf16-exact values), FP8 block, or lazy


def fast_bf16_normal(shape: tuple[int, int], std: float, key: int) -> np.ndarray:
    """bfloat16 [O, I], entries N(0, std) quantiles drawn by hashing (see `HashedNormal`)."""
    return HashedNormal(tuple(shape), std, key).materialize()


def fast_fp8_normal(shape: tuple[int, int], std: float, key: int) -> Fp8Block:
    """Block-FP8 [O, I] whose dequantized value is ~N(0, std) (see `HashedNormal`)."""
    return HashedNormal(tuple(shape), std, key, fp8=True).materialize()
