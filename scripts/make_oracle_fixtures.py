#!/usr/bin/env python3
"""Build the HF-transformers numerical oracle fixtures under tests/fixtures/oracle/.

Two tiny random float32 checkpoints are built with Hugging Face transformers' own model classes
(torch fallback paths only: no fla / causal-conv1d / hub kernels), written to disk in the layout the
released checkpoints use, reloaded with transformers to prove the written tensors are the ones used,
and their teacher-forced logits and greedy continuations are stored as expected outputs:

  tests/fixtures/oracle/qwen3_5/     Qwen3_5ForCausalLM math, released Qwen3.5 VLM-wrapper layout
                                     (config.json with text_config, tensors under model.language_model.)
  tests/fixtures/oracle/qwen3_next/  Qwen3NextForCausalLM with a dense MLP in every layer
                                     (num_experts=0), HF's flat layout (model., fused in_proj_qkvz/_ba),
                                     tied embeddings, release-style rope_theta / full_attention_interval.
  tests/fixtures/oracle/qwen3_5_moe/ Qwen3_5MoeForCausalLM (8 experts, top 2, a shared expert in every layer),
                                     the Qwen3.5 VLM-wrapper layout, experts stored fused (3-D gate_up_proj /
                                     down_proj).
  tests/fixtures/oracle/qwen3_next_moe/ Qwen3NextForCausalLM with MoE (norm_topk_prob false, layer 2 dense
                                     through mlp_only_layers), experts stored one tensor per expert.

Each dir: config.json, generation_config.json, model.safetensors (float32, incl. random mtp.* tensors that
HF ignores), expected.npz, meta.json.  Run through `make oracle-fixtures` (creates .venv-oracle).
Deterministic: fixed seeds, 1 torch thread, torch.use_deterministic_algorithms(True).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("USE_HUB_KERNELS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import importlib.util
import json
import math
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from transformers import (
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                                             modeling_qwen3_5_moe)
from transformers.models.qwen3_next import modeling_qwen3_next

REPO = Path(__file__).resolve().parents[1]
OUT_ROOT = REPO / "tests" / "fixtures" / "oracle"

# ---------------------------------------------------------------------------------------------------------
# Geometry shared by both fixtures.
# ---------------------------------------------------------------------------------------------------------
H = 64
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
GEOMETRY = dict(
    vocab_size=256,
    hidden_size=H,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    hidden_act="silu",
)
# The MoE fixtures: every layer sparse except where mlp_only_layers says (Qwen3-Next), the MTP layer too.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
NEXT_MOE_DENSE_LAYERS = [2]
KINDS = ["qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_next_moe"]
# Below this gap between the k-th and (k+1)-th router probability a float32 rounding difference could
# choose another expert; a seed whose prompts come that close is rejected.
ROUTER_MIN_GAP = 1e-6
ROPE_THETA = 10000.0
PARTIAL_ROTARY_FACTOR = 0.25
ROTARY_DIM = int(GEOMETRY["head_dim"] * PARTIAL_ROTARY_FACTOR)  # 8
MROPE_SECTION = [2, 1, 1]  # sums to ROTARY_DIM // 2 = 4 (release: [11, 11, 10] for rotary dim 64)
assert sum(MROPE_SECTION) == ROTARY_DIM // 2

PROMPT_LENS = [5, 19, 70]  # 70 > 64: chunked GDN prefill with a ragged last chunk (64 + 6)
# A long prompt (drawn after the seed is chosen, so the arrays above do not change): qmtp prefills it in
# several chunks; its teacher-forced logits are kept every LONG_EVERY positions and at the last 4.
LONG_PROMPT_LEN = 2100
LONG_EVERY = 100
GREEDY_PROMPTS = [0, 1]
MAX_NEW_TOKENS = 12
MIN_GAP = 1e-3  # required top-2 logit gap at every greedy step
EOS_ID = 255  # never appears in prompts nor in the expected greedy outputs (checked)
EXTRA_EOS_ID = 254  # qwen3_5 generation_config uses a list, like the release
PROMPT_VOCAB_HI = 254  # prompts sampled from [0, 254): no eos ids in prompts

# Init scales (see randomize()).
EMBED_STD = 0.5  # tied logits std ~ EMBED_STD * sqrt(H) = 4
LM_HEAD_STD = 4.0 / math.sqrt(H)  # untied logits std ~ 4
# Extra gain on the residual-branch output projections (o_proj / down_proj / out_proj). With gain 1 the
# tied-embedding model mostly predicts its own input token (embedding dominates the residual stream) and
# greedy decoding degenerates into repeats; gain 2 makes the layers matter.
RESIDUAL_OUT_GAIN = 2.0
MIN_DISTINCT_GREEDY = 8  # each 12-token greedy continuation must have at least this many distinct tokens
NORM_STD = 0.1
GDN_NORM_STD = 0.1
# Mamba-style negative dt bias: with N(0, 0.5) softplus(a + dt_bias) ~ 0.7 and exp(g) has median ~1e-3, so the
# GDN state is gone after a token or two and the state handed across the 64-token chunk boundary barely matters
# (~5% of the last-chunk logits); N(-3, 0.5) gives a spread of per-token decays exp(g) (median ~0.75, ~20% > 0.9).
DT_BIAS_MEAN = -3.0
DT_BIAS_STD = 0.5
CONV_STD = 0.3
A_RANGE = (1.0, 16.0)

MAX_ATTEMPTS = 50
CHUNK = 64  # HF torch_chunk_gated_delta_rule chunk size
MIN_RECURRENCE_EFFECT = 0.05  # required relative logits change when the GDN state carry is ablated


def log(msg: str) -> None:
    print(msg, flush=True)


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    """Round to the nearest bfloat16 value, keep float32 storage (bf16 casts of the fixture are lossless)."""
    return t.to(torch.bfloat16).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Weight randomization
# ---------------------------------------------------------------------------------------------------------
def _rand_tensor(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """Random value for a parameter, chosen by its name so every convention is exercised."""
    shape = tuple(shape)
    if name.endswith("embed_tokens.weight"):
        t = torch.randn(shape, generator=gen) * EMBED_STD
    elif name == "lm_head.weight":
        t = torch.randn(shape, generator=gen) * LM_HEAD_STD
    elif name.endswith("linear_attn.norm.weight"):  # GDN gated RMSNorm: plain weight (not 1+w)
        t = 1.0 + torch.randn(shape, generator=gen) * GDN_NORM_STD
    elif len(shape) == 1 and "norm" in name.rsplit(".", 2)[-2]:  # zero-centred (1+w) norms, incl. mtp.pre_fc_norm_*
        t = torch.randn(shape, generator=gen) * NORM_STD
    elif name.endswith("A_log"):
        lo, hi = A_RANGE
        t = torch.log(lo + (hi - lo) * torch.rand(shape, generator=gen))
    elif name.endswith("dt_bias"):
        t = DT_BIAS_MEAN + torch.randn(shape, generator=gen) * DT_BIAS_STD
    elif name.endswith("conv1d.weight"):
        t = torch.randn(shape, generator=gen) * CONV_STD
    elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stacked experts [X, out, in]
        gain = RESIDUAL_OUT_GAIN if name.endswith("down_proj") else 1.0
        t = torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[-1]))
    elif name.endswith(".weight") and len(shape) == 2:  # nn.Linear [out, in]
        gain = RESIDUAL_OUT_GAIN if name.rsplit(".", 2)[-2] in ("o_proj", "down_proj", "out_proj") else 1.0
        t = torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[1]))
    else:
        raise ValueError(f"no init rule for {name} {shape}")
    return bf16_round(t.to(torch.float32))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # named_parameters() de-duplicates tied tensors (lm_head.weight is embed_tokens.weight when tied)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        p.copy_(_rand_tensor(name, p.shape, gen))


def is_moe(kind: str) -> bool:
    return kind.endswith("_moe")


def moe_mlp_specs(prefix: str, fused: bool) -> dict[str, tuple[int, ...]]:
    """The sparse MoE block's tensors under `prefix` (a decoder layer's), experts fused or one per expert."""
    h, x, i, s = H, MOE["num_experts"], MOE["moe_intermediate_size"], MOE["shared_expert_intermediate_size"]
    specs = {prefix + "mlp.gate.weight": (x, h), prefix + "mlp.shared_expert.gate_proj.weight": (s, h),
             prefix + "mlp.shared_expert.up_proj.weight": (s, h), prefix + "mlp.shared_expert.down_proj.weight": (h, s),
             prefix + "mlp.shared_expert_gate.weight": (1, h)}
    if fused:
        specs[prefix + "mlp.experts.gate_up_proj"] = (x, 2 * i, h)
        specs[prefix + "mlp.experts.down_proj"] = (x, h, i)
    else:
        for e in range(x):
            specs[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = (i, h)
            specs[f"{prefix}mlp.experts.{e}.up_proj.weight"] = (i, h)
            specs[f"{prefix}mlp.experts.{e}.down_proj.weight"] = (h, i)
    return specs


def mtp_tensor_specs(cfg: dict, kind: str = "qwen3_5") -> dict[str, tuple[int, ...]]:
    """MODEL_SPEC §2.5, one MTP layer (always full attention with the doubled q_proj); its MLP dense, or
    for the MoE kinds the sparse block (MTP layer 0 follows the rule of layer index 0) in the kind's layout."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = "mtp.layers.0."
    mlp = (moe_mlp_specs(p, fused=kind == "qwen3_5_moe") if is_moe(kind) else
           {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
    return {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (nq * hd * 2, h),
        p + "self_attn.k_proj.weight": (nkv * hd, h),
        p + "self_attn.v_proj.weight": (nkv * hd, h),
        p + "self_attn.o_proj.weight": (h, nq * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        **mlp,
    }


def make_mtp_tensors(cfg: dict, seed: int, kind: str = "qwen3_5") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: _rand_tensor(n, s, gen).contiguous() for n, s in mtp_tensor_specs(cfg, kind).items()}


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's stacked experts (gate_up_proj [X, 2I, H], down_proj [X, H, I]) as one tensor per expert and
    projection (experts.{x}.gate_proj / up_proj / down_proj.weight), the layout of the Qwen3-Next release."""
    out = {}
    for n, t in tensors.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            i = t.shape[1] // 2
            for x in range(t.shape[0]):
                out[f"{n[:-len('gate_up_proj')]}{x}.gate_proj.weight"] = t[x, :i].contiguous()
                out[f"{n[:-len('gate_up_proj')]}{x}.up_proj.weight"] = t[x, i:].contiguous()
        elif n.endswith("mlp.experts.down_proj"):
            for x in range(t.shape[0]):
                out[f"{n[:-len('down_proj')]}{x}.down_proj.weight"] = t[x].contiguous()
        else:
            out[n] = t
    return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of split_experts (HF's in-memory names, to compare a reloaded model with the files)."""
    out, parts = {}, {}
    for n, t in tensors.items():
        if ".mlp.experts." in n and n.endswith(".weight"):
            head, x, proj = n.rsplit(".", 3)[0], int(n.rsplit(".", 3)[1]), n.rsplit(".", 3)[2]
            parts.setdefault(head, {}).setdefault(proj, {})[x] = t
        else:
            out[n] = t
    for head, by in parts.items():
        n = len(by["down_proj"])
        out[head + ".gate_up_proj"] = torch.stack([torch.cat([by["gate_proj"][x], by["up_proj"][x]]) for x in range(n)])
        out[head + ".down_proj"] = torch.stack([by["down_proj"][x] for x in range(n)])
    return out


# ---------------------------------------------------------------------------------------------------------
# HF forward helpers
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].float()


def top2_gap(row: torch.Tensor) -> float:
    v = torch.topk(row, 2).values
    return float(v[0] - v[1])


@torch.no_grad()
def greedy_nocache(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    seq, out, gaps = list(ids), [], []
    for _ in range(n):
        row = full_logits(model, seq)[-1]
        tok = int(torch.argmax(row))
        gaps.append(top2_gap(row))
        out.append(tok)
        seq.append(tok)
    return out, gaps


@torch.no_grad()
def greedy_generate(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    x = torch.tensor([ids], dtype=torch.long)
    res = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        num_beams=1,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = res.sequences[0, len(ids):].tolist()
    step_logits = torch.stack([lg[0].float() for lg in res.logits])  # [n, V] raw logits per step
    return new, step_logits


class GdnProbe:
    """Monkeypatches the module-level torch_chunk_gated_delta_rule of a modeling module to record the log-decays g
    and, with `segment` set, to ablate the recurrent-state carry: the sequence is cut into independent segments of
    `segment` tokens, each starting from a zero state (segment=1: every token sees S=0)."""

    def __init__(self, mod, segment: int | None = None, recurrent: bool = False):
        self.mod, self.segment, self.recurrent, self.g = mod, segment, recurrent, []

    def __enter__(self):
        self.orig = self.mod.torch_chunk_gated_delta_rule
        orig, seg = self.orig, self.segment
        rec = self.mod.torch_recurrent_gated_delta_rule

        def patched(query, key, value, g, beta, **kw):
            self.g.append(g.detach().clone())
            if self.recurrent:  # HF's token-by-token reference instead of the chunked (WY) form
                kw.pop("chunk_size", None)
                return rec(query, key, value, g=g, beta=beta, **kw)
            if seg is None:
                return orig(query, key, value, g=g, beta=beta, **kw)
            outs = []
            for t in range(0, query.shape[1], seg):
                sl = slice(t, t + seg)
                kw1 = dict(kw, initial_state=None, output_final_state=False)
                o, _ = orig(query[:, sl], key[:, sl], value[:, sl], g=g[:, sl], beta=beta[:, sl], **kw1)
                outs.append(o)
            return torch.cat(outs, dim=1), None

        self.mod.torch_chunk_gated_delta_rule = patched
        return self

    def __exit__(self, *exc):
        self.mod.torch_chunk_gated_delta_rule = self.orig


def recurrence_stats(model, mod, ids: list[int]) -> dict:
    """How much the GDN recurrent state matters on prompt `ids` (no cache, chunked path)."""
    with GdnProbe(mod) as probe:
        base = full_logits(model, ids)
    with GdnProbe(mod, segment=1):
        abl1 = full_logits(model, ids)
    with GdnProbe(mod, segment=CHUNK):
        abl64 = full_logits(model, ids)
    with GdnProbe(mod, recurrent=True):
        seq_ref = full_logits(model, ids)
    decays = torch.cat([g.exp().flatten() for g in probe.g])
    per_layer = [[round(float(v), 4) for v in g.exp()[0].mean(0)] for g in probe.g]
    tail = slice(CHUNK, len(ids))
    return {
        "prompt_len": len(ids),
        "chunked_vs_token_by_token_gdn_logits_max_abs_diff": float((base - seq_ref).abs().max()),
        "decay_exp_g_mean": round(float(decays.mean()), 4),
        "decay_exp_g_median": round(float(decays.median()), 4),
        "decay_exp_g_frac_above_0.5": round(float((decays > 0.5).float().mean()), 4),
        "decay_exp_g_frac_above_0.9": round(float((decays > 0.9).float().mean()), 4),
        "decay_exp_g_mean_per_layer_per_head": per_layer,
        "logits_rel_change_when_gdn_state_zeroed_every_token": round(float((base - abl1).norm() / base.norm()), 4),
        "argmax_changed_frac_when_state_zeroed_every_token": round(
            float((base.argmax(-1) != abl1.argmax(-1)).float().mean()), 4),
        "last_chunk_logits_rel_change_when_state_not_carried_across_chunk_boundary": round(
            float((base[tail] - abl64[tail]).norm() / base[tail].norm()), 4),
    }


# ---------------------------------------------------------------------------------------------------------
# Config builders
# ---------------------------------------------------------------------------------------------------------
def qwen3_5_text_config(moe: bool = False) -> Qwen3_5TextConfig | Qwen3_5MoeTextConfig:
    """Qwen3.5, or with `moe` Qwen3.5-MoE (every layer sparse: no dense width)."""
    geometry = dict({k: v for k, v in GEOMETRY.items() if k != "intermediate_size"}, **MOE) if moe else GEOMETRY
    return (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(
        **geometry,
        layer_types=list(LAYER_TYPES),
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=ROPE_THETA,
            partial_rotary_factor=PARTIAL_ROTARY_FACTOR,
            mrope_section=list(MROPE_SECTION),
            mrope_interleaved=True,
        ),
        eos_token_id=EOS_ID,
        attn_implementation="eager",
    )


def qwen3_next_config(moe: bool = False) -> Qwen3NextConfig:
    # Qwen3NextDecoderLayer: MoE iff layer not in mlp_only_layers and num_experts > 0 and (i+1) % step == 0
    experts = dict(MOE, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=list(NEXT_MOE_DENSE_LAYERS))
    return Qwen3NextConfig(
        **GEOMETRY,
        layer_types=list(LAYER_TYPES),
        tie_word_embeddings=True,
        **(experts if moe else dict(num_experts=0)),
        rope_parameters=dict(rope_type="default", rope_theta=ROPE_THETA, partial_rotary_factor=PARTIAL_ROTARY_FACTOR),
        eos_token_id=EOS_ID,
        attn_implementation="eager",
    )


_DROP_KEYS = {"transformers_version", "architectures", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
              "is_encoder_decoder", "id2label", "label2id", "problem_type", "_name_or_path", "output_attentions",
              "dtype", "torch_dtype", "output_router_logits", "router_aux_loss_coef"}


def _clean(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in _DROP_KEYS}


def qwen3_5_release_config(text_cfg: Qwen3_5TextConfig | Qwen3_5MoeTextConfig, moe: bool = False) -> dict:
    """Released Qwen3.5 (or Qwen3.5-MoE) layout: VLM wrapper, text fields nested under text_config."""
    t = _clean(text_cfg.to_dict())
    t.update(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        dtype="float32",
        # the release also carries these (HF's Qwen3_5TextConfig has no such fields; they pass through as extras)
        partial_rotary_factor=PARTIAL_ROTARY_FACTOR,
        attn_output_gate=True,
        output_gate_type="swish",
        mamba_ssm_dtype="float32",
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        full_attention_interval=2,
    )
    # tiny vision config (describes a ViT whose model.visual.* tensors are NOT shipped: text-only fixture)
    vis = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H)
    top = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=t, vision_config=vis,
                                                       tie_word_embeddings=False).to_dict()
    top = _clean(top)
    top["vision_config"] = _clean(top["vision_config"])
    top["text_config"] = dict(sorted(t.items()))  # exactly what we built (HF re-serialization drops nothing)
    top.update(architectures=["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
               model_type="qwen3_5_moe" if moe else "qwen3_5", dtype="float32",
               tie_word_embeddings=False, transformers_version=transformers.__version__)
    return dict(sorted(top.items()))


def qwen3_next_release_config(cfg: Qwen3NextConfig) -> dict:
    """Flat Qwen3-Next layout in the style of the release: top-level rope_theta/partial_rotary_factor,
    rope_scaling null, full_attention_interval (no layer_types), plus num_nextn_predict_layers."""
    d = _clean(cfg.to_dict())
    d.pop("rope_parameters")
    d.pop("layer_types")
    d.update(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        dtype="float32",
        rope_theta=ROPE_THETA,
        partial_rotary_factor=PARTIAL_ROTARY_FACTOR,
        rope_scaling=None,
        full_attention_interval=2,
        num_nextn_predict_layers=1,
        transformers_version=transformers.__version__,
    )
    return dict(sorted(d.items()))


# ---------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def check_mrope_equals_plain_rope(model) -> float:
    """Qwen3_5TextRotaryEmbedding with mrope_section (interleaved) vs plain 1-D RoPE, text positions."""
    rot = model.model.rotary_emb
    T = 100
    pos = torch.arange(T)
    x = torch.zeros(1, T, H)
    cos, sin = rot(x, pos.view(1, 1, T).expand(3, 1, T))
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float) / ROTARY_DIM))
    f = pos[:, None].float() * inv
    emb = torch.cat([f, f], -1)
    assert cos.shape[-1] == ROTARY_DIM, cos.shape
    err = max(float((cos[0] - emb.cos()).abs().max()), float((sin[0] - emb.sin()).abs().max()))
    assert err == 0.0, f"mrope != plain rope: {err}"
    return err


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@torch.no_grad()
def reload_check(kind: str, out_dir: Path, model, written: dict[str, torch.Tensor], prompts, logits) -> dict:
    """Reload the written dir with transformers and check it reproduces the logits bit-for-bit."""
    info: dict = {}
    cls = {"qwen3_5": Qwen3_5ForCausalLM, "qwen3_5_moe": Qwen3_5MoeForCausalLM}.get(kind, Qwen3NextForCausalLM)
    nested = kind.startswith("qwen3_5")
    # 1) straight from the written directory (HF maps model.language_model. -> model. for qwen3_5_text)
    m2, load_info = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                        output_loading_info=True)
    m2.eval()
    info["direct_from_pretrained_class"] = type(m2).__name__
    info["direct_missing_keys"] = sorted(load_info.get("missing_keys", []))
    info["direct_unexpected_keys"] = sorted(load_info.get("unexpected_keys", []))
    info["direct_mismatched_keys"] = [str(x) for x in load_info.get("mismatched_keys", [])]
    assert not info["direct_missing_keys"], info["direct_missing_keys"]
    assert not info["direct_mismatched_keys"], info["direct_mismatched_keys"]
    # every loaded tensor equals the written one
    prefix_map = ("model.", "model.language_model.") if nested else ("model.", "model.")
    sd2 = m2.state_dict()
    written = fuse_experts(written)  # HF holds the experts stacked
    for n, t in sd2.items():
        src = n
        if n.startswith(prefix_map[0]):
            src = prefix_map[1] + n[len(prefix_map[0]):]
        if n == "lm_head.weight" and "lm_head.weight" not in written:  # tied
            src = prefix_map[1] + "embed_tokens.weight"
        assert torch.equal(t, written[src]), f"reloaded {n} != written {src}"
    info["direct_all_loaded_tensors_equal_written"] = True
    if not nested:
        assert m2.lm_head.weight.data_ptr() == m2.model.embed_tokens.weight.data_ptr(), "tie lost on reload"
    # config sanity: the reloaded HF config means the same thing
    c2 = m2.config
    assert list(c2.layer_types) == LAYER_TYPES, c2.layer_types
    assert float(c2.rope_parameters["rope_theta"]) == ROPE_THETA, c2.rope_parameters
    assert float(c2.rope_parameters["partial_rotary_factor"]) == PARTIAL_ROTARY_FACTOR, c2.rope_parameters
    info["reloaded_config_class"] = type(c2).__name__
    info["reloaded_rope_parameters"] = dict(c2.rope_parameters)
    diffs = [max_abs(full_logits(m2, p), lg) for p, lg in zip(prompts, logits)]
    info["direct_reload_logits_max_abs_diff"] = max(diffs)
    assert max(diffs) == 0.0, diffs

    # 2) via a temp dir in HF's own layout (save_pretrained of the in-memory model), compare names + logits
    with tempfile.TemporaryDirectory() as td:
        model.save_pretrained(td, safe_serialization=True)
        names = set()
        for f in sorted(Path(td).glob("*.safetensors")):
            with safetensors.safe_open(str(f), "pt") as fh:
                names |= set(fh.keys())
        ours = {n for n in written if not n.startswith("mtp.")}
        if nested:
            ours = {("model." + n[len("model.language_model."):]) if n.startswith("model.language_model.") else n
                    for n in ours}
        info["hf_save_pretrained_names_equal_ours_modulo_prefix"] = names == ours
        if names != ours:
            info["hf_only"] = sorted(names - ours)
            info["ours_only"] = sorted(ours - names)
        info["hf_save_pretrained_config_keys"] = sorted(json.loads((Path(td) / "config.json").read_text()).keys())
        m3 = cls.from_pretrained(td, dtype=torch.float32, attn_implementation="eager").eval()
        reference = model.state_dict()
        assert all(torch.equal(t, reference[n]) for n, t in m3.state_dict().items()), "HF-layout reload changed a tensor"
        diffs3 = [max_abs(full_logits(m3, p), lg) for p, lg in zip(prompts, logits)]
        info["hf_layout_reload_logits_max_abs_diff"] = max(diffs3)
        # Equal tensors; a reloaded stacked-expert tensor may have another memory layout, on which torch's
        # matmul rounds differently (seen: 8e-6 on Qwen3-Next MoE), so only the dense kinds must be exact.
        assert max(diffs3) == 0.0 or is_moe(kind) and max(diffs3) < 1e-4, diffs3
    return info



# ---------------------------------------------------------------------------------------------------------
# Independent cross-check: MODEL_SPEC §2-3 math in numpy float64, reading only the WRITTEN files
# ---------------------------------------------------------------------------------------------------------
def spec_reference_logits(out_dir: Path, ids: list[int]) -> np.ndarray:
    """Forward per /work/shared/design/MODEL_SPEC.md §3 (sequential GDN recurrence, float64), from config.json +
    model.safetensors only (no transformers). Validates that the files mean what the spec says."""
    cfg = json.loads((out_dir / "config.json").read_text())
    c = cfg.get("text_config", cfg)
    prefix = "model.language_model." if "text_config" in cfg else "model."
    W = {k: v.astype(np.float64) for k, v in safetensors.numpy.load_file(str(out_dir / "model.safetensors")).items()}
    Hh, eps = c["hidden_size"], c["rms_norm_eps"]
    nq, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    Hk, Hv, dk, dv, Kc = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                          c["linear_value_head_dim"], c["linear_conv_kernel_dim"])
    r = Hv // Hk
    rp = c.get("rope_parameters") or {}
    theta = rp.get("rope_theta", c.get("rope_theta"))
    prf = rp.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    R = int(hd * prf)
    lt = c.get("layer_types") or ["full_attention" if (i + 1) % c["full_attention_interval"] == 0 else
                                  "linear_attention" for i in range(c["num_hidden_layers"])]
    T = len(ids)

    def rms_zc(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    def softplus(x):
        return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))

    def attn(x, p):
        qg = (x @ W[p + "q_proj.weight"].T).reshape(T, nq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nq * hd)
        k = (x @ W[p + "k_proj.weight"].T).reshape(T, nkv, hd)
        v = (x @ W[p + "v_proj.weight"].T).reshape(T, nkv, hd)
        q, k = rms_zc(q, W[p + "q_norm.weight"]), rms_zc(k, W[p + "k_norm.weight"])
        inv = theta ** (-np.arange(0, R, 2, dtype=np.float64) / R)
        ang = np.arange(T)[:, None] * inv[None]
        cos, sin = np.concatenate([np.cos(ang)] * 2, -1)[:, None], np.concatenate([np.sin(ang)] * 2, -1)[:, None]

        def rope(x):
            x1, x2 = x[..., :R // 2], x[..., R // 2:R]
            return np.concatenate([x[..., :R] * cos + np.concatenate([-x2, x1], -1) * sin, x[..., R:]], -1)

        q, k = rope(q), rope(k)
        o = np.zeros((T, nq, hd))
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for h in range(nq):
            kv = h // (nq // nkv)
            s = q[:, h] @ k[:, kv].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        return (o.reshape(T, nq * hd) * sigmoid(gate)) @ W[p + "o_proj.weight"].T

    def mlp(x, p):
        if p + "gate_proj.weight" in W:  # dense SwiGLU
            return (silu(x @ W[p + "gate_proj.weight"].T) * (x @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T
        # sparse MoE (MODEL_SPEC §3.4): softmax router, top-k, optional renormalisation, shared expert
        if p + "experts.gate_up_proj" in W:
            gate_up, down = W[p + "experts.gate_up_proj"], W[p + "experts.down_proj"]
        else:
            n = W[p + "gate.weight"].shape[0]
            gate_up = np.stack([np.concatenate([W[f"{p}experts.{e}.gate_proj.weight"], W[f"{p}experts.{e}.up_proj.weight"]])
                                for e in range(n)])
            down = np.stack([W[f"{p}experts.{e}.down_proj.weight"] for e in range(n)])
        inter = gate_up.shape[1] // 2
        logits = x @ W[p + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(T):
            top = np.argsort(-probs[t], kind="stable")[:c["num_experts_per_tok"]]
            w = probs[t, top] / (probs[t, top].sum() if c.get("norm_topk_prob", True) else 1.0)
            for e, we in zip(top, w):
                hg, hu = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
                out[t] += we * (down[e] @ (silu(hg) * hu))
        shared = (silu(x @ W[p + "shared_expert.gate_proj.weight"].T) * (x @ W[p + "shared_expert.up_proj.weight"].T)) \
            @ W[p + "shared_expert.down_proj.weight"].T
        return out + sigmoid(x @ W[p + "shared_expert_gate.weight"].T) * shared

    def gdn(x, p):
        if p + "in_proj_qkv.weight" in W:  # Qwen3.5 split layout
            mixed = x @ W[p + "in_proj_qkv.weight"].T
            z = (x @ W[p + "in_proj_z.weight"].T).reshape(T, Hv, dv)
            b, a = x @ W[p + "in_proj_b.weight"].T, x @ W[p + "in_proj_a.weight"].T
        else:  # Qwen3-Next fused, interleaved by key-head group (MODEL_SPEC §2.4)
            qkvz = (x @ W[p + "in_proj_qkvz.weight"].T).reshape(T, Hk, 2 * dk + 2 * r * dv)
            ba = (x @ W[p + "in_proj_ba.weight"].T).reshape(T, Hk, 2 * r)
            qq, kk = qkvz[..., :dk], qkvz[..., dk:2 * dk]
            vv, zz = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
            mixed = np.concatenate([qq.reshape(T, -1), kk.reshape(T, -1), vv.reshape(T, -1)], -1)
            z = zz.reshape(T, Hv, dv)
            b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
        w = W[p + "conv1d.weight"][:, 0, :]  # [conv_dim, Kc]
        u = np.concatenate([np.zeros((Kc - 1, mixed.shape[1])), mixed], 0)
        y = silu(sum(w[:, i][None] * u[i:i + T] for i in range(Kc)))
        q = y[:, :Hk * dk].reshape(T, Hk, dk)
        k = y[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
        v = y[:, 2 * Hk * dk:].reshape(T, Hv, dv)
        beta = sigmoid(b)
        g = -np.exp(W[p + "A_log"]) * softplus(a + W[p + "dt_bias"])
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        S = np.zeros((Hv, dk, dv))
        o = np.zeros((T, Hv, dv))
        for t in range(T):
            S = S * np.exp(g[t])[:, None, None]
            uu = v[t] - np.einsum("hkv,hk->hv", S, k[t])
            S = S + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * uu)
            o[t] = np.einsum("hkv,hk->hv", S, q[t])
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * W[p + "norm.weight"] * silu(z)
        return o.reshape(T, Hv * dv) @ W[p + "out_proj.weight"].T

    x = W[prefix + "embed_tokens.weight"][np.asarray(ids)]
    for i, kind in enumerate(lt):
        p = f"{prefix}layers.{i}."
        hn = rms_zc(x, W[p + "input_layernorm.weight"])
        x = x + (attn(hn, p + "self_attn.") if kind == "full_attention" else gdn(hn, p + "linear_attn."))
        hn = rms_zc(x, W[p + "post_attention_layernorm.weight"])
        x = x + mlp(hn, p + "mlp.")
    x = rms_zc(x, W[prefix + "norm.weight"])
    lm = W.get("lm_head.weight", W[prefix + "embed_tokens.weight"])
    return x @ lm.T

# ---------------------------------------------------------------------------------------------------------
# Build one fixture
# ---------------------------------------------------------------------------------------------------------
def build_model(kind: str, seed: int):
    torch.manual_seed(seed)  # HF's own __init__ draws randomness; we overwrite every parameter anyway
    if kind == "qwen3_5":
        cfg = qwen3_5_text_config()
        model = Qwen3_5ForCausalLM(cfg)
        mod = modeling_qwen3_5
    elif kind == "qwen3_5_moe":
        cfg = qwen3_5_text_config(moe=True)
        model = Qwen3_5MoeForCausalLM(cfg)
        mod = modeling_qwen3_5_moe
    else:
        cfg = qwen3_next_config(moe=is_moe(kind))
        model = Qwen3NextForCausalLM(cfg)
        mod = modeling_qwen3_next
    model = model.to(torch.float32).eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    randomize(model, seed)
    return cfg, model, mod


def try_seed(kind: str, seed: int):
    cfg, model, mod = build_model(kind, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    prompts = [torch.randint(0, PROMPT_VOCAB_HI, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    with RouterProbe(model) as router:
        logits = [full_logits(model, p) for p in prompts]
    greedy, greedy_nc, gaps, gen_vs_nc = {}, {}, {}, {}
    ok, why = True, []
    for i in GREEDY_PROMPTS:
        g_cache, step_logits = greedy_generate(model, prompts[i], MAX_NEW_TOKENS)
        g_nc, gp = greedy_nocache(model, prompts[i], MAX_NEW_TOKENS)
        greedy[i], greedy_nc[i], gaps[i] = g_cache, g_nc, gp
        # cached-decode step logits vs the no-cache full forward logits at the same positions
        seq = prompts[i] + g_nc
        nc_rows = full_logits(model, seq)[len(prompts[i]) - 1: len(seq) - 1]
        gen_vs_nc[i] = max_abs(step_logits, nc_rows) if g_cache == g_nc else None
        if len(g_cache) != MAX_NEW_TOKENS:
            ok = False; why.append(f"prompt {i}: generate returned {len(g_cache)} tokens")
        if EOS_ID in g_nc or EXTRA_EOS_ID in g_nc:
            ok = False; why.append(f"prompt {i}: eos id in greedy output")
        if len(set(g_nc)) < MIN_DISTINCT_GREEDY:
            ok = False; why.append(f"prompt {i}: degenerate greedy output {g_nc}")
        if min(gp) <= MIN_GAP:
            ok = False; why.append(f"prompt {i}: min top-2 gap {min(gp):.2e}")
    if router.min_gap is not None and router.min_gap < ROUTER_MIN_GAP:
        ok = False; why.append(f"router top-k gap {router.min_gap:.1e}")
    rec = recurrence_stats(model, mod, prompts[2])
    if (rec["logits_rel_change_when_gdn_state_zeroed_every_token"] < MIN_RECURRENCE_EFFECT
            or rec["last_chunk_logits_rel_change_when_state_not_carried_across_chunk_boundary"] < MIN_RECURRENCE_EFFECT):
        ok = False; why.append(f"recurrence too weak: {rec}")
    return ok, why, dict(cfg=cfg, model=model, mod=mod, prompts=prompts, logits=logits, greedy=greedy,
                         greedy_nc=greedy_nc, gaps=gaps, gen_vs_nc=gen_vs_nc, rec=rec, router_gap=router.min_gap)


class RouterProbe:
    """Records the smallest gap between the k-th and (k+1)-th router probability over every MoE layer and
    token of the forwards run inside it (None: no MoE layer ran)."""

    def __init__(self, model):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.min_gap, self.hooks = None, []

    def record(self, module, inputs, output):
        probs = torch.softmax(output[0].double(), dim=-1).sort(dim=-1, descending=True).values
        gap = float((probs[:, module.top_k - 1] - probs[:, module.top_k]).min())
        self.min_gap = gap if self.min_gap is None else min(self.min_gap, gap)

    def __enter__(self):
        self.hooks = [r.register_forward_hook(self.record) for r in self.routers]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def build_fixture(kind: str, base_seed: int) -> dict:
    log(f"\n=== {kind}: searching seeds from {base_seed} ===")
    for attempt in range(MAX_ATTEMPTS):
        seed = base_seed + attempt
        ok, why, r = try_seed(kind, seed)
        log(f"  seed {seed}: {'OK' if ok else 'rejected: ' + '; '.join(why)}")
        if ok:
            break
    else:
        raise SystemExit(f"{kind}: no acceptable seed in {MAX_ATTEMPTS} attempts")

    cfg, model, mod, prompts, logits = r["cfg"], r["model"], r["mod"], r["prompts"], r["logits"]
    out_dir = OUT_ROOT / kind
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    # ---- tensors -------------------------------------------------------------------------------------
    sd = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}
    written: dict[str, torch.Tensor] = {}
    if kind == "qwen3_next_moe":
        sd = split_experts(sd)  # one tensor per expert, as the Qwen3-Next release stores them
    for n, t in sd.items():
        if kind.startswith("qwen3_5"):
            name = ("model.language_model." + n[len("model."):]) if n.startswith("model.") else n
        else:
            name = n
        written[name] = t
    if cfg.tie_word_embeddings:
        del written["lm_head.weight"]  # absent from tied checkpoints; use embed_tokens
    mtp = make_mtp_tensors(GEOMETRY, seed + 100_000, kind)
    written.update(mtp)
    for n, t in written.items():
        assert t.dtype == torch.float32, (n, t.dtype)
    written = dict(sorted(written.items()))
    safetensors.torch.save_file(written, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)

    # ---- config / generation config -------------------------------------------------------------------
    if kind.startswith("qwen3_5"):
        cfg_json = qwen3_5_release_config(cfg, moe=is_moe(kind))
        gen_eos = [EOS_ID, EXTRA_EOS_ID]
    else:
        cfg_json = qwen3_next_release_config(cfg)
        gen_eos = EOS_ID
    (out_dir / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    gcfg = {"do_sample": False, "eos_token_id": gen_eos, "transformers_version": transformers.__version__}
    GenerationConfig(**{k: v for k, v in gcfg.items() if k != "transformers_version"})  # validates
    (out_dir / "generation_config.json").write_text(json.dumps(gcfg, indent=2) + "\n")

    # ---- checks ---------------------------------------------------------------------------------------
    mrope_err = check_mrope_equals_plain_rope(model) if kind.startswith("qwen3_5") else None
    reload_info = reload_check(kind, out_dir, model, written, prompts, logits)
    log(f"  reload: {json.dumps({k: v for k, v in reload_info.items() if 'keys' not in k or v}, default=str)}")

    spec_diffs = [float(np.abs(spec_reference_logits(out_dir, p) - lg.double().numpy()).max())
                  for p, lg in zip(prompts, logits)]
    log(f"  MODEL_SPEC numpy float64 reference vs HF float32 logits, max abs diff per prompt: {spec_diffs}")
    assert max(spec_diffs) < 1e-3, spec_diffs

    # ---- expected outputs -----------------------------------------------------------------------------
    arrays = {}
    for i, (p, lg) in enumerate(zip(prompts, logits)):
        arrays[f"prompt_{i}"] = np.asarray(p, dtype=np.int32)
        arrays[f"logits_{i}"] = lg.numpy().astype(np.float32)
    for i in GREEDY_PROMPTS:
        arrays[f"greedy_{i}"] = np.asarray(r["greedy"][i], dtype=np.int32)
    with RouterProbe(model) as router:
        arrays.update(long_prompt_arrays(model, seed))
    if router.min_gap is not None:
        assert router.min_gap >= ROUTER_MIN_GAP, f"long prompt: router top-k gap {router.min_gap:.1e}"
    np.savez(out_dir / "expected.npz", **arrays)

    tf_gaps = [min(top2_gap(row) for row in lg) for lg in logits]
    meta = {
        "fixture": kind,
        "note": (
            "Made by scripts/make_oracle_fixtures.py (run via scripts/make_oracle_fixtures.sh). A tiny random "
            f"checkpoint built with transformers' {type(model).__name__} ({type(cfg).__name__}), every parameter "
            "re-randomized with a seeded torch.Generator (rules in init_scales), all weights rounded to "
            "bfloat16-representable values but stored as float32. Expected outputs are float32, eager attention, "
            "HF torch fallback GDN (torch_chunk_gated_delta_rule for prefill/no-cache forwards, "
            "torch_recurrent_gated_delta_rule for cached single-token decode), CPU, 1 thread, "
            "torch.use_deterministic_algorithms(True). logits_i = teacher-forced logits of ONE forward over "
            "prompt_i with use_cache=False. greedy_i = new tokens of model.generate(do_sample=False, "
            "max_new_tokens=12, use_cache=True, eos never fires). mtp.* tensors are random extras (HF ignores "
            "them; no expected MTP outputs). The written directory was reloaded with transformers and reproduced "
            "the logits exactly."
        ),
        "layout": {
            "qwen3_5": "released Qwen3.5 VLM-wrapper layout: config.json model_type qwen3_5 with text_config "
                       "(model_type qwen3_5_text); tensors model.language_model.*, lm_head.weight top-level, mtp.* "
                       "top-level; vision_config present but NO model.visual.* tensors",
            "qwen3_5_moe": "as qwen3_5 with model_type qwen3_5_moe / qwen3_5_moe_text: a sparse MoE block in every "
                           "layer and in mtp.layers.0, the experts stored fused (mlp.experts.gate_up_proj [X, 2I, H], "
                           "mlp.experts.down_proj [X, H, I])",
            "qwen3_next": "HF flat Qwen3-Next layout: tensors model.* (fused in_proj_qkvz / in_proj_ba), tied embeddings "
                          "so NO lm_head.weight, mtp.* top-level; config.json release-style (top-level rope_theta, "
                          "partial_rotary_factor, rope_scaling null, full_attention_interval=2 and no layer_types), "
                          "num_experts=0 => dense Qwen3NextMLP in every layer",
            "qwen3_next_moe": "as qwen3_next with num_experts=8: a sparse MoE block (norm_topk_prob false) in every "
                              "layer but mlp_only_layers=[2] and in mtp.layers.0, the experts stored one tensor per "
                              "expert (mlp.experts.{x}.gate_proj / up_proj / down_proj.weight)",
        }[kind],
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "seeds": {
            "model_seed": seed,
            "weights_generator_seed": seed,
            "mtp_generator_seed": seed + 100_000,
            "prompt_generator_seed": seed + 7,
            "seeds_rejected_before": seed - base_seed,
        },
        "geometry": {
            **GEOMETRY,
            "layer_types": LAYER_TYPES,
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
            "rotary_dim": ROTARY_DIM,
            "mrope_section": MROPE_SECTION if kind.startswith("qwen3_5") else None,
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "mtp_num_layers": 1,
            "dense_mlp_every_layer": not is_moe(kind),
            **({"moe": dict(MOE, **({"norm_topk_prob": False, "mlp_only_layers": NEXT_MOE_DENSE_LAYERS}
                                   if kind == "qwen3_next_moe" else {}))} if is_moe(kind) else {}),
        },
        "init_scales": {
            "embed_tokens": f"N(0, {EMBED_STD})",
            "lm_head": f"N(0, 4/sqrt(H)) = N(0, {LM_HEAD_STD})" if not cfg.tie_word_embeddings else "tied",
            "linear_weights": "N(0, 1/sqrt(fan_in)); o_proj/down_proj/out_proj (and mtp ones) x "
                              f"{RESIDUAL_OUT_GAIN}",
            "zero_centred_norm_weights": f"N(0, {NORM_STD}) (applied as 1+w)",
            "gdn_gated_norm_weight": f"1 + N(0, {GDN_NORM_STD}) (applied as w)",
            "A_log": f"log(U{A_RANGE})",
            "dt_bias": f"N({DT_BIAS_MEAN}, {DT_BIAS_STD})",
            "conv1d": f"N(0, {CONV_STD})",
            "rounding": "every tensor rounded to bfloat16-representable values, stored float32",
        },
        "eos_token_id_generation_config": gen_eos,
        "eos_check": "eos ids 254/255 appear in no prompt and in no expected greedy output",
        "prompt_lens": PROMPT_LENS,
        "long_prompt": {"len": LONG_PROMPT_LEN, "logits_every": LONG_EVERY, "generator_seed": seed + 13,
                        "note": "long_logits = the one-forward logits at long_positions; long_greedy as greedy_i"},
        "greedy_prompts": GREEDY_PROMPTS,
        "max_new_tokens": MAX_NEW_TOKENS,
        "greedy_cache_equals_nocache_argmax_loop": {str(i): r["greedy"][i] == r["greedy_nc"][i] for i in GREEDY_PROMPTS},
        "greedy_nocache_tokens": {str(i): r["greedy_nc"][i] for i in GREEDY_PROMPTS},
        "cached_decode_step_logits_vs_nocache_max_abs_diff": {str(i): r["gen_vs_nc"][i] for i in GREEDY_PROMPTS},
        "greedy_top2_gap_min": min(min(g) for g in r["gaps"].values()),
        "greedy_top2_gap_min_per_prompt": {str(i): min(g) for i, g in r["gaps"].items()},
        "greedy_top2_gaps": {str(i): [round(x, 5) for x in g] for i, g in r["gaps"].items()},
        "teacher_forced_top2_gap_min_per_prompt": {str(i): g for i, g in enumerate(tf_gaps)},
        "teacher_forced_argmax_equals_input_token_frac": round(float(np.mean(np.concatenate(
            [(lg.argmax(-1).numpy() == np.asarray(p)) for p, lg in zip(prompts, logits)]))), 4),
        "logits_std_per_prompt": {str(i): round(float(lg.std()), 4) for i, lg in enumerate(logits)},
        "recurrence": r["rec"],
        **({"router_top_k_gap_min": r["router_gap"]} if is_moe(kind) else {}),
        "mrope_vs_plain_rope_max_abs_diff": mrope_err,
        "model_spec_numpy_float64_reference_vs_logits_max_abs_diff": spec_diffs,
        "reload": reload_info,
        "tensors": {n: list(t.shape) for n, t in written.items()},
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    log(f"  greedy: {r['greedy']}  (no-cache loop agrees: {meta['greedy_cache_equals_nocache_argmax_loop']})")
    log(f"  min greedy top-2 gap {meta['greedy_top2_gap_min']:.4f}; recurrence "
        f"{json.dumps({k: v for k, v in r['rec'].items() if 'per_layer' not in k})}")
    for f in sorted(out_dir.iterdir()):
        log(f"  wrote {f.relative_to(REPO)} ({f.stat().st_size} bytes)")
    return meta


@torch.no_grad()
def long_prompt_arrays(model, seed: int) -> dict:
    """long_prompt (LONG_PROMPT_LEN ids), long_positions, long_logits (the teacher-forced logits there, one
    forward) and long_greedy (MAX_NEW_TOKENS new tokens, cached generate)."""
    gen = torch.Generator().manual_seed(seed + 13)
    ids = torch.randint(0, PROMPT_VOCAB_HI, (LONG_PROMPT_LEN,), generator=gen).tolist()
    logits = full_logits(model, ids)
    positions = sorted(set(range(0, LONG_PROMPT_LEN, LONG_EVERY)) | set(range(LONG_PROMPT_LEN - 4, LONG_PROMPT_LEN)))
    greedy, _ = greedy_generate(model, ids, MAX_NEW_TOKENS)
    assert EOS_ID not in greedy and EXTRA_EOS_ID not in greedy, greedy
    log(f"  long prompt: {LONG_PROMPT_LEN} tokens, greedy {greedy}")
    return {"long_prompt": np.asarray(ids, np.int32), "long_positions": np.asarray(positions, np.int32),
            "long_logits": logits[positions].numpy().astype(np.float32), "long_greedy": np.asarray(greedy, np.int32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=KINDS, help="build one fixture only")
    args = ap.parse_args()

    for pkg in ("fla", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            raise SystemExit(f"{pkg} is importable: the oracle must use HF's torch fallback paths; use a clean venv")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    transformers.logging.set_verbosity_error()
    log(f"python {platform.python_version()}  torch {torch.__version__}  transformers {transformers.__version__}")

    for kind, base_seed in zip(KINDS, (1000, 2000, 3000, 4000)):
        if args.only in (None, kind):
            build_fixture(kind, base_seed)
    log("\ndone")


if __name__ == "__main__":
    main()
