"""Hugging Face-format export of a trained model, and the MTP write-back of `--train_mtp_only`.

`export_checkpoint(out_dir, config, params, tokenizer)` writes what `qmtp.load` reads strictly and
HF transformers' Qwen3_5ForCausalLM loads (it ignores `mtp.*`):

    config.json              the Qwen3.5 VLM-wrapper layout of qmtp.tools.make_checkpoint
    model.safetensors        or model-0000i-of-0000N.safetensors + model.safetensors.index.json beyond
                             max_shard_bytes; names and HF shapes from `params.tensor_table`; BF16 or F32
    tokenizer.json, tokenizer_config.json (ChatML chat template), generation_config.json
                             (eos [<|im_end|>, <|endoftext|>], bos = pad = <|endoftext|>)

`write_back_mtp(src_dir, out_dir, cfg, mtp_params)` copies a checkpoint directory and overwrites in
place the bytes of every `mtp.*` tensor in its own stored format (FP8 re-quantized): every other
tensor stays bit-identical. Both write a temporary directory beside `out_dir`, then rename it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import types
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import flags

from qmtp.cli_help import check_output_dir
from qmtp.model import checkpoint, config as qconfig, params as P
from qmtp.tools import checkpoint_writer, tiny_tokenizer
from qmtp.tools.make_checkpoint import parse_size, write_json
from qmtp.train import loss as train_loss
from qmtp.train.checkpoints import DATA_DIR, restore
from qmtp.train.data import prepare, special_ids
from qmtp.train.flags import cli
from qmtp.train.hyper import float_tree, Hyper

DTYPES = {"bf16": "BF16", "fp32": "F32"}
_NP = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}
DEFAULT_MAX_SHARD_BYTES = 14 * 10**6


@contextlib.contextmanager
def _atomic_dir(out_dir: str, overwrite: bool):
    """A temporary directory beside `out_dir`, renamed to it when the block succeeds."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.exists(out_dir):
            if not overwrite:
                raise FileExistsError(f"{out_dir} exists (pass overwrite=True / --overwrite)")
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hf_value(tree: dict, entry: P.TensorEntry) -> np.ndarray:
    """float32 [HF shape] of one tensor_table entry (the inverse of params.place): params keep the
    HF layout except conv [C, W] -> [C, 1, W]."""
    if entry.role in (P.FUSED_QKVZ, P.FUSED_BA):
        raise ValueError(f"{entry.name}: exporting fused Qwen3-Next projections is not supported")
    if entry.group in (None, "mtp"):
        leaf = (tree if entry.group is None else tree["mtp"])[entry.key]
    else:
        leaf = (tree["mtp"]["layers"] if entry.group == "mtp_layers" else tree[entry.group])[entry.index][entry.key]
    value = np.asarray(leaf, np.float32)
    if entry.role == P.CONV:
        value = value[:, None, :]
    if value.shape != entry.shape:
        raise ValueError(f"{entry.name}: parameter shape {value.shape}, expected {entry.shape}")
    return value


def export_checkpoint(out_dir: str, config: dict, params: dict, tokenizer, dtype: str = "bf16",
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> str:
    """Writes the HF directory (module doc) of `params` (any float dtype, host or device arrays)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: supported {sorted(DTYPES)}")
    cfg = qconfig.from_dict(config, source="export config")
    vocab = tokenizer.get_vocab_size()
    if vocab != cfg.vocab_size:
        raise ValueError(f"tokenizer has {vocab} ids, the model {cfg.vocab_size}")
    ids = special_ids(tokenizer)
    if ids != tiny_tokenizer.special_token_ids(vocab):
        raise ValueError("the tokenizer's special tokens are not its last three ids (qmtp.train.data layout)")
    eot, im_end = ids[tiny_tokenizer.ENDOFTEXT], ids[tiny_tokenizer.IM_END]
    config = dict(config, dtype="float32" if dtype == "fp32" else "bfloat16")
    config["text_config"] = dict(config["text_config"], dtype=config["dtype"])
    shards = checkpoint_writer.shard_units(checkpoint_writer.plan_tensors(cfg, dtype), max_shard_bytes)
    names = checkpoint_writer.shard_file_names(len(shards))

    def chunks(t: checkpoint_writer.StoredTensor) -> list[np.ndarray]:  # a TensorSource: one chunk per tensor
        return [np.ascontiguousarray(hf_value(params, t.entry).astype(_NP[t.dtype]))]
    with _atomic_dir(out_dir, overwrite) as tmp:
        write_json(os.path.join(tmp, "config.json"), config)
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        write_json(os.path.join(tmp, "tokenizer_config.json"),
                    tiny_tokenizer.tokenizer_config(vocab, config["text_config"]["max_position_embeddings"]))
        write_json(os.path.join(tmp, "generation_config.json"),
                    {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": False})
        for name, shard in zip(names, shards):
            checkpoint_writer.write_safetensors(os.path.join(tmp, name), shard, types.SimpleNamespace(chunks=chunks))
        if len(shards) > 1:
            write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
                         "weight_map": {t.name: n for n, s in zip(names, shards) for t in s}})
    return os.path.abspath(out_dir)


def write_back_mtp(src_dir: str, out_dir: str, cfg: qconfig.ModelConfig, mtp_params: dict,
                   overwrite: bool = False) -> str:
    """A copy of `src_dir` whose mtp.* tensors hold `mtp_params` (module doc)."""
    headers, new = checkpoint.read_headers(src_dir), {}  # new: name -> stored bytes
    for entry in P.tensor_table(cfg):
        if entry.group not in ("mtp", "mtp_layers"):
            continue
        value, stored = hf_value({"mtp": mtp_params}, entry), headers[entry.name].dtype
        if stored == "F8_E4M3":
            scale_dtype = "bf16" if headers[entry.name + "_scale_inv"].dtype == "BF16" else "fp32"
            q, scale = checkpoint_writer.quantize_stored(value, scale_dtype)
            new[entry.name], new[entry.name + "_scale_inv"] = q.tobytes(), scale.tobytes()
        elif stored in _NP:
            new[entry.name] = value.astype(_NP[stored]).tobytes()
        else:
            raise ValueError(f"{entry.name}: cannot write a {stored} tensor")
    with _atomic_dir(out_dir, overwrite) as tmp:
        os.rmdir(tmp)
        shutil.copytree(src_dir, tmp)
        for file in sorted({headers[n].file for n in new}):
            with open(os.path.join(tmp, file), "r+b") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                for name in sorted(new.keys() & header.keys()):
                    (lo, hi), data = header[name]["data_offsets"], new[name]
                    if hi - lo != len(data):
                        raise ValueError(f"{name}: {len(data)} new bytes for a {hi - lo}-byte tensor")
                    f.seek(8 + n + lo)
                    f.write(data)
    return os.path.abspath(out_dir)


def export_run(run_dir: str, out: str, step: int | None = None, dtype: str = "bf16",
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> str:
    """Exports checkpoint `step` (default latest) of a run directory; a --train_mtp_only run's MTP
    tensors are written back into a copy of its --init_checkpoint."""
    with open(os.path.join(run_dir, "run_config.json")) as f:
        rc = json.load(f)
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
    tokenizer = prepare(os.path.join(run_dir, DATA_DIR), vocab_size=None).tokenizer
    return export_checkpoint(out, config, host, tokenizer, dtype, max_shard_bytes, overwrite=overwrite)


def main(argv: Sequence[str] | None = None) -> int:
    """python -m qmtp.train.export --run_dir=RUN --out=DIR: exports a qmtp.train run's latest checkpoint."""
    def define(fv: flags.FlagValues) -> None:
        kw = {"flag_values": fv}
        flags.DEFINE_string("run_dir", None, "Run directory of qmtp.train (its --out_dir).", **kw)
        flags.DEFINE_string("out", None, "Output checkpoint directory (written atomically).", **kw)
        flags.DEFINE_enum("dtype", "bf16", list(DTYPES), "Storage dtype of every tensor (joint runs).", **kw)
        flags.DEFINE_string("max_shard_bytes", "14MB", "Largest safetensors file (bytes or 14MB / 10MiB).", **kw)
        flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).", **kw)
        flags.DEFINE_bool("overwrite", False, "Replace --out if it exists.", **kw)

    def body(fv) -> str:
        if not fv.run_dir or not fv.out:
            raise ValueError("--run_dir and --out are required")
        check_output_dir("out", fv.out)  # before the checkpoint is restored: the write comes last
        if os.path.exists(fv.out) and not fv.overwrite:
            raise ValueError(f"--out={fv.out} exists (pass --overwrite to replace it)")
        if not os.path.isfile(os.path.join(fv.run_dir, "run_config.json")):
            raise ValueError(f"--run_dir={fv.run_dir}: {fv.run_dir} is not a qmtp.train run directory "
                             "(no run_config.json)")
        return "wrote " + export_run(fv.run_dir, fv.out, step=fv.step, dtype=fv.dtype,
                                     max_shard_bytes=parse_size(fv.max_shard_bytes), overwrite=fv.overwrite)
    usage = f"usage: python -m qmtp.train.export --run_dir=RUN --out=DIR [flags]\n\n{main.__doc__}\n"
    return cli(argv, define, usage, "export", body)


if __name__ == "__main__":
    sys.exit(main())
