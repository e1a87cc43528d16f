"""E4M3 x E4M3 dots that may use Hopper's FP8 warpgroup MMA from Pallas' Triton lowering.

Triton uses its MMAv3 (`wgmma`) instructions for an FP8 dot only when the dot allows some products to
be summed in the tensor core's reduced-precision accumulator (`maxNumImpreciseAcc` >= 32); otherwise
it converts both operands to f16 and runs the older `mma.sync` path, which is what the FP8 decode
kernel set out to avoid (scripts/triton_loop_stats.py: 245 instructions per chunk with the
conversions, against 184 for the f16-pieces kernel). Pallas builds `tt.dot` without the attribute,
so `install()` (called when pallas_kernels.fp8_matmul is imported) wraps the lowering module's
dialect handle: an FP8 x FP8 `tt.dot` then carries maxNumImpreciseAcc = K, the dot's whole K (one
128-feature chunk in the decode kernel, whose f32 accumulation across chunks happens outside the
dot, as DeepSeek-V3 promotes every 128 products). Every other dot is built as before; the wrap has
to stay in place because Pallas lowers a kernel when the enclosing jit is lowered, not where the
pallas_call is traced.

This reaches into `jax._src.pallas.triton.lowering` (jax 0.11.2, pinned): if that module no longer
has `tt_dialect`, nothing is wrapped and FP8 dots keep Triton's default (correct, slower).
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
