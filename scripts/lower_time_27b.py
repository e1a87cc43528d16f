"""Trace + lower time of the full 64-layer Qwen3.5-27B decode loops (abstract weights, no device).

    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/lower_time_27b.py

The layer loop is unrolled in Python; this measures what that costs before XLA compiles.
"""
import time, jax, jax.numpy as jnp
from qmtp import config as qc, params as P, decode, speculate
from qmtp.state import state_shapes
from qmtp.tools import make_checkpoint as mc
cfg = qc.from_dict(mc.build_config("qwen3_5_27b", "fp8", 0, None))
params = P.abstract_params(cfg, jnp.bfloat16, fp8_linear=True)
state = state_shapes(cfg, 1, 64, 16, 8, jnp.bfloat16)
i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
t0 = time.time()
lo = decode.greedy_loop.trace(cfg, decode.LoopSpec(64, ()), params, state, i32(1), i32(1)).lower(lowering_platforms=("cuda",))
t1 = time.time()
lo2 = speculate.spec_loop.trace(cfg, speculate.SpecConfig(3, 64, ()), params, state, i32(1), i32(1),
    jax.ShapeDtypeStruct((1, cfg.hidden_size), jnp.bfloat16), i32(1), i32(1, 1)).lower(lowering_platforms=("cuda",))
t2 = time.time()
print(f"64-layer trace+lower: plain loop {t1-t0:.1f} s, spec loop K=3 {t2-t1:.1f} s; HLO text {len(lo.as_text())/1e6:.1f} MB / {len(lo2.as_text())/1e6:.1f} MB")
