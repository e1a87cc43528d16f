"""The Pallas launches of a pass are lowered once per distinct (shapes, config), not once per layer:
fp8_matmul's decode / prefill launches and gdn_conv's kernel are nested jits, whose lowered functions
JAX reuses (64 layers traced and lowered in 3.1 s instead of 25.7 s, session 14). Checked on the H200 lowering
from the CPU: the Triton kernels in the module do not grow with the layer count."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from h200_lowering import H200, triton_calls
from qmtp import api, config as qc, decode, ops
from qmtp.state import init_state
from qmtp.tools import make_checkpoint
from pallas_kernels.bench.step import random_params


def _triton_kernels_of_plain_loop(layers: int) -> int:
    cfg = qc.from_dict(make_checkpoint.build_config("qwen3_5_27b", "fp8", 0, layers))
    params = jax.eval_shape(api.fuse_gate_projections, jax.eval_shape(lambda: random_params(cfg, jnp.bfloat16)))
    state = jax.eval_shape(lambda: init_state(cfg, np.arange(8, dtype=np.int32)[None], 8, 16, jnp.bfloat16))
    first = jax.ShapeDtypeStruct((1,), jnp.int32)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = decode.greedy_loop.trace(cfg, decode.LoopSpec(4, ()), params, state, first, first,
                                           impl="pallas").lower(lowering_platforms=("cuda",))
    return len(triton_calls(lowered))


def test_kernels_lowered_once_per_distinct_launch(monkeypatch):
    monkeypatch.setattr(ops, "_interpret", lambda: False)  # the Triton lowering, as on the GPU
    four, eight = _triton_kernels_of_plain_loop(4), _triton_kernels_of_plain_loop(8)
    # 4 layers (3 GDN + 1 attention): in_proj_qkv+z, out_proj, gate+up, down, the conv kernel, q+k+v,
    # o_proj (out_proj's shape and config: shared), paged attention, the bf16 lm_head; 8 layers add none
    assert four == eight, (four, eight)
    assert four <= 10, four
