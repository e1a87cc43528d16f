"""The one switch between the Pallas kernels and their pure-jnp `_ref` twins.

Every hot operation of the model goes through here with an explicit `impl`:
  "ref"    - pure jnp (XLA); runs everywhere, the semantics every kernel is tested against;
  "pallas" - the Pallas kernels (Triton lowering) on the GPU; on the CPU backend they run in
             interpret mode, so the same flag works in tests (slowly).
Operations without a kernel yet (chunked GDN prefill) use the reference under both.
Model code never imports `pallas_kernels` directly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import fp8_act_quant, fp8_config, fp8_matmul, fp8_tiles, gdn, gdn_conv, paged_attention
from qmtp.fp8 import Fp8Block

IMPLS = ("ref", "pallas")
# linear_many's shared launch (several FP8 projections of one x in one kernel launch); False only to
# measure what it gains (`python -m pallas_kernels.bench --parts=step`: 15.3 -> 14.2 ms per 27B step)
SHARED_PROJECTION_LAUNCH = True
# The paged-attention kernel holds all G*T query rows of a KV head in one tile: it is built for decode
# and verify (T <= K+1). Prefill (long T) uses the reference until a prefill attention kernel exists
# (measured: a 64-token prefill asked for 384 KiB of shared memory at D = 256).
PAGED_ATTENTION_MAX_QUERIES = 8
# FP8 projections of at least this many rows (prefill of long prompts) dequantize the weight once and
# use XLA's dot (fp8_matmul.fp8_matmul_dequant_dot: 1.9-2.5x the Pallas GEMM's TFLOP/s at M = 1024 on
# the five 27B shapes, H200 2026-11-30); fewer rows stream the FP8 weight through the Pallas kernels.
# 0 disables it (bench comparisons).
DEQUANT_DOT_MIN_ROWS = 1024
# True: a single FP8 row (plain decode at batch 1) takes XLA's fused dequantize + dot (the reference
# formula) instead of the Pallas kernel. Off until the whole step measures faster with it
# (`pallas_kernels.bench --parts=step --step_impls=pallas,pallas_m1xla`): per weight, XLA's fusion
# streamed 1.65-2.15 TB/s at M = 1 on four of the five 27B shapes where the Pallas CUDA-core path
# gave 1.24-1.95 (mlp_down the exception: 1.26 vs 1.63).
XLA_SINGLE_ROW = False
# True: with impl="pallas", decode and verify compute the GDN gates (beta = sigmoid(b), g = -exp(A_log)
# softplus(a + dt_bias)) and select the padding tokens away inside the recurrence kernel
# (gdn.gdn_recurrence_gated), and the speculative commit runs the same kernel with n_valid = the
# accepted length: the XLA ops that made the gates and masked g, beta, k and v for every GDN layer go
# (the trace of the 27B step has ~1.5 ms in ~1000 small XLA ops; the commit of a K=3 round took 1.43
# ms for 48 layers). Off until measured: step variant "pallas_gdngated", the bench breakdown's commit.
GDN_GATES_IN_KERNEL = False
# True: with impl="pallas", decode and verify run one kernel from the raw in_proj_qkv output to the
# recurrence output (gdn_conv.gdn_conv_recurrence: the causal conv, SiLU, q/k L2 norms, the gates, the
# padding select and the recurrence; it returns the new conv state too), and the speculative commit
# runs the same kernel from the old conv and ssm state with n_valid = the accepted length. It takes
# the per-layer XLA ops between in_proj and the recurrence (conv window concat, the 4-tap conv, SiLU,
# the norms, the conv-state gather, slices, the gates and masks) out of the step: 1348 -> 1014
# launches and 9.56 -> 9.18 ms for the 64-layer 27B step in one run (H200, session 8; variant
# "pallas_gdnxla" is the old path), plain decode 104.7 -> 107.6 tok/s end to end. Includes what
# GDN_GATES_IN_KERNEL does (it wins when both are on).
GDN_CONV_IN_KERNEL = True
# True: a forward that keeps its GDN input state alive for a replay (the verify pass: the commit may
# rebuild from it) has the conv kernel write the new state to a fresh buffer. With the state input
# aliased to the output (in place, as plain decode keeps it), XLA must first copy each GDN layer's
# 3.1 MB state. Measured on the H200 in one lease (session 9, `qmtp.bench
# --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=2 --trace_dir=...`, with and without
# --kernels=gdn_replay_fresh_state=false): the K=3 traces' `memcpy128` fell from 116.6 to 68.6 per
# round (one is left per GDN kernel call) and device busy time per round
# from 13.03 to 12.92 ms; K=3 natural 332.5 -> 338.7 tok/s, profiled 249.9 -> 251.6, plain unchanged.
GDN_REPLAY_FRESH_STATE = True
# True: the speculative loops (speculate.spec_loop / spec_rounds) carry each GDN layer's state and conv
# state in K+2 slots [K+2, B, ...] with a read slot per row: the verify pass reads it and writes the
# state after each of its K+1 tokens to the slots after it (the conv kernel or its ref twin), so the
# commit is `gdn_conv.next_slots` (an index) and nothing is rebuilt or copied. Without it the loop
# keeps the old state and re-runs the conv kernel from it over the accepted prefix whenever a draft was
# rejected (model.commit_gdn), behind a lax.cond that skips full acceptances; that cond makes the host
# wait for the verify pass and then launch the 48 rebuild kernels one by one: measured in session 11
# as ~0.84 ms per rebuild inside a 27B round (profiled K=3 round 11.76 vs natural 11.40 ms with 43% of
# rounds rebuilding) for ~0.36 ms of kernel time. Costs K+1 more GDN states per sequence inside the
# loop (0.6 GB at 27B, K=3) and a copy in and out per loop call. (It replaces session 11's double-
# buffered pair, which saved the verify's state copies but kept the rebuild.)
GDN_STATE_SLOTS = True
# True: the plain decode loops (decode.greedy_loop, greedy_steps) carry the GDN state and conv state in
# two slots as well and alternate between them, so the conv kernel updates the conv state in place.
# Unslotted, its conv-state output is a new buffer (programs of one key head still read the old q/k
# rows while another writes them), which the loop then copies into its carried buffer: 48
# `memcpy32_post` per 27B step, ~70 us of a 9.0 ms step (round_pieces, sessions 12-13), copies the
# slotted verify pass does not make. Costs one more GDN state per sequence (~151 MB at 27B). Off until
# measured on the GPU.
GDN_PLAIN_SLOTS = False
# True: layers.write_kv's scatter of a pass's new K/V rows into the pages states that its indices are
# unique (each valid token owns its row; dropped tokens get distinct out-of-range rows), which lets
# XLA write the rows without ordering the updates. One row per sequence already becomes a
# dynamic-update-slice; this is for the verify pass's K+1 rows (32 scatters of ~2.8 us per 27B verify,
# session 11) and the MTP refresh.
KV_SCATTER_UNIQUE = True
# The conv kernel's tile (gdn.RecurrenceConfig): Dv columns of the state per program and warps per
# program. 32 x 4 is the recurrence kernel's measured default (gdn_decode sweep, session 3); the conv
# kernel's own sweep is `pallas_kernels.bench --parts=gdn` (kernel gdn_conv_decode). In the K=3
# verify of session 9 the kernel took 8.4 us per layer at T=4 against 4.5 at T=1 (192 programs).
GDN_CONV_BLOCK_V = 32
GDN_CONV_NUM_WARPS = 4
# True: the conv kernel's "hoisted" form (gdn.RecurrenceConfig.form): all tokens' loads, conv, norms
# and gates before the state chain, one reduction step per token in the chain (S^T k and S^T q both
# from the previous state). Measured on the H200 (session 11, one lease, results/2026-12-01/session11/
# pieces2): the kernel alone at B = 1 / 8, T = 4: 9.78 / 33.6 us per layer against 10.79 / 37.2
# sequential; T = 1: 6.20 / 21.3 against 6.41 / 21.3; the 27B verify pass 9.761 vs 9.797 ms and the
# commit's rebuild 0.854 vs 0.912 ms device time; the 64-layer step 9.31 vs 9.27 ms (noise). A WY
# "chunk" form (all tokens at once through Triton dots) was 4x slower and was removed.
GDN_CONV_HOISTED = True
# True: bf16 weights (the lm_head of FP8 checkpoints; every projection of bf16 checkpoints) with at
# most fp8_config.DECODE_MAX_ROWS rows run on the weight-streaming decode kernel
# (fp8_matmul.bf16_matmul) instead of XLA's dot: one reduction order for 1..16 rows, so greedy
# MTP in bf16 cannot leave plain greedy through a row-count-dependent GEMM. Off: XLA's bf16 GEMV
# streams 2.5-3.5 TB/s at M = 1..4 on the H200, faster than this kernel is likely to; the cost of
# the switch is measured by `pallas_kernels.bench --parts=step --step_impls=pallas,pallas_bf16stream`.
BF16_STREAMING = False
# True: FP8 projections of at most fp8_config.DECODE_MAX_ROWS rows (decode, verify, drafts, prefills
# of that few tokens) quantize their activations to E4M3 per row and 128 features (MODEL_SPEC §5.3,
# the checkpoints' `activation_scheme: "dynamic"`, as vLLM and SGLang run them) and multiply on the FP8 tensor cores
# (fp8_matmul(..., act_quant=True)); impl="ref" uses the same formula (fp8_act_quant.fp8_matmul_act_ref).
# The weights then reach the tensor cores unconverted (the exact path converts each weight to f16:
# its kernel was issue-bound, FP8 kernels at ~3.45 TB/s in the step against 4.5 for the bf16
# lm_head GEMV). It changes the numbers (a relative 2^-4 per activation at most) and so, rarely, a
# greedy token; longer prefills keep exact activations. Off until the step and a real checkpoint measure it.
FP8_ACT_QUANT = False
# True: qmtp.load joins each GDN layer's in_proj_b and in_proj_a [Hv, E] into one in_proj_ba [2 Hv, E]
# = [b | a] (api.fuse_gate_projections; per TP shard [b_s | a_s]), so the two gate projections are one
# dot and the conv kernel reads b and a from its output in place. In the 27B verify pass (4 rows) XLA
# ran them as 96 small GEMMs (~2.9 us each; session 10, scripts/round_pieces.py launch kinds); XLA's
# own DotMerger joined them but concatenated both weights on every call (a wash: session 10). Joined:
# 49 GEMMs instead of 97 and 141 us less GEMM time per 27B verify pass (two leases); the one-row step unchanged
# (9.14 vs 9.12 ms, step variant "pallas_gates_apart"). Read at load time: a model loaded before a
# change keeps its tree.
FUSE_GATE_PROJECTIONS = True
# > 0: with impl="pallas", a bf16 weight of at most this many output rows (the joined gate projection
# in_proj_ba, 2 Hv = 96 at 27B) times 2..fp8_config.DECODE_MAX_ROWS token rows runs as a multiply and an
# f32 sum over the input dim, which XLA emits as one reduce fusion, as it does for one row, instead of
# a GEMM: in the 27B verify pass (4 rows) the 48 gate GEMMs took ~3 us each where one row's reduce
# fusions take ~1.5 (session 10 launch kinds). Measured (session 11, `scripts/round_pieces.py
# --variants=bf16_reduce_max_out=256`, same process): verify 9.721 vs 9.797 ms device time, the
# target step unchanged. 0 = off.
BF16_REDUCE_MAX_OUT = 256
# True: qmtp.load(impl="pallas") lays every FP8 weight whose shape allows it out in the kernels' tiled
# layout (qmtp/weight_layout.py, pallas_kernels/fp8_layout.py: each [64, 128] chunk of the decode
# kernel one contiguous run). Measured on the H200: the 27B step's FP8 launches by kernel time 7.10 ->
# 6.91 ms at 1 row, 7.22 -> 7.06 at 4, 7.25 -> 7.18 at 16 (session 17, `pallas_kernels.bench
# --parts=fp8_launches --fp8_launch_layouts=checkpoint,tiled`); in session 18 the 64-layer step 9.07 ->
# 8.84 ms (`--parts=step --step_impls=pallas_untiled,pallas`), TP1 plain decode 111.7 -> 113.4 tok/s
# and K=3 285.6 -> 289.0 (`qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags`), and the prefill
# GEMM's launches of a step 29.42 -> 29.10 ms at 64 rows, 98.2 -> 91.1 at 512.
FP8_TILED_WEIGHTS = True


# kernel_settings() name -> (module, attribute) of the switch ("ops" is this module), with the
# integer range a value must fall in (None: a bool)
POW2 = "a power of two"  # a setting's bounds (lo, hi, POW2): a tile's rows, so only powers of two
_SETTING_SWITCHES = {"shared_projection_launch": ("ops", "SHARED_PROJECTION_LAUNCH", None),
                     "dequant_dot_min_rows": ("ops", "DEQUANT_DOT_MIN_ROWS", (0, None)),
                     "xla_single_row": ("ops", "XLA_SINGLE_ROW", None),
                     "gdn_gates_in_kernel": ("ops", "GDN_GATES_IN_KERNEL", None),
                     "gdn_conv_in_kernel": ("ops", "GDN_CONV_IN_KERNEL", None),
                     "gdn_replay_fresh_state": ("ops", "GDN_REPLAY_FRESH_STATE", None),
                     "gdn_state_slots": ("ops", "GDN_STATE_SLOTS", None),
                     "gdn_plain_slots": ("ops", "GDN_PLAIN_SLOTS", None),
                     "kv_scatter_unique": ("ops", "KV_SCATTER_UNIQUE", None),
                     "gdn_conv_block_v": ("ops", "GDN_CONV_BLOCK_V", (1, 128)),
                     "gdn_conv_num_warps": ("ops", "GDN_CONV_NUM_WARPS", (1, 16)),
                     "gdn_conv_hoisted": ("ops", "GDN_CONV_HOISTED", None),
                     "bf16_streaming": ("ops", "BF16_STREAMING", None),
                     "fp8_act_quant": ("ops", "FP8_ACT_QUANT", None),
                     "fuse_gate_projections": ("ops", "FUSE_GATE_PROJECTIONS", None),
                     "bf16_reduce_max_out": ("ops", "BF16_REDUCE_MAX_OUT", (0, None)),
                     "fp8_tiled_weights": ("ops", "FP8_TILED_WEIGHTS", None),
                     "fp8_tile_rows": ("fp8_layout", "TILE_ROWS", (64, 128, POW2)),
                     "fp8_m1_cuda_core": ("fp8_config", "M1_CUDA_CORE", None),
                     "fp8_scale_preload": ("fp8_config", "SCALE_PRELOAD", None),
                     "fp8_x_f16": ("fp8_config", "X_F16", None),
                     "fp8_x_f16_scaled": ("fp8_config", "X_F16_SCALED", None),
                     "fp8_x_chunk_scaled": ("fp8_config", "X_CHUNK_SCALED", None),
                     "fp8_x_f16_max_rows": ("fp8_config", "X_F16_MAX_ROWS", (1, fp8_tiles.DECODE_DOT_MAX_ROWS // 2)),
                     "fp8_decode_max_rows": ("fp8_config", "DECODE_MAX_ROWS", (1, fp8_tiles.DECODE_DOT_MAX_ROWS)),
                     "fp8_decode_programs_per_sm": ("fp8_config", "DECODE_PROGRAMS_PER_SM", (1, 64)),
                     "fp8_narrow_x_on_m": ("fp8_config", "NARROW_X_ON_M", None),
                     "fp8_narrow_programs_per_sm": ("fp8_config", "NARROW_PROGRAMS_PER_SM", (1, 64)),
                     "fp8_narrow_num_stages": ("fp8_config", "NARROW_NUM_STAGES", (1, 8)),
                     "fp8_gemm_split_programs": ("fp8_config", "GEMM_SPLIT_PROGRAMS", (0, None)),
                     "fp8_narrow_decode_max_rows": ("fp8_config", "NARROW_DECODE_MAX_ROWS",
                                                    (0, fp8_tiles.DECODE_DOT_MAX_ROWS)),
                     "fp8_gemm_x_f16_scaled": ("fp8_config", "GEMM_X_F16_SCALED", None),
                     "fp8_verify_narrow_stages": ("fp8_config", "VERIFY_NARROW_STAGES", (1, 8)),
                     "fp8_verify_narrow_block_o": ("fp8_config", "VERIFY_NARROW_BLOCK_O", (64, 128, POW2)),
                     "fp8_verify_wide_block_o": ("fp8_config", "VERIFY_WIDE_BLOCK_O", (64, 128, POW2)),
                     "fp8_verify_tall_stages": ("fp8_config", "VERIFY_TALL_STAGES", (1, 8)),
                     "fp8_narrow_block_o": ("fp8_config", "NARROW_BLOCK_O", (64, 128, POW2)),
                     "fp8_gemm_mid_block_m": ("fp8_config", "GEMM_MID_BLOCK_M", (16, 256, POW2)),
                     "fp8_gemm_mid_stages": ("fp8_config", "GEMM_MID_STAGES", (1, 8)),
                     "paged_attention_max_queries": ("ops", "PAGED_ATTENTION_MAX_QUERIES", (1, None)),
                     "spec_skip_full_commit": ("speculate", "SKIP_FULL_COMMIT", None)}


# a setting's module name -> the module it lives in (imported at use: qmtp.speculate imports this one)
_SWITCH_MODULES = {"ops": __name__, "fp8_config": "pallas_kernels.fp8_config",
                   "fp8_layout": "pallas_kernels.fp8_layout", "speculate": "qmtp.speculate"}


def _switch_module(module: str):
    import importlib
    return importlib.import_module(_SWITCH_MODULES[module])


def kernel_settings() -> dict:
    """The module switches that change which kernel runs where (recorded with benchmark figures)."""
    return {name: getattr(_switch_module(module), attr) for name, (module, attr, _) in _SETTING_SWITCHES.items()}


def set_kernel_settings(settings: dict) -> dict:
    """Sets module switches by their kernel_settings() names; values may be bools / ints or their
    text ("true", "0", "64"). Every value is checked before any is set (a bad one changes nothing).
    Returns the previous settings (pass them back to restore). Takes effect for functions traced
    afterwards: jitted functions already compiled keep their kernels (call jax.clear_caches()
    between settings in one process)."""
    previous = kernel_settings()
    parsed = {}
    for name, value in settings.items():
        if name not in _SETTING_SWITCHES:
            raise ValueError(f"unknown kernel setting {name!r}; known: {', '.join(sorted(_SETTING_SWITCHES))}")
        parsed[name] = _parse_setting(name, value, _SETTING_SWITCHES[name][2])
    for name, value in parsed.items():
        module, attr, _ = _SETTING_SWITCHES[name]
        setattr(_switch_module(module), attr, value)
    return previous


def parse_kernel_settings(items) -> dict:
    """["name=value", ...] (a command-line list) -> {name: value}; a malformed item is refused."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"kernel setting {item!r}: expected name=value (names: {', '.join(sorted(_SETTING_SWITCHES))})")
        out[name.strip()] = value.strip()
    return out


def _parse_setting(name: str, value, bounds):
    """A bool (bounds None) or an integer within bounds (lo, hi[, POW2]; hi None: unbounded) from its text."""
    if bounds is None:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"kernel setting {name}={value!r}: expected true or false")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"kernel setting {name}={value!r}: expected an integer") from None
    lo, hi, *rule = bounds
    if number < lo or (hi is not None and number > hi):
        raise ValueError(f"kernel setting {name}={number}: must be in [{lo}, {hi if hi is not None else 'inf'}]")
    if rule == [POW2] and not fp8_tiles.is_pow2(number):
        raise ValueError(f"kernel setting {name}={number}: must be a power of two (a tile's rows)")
    return number


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: supported {IMPLS}")


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def linear(x: jax.Array, w, impl: str = "ref", out_dtype=None) -> jax.Array:
    """y = x @ W.T for W [O, I] in the compute dtype or an Fp8Block; output in `out_dtype` (x's dtype).

    Accumulates in f32 (preferred_element_type) and rounds once at the end."""
    check_impl(impl)
    out_dtype = out_dtype or x.dtype
    rows = math.prod(x.shape[:-1])
    if isinstance(w, Fp8Block):
        if _act_quant(rows):
            if impl == "pallas":
                return fp8_matmul.fp8_matmul(x, w.weight, w.scale, out_dtype=out_dtype, interpret=_interpret(),
                                             act_quant=True)
            return fp8_act_quant.fp8_matmul_act_ref(x, w.weight, w.scale, out_dtype=out_dtype)
        if impl == "pallas" and DEQUANT_DOT_MIN_ROWS and rows >= DEQUANT_DOT_MIN_ROWS:
            return fp8_matmul.fp8_matmul_dequant_dot(x, w.weight, w.scale, out_dtype=out_dtype)
        if impl == "pallas" and not (XLA_SINGLE_ROW and rows == 1):
            return fp8_matmul.fp8_matmul(x, w.weight, w.scale, out_dtype=out_dtype, interpret=_interpret())
        return fp8_matmul.fp8_matmul_ref(x, w.weight, w.scale, out_dtype=out_dtype)
    if impl == "pallas" and BF16_STREAMING and w.dtype == jnp.bfloat16 and 1 <= rows <= fp8_config.DECODE_MAX_ROWS:
        return fp8_matmul.bf16_matmul(x, w, out_dtype=out_dtype, interpret=_interpret())
    if (impl == "pallas" and w.dtype == jnp.bfloat16 and w.shape[0] <= BF16_REDUCE_MAX_OUT
            and 2 <= rows <= fp8_config.DECODE_MAX_ROWS):
        # y[..., o] = sum_i x[..., i] w[o, i] in f32: a reduce fusion, not a GEMM (BF16_REDUCE_MAX_OUT)
        y = jnp.sum(x[..., None, :].astype(jnp.float32) * w.astype(jnp.float32), axis=-1)  # [..., O]
        return y.astype(out_dtype)
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32,
                   precision=_precision(x.dtype))
    return y.astype(out_dtype)


def linear_many(x: jax.Array, ws, impl: str = "ref") -> tuple[jax.Array, ...]:
    """(linear(x, w) for w in ws): several projections of the same x. With impl="pallas" and all
    weights Fp8Block, the few-row (decode / verify) case runs as one kernel launch over all of them
    (fewer launches per layer; measured in WORKSPACE.md); otherwise one matmul each."""
    check_impl(impl)
    rows = math.prod(x.shape[:-1])
    single_xla = XLA_SINGLE_ROW and rows == 1 and not _act_quant(rows)
    if impl == "pallas" and SHARED_PROJECTION_LAUNCH and not single_xla and all(isinstance(w, Fp8Block) for w in ws):
        return fp8_matmul.fp8_matmul_many(x, [w.weight for w in ws], [w.scale for w in ws], interpret=_interpret(),
                                          act_quant=_act_quant(rows))
    return tuple(linear(x, w, impl) for w in ws)


def _act_quant(rows: int) -> bool:
    """Whether FP8 projections of `rows` rows run on E4M3 activations (FP8_ACT_QUANT)."""
    return FP8_ACT_QUANT and 1 <= rows <= fp8_config.DECODE_MAX_ROWS


def _precision(dtype):
    # f32 runs (tests, oracle parity) must not silently drop to TF32 / bf16 passes on the GPU.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def gdn_recurrence(q, k, v, g, beta, state, impl: str = "ref"):
    """Per-token gated delta rule for decode / verify (T small); see pallas_kernels/gdn.py."""
    check_impl(impl)
    if impl == "pallas":
        return gdn.gdn_recurrence(q, k, v, g, beta, state, interpret=_interpret())
    return gdn.gdn_recurrence_ref(q, k, v, g, beta, state)


def gdn_gates_in_kernel(impl: str) -> bool:
    """Whether decode / verify hand the raw gate projections to the recurrence kernel (GDN_GATES_IN_KERNEL)."""
    return impl == "pallas" and GDN_GATES_IN_KERNEL


def gdn_gates(a, b, a_log, dt_bias):
    """(g, beta) [B, T, Hv] f32 from the raw projections a, b and A_log, dt_bias [Hv] (MODEL_SPEC §3.6
    step 4); XLA under both impls (inside the recurrence kernel with GDN_GATES_IN_KERNEL)."""
    return gdn.gdn_gates_ref(a, b, a_log, dt_bias)


def gdn_recurrence_gated(q, k, v, a, b, a_log, dt_bias, state, n_valid, impl: str = "ref"):
    """gdn_recurrence with the gates computed from the raw projections a, b [B, T, Hv] and tokens
    t >= n_valid [B] left out (they cannot reach the state); see pallas_kernels/gdn.py."""
    check_impl(impl)
    if impl == "pallas":
        return gdn.gdn_recurrence_gated(q, k, v, a, b, a_log, dt_bias, state, n_valid, interpret=_interpret())
    return gdn.gdn_recurrence_gated_ref(q, k, v, a, b, a_log, dt_bias, state, n_valid)


def gdn_conv_in_kernel(impl: str) -> bool:
    """Whether decode / verify hand the raw in_proj_qkv output to the fused conv + recurrence kernel
    (GDN_CONV_IN_KERNEL)."""
    return impl == "pallas" and GDN_CONV_IN_KERNEL


def gdn_conv_recurrence(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, impl: str = "ref",
                        state_kept: bool = False, ba=None, slots=None):
    """Causal conv + SiLU + q/k L2 norms (q scaled by Dk^-0.5) + gates + the per-token recurrence from
    the raw in_proj_qkv output mixed [B, T, C] (channels q | k | v) and conv_state [B, W-1, C];
    tokens t >= n_valid [B] change neither state. Returns (o [B, T, Hv, Dv] f32, ssm state, conv
    state); see pallas_kernels/gdn_conv.py. The key-head count comes from the shapes:
    C = 2 Hk Dk + Hv Dv with Hv, Dk, Dv from state [B, Hv, Dk, Dv]. state_kept: the caller uses the
    input state afterwards (a replay), so the kernel writes a fresh one if GDN_REPLAY_FRESH_STATE.
    ba [B, T, 2 Hv] = [b | a] (with a = b = None): both gate projections as one array. slots int [B]:
    state [Ns, B, Hv, Dk, Dv] and conv_state [Ns, B, W-1, C] are slotted (GDN_STATE_SLOTS): read from
    each row's slot, every token's state written to the slots after it, in place."""
    check_impl(impl)
    hv, dk, dv = state.shape[-3:]
    kw = {"key_heads": (mixed.shape[-1] - hv * dv) // (2 * dk), "scale": dk ** -0.5}
    if impl == "pallas":
        config = gdn.RecurrenceConfig(block_v=GDN_CONV_BLOCK_V, num_warps=GDN_CONV_NUM_WARPS,
                                      form="hoisted" if GDN_CONV_HOISTED else "sequential")
        return gdn_conv.gdn_conv_recurrence(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid,
                                            interpret=_interpret(), config=config,
                                            in_place=slots is not None or not (state_kept and GDN_REPLAY_FRESH_STATE),
                                            ba=ba, slots=slots, **kw)
    return gdn_conv.gdn_conv_recurrence_ref(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, ba=ba,
                                            slots=slots, **kw)


def gdn_chunked(q, k, v, g, beta, state, impl: str = "ref"):
    """Chunked gated delta rule for prefill; same math as gdn_recurrence."""
    check_impl(impl)
    return gdn.gdn_chunked_ref(q, k, v, g, beta, state)


def paged_attention_op(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale, impl: str = "ref"):
    """Causal GQA attention of T queries over paged KV; see pallas_kernels/paged_attention.py."""
    check_impl(impl)
    if impl == "pallas" and q.shape[1] <= PAGED_ATTENTION_MAX_QUERIES:
        return paged_attention.paged_attention(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale,
                                               interpret=_interpret())
    return paged_attention.paged_attention_ref(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale)
