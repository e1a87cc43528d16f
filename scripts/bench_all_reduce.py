"""The all-reduce of tensor-parallel decoding alone: pallas_kernels/all_reduce.py's one-shot kernel
beside psum (NCCL), in one run, on every visible GPU (two or more).

For each row count (a [rows, 5120] f32 partial sum, as the 27B TP step reduces after o_proj,
out_proj and the MLP), both forms run CALLS times inside one jitted shard_map program, each call's
input the previous output (scaled back, so the calls cannot overlap or be folded): us per call =
the program's median time / CALLS. Before timing, the kernel's sum is checked against psum's, bit for
bit, on random partials. Rows where the array does not fit the kernel (all_reduce.fits) time psum only.

    JAX_PLATFORMS=cuda PYTHONPATH=. python scripts/bench_all_reduce.py --out=$OUT/all_reduce.json
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import all_reduce
from pallas_kernels.bench import common

flags.DEFINE_list("rows", ["1", "4", "16", "64"], "Row counts of the [rows, --width] f32 array reduced.")
flags.DEFINE_integer("width", 5120, "Elements per row (the 27B hidden size).")
flags.DEFINE_integer("calls", 200, "All-reduces per timed program.")
flags.DEFINE_integer("trials", 7, "Timed runs of each program (the median is reported).")
flags.DEFINE_string("out", "all_reduce.json", "JSON file with every row.")
FLAGS = flags.FLAGS

AXIS = "tp"


def _program(mesh, reduce_fn, calls: int):
    """A jitted shard_map running `calls` dependent all-reduces of each device's [rows, width] block."""
    n = mesh.size

    def body(x):  # x: this device's partial [rows, width]
        def step(_, v):
            return jax.lax.pcast(reduce_fn(v) / n, AXIS, to="varying")  # the sum of n equal parts, back
        return jax.lax.fori_loop(0, calls, step, x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def main(argv):
    del argv
    devices = jax.devices()
    if len(devices) < 2 or devices[0].platform != "gpu":
        raise SystemExit(f"bench_all_reduce needs two or more GPUs, found {devices}")
    mesh = jax.sharding.Mesh(devices, (AXIS,))
    n = mesh.size
    results = {"devices": [d.device_kind for d in devices], "n": n, "jax": jax.__version__, "rows": []}
    one_shot = functools.partial(all_reduce.one_shot_all_reduce, axis_name=AXIS)
    psum = functools.partial(all_reduce.all_reduce_ref, axis_name=AXIS)
    for rows in map(int, FLAGS.rows):
        shape = (n * rows, FLAGS.width)  # device d holds rows [d * rows, (d + 1) * rows)
        x = jax.device_put(jnp.asarray(np.random.default_rng(rows).standard_normal(shape), jnp.float32),
                           NamedSharding(mesh, P(AXIS)))
        row = {"rows": rows, "bytes": rows * FLAGS.width * 4}
        forms = {"psum": psum}
        if all_reduce.fits(jnp.zeros((rows, FLAGS.width), jnp.float32)):
            forms["one_shot"] = one_shot
            check = {name: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P()))(x)
                     for name, fn in forms.items()}
            row["equal_to_psum"] = bool(np.array_equal(np.asarray(check["psum"]), np.asarray(check["one_shot"])))
        for name, fn in forms.items():
            median, best = common.timed(_program(mesh, fn, FLAGS.calls), x, trials=FLAGS.trials)
            row[f"{name}_us"], row[f"{name}_best_us"] = median / FLAGS.calls * 1e6, best / FLAGS.calls * 1e6
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
