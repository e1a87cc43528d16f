"""Tensor parallelism: the mesh, the collectives the model calls, and the shard_map around the
outermost jitted functions.

Only this module knows meshes and axis names (ARCHITECTURE.md, house rule 5). Model code calls the
collectives below unconditionally; each is the identity when no "tp" axis is bound (TP1, or any
code outside shard_map), so one model implementation serves every N:

    all_reduce(x)        psum of row-parallel partial sums (after o_proj, out_proj, mlp_down)
    embed_lookup(E, ids) vocabulary-parallel embedding: each shard looks up its id range, psum
    greedy_argmax(l)     vocabulary-parallel argmax over logits [..., V/n] (ties: lowest id)
    gather_vocab(l)      the full logits [..., V] (API calls that return logits)

`sharded(fn, ...)` runs a jitted entry point (prefill, the decode loop) as one shard_map over the mesh, with PartitionSpecs derived from the parameter keys
(`qmtp.model.shard_layout`) and the decode state's layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qmtp.model import shard_layout
from qmtp.model.config import FP8_BLOCK, ModelConfig
from qmtp.runtime.state import DecodeState, PagedKV, gdn_slot_count, state_shapes

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

    Attention and GDN heads, the MLP width (dense layers), each expert's and the shared expert's width
    (MoE layers) and the vocabulary are split; fewer KV heads than shards is allowed when n is a
    multiple of them (KV heads are then replicated). With FP8 block weights every split dimension's
    shard must be a whole number of 128-blocks."""
    if n == 1:
        return
    widths = {}  # the MLP widths the model's layers use
    layers = range(max(cfg.num_hidden_layers, cfg.mtp_layers))
    if cfg.moe is None or not all(cfg.layer_is_moe(i) for i in layers):
        widths["intermediate_size"] = cfg.intermediate_size
    if cfg.moe is not None:
        widths.update(moe_intermediate_size=cfg.moe.expert_size,
                      shared_expert_intermediate_size=cfg.moe.shared_size)
    splits = {"num_attention_heads": cfg.num_attention_heads, "linear_num_key_heads": cfg.linear_num_key_heads,
              "linear_num_value_heads": cfg.linear_num_value_heads, **widths, "vocab_size": cfg.vocab_size}
    for name, size in splits.items():
        if size % n:
            raise ValueError(f"--tp={n}: {name}={size} is not divisible by {n}")
    hkv = cfg.num_key_value_heads
    if hkv % n and n % hkv:
        raise ValueError(f"--tp={n}: num_key_value_heads={hkv} can be neither split nor replicated {n} ways")
    if fp8:
        shards = {**{f"{name} / tp": size // n for name, size in widths.items()},
                  "attention q rows / tp": 2 * cfg.num_attention_heads * cfg.head_dim // n,
                  "attention o_proj columns / tp": cfg.num_attention_heads * cfg.head_dim // n,
                  "attention k/v rows / tp": shard_layout.kv_heads_per_shard(cfg, n) * cfg.head_dim,
                  "GDN value_dim / tp": cfg.value_dim // n, "GDN key_dim / tp": cfg.key_dim // n}
        for name, size in shards.items():
            if size % FP8_BLOCK:
                raise ValueError(f"--tp={n}: FP8 weights need shard boundaries on {FP8_BLOCK}-multiples, but "
                                 f"{name} = {size}")


def vocab_parallel_argmax(logits: jax.Array, axis_name: str = AXIS) -> jax.Array:
    """Greedy argmax over a vocabulary split contiguously across `axis_name` (inside shard_map).

    logits [..., V/n] is this shard's slice (shard i holds ids [i V/n, (i+1) V/n)). Returns the global
    id [...] int32, ties broken to the lowest id exactly as jnp.argmax on the full vocabulary does.

    One collective: each shard's (max, id) pair travels in one all-gather (the id's int32 bits
    carried in an f32 lane, so any vocabulary size is exact), and every shard picks the winner
    itself; a decode step is latency-bound on its ~130 small collectives at TP2, so the pmax + pmin
    pair this replaces cost one extra."""
    width = logits.shape[-1]
    local_max = jnp.max(logits, axis=-1).astype(jnp.float32)  # exact: bf16 / f32 logits
    local_id = jnp.argmax(logits, axis=-1).astype(jnp.int32) + jax.lax.axis_index(axis_name) * width
    pair = jnp.stack([local_max, jax.lax.bitcast_convert_type(local_id, jnp.float32)], axis=-1)  # [..., 2]
    pairs = jax.lax.all_gather(pair, axis_name, axis=0, to="invarying")  # [n, ..., 2]
    best = jnp.max(pairs[..., 0], axis=0)
    ids = jax.lax.bitcast_convert_type(pairs[..., 1], jnp.int32)
    return jnp.min(jnp.where(pairs[..., 0] == best, ids, jnp.iinfo(jnp.int32).max), axis=0)


# ---- collectives the model calls (identity when no "tp" axis is bound) ---------------------------
def _bound() -> bool:
    try:
        jax.lax.axis_size(AXIS)
    except NameError:
        return False
    return True


def all_reduce(x: jax.Array) -> jax.Array:
    """Sum of the shards' partial results (row-parallel projections). Callers pass f32 partials so
    the sum is rounded once, as the single-device matmul rounds its f32 accumulator once."""
    return jax.lax.psum(x, AXIS) if _bound() else x


def check_replicated(x: jax.Array, what: str) -> jax.Array:
    """x, refused at trace time when shard_map's replication check (check_vma) sees it vary across the
    TP shards where every shard must hold the same value: a row-parallel partial sum left unreduced
    would otherwise reach the vocabulary-parallel argmax, whose all-gather makes any input invariant,
    and give wrong tokens silently."""
    aval = jax.typeof(x)
    varying = aval.mat.varying if hasattr(aval, "mat") else getattr(aval, "vma", ())  # jax 0.11: .mat
    if _bound() and AXIS in varying:
        raise ValueError(f"{what} varies across the tp shards: a row-parallel partial sum was not reduced "
                         "(tp.all_reduce)")
    return x


def embed_lookup(embed: jax.Array, ids: jax.Array) -> jax.Array:
    """embed[ids] for a table split by vocabulary rows: [V/n, E] here, ids global -> [..., E]."""
    if not _bound():
        return embed[ids]
    rows = embed.shape[0]
    local = ids - jax.lax.axis_index(AXIS) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[..., None], embed[jnp.clip(local, 0, rows - 1)], 0)
    return jax.lax.psum(x, AXIS)  # exactly one shard contributes a non-zero row: the sum is exact


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """Greedy token id [...] int32 from logits [..., V] (TP1) or this shard's [..., V/n] slice."""
    if _bound():
        return vocab_parallel_argmax(logits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def gather_vocab(logits: jax.Array) -> jax.Array:
    """Full logits [..., V] from the shards' [..., V/n] slices (identity in TP1)."""
    if not _bound():
        return logits
    # the invariant form: every shard holds the same full result (shard_map's check_vma knows it)
    return jax.lax.all_gather(logits, AXIS, axis=logits.ndim - 1, tiled=True, to="invarying")


# ---- layouts ---------------------------------------------------------------------------------------
def leaf_key(path) -> str:
    """The parameter key of a leaf: the last dict key on its path (Fp8Block fields share it)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return keys[-1]


def dim_spec(ndim: int, dim: int | None) -> P:
    """The PartitionSpec of an ndim array split along dim (None: replicated)."""
    if dim is None:
        return P()
    return P(*[AXIS if d == dim else None for d in range(ndim)])


def param_specs(params: dict) -> dict:
    """PartitionSpecs of a parameter tree (same structure; Fp8Block weight and scale split alike)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: dim_spec(leaf.ndim, shard_layout.split_dim(leaf_key(path))), params)


def state_specs(state: DecodeState) -> DecodeState:
    """KV pages split by head, conv state by channel, GDN state by value head; tables replicated. A
    slotted GDN/conv state ([Ns, B, ...], state.gdn_slot_count) has the slot axis in front."""
    kv = lambda pk: PagedKV(tuple(P(None, None, AXIS, None) for _ in pk.k), tuple(P(None, None, AXIS, None) for _ in pk.v))
    slot = (None,) if gdn_slot_count(state) else ()
    return DecodeState(kv=kv(state.kv), mtp_kv=kv(state.mtp_kv),
                       conv=tuple(P(*slot, None, None, AXIS) for _ in state.conv),
                       ssm=tuple(P(*slot, None, AXIS) for _ in state.ssm), page_table=P(), lengths=P())


def gdn_row_specs(rows: tuple) -> tuple:
    """Specs of GDN rows (conv rows, ssm rows) taken out of a state, shaped as `rows` (or a state): conv
    split by channel, ssm by value head, as in the state."""
    conv, ssm = (rows.conv, rows.ssm) if isinstance(rows, DecodeState) else rows
    return tuple(P(None, None, AXIS) for _ in conv), tuple(P(None, AXIS) for _ in ssm)


def global_state_shapes(cfg: ModelConfig, n: int, batch: int, num_pages: int, page_size: int, pages_per_seq: int,
                        dtype, gdn_slots: int = 0) -> DecodeState:
    """The TP-global state shapes: as `state_shapes`, with n * (KV heads per shard) KV heads."""
    return state_shapes(cfg, batch, num_pages, page_size, pages_per_seq, dtype,
                        kv_heads=n * shard_layout.kv_heads_per_shard(cfg, n), gdn_slots=gdn_slots)


def init_state(cfg: ModelConfig, mesh: Mesh, page_table: np.ndarray, num_pages: int, page_size: int,
               dtype, gdn_slots: int = 0) -> DecodeState:
    """A zero decode state created directly in its shards (nothing is built on one device first);
    gdn_slots: see state.state_shapes."""
    page_table = np.asarray(page_table, np.int32)
    shapes = global_state_shapes(cfg, mesh.size, page_table.shape[0], num_pages, page_size, page_table.shape[1],
                                 dtype, gdn_slots=gdn_slots)
    shardings = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), state_specs(shapes))
    zeros = jax.jit(lambda: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                    out_shardings=shardings)()
    table = jax.device_put(page_table, NamedSharding(mesh, P()))
    return dataclasses.replace(zeros, page_table=table)


def assemble(pieces: list, dim: int, mesh: Mesh) -> jax.Array:
    """One TP-global array from per-device pieces (piece s on device s), split along `dim`."""
    devices = list(mesh.devices.flat)
    shape = list(pieces[0].shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    sharding = NamedSharding(mesh, dim_spec(len(shape), dim))
    arrays = [jax.device_put(p, d) for p, d in zip(pieces, devices)]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def vocab_rows(mesh: Mesh | None):
    """The sharding of a [V, ...] array split by vocabulary rows (None on one device)."""
    return None if mesh is None else NamedSharding(mesh, P(AXIS, None))


def replicated(mesh: Mesh | None):
    """The sharding of an array every device holds whole (None on one device)."""
    return None if mesh is None else NamedSharding(mesh, P())


def committed_shapes(tree, device: jax.Device):
    """ShapeDtypeStructs of tree's arrays (or shapes) committed to one device: what jax.device_put(tree,
    device) gives a program to compile for, without the memory."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def map_row_shards(fn, mesh: Mesh):
    """jit(fn) applied to each device's rows of [R, ...] arrays split along dim 0 ([R/n, ...] pieces in,
    pieces out): e.g. quantizing each vocabulary shard of the lm_head in its own 128-blocks, or joining
    each device's rows of two weights (load.fuse_gate_projections)."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS, None), out_specs=P(AXIS, None)))


def map_split_shards(fn, mesh: Mesh, dim: int | None, in_ndim: int, out_ndim: int, donate: bool = False):
    """jit(fn) applied to each device's shard of an array split along `dim` (None: replicated) that
    keeps its split on the same dim of fn's output (e.g. tiling each shard of an FP8 weight in place)."""
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=dim_spec(in_ndim, dim), out_specs=dim_spec(out_ndim, dim))
    return jax.jit(mapped, donate_argnums=(0,) if donate else ())


def param_shardings(abstract: dict, mesh: Mesh | None) -> dict:
    """The sharding of every leaf of a parameter tree: NamedSharding(mesh, param_specs) on a mesh, else
    the default device (where checkpoint.load's jnp.asarray puts the tree)."""
    if mesh is None:
        (device,) = jnp.asarray(0).devices()
        device = jax.sharding.SingleDeviceSharding(device)
        return jax.tree_util.tree_map(lambda _: device, abstract)
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), param_specs(abstract),
                                  is_leaf=lambda x: isinstance(x, P))


# ---- the shard_map around an entry point -----------------------------------------------------------
_SHARDED: dict = {}


def _specs(kind: str, value):
    if kind == "params":
        return param_specs(value)
    if kind == "state":
        return state_specs(value)
    if kind == "gdn_rows":
        return gdn_row_specs(value)
    return P()  # replicated: a prefix spec for the whole argument


def sharded(fn, mesh: Mesh, lead: tuple, args: tuple, kinds: tuple, out_kinds: tuple, check_vma: bool = True,
            statics: dict | None = None):
    """fn(*lead, *args, **statics) as one jitted shard_map over `mesh`: fn is a jitted entry point (its
    Python body is taken from __wrapped__), lead its leading static arguments (cfg, kernels, ...), statics
    its static keyword arguments (hashable values); kinds name each arg ("params", "state", "gdn_rows" or
    "rep") and each output ("state", "gdn_rows" or "rep"); "gdn_rows" are (conv rows, ssm rows) taken
    out of a state (a prefix cache checkpoint's). The state arguments are donated, as the
    single-device entry points do."""
    state_arg = args[kinds.index("state")] if "state" in kinds else None
    statics = statics or {}
    key = (fn, mesh, lead, tuple(sorted(statics.items())), kinds, out_kinds, check_vma,
           jax.tree_util.tree_structure(args),
           gdn_slot_count(state_arg) if state_arg is not None else 0)
    if key not in _SHARDED:
        in_specs = tuple(_specs(k, a) for k, a in zip(kinds, args))
        # output "state" j is shaped as input "state" j (the first when there are fewer)
        state_args = [a for k, a in zip(kinds, args) if k == "state"]
        out_state = iter(state_args + [state_arg] * len(out_kinds))
        out_specs = tuple(state_specs(next(out_state)) if k == "state" else
                          gdn_row_specs(state_arg) if k == "gdn_rows" else P() for k in out_kinds)
        body = functools.partial(_call_wrapped, fn.__wrapped__, lead, statics)
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
        donate = tuple(i for i, k in enumerate(kinds) if k == "state")
        _SHARDED[key] = jax.jit(mapped, donate_argnums=donate)
    return _SHARDED[key](*args)


def _call_wrapped(raw_fn, lead, statics, *args):
    return tuple(raw_fn(*lead, *args, **statics))
