"""pallas_kernels/moe_matmul.py: the grouped expert matmul (interpret mode) against its reference, a row's
result independent of the rows beside it, unused blocks, and the H200 lowering (compiled on the device
by the `gpu` case)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200, triton_calls
from pallas_kernels import moe_matmul as mm
from qmtp.model.fp8 import quantize_np

X, O, I = 5, 200, 300  # ragged O and I: masked last blocks
BLOCKS = jnp.asarray([3, -1, 0, 4, 3], jnp.int32)


def _weights(kind: str, rng):
    w = rng.standard_normal((X, O, I)).astype(np.float32) * 0.1
    if kind == "fp8":
        q, s = zip(*(quantize_np(w[e]) for e in range(X)))
        return jnp.asarray(np.stack(q)), jnp.asarray(np.stack(s))
    return jnp.asarray(w, jnp.bfloat16 if kind == "bf16" else jnp.float32), None


@pytest.mark.parametrize("kind", ["fp8", "bf16", "f32"])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_matches_the_reference(kind, x_dtype):
    rng = np.random.default_rng(0)
    w, scale = _weights(kind, rng)
    x = jnp.asarray(rng.standard_normal((BLOCKS.shape[0] * mm.BLOCK_ROWS, I)), x_dtype)
    got = mm.expert_matmul(x, BLOCKS, w, scale, jnp.float32, interpret=True)
    want = mm.expert_matmul_ref(x, BLOCKS, w, scale, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    unused = slice(mm.BLOCK_ROWS, 2 * mm.BLOCK_ROWS)  # block 1 has no expert: zeros
    assert not np.asarray(got[unused]).any()


def test_taller_blocks_match_the_reference():
    """Blocks of 4 x BLOCK_ROWS rows (a prefill's blocks): the block height comes from the shapes."""
    rng = np.random.default_rng(3)
    w, scale = _weights("fp8", rng)
    x = jnp.asarray(rng.standard_normal((BLOCKS.shape[0] * 4 * mm.BLOCK_ROWS, I)), jnp.bfloat16)
    got = mm.expert_matmul(x, BLOCKS, w, scale, jnp.float32, interpret=True)
    want = mm.expert_matmul_ref(x, BLOCKS, w, scale, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[4 * mm.BLOCK_ROWS:8 * mm.BLOCK_ROWS]).any()  # block 1 unused
    with pytest.raises(ValueError, match="power of two"):
        mm.expert_matmul(x[:BLOCKS.shape[0] * 24], BLOCKS, w, scale, interpret=True)


SPLIT = mm.ExpertMatmulConfig(block_o=32, split_k=2)  # I = 300: 3 chunks in runs of 2 and 1


def test_split_runs_and_narrow_tiles_match_the_reference():
    rng = np.random.default_rng(2)
    w, scale = _weights("fp8", rng)
    x = jnp.asarray(rng.standard_normal((BLOCKS.shape[0] * mm.BLOCK_ROWS, I)), jnp.bfloat16)
    got = mm.expert_matmul(x, BLOCKS, w, scale, jnp.bfloat16, interpret=True, config=SPLIT)
    want = mm.expert_matmul_ref(x, BLOCKS, w, scale, jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)  # bf16 out
    assert got.dtype == jnp.bfloat16 and not np.asarray(got[mm.BLOCK_ROWS:2 * mm.BLOCK_ROWS]).any()


@pytest.mark.parametrize("config", [None, SPLIT], ids=["default", "split"])
def test_a_row_does_not_depend_on_the_rows_beside_it(config):
    rng = np.random.default_rng(1)
    w, scale = _weights("fp8", rng)
    x = jnp.asarray(rng.standard_normal((BLOCKS.shape[0] * mm.BLOCK_ROWS, I)), jnp.bfloat16)
    alone = x.at[1:].set(0)  # row 0 of block 0 with its neighbours zeroed
    run = lambda v: np.asarray(mm.expert_matmul(v, BLOCKS, w, scale, jnp.float32, interpret=True,  # noqa: E731
                                                config=config)[0])
    assert np.array_equal(run(x), run(alone))


def test_lowers_for_h200():
    sds = jax.ShapeDtypeStruct
    args = (sds((9 * mm.BLOCK_ROWS, 2048), jnp.bfloat16), sds((9,), jnp.int32),
            sds((256, 1024, 2048), jnp.float8_e4m3fn), sds((256, 8, 16), jnp.float32))
    lowered = lower_for_h200(lambda x, e, w, s: mm.expert_matmul(x, e, w, s, jnp.bfloat16), args)
    assert len(triton_calls(lowered)) == 1


@pytest.mark.gpu
def test_h200_kernel_matches_the_reference_at_the_35b_shapes():
    """The 35B-A3B expert gate/up at decode: 8 experts of 256, one token each (8 blocks + 1 unused)."""
    key = jax.random.key(0)
    w = (jax.random.normal(key, (256, 1024, 2048)) * 64).clip(-448, 448).astype(jnp.float8_e4m3fn)
    s = jnp.full((256, 8, 16), 1e-4, jnp.float32)
    e = jnp.asarray([3, 17, 40, 41, 99, 128, 200, 255, -1], jnp.int32)
    x = jax.random.normal(key, (9 * mm.BLOCK_ROWS, 2048)).astype(jnp.bfloat16)
    got = mm.expert_matmul(x, e, w, s, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(mm.expert_matmul_ref(x, e, w, s, jnp.float32)),
                               rtol=2e-5, atol=2e-5)
