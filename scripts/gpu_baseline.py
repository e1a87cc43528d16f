"""Baseline run on the GPU machine (issue 2): does the reference path run, and what does it cost.

    PYTHONPATH=. python scripts/gpu_baseline.py --out=$OUT/baseline.json

Measures in one process: the copy bandwidth (jitted x + 1 over 4 GiB f32), then for the tiny
preset (bf16, fp8) and a 2-layer slice of the Qwen3.5-27B shapes in FP8: checkpoint write and load
time, compile time, TTFT, decode tokens/s and peak device memory, all with impl="ref".
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_string("out", "baseline.json", "Where to write the JSON results.")
flags.DEFINE_integer("slice_layers", 2, "Layers of the 27B-shaped slice.")
flags.DEFINE_integer("new_tokens", 32, "Tokens generated per run.")
FLAGS = flags.FLAGS


def peak_memory() -> int | None:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def run_case(name: str, preset: str, dtype: str, num_layers, compute_dtype: str) -> dict:
    import qmtp
    from qmtp.tools import make_checkpoint
    out = {"name": name, "preset": preset, "weights": dtype, "compute": compute_dtype}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        t0 = time.perf_counter()
        path = make_checkpoint.write_checkpoint(os.path.join(tmp, name), preset=preset, dtype=dtype,
                                                seed=0, num_layers=num_layers)
        out["write_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model = qmtp.load(path, dtype=compute_dtype)
        out["load_s"] = time.perf_counter() - t0
        prompt = list(range(1, 65))
        res = qmtp.generate(model, [prompt], max_new_tokens=FLAGS.new_tokens, stop_token_ids=[], warmup=True)
        out.update({k: res.stats[k] for k in ("ttft_s", "decode_s", "warmup_s", "decode_tokens_per_s", "steps")})
        out["ms_per_step"] = res.stats["decode_s"] / max(res.stats["steps"], 1) * 1e3
        out["tokens"] = res.tokens[0]
        out["peak_bytes"] = peak_memory()
    print(json.dumps({k: v for k, v in out.items() if k != "tokens"}), flush=True)
    return out


def main(argv):
    from qmtp.bandwidth import copy_bandwidth
    import jax
    results = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
               "copy": copy_bandwidth(), "cases": []}
    print(json.dumps(results["copy"]), flush=True)
    cases = [("tiny_bf16", "tiny", "bf16", None, "bfloat16"),
             ("tiny_fp8", "tiny", "fp8", None, "bfloat16"),
             (f"q35_27b_{FLAGS.slice_layers}layer_fp8", "qwen3_5_27b", "fp8", FLAGS.slice_layers, "bfloat16")]
    for case in cases:
        try:
            results["cases"].append(run_case(*case))
        except Exception as e:  # record and go on: one failing case must not hide the others
            results["cases"].append({"name": case[0], "error": repr(e)})
            print(f"{case[0]} failed: {e!r}", file=sys.stderr, flush=True)
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
