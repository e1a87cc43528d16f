"""Hugging Face-format export of a trained model, and the MTP write-back of `--train_mtp_only`.

`export_checkpoint(out_dir, config, params, tokenizer)` writes what `qmtp.load` reads strictly and
HF transformers' Qwen3_5ForCausalLM loads (it ignores `mtp.*`):

    config.json              `model_config(...)`: the Qwen3.5 VLM-wrapper layout of
                             qmtp.tools.make_checkpoint (model_type qwen3_5, text fields under
                             text_config from presets' Qwen3.5 text_config, mtp_num_hidden_layers 1)
    model.safetensors        or model-0000i-of-0000N.safetensors + model.safetensors.index.json when
                             the tensors exceed max_shard_bytes; names and HF shapes from
                             `params.tensor_table` (model.language_model.*, lm_head.weight, mtp.*);
                             every tensor BF16 (dtype "bf16") or F32 ("fp32")
    tokenizer.json, tokenizer_config.json (ChatML chat template), generation_config.json
                             (eos [<|im_end|>, <|endoftext|>], bos = pad = <|endoftext|>)

`write_back_mtp(src_dir, out_dir, cfg, mtp_params)` copies a checkpoint directory and overwrites,
in place inside the copied safetensors files, the bytes of every `mtp.*` tensor with the new
values stored in the source tensor's own format (BF16 / F16 / F32, or FP8 E4M3 re-quantized with
128x128 block scales `amax / 448` in the source scale dtype). Sizes and headers are unchanged, so
every other tensor (FP8 ones included) stays bit-identical.

Both write into a temporary directory beside `out_dir` and rename it into place.

    python -m qmtp.train.export --run_dir=RUN --out=DIR [--dtype=bf16] [--max_shard_bytes=14MB]

exports the latest orbax checkpoint of a `qmtp.train` run (or, for a --train_mtp_only run, writes
its MTP tensors back into a copy of the run's --init_checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Sequence

import ml_dtypes
import numpy as np

from qmtp.model import config as qconfig, params as P
from qmtp.tools import checkpoint_writer, presets, tiny_tokenizer
from qmtp.tools.make_checkpoint import parse_size

DTYPES = {"bf16": "BF16", "fp32": "F32"}
_NP = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}
DEFAULT_MAX_SHARD_BYTES = 14 * 10**6


# ---- config files --------------------------------------------------------------------------------

def model_config(*, hidden_size: int, intermediate_size: int, num_layers: int, full_attention_interval: int,
                 num_attention_heads: int, num_key_value_heads: int, head_dim: int, partial_rotary_factor: float,
                 rope_theta: float, linear_num_key_heads: int, linear_num_value_heads: int,
                 linear_key_head_dim: int, linear_value_head_dim: int, linear_conv_kernel_dim: int,
                 vocab_size: int, tie_word_embeddings: bool, max_position_embeddings: int, dtype: str = "bf16",
                 note: dict | None = None) -> dict:
    """config.json of a trained model: make_checkpoint.build_config's layout with our geometry.
    Token ids: the tokenizer layout of `qmtp.train.data` (specials are the last three ids)."""
    text = presets.text_config(
        hidden=hidden_size, ffn=intermediate_size, num_layers=num_layers, interval=full_attention_interval,
        heads=num_attention_heads, kv_heads=num_key_value_heads, head_dim=head_dim,
        partial_rotary=partial_rotary_factor, rope_theta=rope_theta, gdn_k_heads=linear_num_key_heads,
        gdn_v_heads=linear_num_value_heads, gdn_k_dim=linear_key_head_dim, gdn_v_dim=linear_value_head_dim,
        conv=linear_conv_kernel_dim, vocab=vocab_size, tie=tie_word_embeddings, max_positions=max_position_embeddings)
    eot = tiny_tokenizer.bos_token_id(vocab_size)
    text.update(bos_token_id=eot, eos_token_id=eot, dtype="float32" if dtype == "fp32" else "bfloat16")
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": tie_word_embeddings, "dtype": text["dtype"], "text_config": text,
            "qmtp_trained": dict(note or {}, generator="qmtp.train")}


def generation_config(tokenizer) -> dict:
    from qmtp.train.data import special_ids
    ids = special_ids(tokenizer)
    eot, im_end = ids[tiny_tokenizer.ENDOFTEXT], ids[tiny_tokenizer.IM_END]
    return {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": False}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_tokenizer_files(tmp: str, tokenizer, config: dict) -> None:
    from qmtp.train.data import special_ids
    vocab = tokenizer.get_vocab_size()
    if special_ids(tokenizer) != tiny_tokenizer.special_token_ids(vocab):
        raise ValueError("the tokenizer's special tokens are not its last three ids (qmtp.train.data layout)")
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    max_len = config["text_config"]["max_position_embeddings"]
    _write_json(os.path.join(tmp, "tokenizer_config.json"), tiny_tokenizer.tokenizer_config(vocab, max_len))
    _write_json(os.path.join(tmp, "generation_config.json"), generation_config(tokenizer))


# ---- atomic output directory -----------------------------------------------------------------------

def _publish(tmp: str, out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir):
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists (pass overwrite=True / --overwrite)")
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)


def _tmp_beside(out_dir: str) -> str:
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)


# ---- export ------------------------------------------------------------------------------------------

def param_leaf(tree: dict, entry: P.TensorEntry):
    """The parameter of one tensor_table entry (the inverse of checkpoint._place)."""
    if entry.group is None:
        return tree[entry.key]
    if entry.group == "mtp":
        return tree["mtp"][entry.key]
    if entry.group == "mtp_layers":
        return tree["mtp"]["layers"][entry.index][entry.key]
    return tree[entry.group][entry.index][entry.key]


def hf_value(tree: dict, entry: P.TensorEntry) -> np.ndarray:
    """float32 [HF shape] of one entry: params keep the HF layout except conv [C, W] -> [C, 1, W]."""
    if entry.role in (P.FUSED_QKVZ, P.FUSED_BA):
        raise ValueError(f"{entry.name}: exporting fused Qwen3-Next projections is not supported")
    value = np.asarray(param_leaf(tree, entry), np.float32)
    if entry.role == P.CONV:
        value = value[:, None, :]
    if value.shape != entry.shape:
        raise ValueError(f"{entry.name}: parameter shape {value.shape}, expected {entry.shape}")
    return value


class _ParamSource:
    """checkpoint_writer's TensorSource interface over an in-memory parameter tree."""

    def __init__(self, tree: dict):
        self.tree = tree

    def chunks(self, t: checkpoint_writer.StoredTensor):
        yield np.ascontiguousarray(hf_value(self.tree, t.entry).astype(_NP[t.dtype]))


def export_checkpoint(out_dir: str, config: dict, params: dict, tokenizer, dtype: str = "bf16",
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> str:
    """Writes the HF directory (module doc) of `params` (any float dtype, host or device arrays)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: supported {sorted(DTYPES)}")
    cfg = qconfig.from_dict(config, source="export config")
    if tokenizer.get_vocab_size() != cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model {cfg.vocab_size}")
    config = dict(config, dtype="float32" if dtype == "fp32" else "bfloat16")
    config["text_config"] = dict(config["text_config"], dtype=config["dtype"])
    shards = checkpoint_writer.shard_units(checkpoint_writer.plan_tensors(cfg, dtype), max_shard_bytes)
    tmp = _tmp_beside(out_dir)
    try:
        _write_json(os.path.join(tmp, "config.json"), config)
        _write_tokenizer_files(tmp, tokenizer, config)
        names = checkpoint_writer.shard_file_names(len(shards))
        source = _ParamSource(params)
        for name, shard in zip(names, shards):
            checkpoint_writer.write_safetensors(os.path.join(tmp, name), shard, source)
        if len(shards) > 1:
            _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
                         "weight_map": {t.name: n for n, s in zip(names, shards) for t in s}})
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.abspath(out_dir)


# ---- MTP write-back ------------------------------------------------------------------------------------

def _raw_header(path: str) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def mtp_tensor_bytes(cfg: qconfig.ModelConfig, headers: dict, mtp_params: dict) -> dict[str, bytes]:
    """name -> new stored bytes of every mtp.* tensor (and FP8 scale), in the source's format."""
    out: dict[str, bytes] = {}
    tree = {"mtp": mtp_params}
    for entry in P.tensor_table(cfg):
        if entry.group not in ("mtp", "mtp_layers"):
            continue
        value, h = hf_value(tree, entry), headers[entry.name]
        if h.dtype == "F8_E4M3":
            sh = headers[entry.name + "_scale_inv"]
            q, scale = checkpoint_writer.quantize_stored(value, "bf16" if sh.dtype == "BF16" else "fp32")
            out[entry.name], out[entry.name + "_scale_inv"] = q.tobytes(), scale.tobytes()
        elif h.dtype in _NP:
            out[entry.name] = value.astype(_NP[h.dtype]).tobytes()
        else:
            raise ValueError(f"{entry.name}: cannot write a {h.dtype} tensor")
    return out


def write_back_mtp(src_dir: str, out_dir: str, cfg: qconfig.ModelConfig, mtp_params: dict,
                   overwrite: bool = False) -> str:
    """A copy of `src_dir` whose mtp.* tensors hold `mtp_params` (module doc)."""
    from qmtp.model.checkpoint import read_headers
    headers = read_headers(src_dir)
    new = mtp_tensor_bytes(cfg, headers, mtp_params)
    tmp = _tmp_beside(out_dir)
    try:
        os.rmdir(tmp)
        shutil.copytree(src_dir, tmp)
        for file in sorted({headers[n].file for n in new}):
            path = os.path.join(tmp, file)
            start, header = _raw_header(path)
            with open(path, "r+b") as f:
                for name, data in new.items():
                    if name not in header:
                        continue
                    lo, hi = header[name]["data_offsets"]
                    if hi - lo != len(data):
                        raise ValueError(f"{name}: {len(data)} new bytes for a {hi - lo}-byte tensor")
                    f.seek(start + lo)
                    f.write(data)
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.abspath(out_dir)


def export_run(run_dir: str, out: str, step: int | None = None, dtype: str = "bf16",
               max_shard_bytes: int = 14 * 10**6, overwrite: bool = False) -> str:
    """Exports checkpoint `step` (default latest) of a run directory (`python -m qmtp.train.export`)."""
    import jax
    import jax.numpy as jnp

    from qmtp.model import checkpoint
    from qmtp.train import data as train_data, loss as train_loss
    from qmtp.train.checkpoints import DATA_DIR, restore
    from qmtp.train.hyper import float_tree, Hyper
    with open(os.path.join(run_dir, "run_config.json")) as f:
        rc = json.load(f)
    tokenizer = train_data.prepare(os.path.join(run_dir, DATA_DIR), vocab_size=None).tokenizer
    hp = Hyper(rc["steps"], rc["learning_rate"], rc["warmup_steps"], rc["min_lr_ratio"], rc["weight_decay"],
               rc["grad_clip"], rc["adam_b1"], rc["adam_b2"], rc["mtp_loss_weight"], rc["compute_dtype"],
               rc["train_mtp_only"])
    if rc["train_mtp_only"]:
        cfg, params = checkpoint.load(rc["init_checkpoint"], dtype=rc["compute_dtype"], progress=False)
        trainable = {"mtp": float_tree(params["mtp"])}
    else:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
        cfg = qconfig.from_dict(config, source=run_dir)
        trainable = jax.tree_util.tree_map(jnp.asarray, train_loss.init_params(cfg, 0))
    got = restore(run_dir, {"params": trainable, "opt_state": hp.optimizer().init(trainable), "step": jnp.int32(0)},
                  step)
    host = jax.device_get(got["params"])
    if rc["train_mtp_only"]:
        return write_back_mtp(rc["init_checkpoint"], out, cfg, host["mtp"], overwrite=overwrite)
    return export_checkpoint(out, config, host, tokenizer, dtype, max_shard_bytes, overwrite=overwrite)


# ---- command line -------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """python -m qmtp.train.export --run_dir=RUN --out=DIR: exports a qmtp.train run's latest checkpoint."""
    from absl import flags
    fv = flags.FlagValues()
    flags.DEFINE_string("run_dir", None, "Run directory of qmtp.train (its --out_dir).", flag_values=fv)
    flags.DEFINE_string("out", None, "Output checkpoint directory (written atomically).", flag_values=fv)
    flags.DEFINE_enum("dtype", "bf16", list(DTYPES), "Storage dtype of every tensor (joint runs).", flag_values=fv)
    flags.DEFINE_string("max_shard_bytes", "14MB", "Largest safetensors file (bytes or 14MB / 10MiB).",
                        flag_values=fv)
    flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "Replace --out if it exists.", flag_values=fv)
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        print(f"usage: python -m qmtp.train.export --run_dir=RUN --out=DIR [flags]\n\n{main.__doc__}\n\nflags:\n"
              f"{fv.get_help(prefix='  ', include_special_flags=False)}")
        return 0
    try:
        fv(argv)
        if not fv.run_dir or not fv.out:
            raise ValueError("--run_dir and --out are required")
        path = export_run(fv.run_dir, fv.out, step=fv.step, dtype=fv.dtype,
                                            max_shard_bytes=parse_size(fv.max_shard_bytes), overwrite=fv.overwrite)
    except (flags.Error, ValueError, FileExistsError) as e:
        print(f"export: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
