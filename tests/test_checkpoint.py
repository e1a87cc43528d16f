"""The strict loader: layouts, sharding, and one clear error for each kind of bad checkpoint."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qmtp
from qmtp.model import checkpoint, params as P
from qmtp.model.checkpoint import CheckpointError
from qmtp.model.config import from_dict

ORACLE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle")
PREFIX = "model.language_model."


@pytest.fixture
def ckpt(tmp_path):
    """A writable copy of the Qwen3.5 oracle checkpoint (nested layout, f32, with mtp.*)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(os.path.join(ORACLE, "qwen3_5"), dst)
    return str(dst)


def rewrite(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_fused_qkvz_and_ba_row_order_from_the_spec():
    cfg = from_dict({"model_type": "qwen3_next", "hidden_size": 8, "intermediate_size": 8, "vocab_size": 8,
                     "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 4,
                     "rope_theta": 1.0, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                     "linear_key_head_dim": 1, "linear_value_head_dim": 1, "linear_conv_kernel_dim": 2})
    # Per key head g: [q_g | k_g | v_g (r=2 rows) | z_g (2 rows)] -> groups of 6 rows.
    assert P.fused_qkvz_rows(cfg) == ([0, 6, 1, 7, 2, 3, 8, 9], [4, 5, 10, 11])
    assert P.fused_ba_rows(cfg) == ([0, 1, 4, 5], [2, 3, 6, 7])


def test_loads_nested_layout_with_stacks_and_dtypes(ckpt):
    cfg, params = checkpoint.load(ckpt, dtype="bfloat16")
    assert len(params["gdn"]) == len(params["attn"]) == 2 and len(params["mtp"]["layers"]) == 1
    assert params["gdn"][1]["in_proj_qkv"].shape == (cfg.conv_dim, 64)
    assert params["attn"][0]["q_proj"].shape == (2 * 4 * 32, 64)
    assert params["gdn"][0]["conv"].shape == (cfg.conv_dim, 4)
    assert params["gdn"][0]["A_log"].dtype == np.float32 and params["gdn"][1]["dt_bias"].dtype == np.float32
    assert params["final_norm"].dtype == np.float32 and params["embed"].dtype.name == "bfloat16"
    assert params["mtp"]["layers"][0]["q_proj"].shape == (256, 64) and "fc" in params["mtp"]
    raw = load_file(os.path.join(ckpt, "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(params["attn"][1]["k_proj"], np.float32),
                                  raw[PREFIX + "layers.3.self_attn.k_proj.weight"].astype("bfloat16").astype(np.float32))


def test_vision_tensors_are_ignored(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.visual.blocks.0.attn.qkv.weight": np.zeros((3, 3), np.float32)}))
    checkpoint.load(ckpt)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop(PREFIX + "layers.1.self_attn.k_proj.weight"),
     r"missing tensors \(1\): model.language_model.layers.1.self_attn.k_proj.weight"),
    (lambda t: t.pop("mtp.fc.weight"), r"missing tensors \(1\): mtp.fc.weight"),
    (lambda t: t.update({PREFIX + "layers.9.mlp.up_proj.weight": np.zeros((2, 2), np.float32)}),
     r"unexpected tensors \(1\): model.language_model.layers.9.mlp.up_proj.weight"),
    (lambda t: t.update({PREFIX + "layers.0.linear_attn.out_proj.weight": np.zeros((64, 63), np.float32)}),
     r"layers.0.linear_attn.out_proj.weight: shape \[64, 63\], expected \[64, 64\]"),
    (lambda t: t.update({PREFIX + "layers.0.mlp.up_proj.weight_scale_inv": np.ones((1, 1), np.float32)}),
     r"up_proj.weight_scale_inv: scale for a F32 weight"),
])
def test_bad_tensors_are_reported_by_name(ckpt, edit, message):
    rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(ckpt)


def test_truncated_and_corrupt_files_name_the_file(ckpt):
    file = os.path.join(ckpt, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated"):
        checkpoint.load(ckpt)
    open(file, "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        checkpoint.load(ckpt)


def _split(ckpt, with_index: bool, duplicate: bool = False):
    file = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(file)
    os.remove(file)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    if duplicate:  # the first shard's first tensor also goes into the second shard
        halves["model-00002-of-00002.safetensors"].append(names[0])
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(ckpt, shard))
    if with_index:
        weight_map = {k: shard for shard, keys in halves.items() for k in keys}
        with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def test_sharded_checkpoint_loads_the_same_params(ckpt):
    import jax
    _, single = checkpoint.load(ckpt, dtype="float32")
    _split(ckpt, with_index=True)
    _, sharded = checkpoint.load(ckpt, dtype="float32")
    flat1, tree1 = jax.tree_util.tree_flatten_with_path(single)
    flat2, tree2 = jax.tree_util.tree_flatten_with_path(sharded)
    assert tree1 == tree2
    for (path, a), (_, b) in zip(flat1, flat2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_duplicated_tensor_across_shards(ckpt):
    _split(ckpt, with_index=False, duplicate=True)
    with pytest.raises(CheckpointError, match=r"duplicated tensors: lm_head.weight \(in model-00001"):
        checkpoint.load(ckpt)


def test_index_listing_a_missing_shard(ckpt):
    _split(ckpt, with_index=True)
    os.remove(os.path.join(ckpt, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=r"lists model-00002-of-00002.safetensors, which does not exist"):
        checkpoint.load(ckpt)


def test_missing_directory_and_bad_dtype(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        qmtp.load(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="dtype='float16'"):
        qmtp.load(os.path.join(ORACLE, "qwen3_5"), dtype="float16")


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_abstract_params_match_loaded_layouts(name):
    import jax
    import jax.numpy as jnp
    cfg, params = checkpoint.load(os.path.join(ORACLE, name), dtype="float32")
    spec = lambda tree: jax.tree_util.tree_map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)
    assert spec(params) == spec(P.abstract_params(cfg, jnp.float32))
