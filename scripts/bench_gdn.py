"""GDN timings on the GPU machine (issue 4). One process, JSON lines on stdout and one JSON file:

    PYTHONPATH=. python scripts/bench_gdn.py --out=$OUT/bench_gdn.json

1. copy ceiling: jitted x + 1 over 4 GiB f32 (read + write), best of 10, as in gpu_baseline.py.
2. decode / verify recurrence, Qwen3.5-27B GDN shapes (Hk 16, Hv 48, Dk = Dv = 128), T in {1, 5},
   B in {1, 8}: gdn_recurrence_ref and the Pallas kernel (each config of --configs), each timed
   inside one jitted fori_loop that updates --layers different states per iteration (48 = one
   decode step of the 27B model, 144 MiB of state per sequence: far more than the 50 MB L2, and no
   host dispatch per call). Reports us per call and the state bytes moved per second (read + write
   of [B, 48, 128, 128] f32 per call) as a share of the copy bandwidth; plus the kernel's relative
   error against the ref for that shape.
3. chunked prefill: gdn_chunked_ref (jitted; --prefill_layers layers in one program) at B = 1,
   T in --prefill_tokens: tokens/s for one layer and for the 48 GDN layers, and its share of one
   prefill of a 27B GDN decoder layer, whose other cost is measured in the same run as the layer's
   bf16 XLA matmuls (in_proj_qkv, z, b, a, out_proj, MLP gate/up/down) over the same T tokens:
   share = t_gdn / (t_gdn + t_matmuls). Also times the Pallas recurrence kernel at those T (its
   token loop) for comparison.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

from absl import app, flags

flags.DEFINE_string("out", "bench_gdn.json", "Where to write the JSON results.")
flags.DEFINE_integer("layers", 48, "Distinct states updated per loop iteration in the decode timing.")
flags.DEFINE_integer("iters", 20, "Loop iterations per timed decode call.")
flags.DEFINE_integer("repeats", 7, "Timed calls per case (median and best reported).")
flags.DEFINE_list("configs", ["32x4", "16x4", "64x4", "32x2", "32x8", "128x8"],
                  "Kernel tile configs to time, block_v x num_warps (the first: the frozen default).")
flags.DEFINE_list("batches", ["1", "8"], "Decode batch sizes.")
flags.DEFINE_list("tokens", ["1", "5"], "Decode / verify token counts.")
flags.DEFINE_list("prefill_tokens", ["512", "4096"], "Prefill lengths for the chunked reference.")
flags.DEFINE_integer("prefill_layers", 4, "Distinct layers per jitted prefill program.")
flags.DEFINE_bool("kernel_prefill", True, "Also time the Pallas recurrence kernel at the prefill lengths.")
flags.DEFINE_bool("interpret", False, "Run the kernel in interpret mode (CPU smoke test of this script only).")
FLAGS = flags.FLAGS

HK, HV, DK, DV = 16, 48, 128, 128
HIDDEN, FFN = 5120, 17408
GDN_LAYERS = 48
CHUNK = 64


def emit(results: dict, key: str, item: dict) -> None:
    results.setdefault(key, []).append(item)
    print(json.dumps({key: item}), flush=True)
    with open(FLAGS.out, "w") as f:
        json.dump(results, f, indent=2)


def timed(step, carry, consts, repeats: int):
    """carry = step(carry, consts) (the carry donated; inputs are arguments, never closed-over
    constants), once to compile and warm, then `repeats` times timed."""
    import jax
    t0 = time.perf_counter()
    carry = jax.block_until_ready(step(carry, consts))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(step(carry, consts))
        times.append(time.perf_counter() - t0)
    return carry, {"median_s": statistics.median(times), "best_s": min(times), "first_call_s": first}


def gdn_inputs(key, b: int, t: int):
    """Model-like inputs: q, k L2-normalised (q * Dk^-0.5), g < 0, 0 < beta < 1, state ~ N(0, 0.25)."""
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(key, 6)
    l2 = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q = l2(jax.random.normal(ks[0], (b, t, HK, DK))) * DK ** -0.5
    k = l2(jax.random.normal(ks[1], (b, t, HK, DK)))
    v = jax.random.normal(ks[2], (b, t, HV, DV))
    g = -0.3 * jnp.exp(0.5 * jax.random.normal(ks[3], (b, t, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, HV)))
    state = 0.5 * jax.random.normal(ks[5], (b, HV, DK, DV))
    return q, k, v, g, beta, state


def decode_case(fn, b: int, t: int) -> dict:
    """fn(q, k, v, g, beta, state) -> (o, state'); --layers states updated per fori_loop iteration."""
    import jax
    import jax.numpy as jnp
    layers, iters = FLAGS.layers, FLAGS.iters
    inputs = gdn_inputs(jax.random.key(b * 10 + t), b, t)[:5]
    states = tuple(0.5 * jax.random.normal(jax.random.key(1000 + i), (b, HV, DK, DV)) for i in range(layers))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry, inputs):
        q, k, v, g, beta = inputs

        def body(i, c):
            sts, acc = c
            new = []
            for s in sts:
                o, s = fn(q, k, v, g, beta, s)
                acc = acc + jnp.sum(o)  # keeps o live (the ref would otherwise skip computing it)
                new.append(s)
            return tuple(new), acc
        return jax.lax.fori_loop(0, iters, body, carry)

    carry = (states, jnp.zeros((), jnp.float32))
    carry, tm = timed(step, carry, inputs, FLAGS.repeats)
    calls = layers * iters
    state_bytes = b * HV * DK * DV * 4
    per_call = tm["median_s"] / calls
    out = {"us_per_call": per_call * 1e6, "best_us_per_call": tm["best_s"] / calls * 1e6,
           "state_tb_per_s": 2 * state_bytes / per_call / 1e12, "first_call_s": tm["first_call_s"],
           "finite": bool(jnp.isfinite(carry[1]))}
    del carry
    return out


def rel_err(a, e) -> float:
    import numpy as np
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


def bench_decode(results: dict, copy_tbps: float, configs, with_ref: bool) -> None:
    import jax
    from pallas_kernels import gdn
    for b in map(int, FLAGS.batches):
        for t in map(int, FLAGS.tokens):
            args = gdn_inputs(jax.random.key(7), b, t)
            want_o, want_s = jax.jit(gdn.gdn_recurrence_ref)(*args)
            cases = [("ref", None, gdn.gdn_recurrence_ref)] if with_ref else []
            for c in configs:
                bv, warps = map(int, c.split("x"))
                cfg = gdn.RecurrenceConfig(block_v=bv, num_warps=warps)
                cases.append((f"kernel_{c}", cfg,
                              functools.partial(gdn.gdn_recurrence, config=cfg, interpret=FLAGS.interpret)))
            for name, cfg, fn in cases:
                item = {"impl": name, "B": b, "T": t, "layers": FLAGS.layers, "iters": FLAGS.iters}
                try:
                    if cfg is not None:
                        o, s = jax.jit(fn)(*args)
                        item["rel_err_o"], item["rel_err_state"] = rel_err(o, want_o), rel_err(s, want_s)
                    item.update(decode_case(fn, b, t))
                    item["share_of_copy"] = item["state_tb_per_s"] / copy_tbps
                except Exception as e:  # record and go on: one failing config must not hide the others
                    item["error"] = repr(e)[:2000]
                    print(f"{name} B={b} T={t} failed: {e!r}", file=sys.stderr, flush=True)
                emit(results, "decode", item)


def chunked_flops_per_token() -> float:
    """Multiply-adds x 2 of gdn_chunked_ref per token, all heads: intra-chunk C x C products (K K^T,
    U, W, Q K^T, the intra-chunk output) and the per-chunk state products (W S, Q S, K^T Vn)."""
    return HV * (2 * CHUNK * (3 * DK + 2 * DV) + 6 * DK * DV)


def layer_matmuls(x, w):
    """The bf16 matmuls of one 27B GDN decoder layer over x [T, E]: projections, out_proj, MLP."""
    import jax
    import jax.numpy as jnp
    mm = lambda a, m: jnp.einsum("ti,oi->to", a, m, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    qkv, z = mm(x, w["qkv"]), mm(x, w["z"])
    ba = mm(x, w["ba"])
    o = z * jax.nn.sigmoid(qkv[:, :HV * DV]) + ba[:, :1]  # stands in for the GDN output [T, Hv*Dv]
    h = x + mm(o, w["out"])
    return h + mm(jax.nn.silu(mm(h, w["gate"])) * mm(h, w["up"]), w["down"])


def bench_prefill(results: dict) -> None:
    import jax
    import jax.numpy as jnp
    from pallas_kernels import gdn
    n = FLAGS.prefill_layers
    for t in map(int, FLAGS.prefill_tokens):
        item = {"B": 1, "T": t, "layers_per_program": n}
        try:
            xs = [gdn_inputs(jax.random.key(100 + i), 1, t) for i in range(n)]

            ins = [x[:5] for x in xs]

            @functools.partial(jax.jit, donate_argnums=0)
            def chunked(c, ins):
                outs = [gdn.gdn_chunked_ref(*x, s) for x, s in zip(ins, c[0])]
                return tuple(s for _, s in outs), sum(jnp.sum(o) for o, _ in outs)

            _, tm = timed(chunked, (tuple(x[5] for x in xs), jnp.zeros(())), ins, FLAGS.repeats)
            per_layer = tm["median_s"] / n
            item.update({"chunked_ref_ms_per_layer": per_layer * 1e3,
                         "chunked_ref_tokens_per_s_one_layer": t / per_layer,
                         "chunked_ref_tokens_per_s_48_layers": t / (GDN_LAYERS * per_layer),
                         "chunked_ref_tflops": chunked_flops_per_token() * t / per_layer / 1e12,
                         "chunked_first_call_s": tm["first_call_s"]})

            key = jax.random.key(t)
            mk = lambda i, shape: (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02)
            ws = [{"qkv": mk(10 * j, (2 * HK * DK + HV * DV, HIDDEN)), "z": mk(10 * j + 1, (HV * DV, HIDDEN)),
                   "ba": mk(10 * j + 2, (2 * HV, HIDDEN)), "out": mk(10 * j + 3, (HIDDEN, HV * DV)),
                   "gate": mk(10 * j + 4, (FFN, HIDDEN)), "up": mk(10 * j + 5, (FFN, HIDDEN)),
                   "down": mk(10 * j + 6, (HIDDEN, FFN))} for j in range(n)]
            x0 = jax.random.normal(key, (t, HIDDEN), jnp.bfloat16)

            @functools.partial(jax.jit, donate_argnums=0)
            def matmuls(x, ws):
                for w in ws:
                    x = layer_matmuls(x, w)
                return x

            _, tmm = timed(matmuls, x0, ws, FLAGS.repeats)
            mm_layer = tmm["median_s"] / n
            params = sum(w.size for w in ws[0].values())
            item.update({"layer_matmuls_ms": mm_layer * 1e3,
                         "layer_matmuls_tflops": 2 * params * t / mm_layer / 1e12,
                         "chunked_share_of_layer_prefill": per_layer / (per_layer + mm_layer)})
            del ws

            if FLAGS.kernel_prefill:
                rec = functools.partial(gdn.gdn_recurrence, interpret=FLAGS.interpret)

                @functools.partial(jax.jit, donate_argnums=0)
                def kernel(c, ins):
                    outs = [rec(*x, s) for x, s in zip(ins, c[0])]
                    return tuple(s for _, s in outs), sum(jnp.sum(o) for o, _ in outs)

                xs = [gdn_inputs(jax.random.key(100 + i), 1, t) for i in range(n)]  # states were donated
                _, tk = timed(kernel, (tuple(x[5] for x in xs), jnp.zeros(())), ins, FLAGS.repeats)
                k_layer = tk["median_s"] / n
                item.update({"recurrence_kernel_ms_per_layer": k_layer * 1e3,
                             "recurrence_kernel_tokens_per_s_one_layer": t / k_layer})
                fresh = gdn_inputs(jax.random.key(100), 1, t)  # the timed states were donated
                o_c, s_c = jax.jit(gdn.gdn_chunked_ref)(*fresh)
                o_k, s_k = jax.jit(rec)(*fresh)
                item["kernel_vs_chunked_rel_err_state"] = rel_err(s_k, s_c)
                item["kernel_vs_chunked_rel_err_o"] = rel_err(o_k, o_c)
            del xs
        except Exception as e:
            item["error"] = repr(e)[:2000]
            print(f"prefill T={t} failed: {e!r}", file=sys.stderr, flush=True)
        emit(results, "prefill", item)


def main(argv):
    from qmtp.bandwidth import copy_bandwidth
    import jax
    results = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
               "device_kind": jax.devices()[0].device_kind}
    results["copy"] = copy_bandwidth()
    print(json.dumps({"copy": results["copy"]}), flush=True)
    # the ref and the first config everywhere, then prefill, then the rest of the sweep: whatever a
    # time limit cuts off, the main figures are already in --out (rewritten after every item)
    bench_decode(results, results["copy"]["tb_per_s"], FLAGS.configs[:1], with_ref=True)
    if FLAGS.prefill_tokens and FLAGS.prefill_tokens != [""]:
        bench_prefill(results)
    bench_decode(results, results["copy"]["tb_per_s"], FLAGS.configs[1:], with_ref=False)
    with open(FLAGS.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
