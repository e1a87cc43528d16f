"""Tests of the synthetic checkpoint writer (qmtp.tools.make_checkpoint, presets, tiny_tokenizer).

Expectations are spelled out independently of the writer where possible (which projections are FP8,
scale-grid shapes of the tiny preset, the E4M3 rounding bound), so a wrong writer fails them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy before safetensors)
import numpy as np
import pytest
from safetensors import safe_open

from qmtp.model import params
from qmtp.model.config import from_dict, ModelConfig
from qmtp.model.fp8 import dequantize_np, quantize_np
from qmtp.tools import make_checkpoint as mc, presets, tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, F = "linear_attention", "full_attention"

# Projections MODEL_SPEC §5.2 stores as FP8 (target layers and mtp.layers.*), and the tiny preset's
# scale grids [ceil(out/128), ceil(in/128)] for them (E 160, F 272, q 2*4*32, kv 2*32, GDN qkv 256, z 128).
FP8_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                "linear_attn.out_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
TINY_SCALE_GRIDS = {"q_proj": (2, 2), "k_proj": (1, 2), "v_proj": (1, 2), "o_proj": (2, 1),
                    "in_proj_qkv": (2, 2), "in_proj_z": (1, 2), "out_proj": (2, 1),
                    "gate_proj": (3, 2), "up_proj": (3, 2), "down_proj": (2, 3)}

# E4M3: 3 mantissa bits, exponent bias 7, so round-to-nearest errs by at most half an ulp:
# 2^-(3+1) of the value for normal codes (|code| >= 2^-6), 2^-10 (half the subnormal spacing 2^-9)
# below that; in weight units multiply the code bounds by the block scale.
E4M3_MANTISSA_BITS = 3
E4M3_REL_HALF_ULP = 2.0 ** -(E4M3_MANTISSA_BITS + 1)
E4M3_SUBNORMAL_HALF_ULP = 2.0 ** (1 - 7 - E4M3_MANTISSA_BITS - 1)
F32_SLACK = 1 + 2.0 ** -20  # float32 arithmetic of dequantization


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def header(path: str) -> tuple[dict, int]:
    """(safetensors header without __metadata__, data bytes) read by hand."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head, os.path.getsize(path) - 8 - n


def files_of(ckpt: str) -> dict[str, str]:
    """tensor name -> safetensors file path (index or single file)."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(ckpt, v) for k, v in json.load(f)["weight_map"].items()}
    path = os.path.join(ckpt, "model.safetensors")
    return {k: path for k in header(path)[0]}


def dtypes_of(ckpt: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (safetensors dtype string, shape) from the headers."""
    out = {}
    for path in set(files_of(ckpt).values()):
        for k, v in header(path)[0].items():
            out[k] = (v["dtype"], tuple(v["shape"]))
    return out


def load(ckpt: str) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(set(files_of(ckpt).values())):
        with safe_open(path, framework="np") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def digests(ckpt: str) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(ckpt, n), "rb").read()).hexdigest() for n in sorted(os.listdir(ckpt))}


def block_max(w: np.ndarray, block: int = 128) -> np.ndarray:
    """[ceil(O/128), ceil(I/128)] max |w| per block (ragged edges included)."""
    o, i = w.shape
    return np.array([[np.abs(w[r:r + block, c:c + block]).max() for c in range(0, i, block)]
                     for r in range(0, o, block)], np.float32)


def expand(s: np.ndarray, shape: tuple[int, int], block: int = 128) -> np.ndarray:
    return np.repeat(np.repeat(s, block, 0), block, 1)[: shape[0], : shape[1]]


def tiny_cfg(ckpt: str) -> ModelConfig:
    return ModelConfig.from_hf(ckpt)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints (seed 0) written once: bf16, fp8, fp32, fp8 with bf16 scales, bf16 seed 1."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, kw in {"bf16": dict(dtype="bf16"), "fp8": dict(dtype="fp8"), "fp32": dict(dtype="fp32"),
                     "fp8_bf16scale": dict(dtype="fp8", fp8_scale_dtype="bf16"),
                     "bf16_seed1": dict(dtype="bf16", seed=1)}.items():
        out[name] = mc.write_checkpoint(str(root / name), "tiny", **kw)
    return out


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_config_is_released_qwen3_5_layout_and_accepted(ckpts, kind):
    with open(os.path.join(ckpts[kind], "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "qwen3_5" and raw["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = raw["text_config"]
    assert text["model_type"] == "qwen3_5_text"
    assert text["layer_types"] == [L, F, L, F]
    rope = text["rope_parameters"]
    assert rope["rope_type"] == "default" and rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) * 2 == int(text["head_dim"] * rope["partial_rotary_factor"]) == 8
    assert (text["mamba_ssm_dtype"], text["output_gate_type"], text["hidden_act"]) == ("float32", "swish", "silu")
    assert text["attn_output_gate"] is True and text["mtp_use_dedicated_embeddings"] is False

    cfg = tiny_cfg(ckpts[kind])
    assert cfg.weight_prefix == "model.language_model."
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (160, 272, 384)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (4, 2, 32, 8)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (2, 4, 32, 32, 4)
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 4096
    assert cfg.mtp_layers == 1 and cfg.tie_word_embeddings is False
    assert cfg.bos_token_id == 381 and cfg.eos_token_ids == (383, 381)  # generation_config wins
    if kind == "bf16":
        assert cfg.quantization is None and "quantization_config" not in raw
    else:
        q = raw["quantization_config"]
        assert (q["quant_method"], q["fmt"], q["activation_scheme"], q["weight_block_size"]) == \
            ("fp8", "e4m3", "dynamic", [128, 128])
        assert cfg.quantization.block == (128, 128) and "lm_head" in cfg.quantization.modules_to_not_convert


def test_layer_slices_and_27b_shapes():
    assert presets.layer_types(1, 4) == [F]
    assert presets.layer_types(2, 4) == [L, F]
    assert presets.layer_types(3, 4) == [L, L, F]
    assert presets.layer_types(8, 4) == [L, L, L, F] * 2
    assert presets.layer_types(5, 2) == [L, F, L, F, L]
    with pytest.raises(ValueError, match="num_layers"):
        presets.layer_types(0, 4)

    cfg = from_dict(mc.build_config("qwen3_5_27b", "fp8"))
    assert cfg.num_hidden_layers == 64 and cfg.full_layer_ids == tuple(range(3, 64, 4))
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7 and cfg.value_dim == 6144 and cfg.conv_dim == 10240
    shapes = {e.name: e.shape for e in params.tensor_table(cfg)}
    p = "model.language_model."
    assert shapes[p + "embed_tokens.weight"] == shapes["lm_head.weight"] == (248320, 5120)
    assert shapes[p + "layers.3.self_attn.q_proj.weight"] == (12288, 5120)
    assert shapes[p + "layers.0.linear_attn.in_proj_qkv.weight"] == (10240, 5120)
    assert shapes[p + "layers.0.mlp.down_proj.weight"] == (5120, 17408)
    scales = {t.name: t.shape for unit in mc.plan_tensors(cfg, "fp8") for t in unit if t.part == "fp8_scale"}
    assert scales[p + "layers.3.self_attn.q_proj.weight_scale_inv"] == (96, 40)
    assert scales[p + "layers.0.mlp.gate_proj.weight_scale_inv"] == (136, 40)
    assert mc.build_config("qwen3_5_27b", "bf16")["text_config"]["rope_parameters"]["mrope_section"] == [11, 11, 10]
    sliced = from_dict(mc.build_config("qwen3_5_27b", "fp8", num_layers=2))
    assert sliced.layer_types == (L, F) and sliced.hidden_size == 5120


# --------------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,stored", [("bf16", "BF16"), ("fp32", "F32")])
def test_plain_checkpoint_holds_exactly_the_table(ckpts, kind, stored):
    cfg = tiny_cfg(ckpts[kind])
    table = {e.name: e.shape for e in params.tensor_table(cfg)}
    got = dtypes_of(ckpts[kind])
    assert set(got) == set(table)
    for name, (dtype, shape) in got.items():
        assert dtype == stored and shape == table[name], name
    head, data_bytes = header(os.path.join(ckpts[kind], "model.safetensors"))
    spans = sorted(v["data_offsets"] for v in head.values())
    assert spans[0][0] == 0 and spans[-1][1] == data_bytes
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no holes in the index


@pytest.mark.parametrize("kind,scale_dtype", [("fp8", "F32"), ("fp8_bf16scale", "BF16")])
def test_fp8_checkpoint_layout(ckpts, kind, scale_dtype):
    cfg = tiny_cfg(ckpts[kind])
    table = {e.name: e.shape for e in params.tensor_table(cfg)}
    quantized = {n for n in table if n.endswith(FP8_SUFFIXES)}
    assert len(quantized) == 2 * 6 + 2 * 7 + 7  # 2 GDN layers, 2 attention layers, the MTP layer
    assert any(n.startswith("mtp.layers.0.") for n in quantized)
    got = dtypes_of(ckpts[kind])
    assert set(got) == set(table) | {n + "_scale_inv" for n in quantized}
    for name, shape in table.items():
        dtype, stored_shape = got[name]
        assert stored_shape == shape, name
        if name in quantized:
            assert dtype == "F8_E4M3", name
            proj = name.split(".")[-2]
            assert got[name + "_scale_inv"] == (scale_dtype, TINY_SCALE_GRIDS[proj]), name
        elif name.endswith(("A_log", "dt_bias")):
            assert dtype == "F32", name
        else:
            assert dtype == "BF16", name
    # modules_to_not_convert (transformers' substring match) agrees with what is stored.
    with open(os.path.join(ckpts[kind], "config.json")) as f:
        skip = json.load(f)["quantization_config"]["modules_to_not_convert"]
    for name in table:
        if len(table[name]) == 2:
            module = name.removesuffix(".weight")
            assert (name in quantized) == (not any(p in module for p in skip)), name


def test_same_seed_same_bytes_other_seed_other_weights(ckpts, tmp_path):
    again = mc.write_checkpoint(str(tmp_path / "again"), "tiny", "bf16", seed=0)
    assert digests(again) == digests(ckpts["bf16"])
    a, b = load(ckpts["bf16"]), load(ckpts["bf16_seed1"])
    assert a.keys() == b.keys()
    for name in a:
        assert not np.array_equal(f32(a[name]), f32(b[name])), name
    with open(os.path.join(ckpts["bf16_seed1"], "config.json")) as f:
        assert json.load(f)["qmtp_synthetic"]["seed"] == 1


def test_fp8_is_the_quantized_twin_of_bf16(ckpts):
    bf16, q8, fp32 = load(ckpts["bf16"]), load(ckpts["fp8"]), load(ckpts["fp32"])
    for name, w in bf16.items():
        w = f32(w)
        assert np.array_equal(f32(fp32[name]), w), name  # fp32 storage holds the same (bf16-exact) values
        if name + "_scale_inv" not in q8:
            assert np.array_equal(f32(q8[name]), w), name  # unquantized tensors identical (A_log F32 too)
            continue
        codes, scale = q8[name], f32(q8[name + "_scale_inv"])
        assert not np.isnan(f32(codes)).any(), name
        np.testing.assert_allclose(scale, block_max(w) / np.float32(448.0), rtol=1e-7, err_msg=name)
        s = expand(scale, w.shape)
        err = np.abs(f32(codes) * s - w)
        bound = np.maximum(E4M3_REL_HALF_ULP * np.abs(w), E4M3_SUBNORMAL_HALF_ULP * s) * F32_SLACK
        assert (err <= bound).all(), (name, float((err / bound).max()))
        assert (err <= 2.0 ** -3 * expand(block_max(w), w.shape)).all(), name  # the coarser per-block bound
        assert err.max() > 0, name  # really quantized


def test_bf16_scales_dequantize_within_bound(ckpts):
    """With BF16 weight_scale_inv the codes are consistent with the rounded scale: same E4M3 bound."""
    bf16, q8 = load(ckpts["bf16"]), load(ckpts["fp8_bf16scale"])
    for name in (n for n in q8 if n.endswith("_scale_inv")):
        w = f32(bf16[name.removesuffix("_scale_inv")])
        scale = f32(q8[name])
        np.testing.assert_allclose(scale, block_max(w) / 448, rtol=2.0 ** -8, err_msg=name)
        s = expand(scale, w.shape)
        err = np.abs(dequantize_np(q8[name.removesuffix("_scale_inv")], scale) - w)
        bound = np.maximum(E4M3_REL_HALF_ULP * np.abs(w), E4M3_SUBNORMAL_HALF_ULP * s) * F32_SLACK
        assert (err <= bound).all(), (name, float((err / bound).max()))


def test_weight_distributions(ckpts):
    w = {k: f32(v) for k, v in load(ckpts["bf16"]).items()}
    p = "model.language_model."
    assert abs(w[p + "embed_tokens.weight"].std() - 1.0) < 0.05
    for name in (p + "layers.0.mlp.gate_proj.weight", p + "layers.0.mlp.down_proj.weight",
                 p + "layers.1.self_attn.q_proj.weight", "mtp.fc.weight", "lm_head.weight"):
        assert abs(w[name].std() * math.sqrt(w[name].shape[1]) - 1.0) < 0.1, name
    zero_centred = np.concatenate([v for k, v in w.items() if k.endswith("norm.weight")
                                   and not k.endswith("linear_attn.norm.weight")])
    assert abs(zero_centred.mean()) < 0.02 and 0.08 < zero_centred.std() < 0.12
    gdn_norm = w[p + "layers.0.linear_attn.norm.weight"]
    assert abs(gdn_norm.mean() - 1.0) < 0.06 and 0.05 < gdn_norm.std() < 0.15
    a_log = np.concatenate([w[p + f"layers.{i}.linear_attn.A_log"] for i in (0, 2)])
    assert (a_log >= 0).all() and (a_log <= math.log(16) + 1e-2).all() and a_log.std() > 0.2
    assert 0.25 < w[p + "layers.0.linear_attn.conv1d.weight"].std() < 0.35


def test_layer_slice_shares_weights_with_full_model(ckpts, tmp_path):
    sliced = mc.write_checkpoint(str(tmp_path / "s3"), "tiny", "bf16", num_layers=3)
    assert tiny_cfg(sliced).layer_types == (L, F, L)
    full, part = load(ckpts["bf16"]), load(sliced)
    assert not any(".layers.3." in n for n in part)
    for name, v in part.items():
        assert np.array_equal(f32(v), f32(full[name])), name


def test_sharded_index_maps_every_tensor(ckpts, tmp_path):
    limit = 150_000
    out = mc.write_checkpoint(str(tmp_path / "sharded"), "tiny", "fp8", max_shard_bytes=limit)
    names = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(names) >= 4 and "model.safetensors" not in names
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    assert set(weight_map) == set(dtypes_of(ckpts["fp8"]))
    assert set(weight_map.values()) == set(names)
    total = 0
    for name in names:
        head, data_bytes = header(os.path.join(out, name))
        assert set(head) == {k for k, v in weight_map.items() if v == name}, name
        sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items()}
        assert sum(sizes.values()) == data_bytes
        pairs = {k.removesuffix("_scale_inv") for k in head}
        assert data_bytes <= limit or len(pairs) == 1, name  # only a lone oversized unit exceeds the limit
        total += data_bytes
    assert index["metadata"]["total_size"] == total
    single, sharded = load(ckpts["fp8"]), load(out)
    for k, v in single.items():
        assert np.array_equal(v.view(np.uint8), sharded[k].view(np.uint8)), k


# --------------------------------------------------------------------------------------------------
# the fast (real-shape) generator, exercised at small shapes
# --------------------------------------------------------------------------------------------------


def test_fast_fp8_draw_is_its_own_quantization():
    for shape in [(300, 200), (128, 128), (48, 257), (1, 1)]:
        w = presets.fast_fp8_normal(shape, 1 / math.sqrt(shape[1]), key=12345)
        codes = w.weight.view(np.uint8)
        assert not ((codes & 0x7F) == 0x7F).any(), shape  # no NaN codes
        deq = dequantize_np(w.weight, w.scale)
        assert np.array_equal(f32(deq.astype(ml_dtypes.bfloat16)), deq), shape  # bf16-exact
        q, s = quantize_np(deq)
        assert np.array_equal(q.view(np.uint8), codes) and np.array_equal(s, w.scale), shape
    big = presets.fast_fp8_normal((512, 1024), 0.03, key=7)
    assert abs(dequantize_np(big.weight, big.scale).std() / 0.03 - 1) < 0.1
    assert len(np.unique(big.scale)) > 1  # scales vary per block


def test_hashed_rows_are_chunking_independent():
    for fp8 in (False, True):
        lazy = presets.HashedNormal((300, 37), 0.5, key=99, fp8=fp8)
        whole = lazy.rows(0, 300).view(np.uint8)
        parts = np.concatenate([lazy.rows(lo, min(300, lo + 77)).view(np.uint8) for lo in range(0, 300, 77)])
        assert np.array_equal(whole, parts)
    padded = presets.HashedNormal((300, 37), 0.5, key=99, live_rows=130).materialize()
    plain = presets.HashedNormal((300, 37), 0.5, key=99).materialize()
    assert np.array_equal(f32(padded[:130]), f32(plain[:130])) and not f32(padded[130:]).any()
    assert abs(f32(plain).std() / 0.5 - 1) < 0.1


def test_fast_preset_twins_are_exact(tmp_path, monkeypatch):
    """The fast path end to end at tiny shapes: chunked writes, zero padding rows, exact twins."""
    padded = lambda n=None: {**presets.tiny_text_config(n), "vocab_size": 512}  # noqa: E731
    monkeypatch.setitem(presets.PRESETS, "tiny_fast",
                        presets.Preset("tiny_fast", "test", padded, fast_weights=True))
    monkeypatch.setattr(mc.TensorSource, "CHUNK_BYTES", 1)  # 128-row chunks
    b = load(mc.write_checkpoint(str(tmp_path / "b"), "tiny_fast", "bf16"))
    q = load(mc.write_checkpoint(str(tmp_path / "q"), "tiny_fast", "fp8"))
    lm_head = f32(b["lm_head.weight"])
    assert lm_head.shape == (512, 160) and not lm_head[384:].any() and (lm_head[:384] != 0).mean() > 0.9
    n_quantized = 0
    for name, v in b.items():
        if name + "_scale_inv" in q:
            n_quantized += 1
            assert np.array_equal(dequantize_np(q[name], q[name + "_scale_inv"]), f32(v)), name
        else:
            assert np.array_equal(f32(q[name]), f32(v)), name
    assert n_quantized == 33


# --------------------------------------------------------------------------------------------------
# tokenizer and text files
# --------------------------------------------------------------------------------------------------


def test_tokenizer_is_deterministic_and_round_trips():
    tok = tiny_tokenizer.build_tokenizer()
    assert tok.to_str() == tiny_tokenizer.build_tokenizer().to_str()
    assert tok.get_vocab_size() == tiny_tokenizer.TINY_VOCAB_SIZE == 384
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [381, 382, 383]
    assert tiny_tokenizer.special_token_ids() == {"<|endoftext|>": 381, "<|im_start|>": 382, "<|im_end|>": 383}
    for text in ["Hello, world!", "def f(x):\n    return x * 2  # double\n", "  leading and trailing  ",
                 "tabs\tand\r\nnewlines\n\n", "~!@#$%^&*()_+`-=[]{}|;':\",./<>?", "0123456789 " * 3]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text and max(ids) < 381, text
    english = "The model reads the text one token at a time and predicts the next token."
    assert len(tok.encode(english).ids) < 0.7 * len(english)  # merges are really used
    chat = "<|im_start|>user\nhi<|im_end|>\n"
    ids = tok.encode(chat).ids
    assert ids[0] == 382 and 383 in ids and tok.decode(ids, skip_special_tokens=False) == chat
    with pytest.raises(ValueError, match="too small"):
        tiny_tokenizer.build_tokenizer(200)


def test_checkpoint_tokenizer_and_generation_files(ckpts):
    from tokenizers import Tokenizer

    d = ckpts["fp8"]
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    assert json.loads(tok.to_str()) == json.loads(tiny_tokenizer.build_tokenizer().to_str())
    with open(os.path.join(d, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")] == [383, 381]
    assert gen["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert (tc["eos_token"], tc["pad_token"], tc["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert "<|im_start|>" in tc["chat_template"] and tc["added_tokens_decoder"]["383"]["content"] == "<|im_end|>"


# --------------------------------------------------------------------------------------------------
# API and CLI
# --------------------------------------------------------------------------------------------------


def test_write_refuses_non_empty_dir_and_overwrites_atomically(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()  # an empty directory is fine
    mc.write_checkpoint(str(out), "tiny", "bf16", num_layers=1)
    with pytest.raises(FileExistsError, match="not empty"):
        mc.write_checkpoint(str(out), "tiny", "fp8", num_layers=1)
    assert "quantization_config" not in json.load(open(out / "config.json"))
    mc.write_checkpoint(str(out), "tiny", "fp8", num_layers=1, overwrite=True)
    assert "quantization_config" in json.load(open(out / "config.json"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp dirs left behind
    for kwargs, match in [(dict(preset="nope"), "unknown preset"), (dict(dtype="fp16"), "dtype"),
                          (dict(num_layers=0), "num_layers"), (dict(seed=-1), "seed"),
                          (dict(max_shard_bytes=0), "max_shard_bytes")]:
        with pytest.raises(ValueError, match=match):
            mc.write_checkpoint(str(tmp_path / "bad"), **kwargs)
    assert not (tmp_path / "bad").exists()


def test_ensure_preset_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("QMTP_CACHE", str(tmp_path / "env_cache"))
    path = mc.ensure_preset("tiny", "bf16", seed=3, num_layers=1)
    assert path.startswith(str(tmp_path / "env_cache")) and "tiny-bf16-seed3-L1-gen" in path
    assert tiny_cfg(path).num_hidden_layers == 1

    def no_write(*args, **kwargs):
        raise AssertionError("cached preset was regenerated")

    monkeypatch.setattr(mc, "write_checkpoint", no_write)
    assert mc.ensure_preset("tiny", "bf16", seed=3, num_layers=1) == path
    monkeypatch.undo()
    explicit = mc.ensure_preset("tiny", "fp8", seed=0, cache_dir=str(tmp_path / "c"), num_layers=1)
    assert explicit.startswith(str(tmp_path / "c")) and tiny_cfg(explicit).quantization is not None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "qmtp.tools.make_checkpoint", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_help_and_errors(tmp_path):
    helped = run_cli("--help")
    assert helped.returncode == 0
    for flag in ("--preset", "--dtype", "--seed", "--out", "--num_layers", "--max_shard_bytes",
                 "--fp8_scale_dtype", "--[no]overwrite", "qwen3_5_27b"):
        assert flag in helped.stdout, flag
    bogus = run_cli("--out=" + str(tmp_path / "x"), "--bogus=1")
    assert bogus.returncode != 0 and len(bogus.stderr.strip().splitlines()) == 1 and "bogus" in bogus.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,needle", [
    (["--preset=huge"], "preset"), (["--dtype=fp16"], "dtype"), (["--max_shard_bytes=lots"], "max_shard_bytes"),
    ([], "--out is required"), (["stray"], "positional")])
def test_cli_bad_values_give_one_line(tmp_path, capsys, args, needle):
    out = [] if needle == "--out is required" else ["--out=" + str(tmp_path / "x")]
    assert mc.main(["make_checkpoint", *out, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith("make_checkpoint: error:")


def test_cli_writes_what_the_api_writes(ckpts, tmp_path):
    done = run_cli("--preset=tiny", "--dtype=fp8", "--seed=0", "--out=" + str(tmp_path / "cli"))
    assert done.returncode == 0, done.stderr
    assert digests(str(tmp_path / "cli")) == digests(ckpts["fp8"])
    assert mc.parse_size("4GiB") == 4 * 2**30 and mc.parse_size("500MB") == 500 * 10**6 and mc.parse_size("7") == 7
