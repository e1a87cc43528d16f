"""The parameter tree and the one key table that maps it to checkpoint tensors.

Parameter tree (dicts of arrays; one dict per layer, in per-kind tuples):

    embed        [V, E]                    compute dtype
    lm_head      [V, E]                    absent when tie_word_embeddings (embed is used)
    final_norm   [E]                       f32, zero-centred (applied as 1 + w)
    gdn[j]/...   the j-th linear-attention layer (tuple over Lg)
    attn[j]/...  the j-th full-attention layer (tuple over La)
    mtp/fc, mtp/pre_fc_norm_embedding, mtp/pre_fc_norm_hidden, mtp/norm
    mtp/layers[j]/...  the MTP decoder layers (full attention)

A layer's MLP is dense (mlp_gate, mlp_up, mlp_down) or, where cfg.layer_is_moe, the sparse MoE block
(qmtp/model/moe.py): router [X, E], experts_gate_up [X, 2I, E] (each expert's gate rows, then its up
rows), experts_down [X, E, I], shared_mlp_gate / shared_mlp_up [S, E], shared_mlp_down [E, S],
shared_gate [1, E]. The experts are stacked whichever way the checkpoint stores them: one tensor per
expert and projection (`mlp.experts.{x}.gate_proj.weight`, as Qwen3-Next releases) or fused
3-D tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`; `tensor_table(fused_experts=True)`).

Layers are separate arrays, not [L, ...] stacks: XLA copies a layer sliced out of a stack before
each matmul on the GPU. Linear weights keep the checkpoint's [out, in] layout (y = x @ W.T), in the
compute dtype or as an `Fp8Block`; norm weights, A_log and dt_bias are f32; conv [C, 1, W] is held
as [C, W]. `tensor_table(cfg)` maps every checkpoint tensor to its place in the tree.
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
EXPERTS = "experts"  # rows of a stacked expert weight [X, R, C] (TensorEntry.expert / row0); may be FP8
FUSED_EXPERTS = "fused_experts"  # a whole stacked expert weight [X, R, C] as stored; may be FP8


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor. `group` is None (top level), 'gdn', 'attn' or 'mtp_layers'; `index`
    is the position in that group's layer stack; `key` the param name (fused entries fill two).
    An EXPERTS entry fills rows row0 .. row0 + shape[0] - 1 of expert `expert` of its stacked param."""

    name: str
    group: str | None
    index: int | None
    key: str
    shape: tuple[int, ...]
    role: str
    expert: int | None = None
    row0: int = 0


def _mlp(cfg: ModelConfig, layer: int, fused_experts: bool) -> dict[str, tuple]:
    """HF suffix -> (param key, HF shape, role[, expert, row0]) of the norms and the MLP of decoder layer
    `layer` (MTP layer j follows the rule of index j): dense, or the sparse MoE block where the config
    says."""
    e = cfg.hidden_size
    table = {"input_layernorm.weight": ("input_norm", (e,), NORM),
             "post_attention_layernorm.weight": ("post_norm", (e,), NORM)}
    if not cfg.layer_is_moe(layer):
        f = cfg.intermediate_size
        return {**table, "mlp.gate_proj.weight": ("mlp_gate", (f, e), LINEAR),
                "mlp.up_proj.weight": ("mlp_up", (f, e), LINEAR), "mlp.down_proj.weight": ("mlp_down", (e, f), LINEAR)}
    m = cfg.moe
    x, i, s = m.num_experts, m.expert_size, m.shared_size
    table.update({"mlp.gate.weight": ("router", (x, e), LINEAR),
                  "mlp.shared_expert.gate_proj.weight": ("shared_mlp_gate", (s, e), LINEAR),
                  "mlp.shared_expert.up_proj.weight": ("shared_mlp_up", (s, e), LINEAR),
                  "mlp.shared_expert.down_proj.weight": ("shared_mlp_down", (e, s), LINEAR),
                  "mlp.shared_expert_gate.weight": ("shared_gate", (1, e), LINEAR)})
    if fused_experts:
        table["mlp.experts.gate_up_proj"] = ("experts_gate_up", (x, 2 * i, e), FUSED_EXPERTS)
        table["mlp.experts.down_proj"] = ("experts_down", (x, e, i), FUSED_EXPERTS)
    else:
        for n in range(x):
            table[f"mlp.experts.{n}.gate_proj.weight"] = ("experts_gate_up", (i, e), EXPERTS, n, 0)
            table[f"mlp.experts.{n}.up_proj.weight"] = ("experts_gate_up", (i, e), EXPERTS, n, i)
            table[f"mlp.experts.{n}.down_proj.weight"] = ("experts_down", (e, i), EXPERTS, n, 0)
    return table


def stacked_shape(cfg: ModelConfig, key: str) -> tuple[int, int, int]:
    """[X, R, C] of a stacked expert param (experts_gate_up / experts_down)."""
    m = cfg.moe
    return ((m.num_experts, 2 * m.expert_size, cfg.hidden_size) if key == "experts_gate_up"
            else (m.num_experts, cfg.hidden_size, m.expert_size))


def attention_layer_tensors(cfg: ModelConfig, layer: int = 0, fused_experts: bool = False) -> dict[str, tuple]:
    """HF suffix -> (param key, HF shape, role[, expert, row0]) for full-attention decoder layer
    `layer` (or MTP layer `layer`)."""
    e, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {
        "self_attn.q_proj.weight": ("q_proj", (2 * hq * d, e), LINEAR),  # per head: [query | gate]
        "self_attn.k_proj.weight": ("k_proj", (hkv * d, e), LINEAR),
        "self_attn.v_proj.weight": ("v_proj", (hkv * d, e), LINEAR),
        "self_attn.o_proj.weight": ("o_proj", (e, hq * d), LINEAR),
        "self_attn.q_norm.weight": ("q_norm", (d,), NORM),
        "self_attn.k_norm.weight": ("k_norm", (d,), NORM),
        **_mlp(cfg, layer, fused_experts),
    }


def gdn_layer_tensors(cfg: ModelConfig, layer: int = 0, fused_experts: bool = False) -> dict[str, tuple]:
    """HF suffix -> (param key, HF shape, role[, expert, row0]) for Gated DeltaNet decoder layer `layer`."""
    e, hv = cfg.hidden_size, cfg.linear_num_value_heads
    table = {
        "linear_attn.conv1d.weight": ("conv", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), CONV),
        "linear_attn.dt_bias": ("dt_bias", (hv,), FP32),
        "linear_attn.A_log": ("A_log", (hv,), FP32),
        "linear_attn.norm.weight": ("gdn_norm", (cfg.linear_value_head_dim,), NORM),  # plain w, not 1 + w
        "linear_attn.out_proj.weight": ("out_proj", (e, cfg.value_dim), LINEAR),
        **_mlp(cfg, layer, fused_experts),
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


def tensor_table(cfg: ModelConfig, fused_experts: bool = False) -> list[TensorEntry]:
    """Every tensor a checkpoint of `cfg` must hold (FP8 scale siblings are not listed); fused_experts:
    the MoE experts stored as fused 3-D tensors (module doc)."""
    e, v, p = cfg.hidden_size, cfg.vocab_size, cfg.weight_prefix
    out = [TensorEntry(p + "embed_tokens.weight", None, None, "embed", (v, e), EMBED),
           TensorEntry(p + "norm.weight", None, None, "final_norm", (e,), NORM)]
    if not cfg.tie_word_embeddings:
        out.append(TensorEntry("lm_head.weight", None, None, "lm_head", (v, e), EMBED))
    counters = {"gdn": 0, "attn": 0}
    for i, kind in enumerate(cfg.layer_types):
        group = "gdn" if kind == "linear_attention" else "attn"
        table = (gdn_layer_tensors(cfg, i, fused_experts) if group == "gdn"
                 else attention_layer_tensors(cfg, i, fused_experts))
        j = counters[group]
        counters[group] += 1
        for suffix, (key, shape, role, *at) in table.items():
            out.append(TensorEntry(f"{p}layers.{i}.{suffix}", group, j, key, shape, role, *at))
    if cfg.mtp_layers:
        out += [TensorEntry("mtp.fc.weight", "mtp", None, "fc", (e, 2 * e), LINEAR),
                TensorEntry("mtp.pre_fc_norm_embedding.weight", "mtp", None, "pre_fc_norm_embedding", (e,), NORM),
                TensorEntry("mtp.pre_fc_norm_hidden.weight", "mtp", None, "pre_fc_norm_hidden", (e,), NORM),
                TensorEntry("mtp.norm.weight", "mtp", None, "norm", (e,), NORM)]
        for j in range(cfg.mtp_layers):
            for suffix, (key, shape, role, *at) in attention_layer_tensors(cfg, j, fused_experts).items():
                out.append(TensorEntry(f"mtp.layers.{j}.{suffix}", "mtp_layers", j, key, shape, role, *at))
    return out


def empty_tree(cfg: ModelConfig) -> dict:
    """The tree's skeleton with empty layer dicts, for `place` to fill and `finalize_tree` to close."""
    return {"gdn": [{} for _ in cfg.linear_layer_ids], "attn": [{} for _ in cfg.full_layer_ids],
            "mtp": {"layers": [{} for _ in range(cfg.mtp_layers)]}}


def place(tree: dict, entry: TensorEntry, key: str, value) -> None:
    """Top-level and MTP glue tensors go in directly; layer tensors into their layer's dict."""
    if entry.group is None:
        tree[key] = value
    elif entry.group == "mtp":
        tree["mtp"][key] = value
    elif entry.group == "mtp_layers":
        tree["mtp"]["layers"][entry.index][key] = value
    else:
        tree[entry.group][entry.index][key] = value


def _per_key_head(hk: int, *sizes: int) -> list[list[int]]:
    """Rows of each piece when the rows are grouped by key head g as [piece_0 | piece_1 | ...] of `sizes`."""
    starts = [sum(sizes[:n]) for n in range(len(sizes))]
    return [[g * sum(sizes) + a + j for g in range(hk) for j in range(n)] for a, n in zip(starts, sizes)]


def fused_qkvz_rows(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """Row indices of Qwen3-Next's in_proj_qkvz giving the Qwen3.5 (qkv rows, z rows); its rows are
    grouped by key head g (MODEL_SPEC §2.4): [q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)]."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    rdv = cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim
    q, k, v, z = _per_key_head(hk, dk, dk, rdv, rdv)
    return q + k + v, z


def fused_ba_rows(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """Row indices of Qwen3-Next's in_proj_ba giving (b rows, a rows): per key head [b_g (r) | a_g (r)]."""
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    b, a = _per_key_head(cfg.linear_num_key_heads, r, r)
    return b, a


def abstract_params(cfg: ModelConfig, dtype, fp8_linear: bool = False) -> dict:
    """The parameter tree as jax.ShapeDtypeStructs, as `checkpoint.load` would build it (for memory
    planning and jax.eval_shape). `fp8_linear`: every LINEAR weight except in_proj_b/a and mtp.fc
    (MODEL_SPEC §5.2) is an Fp8Block."""
    import jax
    import jax.numpy as jnp

    from qmtp.model.fp8 import Fp8Block, scale_grid

    tree = empty_tree(cfg)
    keep_bf16 = {"in_proj_b", "in_proj_a", "fc", "router", "shared_gate"}

    def leaf(key, shape, role):
        if role in (NORM, FP32):
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        if role == CONV:
            return jax.ShapeDtypeStruct((shape[0], shape[2]), dtype)
        if role in (LINEAR, FUSED_EXPERTS) and fp8_linear and key not in keep_bf16:
            return Fp8Block(jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                            jax.ShapeDtypeStruct(shape[:-2] + scale_grid(*shape[-2:]), jnp.float32))
        return jax.ShapeDtypeStruct(shape, dtype)

    for e in tensor_table(cfg, fused_experts=True):
        if e.role in (FUSED_QKVZ, FUSED_BA):  # split into the two Qwen3.5 projections
            out_a = cfg.conv_dim if e.role == FUSED_QKVZ else cfg.linear_num_value_heads
            for key, rows in zip(e.key.split("+"), (out_a, e.shape[0] - out_a)):
                place(tree, e, key, leaf(key, (rows, e.shape[1]), LINEAR))
        else:
            place(tree, e, e.key, leaf(e.key, e.shape, e.role))
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
