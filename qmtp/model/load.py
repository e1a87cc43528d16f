"""The parameter loading pipeline, `load_params`: read (strictly, sharded where a mesh says; or from
the converted cache) -> MTP draft head -> join the gate projections -> tile the FP8 weights. No
optional step changes the tokens (the draft head only changes which drafts are proposed).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from qmtp.model import checkpoint, fp8 as fp8_lib, target
from qmtp.runtime import tp as tp_lib
from qmtp.runtime.kernel_config import KernelConfig

DRAFT_HEADS = ("auto", "bf16", "fp8")


def check_draft_head(draft_head: str) -> None:
    if draft_head not in DRAFT_HEADS:
        raise ValueError(f"draft_head={draft_head!r}: supported {DRAFT_HEADS}")


def load_params(checkpoint_dir: str, dtype: str, kernels: KernelConfig, mesh=None, *, progress: bool = True,
                converted_cache: str | None = None, draft_head: str = "auto", draft_vocab=None):
    """(cfg, params) of a checkpoint as the model runs it (qmtp.load documents each argument): read,
    draft head (an FP8 copy of the lm_head and/or a draft vocabulary's rows, under params["mtp"]),
    in_proj_b and in_proj_a joined into in_proj_ba, each MoE block's router and shared-expert gate joined
    into router_gate, FP8 weights tiled under the Pallas kernels."""
    check_draft_head(draft_head)
    if converted_cache is None:
        cfg, params = checkpoint.load(checkpoint_dir, dtype=dtype, progress=progress, mesh=mesh)
    else:
        from qmtp.model import converted_cache as cache_lib
        cfg, params = cache_lib.load_or_convert(converted_cache, checkpoint_dir, dtype, progress, mesh,
                                                checkpoint.load)
    if draft_head == "auto":
        draft_head = "fp8" if cfg.quantization is not None else "bf16"
    if draft_vocab is not None and "mtp" in params:
        params = dict(params, mtp=dict(params["mtp"], **_vocab_head(params, cfg, draft_vocab, draft_head, mesh)))
    elif draft_head == "fp8" and "mtp" in params:
        params = dict(params, mtp=dict(params["mtp"], draft_head=_fp8_copy(target.lm_head(params), mesh)))
    params = fuse_gate_projections(params, mesh)
    params = fuse_router_gates(params, mesh)
    if kernels.pallas:
        from qmtp.model import weight_layout
        params = weight_layout.tile_fp8_weights(params, mesh)
    return cfg, params


def fuse_gate_projections(params: dict, mesh=None) -> dict:
    """The tree with each GDN layer's in_proj_b and in_proj_a [Hv, E] replaced by in_proj_ba [2 Hv, E]
    = [b | a]: one dot for both gate projections, each output the same dot product (on some CPUs the
    joined dot sums in another order: last-bit differences). Under TP shard s holds [b_s | a_s].
    Layers already joined, or with FP8 gate weights (the loader keeps them bf16), stay as they are."""
    layers = params.get("gdn", ())
    if not layers or not all("in_proj_b" in p and "in_proj_a" in p for p in layers):
        return params
    if any(isinstance(p[n], fp8_lib.Fp8Block) for p in layers for n in ("in_proj_b", "in_proj_a")):
        return params
    join = lambda b, a: jnp.concatenate([b, a], axis=0)  # noqa: E731
    join = jax.jit(join) if mesh is None else tp_lib.map_row_shards(join, mesh)
    fused = tuple({**{k: v for k, v in p.items() if k not in ("in_proj_b", "in_proj_a")},
                   "in_proj_ba": join(p["in_proj_b"], p["in_proj_a"])} for p in layers)
    return dict(params, gdn=fused if isinstance(layers, tuple) else list(fused))


def fuse_router_gates(tree, mesh=None):
    """The tree with each MoE block's router [X, E] and shared_gate [1, E] (both bf16, replicated under TP)
    replaced by router_gate [X + 1, E] = [router | shared_gate]: one projection for both, each output the
    same dot product (moe.router_logits)."""
    join = jax.jit(lambda r, g: jnp.concatenate([r, g], axis=0), out_shardings=tp_lib.replicated(mesh))

    def fuse(tree):
        if isinstance(tree, dict):
            if "router" in tree and "shared_gate" in tree:
                rest = {k: v for k, v in tree.items() if k not in ("router", "shared_gate")}
                return {**rest, "router_gate": join(tree["router"], tree["shared_gate"])}
            return {k: fuse(v) for k, v in tree.items()}
        if type(tree) in (tuple, list):
            return type(tree)(fuse(v) for v in tree)
        return tree

    return fuse(tree)


def _fp8_copy(w: jax.Array, mesh) -> fp8_lib.Fp8Block:
    """An FP8 block copy of a [V, E] head, made where it lives; under TP each device quantizes its own
    rows in their own 128-blocks (so the split need not fall on a 128-row boundary)."""
    return (jax.jit(fp8_lib.quantize) if mesh is None else tp_lib.map_row_shards(fp8_lib.quantize, mesh))(w)


def _vocab_head(params: dict, cfg, draft_vocab, draft_head: str, mesh) -> dict:
    """{"draft_head": lm_head's rows of the draft vocabulary [Vs', E] (FP8 when draft_head is "fp8"),
    "draft_vocab": their ids [Vs'] int32, replicated}; Vs' = Vs padded to a multiple of the TP size."""
    from qmtp.model import draft_vocab as vocab_lib
    ids = (vocab_lib.read(draft_vocab, cfg.vocab_size) if isinstance(draft_vocab, (str, os.PathLike))
           else vocab_lib.validate(draft_vocab, cfg.vocab_size))
    ids = vocab_lib.padded(ids, 1 if mesh is None else mesh.size)
    rows = tp_lib.vocab_rows(mesh)
    head = jax.jit(lambda w, i: jnp.take(w, i, axis=0), out_shardings=rows)(target.lm_head(params), jnp.asarray(ids))
    if draft_head == "fp8":
        head = _fp8_copy(head, mesh)
    return {"draft_head": head, "draft_vocab": jax.device_put(jnp.asarray(ids), tp_lib.replicated(mesh))}
