"""The decode state: an immutable pytree passed into every step function and returned by it.

    kv.k, kv.v     La x [P, S, Hkv, D]   paged KV of the target's full-attention layers (compute dtype)
    mtp_kv.k, .v   Lm x [P, S, Hkv, D]   paged KV of the MTP layers (same page table and positions)
    conv           Lg x [B, W-1, C]      last W-1 pre-conv inputs of each GDN layer (compute dtype)
    ssm            Lg x [B, Hv, Dk, Dv]  GDN recurrent state (float32)
    page_table     [B, Pmax] int32       page ids of each sequence; position p lives in page
                                         page_table[b, p // S], slot p % S
    lengths        [B] int32             committed tokens per sequence (KV beyond is stale)

Per-layer state is a tuple of arrays, not one stack: each layer updates its own donated buffer in
place, where slicing a stack would copy every layer's state each step. The conv state is time-major.
Everything is zero-initialised (MODEL_SPEC §7.8): stale memory never reaches live positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qmtp.model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    k: tuple[jax.Array, ...]  # L x [P, S, Hkv, D]
    v: tuple[jax.Array, ...]  # L x [P, S, Hkv, D]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    def replace_layer(self, j: int, k: jax.Array, v: jax.Array) -> "PagedKV":
        return PagedKV(self.k[:j] + (k,) + self.k[j + 1:], self.v[:j] + (v,) + self.v[j + 1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    kv: PagedKV
    mtp_kv: PagedKV
    conv: tuple[jax.Array, ...]  # Lg x [B, W-1, C]
    ssm: tuple[jax.Array, ...]  # Lg x [B, Hv, Dk, Dv]
    page_table: jax.Array  # [B, Pmax] int32
    lengths: jax.Array  # [B] int32

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def row(self, b: jax.Array) -> "DecodeState":
        """Sequence b alone (a batch of one; b may be traced): its GDN/conv rows (not in the slot ring),
        page-table row and length; the KV pages are shared by all rows."""
        one = lambda x: jax.lax.dynamic_slice_in_dim(x, b, 1, axis=0)  # noqa: E731
        return dataclasses.replace(self, conv=tuple(map(one, self.conv)), ssm=tuple(map(one, self.ssm)),
                                   page_table=one(self.page_table), lengths=one(self.lengths))

    def with_row(self, b: jax.Array, one: "DecodeState") -> "DecodeState":
        """This state with sequence b (and the KV pages) taken from `one`, a row(b) that has run."""
        put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, b, axis=0)  # noqa: E731
        return dataclasses.replace(self, kv=one.kv, mtp_kv=one.mtp_kv, conv=tuple(map(put, self.conv, one.conv)),
                                   ssm=tuple(map(put, self.ssm, one.ssm)), lengths=put(self.lengths, one.lengths))


def state_shapes(cfg: ModelConfig, batch: int, num_pages: int, page_size: int, pages_per_seq: int,
                 dtype, kv_heads: int | None = None, gdn_slots: int = 0) -> DecodeState:
    """Abstract (ShapeDtypeStruct) state; the one place that states every shape and dtype.
    kv_heads: KV heads of the cache (default the config's; tensor parallelism with fewer KV heads
    than devices stores each replica). gdn_slots = Ns > 0: the conv and ssm states in the slot ring,
    [Ns, B, ...] (qmtp/runtime/loop.py)."""
    s = jax.ShapeDtypeStruct
    hkv, d = kv_heads or cfg.num_key_value_heads, cfg.head_dim
    pages = lambda layers: tuple(s((num_pages, page_size, hkv, d), dtype) for _ in range(layers))
    lg = cfg.num_linear_layers
    lead = (gdn_slots,) if gdn_slots else ()
    return DecodeState(
        kv=PagedKV(pages(cfg.num_full_layers), pages(cfg.num_full_layers)),
        mtp_kv=PagedKV(pages(cfg.mtp_layers), pages(cfg.mtp_layers)),
        conv=tuple(s(lead + (batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype) for _ in range(lg)),
        ssm=tuple(s(lead + (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                    jnp.float32) for _ in range(lg)),
        page_table=s((batch, pages_per_seq), jnp.int32),
        lengths=s((batch,), jnp.int32),
    )


def init_state(cfg: ModelConfig, page_table: np.ndarray, num_pages: int, page_size: int, dtype,
               gdn_slots: int = 0) -> DecodeState:
    """Zero state for len(page_table) sequences with the given page table [B, Pmax] (gdn_slots: see
    state_shapes)."""
    page_table = np.asarray(page_table, np.int32)
    batch, pages_per_seq = page_table.shape
    shapes = state_shapes(cfg, batch, num_pages, page_size, pages_per_seq, dtype, gdn_slots=gdn_slots)
    state = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return dataclasses.replace(state, page_table=jnp.asarray(page_table))


def gdn_slot_count(state: DecodeState) -> int:
    """Ns when the GDN/conv state is in the slot ring (conv Lg x [Ns, B, W-1, C], ssm Lg x
    [Ns, B, Hv, Dk, Dv]: qmtp/runtime/loop.py), else 0."""
    return state.ssm[0].shape[0] if state.ssm and state.ssm[0].ndim == 5 else 0
