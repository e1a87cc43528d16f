"""The parameter tree and the one key table that maps it to checkpoint tensors.

Parameter tree (dicts of arrays; one dict per layer, in per-kind tuples):

    embed        [V, E]                    compute dtype
    lm_head      [V, E]                    absent when tie_word_embeddings (embed is used)
    final_norm   [E]                       f32, zero-centred (applied as 1 + w)
    gdn[j]/...   the j-th linear-attention layer (tuple over Lg)
    attn[j]/...  the j-th full-attention layer (tuple over La)
    mtp/fc, mtp/pre_fc_norm_embedding, mtp/pre_fc_norm_hidden, mtp/norm
    mtp/layers[j]/...  the MTP decoder layers (full attention)

Layers are separate arrays, not [L, ...] stacks: on the GPU, XLA copies a layer sliced out of a
stack before each matmul (scripts/gpu_layout_probe.py measured 0.80 TB/s for stacked slices vs
3.42 TB/s for per-layer arrays at 27B MLP shapes).

Linear weights keep the checkpoint's [out, in] layout (y = x @ W.T); a linear weight is either an
array in the compute dtype or an `Fp8Block` (E4M3 weight + f32 scale grid). Norm weights, A_log and
dt_bias are f32; the depthwise conv weight [C, 1, W] is stored as [C, W].

`tensor_table(cfg)` lists every checkpoint tensor (target and `mtp.*`) with its HF name, its place in
the tree, its HF shape and its role. The loader and the synthetic checkpoint writer both use it.
"""

from __future__ import annotations

import dataclasses
from qmtp.model.config import ModelConfig

# Roles of checkpoint tensors.
LINEAR = "linear"  # [out, in] projection; may be FP8 block-quantized
EMBED = "embed"  # [V, E] embedding / lm_head, never quantized
NORM = "norm"  # 1-D norm weight, f32
CONV = "conv"  # depthwise conv [C, 1, W] -> [C, W]
FP32 = "fp32"  # A_log, dt_bias: upcast to f32
FUSED_QKVZ = "fused_qkvz"  # Qwen3-Next in_proj_qkvz -> in_proj_qkv + in_proj_z (row permute)
FUSED_BA = "fused_ba"  # Qwen3-Next in_proj_ba -> in_proj_b + in_proj_a (row permute)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor. `group` is None (top level), 'gdn', 'attn' or 'mtp_layers'; `index`
    is the position in that group's layer stack; `key` the param name (fused entries fill two)."""

    name: str
    group: str | None
    index: int | None
    key: str
    shape: tuple[int, ...]
    role: str


def _mlp(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], str]]:
    e, f = cfg.hidden_size, cfg.intermediate_size
    return {
        "input_layernorm.weight": ("input_norm", (e,), NORM),
        "post_attention_layernorm.weight": ("post_norm", (e,), NORM),
        "mlp.gate_proj.weight": ("mlp_gate", (f, e), LINEAR),
        "mlp.up_proj.weight": ("mlp_up", (f, e), LINEAR),
        "mlp.down_proj.weight": ("mlp_down", (e, f), LINEAR),
    }


def attention_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """HF suffix -> (param key, HF shape, role) for a full-attention decoder layer (also MTP)."""
    e, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {
        "self_attn.q_proj.weight": ("q_proj", (2 * hq * d, e), LINEAR),  # per head: [query | gate]
        "self_attn.k_proj.weight": ("k_proj", (hkv * d, e), LINEAR),
        "self_attn.v_proj.weight": ("v_proj", (hkv * d, e), LINEAR),
        "self_attn.o_proj.weight": ("o_proj", (e, hq * d), LINEAR),
        "self_attn.q_norm.weight": ("q_norm", (d,), NORM),
        "self_attn.k_norm.weight": ("k_norm", (d,), NORM),
        **_mlp(cfg),
    }


def gdn_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """HF suffix -> (param key, HF shape, role) for a Gated DeltaNet decoder layer."""
    e, hv = cfg.hidden_size, cfg.linear_num_value_heads
    table = {
        "linear_attn.conv1d.weight": ("conv", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), CONV),
        "linear_attn.dt_bias": ("dt_bias", (hv,), FP32),
        "linear_attn.A_log": ("A_log", (hv,), FP32),
        "linear_attn.norm.weight": ("gdn_norm", (cfg.linear_value_head_dim,), NORM),  # plain w, not 1 + w
        "linear_attn.out_proj.weight": ("out_proj", (e, cfg.value_dim), LINEAR),
        **_mlp(cfg),
    }
    if cfg.gdn_fused_projections:
        table["linear_attn.in_proj_qkvz.weight"] = ("in_proj_qkv+in_proj_z",
                                                    (cfg.conv_dim + cfg.value_dim, e), FUSED_QKVZ)
        table["linear_attn.in_proj_ba.weight"] = ("in_proj_b+in_proj_a", (2 * hv, e), FUSED_BA)
    else:
        table["linear_attn.in_proj_qkv.weight"] = ("in_proj_qkv", (cfg.conv_dim, e), LINEAR)
        table["linear_attn.in_proj_z.weight"] = ("in_proj_z", (cfg.value_dim, e), LINEAR)
        table["linear_attn.in_proj_b.weight"] = ("in_proj_b", (hv, e), LINEAR)
        table["linear_attn.in_proj_a.weight"] = ("in_proj_a", (hv, e), LINEAR)
    return table


def tensor_table(cfg: ModelConfig, mtp_layers: int | None = None) -> list[TensorEntry]:
    """Every tensor a checkpoint of `cfg` must hold (FP8 scale siblings are not listed)."""
    e, v, p = cfg.hidden_size, cfg.vocab_size, cfg.weight_prefix
    n_mtp = cfg.mtp_layers if mtp_layers is None else mtp_layers
    out = [TensorEntry(p + "embed_tokens.weight", None, None, "embed", (v, e), EMBED),
           TensorEntry(p + "norm.weight", None, None, "final_norm", (e,), NORM)]
    if not cfg.tie_word_embeddings:
        out.append(TensorEntry("lm_head.weight", None, None, "lm_head", (v, e), EMBED))
    counters = {"gdn": 0, "attn": 0}
    for i, kind in enumerate(cfg.layer_types):
        group = "gdn" if kind == "linear_attention" else "attn"
        table = gdn_layer_tensors(cfg) if group == "gdn" else attention_layer_tensors(cfg)
        j = counters[group]
        counters[group] += 1
        for suffix, (key, shape, role) in table.items():
            out.append(TensorEntry(f"{p}layers.{i}.{suffix}", group, j, key, shape, role))
    if n_mtp:
        out += [TensorEntry("mtp.fc.weight", "mtp", None, "fc", (e, 2 * e), LINEAR),
                TensorEntry("mtp.pre_fc_norm_embedding.weight", "mtp", None, "pre_fc_norm_embedding", (e,), NORM),
                TensorEntry("mtp.pre_fc_norm_hidden.weight", "mtp", None, "pre_fc_norm_hidden", (e,), NORM),
                TensorEntry("mtp.norm.weight", "mtp", None, "norm", (e,), NORM)]
        for j in range(n_mtp):
            for suffix, (key, shape, role) in attention_layer_tensors(cfg).items():
                out.append(TensorEntry(f"mtp.layers.{j}.{suffix}", "mtp_layers", j, key, shape, role))
    return out


def group_sizes(cfg: ModelConfig, mtp_layers: int | None = None) -> dict[str, int]:
    return {"gdn": cfg.num_linear_layers, "attn": cfg.num_full_layers,
            "mtp_layers": cfg.mtp_layers if mtp_layers is None else mtp_layers}


def fused_qkvz_rows(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """Row indices of Qwen3-Next's in_proj_qkvz that give the Qwen3.5 logical (qkv rows, z rows).

    The fused rows are grouped by key head g (MODEL_SPEC §2.4): [q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)].
    """
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    group = 2 * dk + 2 * r * dv
    q, k, v, z = [], [], [], []
    for g in range(hk):
        base = g * group
        q += range(base, base + dk)
        k += range(base + dk, base + 2 * dk)
        v += range(base + 2 * dk, base + 2 * dk + r * dv)
        z += range(base + 2 * dk + r * dv, base + group)
    return q + k + v, z


def fused_ba_rows(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """Row indices of Qwen3-Next's in_proj_ba giving (b rows, a rows): per key head [b_g (r) | a_g (r)]."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    b, a = [], []
    for g in range(hk):
        b += range(g * 2 * r, g * 2 * r + r)
        a += range(g * 2 * r + r, (g + 1) * 2 * r)
    return b, a


def abstract_params(cfg: ModelConfig, dtype, fp8_linear: bool = False) -> dict:
    """The parameter tree as jax.ShapeDtypeStructs, as `checkpoint.load` would build it.

    `fp8_linear`: every LINEAR weight except in_proj_b/a and mtp.fc (MODEL_SPEC §5.2) is an Fp8Block.
    For memory planning and abstract evaluation (jax.eval_shape) without reading any weights."""
    import jax
    import jax.numpy as jnp

    from qmtp.model.fp8 import Fp8Block, scale_grid

    sizes = group_sizes(cfg)
    tree: dict = {"gdn": [{} for _ in range(sizes["gdn"])], "attn": [{} for _ in range(sizes["attn"])],
                  "mtp": {"layers": [{} for _ in range(sizes["mtp_layers"])]}}
    keep_bf16 = {"in_proj_b", "in_proj_a", "fc"}

    def leaf(key, shape, role):
        if role in (NORM, FP32):
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        if role == CONV:
            return jax.ShapeDtypeStruct((shape[0], shape[2]), dtype)
        if role == LINEAR and fp8_linear and key not in keep_bf16:
            return Fp8Block(jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                            jax.ShapeDtypeStruct(scale_grid(*shape), jnp.float32))
        return jax.ShapeDtypeStruct(shape, dtype)

    for e in tensor_table(cfg):
        if e.group is None:
            node = tree
        elif e.group == "mtp":
            node = tree["mtp"]
        elif e.group == "mtp_layers":
            node = tree["mtp"]["layers"][e.index]
        else:
            node = tree[e.group][e.index]
        if e.role in (FUSED_QKVZ, FUSED_BA):  # split into the two Qwen3.5 projections
            out_a = cfg.conv_dim if e.role == FUSED_QKVZ else cfg.linear_num_value_heads
            for key, rows in zip(e.key.split("+"), (out_a, e.shape[0] - out_a)):
                node[key] = leaf(key, (rows, e.shape[1]), LINEAR)
        else:
            node[e.key] = leaf(e.key, e.shape, e.role)
    return finalize_tree(tree)


def finalize_tree(tree: dict) -> dict:
    """Layer lists become tuples; an MTP subtree without layers or glue is dropped."""
    tree = dict(tree, gdn=tuple(tree["gdn"]), attn=tuple(tree["attn"]))
    mtp = dict(tree.pop("mtp"))
    mtp["layers"] = tuple(mtp.get("layers", ()))
    if not mtp["layers"]:
        mtp.pop("layers")
    if mtp:
        tree["mtp"] = mtp
    return tree
