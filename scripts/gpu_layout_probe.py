"""Does slicing a layer out of stacked [L, O, I] weights copy it on the GPU? (parameter layout choice)

    PYTHONPATH=. python scripts/gpu_layout_probe.py

Runs the same 4-layer SwiGLU MLP stack at Qwen3.5-27B shapes (E 5120, F 17408, bf16, M = 1 row) as
a 20-step on-device loop in three layouts: a Python loop over static slices of stacked weights, a
Python loop over separate per-layer arrays, and lax.scan over the stack. Prints per-step time, the
implied weight bandwidth and XLA's temp buffer bytes, plus the copy ceiling from the same run.
"""

import json
import time

import jax
import jax.numpy as jnp

E, F, L, STEPS = 5120, 17408, 4, 20


def mlp(x, g, u, d):
    h = jnp.einsum("ti,oi->to", x, g, preferred_element_type=jnp.float32)
    up = jnp.einsum("ti,oi->to", x, u, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(h) * up).astype(x.dtype)
    return x + jnp.einsum("tf,ef->te", a, d, preferred_element_type=jnp.float32).astype(x.dtype)


def stacked(w, x):
    def body(_, x):
        for j in range(L):
            x = mlp(x, w["g"][j], w["u"][j], w["d"][j])
        return x
    return jax.lax.fori_loop(0, STEPS, body, x)


def listed(ws, x):
    def body(_, x):
        for w in ws:
            x = mlp(x, w["g"], w["u"], w["d"])
        return x
    return jax.lax.fori_loop(0, STEPS, body, x)


def scanned(w, x):
    def body(_, x):
        return jax.lax.scan(lambda x, lw: (mlp(x, lw["g"], lw["u"], lw["d"]), None), x, w)[0]
    return jax.lax.fori_loop(0, STEPS, body, x)


def timed(f, *args):
    f = jax.jit(f)
    mem = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    f(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(3):
        f(*args).block_until_ready()
    return (time.perf_counter() - t0) / 3 / STEPS, mem


def main():
    key = jax.random.PRNGKey(0)
    mk = lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.01).astype(jnp.bfloat16)
    ks = jax.random.split(key, 3)
    w = {"g": mk(ks[0], (L, F, E)), "u": mk(ks[1], (L, F, E)), "d": mk(ks[2], (L, E, F))}
    ws = [{n: a[j] + 0 for n, a in w.items()} for j in range(L)]
    x = jnp.ones((1, E), jnp.bfloat16)
    weight_bytes = sum(a.nbytes for a in w.values())
    big = jnp.zeros((1 << 30,), jnp.float32)
    inc = jax.jit(lambda a: a + 1)
    inc(big).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        inc(big).block_until_ready()
    copy = 2 * big.nbytes / ((time.perf_counter() - t0) / 5)
    out = {"copy_tb_s": copy / 1e12, "weight_bytes_per_step": weight_bytes}
    for name, f, arg in (("stacked_slices", stacked, w), ("per_layer_arrays", listed, ws), ("scan", scanned, w)):
        step, mem = timed(f, arg, x)
        out[name] = {"ms_per_step": step * 1e3, "tb_s": weight_bytes / step / 1e12, "temp_bytes": mem}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
