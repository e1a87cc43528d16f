"""One-shot all-reduce of a small f32 array over the devices of a mesh axis (Mosaic GPU), for the
row-parallel sums of tensor-parallel decoding:

    y = x_0 + x_1 + ... + x_{n-1}        (x_d: device d's array; every device gets y)

Each device stores its x into slot d of every peer's receive buffer (peer stores over NVLink, no
multicast), signals each peer's semaphore, waits for the n - 1 signals it is owed, and adds the n
slots in device order 0, 1, .., n-1 in f32: the same order on every device, so every device holds the
same bits (and for n = 2 the bits of psum's one f32 addition, which is commutative).

One CTA (one warpgroup) moves and adds the whole array, CHUNK elements at a time (what its registers
hold): the rows TP decode reduces are one [B, 5120] f32 row per sequence (20 KB at batch 1), where a
launch costs its latency, not its bandwidth: one round of peer stores and one semaphore handshake,
against the ~16 us of NCCL's all-reduce measured in the 27B TP2 step. `fits` says where it applies
(MAX_BYTES, whole 512-element pieces of the warpgroup's layout); `all_reduce_ref` (psum) is its twin
and serves everything else.

The receive buffer is a second output of the kernel, so XLA allocates it with the collective
metadata that makes a peer's buffer addressable (`plgpu.remote_ref`); the caller drops it. Like JAX's
own Mosaic GPU collectives (ops/gpu/all_gather_mgpu.py stores into its peers' outputs as it starts),
it counts on that launch making every peer's buffer and semaphore ready before any device stores:
the `gpu` test and scripts/bench_all_reduce.py check its sum against psum's bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LANES = 128  # threads of a warpgroup: the layout's unit
VEC = 4  # f32 elements per thread access (16-byte stores)
CHUNK = 16384  # f32 elements in registers at a time: 128 per thread
MAX_BYTES = 4 * CHUNK * 4  # 256 KB: 12 rows of 5120; larger arrays go to psum (NCCL spreads them over many SMs)


def fits(x: jax.Array) -> bool:
    """Whether the kernel takes x: f32, at most MAX_BYTES, a whole number of LANES x VEC elements."""
    return x.dtype == jnp.float32 and 0 < x.size * 4 <= MAX_BYTES and x.size % (LANES * VEC) == 0


def all_reduce_ref(x: jax.Array, axis_name: str) -> jax.Array:
    """The twin: psum over axis_name."""
    return lax.psum(x, axis_name)


def one_shot_all_reduce(x: jax.Array, axis_name: str) -> jax.Array:
    """psum(x, axis_name) by peer stores and semaphores (module doc), inside shard_map on GPUs.
    x: f32 with fits(x) true, the same shape on every device; returns the sum, invariant across the
    axis (the type psum gives)."""
    if not fits(x):
        raise ValueError(f"one_shot_all_reduce: x {x.dtype}{list(x.shape)} needs f32, at most {MAX_BYTES} bytes "
                         f"and a multiple of {LANES * VEC} elements; use all_reduce_ref (psum)")
    n = lax.axis_size(axis_name)
    flat = x.reshape(-1)  # [N]
    if n == 1:
        return x
    # Mosaic GPU types its outputs alike on every device (no varying axes): right for the sum
    y, _ = plgpu.kernel(
        functools.partial(_kernel, n=n, axis_name=axis_name),
        out_type=[jax.ShapeDtypeStruct(flat.shape, jnp.float32),  # the sum
                  jax.ShapeDtypeStruct((n,) + flat.shape, jnp.float32)],  # receive buffer: slot d from device d
        grid=(1,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SemaphoreType.REGULAR],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(flat)
    return y.reshape(x.shape)


def _kernel(x_ref, y_ref, recv_ref, sem_ref, *, n, axis_name):
    # x_ref [N]; y_ref [N]; recv_ref [n, N] (peers store into it); sem_ref: signals received
    dev = lax.axis_index(axis_name)
    size = x_ref.shape[0]
    pieces = [pl.ds(start, min(CHUNK, size - start)) for start in range(0, size, CHUNK)]
    peers = [plgpu.remote_ref(recv_ref, lax.rem(dev + offset, n)) for offset in range(1, n)]
    for piece in pieces:
        x = plgpu.layout_cast(x_ref[piece], plgpu.Layout.WG_STRIDED((piece.size,), vec_size=VEC))
        recv_ref[dev, piece] = x  # my own slot, so the sum below reads n slots alike
        for remote in peers:
            remote[dev, piece] = x
    # each signal waits for the warpgroup's stores (a barrier) and releases them at system scope
    for offset in range(1, n):
        pl.semaphore_signal(sem_ref, device_id=lax.rem(dev + offset, n))
    pl.semaphore_wait(sem_ref, n - 1)
    for piece in pieces:
        layout = plgpu.Layout.WG_STRIDED((piece.size,), vec_size=VEC)
        acc = plgpu.layout_cast(recv_ref[0, piece], layout)
        for d in range(1, n):  # device order: the same sum on every device
            acc = acc + plgpu.layout_cast(recv_ref[d, piece], layout)
        y_ref[piece] = acc
