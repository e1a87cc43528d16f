"""Tensor parallelism: the mesh, its validation, and the cross-shard collectives the model needs.

Only this module knows meshes and axis names (ARCHITECTURE.md, house rule 5). This first step holds
the pieces that do not depend on how the parameters are laid out: a 1-D "tp" mesh over N devices,
the check that a model can be split N ways, and the vocabulary-parallel greedy argmax. Sharded
loading and the shard_map around prefill and the speculative loop come next (issue 5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from qmtp.config import FP8_BLOCK, ModelConfig

AXIS = "tp"


def make_mesh(n: int, devices=None) -> Mesh:
    """A 1-D mesh named "tp" over the first n devices (of `devices`, default jax.devices())."""
    devices = list(jax.devices() if devices is None else devices)
    if n < 1 or n > len(devices):
        raise ValueError(f"--tp={n}: {len(devices)} {devices[0].platform if devices else ''} device(s) "
                         f"visible; --tp must be between 1 and {len(devices)}")
    return Mesh(devices[:n], (AXIS,))


def check_tp(cfg: ModelConfig, n: int, fp8: bool = False) -> None:
    """Raises ValueError naming the first dimension that cannot be split n ways.

    Attention and GDN heads, the MLP width and the vocabulary are split; fewer KV heads than shards
    is allowed when n is a multiple of them (KV heads are then replicated). With FP8 block weights
    every split dimension's shard must be a whole number of 128-blocks."""
    if n == 1:
        return
    splits = {"num_attention_heads": cfg.num_attention_heads, "linear_num_key_heads": cfg.linear_num_key_heads,
              "linear_num_value_heads": cfg.linear_num_value_heads, "intermediate_size": cfg.intermediate_size,
              "vocab_size": cfg.vocab_size}
    for name, size in splits.items():
        if size % n:
            raise ValueError(f"--tp={n}: {name}={size} is not divisible by {n}")
    hkv = cfg.num_key_value_heads
    if hkv % n and n % hkv:
        raise ValueError(f"--tp={n}: num_key_value_heads={hkv} can be neither split nor replicated {n} ways")
    if fp8:
        shards = {"intermediate_size / tp": cfg.intermediate_size // n,
                  "attention q rows / tp": 2 * cfg.num_attention_heads * cfg.head_dim // n,
                  "GDN value_dim / tp": cfg.value_dim // n, "GDN key_dim / tp": cfg.key_dim // n}
        for name, size in shards.items():
            if size % FP8_BLOCK:
                raise ValueError(f"--tp={n}: FP8 weights need shard boundaries on {FP8_BLOCK}-multiples, but "
                                 f"{name} = {size}")


def vocab_parallel_argmax(logits: jax.Array, axis_name: str = AXIS) -> jax.Array:
    """Greedy argmax over a vocabulary split contiguously across `axis_name` (inside shard_map).

    logits [..., V/n] is this shard's slice (shard i holds ids [i V/n, (i+1) V/n)). Returns the global
    id [...] int32, ties broken to the lowest id exactly as jnp.argmax on the full vocabulary does."""
    width = logits.shape[-1]
    local_max = jnp.max(logits, axis=-1)
    local_id = jnp.argmax(logits, axis=-1).astype(jnp.int32) + jax.lax.axis_index(axis_name) * width
    best = jax.lax.pmax(local_max, axis_name)
    candidate = jnp.where(local_max == best, local_id, jnp.iinfo(jnp.int32).max)
    return jax.lax.pmin(candidate, axis_name)
