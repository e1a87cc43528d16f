"""KernelConfig: how the model's hot operations run, chosen once and passed down as a static argument.

Hashable and frozen, so two models with different configurations run side by side in one process,
each with its own compiled kernels. Settled choices are plain code (runtime/ops.py, pallas_kernels/).
"""

from __future__ import annotations

import dataclasses

IMPLS = ("ref", "pallas")


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
    on the other sequences of a batch (the attention and GDN kernels already compute each row alone).
    Needs impl="pallas" and excludes fp8_act_quant."""

    impl: str = "ref"
    fp8_act_quant: bool = False
    deterministic: bool = False

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: supported {IMPLS}")
        if self.deterministic and (self.impl != "pallas" or self.fp8_act_quant):
            raise ValueError(f"deterministic=True needs impl='pallas' without fp8_act_quant, got impl={self.impl!r}, "
                             f"fp8_act_quant={self.fp8_act_quant}")

    @property
    def pallas(self) -> bool:
        return self.impl == "pallas"


REF = KernelConfig()
PALLAS = KernelConfig("pallas")
