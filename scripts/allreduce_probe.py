"""Latency of the small all-reduces a TP decode step makes, under candidate XLA / NCCL settings.

A TP2 step of the 27B target makes 2L+1 = 129 dependent all-reduces of one [1, 5120] bf16 row
(issue 5; the bench breakdown measured ~2.1 ms of a 10.5 ms TP2 step). This probe times a chain of
`--count` dependent psums inside one jitted shard_map (x <- psum(x) * (1/N): the values stay put),
repeated in a fori_loop, and subtracts the same chain without the psum:

    us_per_all_reduce = ((t(R_long) - t(R_short)) - (b(R_long) - b(R_short))) / ((R_long - R_short) * count)

Each setting (XLA_FLAGS and NCCL environment) runs in its own process, because XLA reads its flags
once per process. One JSON line per setting; with --out, a JSON file with all of them.

  PYTHONPATH=. python scripts/allreduce_probe.py --out=$OUT/allreduce.json          (GPU machine)
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/allreduce_probe.py --settings=default
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# name -> (extra XLA_FLAGS, extra environment). NVLink multicast stays off (the machine's NCCL_NVLS_ENABLE=0
# is inherited; nothing here asks for multicast).
SETTINGS = {
    "default": ("", {}),
    "one_shot_kernel": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true", {}),
    "sync_all_reduce": ("--xla_gpu_disable_async_collectives=ALLREDUCE", {}),
    "nccl_ll": ("", {"NCCL_PROTO": "LL"}),
    "nccl_ll_1ch": ("", {"NCCL_PROTO": "LL", "NCCL_MAX_NCHANNELS": "1"}),
    "sync_one_shot": ("--xla_gpu_disable_async_collectives=ALLREDUCE "
                      "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true", {}),
    "command_buffer_collectives": ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES", {}),
    # NCCL's symmetric-memory kernels (NCCL >= 2.27; buffers registered as windows), 30-40% lower
    # latency for small all-reduces by the XLA change that added them; multicast stays off
    "nccl_symmetric": ("--xla_gpu_experimental_enable_nccl_symmetric_buffers=true", {}),
    # XLA's NVSHMEM collectives by name (small messages inside an NVLink domain); a machine or jaxlib
    # without them fails this setting's process, and its line says so
    "nvshmem": ("--xla_gpu_collectives_implementation=nvshmem", {}),
}


def measure(size: int, count: int, reps: tuple[int, int], trials: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from qmtp import tp

    n = len(jax.devices())
    mesh = tp.make_mesh(n)

    def chain(with_psum: bool):
        # scales are runtime values and each link ends in an optimization barrier, so XLA can neither
        # fold the baseline's multiplies nor fuse its links into one kernel: one small kernel per
        # link in both chains, and the difference is the all-reduce alone
        def body(x, r, inv_n, n_arr):  # x [1, size] per device; r [1] repetitions
            def one_rep(_, x):
                for _ in range(count):
                    y = jax.lax.optimization_barrier(x * inv_n[0])
                    x = jax.lax.psum(y, tp.AXIS) if with_psum else y * n_arr[0]
                return x
            return jax.lax.fori_loop(0, r[0], one_rep, x)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=P(), check_vma=False))

    x = jnp.ones((1, size), jnp.bfloat16)
    inv_n, n_arr = jnp.full((1,), 1.0 / n, jnp.bfloat16), jnp.full((1,), n, jnp.bfloat16)
    out = {"devices": n, "device_kind": jax.devices()[0].device_kind, "size": size, "count": count, "reps": reps}
    for name, with_psum in (("psum", True), ("baseline", False)):
        fn = chain(with_psum)
        times = {}
        for r in reps:
            arg = jnp.full((1,), r, jnp.int32)
            jax.block_until_ready(fn(x, arg, inv_n, n_arr))  # compile + warm
            samples = []
            for _ in range(trials):
                t = time.perf_counter()
                jax.block_until_ready(fn(x, arg, inv_n, n_arr))
                samples.append(time.perf_counter() - t)
            times[r] = float(np.median(samples))
        out[name + "_s"] = times
    d_psum = out["psum_s"][reps[1]] - out["psum_s"][reps[0]]
    d_base = out["baseline_s"][reps[1]] - out["baseline_s"][reps[0]]
    per = (reps[1] - reps[0]) * count
    out["us_per_all_reduce"] = (d_psum - d_base) / per * 1e6
    out["us_per_link_with_op"] = d_psum / per * 1e6  # psum + its elementwise op, as the chain runs it
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    ap.add_argument("--size", type=int, default=5120, help="elements of the all-reduced row (hidden size)")
    ap.add_argument("--count", type=int, default=129, help="dependent all-reduces per repetition (2L+1)")
    ap.add_argument("--reps", default="2,12", help="short,long repetition counts")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON file with every setting's result")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps = tuple(int(r) for r in args.reps.split(","))
    if args.child:  # one setting, in this process
        print(json.dumps({"setting": args.child, **measure(args.size, args.count, reps, args.trials)}), flush=True)
        return 0
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:  # before any setting runs
        ap.error(f"--settings: unknown {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    results = []
    for name in names:
        flags, env = SETTINGS[name]
        child_env = dict(os.environ, **env)
        child_env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags) if f)
        cmd = [sys.executable, __file__, f"--child={name}", f"--size={args.size}", f"--count={args.count}",
               f"--reps={args.reps}", f"--trials={args.trials}"]
        t = time.perf_counter()
        p = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=300)
        line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
        row = json.loads(line) if p.returncode == 0 and line else {"setting": name, "error": p.stderr[-2000:]}
        row.update(xla_flags=child_env["XLA_FLAGS"], env=env, wall_s=round(time.perf_counter() - t, 1))
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
