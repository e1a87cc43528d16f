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
    longer prefills keep exact activations. Off by default: exact activations."""

    impl: str = "ref"
    fp8_act_quant: bool = False

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: supported {IMPLS}")

    @property
    def pallas(self) -> bool:
        return self.impl == "pallas"


REF = KernelConfig()
PALLAS = KernelConfig("pallas")
