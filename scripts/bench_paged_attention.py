"""GPU micro-benchmark: Pallas paged attention vs the jnp reference, against the copy bandwidth.

Each case (B, T, context) builds L layers of separate KV caches (bf16 [P, S, Hkv, D], shuffled pages,
every sequence at the full context), enough that the caches of one pass exceed the L2 cache; one
jitted program runs `reps` rounds over all L layers (each round's queries depend on the previous
round's output, so nothing is hoisted or overlapped across rounds). Time per call = wall / (reps L).
KV bytes per call = 2 (K and V) * sum_b kv_length_b * Hkv * D * itemsize: the bytes attention must
read, charged identically to both implementations. The copy ceiling is a jitted x + 1 over 4 GiB of
f32 (4 GiB read + 4 GiB written) in the same process. Prints one JSON document.

    JAX_PLATFORMS=cuda .venv/bin/python scripts/bench_paged_attention.py            # all cases
    JAX_PLATFORMS=cuda .venv/bin/python scripts/bench_paged_attention.py --b 8 --t 5 --context 8192 \
        --block_k 32 --num_warps 8                                                   # one point, tuned
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import paged_attention as pa  # noqa: E402

L2_BYTES = 50 * 2 ** 20  # H200 L2 (50 MiB); the caches of one round are made >= 8x this


def timed(fn, *args, iters: int) -> float:
    """Best wall time of `iters` calls (seconds), after one warm-up call (compile)."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def make_case(rng, b, t, context, hq, hkv, d, s, layers, dtype):
    pmax = -(-context // s)
    n_pages = b * pmax
    tables = rng.permutation(n_pages).reshape(b, pmax).astype(np.int32)
    kv_lengths = np.full((b,), context, np.int32)
    q_positions = (context - t + np.arange(t, dtype=np.int32))[None].repeat(b, 0)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    shape = (n_pages, s, hkv, d)
    ks, vs = [], []
    for i in range(layers):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        ks.append(jax.random.normal(k1, shape, dtype))
        vs.append(jax.random.normal(k2, shape, dtype))
    return q, ks, vs, jnp.asarray(tables), jnp.asarray(q_positions), jnp.asarray(kv_lengths)


def make_program(attn, layers: int, reps: int):
    def program(q, ks, vs, page_table, q_positions, kv_lengths):
        def round_(_, carry):
            qq = q + (carry * 1e-30).astype(q.dtype)  # a true dependency on the previous round
            total = jnp.zeros((), jnp.float32)
            for i in range(layers):
                o = attn(qq, ks[i], vs[i], page_table, q_positions, kv_lengths)
                total = total + jnp.sum(jnp.square(o.astype(jnp.float32)))  # all of o, nonlinearly
            return total

        return jax.lax.fori_loop(0, reps, round_, jnp.zeros((), jnp.float32))

    return jax.jit(program)


def main() -> None:
    from qmtp.bandwidth import copy_bandwidth
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--t", type=int, nargs="*", default=[1, 5])
    ap.add_argument("--context", type=int, nargs="*", default=[1024, 8192])
    ap.add_argument("--hq", type=int, default=24)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max_layers", type=int, default=64)
    ap.add_argument("--skip_ref", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (tiny shapes)")
    ap.add_argument("--copy_log2_elems", type=int, default=30, help="copy test size: 2^30 f32 = 4 GiB")
    for field in ("block_k", "max_tile_bytes", "target_programs", "min_keys_per_split", "num_warps", "num_stages"):
        ap.add_argument(f"--{field}", type=int, default=getattr(pa.DEFAULT_CONFIG, field))
    args = ap.parse_args()
    config = pa.PagedAttentionConfig(**{f: getattr(args, f) for f in (
        "block_k", "max_tile_bytes", "target_programs", "min_keys_per_split", "num_warps", "num_stages")})

    dtype = jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize
    scale = args.d ** -0.5
    kernel = lambda *a: pa.paged_attention(*a, scale, config=config, interpret=args.interpret)
    ref = lambda *a: pa.paged_attention_ref(*a, scale)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "config": vars(config),
              "shape": {"hq": args.hq, "hkv": args.hkv, "d": args.d, "page_size": args.page_size,
                        "dtype": jnp.dtype(dtype).name},
              "copy": copy_bandwidth(2 ** args.copy_log2_elems / (1 << 28), max(args.iters, 3)), "cases": []}
    copy_gbps = report["copy"]["tb_per_s"] * 1e3
    rng = np.random.default_rng(0)
    for b in args.b:
        for t in args.t:
            for context in args.context:
                kv_bytes = 2 * b * context * args.hkv * args.d * itemsize  # per layer call
                layers = max(2, min(args.max_layers, math.ceil(8 * L2_BYTES / kv_bytes)))
                inputs = make_case(rng, b, t, context, args.hq, args.hkv, args.d, args.page_size, layers, dtype)
                q, ks, vs, pt, qp, kl = inputs
                one = (q, ks[0], vs[0], pt, qp, kl)
                got = np.asarray(jax.jit(kernel)(*one), np.float64)
                want = np.asarray(jax.jit(ref)(*one), np.float64)
                case = {"b": b, "t": t, "context": context, "layers": layers, "reps": args.reps,
                        "kv_bytes_per_call": kv_bytes,
                        "n_splits": config.num_splits(b, args.hkv, -(-context // args.page_size) * args.page_size),
                        "rel_err_vs_ref": float(np.max(np.abs(got - want)) / np.max(np.abs(want)))}
                impls = [("kernel", kernel)] + ([] if args.skip_ref else [("ref", ref)])
                for name, attn in impls:
                    sec = timed(make_program(attn, layers, args.reps), *inputs, iters=args.iters)
                    per_call = sec / (args.reps * layers)
                    gbps = kv_bytes / per_call / 1e9
                    case[name] = {"us_per_call": per_call * 1e6, "KV_GBps": gbps, "share_of_copy": gbps / copy_gbps}
                if "ref" in case:
                    case["speedup_vs_ref"] = case["ref"]["us_per_call"] / case["kernel"]["us_per_call"]
                report["cases"].append(case)
                print(json.dumps(case), file=sys.stderr, flush=True)
                del inputs, q, ks, vs, one
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
