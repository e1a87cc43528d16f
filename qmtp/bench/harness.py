"""The benchmark harness: python -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags

In one process, on the same prompts: the copy bandwidth (the ceiling every share is quoted
against), plain greedy decoding, MTP K = 1..4 with natural acceptance, and MTP with the accepted
drafts capped by a seeded acceptance profile (default 0.85 / 0.70 / 0.57 cumulative per position,
what Qwen 3.x heads show on code). Every mode's programs compile first, all at once on threads (one
device), then each mode runs --repeats times after a warm-up run (compile times reported separately);
every mode's tokens must equal plain greedy's (a mismatch fails the run, exit status 1). With
--temperature > 0 every mode samples (speculative sampling with MTP: the same distribution, not the
same tokens, so no token check), seeded by --seed: acceptance and speed under sampling.

Per mode: decode tokens/s = sum(output_tokens - 1) / sum(wall - TTFT) (median, min, max over the
repeats), TTFT, mean accepted length, per-position acceptance, speedup over plain, share of the
bandwidth roofline (`qmtp.bench.report`), peak device memory. Writes one JSON (config, versions,
platform, device, figures, raw timings) and one PNG plot per case (tokens/s vs K, natural and profiled,
with the roofline and the MTP ceilings on a GPU; on a CPU the copy bandwidth is no ceiling, since a small
model's weights stay in cache, and neither plot nor table quotes one); with several --batch sizes, one
more of tokens/s against batch, one line per mode (`<plot>_batches.png`). Output paths are checked
before anything runs. `--engine=ref` runs the pure-XLA path, `--engine=pallas` the
kernels, `--engine=pallas,ref` both on the same loaded weights with a comparison table; on the CPU the tiny presets give a quick smoke run (configs/bench_tiny.flags).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time

from absl import flags

from qmtp import cli_help
from qmtp.bench.cases import ENGINES, Progress, bench_case, memory, sampling

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "preset:qwen3_5_27b_controlled:fp8",
                    "Checkpoint directory, or preset:NAME[:DTYPE] (a synthetic checkpoint built on first use into "
                    "the cache; the *_controlled presets give 100% natural acceptance so profiles can be imposed).")
flags.DEFINE_integer("num_layers", None, "Presets only: build a slice with this many decoder layers (default: all).")
flags.DEFINE_list("engine", ["pallas"], "Kernel paths, comma-separated: 'pallas' (Pallas kernels), 'ref' (pure XLA), "
                  "'deterministic' (the Pallas kernels with row-invariant projections, --deterministic of "
                  "qmtp.generate); several run the same cases on the same loaded weights, and a comparison table "
                  "follows.")
flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (devices).", lower_bound=1)
flags.DEFINE_string("converted_cache", None, "Orbax cache of the converted parameters (see qmtp.generate).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype (FP8 weights stay FP8).")
flags.DEFINE_list("ks", ["1", "2", "3", "4"], "MTP drafts per round to measure with natural acceptance.")
flags.DEFINE_boolean("auto", False, "Also measure mtp_k='auto' (the draft length chosen per round among 0, 1, 3), "
                     "natural and, when --profile has 3 positions, profiled.")
flags.DEFINE_list("profile", ["0.85", "0.70", "0.57"],
                  "Cumulative per-position acceptance imposed by capping accepted drafts (empty: no profiled "
                  "runs); profiled runs use every K in --ks up to the profile's length.")
flags.DEFINE_integer("profile_seed", 0, "Seed of the acceptance-cap schedule.")
flags.DEFINE_list("prompt_lengths", ["64"], "Prompt lengths in tokens (each length is its own table).")
flags.DEFINE_list("batch", ["1"], "Batch sizes (each its own table).")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per sequence.", lower_bound=2)
flags.DEFINE_integer("repeats", 3, "Timed runs per mode (median and spread reported).", lower_bound=1)
flags.DEFINE_integer("prompt_seed", 0, "Seed of the random prompt tokens.")
flags.DEFINE_multi_string("prompt_text", [], "Text prompt (repeatable; needs the checkpoint's tokenizer.json): "
                          "measure on these prompts, one sequence each, instead of random tokens; --batch and "
                          "--prompt_lengths are then ignored. Natural acceptance of a trained model depends on it.")
flags.DEFINE_bool("breakdown", True, "Also time the pieces of a speculative round alone (target step, verify, "
                  "draft, all-reduce) for each K of --breakdown_ks, next to the measured round time.")
flags.DEFINE_list("breakdown_ks", [], "The K values of the breakdown (empty: every K of --ks). Each K compiles "
                  "its own verify and draft programs, which takes minutes at 64 layers.")
cli_help.define_sampling_flags()  # every mode samples at --temperature > 0 (no token check)
flags.DEFINE_bool("sampling_cost", False, "With --temperature > 0: also run each mode greedily on the same prompts "
                  "and acceptance caps, and report what sampling adds to its time per step or round, both measured "
                  "in this run (target: <= 3% for plain and K=3).")
cli_help.define_model_flags(deterministic=False)
flags.DEFINE_string("trace_dir", None, "Also run each mode once more, after its timed repeats, under the JAX "
                    "profiler: one perfetto trace per mode in a subdirectory named after it (plain, K3_natural, "
                    "K3_profiled, ...; summarize with scripts/trace_summary.py). Not part of the figures.")
flags.DEFINE_float("copy_gib", 4.0, "Size of the f32 array of the copy-bandwidth measurement.")
flags.DEFINE_string("compare_to", None, "An earlier bench JSON (e.g. the TP1 table's) to compare with: each mode's "
                    "tok/s over the same mode's there, for the same engine, batch and prompt length; a TP2 run "
                    "against a TP1 result also checks the TP2 >= 1.6x TP1 target.")
flags.DEFINE_string("out", "bench_result.json", "Where to write the JSON result.")
flags.DEFINE_string("plot", None, "Where to write the PNG plot (default: --out with .png; several cases: _0, _1, "
                    "... before .png; several --batch sizes: also _batches, tokens/s against batch).")
flags.DEFINE_string("plot_from", None, "Only draw the plots of an existing result JSON (no benchmark).")


def main(argv):
    del argv
    try:
        return _plot_from(FLAGS.plot_from) if FLAGS.plot_from else _run()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _plot_from(src: str) -> int:
    """--plot_from: the plot of each case of an earlier result, nothing run."""
    from qmtp.bench import report as br
    try:
        with open(src) as f:
            result = json.load(f)
        cases = result["cases"]
    except OSError as e:
        raise ValueError(f"--plot_from={src}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--plot_from={src}: not a qmtp.bench result ({e!r})") from None
    paths = [_plot_path(src, i, len(cases)) for i in range(len(cases))]
    several = len({c.get("batch") for c in cases}) > 1
    for path in paths + [_batch_plot_path(src)] * several:
        cli_help.check_output_file("plot", path)
    where = br.platform_of(result)
    drawn = [br.plot(dict(case, config=result.get("config") or {}, platform=where), path)
             for case, path in zip(cases, paths)]
    if several:
        drawn.append(br.plot_batches(dict(result, config=result.get("config") or {}), _batch_plot_path(src)))
    print("\n".join(p or "matplotlib is not installed" for p in drawn))
    return 0


def _plot_path(out: str, i: int, n: int) -> str:
    base = FLAGS.plot or os.path.splitext(out)[0] + ".png"
    return base if n == 1 else f"{os.path.splitext(base)[0]}_{i}.png"


def _batch_plot_path(out: str) -> str:
    """Where a run of several batch sizes draws tokens/s against batch: beside the cases' plots."""
    return os.path.splitext(FLAGS.plot or out)[0] + "_batches.png"


def check_outputs(n_cases: int, several_batches: bool = False) -> None:
    """ValueError naming the flag unless --out, every plot path and --trace_dir can be written."""
    cli_help.check_output_file("out", FLAGS.out)
    for i in range(n_cases):
        cli_help.check_output_file("plot", _plot_path(FLAGS.out, i, n_cases))
    if several_batches:
        cli_help.check_output_file("plot", _batch_plot_path(FLAGS.out))
    cli_help.check_output_dir("trace_dir", FLAGS.trace_dir)


def _run() -> int:
    import jax

    import qmtp
    from qmtp import api
    from qmtp.bench import bandwidth, report as br, targets
    from qmtp.bench.bandwidth import copy_bandwidth
    from qmtp.runtime import ops
    batches, lengths = [int(b) for b in FLAGS.batch], [int(p) for p in FLAGS.prompt_lengths]
    unknown = sorted(set(FLAGS.breakdown_ks) - set(FLAGS.ks), key=int) if FLAGS.breakdown else []
    if unknown:  # checked before the minutes of loading and compiling (and only for a breakdown that runs)
        raise ValueError(f"--breakdown_ks={','.join(unknown)} not in --ks={','.join(FLAGS.ks)}")
    engines = list(dict.fromkeys(FLAGS.engine))
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise ValueError(f"--engine={','.join(FLAGS.engine)}: expected one or more of {', '.join(ENGINES)}")
    other = br.load_comparison(FLAGS.compare_to) if FLAGS.compare_to else None  # checked before loading
    sampling()  # a bad value fails before anything loads
    if FLAGS.sampling_cost and not FLAGS.temperature > 0:
        raise ValueError("--sampling_cost compares sampled modes with greedy ones: it needs --temperature > 0")
    if FLAGS.prompt_text:
        batches, lengths = [len(FLAGS.prompt_text)], [0]
    check_outputs(len(engines) * len(batches) * len(lengths), several_batches=len(set(batches)) > 1)
    compile_cache_dir = cli_help.apply_compile_cache_flag()
    from qmtp.runtime import adaptive_k
    n_profile = len([p for p in FLAGS.profile if p])
    n_modes = (1 + len(FLAGS.ks) + len([k for k in FLAGS.ks if int(k) <= n_profile])
               + FLAGS.auto * (1 + (n_profile >= adaptive_k.CANDIDATES[-1])))  # auto_modes' count
    runs_per_mode = FLAGS.repeats * (1 + FLAGS.sampling_cost)  # --sampling_cost: and the greedy twin's
    progress = Progress(len(engines) * len(batches) * len(lengths) * n_modes * runs_per_mode)
    copy = copy_bandwidth(FLAGS.copy_gib, 10)
    from qmtp.bench import compute
    try:  # the prefill floor's rate; the benchmark runs without it if XLA cannot run an E4M3 dot here
        matmul = compute.matmul_rate(compute.GPU_SHAPE if br.has_ceiling(jax.default_backend()) else compute.CPU_SHAPE)
        print(f"FP8 matmul {matmul['tflop_per_s']:.1f} TFLOP/s at {matmul['shape']}", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 (any XLA failure: recorded, and no floor is reported)
        matmul = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(f"FP8 matmul rate not measured ({matmul['error']}): no prefill floor", file=sys.stderr, flush=True)
    print(bandwidth.describe(copy), file=sys.stderr, flush=True)
    from qmtp.tools.make_checkpoint import resolve_checkpoint
    path = resolve_checkpoint(FLAGS.checkpoint, FLAGS.num_layers)
    t = time.perf_counter()
    model = qmtp.load(path, dtype=FLAGS.dtype, impl=ENGINES[engines[0]][0], tp=FLAGS.tp, converted_cache=FLAGS.converted_cache,
                      draft_head=FLAGS.draft_head, draft_vocab=FLAGS.draft_vocab, fp8_act_quant=FLAGS.fp8_act_quant,
                      prefill_chunk=FLAGS.prefill_chunk)
    load_s = time.perf_counter() - t
    resident = memory()
    config = {"checkpoint": path, "checkpoint_flag": FLAGS.checkpoint, "num_layers": model.cfg.num_hidden_layers,
              "engine": ",".join(engines), "tp": FLAGS.tp, "dtype": FLAGS.dtype, "ks": FLAGS.ks, "profile": FLAGS.profile,
              "max_new_tokens": FLAGS.max_new_tokens, "repeats": FLAGS.repeats, "batch": FLAGS.batch,
              "prompt_lengths": FLAGS.prompt_lengths,
              "draft_head": model.draft_head, "draft_vocab": FLAGS.draft_vocab,
              "draft_vocab_size": (int(model.params["mtp"]["draft_vocab"].shape[0])
                                   if "draft_vocab" in model.params.get("mtp", {}) else None),
              # settings outside the flags that change the figures (collectives, the FP8 single-row path)
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "fp8_act_quant": FLAGS.fp8_act_quant,
              "prefill_chunk": FLAGS.prefill_chunk, "sampling": sampling(),
              # a warm compilation cache shortens each mode's compile_s
              "compile_cache": compile_cache_dir, "compare_to": FLAGS.compare_to,
              "title": f"{os.path.basename(path)} engine={','.join(engines)} TP{FLAGS.tp}"}
    result = {"config": config, "versions": {"jax": jax.__version__, "python": platform.python_version()},
              "platform": jax.default_backend(), "device": [str(d) for d in jax.devices()], "copy": copy,
              "matmul": matmul,
              "load_s": load_s, "memory_after_load": resident, "cases": []}
    ok = True
    text_ids = api.encode(model, FLAGS.prompt_text) if FLAGS.prompt_text else None
    if text_ids is not None:
        batches, lengths = [len(text_ids)], [max(len(p) for p in text_ids)]
        config["prompt_text"] = FLAGS.prompt_text
    for engine in engines:
        # the same weights, the other kernel path
        impl, deterministic = ENGINES[engine]
        engine_model = dataclasses.replace(model, kernels=dataclasses.replace(model.kernels, impl=impl,
                                                                              deterministic=deterministic))
        for b in batches:
            for p in lengths:
                case = bench_case(engine_model, b, p, copy["tb_per_s"] * 1e12, progress, prompts=text_ids,
                                  matmul_tflops=matmul.get("tflop_per_s"))
                case.update(engine=engine, memory=memory())
                result["cases"].append(case)
                ok &= case["all_tokens_match_plain"]
                with open(FLAGS.out, "w") as f:
                    json.dump(result, f, indent=2, default=str)
                print("\n" + br.heading(case, copy["tb_per_s"], result["platform"]))
                print(br.table(case["modes"], shares=br.has_ceiling(result["platform"])))
                if case.get("breakdown"):
                    print(br.breakdown_table(case["breakdown"]))
                if FLAGS.sampling_cost:
                    print(br.sampling_cost_table(case["modes"]))
                for k, pieces in (case.get("breakdown_kernels") or {}).items():
                    print(f"K={k}: " + br.kernel_diff_table(pieces))
                case["targets"] = targets.check(case)
                comparison = br.compare(case, FLAGS.tp, other) if other else None
                if comparison:
                    case["comparison"] = dict(comparison, path=FLAGS.compare_to)
                    case["targets"] += comparison["targets"]
                    print(f"against {FLAGS.compare_to}:\n" + br.comparison_table(comparison, FLAGS.tp))
                elif other:
                    print(f"{FLAGS.compare_to} has no case with engine {engine}, batch {b}, prompt {p}: not compared")
                if case["targets"] and jax.default_backend() != "cpu":  # GPU targets (PERFORMANCE.md)
                    print(targets.text(case["targets"]))
    if len(engines) > 1:
        result["engine_comparison"] = br.engine_comparison(result["cases"], engines)
        print(f"\ndecode tok/s by engine ({engines[0]} / {engines[1]}):")
        print(br.engine_comparison_table(result["engine_comparison"], engines))
    for i, case in enumerate(result["cases"]):
        title = f"{os.path.basename(path)} engine={case['engine']} TP{FLAGS.tp}"
        png = br.plot(dict(case, config=dict(config, title=title), platform=result["platform"]),
                      _plot_path(FLAGS.out, i, len(result["cases"])))
        case["plot"] = png
    if len(set(batches)) > 1:  # tokens/s against batch, one line per mode
        result["batch_plot"] = br.plot_batches(result, _batch_plot_path(FLAGS.out))
    result["all_tokens_match_plain"] = ok
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    plots = [c.get("plot") for c in result["cases"]] + [result.get("batch_plot")]
    print(f"\nwrote {FLAGS.out}" + "".join(f", {p}" for p in plots if p))
    if not ok:
        bad = [m["name"] for c in result["cases"] for m in c["modes"] if not m["tokens_match_plain"]]
        print(f"error: tokens differ from plain greedy in: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def cli() -> None:
    cli_help.run(lambda argv: sys.exit(main(argv)), __doc__, __name__)


if __name__ == "__main__":
    cli()
