"""The weight generators of the synthetic checkpoint presets (qmtp.tools.presets): the random
weights every preset starts from and the controlled-acceptance construction.

Weight convention, shared by every preset (this is what makes the bf16 / fp8 / fp32 checkpoints of
one preset and seed twins):
  * The generator is called with the table entry only; its value never depends on the storage dtype.
  * A value is a float array whose entries are all exactly representable in bf16 (so bf16 and fp32
    storage hold the same numbers and an FP8 checkpoint stores `qmtp.model.fp8.quantize_np` of them), or
    an `Fp8Block` (E4M3 codes + f32 block scales) for a tensor that an FP8 checkpoint stores
    quantized, whose float value `qmtp.model.fp8.dequantize_np(...)` is bf16-exact and quantizes back to
    the same codes and scales, or a `HashedNormal`: either of the two, drawn lazily row block by row
    block (the writer streams it without materializing the whole tensor).
  * Each tensor is drawn from its own stream, keyed by (seed, tensor name): a `--num_layers` slice
    has the same layer-0 weights as the full model, and order of generation does not matter.

Distributions (`RandomWeights`): linear [out, in] ~ N(0, 1/sqrt(in)) (lm_head too: logits O(1));
embed_tokens N(0, 1); zero-centred norms N(0, 0.1); linear_attn.norm 1 + N(0, 0.1); A_log = log U(1, 16);
dt_bias N(0, 0.5); conv1d N(0, 0.3). lm_head rows of ids >= the tokenizer's size (vocab padding of
real-shape presets) are zero, so greedy argmax stays inside the tokenizer.

Two ways to draw the big matrices:
  * exact (tiny): float32 normals from a seeded PCG64 `np.random.Generator`, rounded to bf16.
  * fast (real shapes, ~27 G values; `HashedNormal`): counter-based splitmix64 hashing of the
    element index (pure uint64 arithmetic, independent of the numpy version) gives 16-bit words
    that index a 65536-entry table of N(0, 1) quantiles (Python's statistics.NormalDist), already
    in the target format (bf16 bits, or E4M3 codes of N(0, 64) for FP8-eligible weights, with
    per-block scales ~ std/64 varying +-15%). Several threads fill disjoint chunks; no float64
    normals are drawn.

Presets that pin tensors down subclass `RandomWeights`, override `__call__` for those tensors
(delegating the rest to `super().__call__`), and name the subclass in their `Preset(weights_cls=...)`.

"Controlled acceptance" presets (`tiny_controlled`, `qwen3_5_27b_controlled`; `ControlledWeights`):
the target's greedy next token after input token x is `controlled_permutation(preset, seed)[x]` for
any context, and the MTP head drafts the same, so natural MTP acceptance is 100% (construction in the
`ControlledWeights` doc). Every other tensor keeps its random draw; only the residual-branch output
projections are scaled down.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import ml_dtypes
import numpy as np

from qmtp.model import params
from qmtp.model.config import ModelConfig
from qmtp.tools import tiny_tokenizer
from qmtp.tools.fast_random import _hash_words, HashedNormal, WeightValue

# --------------------------------------------------------------------------------------------------
# the default random weights
# --------------------------------------------------------------------------------------------------


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 array with every value rounded to the nearest bf16."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class RandomWeights:
    """name -> value for every checkpoint tensor, by role (distributions in the module doc).

    `weights(entry, fp8_eligible)`: `fp8_eligible` says whether an FP8 checkpoint stores this tensor
    quantized (the same answer for every storage dtype); the fast path then returns a lazy FP8
    `HashedNormal`, whose dequantized value the bf16 / fp32 twins store. Exact path: float32 arrays
    of bf16-exact values. Subclass and override `__call__` to pin specific tensors.
    """

    def __init__(self, cfg: ModelConfig, seed: int, *, fast: bool, live_vocab: int):
        self.cfg, self.seed, self.fast, self.live_vocab = cfg, seed, fast, live_vocab

    @classmethod
    def synthetic_metadata(cls, live_vocab: int, seed: int) -> dict:
        """Extra keys of config.json's `qmtp_synthetic` block (none for plain random weights)."""
        return {}

    def __call__(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        role, key = entry.role, entry.key
        if role == params.EMBED and key == "lm_head":
            return self._lm_head(entry, fp8_eligible)
        if role == params.EMBED:
            return self._matrix(entry, entry.shape, 1.0, fp8_eligible)
        if role in (params.LINEAR, params.FUSED_QKVZ, params.FUSED_BA):
            return self._matrix(entry, entry.shape, 1.0 / math.sqrt(entry.shape[1]), fp8_eligible)
        rng = self.rng(entry.name)
        if role == params.NORM:
            offset = 1.0 if key == "gdn_norm" else 0.0  # linear_attn.norm is applied as w, the rest as 1 + w
            return _round_bf16(offset + 0.1 * rng.standard_normal(entry.shape, np.float32))
        if role == params.CONV:
            return _round_bf16(0.3 * rng.standard_normal(entry.shape, np.float32))
        if role == params.FP32 and key == "A_log":
            return _round_bf16(np.log(rng.uniform(1.0, 16.0, entry.shape)))
        if role == params.FP32 and key == "dt_bias":
            return _round_bf16(0.5 * rng.standard_normal(entry.shape, np.float32))
        raise ValueError(f"{entry.name}: no synthetic initializer for role {role!r} / key {key!r}")

    def rng(self, name: str) -> np.random.Generator:
        """The seeded PCG64 generator of one tensor."""
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self._digest(name)[0])))

    def hash_key(self, name: str) -> int:
        """The 64-bit key of one tensor's fast (splitmix64) stream."""
        return self._digest(name)[1]

    def _digest(self, name: str) -> tuple[int, int]:
        d = hashlib.sha256(f"qmtp-synthetic/{self.seed}/{name}".encode()).digest()
        return int.from_bytes(d[:16], "little"), int.from_bytes(d[16:24], "little")

    def _matrix(self, entry: params.TensorEntry, shape: tuple[int, int], std: float, fp8_eligible: bool,
                live_rows: int | None = None) -> WeightValue:
        """A 2-D N(0, std) tensor (rows >= live_rows zero): exact normals, or a lazy `HashedNormal`."""
        if self.fast:
            return HashedNormal(shape, std, self.hash_key(entry.name), fp8=fp8_eligible, live_rows=live_rows)
        live = shape[0] if live_rows is None else min(live_rows, shape[0])
        out = np.zeros(shape, np.float32)
        out[:live] = _round_bf16(std * self.rng(entry.name).standard_normal((live, shape[1]), np.float32))
        return out

    def _lm_head(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        """[V, E] ~ N(0, 1/sqrt(E)) with rows >= live_vocab (padding ids) zero."""
        v, e = entry.shape
        return self._matrix(entry, (v, e), 1.0 / math.sqrt(e), fp8_eligible, live_rows=self.live_vocab)


# --------------------------------------------------------------------------------------------------
# controlled acceptance
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class PinnedRows(HashedNormal):
    """A bf16 `HashedNormal` whose first rows are given instead of drawn: rows [0, n) are `head`
    (bfloat16 [n, I], n <= zero_from), the rest drawn (or zero from live_rows on) as usual."""

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
        n = self.head.shape[0]
        if lo < n:
            out[: min(hi, n) - lo] = self.head[lo: min(hi, n)]
        return out


def _hash_cycle(ids: np.ndarray, key: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids in a hashed random order, the successor of each of them in that cyclic order)."""
    order = ids[np.argsort(_hash_words(0, len(ids), key), kind="stable")]
    return order, np.roll(order, -1)


@functools.lru_cache(maxsize=16)
def seeded_permutation(live_vocab: int, seed: int) -> np.ndarray:
    """Read-only [live_vocab] int64: the controlled presets' token permutation (see
    `controlled_permutation`). Pure uint64 hashing of (seed, group): independent of numpy's RNGs."""
    specials = sorted(tiny_tokenizer.special_token_ids(live_vocab).values())
    regular = np.setdiff1d(np.arange(live_vocab), specials)
    if len(regular) < 2:
        raise ValueError(f"live vocab {live_vocab}: too small for a controlled permutation")
    pi = np.full(live_vocab, -1, np.int64)
    for group, tag in ((regular, "regular"), (np.asarray(specials), "special")):
        digest = hashlib.sha256(f"qmtp-controlled-permutation/{seed}/{tag}".encode()).digest()
        order, successor = _hash_cycle(group.astype(np.int64), int.from_bytes(digest[:8], "little"))
        pi[order] = successor
    assert sorted(pi.tolist()) == list(range(live_vocab)) and not np.any(pi == np.arange(live_vocab))
    pi.setflags(write=False)
    return pi


class ControlledWeights(RandomWeights):
    """Weights whose greedy behaviour is known: the target maps input token x to `pi[x]` whatever
    the context, and the MTP head drafts `pi[token]` (natural acceptance 100%).

    pi (`controlled_permutation`): over the tokenizer's live ids, one seeded cycle through all
    regular ids and one through the special tokens, so pi has no fixed point (pi[x] != x: a
    mis-wired MTP that reproduces its input token, or the wrong one, is always wrong), a prompt of
    regular tokens never generates a special (stop) token, and greedy text from any regular token
    runs through every regular id before repeating (period live_vocab - 3).

    Construction (E = hidden size, emb_x = embed_tokens row x):
      * embed_tokens rows of live ids: their random draw rescaled to norm sqrt(E) (rms 1); rows of
        padding ids keep their N(0, 1) draw.
      * lm_head row pi[x] = (LOGIT_SCALE / E) * emb_x for live x; rows of padding ids zero.
      * every residual branch is scaled down: o_proj, linear_attn.out_proj and mlp.down_proj (target
        and MTP layer) ~ N(0, OUTPUT_SCALE / sqrt(in)); everything else keeps the default draw
        (norm weights N(0, 0.1), all other projections N(0, 1/sqrt(in)), GDN gates / conv ...).
        The residual stream at position p stays dominated by emb_{x_p}, so the post-final-norm
        hidden h_p ~ sqrt(E) * emb_{x_p} / |emb_{x_p}| and logit[pi[y]] ~ LOGIT_SCALE * cos(h_p, emb_y):
        argmax pi[x_p], ids outside the live vocab score ~0.
      * mtp.fc = [I + N(0, FC_NOISE / sqrt(E)) | N(0, FC_NOISE / sqrt(E))]: the identity block acts
        on the normed embedding (MODEL_SPEC §4.1, embedding columns first), so the MTP output at p
        follows emb_{x_{p+1}} -> draft pi[x_{p+1}]; fed its own post-mtp.norm hidden (which follows
        its input token's embedding) and its previous draft, it keeps drafting pi[draft].
        Swapped concat halves make it follow the hidden instead (draft pi[x_p] = x_{p+1}), and the
        unshifted token x_p gives pi[x_p]: both always wrong since pi has no fixed point.
    """

    LOGIT_SCALE = 32.0  # logit of the followed token when the hidden lies exactly along its embedding
    OUTPUT_SCALE = 0.1  # std multiplier (x 1/sqrt(in)) of o_proj, out_proj and mlp.down_proj
    FC_NOISE = 0.1  # std multiplier (x 1/sqrt(E)) of the random parts of mtp.fc
    OUTPUT_KEYS = ("o_proj", "out_proj", "mlp_down")

    def __init__(self, cfg: ModelConfig, seed: int, *, fast: bool, live_vocab: int):
        super().__init__(cfg, seed, fast=fast, live_vocab=live_vocab)
        if cfg.tie_word_embeddings:
            raise ValueError("controlled weights need an untied lm_head (tie_word_embeddings=false)")
        if not 0 < live_vocab <= cfg.vocab_size:
            raise ValueError(f"live vocab {live_vocab} outside [1, vocab_size={cfg.vocab_size}]")
        self.permutation = seeded_permutation(live_vocab, seed)

    @classmethod
    def synthetic_metadata(cls, live_vocab: int, seed: int) -> dict:
        return {
            "note": "controlled acceptance weights: target greedy next token after x is "
                    "controlled.permutation[x] for any context, the MTP head drafts the same; text only",
            "controlled": {"permutation": seeded_permutation(live_vocab, seed).tolist(), "permutation_seed": seed,
                           "logit_scale": cls.LOGIT_SCALE, "output_scale": cls.OUTPUT_SCALE,
                           "mtp_fc_noise": cls.FC_NOISE},
        }

    def __call__(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        role, key = entry.role, entry.key
        if role == params.EMBED and key == "embed":
            return self._embed(entry)
        if role == params.EMBED and key == "lm_head":
            return self._lm_head(entry, fp8_eligible)
        if entry.group == "mtp" and key == "fc":
            return self._mtp_fc(entry)
        if role == params.LINEAR and key in self.OUTPUT_KEYS:
            return self._matrix(entry, entry.shape, self.OUTPUT_SCALE / math.sqrt(entry.shape[1]), fp8_eligible)
        return super().__call__(entry, fp8_eligible)

    @functools.cached_property
    def live_embedding(self) -> np.ndarray:
        """[live_vocab, E] float32 (bf16-exact): embed_tokens rows of the live ids, norm ~sqrt(E)."""
        v, e = self.cfg.vocab_size, self.cfg.hidden_size
        entry = params.TensorEntry(self.cfg.weight_prefix + "embed_tokens.weight", None, None, "embed", (v, e),
                                   params.EMBED)
        drawn = self._matrix(entry, (v, e), 1.0, False)
        raw = drawn.rows(0, self.live_vocab) if isinstance(drawn, HashedNormal) else drawn[: self.live_vocab]
        raw = np.asarray(raw, np.float64)
        return _round_bf16(raw * (math.sqrt(e) / np.linalg.norm(raw, axis=1, keepdims=True)))

    def _embed(self, entry: params.TensorEntry) -> WeightValue:
        drawn = self._matrix(entry, entry.shape, 1.0, False)
        if isinstance(drawn, HashedNormal):
            return PinnedRows(drawn.shape, drawn.std, drawn.key, head=self.live_embedding.astype(ml_dtypes.bfloat16))
        drawn[: self.live_vocab] = self.live_embedding
        return drawn

    def _lm_head(self, entry: params.TensorEntry, fp8_eligible: bool) -> WeightValue:
        v, e = entry.shape
        head = np.zeros((self.live_vocab, e), np.float32)
        head[self.permutation] = _round_bf16(self.LOGIT_SCALE / e * self.live_embedding.astype(np.float64))
        if self.fast:
            return PinnedRows((v, e), 1.0 / math.sqrt(e), self.hash_key(entry.name), live_rows=self.live_vocab,
                              head=head.astype(ml_dtypes.bfloat16))
        out = np.zeros((v, e), np.float32)
        out[: self.live_vocab] = head
        return out

    def _mtp_fc(self, entry: params.TensorEntry) -> np.ndarray:
        e = self.cfg.hidden_size
        if entry.shape != (e, 2 * e):
            raise ValueError(f"{entry.name}: shape {list(entry.shape)}, expected [{e}, {2 * e}]")
        drawn = self._matrix(entry, entry.shape, self.FC_NOISE / math.sqrt(e), False)
        w = np.asarray(drawn.materialize() if isinstance(drawn, HashedNormal) else drawn, np.float32)
        w[np.arange(e), np.arange(e)] += 1.0  # identity on the normed embedding (input columns [0, E))
        return _round_bf16(w)
