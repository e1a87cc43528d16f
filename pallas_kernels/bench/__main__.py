"""`python -m pallas_kernels.bench`: the kernels at the Qwen3.5-27B shapes on the GPU, in one run.

Prints, in one process: the copy bandwidth (the ceiling every figure is a share of), then for each
part the Pallas kernel's time, achieved bandwidth (or TFLOP/s for prefill GEMMs) and share of the
copy bandwidth next to the XLA path on the same shapes, and a summary table at the end. Every row
is also written to --out as it is measured (a run cut by a time limit keeps what it measured).

Parts: fp8 (block matmul, every FP8 shape of the 27B decode step at --fp8_ms rows, prefill rows against
XLA's bf16 matmul; --fp8_sweep times candidate tile configs), fp8_launches (the step's FP8 launches as
it makes them, projections of one x sharing a launch, at --fp8_launch_ms rows, against the 80%-of-copy
target and each launch's read floor), gdn (the conv + recurrence kernel at batch 1-16, chunked prefill),
attention (paged attention for 1..K+1 queries at 1K-32K context; a 2048-token prefill chunk's
tile configs at 8K and 32K), moe (the grouped expert matmul at the
35B-A3B shapes, decode and verify blocks, a prefill chunk against XLA's ragged dot; --moe_sweep times
candidate tiles). `--quick --interpret`
runs a CPU smoke test of the harness (no figures mean anything there).

    JAX_PLATFORMS=cuda PYTHONPATH=. python -m pallas_kernels.bench --out=$OUT/bench.json
    JAX_PLATFORMS=cuda PYTHONPATH=. python -m pallas_kernels.bench --parts=fp8 --fp8_sweep
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from pallas_kernels.bench.attention import PREFILL_CONFIGS
from pallas_kernels.bench.fp8_launches import LAYOUTS

PARTS = ("fp8", "fp8_launches", "gdn", "attention", "moe")

flags.DEFINE_list("parts", list(PARTS), f"Which parts to run, in order: any of {', '.join(PARTS)}.")
flags.DEFINE_string("out", "bench.json", "JSON file with every row, the copy bandwidth and the versions.")
flags.DEFINE_bool("quick", False, "Minimal cases and sizes (with --interpret: a CPU smoke test of the harness).")
flags.DEFINE_bool("interpret", False, "Run the Pallas kernels in interpret mode (CPU; figures are meaningless).")
flags.DEFINE_bool("fp8_sweep", False, "fp8: also time candidate tile configs (a few seconds of compile each).")
flags.DEFINE_string("fp8_sweep_match", "", "fp8: with --fp8_sweep, only the candidate configs whose repr contains "
                    "this text (e.g. 'num_stages=3').")
flags.DEFINE_bool("fp8_a8_sweep", False, "fp8: also time the E4M3-activation rows (impl pallas_a8) over "
                  "a8_candidate_configs (W on the dot's M side, block_o 64/128, 4/8 warps, split-K 1-8).")
flags.DEFINE_bool("xla", True, "fp8: also time the XLA paths (dequantize + matmul, and bf16 weights).")
flags.DEFINE_list("fp8_ms", ["1", "4", "5", "16"], "fp8: rows (M) of the decode / verify cases.")
flags.DEFINE_list("fp8_shapes", [], "fp8: only these weight shapes, OxI (default: every FP8 shape of the 27B step; "
                  "others allowed).")
flags.DEFINE_enum("fp8_layout", "checkpoint", list(LAYOUTS), "fp8: the weight layout the Pallas rows read: "
                  "checkpoint ([O, I] as stored) or tiled (fp8_layout's tiles, as the engine lays them out).")
flags.DEFINE_list("fp8_prefill_ms", ["1024", "4096"], "fp8: rows of the prefill GEMM cases (empty: none).")
flags.DEFINE_bool("fp8_device_time", True, "fp8, fp8_launches: also time the default Pallas configs by their device "
                  "time in a profiler trace (GPU only): the kernel alone, and every kernel of a call without the idle "
                  "gaps between launches (kernel_* and busy_* keys), next to the wall-clock figure.")
flags.DEFINE_list("fp8_launch_ms", ["1", "4", "16"], "fp8_launches: rows (M) of each launch.")
flags.DEFINE_bool("fp8_launch_floor", True, "fp8_launches: also time each launch's read floor (a kernel that only "
                  "reads the same bytes in one launch, read_floor.py) and each launch's share of it.")
flags.DEFINE_list("fp8_launch_layouts", ["tiled"], "fp8_launches: weight layouts to time each launch on: "
                  "tiled (fp8_layout's tiles, as the engine lays them out) and / or checkpoint ([O, I] as stored); "
                  "with tiled the read floor also times tiled bytes.")
flags.DEFINE_list("gdn_cases", ["conv", "prefill"], "gdn: which cases: conv (the conv + recurrence kernel and its "
                  "tile sweep), prefill (the chunked form).")
flags.DEFINE_list("gdn_prefill_chunks", ["64"], "gdn: chunk sizes of the prefill case's WY form (powers of two; "
                  "the model's is gdn_chunked_ref's default, 64), one row each.")
flags.DEFINE_list("gdn_chain_configs", ["64x8"], "gdn: the prefill case's chain kernel configs (gdn_chunked), "
                  "BVxWARPS, one pallas row each.")
flags.DEFINE_list("gdn_batches", [], "gdn: sequences per call of the conv case (default 1, 8, 16).")
flags.DEFINE_list("gdn_tokens", [], "gdn: tokens per sequence of the conv case (default 1, 4, 5).")
flags.DEFINE_list("gdn_conv_configs", [], "gdn: the conv case's kernel configs, BVxWARPS (default: a tile sweep).")
flags.DEFINE_enum("attention_cases", "both", ["decode", "prefill", "both"], "attention: decode / verify "
                  "queries (1-5 per sequence), a prefill chunk's 2048 (one row per --attention_prefill_configs), "
                  "or both.")
flags.DEFINE_list("attention_prefill_configs", list(PREFILL_CONFIGS), "attention: the prefill "
                  "tile configs, ROWSxWARPSxBKxSTAGES (query rows per program, warps, keys per step, stages; the "
                  "first is the default's).")
flags.DEFINE_list("attention_prefill_tokens", [str(2048)], "attention: the prefill case's new tokens at the end of "
                  "each context (2048: a prefill chunk; 128: a serving piece beside decoding streams).")
flags.DEFINE_bool("moe_sweep", False, "moe: also time candidate ExpertMatmulConfigs (block_o, split_k, warps, "
                  "stages).")
flags.DEFINE_float("copy_gib", 4.0, "Size of the f32 array of the copy-bandwidth measurement.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax

    from pallas_kernels.bench import common

    unknown = [p for p in FLAGS.parts if p not in PARTS]
    if unknown:
        print(f"error: --parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    bad = [x for x in FLAGS.fp8_launch_layouts if x not in LAYOUTS]
    if bad or not FLAGS.fp8_launch_layouts:
        print(f"error: --fp8_launch_layouts: {', '.join(bad) or 'empty'}; choose from {', '.join(LAYOUTS)}",
              file=sys.stderr)
        return 2
    rec = common.Recorder(FLAGS.out, {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
                                      "flags": {f: getattr(FLAGS, f) for f in ("parts", "quick", "interpret")},
                                      "xla_flags": os.environ.get("XLA_FLAGS", "")})
    copy = common.copy_bandwidth(0.0625 if FLAGS.quick else FLAGS.copy_gib, 3 if FLAGS.quick else 10)
    rec.set("copy", copy)
    tb = copy["tb_per_s"]
    opts = dict(quick=FLAGS.quick, interpret=FLAGS.interpret)
    launches = None  # the fp8_launches part's result, for its target lines at the end
    for part in FLAGS.parts:
        print(f"== {part}", file=sys.stderr, flush=True)
        if part == "fp8":
            from pallas_kernels.bench import fp8
            agg = fp8.run(tb, rec.emit, sweep=FLAGS.fp8_sweep, sweep_match=FLAGS.fp8_sweep_match, xla=FLAGS.xla,
                          decode_ms=[int(m) for m in FLAGS.fp8_ms],
                          prefill_ms=[int(m) for m in FLAGS.fp8_prefill_ms if m],
                          only_shapes=[tuple(int(v) for v in s.split("x")) for s in FLAGS.fp8_shapes],
                          device_time=FLAGS.fp8_device_time, a8_sweep=FLAGS.fp8_a8_sweep, layout=FLAGS.fp8_layout,
                          **opts)
            rec.set("fp8_step_aggregate", {str(k): v for k, v in agg.items()})
            if FLAGS.fp8_sweep:
                rec.set("fp8_best_configs", fp8.best_configs(rec.results["rows"]))
        elif part == "fp8_launches":
            from pallas_kernels.bench import fp8_launches
            launches = fp8_launches.run(tb, rec.emit, decode_ms=[int(m) for m in FLAGS.fp8_launch_ms],
                                        device_time=FLAGS.fp8_device_time, floor=FLAGS.fp8_launch_floor,
                                        layouts=tuple(FLAGS.fp8_launch_layouts), **opts)
            rec.set("fp8_launches", {key: {str(m): v for m, v in val.items()} for key, val in launches.items()})
        elif part == "gdn":
            from pallas_kernels.bench import gdn
            gdn.run(tb, rec.emit, cases=tuple(FLAGS.gdn_cases), batches=tuple(int(b) for b in FLAGS.gdn_batches),
                    tokens=tuple(int(t) for t in FLAGS.gdn_tokens), conv_configs=tuple(FLAGS.gdn_conv_configs),
                    prefill_chunks=tuple(int(c) for c in FLAGS.gdn_prefill_chunks),
                    chain_configs=tuple(FLAGS.gdn_chain_configs), **opts)
        elif part == "moe":
            from pallas_kernels.bench import moe
            moe.run(tb, rec.emit, sweep=FLAGS.moe_sweep, **opts)
        else:
            from pallas_kernels.bench import attention
            if FLAGS.attention_cases in ("decode", "both"):
                attention.run(tb, rec.emit, **opts)
            if FLAGS.attention_cases in ("prefill", "both"):
                attention.run_prefill(tb, rec.emit, configs=tuple(FLAGS.attention_prefill_configs),
                                      tokens=tuple(int(t) for t in FLAGS.attention_prefill_tokens), **opts)
    print(f"\ncopy bandwidth {copy['tb_per_s']:.3f} TB/s (fastest of the trials; median "
          f"{copy['tb_per_s_median']:.3f}), {copy['bytes'] / 2**30:.1f} GiB moved per pass")
    print(common.summary_table(rec.results["rows"]))
    if "fp8_step_aggregate" in rec.results:
        print("fp8 matmuls of one 27B decode step (default configs):",
              json.dumps(rec.results["fp8_step_aggregate"]))
    if launches is not None:
        from pallas_kernels.bench import fp8_launches
        print("\n".join(fp8_launches.target_lines(launches)))
    return 0


if __name__ == "__main__":
    app.run(main)
