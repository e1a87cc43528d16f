"""A small program for Nsight Compute: the FP8 decode kernel at one row on two 27B shapes and the
same kernel on a bf16 weight (which streams ~1.7x the bytes per second: issue 4), each launched
twice (the first call compiles). Under ncu (scripts/ncu_fp8.sh) the second round is profiled:

  launch 4: fp8  [17408, 5120]  (gate / up, default config: 64-row programs, split-K 2)
  launch 5: fp8  [5120, 17408]  (mlp_down, split-K 4)
  launch 6: bf16 [17408, 5120]  (fp8_matmul.bf16_matmul: the same kernel, 2 bytes per weight)
  launch 7: fp8  [17408, 5120]  with DecodeConfig(x_f16=True) (E4M3 -> f16 instead of bf16)
(each round launches 4 kernels named fp8_matmul_decode; the x_f16 call's piece and sum ops are XLA's)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import fp8_matmul as fm


def weights(o, i, key):
    w = (jax.random.normal(key, (o, i), jnp.float32) * 64.0).clip(-448, 448).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(key, (o // 128, i // 128), jnp.float32, 1e-4, 2e-4)
    return w, s


def main() -> None:
    k = jax.random.split(jax.random.key(0), 4)
    w_up, s_up = weights(17408, 5120, k[0])
    w_down, s_down = weights(5120, 17408, k[1])
    w_bf16 = jax.jit(lambda w, s: fm.dequantize_ref(w, s, jnp.bfloat16))(w_up, s_up)
    x_up = jax.random.normal(k[2], (1, 5120), jnp.float32).astype(jnp.bfloat16)
    x_down = jax.random.normal(k[3], (1, 17408), jnp.float32).astype(jnp.bfloat16)
    mm = jax.jit(fm.fp8_matmul, static_argnames=("config",))  # one program per shape and config
    b16 = jax.jit(fm.bf16_matmul)
    f16_config = dataclasses.replace(fm.default_config(1, 17408, 5120), x_f16=True)
    for _ in range(2):
        jax.block_until_ready(mm(x_up, w_up, s_up))
        jax.block_until_ready(mm(x_down, w_down, s_down))
        jax.block_until_ready(b16(x_up, w_bf16))
        jax.block_until_ready(mm(x_up, w_up, s_up, config=f16_config))
    print("configs:", fm.default_config(1, 17408, 5120), fm.default_config(1, 5120, 17408), flush=True)


if __name__ == "__main__":
    main()
