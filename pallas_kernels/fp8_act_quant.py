"""Dynamic FP8 activation quantization (MODEL_SPEC §5.3: DeepSeek-V3's "1x128", the checkpoints'
`activation_scheme: "dynamic"`) and the reference of fp8_matmul's act_quant path.

Per token row t and group g of 128 input features (the last group may be short):

    s_x[t, g] = max(max_i |x[t, g*128 + i]|, 1e-10) / 448
    x_q[t, i] = e4m3(clamp(x[t, i] / s_x[t, i // 128], -448, 448))          (round to nearest even)
    y[t, o]   = sum_g s_x[t, g] * s_w[o // 128, g] * sum_{i in g} x_q[t, i] * w_q[o, i]

Products x_q * w_q are exact in f32, group sums round in f32: against `fp8_matmul_ref` the error is x's
quantization, at most a relative 2^-4 per element (E4M3's 3 mantissa bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_layout import untile_weight

GROUP = 128  # activation features per scale (= the weight scale block)
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-10  # an all-zero group keeps a finite scale (its x_q are 0)


def quantize_activations(x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x2 [M, I] -> (x_q [M, I] float8_e4m3fn, s_x [M, ceil(I / 128)] f32), per MODEL_SPEC §5.3."""
    x_q, s_x = quantize_groups(x2)
    return x_q[:, :x2.shape[1]], s_x


def quantize_groups(x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """quantize_activations with x_q in whole groups [M, G * 128], zeros past I (the decode kernel's layout)."""
    m, i = x2.shape
    groups = -(-i // GROUP)
    xf = jnp.pad(x2.astype(jnp.float32), ((0, 0), (0, groups * GROUP - i))).reshape(m, groups, GROUP)
    s_x = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), SCALE_FLOOR) / E4M3_MAX  # [M, G]
    x_q = jnp.clip(xf / s_x[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return x_q.reshape(m, groups * GROUP), s_x


def fp8_matmul_act_ref(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """The module's y for x [..., I], W [O, I] E4M3 (either layout), scale grid; rounded once to out_dtype."""
    out_dtype = out_dtype or x.dtype
    lead, i = x.shape[:-1], x.shape[-1]
    w = untile_weight(w)  # either layout (fp8_layout)
    o = w.shape[0]
    x_q, s_x = quantize_groups(x.reshape(-1, i))
    groups = s_x.shape[1]
    xg = x_q.astype(jnp.float32).reshape(-1, groups, GROUP)
    wg = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, groups * GROUP - i))).reshape(o, groups, GROUP)
    per_group = jnp.einsum("mgk,ogk->mog", xg, wg, precision=jax.lax.Precision.HIGHEST)  # [M, O, G]
    s_w = jnp.repeat(scale.astype(jnp.float32), GROUP, axis=0)[:o]  # [O, G]
    y = jnp.sum(per_group * s_x[:, None, :] * s_w[None], axis=-1)
    return y.astype(out_dtype).reshape(*lead, o)
