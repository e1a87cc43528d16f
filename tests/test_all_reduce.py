"""pallas_kernels/all_reduce.py: which arrays the one-shot kernel takes, its lowering for 2, 4 and 8 H200s
inside shard_map (the CPU cannot run it: Mosaic GPU's interpreter has no semaphores), and on two or
more GPUs its sum against psum's, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from h200_lowering import H200
from pallas_kernels import all_reduce


def _zeros(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("shape,dtype,fits", [
    ((1, 5120), jnp.float32, True),  # one decode row of the 27B
    ((12, 5120), jnp.float32, True),  # the most rows of 5120 under MAX_BYTES
    ((13, 5120), jnp.float32, False),
    ((1, 5120), jnp.bfloat16, False),  # partial sums are f32
    ((1, 100), jnp.float32, False),  # not whole pieces of the warpgroup's layout
])
def test_fits_takes_small_f32_arrays_of_whole_pieces(shape, dtype, fits):
    assert all_reduce.fits(jnp.zeros(shape, dtype)) == fits


def _lower(n: int, rows: int):
    mesh = jax.sharding.AbstractMesh((n,), ("tp",), abstract_device=H200,
                                     axis_types=(jax.sharding.AxisType.Explicit,))
    # out_specs P(): shard_map's check_vma accepts only an output typed the same on every device
    body = jax.shard_map(lambda x: all_reduce.one_shot_all_reduce(x, "tp"), mesh=mesh, in_specs=P("tp"),
                         out_specs=P())
    x = jax.ShapeDtypeStruct((n * rows, 5120), jnp.float32, sharding=NamedSharding(mesh, P("tp")))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(body).trace(x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n,rows", [(2, 1), (2, 12), (4, 1), (8, 4)])
def test_the_kernel_lowers_for_h200s_with_a_replicated_output(n, rows):
    text = _lower(n, rows)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1 and "stablehlo.all_reduce" not in text  # no psum


def test_an_array_it_does_not_take_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="at most 262144 bytes"):
        jax.eval_shape(lambda x: all_reduce.one_shot_all_reduce(x, "tp"), _zeros(13, 5120))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 12])
def test_gpu_the_sum_equals_psum_bit_for_bit(rows):
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs two or more GPUs")
    mesh = jax.sharding.Mesh(devices, ("tp",))
    x = jax.device_put(jnp.asarray(np.random.default_rng(rows).standard_normal((mesh.size * rows, 5120)),
                                   jnp.float32), NamedSharding(mesh, P("tp")))
    run = lambda fn: np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P()))(x))  # noqa: E731
    got = run(lambda v: all_reduce.one_shot_all_reduce(v, "tp"))
    want = run(lambda v: all_reduce.all_reduce_ref(v, "tp"))
    np.testing.assert_array_equal(got, want)
