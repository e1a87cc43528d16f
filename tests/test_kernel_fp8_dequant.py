"""The FP8 dequantize kernel (pallas_kernels/fp8_dequant.py) against its jnp twin, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8_dequant, fp8_matmul
from pallas_kernels.fp8_layout import tile_weight
from h200_lowering import lower_for_h200, triton_calls


def _weight(o: int, i: int, seed: int = 0):
    """[O, I] E4M3 over its whole range (subnormals, +-448) and a scale grid of distinct values."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(o, i)) * 100.0, jnp.float32).clip(-448, 448).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(1e-4, 3.0, size=(-(-o // 128), i // 128)), jnp.float32)
    return w, scale


# (O, I, tile rows or None for the checkpoint's [O, I]): 128-row tiles with chunk counts 4, 2 and 1 per
# program (I / 128 = 8, 6, 1... 5), 64-row tiles (O no multiple of 128: the last scale block spans 64 rows)
CASES = [(256, 1024, 128), (384, 768, 128), (128, 640, 128), (192, 512, 64), (256, 384, None), (320, 256, None)]


@pytest.mark.parametrize("o,i,rows", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_equals_the_reference_bitwise(o, i, rows, dtype):
    w, scale = _weight(o, i)
    laid_out = w if rows is None else tile_weight(w, rows)
    got = fp8_dequant.dequantize(laid_out, scale, dtype, interpret=True)
    want = fp8_matmul.dequantize_ref(w, scale, dtype)
    assert got.shape == (o, i) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_weight_shards_inside_shard_map():
    """TP: each device dequantizes its shard of the tiles (as the model's shard_map runs Pallas kernels:
    check_vma off, see qmtp/api.py) and the shards make up the whole weight's values."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    w, scale = _weight(512, 256)
    mesh = jax.make_mesh((2,), ("x",))
    shard = NamedSharding(mesh, P("x"))
    f = jax.jit(jax.shard_map(lambda w, s: fp8_dequant.dequantize(w, s, jnp.bfloat16, interpret=True), mesh=mesh,
                              in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False))
    got = f(jax.device_put(tile_weight(w), shard), jax.device_put(scale, shard))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(fp8_matmul.dequantize_ref(w, scale, jnp.bfloat16).astype(jnp.float32)))


def test_bad_inputs_name_the_shape():
    w, scale = _weight(256, 256)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_dequant.dequantize(w.astype(jnp.bfloat16), scale, interpret=True)
    with pytest.raises(ValueError, match=r"w \(100, 256\)"):
        fp8_dequant.dequantize(w[:100], scale, interpret=True)
    with pytest.raises(ValueError, match=r"scale \(1, 2\)"):
        fp8_dequant.dequantize(w, scale[:1], interpret=True)


def test_lowers_for_h200():
    w = jax.ShapeDtypeStruct((40, 40, 128, 128), jnp.float8_e4m3fn)  # the 27B's [5120, 5120] tiles
    scale = jax.ShapeDtypeStruct((40, 40), jnp.float32)
    lowered = lower_for_h200(lambda w, s: fp8_dequant.dequantize(w, s, jnp.bfloat16), (w, scale))
    assert len(triton_calls(lowered)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("o,i,rows", [(17408 * 2, 5120, 128), (5120, 17408, 128), (192, 5120, 64)])
def test_gpu_equals_the_reference(o, i, rows):
    w, scale = _weight(o, i)
    got = jax.jit(lambda w, s: fp8_dequant.dequantize(w, s, jnp.bfloat16))(tile_weight(w, rows), scale)
    want = jax.jit(lambda w, s: fp8_matmul.dequantize_ref(w, s, jnp.bfloat16))(w, scale)
    assert bool(jnp.array_equal(got, want))
