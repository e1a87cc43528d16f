"""The compute ceiling a prefill is quoted against: XLA's matmul on E4M3 operands (the FP8 tensor cores).

A prefill of P prompt tokens must do 2 x P x (the target's projection weights) FLOP; at the FP8 matmul's
rate, measured in the same process as the TTFT it normalizes, that is the prefill's compute floor, and
floor / TTFT is the share of it a prefill reaches (attention and the GDN recurrence aside, which is why the
share stays below 1). On a CPU the rate is measured at a small shape and is no ceiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qmtp.bench.bandwidth import median_and_fastest
from qmtp.model.fp8 import Fp8Block

# The 27B MLP's gate projection at a prefill of 8192 tokens: [M, K] x [K, N]
GPU_SHAPE = (8192, 5120, 17408)
CPU_SHAPE = (256, 256, 256)


def matmul_rate(shape=GPU_SHAPE, trials: int = 5) -> dict:
    """TFLOP/s of one jitted E4M3 [M, K] x [K, N] product with f32 accumulation, from the fastest of
    `trials` timed calls after a warm-up call (noise only lengthens a trial)."""
    m, k, n = shape
    a = jnp.ones((m, k), jnp.float8_e4m3fn)  # the values do not change the time
    b = jnp.ones((k, n), jnp.float8_e4m3fn)
    f = jax.jit(lambda ab: jnp.dot(ab[0], ab[1], preferred_element_type=jnp.float32))
    _, best = median_and_fastest(f, (a, b), trials, passes=1)
    return {"shape": list(shape), "dtype": "float8_e4m3fn", "best_s": best, "tflop_per_s": 2 * m * k * n / best / 1e12}


def projection_weights(params: dict) -> int:
    """Multiply-adds per prompt token through the target's decoder layers: every FP8 and 2-D weight of
    params["gdn"] and params["attn"] (the embedding is a lookup; the lm_head runs at one position)."""
    total = 0
    for layer in (*params.get("gdn", ()), *params.get("attn", ())):
        for w in layer.values():
            if isinstance(w, Fp8Block):  # [O, I], or the load's tiles [O / tr, I / 128, tr, 128]
                total += int(w.weight.size)
            elif getattr(w, "ndim", 0) == 2:
                total += int(w.shape[0]) * int(w.shape[1])
    return total


def prefill_floor_s(params: dict, prompt_tokens: int, tflop_per_s: float) -> float:
    """Seconds the projections of `prompt_tokens` tokens take at the measured matmul rate."""
    return 2.0 * prompt_tokens * projection_weights(params) / (tflop_per_s * 1e12)
