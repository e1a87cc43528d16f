"""E4M3 x E4M3 dots on Hopper's FP8 warpgroup MMA: Triton emits `wgmma` for an FP8 dot only with
`maxNumImpreciseAcc` >= 32 (else f16 conversions and `mma.sync`), which Pallas never sets. `install()` (run
on importing fp8_matmul; it stays: Pallas lowers a kernel when the enclosing jit is lowered) wraps the
lowering's dialect so an FP8 x FP8 `tt.dot` gets its whole K (one 128-feature chunk; the f32 sum across
chunks is outside the dot, as DeepSeek-V3 promotes every 128 products). Reaches into jax._src (0.11.2,
pinned); without `tt_dialect` nothing is wrapped (Triton's default: correct, slower).
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()


class _Fp8DotDialect:
    """The dialect module, except that `dot` on two FP8 operands sets max_num_imprecise_acc = K."""

    def __init__(self, dialect):
        self._dialect = dialect

    def __getattr__(self, name):
        return getattr(self._dialect, name)

    def dot(self, a, b, c, **kw):
        from jax._src.lib.mlir import ir
        a_type, b_type = ir.RankedTensorType(a.type), ir.RankedTensorType(b.type)
        if kw.get("max_num_imprecise_acc") is None and _is_fp8(a_type.element_type) and _is_fp8(b_type.element_type):
            kw["max_num_imprecise_acc"] = a_type.shape[-1]
        return self._dialect.dot(a, b, c, **kw)


def _is_fp8(t) -> bool:
    return "f8" in str(t).lower()


def install() -> bool:
    """Wraps the Triton lowering's dialect once (idempotent); False where it could not."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    with _LOCK:
        original = getattr(lowering, "tt_dialect", None)
        if original is None:
            return False
        if not isinstance(original, _Fp8DotDialect):
            lowering.tt_dialect = _Fp8DotDialect(original)
        return True
