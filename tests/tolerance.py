"""Named tolerances and one comparison that checks for NaN and reports the relative error.

Relative error = max |actual - expected| / max |expected| (scale-free, so one number per kind).
"""

from __future__ import annotations

import numpy as np

F32_OP = 2e-6  # one f32 op (norm, rope, matmul of O(100) terms) vs the float64 formula
F32_RECURRENCE = 2e-5  # f32 recurrence / chunked solve over ~100 tokens vs float64
F32_MODEL = 1e-4  # a whole f32 forward vs an independent f32 implementation (HF) of a 4-layer model
BF16_MODEL = 5e-2  # a bf16 forward vs its f32 twin (8 mantissa bits, a few layers of error growth)
FP8_VS_BF16_LOGITS = 1.5e-1  # FP8 block weights vs the dequantized bf16 twin: E4M3 has 3 mantissa bits


def rel_err(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


def assert_close(actual, expected, tol: float, what: str = "") -> None:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values in the result"
    err = rel_err(a, e)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"
