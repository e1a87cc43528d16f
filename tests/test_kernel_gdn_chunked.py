"""pallas_kernels/gdn_chunked.py: the chunked gated delta rule with its chain over chunks in one Pallas
kernel, against the float64 loop of tests/test_kernel_gdn.py and against `gdn.gdn_chunked_ref` (interpret
mode on the CPU), and on the GPU at the 27B shapes (`gpu` marker). Tolerances: test_kernel_gdn.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn, gdn_chunked
from test_kernel_gdn import f32_recurrence_tol, make_inputs, np_recurrence
from h200_lowering import attr_int, lower_for_h200, triton_calls
from tolerance import assert_close

NARROW = gdn_chunked.ChunkScanConfig(block_v=16)  # two programs per head at Dv = 32: the column tiling runs


@pytest.mark.parametrize("b,t,hk,hv,dk,dv,chunk", [(2, 70, 2, 4, 16, 32, 16), (1, 37, 1, 2, 32, 16, 32)])
def test_kernel_matches_float64_loop_and_the_scan(b, t, hk, hv, dk, dv, chunk):
    """T not a multiple of the chunk (padding chunks leave the state), several chunks, GQA heads."""
    args = make_inputs(b, t, hk, hv, dk, dv, seed=t)
    o, s = gdn_chunked.gdn_chunked(*map(jnp.asarray, args), chunk=chunk, interpret=True, config=NARROW)
    want_o, want_s, _ = np_recurrence(*args)
    tol = f32_recurrence_tol(t, dk + chunk, implementations=2)
    assert_close(o, want_o, tol, "kernel o")
    assert_close(s, want_s, tol, "kernel final state")
    ref_o, ref_s = gdn.gdn_chunked_ref(*map(jnp.asarray, args), chunk=chunk)
    assert_close(o, ref_o, tol, "kernel o vs the scan")
    assert_close(s, ref_s, tol, "kernel state vs the scan")


def test_kernel_carries_the_state_across_calls():
    """Two calls, the second from the first's state (a prompt prefilled in pieces), give one call's result."""
    args = [jnp.asarray(a) for a in make_inputs(1, 64, 2, 4, 16, 16, seed=5)]
    call = lambda q, k, v, g, beta, s: gdn_chunked.gdn_chunked(q, k, v, g, beta, s, chunk=16, interpret=True)
    o, s = call(*args)
    first = [a[:, :32] for a in args[:5]]
    second = [a[:, 32:] for a in args[:5]]
    o1, s1 = call(*first, args[5])
    o2, s2 = call(*second, s1)
    tol = f32_recurrence_tol(64, 32, implementations=2)
    assert_close(jnp.concatenate([o1, o2], axis=1), o, tol, "o in two calls")
    assert_close(s2, s, tol, "state after two calls")


def test_inputs_are_checked_by_name():
    _, _, u, w, kd, decay = gdn.wy_chunk_inputs(*map(jnp.asarray, make_inputs(1, 32, 1, 2, 16, 16)), chunk=16)
    state = jnp.zeros((1, 2, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="decay has shape"):
        gdn_chunked.wy_chunk_states(u, w, kd, decay[..., :1], state, interpret=True)
    with pytest.raises(ValueError, match="state must be float32"):
        gdn_chunked.wy_chunk_states(u, w, kd, decay, state.astype(jnp.bfloat16), interpret=True)
    _, _, *odd = gdn.wy_chunk_inputs(*map(jnp.asarray, make_inputs(1, 24, 1, 2, 16, 16)), chunk=24)
    with pytest.raises(ValueError, match="C=24 must be a power of two"):
        gdn_chunked.wy_chunk_states(*odd, state, interpret=True)
    with pytest.raises(ValueError, match="block_v=24"):
        gdn_chunked.ChunkScanConfig(block_v=24)


def test_kernel_lowers_for_the_h200_with_three_tf32_products_per_dot():
    """The Triton module at the 27B shapes (T 128): the chain's two dots are 3xTF32 (without the algorithm
    they would lower as plain f32 dots), at the config's warps."""
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in map(jnp.asarray, make_inputs(1, 128, 16, 48, 128, 128))]
    config = gdn_chunked.parse_config("32x8")
    lowered = lower_for_h200(lambda *a: gdn_chunked.gdn_chunked(*a, config=config), args)
    [(cfg, text)] = triton_calls(lowered)
    assert attr_int(cfg, "num_warps") == 8
    dots = [line for line in text.splitlines() if "tt.dot" in line]
    assert len(dots) == 2 and all("inputPrecision = tf32x3" in line for line in dots), dots


def test_configs_parse_and_refuse_by_name():
    assert gdn_chunked.parse_config("16x4") == gdn_chunked.ChunkScanConfig(block_v=16, num_warps=4)
    for bad in ("32", "32x4:tf32x3"):
        with pytest.raises(ValueError, match="want BVxWARPS"):
            gdn_chunked.parse_config(bad)


# ------------------------------------------------------------------------------------------------
# on the GPU:  JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/test_kernel_gdn_chunked.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [512, 2048])
def test_gpu_kernel_matches_the_scan_at_27b_shapes(t):
    if jax.default_backend() != "gpu":
        pytest.fail(f"gpu test on backend {jax.default_backend()!r}: run with JAX_PLATFORMS=cuda")
    args = [jnp.asarray(a) for a in make_inputs(1, t, 16, 48, 128, 128, seed=t)]
    o, s = jax.jit(gdn_chunked.gdn_chunked)(*args)
    ref_o, ref_s = jax.jit(gdn.gdn_chunked_ref)(*args)
    tol = f32_recurrence_tol(t, 128 + gdn.WY_CHUNK, implementations=2)
    assert_close(o, ref_o, tol, "kernel o vs the scan")
    assert_close(s, ref_s, tol, "kernel state vs the scan")
    assert np.isfinite(np.asarray(o)).all()
