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
    (NEXT, ["num_experts"], 512, r"required field num_experts_per_tok is missing"),
    (QWEN35, ["text_config", "num_experts"], 8, r"num_experts=8: a dense Qwen3.5 model type.*qwen3_5_moe"),
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


MOE_FIELDS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 48, "router_aux_loss_coef": 0.001, "output_router_logits": False}


def test_qwen3_next_moe_per_sparse_step_and_mlp_only_layers():
    cfg = from_dict(dict(NEXT, **MOE_FIELDS, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[5]))
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.shared_size) == (8, 2, 32, 48)
    assert not moe.norm_topk_prob and cfg.intermediate_size == 128
    assert [i for i in range(8) if cfg.layer_is_moe(i)] == [1, 3, 7]  # (i + 1) % 2 == 0, not layer 5
    assert from_dict(dict(NEXT, **MOE_FIELDS)).moe.norm_topk_prob  # HF's default


def test_qwen35_moe_every_layer_without_a_dense_width():
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
    cfg = from_dict({"model_type": "qwen3_5_moe", "text_config": dict(text, **MOE_FIELDS)})
    assert cfg.weight_prefix == "model.language_model." and cfg.model_type == "qwen3_5"
    assert cfg.intermediate_size == 0 and all(cfg.layer_is_moe(i) for i in range(4)) and cfg.moe.norm_topk_prob
    flat = from_dict(dict(text, **MOE_FIELDS, model_type="qwen3_5_moe_text"))
    assert flat.weight_prefix == "model." and flat.moe == cfg.moe


@pytest.mark.parametrize("extra,message", [
    ({"n_group": 4}, r"n_group=4: an MoE setting qmtp does not know"),
    ({"routed_scaling_factor": 2.5}, r"routed_scaling_factor=2.5: an MoE setting"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9: must be at most num_experts=8"),
    ({"norm_topk_prob": False}, r"norm_topk_prob=False: Qwen3.5-MoE always renormalizes"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2: Qwen3.5-MoE has MoE in every layer"),
    ({"moe_intermediate_size": None}, r"required field text_config.moe_intermediate_size is missing"),
])
def test_moe_fields_are_read_strictly(extra, message):
    raw = {"model_type": "qwen3_5_moe", "text_config": {**TEXT, **MOE_FIELDS, **extra}}
    with pytest.raises(ConfigError, match=message):
        from_dict(raw, source="x/config.json")


def test_a_dense_layer_needs_the_dense_width():
    raw = dict({k: v for k, v in NEXT.items() if k != "intermediate_size"}, **MOE_FIELDS, mlp_only_layers=[0])
    with pytest.raises(ConfigError, match="required field intermediate_size is missing"):
        from_dict(raw)


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
