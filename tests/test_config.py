"""ModelConfig.from_hf: both layouts, derived geometry, and one clear error per unsupported field."""

import copy
import json

import pytest

from qmtp.model.config import ConfigError, from_dict, ModelConfig

TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
    "num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1, "rms_norm_eps": 1e-6, "eos_token_id": 5,
}
QWEN35 = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": TEXT}
NEXT = {
    "model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
    "num_hidden_layers": 8, "full_attention_interval": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 5e6, "partial_rotary_factor": 0.25,
    "rope_scaling": None, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "num_experts": 0, "tie_word_embeddings": False,
}


def test_qwen35_nested_layout():
    cfg = from_dict(QWEN35)
    assert cfg.model_type == "qwen3_5" and cfg.weight_prefix == "model.language_model."
    assert cfg.tie_word_embeddings and not cfg.gdn_fused_projections
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e7
    assert cfg.key_dim == 32 and cfg.value_dim == 48 and cfg.conv_dim == 112
    assert cfg.linear_layer_ids == (0, 2) and cfg.full_layer_ids == (1, 3)
    assert cfg.mtp_layers == 1 and cfg.eos_token_ids == (5,)


def test_qwen3_next_flat_layout_and_interval():
    cfg = from_dict(NEXT)
    assert cfg.weight_prefix == "model." and cfg.gdn_fused_projections
    assert cfg.full_layer_ids == (3, 7)  # (i + 1) % 4 == 0
    assert cfg.rope_theta == 5e6 and cfg.rotary_dim == 8
    assert cfg.mtp_num_hidden_layers is None  # decided by the checkpoint's tensors


def test_generation_config_eos_overrides(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN35))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_hf(str(tmp_path)).eos_token_ids == (7, 9)


def _bad(base, path, value):
    raw = copy.deepcopy(base)
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


@pytest.mark.parametrize("base,path,value,message", [
    (NEXT, ["num_experts"], 512, r"num_experts=512: mixture-of-experts"),
    (QWEN35, ["text_config", "layer_types", 2], "sliding_attention", r"layer_types\[2\]='sliding_attention'"),
    (QWEN35, ["text_config", "layer_types"], ["full_attention"], r"layer_types.*4 entries"),
    (QWEN35, ["text_config", "rope_parameters", "rope_type"], "yarn", r"rope_type='yarn'"),
    (NEXT, ["rope_scaling"], {"type": "linear", "factor": 2.0}, r"rope_scaling"),
    (QWEN35, ["text_config", "hidden_size"], KeyError, r"required field text_config.hidden_size is missing"),
    (QWEN35, ["text_config", "head_dim"], "256", r"head_dim='256': expected int"),
    (QWEN35, ["text_config", "linear_num_value_heads"], 5, r"linear_num_value_heads=5"),
    (QWEN35, ["text_config", "hidden_act"], "gelu", r"hidden_act='gelu'"),
    (QWEN35, ["text_config", "mamba_ssm_dtype"], "float16", r"mamba_ssm_dtype='float16'"),
    (QWEN35, ["text_config", "mamba_ssm_dtype"], "bfloat16", r"mamba_ssm_dtype=.bfloat16.*float32"),
    (QWEN35, ["text_config", "rope_parameters", "mrope_section"], [3, 3, 3], r"mrope_section"),
    (QWEN35, ["model_type"], "llama", r"model_type='llama' is not supported"),
    (NEXT, ["quantization_config"], {"quant_method": "awq"}, r"quant_method='awq'"),
    (NEXT, ["quantization_config"], {"quant_method": "fp8", "weight_block_size": [64, 64]},
     r"weight_block_size"),
])
def test_unsupported_configs_name_the_field(base, path, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(_bad(base, path, value), source="x/config.json")


def test_fp8_quantization_config():
    raw = dict(NEXT, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})
    assert from_dict(raw).quantization.modules_to_not_convert == ("lm_head",)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        ModelConfig.from_hf(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(str(tmp_path))
