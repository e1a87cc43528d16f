"""The sequential half of the chunked (WY) gated delta rule in one kernel: the prefill's state chain.

`gdn.wy_chunk_inputs` computes, for every chunk of C tokens at once, qg, qk, u, w, kd [B, H, N, C, .] and
decay [B, H, N] (f32); what is left runs chunk after chunk from the state S [B, H, Dk, Dv] f32:

    Vn = u_n - w_n S_n,    S_{n+1} = decay_n S_n + kd_n^T Vn

One launch runs that chain over every chunk and stores each chunk's Vn and entering state S_n: grid
(B, H, Dv / BV), program (b, h, j) keeps the f32 tile S[:, j BV:(j+1) BV] in registers (S's Dv columns
evolve independently) and loops over the N chunks. The outputs O_n = qg_n S_n + qk_n Vn depend on no
later chunk, so they are one XLA product over all chunks afterwards (`gdn.wy_chunk_outputs`), off the
chain: H100, a layer at 4,096 tokens, 2.67 ms with O inside the loop -> 2.45 ms (the outputs in a Pallas
kernel of their own: 2.50).

Each dot is three TF32 tensor-core products (hi*hi + hi*lo + lo*hi, DotAlgorithmPreset.TF32_TF32_F32_X3):
about f32's accuracy (o and the state within 2e-7 of the f32 scan at 4,096 tokens, against TF32's ~6e-4
alone). f32 dots on the CUDA cores (Precision.HIGHEST) were slower (H100, T 4096, one layer: chunk 64 the
best tile 4.7 ms against 2.67 for the chain with O inside, 32x4 spilling at 40.3 ms). Interpret mode
computes in f32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gdn
from pallas_kernels._vma import align
from pallas_kernels.fp8_config import is_pow2

F32 = jnp.float32
TF32_X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


@dataclasses.dataclass(frozen=True)
class ChunkScanConfig:
    """block_v Dv columns of the state per program (a power of two dividing Dv), warps and pipeline stages.
    The default by measurement (H100, T 4096, chunk 64, a whole layer, one run): 64x8 2.34 ms, 32x4 2.45.
    With O inside the loop it was the other way: 32x4 2.67, 64x8 2.92 (3.02 in that run), 16x4 3.28, 32x8 3.72."""

    block_v: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        if not is_pow2(self.block_v) or self.block_v < 16:
            raise ValueError(f"ChunkScanConfig: block_v={self.block_v} must be a power of two >= 16")


CHUNK_SCAN_CONFIG = ChunkScanConfig()


def parse_config(text: str) -> ChunkScanConfig:
    """'32x4' -> ChunkScanConfig(block_v=32, num_warps=4) (BVxWARPS)."""
    try:
        bv, warps = (int(x) for x in text.split("x"))
    except ValueError:
        raise ValueError(f"chunk scan config {text!r}: want BVxWARPS, e.g. 32x4") from None
    return ChunkScanConfig(block_v=bv, num_warps=warps)


def _check(u, w, kd, decay, state) -> None:
    b, h, n, c, dk = w.shape
    dv = u.shape[-1]
    want = {"w": w.shape, "u": (b, h, n, c, dv), "kd": (b, h, n, c, dk), "decay": (b, h, n), "state": (b, h, dk, dv)}
    for name, a in (("w", w), ("u", u), ("kd", kd), ("decay", decay), ("state", state)):
        if a.shape != want[name]:
            raise ValueError(f"wy_chunk_states: {name} has shape {a.shape}, expected {want[name]} from w {w.shape} "
                             f"and u {u.shape}")
        if a.dtype != F32:
            raise ValueError(f"wy_chunk_states: {name} must be float32, got {a.dtype}")
    for name, d in (("C", c), ("Dk", dk), ("Dv", dv)):
        if not is_pow2(d) or d < 16:
            raise ValueError(f"wy_chunk_states: {name}={d} must be a power of two >= 16 (Triton tiles)")


def _kernel(u_ref, w_ref, kd_ref, decay_ref, s_ref, vn_ref, entering_ref, s_out_ref, *, n_chunks: int, precision):
    def body(n, s):  # s: [Dk, BV]
        entering_ref[n] = s
        vn = u_ref[n] - plgpu.dot(w_ref[n], s, precision=precision)  # [C, BV]
        vn_ref[n] = vn
        return decay_ref[n] * s + plgpu.dot(kd_ref[n], vn, trans_a=True, precision=precision)

    s_out_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s_ref[...])


def wy_chunk_states(u, w, kd, decay, state, *, interpret: bool = False, config: ChunkScanConfig | None = None):
    """The chain alone (`gdn.wy_chunk_states_ref`): (Vn [B, H, N, C, Dv], the state entering each chunk
    [B, H, N, Dk, Dv], the final state), all f32."""
    config = CHUNK_SCAN_CONFIG if config is None else config
    _check(u, w, kd, decay, state)
    return _wy_chunk_states(u, w, kd, decay, state, interpret=bool(interpret), config=config)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def _wy_chunk_states(u, w, kd, decay, state, *, interpret, config):
    b, h, n, c, dk = w.shape
    dv = u.shape[-1]
    bv = min(config.block_v, dv)
    per_head = lambda a: pl.BlockSpec((None, None) + a.shape[2:], lambda i, j, l: (i, j) + (0,) * (a.ndim - 2))
    v_tile = pl.BlockSpec((None, None, n, c, bv), lambda i, j, l: (i, j, 0, 0, l))
    state_tiles = pl.BlockSpec((None, None, n, dk, bv), lambda i, j, l: (i, j, 0, 0, l))
    s_tile = pl.BlockSpec((None, None, dk, bv), lambda i, j, l: (i, j, 0, l))
    (u, w, kd, decay, state), out = align(u, w, kd, decay, state)
    return pl.pallas_call(
        functools.partial(_kernel, n_chunks=n, precision=gdn.HIGHEST if interpret else TF32_X3),
        out_shape=(out((b, h, n, c, dv), F32), out((b, h, n, dk, dv), F32), out((b, h, dk, dv), F32)),
        grid=(b, h, dv // bv),
        in_specs=[v_tile, per_head(w), per_head(kd), per_head(decay), s_tile],
        out_specs=[v_tile, state_tiles, s_tile],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_wy_chunk_states",
    )(u, w, kd, decay, state)


def gdn_chunked(q, k, v, g, beta, state, chunk: int = gdn.WY_CHUNK, *, interpret: bool = False,
                config: ChunkScanConfig | None = None):
    """`gdn.gdn_chunked_ref` with its chain over chunks in this kernel: (o [B, T, Hv, Dv] f32, final state)."""
    qg, qk, u, w, kd, decay = gdn.wy_chunk_inputs(q, k, v, g, beta, state, chunk)
    vn, entering, final = wy_chunk_states(u, w, kd, decay, state.astype(F32), interpret=interpret, config=config)
    return gdn.wy_chunk_output(gdn.wy_chunk_outputs(qg, qk, vn, entering), q.shape[1]), final
