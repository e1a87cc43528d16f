"""pallas_kernels/rms_norm.py: the row-invariant RMSNorm against its reference and numpy, row by row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rms_norm as rn
from h200_lowering import lower_for_h200, triton_calls

EPS = 1e-6


def _numpy(x, w, plus_one, z=None):
    x = np.asarray(x, np.float64)
    g = (1.0 + np.asarray(w, np.float64)) if plus_one else np.asarray(w, np.float64)
    if z is not None:
        z = np.asarray(z, np.float64)
        g = g * z / (1.0 + np.exp(-z))
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * g


@pytest.mark.parametrize("d", [96, 256, 320])  # ragged (padded to 128 / 512) and a power of two
@pytest.mark.parametrize("gated", [False, True])
def test_matches_numpy_and_keeps_each_row_alone(d, gated):
    rng = np.random.default_rng(d)
    x = jnp.asarray(rng.standard_normal((2, 5, d)) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(d) * 0.1, jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((2, 5, d)), jnp.bfloat16) if gated else None
    kw = dict(plus_one=not gated, z=z, out_dtype=jnp.float32)
    got = np.asarray(rn.rms_norm_rows(x, w, EPS, interpret=True, **kw))
    assert got.shape == x.shape
    np.testing.assert_allclose(got, _numpy(x, w, not gated, z), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np.asarray(rn.rms_norm_rows_ref(x, w, EPS, **kw)), rtol=1e-6, atol=1e-6)
    alone = rn.rms_norm_rows(x[:1, :1], w, EPS, interpret=True, plus_one=not gated,
                             z=None if z is None else z[:1, :1], out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(alone)[0, 0], got[0, 0])


def test_output_dtype_and_bad_shapes():
    x = jnp.ones((3, 64), jnp.bfloat16)
    assert rn.rms_norm_rows(x, jnp.zeros(64), EPS, plus_one=True, interpret=True).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"w \(32,\)"):
        rn.rms_norm_rows(x, jnp.zeros(32), EPS, plus_one=True, interpret=True)


def test_lowers_for_h200():
    x = jax.ShapeDtypeStruct((4, 5120), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((5120,), jnp.bfloat16)
    lowered = lower_for_h200(lambda x, w: rn.rms_norm_rows(x, w, EPS, plus_one=True, z=x), (x, w))
    assert len(triton_calls(lowered)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("d", [5120, 256, 128])
def test_h200_row_alone_equals_row_in_128(d):
    """XLA's fused norm changes row 0's bits from 33 rows at D = 5120; the kernel at none of 2..128."""
    x = jax.random.normal(jax.random.key(d), (128, d)).astype(jnp.bfloat16)
    w = jnp.full((d,), 0.01, jnp.bfloat16)
    f = jax.jit(lambda x: rn.rms_norm_rows(x, w, EPS, plus_one=True, out_dtype=jnp.float32))
    alone = np.asarray(f(x[:1])[0])
    assert [m for m in (2, 4, 9, 17, 33, 64, 128) if not np.array_equal(np.asarray(f(x[:m])[0]), alone)] == []
