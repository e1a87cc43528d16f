"""The Pallas launches of a pass are lowered once per distinct (shapes, config), not once per layer:
fp8_matmul's decode / prefill launches and gdn_conv's kernel are nested jits, whose lowered functions
JAX reuses (a 64-layer 27B loop lowers ~8x faster than with a pallas_call per layer). Checked on the
H200 lowering from the CPU: the Triton kernels in the module do not grow with the layer count."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from h200_lowering import lower_for_h200, triton_calls
from pallas_kernels import fp8_matmul as fm
from pallas_kernels import gdn_conv

E, HK, HV, DK, DV = 256, 2, 4, 32, 32
C = 2 * HK * DK + HV * DV
sds = jax.ShapeDtypeStruct


def _layers(layers: int):
    """A pass of `layers` layers: each a shared FP8 launch of two weights, one alone, a GEMM of 136 rows
    and the conv + recurrence kernel, every layer with its own weights and state."""

    def run(x, ws, ss, mixed, conv, conv_w, ba, a_log, dt_bias, state, n):
        acc = jnp.zeros((), jnp.float32)
        for layer in range(layers):
            (w1, w2, w3), (s1, s2, s3) = ws[layer], ss[layer]
            y1, y2 = fm.fp8_matmul_many(x, (w1, w2), (s1, s2))
            y3 = fm.fp8_matmul(y1[:, :E], w3, s3)
            g = fm.fp8_matmul(jnp.tile(x, (136 // x.shape[0] + 1, 1))[:136], w1, s1)
            o, _, _ = gdn_conv.gdn_conv_recurrence(mixed, conv[layer], conv_w, None, None, a_log, dt_bias,
                                                   state[layer], n, key_heads=HK, scale=DK ** -0.5, ba=ba)
            acc = acc + jnp.sum(y2) + jnp.sum(y3) + jnp.sum(g) + jnp.sum(o)
        return acc

    w = lambda o, i: (sds((o, i), jnp.float8_e4m3fn), sds((o // 128, i // 128), jnp.float32))
    shapes = [w(2 * E, E), w(E, E), w(E, E)]
    args = (sds((4, E), jnp.bfloat16), [tuple(s[0] for s in shapes)] * layers, [tuple(s[1] for s in shapes)] * layers,
            sds((1, 4, C), jnp.bfloat16), [sds((1, 3, C), jnp.bfloat16)] * layers, sds((C, 4), jnp.bfloat16),
            sds((1, 4, 2 * HV), jnp.bfloat16), sds((HV,), jnp.float32), sds((HV,), jnp.float32),
            [sds((1, HV, DK, DV), jnp.float32)] * layers, sds((1,), jnp.int32))
    return len(triton_calls(lower_for_h200(run, args)))


def test_kernels_lowered_once_per_distinct_launch():
    two, six = _layers(2), _layers(6)
    # the shared decode launch, the lone one, the GEMM and the conv kernel: 4 whatever the layer count
    assert two == six == 4, (two, six)
