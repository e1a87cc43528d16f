"""Collectives per decode step under tensor parallelism, counted in the lowered program (no device).

    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/tp_collectives.py [--preset=qwen3_5_27b] [--tp=2]

Traces the sharded plain greedy loop and the MTP K=3 speculative loop of a preset (abstract FP8
weights: nothing is allocated) for `--tp` fake CPU devices and counts the cross-device collectives
in the lowered StableHLO. The layers are unrolled inside the while loop's body, so each count is per
step (plain) or per round (MTP); the module's few collectives outside the loop are included.
"""

from __future__ import annotations

import collections
import re

from absl import app, flags

flags.DEFINE_string("preset", "qwen3_5_27b", "Synthetic preset whose config to trace.")
flags.DEFINE_integer("tp", 2, "Tensor-parallel degree (fake CPU devices).")
flags.DEFINE_integer("num_layers", None, "Decoder layers (default: the preset's).")
FLAGS = flags.FLAGS

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


def count(text: str) -> dict:
    c = collections.Counter(m.group(1) for m in re.finditer(r"stablehlo\.(\w+)", text) if m.group(1) in OPS)
    return {op: c.get(op, 0) for op in OPS}


def main(argv):
    del argv
    import jax
    jax.config.update("jax_num_cpu_devices", FLAGS.tp)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from qmtp import config as qc, decode, params as qp, speculate, tp
    from qmtp.tools import make_checkpoint

    cfg = qc.from_dict(make_checkpoint.build_config(FLAGS.preset, "fp8", 0, FLAGS.num_layers))
    tp.check_tp(cfg, FLAGS.tp, fp8=True)
    mesh = tp.make_mesh(FLAGS.tp)
    sds = jax.ShapeDtypeStruct
    params = qp.abstract_params(cfg, jnp.bfloat16, fp8_linear=True)
    params = jax.tree_util.tree_map(lambda a, s: sds(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                                    params, tp.param_specs(params))
    state = tp.global_state_shapes(cfg, FLAGS.tp, 1, 64, 16, 8, jnp.bfloat16)
    state = jax.tree_util.tree_map(lambda a, s: sds(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                                   state, tp.state_specs(state))
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    plain = tp.sharded_fn(decode.greedy_loop, mesh, (cfg, decode.LoopSpec(64, ())),
                          (params, state, i32(1), i32(1)), ("params", "state", "rep", "rep"),
                          ("rep", "rep", "rep", "state"), impl="ref")
    args = (params, state, i32(1), i32(1), sds((1, cfg.hidden_size), jnp.bfloat16), i32(1), i32(1, 1))
    spec = tp.sharded_fn(speculate.spec_loop, mesh, (cfg, speculate.SpecConfig(3, 64, ())), args,
                         ("params", "state", "rep", "rep", "rep", "rep", "rep"), ("rep", "rep", "rep", "state"),
                         impl="ref")
    layers = cfg.num_hidden_layers
    print(f"{FLAGS.preset}: {layers} layers, TP{FLAGS.tp}")
    print(f"  plain decode step (per token): {count(plain.lower(params, state, i32(1), i32(1)).as_text())}")
    print(f"  MTP K=3 round (2 draft steps + verify + commit + draft refresh): {count(spec.lower(*args).as_text())}")
    print(f"  expected per target pass: 2 per layer (mixer out + MLP down) = {2 * layers}, + 1 embedding "
          "+ 1 all-gather for the vocabulary-parallel argmax ((max, id) pairs)")


if __name__ == "__main__":
    app.run(main)
