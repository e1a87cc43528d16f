"""How long tracing and lowering a decode loop takes, for the H200, without a GPU.

The persistent compilation cache (qmtp/compile_cache.py) keys on the lowered program, so every start
still traces the model and runs each Pallas kernel's Triton lowering before it can hit the cache; at
27B that was ~37 s of a cached K=3 start on the GPU host (session 14). This script times those two
stages for the plain loop (`decode.greedy_loop`) or the speculative loop (`speculate.spec_loop`)
on a CPU-only machine, lowering for an abstract H200 with the kernels' GPU path (not interpret mode).

  JAX_PLATFORMS=cpu PYTHONPATH=. python scripts/lowering_time.py --layers=64 --mtp_k=3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=64, help="layers of the Qwen3.5-27B-shaped FP8 model")
    ap.add_argument("--mtp_k", type=int, default=0, help="0: the plain loop; 1-4: the speculative loop with K drafts")
    args = ap.parse_args()

    import numpy as np
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from h200_lowering import H200

    from pallas_kernels.bench.step import random_params
    from qmtp import api, config as qc, decode, ops, speculate
    from qmtp.state import init_state
    from qmtp.tools import make_checkpoint

    ops._interpret = lambda: False  # the kernels' Triton lowering, as on the GPU
    cfg = qc.from_dict(make_checkpoint.build_config("qwen3_5_27b", "fp8", 0, args.layers))
    params = jax.eval_shape(api.fuse_gate_projections, jax.eval_shape(lambda: random_params(cfg, jnp.bfloat16)))
    state = jax.eval_shape(lambda: init_state(cfg, np.arange(80, dtype=np.int32)[None], 80, 16, jnp.bfloat16))
    ids = jax.ShapeDtypeStruct((1,), jnp.int32)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        t0 = time.perf_counter()
        if args.mtp_k:
            hidden = jax.ShapeDtypeStruct((1, cfg.hidden_size), jnp.bfloat16)
            cap = jax.ShapeDtypeStruct((64, 1), jnp.int32)
            traced = speculate.spec_loop.trace(cfg, speculate.SpecConfig(args.mtp_k, 256, ()), params, state, ids,
                                               ids, hidden, ids, cap, impl="pallas")
        else:
            traced = decode.greedy_loop.trace(cfg, decode.LoopSpec(256, ()), params, state, ids, ids, impl="pallas")
        t1 = time.perf_counter()
        traced.lower(lowering_platforms=("cuda",))
        t2 = time.perf_counter()
    loop = f"speculative loop K={args.mtp_k}" if args.mtp_k else "plain loop"
    print(f"{loop}, {args.layers} layers: trace {t1 - t0:.2f} s, lower {t2 - t1:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
