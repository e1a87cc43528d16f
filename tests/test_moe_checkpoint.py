"""Mixture-of-experts checkpoints: the experts stored one tensor per expert or fused into 3-D tensors, in
BF16 and FP8, load into the same stacked params; the loader names what is wrong; MTP decoding of an MoE
model gives plain greedy's tokens."""

import os
import shutil

import dataclasses

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qmtp
from qmtp.model import checkpoint, params as P
from qmtp.model.checkpoint import CheckpointError
from qmtp.model.config import ModelConfig
from qmtp.model.fp8 import Fp8Block, scale_grid
from qmtp.tools.make_checkpoint import resolve_checkpoint
from moe_layouts import fuse_experts

PRESET = "preset:tiny_moe"
EXPERT = "model.language_model.layers.{layer}.mlp.experts.{x}.{proj}.weight"


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_per_expert_and_fused_experts_load_the_same_stacked_params(dtype, tmp_path):
    src = resolve_checkpoint(f"{PRESET}:{dtype}")
    fuse_experts(src, str(tmp_path / "fused"))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in load_file(str(tmp_path / "fused" / "model.safetensors")))
    per_expert = qmtp.load(src, dtype="float32", progress=False, impl="ref")
    fused = qmtp.load(str(tmp_path / "fused"), dtype="float32", progress=False, impl="ref")
    layer = per_expert.params["gdn"][0]
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    assert isinstance(gate_up, Fp8Block) == (dtype == "fp8")
    assert np.shape(gate_up.weight if dtype == "fp8" else gate_up) == P.stacked_shape(per_expert.cfg, "experts_gate_up")
    # expert 3's up rows are its up_proj tensor
    raw = load_file(os.path.join(src, "model.safetensors"))
    up = raw[EXPERT.format(layer=0, x=3, proj="up_proj")]
    stored = gate_up.weight if dtype == "fp8" else gate_up
    assert np.array_equal(np.asarray(stored[3, 128:], np.float32), up.astype(np.float32))
    if dtype == "fp8":
        assert np.array_equal(np.asarray(gate_up.scale[3, 1:]),
                              raw[EXPERT.format(layer=0, x=3, proj="up_proj") + "_scale_inv"].astype(np.float32))
    assert np.shape(down.weight if dtype == "fp8" else down) == P.stacked_shape(per_expert.cfg, "experts_down")
    flat = lambda m: {str(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(m.params)[0]}  # noqa: E731
    a, b = flat(per_expert), flat(fused)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_missing_expert_is_named(tmp_path):
    src = resolve_checkpoint(f"{PRESET}:bf16")
    shutil.copytree(src, tmp_path / "ckpt")
    file = str(tmp_path / "ckpt" / "model.safetensors")
    tensors = load_file(file)
    del tensors[EXPERT.format(layer=1, x=5, proj="down_proj")]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): .*layers\.1\.mlp\.experts\.5\.down_proj"):
        qmtp.load(str(tmp_path / "ckpt"), progress=False)


@pytest.mark.parametrize("checkpoint,dtype,impl", [
    # float32, where MTP == plain is promised for every impl (bfloat16 only under --deterministic, whose
    # whole-chunk prefills take too long in interpret mode here; bf16 with impl ref held on tiny_next_moe by
    # chance: the same model with a 128-wide shared expert parts at a prompt's token 23)
    ("preset:tiny_next_moe:bf16", "float32", "ref"),
    pytest.param(f"{PRESET}:bf16", "float32", "ref", marks=pytest.mark.slow),
    pytest.param(f"{PRESET}:fp8", "float32", "pallas", marks=pytest.mark.slow)])  # ~7 minutes in interpret mode
def test_mtp_tokens_equal_plain_on_an_moe_model(checkpoint, dtype, impl):
    model = qmtp.load(resolve_checkpoint(checkpoint), dtype=dtype, impl=impl, progress=False)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [200, 3, 3, 18], [77] * 12]
    plain = qmtp.generate(model, prompts, max_new_tokens=24, stop_token_ids=[]).tokens
    assert qmtp.generate(model, prompts, max_new_tokens=24, stop_token_ids=[], mtp_k=3).tokens == plain


def test_fp8_experts_need_whole_blocks_of_expert_width():
    """Gate and up rows share one scale grid, so the up rows must start on a 128-row block."""
    cfg = ModelConfig.from_hf(resolve_checkpoint(f"{PRESET}:bf16"))
    cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0, moe=dataclasses.replace(cfg.moe, expert_size=64))
    headers = {e.name: checkpoint._Header("model.safetensors", "BF16", e.shape) for e in P.tensor_table(cfg)}
    up = EXPERT.format(layer=0, x=2, proj="up_proj")
    headers[up] = dataclasses.replace(headers[up], dtype="F8_E4M3")
    headers[up + "_scale_inv"] = checkpoint._Header("model.safetensors", "F32", scale_grid(64, cfg.hidden_size))
    with pytest.raises(CheckpointError, match=rf"{up}: FP8 experts need moe_intermediate_size % 128 == 0"):
        checkpoint.validate(cfg, headers, "ckpt")

