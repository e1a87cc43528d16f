"""FP8 block matmul micro-benchmark on the GPU: Pallas kernels vs the XLA paths, as a share of copy bandwidth.

    PYTHONPATH=. python scripts/bench_fp8_matmul.py --out=$OUT/bench_fp8_matmul.json [--sweep]

One process measures:
  copy   jitted x + 1 over 4 GiB of f32 (read + write bytes / time), the ceiling to quote;
  cases  for each weight shape [O, I] (Qwen3.5-27B gate/up [17408, 5120] and down [5120, 17408]) and
         each M (decode/verify rows): one jitted program runs a lax.fori_loop of --reps iterations,
         each calling the matmul on --n_weights different weight matrices (1.4 GB of FP8 for 16, far
         beyond the 50 MB L2), so a weight is never re-read from L2 and host dispatch is paid once.
         The 16 outputs feed one small fusion per iteration that perturbs x (a data dependency, so
         nothing is hoisted out of the loop). impl: pallas (default config, and with --sweep a set
         of candidate DecodeConfigs), xla_ref (fp8_matmul_ref: dequantize + einsum), xla_bf16 (the
         same weights pre-dequantized to bf16, plain einsum; the bf16 ceiling XLA reaches).
  prefill --prefill_m rows through the GEMM config(s): TFLOP/s.
Figures: s_per_matmul, fp8_tb_s = FP8 weight bytes (O*I) / s_per_matmul (for every impl, so rows
compare by time), share_of_copy = fp8_tb_s / copy TB/s, and rel_err of the first output against
fp8_matmul_ref. The loop overhead (same program, no matmul) is reported and not subtracted.
JSON lines go to stdout as they are measured; the whole result to --out.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

from absl import app, flags

flags.DEFINE_string("out", "bench_fp8_matmul.json", "Where to write the JSON results.")
flags.DEFINE_list("ms", ["1", "4", "5", "16"], "Rows (M) of the decode cases.")
flags.DEFINE_list("shapes", ["17408x5120", "5120x17408"], "Weight shapes OxI.")
flags.DEFINE_list("prefill_m", ["512"], "Rows of the prefill cases (empty: none).")
flags.DEFINE_integer("n_weights", 16, "Different weight matrices per loop iteration.")
flags.DEFINE_integer("reps", 8, "Loop iterations inside the timed program.")
flags.DEFINE_integer("trials", 5, "Timed runs per case (median and best reported).")
flags.DEFINE_bool("sweep", False, "Also time candidate tile configs (compile time: a few s each).")
flags.DEFINE_bool("xla", True, "Also time the XLA paths (xla_ref, xla_bf16).")
flags.DEFINE_float("copy_gib", 4.0, "Size of the f32 array of the copy measurement.")
flags.DEFINE_bool("interpret", False, "Run the kernels in interpret mode (a CPU smoke test of this script).")
FLAGS = flags.FLAGS


def timed(fn, *args, trials):
    import jax
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def make_weights(o: int, i: int, n: int, seed: int):
    """n different [O, I] E4M3 weights with realistic values and [ceil(O/128), ceil(I/128)] scales."""
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
    Pallas outputs are sliced (XLA cannot narrow a custom call); XLA paths are summed in full so XLA
    cannot shrink the matmul to the columns used."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def prog(x, ws, ss):
        def body(_, carry):
            x, acc = carry
            ys = [matmul(x, w, s) for w, s in zip(ws, ss)] if ws else [x]
            if full_sum:
                tot = sum(jnp.sum(y.astype(jnp.float32), axis=-1, keepdims=True) for y in ys)
            else:
                tot = sum(y[:, :1].astype(jnp.float32) for y in ys)
            return x + (tot * 1e-30).astype(x.dtype), acc + jnp.sum(tot)

        return jax.lax.fori_loop(0, reps, body, (x, jnp.float32(0)))

    return prog


def candidate_configs(m: int):
    from pallas_kernels.fp8_matmul import DecodeConfig, PrefillConfig
    if m > 16:
        return [PrefillConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                for bm, bn, nw, ns in [(64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (128, 64, 4, 4),
                                       (64, 64, 4, 4), (256, 128, 8, 3)]]
    cands = []
    if m == 1:
        cands += [DecodeConfig(block_o=bo, use_dot=False, split_k=sk, num_warps=nw, num_stages=ns)
                  for bo, sk, nw, ns in [(16, 1, 4, 4), (32, 1, 4, 4), (64, 1, 4, 4), (64, 1, 8, 4),
                                         (32, 2, 4, 4), (64, 1, 4, 2), (64, 2, 4, 4), (128, 1, 8, 3)]]
    cands += [DecodeConfig(block_o=bo, split_k=sk, swap_ab=sw, num_warps=nw, num_stages=ns)
              for bo, sk, sw, nw, ns in [(64, 1, True, 4, 4), (64, 1, False, 4, 4), (32, 1, True, 4, 4),
                                         (128, 1, True, 4, 4), (128, 1, True, 8, 3), (64, 2, True, 4, 4),
                                         (64, 4, True, 4, 4), (32, 2, True, 4, 4), (64, 1, True, 4, 2),
                                         (64, 1, True, 4, 6), (64, 1, True, 8, 4)]]
    return cands


def main(argv):
    from qmtp.bandwidth import copy_bandwidth
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import fp8_matmul as fm

    results = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
               "n_weights": FLAGS.n_weights, "reps": FLAGS.reps, "cases": []}
    copy = copy_bandwidth(FLAGS.copy_gib, max(FLAGS.trials, 10))
    results["copy"] = copy
    print(json.dumps({"copy": copy}), flush=True)
    calls = FLAGS.reps * FLAGS.n_weights

    def save():
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)

    x0 = jnp.ones((16, 128), jnp.bfloat16)
    med, best = timed(loop_program(None, FLAGS.reps, False), x0, (), (), trials=FLAGS.trials)
    results["loop_overhead_s_per_iteration"] = med / FLAGS.reps
    print(json.dumps({"loop_overhead_s_per_iteration": med / FLAGS.reps}), flush=True)

    ref = jax.jit(lambda x, w, s: fm.fp8_matmul_ref(x, w, s))
    for si, shape in enumerate(FLAGS.shapes):
        o, i = (int(v) for v in shape.split("x"))
        ws, ss = make_weights(o, i, FLAGS.n_weights, seed=si)
        bf16 = None
        ms = [int(m) for m in FLAGS.ms] + [int(m) for m in FLAGS.prefill_m if m]
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, i), jnp.float32).astype(jnp.bfloat16)
            want = np.asarray(ref(x, ws[0], ss[0]), np.float64)
            runs = [("pallas", None)]
            if FLAGS.sweep:
                runs += [("pallas", c) for c in candidate_configs(m)]
            if FLAGS.xla:
                runs += [("xla_ref", None), ("xla_bf16", None)]
            for impl, config in runs:
                case = {"o": o, "i": i, "m": m, "impl": impl}
                try:
                    if impl == "pallas":
                        cfg = config or fm.default_config(m, o, i)
                        case["config"] = repr(cfg)
                        case["default"] = config is None
                        mm = functools.partial(fm.fp8_matmul, config=cfg, interpret=FLAGS.interpret)
                        prog, args = loop_program(mm, FLAGS.reps, False), (x, ws, ss)
                    elif impl == "xla_ref":
                        mm = fm.fp8_matmul_ref
                        prog, args = loop_program(mm, FLAGS.reps, True), (x, ws, ss)
                    else:
                        if bf16 is None:
                            deq = jax.jit(lambda w, s: fm.dequantize_ref(w, s, jnp.bfloat16))
                            bf16 = tuple(deq(w, s) for w, s in zip(ws, ss))
                        mm = lambda x, w, s: jnp.einsum("mi,oi->mo", x, w,  # noqa: E731
                                                        preferred_element_type=jnp.float32)
                        prog, args = loop_program(mm, FLAGS.reps, True), (x, bf16, ss)
                    got = np.asarray(jax.jit(mm)(x, args[1][0], ss[0]).astype(jnp.float32), np.float64)
                    case["rel_err"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                    med, best = timed(prog, *args, trials=FLAGS.trials)
                    per = med / calls
                    case.update({"s_per_matmul": per, "best_s_per_matmul": best / calls,
                                 "fp8_tb_s": o * i / per / 1e12, "share_of_copy": o * i / per / 1e12 / copy["tb_per_s"],
                                 "tflop_s": 2 * m * o * i / per / 1e12})
                except Exception as e:  # record and go on: one failing config must not hide the others
                    case["error"] = repr(e)[:2000]
                    print(f"{case} failed", file=sys.stderr, flush=True)
                results["cases"].append(case)
                print(json.dumps(case), flush=True)
                save()
        del ws, ss, bf16

    best = {}
    for c in results["cases"]:
        if c["impl"] == "pallas" and "fp8_tb_s" in c and c.get("rel_err", 1.0) < 1e-2:
            key = f"{c['o']}x{c['i']} m={c['m']}"
            if key not in best or c["fp8_tb_s"] > best[key]["fp8_tb_s"]:
                best[key] = {"config": c["config"], "fp8_tb_s": c["fp8_tb_s"], "share_of_copy": c["share_of_copy"]}
    results["best_pallas"] = best
    print(json.dumps({"best_pallas": best}, indent=1), flush=True)
    save()


if __name__ == "__main__":
    app.run(main)
