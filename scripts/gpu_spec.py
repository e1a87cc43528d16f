"""MTP speculative decoding on the GPU machine (issue 3), impl="ref", in one process:

    PYTHONPATH=. python scripts/gpu_spec.py --out=$OUT/spec.json

For each checkpoint (tiny random, tiny_controlled, a 27B-shaped controlled FP8 slice): plain greedy
and MTP K = 1..4 on the same prompts (tokens checked against plain), decode tokens/s, acceptance,
and the compiled memory (XLA memory_analysis) of the plain loop vs the speculative loop, so the
verification state's cost at real shapes is measured rather than estimated.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_string("out", "spec.json", "Where to write the JSON results.")
flags.DEFINE_integer("slice_layers", 4, "Layers of the 27B-shaped controlled slice.")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per run.")
flags.DEFINE_list("ks", ["0", "1", "2", "3", "4"], "MTP K values to run (0 = plain, always first).")
flags.DEFINE_enum("impl", "ref", ["ref", "pallas"], "Kernel implementation.")
flags.DEFINE_list("cases", ["tiny_random_bf16", "tiny_controlled_bf16", "q35_27b_controlled_fp8"],
                  "Which cases to run (see CASES).")
FLAGS = flags.FLAGS


def compiled_memory(model, prompts, k: int) -> dict:
    """XLA's memory analysis of the compiled decode loop (plain when k == 0)."""
    import jax.numpy as jnp
    from qmtp import decode, speculate
    from qmtp.api import _new_state, _prompt_batch
    n = FLAGS.new_tokens
    state = _new_state(model, [len(p) + n + k + 1 for p in prompts])
    b = len(prompts)
    max_new = jnp.full((b,), n, jnp.int32)
    first = jnp.zeros((b,), jnp.int32)
    if k:
        mh = jnp.zeros((b, model.cfg.hidden_size), state.kv.k[0].dtype)
        lowered = speculate.spec_loop.lower(model.cfg, speculate.SpecConfig(k, n, ()), model.params, state, first,
                                            first, mh, max_new, jnp.full((1, b), k, jnp.int32))
    else:
        lowered = decode.greedy_loop.lower(model.cfg, decode.LoopSpec(n, ()), model.params, state, first, max_new)
    m = lowered.compile().memory_analysis()
    return {name: getattr(m, name, None) for name in
            ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "generated_code_size_in_bytes")}


def divergence(model, prompts, plain, other) -> list:
    """Where MTP output leaves plain greedy: index, and plain's top-2 logit margin there."""
    import numpy as np
    import qmtp
    rows = []
    for p, a, b in zip(prompts, plain, other):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        logits = qmtp.target_logits(model, p + a[:i])[-1]
        top = np.sort(logits)[-2:]
        rows.append({"index": i, "plain": a[i], "mtp": b[i], "margin": float(top[1] - top[0])})
    return rows


def run_case(name: str, preset: str, dtype: str, num_layers) -> dict:
    import numpy as np
    import qmtp
    from qmtp.state import state_bytes
    from qmtp.api import _new_state
    from qmtp.tools import make_checkpoint
    out = {"name": name, "preset": preset, "weights": dtype, "impl": FLAGS.impl, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint.write_checkpoint(os.path.join(tmp, name), preset=preset, dtype=dtype, seed=0,
                                                num_layers=num_layers)
        model = qmtp.load(path, dtype="float32" if dtype == "fp32" else "bfloat16", page_size=16, impl=FLAGS.impl)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 380, 64).tolist()]
        plain = None
        for k in map(int, FLAGS.ks):
            res = qmtp.generate(model, prompts, max_new_tokens=FLAGS.new_tokens, stop_token_ids=[], mtp_k=k,
                                warmup=True)
            keep = ("decode_tokens_per_s", "ttft_s", "decode_s", "warmup_s", "steps", "acceptance_rate",
                    "mean_accepted_length", "position_acceptance", "accept_hist")
            row = {x: res.stats[x] for x in keep if x in res.stats}
            plain = res.tokens if k == 0 else plain
            row["tokens_equal_plain"] = res.tokens == plain
            if res.tokens != plain:
                row["divergence"] = divergence(model, prompts, plain, res.tokens)
            row["ms_per_step"] = res.stats["decode_s"] / max(res.stats["steps"], 1) * 1e3
            out["modes"][f"k{k}"] = row
            print(name, f"k={k}", json.dumps(row), flush=True)
        out["speedup_vs_plain"] = {m: r["decode_tokens_per_s"] / out["modes"]["k0"]["decode_tokens_per_s"]
                                   for m, r in out["modes"].items()}
        if 4 in map(int, FLAGS.ks):
            out["memory_plain"] = compiled_memory(model, prompts, 0)
            out["memory_k4"] = compiled_memory(model, prompts, 4)
        out["state_bytes"] = state_bytes(_new_state(model, [64 + FLAGS.new_tokens + 5]))
        print(name, "memory", out.get("memory_plain"), out.get("memory_k4"), flush=True)
    return out


def main(argv):
    import jax
    results = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "cases": []}
    cases = {"tiny_random_bf16": ("tiny", "bf16", None), "tiny_random_fp32": ("tiny", "fp32", None),
             "tiny_controlled_bf16": ("tiny_controlled", "bf16", None),
             "q35_27b_controlled_fp8": ("qwen3_5_27b_controlled", "fp8", FLAGS.slice_layers),
             "q35_27b_controlled_bf16": ("qwen3_5_27b_controlled", "bf16", FLAGS.slice_layers)}
    for case in [(name,) + cases[name] for name in FLAGS.cases]:
        t0 = time.time()
        try:
            results["cases"].append(run_case(*case))
        except Exception as e:  # record and go on
            results["cases"].append({"name": case[0], "error": repr(e)})
            print(f"{case[0]} failed: {e!r}", file=sys.stderr, flush=True)
        results["cases"][-1]["wall_s"] = time.time() - t0
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
