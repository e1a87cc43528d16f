"""The weights of the synthetic checkpoint presets (qmtp.tools.presets): random draws and controlled acceptance.

A generator is called with the table entry only (so the bf16 / fp8 / fp32 checkpoints of one preset and seed
are twins) and returns a float array of bf16-exact values or a lazy `HashedNormal`; each tensor has its own
stream keyed by (seed, tensor name), so a `--num_layers` slice shares the full model's weights.
`RandomWeights`: linear [out, in] and lm_head N(0, 1/sqrt(in)); embed_tokens N(0, 1); norms N(0, 0.1)
(linear_attn.norm 1 + N(0, 0.1)); A_log = log U(1, 16); dt_bias N(0, 0.5); conv1d N(0, 0.3); lm_head rows
of vocab padding zero. Exact draws (tiny presets): PCG64 float32 normals rounded to bf16. Fast draws (real
shapes): a splitmix64 hash of (key, element index) indexes a table of N(0, 1) quantiles in the stored format,
so any row block is drawn on its own, in threads, identically on every machine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from qmtp.model import params
from qmtp.model.config import ModelConfig
from qmtp.model.fp8 import FP8_BLOCK, FP8_DTYPE, Fp8Block, scale_grid
from qmtp.tools import tiny_tokenizer

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_BLOCK_SALT = 0x5851F42D4C957F2D  # separates the per-block stream from the per-element one
_CHUNK = 1 << 20  # elements per work item (a multiple of 4: four 16-bit words per uint64)
FAST_CODE_STD = 64.0  # std of the E4M3 codes; table max ~4.2 sigma = 267 < 448
_SCALE_FACTORS = np.array([0.85, 0.95, 1.05, 1.15])  # per-block scale variation (rms ~1.0)


def _hash_words(start: int, count: int, key: int) -> np.ndarray:
    """[count] uint64: splitmix64(key + i * golden) for i in [start, start + count) (wrapping arithmetic)."""
    z = np.arange(start, start + count, dtype=np.uint64)
    z *= _GOLDEN
    z += np.uint64(key)
    for shift, mix in ((30, _MIX1), (27, _MIX2)):
        z ^= z >> np.uint64(shift)
        z *= mix
    z ^= z >> np.uint64(31)
    return z


@functools.lru_cache(maxsize=64)
def _table(std: float, fp8: bool) -> np.ndarray:
    """[65536] N(0, std) quantiles at (k + 0.5) / 65536 (exactly antisymmetric) as E4M3 codes or bf16 bits."""
    upper = np.array([statistics.NormalDist().inv_cdf((k + 0.5) / 65536) for k in range(32768, 65536)])
    values = np.concatenate([-upper[::-1], upper]) * std
    return values.astype(FP8_DTYPE if fp8 else ml_dtypes.bfloat16).view(np.uint8 if fp8 else np.uint16)


def _fill_from_table(table: np.ndarray, start: int, count: int, key: int) -> np.ndarray:
    """[count] of table.dtype: element k of the stream of `key` (k in [start, start + count)) is
    table[16-bit lane k % 4 of hash word k // 4] (little-endian)."""
    out = np.empty(count, table.dtype)

    def work(lo: int) -> None:  # absolute element range [lo, hi) of the stream, lo % 4 == 0
        hi = min(start + count, lo + _CHUNK)
        words = _hash_words(lo // 4, (hi - lo + 3) // 4, key).astype("<u8", copy=False)
        out[max(lo - start, 0): hi - start] = table[words.view("<u2")[max(start - lo, 0): hi - lo]]

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # streams cut at word boundaries
        list(pool.map(work, range(start - start % 4, start + count, _CHUNK)))
    return out


@dataclasses.dataclass(frozen=True)
class HashedNormal:
    """A lazily drawn 2-D N(0, std) tensor; any row range can be drawn on its own. fp8=False: bfloat16.
    fp8=True: E4M3 codes ~ E4M3(N(0, 64)), one per [128, 128] block (hashed position) set to +-448 so that
    quantize_np(dequantize_np(codes, scale)) gives them back; scale = std/64 * {0.85, 0.95, 1.05, 1.15}
    (hashed per block) rounded to 4 significant bits, so code * scale is exact in bf16. Rows >= live_rows
    (if set) are zero (vocabulary padding)."""

    shape: tuple[int, int]
    std: float
    key: int
    fp8: bool = False
    live_rows: int | None = None

    def __post_init__(self):
        if self.fp8 and self.live_rows is not None:
            raise ValueError("HashedNormal: zero padding rows (live_rows) are for bf16 tensors only")

    @property
    def zero_from(self) -> int:
        """First row that is all zeros (the row count when none is)."""
        return self.shape[0] if self.live_rows is None else min(self.live_rows, self.shape[0])

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi): E4M3 codes with their +-448 markers, or bf16."""
        i = self.shape[1]
        out = np.zeros((hi - lo, i), np.uint8 if self.fp8 else np.uint16)
        live_hi = min(hi, self.zero_from)
        if live_hi > lo:
            table = _table(FAST_CODE_STD if self.fp8 else self.std, self.fp8)
            out[: live_hi - lo] = _fill_from_table(table, lo * i, (live_hi - lo) * i, self.key).reshape(-1, i)
        if self.fp8:
            r, c, code, _ = self._blocks()
            sel = (r >= lo) & (r < hi)
            out[r[sel] - lo, c[sel]] = code[sel]
        return out.view(FP8_DTYPE if self.fp8 else ml_dtypes.bfloat16)

    @property
    def scale(self) -> np.ndarray:
        """[ceil(O/128), ceil(I/128)] float32 block scales (fp8 only)."""
        return self._blocks()[3]

    def materialize(self) -> np.ndarray | Fp8Block:
        """The whole tensor: a bf16 array, or an `Fp8Block` of codes and scales."""
        codes = self.rows(0, self.shape[0])
        return Fp8Block(weight=codes, scale=self.scale) if self.fp8 else codes

    def _blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per block (flattened [Go*Gi]): row, column and uint8 code of its +-448 marker; scale [Go, Gi]."""
        (o, i), block = self.shape, FP8_BLOCK
        go, gi = scale_grid(o, i, block)
        bits = _hash_words(0, go * gi, self.key ^ _BLOCK_SALT).reshape(go, gi)  # per-block randomness
        bo, bi = np.meshgrid(np.arange(go), np.arange(gi), indexing="ij")  # [Go, Gi] block coordinates
        heights = np.minimum(block, o - bo * block).astype(np.uint64)  # valid rows of each (ragged) block
        widths = np.minimum(block, i - bi * block).astype(np.uint64)
        rows = bo * block + ((bits & np.uint64(0xFFFF)) % heights).astype(np.int64)
        cols = bi * block + (((bits >> np.uint64(16)) & np.uint64(0xFFFF)) % widths).astype(np.int64)
        negative = ((bits >> np.uint64(32)) & np.uint64(1)).astype(np.uint8)
        codes = np.uint8(0x7E) | (negative << np.uint8(7))  # E4M3 +-448
        factor = _SCALE_FACTORS[((bits >> np.uint64(40)) & np.uint64(3)).astype(np.int64)]
        mantissa, exponent = np.frexp(self.std / FAST_CODE_STD * factor)  # rounded to 4 significant bits
        scale = np.ldexp(np.round(mantissa * 16.0) / 16.0, exponent).astype(np.float32)
        return rows.ravel(), cols.ravel(), codes.ravel(), scale


WeightValue = np.ndarray | HashedNormal  # float array of bf16-exact values, or lazy


def fast_fp8_normal(shape: tuple[int, int], std: float, key: int) -> Fp8Block:
    """Block-FP8 [O, I] whose dequantized value is ~N(0, std) (see `HashedNormal`)."""
    return HashedNormal(tuple(shape), std, key, fp8=True).materialize()


@dataclasses.dataclass(frozen=True, eq=False)
class PinnedRows(HashedNormal):
    """A bf16 `HashedNormal` whose rows [0, n) are `head` (bfloat16 [n <= zero_from, I]), not drawn."""

    head: np.ndarray | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.fp8:
            raise ValueError("PinnedRows: bf16 tensors only")
        if (self.head is None or self.head.ndim != 2 or self.head.shape[1] != self.shape[1]
                or self.head.shape[0] > self.zero_from or self.head.dtype != ml_dtypes.bfloat16):
            raise ValueError(f"PinnedRows: head must be bfloat16 [n <= {self.zero_from}, {self.shape[1]}]")

    def rows(self, lo: int, hi: int) -> np.ndarray:
        out = super().rows(lo, hi)
        pinned = self.head[lo:hi]  # empty from row n on
        out[: len(pinned)] = pinned
        return out


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 array with every value rounded to the nearest bf16."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class RandomWeights:
    """`weights(entry, fp8_eligible) -> value` for every checkpoint tensor, by role (module doc). With
    `fp8_eligible` (an FP8 checkpoint stores it quantized) the fast path draws a lazy FP8 `HashedNormal`,
    whose dequantized value the bf16 / fp32 twins store. Presets that pin tensors override `__call__`."""

    def __init__(self, cfg: ModelConfig, seed: int, *, fast: bool, live_vocab: int):
        self.cfg, self.seed, self.fast, self.live_vocab = cfg, seed, fast, live_vocab

    @classmethod
    def synthetic_metadata(cls, live_vocab: int, seed: int) -> dict:
        """Extra keys of config.json's `qmtp_synthetic` block."""
        return {}

    def __call__(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        role, key, shape = entry.role, entry.key, entry.shape
        if role == params.EMBED and key == "lm_head":
            return self._lm_head(entry, fp8_eligible)
        if role == params.EMBED:
            return self._matrix(entry.name, shape, 1.0, fp8_eligible)
        if role in (params.LINEAR, params.FUSED_QKVZ, params.FUSED_BA, params.EXPERTS):
            return self._matrix(entry.name, shape, 1.0 / math.sqrt(shape[1]), fp8_eligible)
        rng = self.rng(entry.name)
        if role == params.NORM:
            offset = 1.0 if key == "gdn_norm" else 0.0  # linear_attn.norm is applied as w, the rest as 1 + w
            return _round_bf16(offset + 0.1 * rng.standard_normal(shape, np.float32))
        if role == params.CONV:
            return _round_bf16(0.3 * rng.standard_normal(shape, np.float32))
        if role == params.FP32 and key == "A_log":
            return _round_bf16(np.log(rng.uniform(1.0, 16.0, shape)))
        if role == params.FP32 and key == "dt_bias":
            return _round_bf16(0.5 * rng.standard_normal(shape, np.float32))
        raise ValueError(f"{entry.name}: no synthetic initializer for role {role!r} / key {key!r}")

    def _digest(self, name: str) -> tuple[int, int]:
        """(PCG64 seed of the exact draws, 64-bit key of the fast stream) of one tensor."""
        d = hashlib.sha256(f"qmtp-synthetic/{self.seed}/{name}".encode()).digest()
        return int.from_bytes(d[:16], "little"), int.from_bytes(d[16:24], "little")

    def rng(self, name: str) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self._digest(name)[0])))

    def _matrix(self, name: str, shape: tuple[int, int], std: float, fp8_eligible: bool,
                live_rows: int | None = None) -> WeightValue:
        """A 2-D N(0, std) tensor (rows >= live_rows zero): exact normals, or a lazy `HashedNormal`."""
        if self.fast:
            return HashedNormal(shape, std, self._digest(name)[1], fp8=fp8_eligible, live_rows=live_rows)
        live = shape[0] if live_rows is None else min(live_rows, shape[0])
        out = np.zeros(shape, np.float32)
        out[:live] = _round_bf16(std * self.rng(name).standard_normal((live, shape[1]), np.float32))
        return out

    def _lm_head(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        """[V, E] ~ N(0, 1/sqrt(E)) with rows >= live_vocab (padding ids) zero."""
        std = 1.0 / math.sqrt(entry.shape[1])
        return self._matrix(entry.name, entry.shape, std, fp8_eligible, live_rows=self.live_vocab)


@functools.lru_cache(maxsize=16)
def seeded_permutation(live_vocab: int, seed: int) -> np.ndarray:
    """Read-only [live_vocab] int64 pi of the controlled presets: one hashed cycle through the regular ids
    and one through the special tokens (pure uint64 hashing of (seed, group), independent of numpy's RNGs)."""
    specials = sorted(tiny_tokenizer.special_token_ids(live_vocab).values())
    regular = np.setdiff1d(np.arange(live_vocab), specials)
    if len(regular) < 2:
        raise ValueError(f"live vocab {live_vocab}: too small for a controlled permutation")
    pi = np.full(live_vocab, -1, np.int64)
    for group, tag in ((regular, "regular"), (np.asarray(specials), "special")):
        digest = hashlib.sha256(f"qmtp-controlled-permutation/{seed}/{tag}".encode()).digest()
        order = group[np.argsort(_hash_words(0, len(group), int.from_bytes(digest[:8], "little")), kind="stable")]
        pi[order] = np.roll(order, -1)  # each id maps to its successor in the hashed cyclic order
    assert sorted(pi.tolist()) == list(range(live_vocab)) and not np.any(pi == np.arange(live_vocab))
    pi.setflags(write=False)
    return pi


class ControlledWeights(RandomWeights):
    """Weights whose greedy behaviour is known: the target maps input token x to pi[x] in any context and the
    MTP head drafts pi[token] (acceptance 100%); pi (`seeded_permutation`) has no fixed point (an MTP that
    reproduces its input token is always wrong). E = hidden size, emb_x = embed_tokens row x:
      * embed_tokens rows of live ids: their random draw rescaled to norm sqrt(E);
      * lm_head row pi[x] = (LOGIT_SCALE / E) * emb_x for live x, padding rows zero;
      * o_proj, out_proj and mlp.down_proj ~ N(0, OUTPUT_SCALE / sqrt(in)), so the residual stream stays
        dominated by emb_{x_p} and the logits peak at pi[x_p];
      * mtp.fc = [I + N(0, FC_NOISE / sqrt(E)) | N(0, FC_NOISE / sqrt(E))]: the identity acts on the normed
        embedding (MODEL_SPEC §4.1), so the MTP drafts pi[x_{p+1}]; swapped halves would give x_{p+1}.
    """

    LOGIT_SCALE = 32.0  # logit of the followed token when the hidden lies exactly along its embedding
    OUTPUT_SCALE = 0.1  # std multiplier (x 1/sqrt(in)) of o_proj, out_proj and mlp.down_proj
    FC_NOISE = 0.1  # std multiplier (x 1/sqrt(E)) of the random parts of mtp.fc

    def __init__(self, cfg: ModelConfig, seed: int, *, fast: bool, live_vocab: int):
        super().__init__(cfg, seed, fast=fast, live_vocab=live_vocab)
        if cfg.tie_word_embeddings:
            raise ValueError("controlled weights need an untied lm_head (tie_word_embeddings=false)")
        if not 0 < live_vocab <= cfg.vocab_size:
            raise ValueError(f"live vocab {live_vocab} outside [1, vocab_size={cfg.vocab_size}]")
        self.permutation = seeded_permutation(live_vocab, seed)

    @classmethod
    def synthetic_metadata(cls, live_vocab: int, seed: int) -> dict:
        return {"note": "controlled acceptance weights: target greedy next token after x is "
                        "controlled.permutation[x] for any context, the MTP head drafts the same; text only",
                "controlled": {"permutation": seeded_permutation(live_vocab, seed).tolist(), "permutation_seed": seed,
                               "logit_scale": cls.LOGIT_SCALE, "output_scale": cls.OUTPUT_SCALE,
                               "mtp_fc_noise": cls.FC_NOISE}}

    def __call__(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        role, key = entry.role, entry.key
        if role == params.EMBED and key == "embed":
            return self._pinned(entry.name, entry.shape, 1.0, self.live_embedding)
        if entry.group == "mtp" and key == "fc":
            return self._mtp_fc(entry)
        if role in (params.LINEAR, params.EXPERTS) and key in ("o_proj", "out_proj", "mlp_down", "shared_mlp_down",
                                                              "experts_down"):
            return self._matrix(entry.name, entry.shape, self.OUTPUT_SCALE / math.sqrt(entry.shape[1]), fp8_eligible)
        return super().__call__(entry, fp8_eligible)  # lm_head: this class's `_lm_head`

    @functools.cached_property
    def live_embedding(self) -> np.ndarray:
        """[live_vocab, E] float32 (bf16-exact): embed_tokens rows of the live ids, norm ~sqrt(E)."""
        e = self.cfg.hidden_size
        drawn = self._matrix(self.cfg.weight_prefix + "embed_tokens.weight", (self.cfg.vocab_size, e), 1.0, False)
        raw = drawn.rows(0, self.live_vocab) if isinstance(drawn, HashedNormal) else drawn[: self.live_vocab]
        raw = np.asarray(raw, np.float64)
        return _round_bf16(raw * (math.sqrt(e) / np.linalg.norm(raw, axis=1, keepdims=True)))

    def _pinned(self, name: str, shape: tuple[int, int], std: float, head: np.ndarray,
                live_rows: int | None = None) -> WeightValue:
        """`_matrix(name, shape, std)` (bf16) with rows [0, len(head)) set to `head` (float32, bf16-exact)."""
        if self.fast:
            key, head = self._digest(name)[1], head.astype(ml_dtypes.bfloat16)
            return PinnedRows(shape, std, key, live_rows=live_rows, head=head)
        out = self._matrix(name, shape, std, False, live_rows)
        out[: len(head)] = head
        return out

    def _lm_head(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        e = entry.shape[1]
        head = np.zeros((self.live_vocab, e), np.float32)
        head[self.permutation] = _round_bf16(self.LOGIT_SCALE / e * self.live_embedding.astype(np.float64))
        return self._pinned(entry.name, entry.shape, 1.0 / math.sqrt(e), head, live_rows=self.live_vocab)

    def _mtp_fc(self, entry: params.TensorEntry) -> np.ndarray:
        e = self.cfg.hidden_size
        if entry.shape != (e, 2 * e):
            raise ValueError(f"{entry.name}: shape {list(entry.shape)}, expected [{e}, {2 * e}]")
        drawn = self._matrix(entry.name, entry.shape, self.FC_NOISE / math.sqrt(e), False)
        w = np.asarray(drawn.materialize() if isinstance(drawn, HashedNormal) else drawn, np.float32)
        w[np.arange(e), np.arange(e)] += 1.0  # identity on the normed embedding (input columns [0, E))
        return _round_bf16(w)
