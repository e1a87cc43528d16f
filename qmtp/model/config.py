"""Model configuration read from a Hugging Face `config.json`, validated once at load.

Layouts (MODEL_SPEC §1.1): Qwen3.5 (`qwen3_5`, `qwen3_5_moe`: fields under `text_config`, weights
under `model.language_model.`; the text-only `qwen3_5_text`, `qwen3_5_moe_text` are flat with
`model.`) and Qwen3-Next (`qwen3_next`: flat, `model.`, fused GDN projections), dense or
mixture-of-experts (`MoeConfig`). Everything the engine cannot run (unknown layer kinds, rope
scaling, MoE routing of other families, ...) raises `ConfigError` naming the field and value, before
any jit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"
FP8_BLOCK = 128  # the only FP8 block size the engine runs (weight_block_size [128, 128])


class ConfigError(ValueError):
    """A config.json the engine cannot run; the message names the file, field and value."""


@dataclasses.dataclass(frozen=True)
class Fp8Quantization:
    """`quantization_config` of an FP8 block checkpoint (MODEL_SPEC §5.1)."""

    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    modules_to_not_convert: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse MoE MLP (MODEL_SPEC §1.2, qmtp/model/moe.py). Decoder layer i is MoE iff
    i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the MTP layer j by the same rule
    on j (HF numbers the MTP layers from 0); the others keep the dense MLP of intermediate_size."""

    num_experts: int  # X
    top_k: int  # num_experts_per_tok
    expert_size: int  # I: moe_intermediate_size
    shared_size: int  # shared_expert_intermediate_size
    norm_topk_prob: bool  # the top-k weights renormalized to sum 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The text decoder's geometry. Axis letters as in ARCHITECTURE.md (E, F, V, Hq, Hkv, D, ...)."""

    model_type: str  # "qwen3_5" or "qwen3_next" (the math family)
    weight_prefix: str  # "model.language_model." or "model."
    gdn_fused_projections: bool  # Qwen3-Next in_proj_qkvz / in_proj_ba (permuted at load)
    hidden_size: int  # E
    intermediate_size: int  # F (0 when every layer is MoE and the config does not state it)
    vocab_size: int  # V
    layer_types: tuple[str, ...]
    num_attention_heads: int  # Hq
    num_key_value_heads: int  # Hkv
    head_dim: int  # D
    rotary_dim: int  # R = int(D * partial_rotary_factor), NeoX rotate-half on dims [0, R)
    rope_theta: float
    rms_norm_eps: float
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv
    linear_key_head_dim: int  # Dk
    linear_value_head_dim: int  # Dv
    linear_conv_kernel_dim: int  # W
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int | None  # None: not stated in config.json, taken from the tensors
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: Fp8Quantization | None = None
    moe: MoeConfig | None = None

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # C: q | k | v channels
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def num_linear_layers(self) -> int:  # Lg
        return len(self.linear_layer_ids)

    @property
    def num_full_layers(self) -> int:  # La
        return len(self.full_layer_ids)

    @property
    def mtp_layers(self) -> int:
        return self.mtp_num_hidden_layers or 0

    def layer_is_moe(self, layer: int) -> bool:
        """Decoder layer `layer` has the sparse MoE MLP (else the dense SwiGLU)."""
        return self.moe is not None and self.moe.is_moe(layer)

    @staticmethod
    def from_hf(checkpoint_dir: str) -> "ModelConfig":
        """Reads and validates `checkpoint_dir/config.json` (and generation_config.json's eos ids)."""
        path = os.path.join(checkpoint_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: not found (is {checkpoint_dir!r} a Hugging Face checkpoint dir?)")
        cfg = from_dict(_read_json(path), source=path)
        gen = os.path.join(checkpoint_dir, "generation_config.json")
        if os.path.isfile(gen):
            eos = _as_id_tuple(_read_json(gen).get("eos_token_id"), gen, "eos_token_id")
            cfg = dataclasses.replace(cfg, eos_token_ids=eos)
        return cfg


def _read_json(path: str) -> Any:
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _as_id_tuple(value: Any, source: str, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: {field}={value!r} must be an int or a list of ints")
    return tuple(values)


class _Fields:
    """Reads fields of one JSON object with errors that name the file and the field."""

    def __init__(self, raw: dict, source: str, where: str = ""):
        self.raw, self.source, self.where = raw, source, where

    def name(self, field: str) -> str:
        return f"{self.where}{field}"

    def fail(self, field: str, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.name(field)}={self.raw.get(field)!r}: {why}")

    def req(self, field: str, kind: type) -> Any:
        if self.raw.get(field) is None:
            raise ConfigError(f"{self.source}: required field {self.name(field)} is missing")
        return self._typed(field, self.raw[field], kind)

    def opt(self, field: str, kind: type, default: Any) -> Any:
        return default if self.raw.get(field) is None else self._typed(field, self.raw[field], kind)

    def only(self, checks: tuple) -> None:
        """Refuses each (field, default, allowed values, why) whose value is not allowed."""
        for field, default, allowed, why in checks:
            if self.opt(field, type(default), default) not in allowed:
                raise self.fail(field, why)

    def _typed(self, field: str, value: Any, kind: type) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise self.fail(field, f"expected {kind.__name__}")
        if kind is int and value <= 0 and field not in _ZERO_OK:
            raise self.fail(field, "must be positive")
        return value


_ZERO_OK = {"mtp_num_hidden_layers", "num_nextn_predict_layers", "num_experts", "bos_token_id",
            "eos_token_id", "pad_token_id", "intermediate_size"}
# The MoE fields of these families; any other field that names experts or routing (another family's
# MoE: grouped routing, scaling factors, ...) is refused rather than silently ignored.
_MOE_FIELDS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
               "router_aux_loss_coef", "output_router_logits"}  # the last two only matter in training
_MOE_WORDS = ("expert", "moe", "router", "routed", "topk", "top_k", "n_group", "sparse")
_ONLY = (  # what the engine runs, checked before the geometry
    ("hidden_act", "silu", ("silu",), "only 'silu' is supported"),
    ("attn_output_gate", True, (True,), "only gated attention (true) is supported"),
    ("output_gate_type", "swish", ("swish", "silu"), "only 'swish' (SiLU) is supported for the GDN gated norm"),
    ("attention_bias", False, (False,), "attention biases are not supported"),
    ("mamba_ssm_dtype", "float32", ("float32",),  # as the released checkpoints state
     "supported: 'float32' (qmtp keeps the GDN recurrent state in float32)"),
)


def from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    """Validates a parsed config.json (either layout) into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"{source}: model_type={model_type!r} needs a text_config object")
        text = dict(raw["text_config"])
        # The multimodal wrapper keeps some text fields at its top level.
        for field in ("tie_word_embeddings", "quantization_config", "eos_token_id", "bos_token_id"):
            if text.get(field) is None and raw.get(field) is not None:
                text[field] = raw[field]
        return _text_config(text, source, "text_config.", family="qwen3_5", prefix="model.language_model.",
                            moe_family=model_type == "qwen3_5_moe")
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        return _text_config(raw, source, "", family="qwen3_next" if model_type == "qwen3_next" else "qwen3_5",
                            prefix="model.", moe_family=model_type != "qwen3_5_text")
    raise ConfigError(
        f"{source}: model_type={model_type!r} is not supported (qmtp runs 'qwen3_5', 'qwen3_5_text', "
        "'qwen3_5_moe', 'qwen3_5_moe_text' and 'qwen3_next')")


def _text_config(raw: dict, source: str, where: str, family: str, prefix: str, moe_family: bool) -> ModelConfig:
    """moe_family: the model type has MoE fields (Qwen3.5-MoE always MoE; Qwen3-Next MoE iff num_experts > 0)."""
    f = _Fields(raw, source, where)
    n_layers = f.req("num_hidden_layers", int)
    layer_types = _layer_types(f, n_layers)
    moe = _moe(f, always=moe_family and family == "qwen3_5") if moe_family else _no_moe(f)
    f.only(_ONLY)

    head_dim = f.req("head_dim", int)
    theta, partial = _rope(f, head_dim)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise f.fail("partial_rotary_factor", f"gives rotary dim {rotary_dim}; must be even and in (0, {head_dim}]")

    nq, nkv = f.req("num_attention_heads", int), f.req("num_key_value_heads", int)
    if nq % nkv:
        raise f.fail("num_key_value_heads", f"must divide num_attention_heads={nq}")
    hk, hv = f.req("linear_num_key_heads", int), f.req("linear_num_value_heads", int)
    if hv % hk:
        raise f.fail("linear_num_value_heads", f"must be a multiple of linear_num_key_heads={hk}")

    if family == "qwen3_5":
        mtp = f.opt("mtp_num_hidden_layers", int, 0)
        if f.opt("mtp_use_dedicated_embeddings", bool, False):
            raise f.fail("mtp_use_dedicated_embeddings", "dedicated MTP embeddings are not supported")
    else:  # Qwen3-Next releases do not state the MTP layer count; the tensors decide.
        mtp = f.opt("num_nextn_predict_layers", int, None)

    # the dense MLP's width, needed where a target or MTP layer is dense
    dense = [i for i in range(n_layers) if moe is None or not moe.is_moe(i)]
    dense_mtp = mtp and (moe is None or not all(moe.is_moe(j) for j in range(mtp)))
    ffn = f.req("intermediate_size", int) if dense or dense_mtp else f.opt("intermediate_size", int, 0)
    if (dense or dense_mtp) and ffn == 0:
        raise f.fail("intermediate_size", f"must be positive: layers {dense[:8] or ['mtp']} have a dense MLP")

    eos = raw.get("eos_token_id")
    return ModelConfig(
        model_type=family,
        weight_prefix=prefix,
        gdn_fused_projections=(family == "qwen3_next"),
        hidden_size=f.req("hidden_size", int),
        intermediate_size=ffn,
        vocab_size=f.req("vocab_size", int),
        layer_types=layer_types,
        num_attention_heads=nq,
        num_key_value_heads=nkv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        rms_norm_eps=f.opt("rms_norm_eps", float, 1e-6),
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=f.req("linear_key_head_dim", int),
        linear_value_head_dim=f.req("linear_value_head_dim", int),
        linear_conv_kernel_dim=f.req("linear_conv_kernel_dim", int),
        tie_word_embeddings=f.opt("tie_word_embeddings", bool, False),
        mtp_num_hidden_layers=mtp,
        max_position_embeddings=f.opt("max_position_embeddings", int, 262144),
        bos_token_id=f.opt("bos_token_id", int, None),
        eos_token_ids=_as_id_tuple(eos, source, f.name("eos_token_id")),
        quantization=_quantization(f),
        moe=moe,
    )


def _layer_types(f: _Fields, n_layers: int) -> tuple[str, ...]:
    if f.raw.get("layer_types") is not None:
        types = f.raw["layer_types"]
        if not isinstance(types, list) or len(types) != n_layers:
            raise f.fail("layer_types", f"must be a list of num_hidden_layers={n_layers} entries")
        for i, t in enumerate(types):
            if t not in (LINEAR, FULL):
                raise ConfigError(
                    f"{f.source}: {f.name('layer_types')}[{i}]={t!r}: unknown layer type "
                    f"(supported: {LINEAR!r}, {FULL!r})")
        return tuple(types)
    interval = f.opt("full_attention_interval", int, 4)
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


def _moe(f: _Fields, always: bool) -> MoeConfig | None:
    """The MoE fields (MODEL_SPEC §1.2): Qwen3.5-MoE (`always`) has no dense layers and always
    renormalizes the top-k weights; Qwen3-Next is MoE iff num_experts > 0, per decoder_sparse_step and
    mlp_only_layers, renormalizing per norm_topk_prob."""
    _refuse_other_moe_fields(f)
    experts = f.req("num_experts", int) if always else f.opt("num_experts", int, 0)
    if experts == 0:
        if always:
            raise f.fail("num_experts", "a Qwen3.5-MoE model needs num_experts > 0")
        return None
    top_k = f.req("num_experts_per_tok", int)
    if top_k > experts:
        raise f.fail("num_experts_per_tok", f"must be at most num_experts={experts}")
    if always:
        if not f.opt("norm_topk_prob", bool, True):
            raise f.fail("norm_topk_prob", "Qwen3.5-MoE always renormalizes the top-k weights (true)")
        for field in ("decoder_sparse_step", "mlp_only_layers"):  # not Qwen3.5-MoE fields: every layer is MoE
            if f.raw.get(field) not in (None, 1, []):
                raise f.fail(field, "Qwen3.5-MoE has MoE in every layer (1 / [] or absent)")
        step, dense_only = 1, ()
    else:
        step = f.opt("decoder_sparse_step", int, 1)
        dense_only = f.opt("mlp_only_layers", list, [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in dense_only):
            raise f.fail("mlp_only_layers", "expected a list of layer indices")
    return MoeConfig(num_experts=experts, top_k=top_k, expert_size=f.req("moe_intermediate_size", int),
                     shared_size=f.req("shared_expert_intermediate_size", int),
                     norm_topk_prob=True if always else f.opt("norm_topk_prob", bool, True),
                     decoder_sparse_step=step, mlp_only_layers=tuple(sorted(set(dense_only))))


def _no_moe(f: _Fields) -> None:
    """A dense model type (qwen3_5 / qwen3_5_text): MoE fields are a config of another model type."""
    _refuse_other_moe_fields(f)
    if f.opt("num_experts", int, 0):
        raise f.fail("num_experts", "a dense Qwen3.5 model type has no experts (MoE checkpoints are "
                     "model_type 'qwen3_5_moe')")
    return None


def _refuse_other_moe_fields(f: _Fields) -> None:
    for field, value in f.raw.items():
        if (field not in _MOE_FIELDS and value not in (None, False, 0, [], {})
                and any(word in field.lower() for word in _MOE_WORDS)):
            raise f.fail(field, "an MoE setting qmtp does not know (it runs the Qwen3-Next / Qwen3.5-MoE "
                         f"routing: {', '.join(sorted(_MOE_FIELDS))})")


def _rope(f: _Fields, head_dim: int) -> tuple[float, float]:
    """Returns (theta, partial_rotary_factor). Qwen3.5 M-RoPE is plain 1-D RoPE for text (§3.5)."""
    params = f.raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise f.fail("rope_parameters", "expected an object")
        p = _Fields(params, f.source, f.name("rope_parameters."))
        p.only((("rope_type", "default", ("default",), "only 'default' rope is supported (no rope scaling)"),))
        theta = p.req("rope_theta", float)
        partial = p.opt("partial_rotary_factor", float, f.opt("partial_rotary_factor", float, 1.0))
        section = params.get("mrope_section")
        if section is not None and sum(section) * 2 != int(head_dim * partial):
            raise p.fail("mrope_section", f"must sum to rotary_dim/2 = {int(head_dim * partial) // 2}")
    else:
        theta = f.req("rope_theta", float)
        partial = f.opt("partial_rotary_factor", float, 1.0)
    scaling = f.raw.get("rope_scaling")
    if scaling is not None and not (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type"))
                                    in ("default", "mrope") and "factor" not in scaling):
        raise f.fail("rope_scaling", "rope scaling is not supported (only null / default)")
    return theta, partial


def _quantization(f: _Fields) -> Fp8Quantization | None:
    q = f.raw.get("quantization_config")
    if q is None:
        return None
    p = _Fields(q, f.source, f.name("quantization_config."))
    if p.req("quant_method", str) != "fp8":
        raise p.fail("quant_method", "only 'fp8' block quantization is supported")
    p.only((("fmt", "e4m3", ("e4m3",), "only 'e4m3' is supported"),
            ("activation_scheme", "dynamic", ("dynamic",), "only 'dynamic' is supported")))
    if q.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK]:
        raise p.fail("weight_block_size", f"only [{FP8_BLOCK}, {FP8_BLOCK}] blocks are supported")
    return Fp8Quantization(modules_to_not_convert=tuple(p.opt("modules_to_not_convert", list, [])))
