#!/usr/bin/env python3
"""Pieces of a speculative round timed alone on a loaded model, with their launches by kind: the
breakdown of `qmtp.bench` (qmtp.bench_breakdown) without the harness's decode modes, for a short
device lease that asks only where the verify pass spends what a target step does not.

    PYTHONPATH=. python scripts/round_pieces.py --checkpoint=preset:qwen3_5_27b_controlled:fp8 \\
        --k=3 --pieces=target_step,verify --out=pieces.json

Prints milliseconds per piece (wall clock and, on a GPU, device busy time) and the launch-kind
table of --compare against --base; writes both to --out as JSON. --variants measures the same pieces
again under other kernel settings, in the same process and on the same loaded model (one load for
several settings; each variant's programs are traced afresh):

    python scripts/round_pieces.py --pieces=verify,commit --variants="gdn_conv_hoisted=true;bf16_reduce_max_out=256"
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
from qmtp import cli_help  # noqa: E402

cli_help.define_kernels_flag()
cli_help.define_draft_head_flag()
cli_help.define_draft_vocab_flag()
cli_help.define_compile_cache_flag()

flags.DEFINE_string("checkpoint", "preset:qwen3_5_27b_controlled:fp8", "Checkpoint directory or preset:NAME:DTYPE.")
flags.DEFINE_integer("k", 3, "Drafts per round (the verify pass runs K+1 tokens).")
flags.DEFINE_list("pieces", ["target_step", "verify"], "Pieces to time: target_step, verify, draft, commit, all_reduce.")
flags.DEFINE_string("base", "target_step", "The piece the launch-kind table compares against.")
flags.DEFINE_string("compare", "verify", "The piece the launch-kind table compares.")
flags.DEFINE_integer("tp", 1, "Tensor-parallel devices.")
flags.DEFINE_string("dtype", "bfloat16", "Activation dtype.")
flags.DEFINE_string("engine", "pallas", "Kernel path: pallas or ref.")
flags.DEFINE_integer("batch", 1, "Sequences per step.")
flags.DEFINE_integer("capacity", 256, "Positions reserved per sequence.")
flags.DEFINE_string("variants", "", "Semicolon-separated kernel settings (each as --kernels takes them, "
                    "name=value,...) to measure the pieces under as well, after the --kernels run; each variant "
                    "starts from --kernels' settings.")
flags.DEFINE_string("out", "", "JSON output path (empty: print only).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax

    import qmtp
    from qmtp import api, bench_breakdown as bd, bench_report as br, ops
    from qmtp.tools.make_checkpoint import resolve_checkpoint
    settings = cli_help.apply_kernels_flag()
    cli_help.apply_compile_cache_flag()
    model = qmtp.load(resolve_checkpoint(FLAGS.checkpoint, None), dtype=FLAGS.dtype, impl=FLAGS.engine, tp=FLAGS.tp,
                      draft_head=FLAGS.draft_head, draft_vocab=FLAGS.draft_vocab)
    variants = [v.strip() for v in FLAGS.variants.split(";") if v.strip()]
    for v in variants:  # a typo fails before the first measurement
        try:
            ops.set_kernel_settings(ops.set_kernel_settings(ops.parse_kernel_settings(v.split(","))))
        except ValueError as e:
            raise ValueError(f"--variants {v!r}: {e}") from None

    def measure() -> dict:
        kernels: dict = {}
        jax.clear_caches()  # the settings are read while tracing: every variant traces anew
        pieces = bd.measure(model, lambda: api._new_state(model, [FLAGS.capacity] * FLAGS.batch), FLAGS.k, kernels,
                            only=tuple(FLAGS.pieces))
        print(br.breakdown_table({str(FLAGS.k): pieces}))
        if kernels and {FLAGS.base, FLAGS.compare} <= set(kernels):
            print(br.kernel_diff_table(kernels, FLAGS.base, FLAGS.compare, top=40))
        return {"pieces": pieces, "kernels": kernels, "kernel_settings": ops.kernel_settings()}

    result = {"k": FLAGS.k, "checkpoint": FLAGS.checkpoint, **measure(), "variants": {}}
    if FLAGS.out:  # after each measurement: a lease cut short keeps what it measured
        _write(FLAGS.out, result)
    for v in variants:
        print(f"== variant {v}")
        ops.set_kernel_settings(settings)
        ops.set_kernel_settings(ops.parse_kernel_settings(v.split(",")))
        try:
            result["variants"][v] = measure()
        except Exception as e:  # a variant that fails to compile or run is reported, the others still run
            print(f"variant {v} failed: {type(e).__name__}: {e}", file=sys.stderr)
            result["variants"][v] = {"error": f"{type(e).__name__}: {e}"}
        if FLAGS.out:
            _write(FLAGS.out, result)
    ops.set_kernel_settings(settings)
    if FLAGS.out:
        _write(FLAGS.out, result)
    return 0


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    cli_help.run(lambda argv: sys.exit(main(argv)), __doc__)
