"""FP8 block checkpoints: kept as FP8 at load, equal to their dequantized twin, strictly validated."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import numpy_ref
import qmtp
from qmtp.model.checkpoint import CheckpointError
from qmtp.model.fp8 import Fp8Block
from qmtp.tools import make_checkpoint
from tolerance import F32_MODEL, assert_close

PROMPT = list(range(5, 60))
Q_PROJ = "model.language_model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("fp8") / "tiny"), "tiny", "fp8", seed=3)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_fp8_weights_stay_fp8_with_ragged_scale_grids(fp8_dir):
    model = qmtp.load(fp8_dir, dtype="bfloat16")
    w = model.params["attn"][1]["k_proj"]  # [64, 160]: one ragged block row, a ragged block column
    assert isinstance(w, Fp8Block) and w.weight.dtype.name == "float8_e4m3fn"
    assert w.weight.shape == (64, 160) and w.scale.shape == (1, 2) and w.scale.dtype == np.float32
    assert isinstance(model.params["mtp"]["layers"][0]["mlp_down"], Fp8Block)
    # in_proj_b/a stay BF16 (qmtp.load joins them into in_proj_ba)
    assert not isinstance(model.params["gdn"][0]["in_proj_ba"], Fp8Block)


def test_fp8_logits_equal_the_dequantized_twin(fp8_dir, tmp_path):
    """Dequantize every FP8 weight with the float64 numpy formula into an F32 twin checkpoint."""
    twin = _copy(fp8_dir, tmp_path / "twin")
    with open(os.path.join(twin, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"].pop("quantization_config", None)
    cfg.pop("quantization_config", None)
    with open(os.path.join(twin, "config.json"), "w") as f:
        json.dump(cfg, f)
    file = os.path.join(twin, "model.safetensors")
    tensors = load_file(file)
    scales = [k for k in tensors if k.endswith("_scale_inv")]
    assert scales, "the fp8 fixture has no quantized weights"
    for s in scales:
        w = s[: -len("_scale_inv")]
        tensors[w] = numpy_ref.fp8_dequant(tensors[w], tensors.pop(s).astype(np.float32)).astype(np.float32)
    save_file(tensors, file)
    got = qmtp.target_logits(qmtp.load(fp8_dir, dtype="float32"), PROMPT)
    want = qmtp.target_logits(qmtp.load(twin, dtype="float32"), PROMPT)
    assert_close(got, want, F32_MODEL, "fp8 vs dequantized twin")


def _edit(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({Q_PROJ + "_scale_inv": np.ones((3, 2), np.float32)}),  # q_proj is [256, 160]
     r"q_proj.weight_scale_inv: scale grid \[3, 2\], expected \[2, 2\] for weight \[256, 160\]"),
    (lambda t: t.pop(Q_PROJ + "_scale_inv"), r"q_proj.weight: F8_E4M3 weight without .*q_proj.weight_scale_inv"),
    (lambda t: t.update({Q_PROJ + "_scale_inv": np.ones((2, 2), np.int32)}),
     r"q_proj.weight_scale_inv: dtype I32, expected BF16 or F32"),
])
def test_bad_fp8_tensors_are_rejected(fp8_dir, tmp_path, edit, message):
    bad = _copy(fp8_dir, tmp_path / "bad")
    _edit(bad, edit)
    with pytest.raises(CheckpointError, match=message):
        qmtp.load(bad)


def test_fp8_embedding_is_rejected(fp8_dir, tmp_path):
    bad = _copy(fp8_dir, tmp_path / "bad")
    name = "model.language_model.embed_tokens.weight"

    def edit(t):
        t[name] = t[name].astype(np.float32).astype("float8_e4m3fn")
        t[name + "_scale_inv"] = np.ones((-(-t[name].shape[0] // 128), 2), np.float32)
    _edit(bad, edit)
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight: F8_E4M3 is only supported for linear weights"):
        qmtp.load(bad)


def test_abstract_params_describe_the_loaded_tree(fp8_dir):
    import jax
    import jax.numpy as jnp
    from qmtp.model.params import abstract_params
    # the checkpoint's tree: without the FP8 draft head that qmtp.load adds for FP8 checkpoints
    # (draft_head="auto"), a copy of lm_head made after loading, not a checkpoint tensor, and with
    # in_proj_b / in_proj_a as the checkpoint names them (qmtp.load joins them)
    from qmtp.model import checkpoint
    cfg, params = checkpoint.load(fp8_dir, dtype="bfloat16", progress=False)
    abstract = abstract_params(cfg, jnp.bfloat16, fp8_linear=True)
    got = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), params)
    want = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), abstract)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(want)
