"""Row-invariant numerics: a row's result does not depend on how many rows share the launch.

Greedy MTP equals plain decoding in bfloat16 only if a token's numbers are the same bits whether it
is decoded alone (one row), as one of the K+1 rows of a verify pass, or as one row of a batch: a
near-tie otherwise flips between them. Each case computes row 0 alone and inside launches of 2..128
rows and requires identical bits (f32 outputs, so no final rounding can hide a different sum order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmtp.model.fp8 import Fp8Block, quantize_np
from qmtp.runtime import ops
from qmtp.runtime.kernel_config import PALLAS, REF

ROWS = (2, 3, 5, 8, 9, 17, 33, 64, 128)


def _row0_alone_and_in(fn, x) -> dict:
    """{rows: row 0 of fn(x[:rows])} for 1 and ROWS, as f32 numpy."""
    f = jax.jit(fn)
    return {m: np.asarray(f(x[:m])[0].astype(jnp.float32)) for m in (1,) + ROWS}


def _parted(results: dict) -> list[int]:
    return [m for m in ROWS if not np.array_equal(results[m], results[1])]


# bf16 weights: out rows <= ops.BF16_REDUCE_MAX_OUT take the reduce form under Pallas, wider ones the dot
@pytest.mark.parametrize("kernels", [REF, PALLAS], ids=["ref", "pallas"])
@pytest.mark.parametrize("out_features,in_features", [(8, 256), (256, 256), (768, 256), (1024, 512)])
def test_bf16_linear_row_alone_equals_row_in_a_launch(kernels, out_features, in_features):
    rng = np.random.default_rng(out_features)
    x = jnp.asarray(rng.standard_normal((128, in_features)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((out_features, in_features)) * 0.05, jnp.bfloat16)
    results = _row0_alone_and_in(lambda x: ops.linear(x, w, kernels, out_dtype=jnp.float32), x)
    assert _parted(results) == []


def test_fp8_linear_reference_row_alone_equals_row_in_a_launch():
    rng = np.random.default_rng(1)
    weight, scale = quantize_np(rng.standard_normal((384, 256)).astype(np.float32) * 0.05)
    w = Fp8Block(jnp.asarray(weight), jnp.asarray(scale))
    x = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    results = _row0_alone_and_in(lambda x: ops.linear(x, w, REF, out_dtype=jnp.float32), x)
    assert _parted(results) == []


def test_a_leading_batch_shape_keeps_the_row_alone_form():
    """[1, 1, I] (one sequence, one token, as decode calls it) is the same one row as [1, I]."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 256)) * 0.05, jnp.bfloat16)
    flat = ops.linear(x[:1], w, REF, out_dtype=jnp.float32)
    nested = ops.linear(x[:1].reshape(1, 1, 256), w, REF, out_dtype=jnp.float32)
    assert nested.shape == (1, 1, 512)
    np.testing.assert_array_equal(np.asarray(nested).reshape(1, 512), np.asarray(flat))
    np.testing.assert_array_equal(np.asarray(flat[0]), np.asarray(ops.linear(x, w, REF, out_dtype=jnp.float32)[0]))
