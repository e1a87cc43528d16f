"""Memory of the speculative verification state at real shapes, from the program's own shapes.

    PYTHONPATH=. python scripts/verify_state_memory.py [--preset=qwen3_5_27b]

jax.eval_shape runs the verify forward (model.forward(..., return_gdn_replay=True)) abstractly on the
real parameter and state shapes: no weights are read, nothing is allocated. It reports the bytes of
what qmtp keeps to commit any accepted length (the GDN replay: conv window + recurrence inputs)
against the alternative of keeping the GDN state after every verified position, for K = 1..4.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from qmtp import config as qconfig, model, params as P
from qmtp.state import state_shapes
from qmtp.tools import make_checkpoint

flags.DEFINE_string("preset", "qwen3_5_27b", "make_checkpoint preset whose shapes to use.")
flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
FLAGS = flags.FLAGS


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def main(argv):
    cfg = qconfig.from_dict(make_checkpoint.build_config(FLAGS.preset, "fp8", 0, None))
    params = P.abstract_params(cfg, jnp.bfloat16, fp8_linear=True)
    rows = []
    for b in map(int, FLAGS.batches):
        for k in range(1, 5):
            state = state_shapes(cfg, b, 64, 16, 8, jnp.bfloat16)
            tokens = jax.ShapeDtypeStruct((b, k + 1), jnp.int32)
            n = jax.ShapeDtypeStruct((b,), jnp.int32)
            _, _, replay = jax.eval_shape(
                lambda p, s, t, nv: model.forward(cfg, p, s, t, nv, return_gdn_replay=True), params, state, tokens, n)
            per_position = cfg.num_linear_layers * b * (k + 1) * int(np.prod(state.ssm[0].shape[1:])) * 4
            rows.append({"batch": b, "k": k, "replay_bytes": nbytes(replay), "per_position_states_bytes": per_position,
                         "ssm_state_bytes": nbytes(state.ssm), "conv_state_bytes": nbytes(state.conv)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    app.run(main)
