"""The whole target decode step at the Qwen3.5-27B shapes: impl="pallas" vs impl="ref", batch 1
and the Pallas path with one kernel launch per projection ("pallas_separate": what
`qmtp.ops.linear_many`'s shared launch saves) or with the FP8 tensor-core configuration for the
single row on the CUDA cores ("pallas_m1fma", the default before 2026-11-30; see fp8_config.M1_CUDA_CORE),
or with single FP8 rows on XLA's fused dequantize + dot ("pallas_m1xla", see ops.XLA_SINGLE_ROW), or
with the bf16 lm_head on the streaming kernel ("pallas_bf16stream", see ops.BF16_STREAMING), or with
the decode configs' block scales loaded per chunk ("pallas_nopreload", the default before 2026-11-30;
see fp8_config.SCALE_PRELOAD), or with bf16 activations entering the FP8 dots as bf16, each weight
converted E4M3 -> f16 -> bf16 ("pallas_noxf16", the default before 2026-11-30; see fp8_config.X_F16),
or with only the GDN gates and padding mask inside the recurrence kernel ("pallas_gdngated", see
ops.GDN_GATES_IN_KERNEL), or with the causal conv, SiLU, q/k norms and gates of every GDN layer as
XLA ops before the recurrence kernel ("pallas_gdnxla", the default before session 8; see
ops.GDN_CONV_IN_KERNEL), or with the split-K
heuristic aiming at 4 programs per SM instead of 2 ("pallas_pps4", see fp8_config.DECODE_PROGRAMS_PER_SM),
or with the narrow weights' W on the dot's M side at split-K 4 ("pallas_narrow_wm", the default before
2026-11-30; see fp8_config.NARROW_X_ON_M), or with the GDN state in two alternating slots so the conv
state is written in place ("pallas_plainslots", see ops.GDN_PLAIN_SLOTS).

Random FP8 block weights with the real shapes are generated on the device (no checkpoint: a 27B
FP8 tree is ~30 GB; the step time does not depend on the values), the KV cache holds `context`
positions, and `qmtp.decode.greedy_loop` (one jitted while_loop, as generation runs it) decodes
n_short and n_long tokens; the per-step time is the difference over (n_long - n_short), so
dispatch and the loop's set-up cancel. Both lengths share one compiled program.

Roofline (PERFORMANCE.md): the bytes a step must read = every target parameter except the
embedding table (one row is read) and the MTP subtree, + GDN and conv state read and written,
+ K and V of `context` positions in every attention layer; over the copy bandwidth measured in
the same run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import os
import time

import numpy as np


# name -> qmtp.ops.set_kernel_settings overrides of the defaults, for impl="pallas" (one measured
# policy changed each); `qmtp.bench --kernels` takes the same names, so a winning variant can be run
# end to end before it becomes a default
VARIANTS = {"pallas": {}, "pallas_separate": {"shared_projection_launch": False},
            "pallas_m1fma": {"fp8_m1_cuda_core": True}, "pallas_m1xla": {"xla_single_row": True},
            "pallas_bf16stream": {"bf16_streaming": True}, "pallas_nopreload": {"fp8_scale_preload": False},
            "pallas_noxf16": {"fp8_x_f16": False},
            "pallas_gdngated": {"gdn_gates_in_kernel": True, "gdn_conv_in_kernel": False},
            "pallas_gdnxla": {"gdn_conv_in_kernel": False},
            "pallas_pps4": {"fp8_decode_programs_per_sm": 4},
            "pallas_narrow_wm": {"fp8_narrow_x_on_m": False},
            "pallas_gdnbv16": {"gdn_conv_block_v": 16}, "pallas_gdnbv8": {"gdn_conv_block_v": 8},
            "pallas_gdnbv8w1": {"gdn_conv_block_v": 8, "gdn_conv_num_warps": 1},
            "pallas_a8": {"fp8_act_quant": True}, "pallas_gates_apart": {"fuse_gate_projections": False},
            "pallas_gdnsequential": {"gdn_conv_hoisted": False},
            "pallas_plainslots": {"gdn_plain_slots": True}, "pallas_untiled": {"fp8_tiled_weights": False},
            "pallas_xchunk": {"fp8_x_chunk_scaled": True},
            "pallas_untiled_xchunk": {"fp8_tiled_weights": False, "fp8_x_chunk_scaled": True}}


def variant_settings(name: str, defaults: dict) -> dict:
    """The kernel settings a step variant runs with: `defaults` with the variant's overrides."""
    return {**defaults, **VARIANTS.get(name, {})}


@functools.partial(__import__("jax").jit, static_argnums=(1, 2, 3))
def _leaf(key, shape, dtype, kind):
    """One parameter on the device. kind: fp8 (E4M3 spread over the format's range), scale (so each
    output has about unit variance), zero (norms: zero-centered; A_log, dt_bias), dense (1/sqrt(fan-in))."""
    import jax
    import jax.numpy as jnp
    if kind == "fp8":
        return (jax.random.normal(key, shape, jnp.float32) * 64.0).clip(-448, 448).astype(jnp.float8_e4m3fn)
    if kind == "zero":
        return jnp.zeros(shape, dtype)
    if kind == "scale":
        return jnp.full(shape, 1.0 / (64.0 * np.sqrt(shape[1] * 128)), dtype)
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[-1])).astype(dtype)


def random_params(cfg, dtype, seed: int = 0) -> dict:
    """A tree with `qmtp.params.abstract_params(cfg, dtype, fp8_linear=True)`'s structure, filled
    on the device."""
    import jax
    import jax.numpy as jnp

    from qmtp import params as qp
    from qmtp.fp8 import Fp8Block

    abstract = qp.abstract_params(cfg, dtype, fp8_linear=True)
    leaves, treedef = jax.tree_util.tree_flatten(abstract, is_leaf=lambda x: isinstance(x, Fp8Block))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, leaf in zip(keys, leaves):
        if isinstance(leaf, Fp8Block):
            out.append(Fp8Block(_leaf(key, leaf.weight.shape, jnp.float8_e4m3fn, "fp8"),
                                _leaf(key, leaf.scale.shape, jnp.float32, "scale")))
        else:
            kind = "zero" if leaf.dtype == jnp.float32 or len(leaf.shape) == 1 else "dense"
            out.append(_leaf(key, tuple(leaf.shape), leaf.dtype, kind))
    return jax.tree_util.tree_unflatten(treedef, out)


LAUNCH_KINDS = ("fusion", "custom-call", "all-reduce-start", "all-reduce", "all-gather", "copy",
                "dynamic-update-slice", "gather", "scatter")


def called_computations(hlo_text: str) -> set[str]:
    """Names of the computations other ops call (fused computations, reducers): their ops run inside
    those ops, not as launches of their own."""
    import re
    return set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo_text))


def count_launches(hlo_text: str) -> dict:
    """Top-level ops of an optimized HLO module by kind (fusions, custom calls: Pallas kernels and
    library GEMMs, collectives, copies): about the kernel launches of one step when the module is
    the decode loop (its body is one step; the few ops outside the loop are counted too). Ops inside
    computations that fusions, reductions or other ops call (calls= / to_apply=) run inside those
    ops and are not counted. A ~13 ms step over thousands of launches makes each launch's fixed
    cost matter."""
    import re
    blocks = re.split(r"\n(?=%|ENTRY )", hlo_text)
    called = called_computations(hlo_text)
    kinds = collections.Counter()
    pattern = re.compile(r"= \S+ (" + "|".join(re.escape(k) for k in LAUNCH_KINDS) + r")\(")
    for block in blocks:
        name = re.match(r"(?:ENTRY )?%([\w.\-]+)", block)
        if name and name.group(1) in called:
            continue
        kinds.update(pattern.findall(block))
    return dict(kinds, total=sum(kinds.values()))


def run(copy_tb_s: float, emit, *, quick: bool = False, interpret: bool = False, num_layers: int | None = None,
        context: int = 1024, n_short: int = 8, n_long: int = 40, impls=("pallas", "pallas_separate", "ref"), trials: int = 3,
        trace_dir: str | None = None, hlo_dir: str | None = None) -> None:
    """Emits one row per impl: s_per_step, tokens/s, share of the roofline, compile time, kernel
    launches per step; with trace_dir, a profiler trace of one timed run per impl; with hlo_dir, the
    compiled loop's optimized HLO per impl (gzip text: what each fusion of the step holds)."""
    import jax
    import jax.numpy as jnp

    from qmtp import config as qc
    from qmtp import api, bench_report, decode, ops, weight_layout
    from qmtp.state import init_state
    from qmtp.tools import make_checkpoint

    del interpret  # qmtp.ops chooses interpret mode itself on a CPU backend
    preset = "tiny" if quick else "qwen3_5_27b"
    if quick:
        num_layers, context, n_short, n_long, trials = num_layers or 4, 40, 2, 6, 1
    cfg = qc.from_dict(make_checkpoint.build_config(preset, "fp8", 0, num_layers))
    t0 = time.perf_counter()
    params = jax.block_until_ready(random_params(cfg, jnp.bfloat16))
    gen_s = time.perf_counter() - t0
    page = 16
    pages = -(-(context + n_long + 1) // page)
    state0 = init_state(cfg, np.arange(pages, dtype=np.int32)[None], pages, page, jnp.bfloat16)
    parts = bench_report.step_bytes(params, state0, context)["target"]  # the harness's own accounting
    total = sum(parts.values())
    roofline_s = total / (copy_tb_s * 1e12)
    case = f"{cfg.num_hidden_layers} layers B=1 ctx={context}"
    spec = decode.LoopSpec(n_long, ())
    first = jnp.zeros((1,), jnp.int32)
    defaults = ops.kernel_settings()

    for name in impls:
        # variants of impl="pallas" with one of the measured policies changed (VARIANTS);
        # jax.clear_caches() so the loop is traced again under the setting
        impl = "ref" if name == "ref" else "pallas"
        ops.set_kernel_settings(variant_settings(name, defaults))
        jax.clear_caches()
        # the tree qmtp.load would hand this variant (the gate projections joined at load or not)
        run_params = api.fuse_gate_projections(params) if ops.FUSE_GATE_PROJECTIONS else params
        if impl == "pallas" and ops.FP8_TILED_WEIGHTS:  # and its FP8 weights tiled at load, or not
            run_params = weight_layout.tile_fp8_weights(run_params, donate=False)
        row = {"kernel": "decode_step", "case": case, "impl": name, "preset": preset,
               "kernel_settings": ops.kernel_settings(),
               "num_layers": cfg.num_hidden_layers, "context": context, "bytes": total, "bytes_by_part": parts,
               "roofline_s": roofline_s, "param_generation_s": gen_s}
        try:
            def fresh_state():
                state = init_state(cfg, np.arange(pages, dtype=np.int32)[None], pages, page, jnp.bfloat16)
                return dataclasses.replace(state, lengths=jnp.full((1,), context, jnp.int32))  # KV holds context

            t = time.perf_counter()
            # one compile: its optimized HLO gives the launch count, the executable runs every timing
            compiled = decode.greedy_loop.lower(cfg, spec, run_params, fresh_state(), first, jnp.ones((1,), jnp.int32),
                                                impl=impl).compile()
            hlo = compiled.as_text()
            row["launches_per_step"] = count_launches(hlo)
            if hlo_dir:
                os.makedirs(hlo_dir, exist_ok=True)
                row["hlo"] = os.path.join(hlo_dir, f"{name}.hlo.txt.gz")
                with gzip.open(row["hlo"], "wt") as f:
                    f.write(hlo)

            def once(n):
                state = fresh_state()
                t = time.perf_counter()
                out = compiled(run_params, state, first, jnp.full((1,), n, jnp.int32))
                jax.block_until_ready(out)
                return time.perf_counter() - t, int(out[2])

            once(n_short)  # warm up
            row["compile_s"] = time.perf_counter() - t
            short = [once(n_short) for _ in range(trials)]
            long = [once(n_long) for _ in range(trials)]
            steps = long[0][1] - short[0][1]
            per = (float(np.median([s for s, _ in long])) - float(np.median([s for s, _ in short]))) / steps
            row.update(s_per_call=per, s_per_step=per, tokens_per_s=1.0 / per, tb_s=total / per / 1e12,
                       share_of_copy=total / per / 1e12 / copy_tb_s, share_of_roofline=roofline_s / per,
                       steps_timed=steps)
            if trace_dir:  # one n_long run under the profiler (perfetto JSON: scripts/trace_summary.py)
                with jax.profiler.trace(os.path.join(trace_dir, name), create_perfetto_trace=True):
                    once(n_long)
                row["trace_dir"] = os.path.join(trace_dir, name)
        except Exception as e:
            row["error"] = repr(e)[:1000]
        emit(row)
    ops.set_kernel_settings(defaults)
