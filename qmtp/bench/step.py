"""The whole target decode step at the Qwen3.5-27B shapes, Pallas kernels against the reference path:

    python -m qmtp.bench.step [--impls=pallas,ref] [--num_layers=N] [--context=1024] [--out=step.json]
    python -m qmtp.bench.step --quick        (the tiny preset on the CPU: a smoke run)

Random FP8 block weights with the real shapes are generated on the device (no checkpoint: a 27B FP8
tree is ~30 GB, and the step time does not depend on the values), the KV cache holds `context`
positions, and the decode loop (`loop.decode` with K = 0, one jitted while_loop as generation runs
it) decodes n_short and n_long tokens; the per-step time is the difference over (n_long - n_short),
so dispatch and the loop's set-up cancel. Both lengths share one compiled program, whose optimized
HLO also gives the kernel launches per step.

Roofline (PERFORMANCE.md): the bytes a step must read (qmtp.bench.report.step_bytes: every target
parameter except the embedding table, the GDN and conv state read and written, K and V of `context`
positions) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import collections
import functools
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from qmtp import cli_help
from qmtp.bench.bandwidth import copy_bandwidth
from qmtp.bench.report import step_bytes
from qmtp.model import config as qconfig, params as qparams, weight_layout
from qmtp.model.fp8 import Fp8Block
from qmtp.model.load import fuse_gate_projections
from qmtp.runtime import loop
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.runtime.state import init_state
from qmtp.tools import make_checkpoint

flags.DEFINE_list("impls", ["pallas", "ref"], "Kernel paths to time: 'pallas' and/or 'ref'.")
flags.DEFINE_integer("num_layers", None, "Keep only the first N decoder layers (default: all 64).")
flags.DEFINE_integer("context", 1024, "Positions already in the KV cache.", lower_bound=1)
flags.DEFINE_integer("n_short", 8, "Tokens of the short timed run.", lower_bound=1)
flags.DEFINE_integer("n_long", 40, "Tokens of the long timed run.", lower_bound=2)
flags.DEFINE_integer("trials", 3, "Timed runs of each length (the median counts).", lower_bound=1)
flags.DEFINE_boolean("quick", False, "The tiny preset with 4 layers and a few steps (a CPU smoke run).")
flags.DEFINE_string("out", "step.json", "Where to write the JSON rows.")

LAUNCH_KINDS = ("fusion", "custom-call", "all-reduce-start", "all-reduce", "all-gather", "copy",
                "dynamic-update-slice", "gather", "scatter")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _leaf(key, shape, dtype, kind):
    """One parameter on the device. kind: fp8 (E4M3 spread over the format's range), scale (so each
    output has about unit variance), zero (norms: zero-centred; A_log, dt_bias), dense (1/sqrt(fan-in))."""
    if kind == "fp8":
        return (jax.random.normal(key, shape, jnp.float32) * 64.0).clip(-448, 448).astype(jnp.float8_e4m3fn)
    if kind == "zero":
        return jnp.zeros(shape, dtype)
    if kind == "scale":
        return jnp.full(shape, 1.0 / (64.0 * np.sqrt(shape[1] * 128)), dtype)
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[-1])).astype(dtype)


def random_params(cfg, dtype, seed: int = 0) -> dict:
    """A tree with qparams.abstract_params(cfg, dtype, fp8_linear=True)'s structure, filled on the device."""
    abstract = qparams.abstract_params(cfg, dtype, fp8_linear=True)
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


def count_launches(hlo_text: str) -> dict:
    """Top-level ops of an optimized HLO module by kind (fusions, custom calls: Pallas kernels and
    library GEMMs, collectives, copies): about the kernel launches of one step when the module is the
    decode loop (its body is one step). Ops inside computations that other ops call (calls= /
    to_apply=: fused computations, reducers) run inside those ops and are not counted."""
    called = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo_text))
    pattern = re.compile(r"= \S+ (" + "|".join(re.escape(k) for k in LAUNCH_KINDS) + r")\(")
    kinds = collections.Counter()
    for block in re.split(r"\n(?=%|ENTRY )", hlo_text):
        name = re.match(r"(?:ENTRY )?%([\w.\-]+)", block)
        if not (name and name.group(1) in called):
            kinds.update(pattern.findall(block))
    return dict(kinds, total=sum(kinds.values()))


def time_step(cfg, params, kernels: KernelConfig, context: int, n_short: int, n_long: int, trials: int) -> dict:
    """Seconds per decode step (batch 1) and launches per step of the K = 0 loop on `params`."""
    page = 16
    pages = -(-(context + n_long + 2) // page)

    def fresh():  # a KV cache holding `context` positions, the budget n tokens
        state = init_state(cfg, np.arange(pages, dtype=np.int32)[None], pages, page, jnp.bfloat16)
        return state.__class__(**{**state.__dict__, "lengths": jnp.full((1,), context, jnp.int32)})

    def slots(n):
        first = jnp.zeros((1,), jnp.int32)
        return loop.Slots.started(first, first, loop.unread_q(cfg, 1),
                                  jnp.zeros((1, cfg.hidden_size), jnp.bfloat16),
                                  jnp.full((1,), n + 1, jnp.int32), loop.stop_rows((), 1),
                                  jnp.zeros((1, cfg.vocab_size), bool))

    t = time.perf_counter()
    compiled = loop.decode.lower(cfg, kernels, 0, n_long, params, fresh(), slots(n_long)).compile()
    launches = count_launches(compiled.as_text())

    def once(n):
        state, carry = fresh(), slots(n)
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(params, state, carry))
        return time.perf_counter() - t0, int(out[1][0])

    once(n_short)  # warm up
    compile_s = time.perf_counter() - t
    short = [once(n_short) for _ in range(trials)]
    long = [once(n_long) for _ in range(trials)]
    steps = long[0][1] - short[0][1]
    per = (float(np.median([s for s, _ in long])) - float(np.median([s for s, _ in short]))) / steps
    return {"s_per_step": per, "tokens_per_s": 1.0 / per, "steps_timed": steps, "compile_s": compile_s,
            "launches_per_step": launches}


def main(argv) -> int:
    del argv
    bad = [i for i in FLAGS.impls if i not in ("pallas", "ref")]
    if bad or not FLAGS.impls:
        print(f"error: --impls={','.join(FLAGS.impls)}: expected pallas and/or ref", file=sys.stderr)
        return 2
    try:  # before the minutes of building and timing
        cli_help.check_output_file("out", FLAGS.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    preset, layers, context, n_short, n_long, trials = ("qwen3_5_27b", FLAGS.num_layers, FLAGS.context,
                                                        FLAGS.n_short, FLAGS.n_long, FLAGS.trials)
    if FLAGS.quick:
        preset, layers, context, n_short, n_long, trials = "tiny", layers or 4, 40, 2, 6, 1
    copy = copy_bandwidth(0.25 if FLAGS.quick else 4.0, 10)
    cfg = qconfig.from_dict(make_checkpoint.build_config(preset, "fp8", 0, layers))
    params = fuse_gate_projections(jax.block_until_ready(random_params(cfg, jnp.bfloat16)))
    pages = -(-context // 16) + 1
    state = init_state(cfg, np.arange(pages, dtype=np.int32)[None], pages, 16, jnp.bfloat16)
    parts = step_bytes(params, state, context)["target"]
    total = sum(parts.values())
    roofline_s = total / (copy["tb_per_s"] * 1e12)
    rows = []
    for impl in FLAGS.impls:
        kernels = KernelConfig(impl)
        run_params = weight_layout.tile_fp8_weights(params, donate=False) if kernels.pallas else params
        row = {"impl": impl, "preset": preset, "num_layers": cfg.num_hidden_layers, "context": context,
               "bytes": total, "bytes_by_part": parts, "roofline_s": roofline_s, "copy_tb_s": copy["tb_per_s"]}
        row.update(time_step(cfg, run_params, kernels, context, n_short, n_long, trials))
        row["share_of_roofline"] = roofline_s / row["s_per_step"]
        print(f"{impl}: {row['s_per_step'] * 1e3:.3f} ms per step ({row['tokens_per_s']:.1f} tok/s), "
              f"{row['share_of_roofline']:.1%} of the roofline at {copy['tb_per_s']:.2f} TB/s copy, "
              f"{row['launches_per_step']['total']} launches per step", flush=True)
        rows.append(row)
    with open(FLAGS.out, "w") as f:
        json.dump({"copy": copy, "rows": rows}, f, indent=2)
    return 0


FLAGS = flags.FLAGS

if __name__ == "__main__":
    cli_help.run(lambda argv: sys.exit(main(argv)), __doc__, __name__)
