"""Presets of the synthetic checkpoint writer: a Qwen3.5 `text_config` builder (optionally sliced to
`num_layers` decoder layers) and the weight generator of `qmtp.tools.synthetic_weights` that goes with it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import numpy as np

from qmtp.model import params
from qmtp.model.config import FULL, LINEAR, ModelConfig
from qmtp.tools import tiny_tokenizer
from qmtp.tools.synthetic_weights import (ControlledWeights, fast_fp8_normal, HashedNormal,  # noqa: F401
                                          PinnedRows, RandomWeights, seeded_permutation, WeightValue)

GENERATOR_VERSION = 1  # bump whenever a preset's config or weights change (part of the cache key)

WeightFn = Callable[[params.TensorEntry, bool], WeightValue]


def layer_types(num_layers: int, interval: int) -> list[str]:
    """Layer i is full attention iff (i+1) % interval == 0; fewer than `interval` layers end with one
    full-attention layer ([linear]*(N-1) + [full]) so both kinds appear."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}: must be >= 1")
    if num_layers < interval:
        return [LINEAR] * (num_layers - 1) + [FULL]
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]


def text_config(*, hidden: int, ffn: int, num_layers: int, interval: int, heads: int, kv_heads: int,
                head_dim: int, partial_rotary: float, rope_theta: float, gdn_k_heads: int,
                gdn_v_heads: int, gdn_k_dim: int, gdn_v_dim: int, conv: int, vocab: int, tie: bool,
                max_positions: int, moe: dict | None = None) -> dict:
    """A Qwen3.5 `text_config` (model_type qwen3_5_text) with the released models' fixed fields; with
    `moe` (experts, top_k, expert_size, shared_size) a Qwen3.5-MoE one (qwen3_5_moe_text: every layer's
    MLP sparse, no dense width)."""
    half = int(head_dim * partial_rotary) // 2  # rotary frequency slots, split over (t, h, w): 64 -> [11, 11, 10]
    eot = tiny_tokenizer.bos_token_id(tiny_tokenizer.TINY_VOCAB_SIZE)  # config bos = eos = <|endoftext|>
    config = {
        "model_type": "qwen3_5_text", "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": num_layers, "layer_types": layer_types(num_layers, interval),
        "full_attention_interval": interval, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "attn_output_gate": True, "attention_bias": False, "attention_dropout": 0.0,
        "partial_rotary_factor": partial_rotary,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial_rotary,
                            "mrope_section": [half // 3 + (1 if i < half % 3 else 0) for i in range(3)],
                            "mrope_interleaved": True},
        "rms_norm_eps": 1e-6, "linear_num_key_heads": gdn_k_heads, "linear_num_value_heads": gdn_v_heads,
        "linear_key_head_dim": gdn_k_dim, "linear_value_head_dim": gdn_v_dim, "linear_conv_kernel_dim": conv,
        "hidden_act": "silu", "output_gate_type": "swish", "mamba_ssm_dtype": "float32",
        "vocab_size": vocab, "tie_word_embeddings": tie, "max_position_embeddings": max_positions,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "bos_token_id": eot,
        "eos_token_id": eot, "initializer_range": 0.02, "use_cache": True, "dtype": "bfloat16",
    }
    if moe:
        del config["intermediate_size"]
        config.update({"model_type": "qwen3_5_moe_text", "num_experts": moe["experts"],
                       "num_experts_per_tok": moe["top_k"], "moe_intermediate_size": moe["expert_size"],
                       "shared_expert_intermediate_size": moe["shared_size"], "router_aux_loss_coef": 0.001,
                       "output_router_logits": False})
    return config


_SMALL = dict(interval=2, heads=4, partial_rotary=0.25, rope_theta=10000.0, gdn_k_heads=2, gdn_v_heads=4, conv=4,
              vocab=tiny_tokenizer.TINY_VOCAB_SIZE, tie=False, max_positions=4096)


def tiny_text_config(num_layers: int | None = None) -> dict:
    """CPU-sized model; dims 160 / 272 / 64 are not multiples of 128 (ragged FP8 blocks)."""
    return text_config(hidden=160, ffn=272, num_layers=4 if num_layers is None else num_layers, kv_heads=2,
                       head_dim=32, gdn_k_dim=32, gdn_v_dim=32, **_SMALL)


def tiny_tp_text_config(num_layers: int | None = None) -> dict:
    """CPU model for tensor-parallel tests: every split dim of its FP8 weights is a whole number of
    128-blocks at TP2, and it has a single KV head (replicated across shards)."""
    return text_config(hidden=256, ffn=512, num_layers=4 if num_layers is None else num_layers, kv_heads=1,
                       head_dim=128, gdn_k_dim=128, gdn_v_dim=128, **_SMALL)


def tiny_tp_moe_text_config(num_layers: int | None = None) -> dict:
    """tiny_tp as a Qwen3.5-MoE: 8 experts (top 2) and a shared expert, each of width 256, so every FP8
    expert splits 2 ways on 128-blocks."""
    return text_config(hidden=256, ffn=0, num_layers=4 if num_layers is None else num_layers, kv_heads=1,
                       head_dim=128, gdn_k_dim=128, gdn_v_dim=128, **_SMALL,
                       moe={"experts": 8, "top_k": 2, "expert_size": 256, "shared_size": 256})


def tiny_moe_text_config(num_layers: int | None = None) -> dict:
    """tiny as a Qwen3.5-MoE: 8 experts (top 2) of width 128 (whole FP8 blocks: gate and up rows stack on
    one scale grid) and a shared expert of width 96."""
    return text_config(hidden=160, ffn=0, num_layers=4 if num_layers is None else num_layers, kv_heads=2,
                       head_dim=32, gdn_k_dim=32, gdn_v_dim=32, **_SMALL,
                       moe={"experts": 8, "top_k": 2, "expert_size": 128, "shared_size": 96})


def qwen3_5_35b_a3b_text_config(num_layers: int | None = None) -> dict:
    """Qwen3.5-35B-A3B shapes (MODEL_SPEC §1.3): 40 layers, E 2048, 256 experts (top 8) of width 512."""
    return text_config(hidden=2048, ffn=0, num_layers=40 if num_layers is None else num_layers, interval=4,
                       heads=16, kv_heads=2, head_dim=256, partial_rotary=0.25, rope_theta=1e7, gdn_k_heads=16,
                       gdn_v_heads=32, gdn_k_dim=128, gdn_v_dim=128, conv=4, vocab=248320, tie=False,
                       max_positions=262144, moe={"experts": 256, "top_k": 8, "expert_size": 512, "shared_size": 512})


def qwen3_next_config(text: dict) -> dict:
    """A Qwen3.5(-MoE) text_config as the flat Qwen3-Next config.json (MODEL_SPEC §1.1): rope fields at the
    top level, the MTP layer count as num_nextn_predict_layers; the GDN projections go fused (in_proj_qkvz,
    in_proj_ba) in its checkpoints. Dense where the text_config has no experts (num_experts 0)."""
    rope = text["rope_parameters"]
    config = {k: v for k, v in text.items() if k not in ("rope_parameters", "mtp_num_hidden_layers",
                                                          "mtp_use_dedicated_embeddings", "output_gate_type")}
    config.update(model_type="qwen3_next", rope_theta=rope["rope_theta"], rope_scaling=None,
                  partial_rotary_factor=rope["partial_rotary_factor"], num_nextn_predict_layers=1,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    config.setdefault("num_experts", 0)
    config.setdefault("intermediate_size", 4 * text["hidden_size"] if config["num_experts"] else 0)
    return config


def tiny_next_moe_config(num_layers: int | None = None) -> dict:
    """tiny_moe as a Qwen3-Next checkpoint (flat config, fused GDN projections)."""
    return qwen3_next_config(tiny_moe_text_config(num_layers))


def qwen3_next_80b_a3b_config(num_layers: int | None = None) -> dict:
    """Qwen3-Next-80B-A3B shapes (MODEL_SPEC §1.3): 48 layers, E 2048, 512 experts (top 10) of width 512."""
    text = text_config(hidden=2048, ffn=0, num_layers=48 if num_layers is None else num_layers, interval=4,
                       heads=16, kv_heads=2, head_dim=256, partial_rotary=0.25, rope_theta=5e6, gdn_k_heads=16,
                       gdn_v_heads=32, gdn_k_dim=128, gdn_v_dim=128, conv=4, vocab=151936, tie=False,
                       max_positions=262144, moe={"experts": 512, "top_k": 10, "expert_size": 512, "shared_size": 512})
    return dict(qwen3_next_config(text), intermediate_size=5120)


def qwen3_5_27b_text_config(num_layers: int | None = None) -> dict:
    """Qwen3.5-27B shapes (MODEL_SPEC §1.3); vocab 248320 of which the tokenizer uses the first 384."""
    return text_config(hidden=5120, ffn=17408, num_layers=64 if num_layers is None else num_layers, interval=4,
                       heads=24, kv_heads=4, head_dim=256, partial_rotary=0.25, rope_theta=1e7, gdn_k_heads=16,
                       gdn_v_heads=48, gdn_k_dim=128, gdn_v_dim=128, conv=4, vocab=248320, tie=False,
                       max_positions=262144)


def controlled_permutation(preset_name: str, seed: int) -> np.ndarray:
    """pi (int64 [tokenizer vocab size], a copy): in checkpoints of a controlled preset and `seed` the target's
    greedy next token after x is pi[x] in any context, and the MTP head drafts it (any layers and dtype)."""
    spec = get_preset(preset_name)
    if not issubclass(spec.weights_cls, ControlledWeights):
        raise ValueError(f"preset {preset_name!r} is not a controlled-acceptance preset")
    return seeded_permutation(spec.tokenizer_vocab_size, seed).copy()


def read_controlled_permutation(config_or_dir: str | dict) -> np.ndarray:
    """pi recorded in a checkpoint's config.json (`qmtp_synthetic.controlled.permutation`), from a
    checkpoint directory, a config.json path or the loaded dict; ValueError if it has none."""
    config = config_or_dir
    if isinstance(config_or_dir, str):
        path = os.path.join(config_or_dir, "config.json") if os.path.isdir(config_or_dir) else config_or_dir
        with open(path) as f:
            config = json.load(f)
    controlled = config.get("qmtp_synthetic", {}).get("controlled")
    if not controlled or "permutation" not in controlled:
        raise ValueError(f"{config_or_dir if isinstance(config_or_dir, str) else 'config'}: not a controlled-"
                         "acceptance checkpoint (no qmtp_synthetic.controlled.permutation)")
    return np.asarray(controlled["permutation"], np.int64)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named synthetic model: its text_config builder and its weight generator."""

    name: str
    description: str
    text_config: Callable[[int | None], dict]  # num_layers (None: the preset's own) -> text_config
    fast_weights: bool  # draw 2-D tensors with `HashedNormal` (real shapes) instead of exact normals
    tokenizer_vocab_size: int = tiny_tokenizer.TINY_VOCAB_SIZE
    weights_cls: type[RandomWeights] = RandomWeights

    def weights(self, cfg: ModelConfig, seed: int) -> WeightFn:
        """The per-tensor weight generator for a config of this preset."""
        return self.weights_cls(cfg, seed, fast=self.fast_weights, live_vocab=self.tokenizer_vocab_size)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", "CPU test model: E 160, F 272, 4 layers (GDN/attn alternating), V 384, exact normals",
           tiny_text_config, fast_weights=False),
    Preset("tiny_tp", "CPU tensor-parallel test model: E 256, F 512, one KV head, head dim 128 (FP8 splits "
           "2 ways on 128-blocks; the KV head is replicated)", tiny_tp_text_config, fast_weights=False),
    Preset("tiny_tp_moe", "CPU tensor-parallel test model of Qwen3.5-MoE: tiny_tp with 8 experts (top 2) and a "
           "shared expert, each of width 256 (FP8 experts split 2 ways on 128-blocks)", tiny_tp_moe_text_config,
           fast_weights=False),
    Preset("tiny_moe", "CPU test model of Qwen3.5-MoE: tiny with 8 experts (top 2, width 128) and a shared "
           "expert (width 96) in every layer, exact normals", tiny_moe_text_config, fast_weights=False),
    Preset("qwen3_5_35b_a3b", "Qwen3.5-35B-A3B shapes: E 2048, 40 layers, 256 experts (top 8, width 512), "
           "V 248320 (tokenizer 384), fast draws", qwen3_5_35b_a3b_text_config, fast_weights=True),
    Preset("tiny_next_moe", "CPU test model of Qwen3-Next MoE: tiny_moe in the Qwen3-Next layout (flat config, "
           "fused GDN projections; bf16 / fp32 only: FP8 blocks would split its 32-wide GDN heads)",
           tiny_next_moe_config, fast_weights=False),
    Preset("qwen3_next_80b_a3b", "Qwen3-Next-80B-A3B shapes: E 2048, 48 layers, 512 experts (top 10, width 512), "
           "V 151936 (tokenizer 384), fast draws", qwen3_next_80b_a3b_config, fast_weights=True),
    Preset("qwen3_5_27b", "Qwen3.5-27B shapes: E 5120, F 17408, 64 layers, V 248320 (tokenizer 384), fast draws",
           qwen3_5_27b_text_config, fast_weights=True),
    Preset("tiny_controlled", "tiny with controlled acceptance: greedy next token = a seeded permutation of the "
           "input token, MTP drafts it (100% acceptance)", tiny_text_config, fast_weights=False,
           weights_cls=ControlledWeights),
    Preset("qwen3_5_35b_a3b_controlled", "qwen3_5_35b_a3b shapes with controlled acceptance (see tiny_controlled)",
           qwen3_5_35b_a3b_text_config, fast_weights=True, weights_cls=ControlledWeights),
    Preset("tiny_moe_controlled", "tiny_moe with controlled acceptance (see tiny_controlled)", tiny_moe_text_config,
           fast_weights=False, weights_cls=ControlledWeights),
    Preset("qwen3_5_27b_controlled", "qwen3_5_27b shapes with controlled acceptance (see tiny_controlled)",
           qwen3_5_27b_text_config, fast_weights=True, weights_cls=ControlledWeights),
)}


def get_preset(name: str) -> Preset:
    """The preset called `name`; ValueError naming the known ones otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name]
