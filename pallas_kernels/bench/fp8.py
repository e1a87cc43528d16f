"""FP8 block matmul at the Qwen3.5-27B shapes: Pallas kernels vs the XLA paths.

For every FP8 weight shape of the 27B target ([O, I] and how many of it one decode step reads,
PROJECTIONS) and every row count M:
  - decode rows (1-128: one token, K+1 verify tokens, batches): one jitted program runs a
    lax.fori_loop of `reps` iterations, each calling the matmul on n distinct weights of that shape
    (n chosen so they hold >= 8x the L2 cache, so no weight is re-read from L2); the outputs feed a
    tiny update of x, so nothing is hoisted. Figure: tb_s = O*I bytes / time per matmul, as a share
    of the copy bandwidth; the same formula for the XLA rows so they compare by time. weight_tb_s
    counts the bytes the row's weights really have (2 per weight for the bf16 rows).
  - prefill rows (>= 1024): TFLOP/s = 2 M O I / time, against XLA's bf16 matmul on the same shape
    (weights pre-dequantized to bf16: the best XLA can do) and XLA's dequantize-then-matmul.
impl: pallas (the default config, plus candidate_configs with `sweep`), pallas_a8 (decode rows: E4M3
activations, `act_quant=True`; rel_err_a8 against fp8_act_quant's reference), xla (fp8_matmul_ref:
dequantize + einsum), xla_bf16 (bf16 weights, plain einsum), dequant_dot (prefill rows: a
materialized bf16 dequantize, then XLA's dot, on the weights as the engine loads them: tiled where they
tile, whatever --fp8_layout says; from the checkpoint layout the kernel would first copy them into
tiles). rel_err: max |y - y_ref| / max |y_ref| of the first
output against exact x. A per-step aggregate weights each shape by its count in a decode step.
"""

from __future__ import annotations

import collections
import functools
import math

from pallas_kernels.bench.common import L2_BYTES, timed

DECODE_MS = (1, 4, 5, 16)
PREFILL_MS = (1024, 4096)
# The 27B target's FP8 projections per layer kind ([O, I]) and its layers of each kind (the MTP head
# and the bf16 lm_head aside); tests/test_bench_fp8_launches.py checks them against the model's tree.
PROJECTIONS = {
    "gdn": {"in_proj_qkv": (10240, 5120), "in_proj_z": (6144, 5120), "out_proj": (5120, 6144),
            "mlp_gate": (17408, 5120), "mlp_up": (17408, 5120), "mlp_down": (5120, 17408)},
    "attn": {"q_proj": (12288, 5120), "k_proj": (1024, 5120), "v_proj": (1024, 5120), "o_proj": (5120, 6144),
             "mlp_gate": (17408, 5120), "mlp_up": (17408, 5120), "mlp_down": (5120, 17408)},
}
LAYERS = {"gdn": 48, "attn": 16}


def step_shapes() -> dict[tuple[int, int], list[str]]:
    """{(O, I): [tensor keys, one per weight a decode step reads]} of the 27B target."""
    shapes: dict = collections.defaultdict(list)
    for kind, projections in PROJECTIONS.items():
        for _ in range(LAYERS[kind]):
            for key, shape in projections.items():
                shapes[shape].append(f"{kind}.{key}")
    return dict(shapes)


def make_weights(o: int, i: int, n: int, seed: int):
    """n distinct [O, I] E4M3 weights (values spread over the E4M3 range) and their scale grids."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def one(key):
        kw, ks = jax.random.split(key)
        w = (jax.random.normal(kw, (o, i), jnp.float32) * 64.0).clip(-448, 448).astype(jnp.float8_e4m3fn)
        s = jax.random.uniform(ks, (-(-o // 128), -(-i // 128)), jnp.float32, 1e-4, 2e-4)
        return w, s

    pairs = [one(k) for k in jax.random.split(jax.random.key(seed), n)]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def loop_program(matmul, reps: int, full_sum: bool):
    """jit(x, ws, ss): fori_loop over reps; each iteration y_k = matmul(x, ws[k], ss[k]) for all k.
    Pallas outputs are sliced (XLA cannot narrow a custom call). XLA outputs are reduced in full with
    a max, so XLA can neither shrink the matmul to the columns used nor reassociate it (a sum over
    the outputs would let it compute x @ (W^T 1), a plain reduction of W)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def prog(x, ws, ss):
        def body(_, carry):
            x, acc = carry
            ys = [matmul(x, w, s) for w, s in zip(ws, ss)]
            if full_sum:
                tot = sum(jnp.max(y.astype(jnp.float32), axis=-1, keepdims=True) for y in ys)
            else:
                tot = sum(y[:, :1].astype(jnp.float32) for y in ys)
            return x + (tot * 1e-30).astype(x.dtype), acc + jnp.sum(tot)

        return jax.lax.fori_loop(0, reps, body, (x, jnp.float32(0)))

    return prog


def _pinned_dequantize(matmul):
    """matmul with the scale tied to x (times 1 + 0 * x[0, 0]: the same values), so the dequantize
    of a loop-invariant weight cannot be hoisted out of the timing loop by XLA."""
    import jax.numpy as jnp

    def mm(x, w, s):
        return matmul(x, w, s * (1.0 + 0.0 * x.reshape(-1)[0].astype(jnp.float32)))

    return mm


def candidate_configs(m: int) -> list:
    """Tile configs the sweep tries besides the default (compile time: a few seconds each): around the
    default's tiles, x form and pipeline depth."""
    from pallas_kernels.fp8_config import DECODE_MAX_ROWS, X_F16_SCALED_MIN_ROWS, DecodeConfig, PrefillConfig
    if m > 16:
        gemm = [PrefillConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, split_k=sk, x_f16_scaled=True)
                for bm, bn, nw, ns, sk in [(64, 128, 4, 3, 1), (64, 128, 4, 4, 1), (64, 128, 8, 3, 1),
                                           (128, 128, 8, 3, 1), (64, 64, 4, 4, 1), (32, 128, 4, 4, 1),
                                           (256, 128, 8, 3, 1), (64, 128, 4, 3, 2), (64, 64, 4, 4, 2),
                                           (64, 128, 4, 3, 4), (64, 128, 4, 3, 8)]]
        if m > DECODE_MAX_ROWS:
            return gemm
        # a batched verify on the decode grid: one scaled f16 piece per row; fewer, longer programs read
        # less of the x slices, more splits fill the SMs, 128-row programs read x once per 128 weight rows
        return gemm + [DecodeConfig(block_o=bo, split_k=sk, swap_ab=sw, num_warps=nw, num_stages=ns, x_f16=True,
                                    x_f16_scaled=True)
                       for bo, sk, sw, nw, ns in [(64, 8, True, 4, 4), (64, 4, True, 4, 3), (64, 2, True, 4, 4),
                                                  (64, 1, True, 4, 4), (64, 4, False, 4, 4), (64, 4, True, 8, 4),
                                                  (64, 8, True, 4, 3), (64, 4, True, 4, 2), (128, 4, True, 8, 3),
                                                  (128, 8, True, 8, 3), (128, 4, True, 4, 3), (128, 8, True, 8, 2),
                                                  (128, 16, True, 8, 3)]]
    scaled = m >= X_F16_SCALED_MIN_ROWS
    # (block_o, split_k, swap_ab, num_warps, num_stages, scale_preload)
    tiles = [(64, 2, False, 4, 4, True), (64, 2, True, 4, 4, True), (64, 4, True, 4, 4, True),
             (64, 1, False, 4, 4, True), (128, 2, False, 8, 4, True), (128, 2, True, 8, 3, True),
             (64, 2, False, 4, 6, True), (32, 2, True, 4, 4, True), (64, 2, False, 4, 4, False),
             # narrow O (80 row blocks): shorter programs, more of them, around the 3-stage default
             (64, 4, False, 4, 3, True), (64, 16, False, 4, 3, True), (32, 8, False, 4, 3, True),
             (32, 16, False, 4, 3, True), (64, 8, False, 8, 3, True), (128, 8, False, 8, 3, True),
             (64, 8, False, 2, 3, True), (64, 8, False, 4, 4, True), (64, 8, False, 4, 2, True),
             # splits that are no power of two (o_proj's 48 chunks in runs of 8 / 4): how programs fall on SMs
             (64, 6, False, 4, 3, True), (64, 12, False, 4, 3, True), (128, 12, False, 8, 3, True)]
    return [DecodeConfig(block_o=bo, split_k=sk, swap_ab=sw, num_warps=nw, num_stages=ns, scale_preload=pre,
                         x_f16=True, x_f16_scaled=scaled)
            for bo, sk, sw, nw, ns, pre in tiles]


def a8_candidate_configs() -> list:
    """Tiles the E4M3-activation sweep tries (`a8_sweep`): W on the dot's M side (Triton's FP8 wgmma
    takes 64 rows per warpgroup there), block_o 64 with one warpgroup or 128 with one or two,
    split-K 1-8; without the weight conversion the kernel may want fewer, longer programs."""
    from pallas_kernels.fp8_config import DecodeConfig
    return [DecodeConfig(block_o=bo, split_k=sk, swap_ab=True, num_warps=nw, num_stages=4, scale_preload=True)
            for bo, nw in ((64, 4), (128, 4), (128, 8)) for sk in (1, 2, 4, 8)]


def run(copy_tb_s: float, emit, *, quick: bool = False, interpret: bool = False, sweep: bool = False,
        sweep_match: str = "", xla: bool = True, decode_ms=DECODE_MS, prefill_ms=PREFILL_MS, only_shapes=(), reps: int = 8,
        trials: int = 5, device_time: bool = True, a8_sweep: bool = False, layout: str = "checkpoint") -> dict:
    """Emits one row per (shape, M, impl[, config]); returns the per-step aggregate per M (from the
    wall clock, and from the kernels' device time where measured: "kernel_" keys).

    sweep: the Pallas rows also try candidate_configs(M) (only those whose repr contains sweep_match);
    a8_sweep: the E4M3-activation rows also try a8_candidate_configs() (decode rows).
    layout: "checkpoint" ([O, I]) or "tiled" (fp8_layout.tile_as_loaded: the engine's tiles; a shape of
    no whole number of tiles stays [O, I]): the weights the Pallas rows read; the XLA rows read [O, I].
    device_time: the default Pallas configs also run once under the profiler (GPU only), which adds
    kernel_s_per_call (the Pallas kernel's own launches), busy_s_per_call (every kernel of a call, the
    split-K sum and the x pieces included, without the idle gaps between launches) and their shares
    of copy, next to the wall-clock s_per_call (trace_events)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import fp8_act_quant, fp8_config, fp8_layout, fp8_matmul as fm

    shapes = {(272, 300): ["ragged"], (130, 129): ["ragged"]} if quick else step_shapes()
    if only_shapes:
        shapes = {s: shapes.get(s, ["other"]) for s in only_shapes}  # e.g. a fused gate+up shape
    if quick:
        # the quick prefill just past the decode kernel's rows, so the GEMM and dequant_dot rows run
        decode_ms, prefill_ms, reps, trials = (1, 5), (fp8_config.DECODE_MAX_ROWS + 8,), 1, 1
    ref = jax.jit(lambda x, w, s: fm.fp8_matmul_ref(x, w, s))
    ref_a8 = jax.jit(lambda x, w, s: fp8_act_quant.fp8_matmul_act_ref(x, w, s))
    pallas_default: dict = collections.defaultdict(dict)  # m -> {(o, i): s_per_call}
    pallas_kernel: dict = collections.defaultdict(dict)  # m -> {(o, i): kernel_s_per_call}
    for si, ((o, i), keys) in enumerate(shapes.items()):
        # weights rotated per call so that none is read from L2; one far past L2 needs few
        n = 2 if quick else 4 if o * i >= 8 * L2_BYTES else min(96, max(16, math.ceil(8 * L2_BYTES / (o * i))))
        ws, ss = make_weights(o, i, n, seed=si)
        ws_loaded = tuple(fp8_layout.tile_as_loaded(w) for w in ws)  # the engine's layout (dequant_dot)
        loaded_tiled = fp8_layout.tile_rows_for(o, i) is not None
        tiled = layout == "tiled" and loaded_tiled
        ws_pallas = ws_loaded if tiled else ws
        bf16 = None
        for m in (*decode_ms, *prefill_ms):
            x = jax.random.normal(jax.random.key(m), (m, i), jnp.float32).astype(jnp.bfloat16)
            want = np.asarray(ref(x, ws[0], ss[0]), np.float64)
            default = fp8_config.default_config(m, o, i, tile_rows=fm.tile_rows(ws_pallas))  # as the model's launch
            runs = [("pallas", None)]
            if sweep:
                runs += [("pallas", c) for c in candidate_configs(m) if sweep_match in repr(c) and c != default]
            a8_default = None
            if m <= fp8_config.DECODE_MAX_ROWS:  # E4M3 activations (an approximation of x)
                a8_default = fp8_config.act_quant_config(m, o, i)
                runs.append(("pallas_a8", a8_default))
                if a8_sweep:
                    runs += [("pallas_a8", c) for c in a8_candidate_configs() if c != a8_default]
            if xla:
                runs += [("xla", None), ("xla_bf16", None)]
            if m > fp8_config.DECODE_MAX_ROWS:
                runs += [("dequant_dot", None)]
            for impl, config in runs:
                row = {"kernel": "fp8_matmul", "case": f"{o}x{i} M={m}", "o": o, "i": i, "m": m, "impl": impl,
                       "tensors": sorted(set(keys)), "count_per_step": len(keys), "n_weights": n,
                       "layout": "tiled" if (impl.startswith("pallas") and tiled
                                             or impl == "dequant_dot" and loaded_tiled) else "checkpoint"}
                try:
                    if impl.startswith("pallas"):
                        a8 = impl == "pallas_a8"
                        cfg = config or default
                        row.update(config=repr(cfg), default=config is None or config == a8_default)
                        mm = functools.partial(fm.fp8_matmul, config=cfg, interpret=interpret, act_quant=a8)
                        prog, args = loop_program(mm, reps, False), (x, ws_pallas, ss)
                    elif impl in ("xla", "dequant_dot"):
                        mm = (fm.fp8_matmul_ref if impl == "xla"
                              else functools.partial(fm.fp8_matmul_dequant_dot, interpret=interpret))
                        weights = ws_loaded if impl == "dequant_dot" else ws
                        prog, args = loop_program(_pinned_dequantize(mm), reps, True), (x, weights, ss)
                    else:
                        if bf16 is None:
                            deq = jax.jit(lambda w, s: fm.dequantize_ref(w, s, jnp.bfloat16))
                            bf16 = tuple(deq(w, s) for w, s in zip(ws, ss))
                        mm = lambda x, w, s: jnp.einsum("mi,oi->mo", x, w,  # noqa: E731
                                                        preferred_element_type=jnp.float32)
                        prog, args = loop_program(mm, reps, True), (x, bf16, ss)
                    got = np.asarray(jax.jit(mm)(x, args[1][0], ss[0]).astype(jnp.float32), np.float64)
                    row["rel_err"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                    if impl == "pallas_a8":  # against its own reference (rel_err above: against exact x)
                        want_a8 = np.asarray(ref_a8(x, ws[0], ss[0]), np.float64)
                        row["rel_err_a8"] = float(np.max(np.abs(got - want_a8)) / max(np.max(np.abs(want_a8)), 1e-30))
                    med, best = timed(prog, *args, trials=trials)
                    per = med / (reps * n)
                    weight_bytes = o * i * (2 if impl == "xla_bf16" else 1)
                    row.update(s_per_call=per, best_s_per_call=best / (reps * n), bytes=o * i,
                               tb_s=o * i / per / 1e12, share_of_copy=o * i / per / 1e12 / copy_tb_s,
                               weight_tb_s=weight_bytes / per / 1e12, tflop_s=2 * m * o * i / per / 1e12)
                    if device_time and impl.startswith("pallas") and row["default"]:
                        row.update(_device_figures(prog, args, reps * n, o * i, copy_tb_s))
                    if impl == "pallas" and config is None:
                        pallas_default[m][(o, i)] = per
                        if "kernel_s_per_call" in row:
                            pallas_kernel[m][(o, i)] = row["kernel_s_per_call"]
                except Exception as e:  # record and go on: one failing config must not hide the others
                    row["error"] = repr(e)[:1000]
                emit(row)
        del ws, ws_pallas, ss, bf16

    aggregate = {}
    for m, times in pallas_default.items():
        if len(times) == len(shapes):
            aggregate[m] = _aggregate(times, shapes, copy_tb_s, "")
            if len(pallas_kernel[m]) == len(shapes):
                aggregate[m].update(_aggregate(pallas_kernel[m], shapes, copy_tb_s, "kernel_"))
    return aggregate


def _aggregate(times: dict, shapes: dict, copy_tb_s: float, key: str) -> dict:
    """All FP8 matmuls of one step: each shape's time per call times its count per step."""
    total_bytes = sum(o * i * len(shapes[(o, i)]) for o, i in times)
    total_s = sum(t * len(shapes[shape]) for shape, t in times.items())
    return {f"{key}s_per_step": total_s, f"{key}tb_s": total_bytes / total_s / 1e12,
            f"{key}share_of_copy": total_bytes / total_s / 1e12 / copy_tb_s}


def _device_figures(prog, args, calls: int, nbytes: int, copy_tb_s: float) -> dict:
    """Per call, from one profiled run of the timing loop: the Pallas kernel's device time and the
    busy time of every kernel (trace_events.device_time), with their bandwidth and share of copy."""
    from pallas_kernels.bench import trace_events
    got = trace_events.device_time(prog, *args, prefix="fp8_matmul")
    if not got or not got["kernel_launches"]:
        return {}
    out = {"kernel_launches_per_call": got["kernel_launches"] / calls}
    for name in ("kernel", "busy"):
        per = got[f"{name}_s"] / calls
        out.update({f"{name}_s_per_call": per, f"{name}_tb_s": nbytes / per / 1e12,
                    f"{name}_share_of_copy": nbytes / per / 1e12 / copy_tb_s})
    return out


def best_configs(rows: list[dict]) -> dict:
    """Fastest exact pallas config per (shape, M) among the rows (for choosing defaults)."""
    best: dict = {}
    for r in rows:
        if r.get("kernel") == "fp8_matmul" and r["impl"] == "pallas" and "tb_s" in r and r.get("rel_err", 1) < 1e-2:
            key = r["case"]
            if key not in best or r["tb_s"] > best[key]["tb_s"]:
                best[key] = {"config": r["config"], "tb_s": r["tb_s"], "share_of_copy": r["share_of_copy"],
                             "default_tb_s": best.get(key, {}).get("default_tb_s")}
            if r.get("default"):
                best[key]["default_tb_s"] = r["tb_s"]
    return best
