"""KernelConfig: how the model's hot operations run, chosen once and passed down as a static argument.

Hashable and frozen, so two models with different configurations run side by side in one process,
each with its own compiled kernels. Settled choices are plain code (runtime/ops.py, pallas_kernels/).
"""

from __future__ import annotations

import dataclasses

IMPLS = ("ref", "pallas")
MIN_PREFILL_CHUNK = 16  # the shortest prompt bucket: a longer bucket is a whole number of chunks
# Until the prefill is measured at long context: the scores of a 2048-token chunk against a 131,072-token
# context are 2048 x 131072 x 4 B = 1 GiB per query head.
DEFAULT_PREFILL_CHUNK = 2048


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """impl: "ref" runs pure jnp (XLA) everywhere: the semantics every kernel is tested against;
    "pallas" runs the Pallas kernels (Triton lowering) on the GPU, in interpret mode on the CPU.

    fp8_act_quant: FP8 projections of at most fp8_config.DECODE_MAX_ROWS rows quantize their
    activations to E4M3 per row and 128 features (MODEL_SPEC §5.3, the checkpoints' dynamic activation
    scheme) and multiply on the FP8 tensor cores; under both impls (the ref path uses the same formula).
    It changes the numbers (at most a relative 2^-4 per activation) and so, rarely, a greedy token;
    longer prefills keep exact activations. Off by default: exact activations.

    deterministic: every bfloat16 and FP8 projection, at every row count (decode, verify, prefill), runs on
    the Pallas block-matmul kernels with one tile config per weight shape (fp8_matmul's row_invariant), so
    a row's numbers do not depend on how many rows share the launch: greedy tokens do not depend on K or
    on the other sequences of a batch. RMSNorm runs one program per row, decode attention fixed key
    splits, the GDN decode kernel one per-token loop at every token count, and a prefill one prompt at a
    time in whole chunks of prefill_chunk tokens (a short prompt pays for one chunk: a small
    prefill_chunk suits short prompts). Needs impl="pallas" and excludes fp8_act_quant.

    prefill_chunk: a prompt longer than this many tokens (a power of two >= 16) is prefilled in chunks of
    it, each after the KV pages and GDN/conv state the previous one left, so prefill memory grows with
    the context, not with its square (the attention scores are [chunk, context] per head)."""

    impl: str = "ref"
    fp8_act_quant: bool = False
    deterministic: bool = False
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: supported {IMPLS}")
        c = self.prefill_chunk
        if c < MIN_PREFILL_CHUNK or c & (c - 1):
            raise ValueError(f"prefill_chunk={c}: a power of two >= {MIN_PREFILL_CHUNK} needed")
        if self.deterministic and (self.impl != "pallas" or self.fp8_act_quant):
            raise ValueError(f"deterministic=True needs impl='pallas' without fp8_act_quant, got impl={self.impl!r}, "
                             f"fp8_act_quant={self.fp8_act_quant}")

    @property
    def pallas(self) -> bool:
        return self.impl == "pallas"


REF = KernelConfig()
PALLAS = KernelConfig("pallas")
