"""Model configuration read from a Hugging Face `config.json`, validated once at load.

Layouts (MODEL_SPEC §1.1): Qwen3.5 (`qwen3_5`: fields under `text_config`, weights under
`model.language_model.`; the text-only `qwen3_5_text` is flat with `model.`) and Qwen3-Next
(`qwen3_next`: flat, `model.`, fused GDN projections). Everything the engine cannot run (MoE, unknown
layer kinds, rope scaling, ...) raises `ConfigError` naming the field and value, before any jit.
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
class ModelConfig:
    """The text decoder's geometry. Axis letters as in ARCHITECTURE.md (E, F, V, Hq, Hkv, D, ...)."""

    model_type: str  # "qwen3_5" or "qwen3_next" (the math family)
    weight_prefix: str  # "model.language_model." or "model."
    gdn_fused_projections: bool  # Qwen3-Next in_proj_qkvz / in_proj_ba (permuted at load)
    hidden_size: int  # E
    intermediate_size: int  # F
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
            "eos_token_id", "pad_token_id"}
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
    if model_type == "qwen3_5":
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"{source}: model_type='qwen3_5' needs a text_config object")
        text = dict(raw["text_config"])
        # The multimodal wrapper keeps some text fields at its top level.
        for field in ("tie_word_embeddings", "quantization_config", "eos_token_id", "bos_token_id"):
            if text.get(field) is None and raw.get(field) is not None:
                text[field] = raw[field]
        return _text_config(text, source, "text_config.", family="qwen3_5", prefix="model.language_model.")
    if model_type in ("qwen3_5_text", "qwen3_next"):
        return _text_config(raw, source, "", family=model_type.removesuffix("_text"), prefix="model.")
    raise ConfigError(
        f"{source}: model_type={model_type!r} is not supported "
        "(qmtp runs 'qwen3_5', 'qwen3_5_text' and 'qwen3_next' dense models)")


def _text_config(raw: dict, source: str, where: str, family: str, prefix: str) -> ModelConfig:
    f = _Fields(raw, source, where)
    n_layers = f.req("num_hidden_layers", int)
    layer_types = _layer_types(f, n_layers)
    _refuse_moe(f, layer_types)
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

    eos = raw.get("eos_token_id")
    return ModelConfig(
        model_type=family,
        weight_prefix=prefix,
        gdn_fused_projections=(family == "qwen3_next"),
        hidden_size=f.req("hidden_size", int),
        intermediate_size=f.req("intermediate_size", int),
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


def _refuse_moe(f: _Fields, layer_types: tuple[str, ...]) -> None:
    """Dense models only: a layer is MoE iff it is not in mlp_only_layers, num_experts > 0 and
    (i+1) % decoder_sparse_step == 0 (MODEL_SPEC §1.2)."""
    if f.opt("num_experts", int, 0) == 0:
        return
    step = f.opt("decoder_sparse_step", int, 1)
    dense_only = set(f.opt("mlp_only_layers", list, []))
    moe = [i for i in range(len(layer_types)) if i not in dense_only and (i + 1) % step == 0]
    if moe:
        raise f.fail("num_experts", f"mixture-of-experts layers are not supported (MoE layers: {moe[:8]}"
                     f"{'...' if len(moe) > 8 else ''}); qmtp runs dense models")


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
