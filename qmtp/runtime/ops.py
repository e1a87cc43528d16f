"""The one door from the model to pallas_kernels: each hot operation, run as the KernelConfig says.

    kernels.impl == "ref"     pure jnp (XLA); runs everywhere, the semantics every kernel is tested against
    kernels.impl == "pallas"  the Pallas kernels (Triton lowering) on the GPU; on the CPU backend they
                              run in interpret mode, so the same configuration works in tests (slowly)

Which kernel serves which shape is settled here as plain code; each rule's measured reason is one
line below and its figure is in WORKSPACE.md. Model code never imports `pallas_kernels` directly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import fp8_act_quant, fp8_config, fp8_layout, fp8_matmul, gdn, gdn_conv, moe_matmul, paged_attention
from pallas_kernels import gdn_chunked as gdn_chunked_kernel
from pallas_kernels import rms_norm as rms_norm_kernels
from pallas_kernels.bench.trace_events import device_time  # noqa: F401  (the model-level benchmarks' profiler)
from qmtp.model.fp8 import Fp8Block
from qmtp.runtime.kernel_config import KernelConfig

# FP8 projections of at least this many rows (prefills) dequantize the weight once and use XLA's dot:
# 1.9-2.5x the Pallas GEMM's TFLOP/s at M = 1024 on the five 27B shapes.
DEQUANT_DOT_MIN_ROWS = 1024
# A bf16 weight of at most this many output rows (the joined gate projection in_proj_ba, 2 Hv = 96 at
# 27B) times 2..DECODE_MAX_ROWS token rows runs as a multiply and an f32 sum, one reduce fusion, not
# a GEMM: the 27B verify pass 9.797 -> 9.721 ms.
BF16_REDUCE_MAX_OUT = 256
# The most rows an FP8 launch streams on the decode kernel; more run GEMM tiles, compute-bound there.
DECODE_MAX_ROWS = fp8_config.DECODE_MAX_ROWS


def check_deterministic_rows(kernels: KernelConfig, batch: int, k: int, flags: str = "batch x (K+1)") -> None:
    """Under KernelConfig.deterministic, ValueError when a decode or verify pass (batch x (K+1) rows) would
    reach fp8_config.ROW_INVARIANT_GEMM_MIN_ROWS rows: its projections would run the GEMM, whose sums
    differ from the decode kernel's, and greedy tokens would depend on the batch and K again."""
    rows, limit = batch * (k + 1), fp8_config.ROW_INVARIANT_GEMM_MIN_ROWS
    if kernels.deterministic and rows >= limit:
        raise ValueError(f"deterministic: {flags} = {batch} x {k + 1} = {rows} rows per pass; at most {limit - 1} "
                         f"keep every row on the row-invariant decode kernel")


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _act_quant(kernels: KernelConfig, rows: int) -> bool:
    """Whether FP8 projections of `rows` rows run on E4M3 activations (KernelConfig.fp8_act_quant)."""
    return kernels.fp8_act_quant and 1 <= rows <= DECODE_MAX_ROWS


def _dequant_dot(kernels: KernelConfig, rows: int) -> bool:
    """Whether FP8 projections of `rows` rows dequantize the weight and use XLA's dot (DEQUANT_DOT_MIN_ROWS)."""
    return kernels.pallas and not kernels.deterministic and rows >= DEQUANT_DOT_MIN_ROWS


def _precision(dtype):
    # f32 runs (tests, oracle parity) must not silently drop to TF32 / bf16 passes on the GPU.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def linear(x: jax.Array, w, kernels: KernelConfig, out_dtype=None) -> jax.Array:
    """y = x @ W.T for W [O, I] in the compute dtype or an Fp8Block; output in `out_dtype` (x's dtype).

    Accumulates in f32 and rounds once at the end."""
    out_dtype = out_dtype or x.dtype
    rows = math.prod(x.shape[:-1])
    if kernels.deterministic and (isinstance(w, Fp8Block) or w.dtype == jnp.bfloat16):
        # one tile config per weight shape at every row count (KernelConfig.deterministic)
        if isinstance(w, Fp8Block):
            return fp8_matmul.fp8_matmul(x, w.weight, w.scale, out_dtype=out_dtype, interpret=_interpret(),
                                         row_invariant=True)
        return fp8_matmul.bf16_matmul(x, w, out_dtype=out_dtype, interpret=_interpret(), row_invariant=True)
    if rows == 1 and _interpret():
        # XLA's CPU dot runs a one-row product as a matrix-vector kernel that sums in another order than
        # its GEMM of 2..128 rows (which agree bit for bit): a plain decode row would not equal the same
        # row of a verify pass or a batch. Two copies of the row take the GEMM's order (concatenated: XLA
        # folds a broadcast row back into a one-row product).
        pair = jnp.concatenate([x.reshape(1, -1)] * 2)
        return linear(pair, w, kernels, out_dtype)[:1].reshape(*x.shape[:-1], -1)
    pallas = kernels.pallas
    if isinstance(w, Fp8Block):
        if _act_quant(kernels, rows):
            if pallas:
                return fp8_matmul.fp8_matmul(x, w.weight, w.scale, out_dtype=out_dtype, interpret=_interpret(),
                                             act_quant=True)
            return fp8_act_quant.fp8_matmul_act_ref(x, w.weight, w.scale, out_dtype=out_dtype)
        if _dequant_dot(kernels, rows):
            return fp8_matmul.fp8_matmul_dequant_dot(x, w.weight, w.scale, out_dtype=out_dtype,
                                                       interpret=_interpret())
        if pallas:
            return fp8_matmul.fp8_matmul(x, w.weight, w.scale, out_dtype=out_dtype, interpret=_interpret())
        return fp8_matmul.fp8_matmul_ref(x, w.weight, w.scale, out_dtype=out_dtype)
    if pallas and w.shape[0] <= BF16_REDUCE_MAX_OUT and 2 <= rows <= DECODE_MAX_ROWS:
        # y[..., o] = sum_i x[..., i] w[o, i] in f32: a reduce fusion, not a GEMM (BF16_REDUCE_MAX_OUT)
        y = jnp.sum(x[..., None, :].astype(jnp.float32) * w.astype(jnp.float32), axis=-1)  # [..., O]
        return y.astype(out_dtype)
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32,
                   precision=_precision(x.dtype))
    return y.astype(out_dtype)


def prefill_weights(layer: dict, rows: int, dtype, kernels: KernelConfig) -> dict:
    """A layer's params for prefill passes of `rows` rows that repeat over a long prompt: every FP8
    projection that `linear` would dequantize at that many rows (DEQUANT_DOT_MIN_ROWS; not under
    KernelConfig.deterministic) dequantized here once into `dtype`, as fp8_matmul_dequant_dot does per
    call, so the passes share it. Expert stacks ([X, ...] scale grids) stay FP8."""
    if not _dequant_dot(kernels, rows):
        return layer

    def dequantized(w):
        if not (isinstance(w, Fp8Block) and w.scale.ndim == 2):
            return w
        return fp8_matmul.dequantize_for_dot(w.weight, w.scale, dtype, interpret=_interpret())
    return jax.tree_util.tree_map(dequantized, layer, is_leaf=lambda v: isinstance(v, Fp8Block))


def linear_many(x: jax.Array, ws, kernels: KernelConfig) -> tuple[jax.Array, ...]:
    """(linear(x, w) for w in ws): several projections of the same x. Under Pallas with every weight an
    Fp8Block they share one kernel launch (the 64-layer 27B step 15.3 -> 14.2 ms); otherwise one each."""
    rows = math.prod(x.shape[:-1])
    if kernels.deterministic and all(isinstance(w, Fp8Block) for w in ws):
        return fp8_matmul.fp8_matmul_many(x, [w.weight for w in ws], [w.scale for w in ws], interpret=_interpret(),
                                          row_invariant=True)
    if kernels.pallas and not _dequant_dot(kernels, rows) and all(isinstance(w, Fp8Block) for w in ws):
        return fp8_matmul.fp8_matmul_many(x, [w.weight for w in ws], [w.scale for w in ws], interpret=_interpret(),
                                          act_quant=_act_quant(kernels, rows))
    return tuple(linear(x, w, kernels) for w in ws)


def rms_norm(x, w, eps, kernels: KernelConfig | None, *, plus_one: bool, z=None, out_dtype=None):
    """RMSNorm (pallas_kernels/rms_norm.py), XLA's fused reduction; under KernelConfig.deterministic one Pallas
    program per row, summed in one order at every row count: XLA's own reduction changes a row's bits with
    the number of rows on the H200 (from 33 rows at D = 5120)."""
    if kernels is not None and kernels.deterministic:
        return rms_norm_kernels.rms_norm_rows(x, w, eps, plus_one=plus_one, z=z, out_dtype=out_dtype,
                                              interpret=_interpret())
    return rms_norm_kernels.rms_norm_rows_ref(x, w, eps, plus_one=plus_one, z=z, out_dtype=out_dtype)


EXPERT_BLOCK_ROWS = moe_matmul.BLOCK_ROWS  # rows of an expert_matmul block (one expert each)


def expert_matmul(x: jax.Array, block_expert: jax.Array, w, kernels: KernelConfig, out_dtype=None) -> jax.Array:
    """y [R, O] for rows x [R, I] in blocks of moe_matmul.BLOCK_ROWS, block b times the stacked expert
    weight w [X, O, I] (an array or an Fp8Block) of expert block_expert[b] (-1: zeros); f32 accumulation
    (pallas_kernels/moe_matmul.py: the kernel is row-invariant)."""
    weight, scale = (w.weight, w.scale) if isinstance(w, Fp8Block) else (w, None)
    if kernels.pallas:
        return moe_matmul.expert_matmul(x, block_expert, weight, scale, out_dtype, interpret=_interpret())
    return moe_matmul.expert_matmul_ref(x, block_expert, weight, scale, out_dtype)


def fenced(kernels: KernelConfig, fn, *args):
    """fn(*args), an elementwise computation between kernels; under KernelConfig.deterministic fenced off
    (optimization barriers on its inputs and output) so XLA compiles it as its own program, the same at
    every row count: fused into the next projection's input preparation (a per-row reduction), the
    SwiGLU's silu(gate) * up gave other bits for a row alone than in a batch of four on the H200."""
    if not kernels.deterministic:
        return fn(*args)
    return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))


def swiglu(gate: jax.Array, up: jax.Array, kernels: KernelConfig, out_dtype) -> jax.Array:
    """silu(gate) * up in f32, rounded to out_dtype (fenced)."""
    return fenced(kernels, lambda g, u: (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32))
                  .astype(out_dtype), gate, up)


def gdn_gates(a, b, a_log, dt_bias):
    """(g, beta) [B, T, Hv] f32 from the raw projections a, b and A_log, dt_bias [Hv] (MODEL_SPEC §3.6
    step 4); XLA under both impls (the decode kernel computes its own)."""
    return gdn.gdn_gates_ref(a, b, a_log, dt_bias)


def gdn_conv_recurrence(mixed, conv_state, conv_w, ba, a_log, dt_bias, state, n_valid, kernels: KernelConfig,
                        slots=None):
    """Causal conv + SiLU + q/k L2 norms (q scaled by Dk^-0.5) + gates + the per-token gated delta
    rule from the raw in_proj_qkv output mixed [B, T, C] (channels q | k | v) and conv_state
    [B, W-1, C]; ba [B, T, 2 Hv] = [b | a], the raw gate projections. Tokens t >= n_valid [B] change
    neither state. Returns (o [B, T, Hv, Dv] f32, ssm state, conv state); see
    pallas_kernels/gdn_conv.py. The key-head count comes from the shapes: C = 2 Hk Dk + Hv Dv with
    Hv, Dk, Dv from state [..., Hv, Dk, Dv]. slots int [B]: state [Ns, B, Hv, Dk, Dv] and conv_state
    [Ns, B, W-1, C] are the slot ring: each row reads its slot, and the state after each token t is
    written to slot (slots[b] + 1 + t) mod Ns, in place."""
    hv, dk, dv = state.shape[-3:]
    kw = {"key_heads": (mixed.shape[-1] - hv * dv) // (2 * dk), "scale": dk ** -0.5, "ba": ba, "slots": slots}
    if kernels.pallas:
        return gdn_conv.gdn_conv_recurrence(mixed, conv_state, conv_w, None, None, a_log, dt_bias, state, n_valid,
                                            interpret=_interpret(), in_place=True,
                                            row_invariant=kernels.deterministic, **kw)
    return gdn_conv.gdn_conv_recurrence_ref(mixed, conv_state, conv_w, None, None, a_log, dt_bias, state, n_valid,
                                            **kw)


def read_slot(ring: jax.Array, read: jax.Array) -> jax.Array:
    """ring [Ns, B, ...] -> [B, ...]: each row's read slot (the slot convention of gdn_conv)."""
    return gdn_conv.read_slot(ring, read)


def next_slots(read: jax.Array, n_keep: jax.Array, n_slots: int) -> jax.Array:
    """Read slots after a ring pass whose rows kept n_keep [B] tokens (gdn_conv.next_slots)."""
    return gdn_conv.next_slots(read, n_keep, n_slots)


def gdn_chunked(q, k, v, g, beta, state, kernels: KernelConfig):
    """Chunked gated delta rule for prefill (the WY form); same math as the per-token rule. Its
    chunk-parallel half is XLA under both impls; under Pallas the chain over chunks is one kernel
    (gdn_chunked.py) instead of a lax.scan of small launches per chunk, then every chunk's output at once:
    one GDN layer at 4,096 tokens 3.75 -> 2.34 ms (H100)."""
    if kernels.pallas:
        return gdn_chunked_kernel.gdn_chunked(q, k, v, g, beta, state, interpret=_interpret())
    return gdn.gdn_chunked_ref(q, k, v, g, beta, state)


def paged_attention_op(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale, kernels: KernelConfig):
    """Causal GQA attention of T queries over paged KV; see pallas_kernels/paged_attention.py. Under Pallas a
    prefill (T > 8) runs the kernel in query blocks (PagedAttentionConfig.prefill_rows): no [T, context] scores.
    Under KernelConfig.deterministic the key splits are fixed 512-key ranges added in one order, so a query's
    result does not depend on the batch, on K or on the other queries of its verify."""
    if kernels.pallas:
        config = paged_attention.ROW_INVARIANT_CONFIG if kernels.deterministic else None
        return paged_attention.paged_attention(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale,
                                               interpret=_interpret(), config=config)
    return paged_attention.paged_attention_ref(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale)


def tile_rows_for(o: int, i: int) -> int | None:
    """The tile height the Pallas kernels lay an [O, I] FP8 weight out in (None: kept as loaded)."""
    return fp8_layout.tile_rows_for(o, i)


def tile_weight(w: jax.Array, rows: int) -> jax.Array:
    """An FP8 weight [O, I] in the kernels' layout of `rows`-row tiles (pallas_kernels/fp8_layout.py)."""
    return fp8_layout.tile_weight(w, block_o=rows)


def untile_weight(w: jax.Array) -> jax.Array:
    """The checkpoint layout [O, I] of a weight in either layout."""
    return fp8_layout.untile_weight(w)
