"""Writes synthetic Hugging Face checkpoints in the released Qwen3.5 layout:

    python -m qmtp.tools.make_checkpoint --preset=tiny --dtype=bf16 --seed=0 --out=DIR

DIR gets config.json (qmtp_synthetic says how it was made), model.safetensors (HF's shards + index beyond
--max_shard_bytes), generation_config.json and the tiny tokenizer's files. bf16 / fp32 store every tensor of
`params.tensor_table` BF16 / F32; fp8 stores the projections MODEL_SPEC §5.2 quantizes as F8_E4M3 +
weight_scale_inv, A_log / dt_bias F32, the rest BF16. The dtypes of one preset and seed are twins.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Sequence

from absl import flags

from qmtp.model import config as qconfig, fp8
from qmtp.tools import presets, tiny_tokenizer
from qmtp.tools.checkpoint_writer import (is_fp8_eligible, MODULES_TO_NOT_CONVERT,  # noqa: F401 (tests use mc.*)
                                          plan_tensors, Progress, shard_file_names, shard_units, TensorSource,
                                          write_safetensors)

DTYPES = ("bf16", "fp8", "fp32")
SCALE_DTYPES = ("fp32", "bf16")
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
PROGRESS_MIN_BYTES = 256 * 2**20  # report progress on stderr for checkpoints at least this big
PRESET_PREFIX = "preset:"  # --checkpoint=preset:NAME[:DTYPE] in the command lines


class CheckpointWriteError(ValueError):
    """Bad arguments or an unusable output location; the message is one line."""


def build_config(preset: str = "tiny", dtype: str = "bf16", seed: int = 0, num_layers: int | None = None) -> dict:
    """The config.json dict of a synthetic checkpoint: the Qwen3.5 VLM-wrapper layout, or the flat one of
    a Qwen3-Next preset."""
    spec = presets.get_preset(preset)
    text = spec.text_config(num_layers)
    text["dtype"] = "float32" if dtype == "fp32" else "bfloat16"
    note = "random weights; text only (no vision tower)"
    synthetic = {"generator": "qmtp.tools.make_checkpoint", "generator_version": presets.GENERATOR_VERSION,
                 "preset": preset, "dtype": dtype, "seed": seed, "num_layers": text["num_hidden_layers"],
                 "tokenizer_vocab_size": spec.tokenizer_vocab_size, "note": note,
                 **spec.weights_cls.synthetic_metadata(spec.tokenizer_vocab_size, seed)}
    if text["vocab_size"] > spec.tokenizer_vocab_size:
        synthetic["note"] += (f"; ids >= {spec.tokenizer_vocab_size} are vocabulary padding "
                              "(no tokenizer entry, zero lm_head rows)")
    if text["model_type"] == "qwen3_next":
        config = dict(text, architectures=["Qwen3NextForCausalLM"], qmtp_synthetic=synthetic)
        if dtype == "fp8":
            config["quantization_config"] = _fp8_quantization()
        return config
    moe = text["model_type"] == "qwen3_5_moe_text"
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              "model_type": "qwen3_5_moe" if moe else "qwen3_5",
              "tie_word_embeddings": text["tie_word_embeddings"], "dtype": text["dtype"], "text_config": text,
              "qmtp_synthetic": synthetic}
    if dtype == "fp8":
        config["quantization_config"] = _fp8_quantization()
    return config


def _fp8_quantization() -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [fp8.FP8_BLOCK, fp8.FP8_BLOCK], "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}


def write_json(path: str, obj: dict) -> None:
    """JSON as every HF file qmtp writes it: indented, sorted keys, a final newline."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _is_nonempty_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


def _publish(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Renames the finished temp dir to out_dir (replacing an old one when `overwrite`)."""
    old = None
    if _is_nonempty_dir(out_dir):
        if not overwrite:
            raise FileExistsError(f"{out_dir} appeared while writing and is not empty")
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "checkpoint"))
    elif os.path.isdir(out_dir):
        os.rmdir(out_dir)
    try:
        os.rename(tmp, out_dir)
    except OSError as e:
        if old:  # put the previous checkpoint back
            os.rename(os.path.join(old, "checkpoint"), out_dir)
            os.rmdir(old)
        raise FileExistsError(f"{out_dir}: could not move the new checkpoint into place ({e.strerror})") from None
    if old:
        shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(out_dir: str, preset: str = "tiny", dtype: str = "bf16", seed: int = 0,
                     num_layers: int | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     overwrite: bool = False, *, fp8_scale_dtype: str = "fp32",
                     progress: bool | None = None) -> str:
    """Writes a synthetic checkpoint to `out_dir` atomically (a temp dir beside it, renamed) and returns its
    absolute path. num_layers: a slice of the preset's decoder layers (None: all); progress: on stderr (None:
    for checkpoints >= 256 MiB). Refuses a non-empty `out_dir` (FileExistsError) unless `overwrite`."""
    spec = presets.get_preset(preset)
    if dtype not in DTYPES:
        raise CheckpointWriteError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    if fp8_scale_dtype not in SCALE_DTYPES:
        raise CheckpointWriteError(f"fp8_scale_dtype={fp8_scale_dtype!r}: must be one of {', '.join(SCALE_DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise CheckpointWriteError(f"seed={seed!r}: must be a non-negative int")
    if num_layers is not None and (not isinstance(num_layers, int) or num_layers < 1):
        raise CheckpointWriteError(f"num_layers={num_layers!r}: must be a positive int (or None)")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise CheckpointWriteError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive int")
    config = build_config(preset, dtype, seed, num_layers)
    cfg = qconfig.from_dict(config, source=f"preset {preset}")
    shards = shard_units(plan_tensors(cfg, dtype, fp8_scale_dtype), max_shard_bytes)
    total = sum(t.nbytes for s in shards for t in s)

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointWriteError(f"{out_dir} exists and is not a directory")
    if _is_nonempty_dir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True / --overwrite)")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < total + 64 * 2**20:
        raise CheckpointWriteError(f"not enough disk space in {parent}: need {total / 1e9:.2f} GB, "
                                   f"{free / 1e9:.2f} GB free")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        vocab = spec.tokenizer_vocab_size
        ids = tiny_tokenizer.special_token_ids(vocab)
        eot, im_end = ids[tiny_tokenizer.ENDOFTEXT], ids[tiny_tokenizer.IM_END]
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, "generation_config.json"),  # Qwen's stop ids, bos = pad = <|endoftext|>
                    {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": False})
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            f.write(tiny_tokenizer.tokenizer_json(vocab))
        write_json(os.path.join(tmp, "tokenizer_config.json"),
                    tiny_tokenizer.tokenizer_config(vocab, config.get("text_config", config)["max_position_embeddings"]))
        source = TensorSource(spec.weights(cfg, seed), fp8_scale_dtype)
        show = total >= PROGRESS_MIN_BYTES if progress is None else progress
        bar = Progress(total, sum(map(len, shards))) if show else None
        names = shard_file_names(len(shards))
        for name, shard in zip(names, shards):
            write_safetensors(os.path.join(tmp, name), shard, source, bar)
        if len(shards) > 1:
            write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total},
                         "weight_map": {t.name: name for name, s in zip(names, shards) for t in s}})
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_cache_dir() -> str:
    """$QMTP_CACHE, else ~/.cache/qmtp."""
    return os.environ.get("QMTP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qmtp")


def ensure_preset(preset: str = "tiny", dtype: str = "bf16", seed: int = 0, cache_dir: str | None = None,
                  num_layers: int | None = None) -> str:
    """The cached checkpoint directory of (preset, dtype, seed[, num_layers]), under
    `cache_dir or default_cache_dir()`/checkpoints, written on first use (never touches the network).
    Safe against concurrent callers: the loser of the final rename reuses the winner's."""
    layers = f"-L{num_layers}" if num_layers is not None else ""
    path = os.path.join(cache_dir or default_cache_dir(), "checkpoints",
                        f"{preset}-{dtype}-seed{seed}{layers}-gen{presets.GENERATOR_VERSION}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    try:
        return write_checkpoint(path, preset, dtype, seed, num_layers)
    except FileExistsError:
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise


def resolve_checkpoint(spec: str, num_layers: int | None = None) -> str:
    """A directory, or preset:NAME[:DTYPE] built on first use (num_layers: a slice of the preset)."""
    if not spec.startswith(PRESET_PREFIX):
        if num_layers is not None:
            raise ValueError("--num_layers slices synthetic presets only")
        return spec
    parts = spec[len(PRESET_PREFIX):].split(":")
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"--checkpoint={spec!r}: expected preset:NAME or preset:NAME:DTYPE")
    return ensure_preset(parts[0], dtype=parts[1] if len(parts) == 2 else "bf16", num_layers=num_layers)


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'4294967296', '4GiB', '500MB', '64kib' -> bytes (positive int)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _SIZE_UNITS or int(float(m.group(1)) * _SIZE_UNITS[unit]) < 1:
        raise CheckpointWriteError(f"--max_shard_bytes={text!r}: expected a positive size like 4294967296, "
                                   "4GiB or 500MB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def define_flags(fv: flags.FlagValues) -> None:
    """The CLI flags, on a private FlagValues (importing this module defines no global flags)."""
    kw = {"flag_values": fv}
    flags.DEFINE_enum("preset", "tiny", list(presets.PRESETS), "Model to write. " + "; ".join(
        f"{p.name}: {p.description}" for p in presets.PRESETS.values()), **kw)
    flags.DEFINE_enum("dtype", "bf16", list(DTYPES),
                      "Storage: bf16 (all BF16), fp8 (block-FP8 E4M3 projections + weight_scale_inv, rest BF16, "
                      "A_log/dt_bias F32), fp32 (all F32, for tests). Same seed = same underlying weights.", **kw)
    flags.DEFINE_integer("seed", 0, "Seed of the random weights (non-negative).", lower_bound=0, **kw)
    flags.DEFINE_string("out", None, "Output directory (required); written atomically via a temp dir beside it.", **kw)
    flags.DEFINE_integer("num_layers", None, "Keep only the first N decoder layers' pattern: interval pattern of "
                         "the preset, or [linear]*(N-1)+[full] when N is below the interval. Default: all.",
                         lower_bound=1, **kw)
    flags.DEFINE_string("max_shard_bytes", "4GiB", "Largest safetensors file before sharding into "
                        "model-0000i-of-0000N.safetensors + index.json; bytes or with a unit (4GiB, 500MB).", **kw)
    flags.DEFINE_enum("fp8_scale_dtype", "fp32", list(SCALE_DTYPES),
                      "Dtype of weight_scale_inv in --dtype=fp8 checkpoints.", **kw)
    flags.DEFINE_bool("overwrite", False, "Replace --out if it exists and is not empty (otherwise an error).", **kw)


def _fail(message: str) -> int:
    print(f"make_checkpoint: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 usage error, 1 write failure)."""
    argv = list(sys.argv if argv is None else argv)
    fv = flags.FlagValues()
    define_flags(fv)
    args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if any(a in ("-h", "-help", "--help", "--helpshort", "--helpfull", "-?") for a in args):
        print(f"usage: python -m qmtp.tools.make_checkpoint --out=DIR [flags]\n\n"
              f"Writes a synthetic Qwen3.5-layout Hugging Face checkpoint (config, safetensors, tokenizer).\n\n"
              f"flags:\n{fv.get_help(prefix='  ', include_special_flags=False)}\n")
        return 0
    try:
        rest = fv(argv)
    except flags.Error as e:
        return _fail(str(e).splitlines()[0])
    if len(rest) > 1:
        return _fail(f"unexpected positional arguments: {' '.join(rest[1:])}")
    if not fv.out:
        return _fail("--out is required (the checkpoint directory to write)")
    try:
        start = time.monotonic()
        path = write_checkpoint(fv.out, fv.preset, fv.dtype, fv.seed, fv.num_layers, parse_size(fv.max_shard_bytes),
                                fv.overwrite, fp8_scale_dtype=fv.fp8_scale_dtype)
    except (ValueError, FileExistsError) as e:
        return _fail(str(e).splitlines()[0])
    except OSError as e:
        print(f"make_checkpoint: error: {e}", file=sys.stderr)
        return 1
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    print(f"wrote {path} ({size / 1e9:.3f} GB) in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
