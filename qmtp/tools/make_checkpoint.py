"""Writes synthetic Hugging Face-format checkpoints in the released Qwen3.5 layout.

    python -m qmtp.tools.make_checkpoint --preset=tiny --dtype=bf16 --seed=0 --out=DIR

DIR gets:
  config.json              model_type qwen3_5 (VLM wrapper), text fields under text_config; for
                           --dtype=fp8 also quantization_config (fp8, e4m3, dynamic, [128, 128] blocks);
                           qmtp_synthetic says how it was made (preset, dtype, seed, layers; controlled
                           presets add controlled.permutation, see presets.ControlledWeights)
  model.safetensors        or model-0000i-of-0000N.safetensors + model.safetensors.index.json when
                           the tensors exceed --max_shard_bytes (HF's layout: metadata.total_size,
                           weight_map name -> file)
  generation_config.json   bos_token_id and eos_token_id [<|im_end|>, <|endoftext|>]
  tokenizer.json, tokenizer_config.json   the tiny byte-level BPE of qmtp.tools.tiny_tokenizer

The tensor list comes only from `qmtp.params.tensor_table` of the config written. Storage per --dtype:
  bf16 / fp32: every tensor BF16 / F32.
  fp8: the projections MODEL_SPEC §5.2 quantizes (self_attn q/k/v/o, linear_attn in_proj_qkv /
       in_proj_z / out_proj, mlp gate/up/down, and those of mtp.layers.*) become F8_E4M3 `X.weight`
       plus `X.weight_scale_inv` (F32, or BF16 with --fp8_scale_dtype=bf16; shape
       qmtp.fp8.scale_grid(out, in)); A_log and dt_bias are F32; everything else (embeddings,
       lm_head, norms, conv1d, in_proj_b/a, mtp.fc) BF16.
The three dtypes of one preset and seed are twins: the same underlying weights (qmtp.tools.presets),
bf16 == fp32 exactly and fp8 = qmtp.fp8.quantize_np of them.

Files are written tensor by tensor into a temporary directory beside DIR, which is then renamed to
DIR: a checkpoint directory is either complete or absent. Python API: `write_checkpoint`, and
`ensure_preset` for a cached copy under $QMTP_CACHE (default ~/.cache/qmtp).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Iterator, Sequence, TextIO

import ml_dtypes  # registers bfloat16 / float8 with numpy; keep before any safetensors import
import numpy as np
from absl import flags

from qmtp import config as qconfig
from qmtp import fp8, params
from qmtp.tools import presets, tiny_tokenizer

DTYPES = ("bf16", "fp8", "fp32")
SCALE_DTYPES = ("fp32", "bf16")
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
PROGRESS_MIN_BYTES = 256 * 2**20  # report progress on stderr for checkpoints at least this big

# Module names (substrings, as transformers matches them) an FP8 checkpoint keeps unquantized:
# MODEL_SPEC §5.2's list for the official Qwen3.6-27B-FP8 plus the MTP glue (mtp.fc and its norms).
MODULES_TO_NOT_CONVERT = (
    "lm_head", "model.language_model.embed_tokens", "model.language_model.norm",
    "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
    "linear_attn.A_log", "linear_attn.conv1d", "linear_attn.dt_bias", "linear_attn.in_proj_ba",
    "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.norm",
    "mtp.fc", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm",
)

# safetensors dtype string -> numpy dtype
_NP_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
              "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
_STORAGE = {"bf16": "BF16", "fp32": "F32"}


class CheckpointWriteError(ValueError):
    """Bad arguments or an unusable output location; the message is one line."""


# --------------------------------------------------------------------------------------------------
# config files
# --------------------------------------------------------------------------------------------------


def build_config(preset: str = "tiny", dtype: str = "bf16", seed: int = 0, num_layers: int | None = None) -> dict:
    """The config.json dict (Qwen3.5 VLM-wrapper layout) of a synthetic checkpoint."""
    spec = presets.get_preset(preset)
    text = spec.text_config(num_layers)
    text["dtype"] = "float32" if dtype == "fp32" else "bfloat16"
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": text["tie_word_embeddings"],
        "dtype": text["dtype"],
        "text_config": text,
        "qmtp_synthetic": {
            "generator": "qmtp.tools.make_checkpoint", "generator_version": presets.GENERATOR_VERSION,
            "preset": preset, "dtype": dtype, "seed": seed, "num_layers": text["num_hidden_layers"],
            "tokenizer_vocab_size": spec.tokenizer_vocab_size,
            "note": "random weights; text only (no vision tower)",
        },
    }
    config["qmtp_synthetic"].update(spec.metadata(seed))  # e.g. a controlled preset's permutation
    if text["vocab_size"] > spec.tokenizer_vocab_size:
        config["qmtp_synthetic"]["note"] += (f"; ids >= {spec.tokenizer_vocab_size} are vocabulary padding "
                                             "(no tokenizer entry, zero lm_head rows)")
    if dtype == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [fp8.FP8_BLOCK, fp8.FP8_BLOCK],
            "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT),
        }
    return config


def generation_config(vocab_size: int) -> dict:
    """generation_config.json: Qwen's stop ids [<|im_end|>, <|endoftext|>] of the tiny tokenizer."""
    bos = tiny_tokenizer.bos_token_id(vocab_size)
    return {"bos_token_id": bos, "eos_token_id": tiny_tokenizer.eos_token_ids(vocab_size), "pad_token_id": bos,
            "do_sample": False}


# --------------------------------------------------------------------------------------------------
# what is stored
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One safetensors entry. `part`: 'value' (the table tensor itself), 'fp8_weight' or 'fp8_scale'."""

    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    entry: params.TensorEntry
    part: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _NP_DTYPES[self.dtype].itemsize


def is_fp8_eligible(entry: params.TensorEntry) -> bool:
    """True iff an FP8 checkpoint stores this tensor as E4M3 + weight_scale_inv (MODEL_SPEC §5.2)."""
    module = entry.name.removesuffix(".weight")
    return (entry.role in (params.LINEAR, params.FUSED_QKVZ) and entry.name.endswith(".weight")
            and not any(pattern in module for pattern in MODULES_TO_NOT_CONVERT))


def plan_tensors(cfg: qconfig.ModelConfig, dtype: str, fp8_scale_dtype: str = "fp32") -> list[list[StoredTensor]]:
    """The stored tensors of every `tensor_table(cfg)` entry, in table order; an FP8 weight and its
    scale form one unit (kept in one shard, weight first)."""
    units = []
    for entry in params.tensor_table(cfg):
        if dtype != "fp8":
            units.append([StoredTensor(entry.name, _STORAGE[dtype], entry.shape, entry, "value")])
        elif is_fp8_eligible(entry):
            grid = fp8.scale_grid(*entry.shape)
            units.append([StoredTensor(entry.name, "F8_E4M3", entry.shape, entry, "fp8_weight"),
                          StoredTensor(entry.name + "_scale_inv", _STORAGE[fp8_scale_dtype], grid, entry, "fp8_scale")])
        else:
            stored = "F32" if entry.role == params.FP32 else "BF16"
            units.append([StoredTensor(entry.name, stored, entry.shape, entry, "value")])
    return units


def shard_units(units: Sequence[list[StoredTensor]], max_shard_bytes: int) -> list[list[StoredTensor]]:
    """Greedy in-order sharding like HF: a unit that does not fit starts a new shard; a unit larger
    than the limit gets a shard of its own."""
    shards: list[list[StoredTensor]] = []
    current: list[StoredTensor] = []
    size = 0
    for unit in units:
        unit_bytes = sum(t.nbytes for t in unit)
        if current and size + unit_bytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current += unit
        size += unit_bytes
    if current:
        shards.append(current)
    return shards


def shard_file_names(n_shards: int) -> list[str]:
    """HF file names: model.safetensors for one shard, model-0000i-of-0000N.safetensors otherwise."""
    if n_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]


# --------------------------------------------------------------------------------------------------
# values -> stored arrays
# --------------------------------------------------------------------------------------------------


_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(fp8.FP8_DTYPE).astype(np.float32)  # code -> value


def _dequantize(codes: np.ndarray, scale: np.ndarray, np_dtype: np.dtype) -> np.ndarray:
    """`fp8.dequantize_np(codes, scale)` cast to `np_dtype` (bit-identical; exact for the presets' FP8
    values), computed per 128-row block in threads. codes: [R, I] E4M3; scale: [ceil(R/128), ceil(I/128)]."""
    block, (n_rows, n_cols) = fp8.FP8_BLOCK, codes.shape
    codes, scale = codes.view(np.uint8), np.asarray(scale, np.float32)
    out = np.empty(codes.shape, np_dtype)

    def work(b: int) -> None:
        lo, hi = b * block, min(n_rows, (b + 1) * block)
        column_scale = np.repeat(scale[b], block)[:n_cols]  # [I]
        out[lo:hi] = (_E4M3_VALUES[codes[lo:hi]] * column_scale).astype(np_dtype)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(work, range(-(-n_rows // block))))
    return out


def _quantize(value: np.ndarray | fp8.Fp8Block, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 [O, I], scale grid in the stored dtype). Float values go through `fp8.quantize_np`; with
    bf16 scales the codes are recomputed against the bf16-rounded scales (dequant stays consistent)."""
    if isinstance(value, fp8.Fp8Block):
        q, scale = np.asarray(value.weight), np.asarray(value.scale, np.float32)
    else:
        w = np.asarray(value, np.float32)
        q, scale = fp8.quantize_np(w)
        if scale_dtype == "bf16":
            scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
            expanded = np.repeat(np.repeat(scale, fp8.FP8_BLOCK, 0), fp8.FP8_BLOCK, 1)[:w.shape[0], :w.shape[1]]
            q = np.clip(w / expanded, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(fp8.FP8_DTYPE)
    return q, scale.astype(_NP_DTYPES[_STORAGE[scale_dtype]])


class TensorSource:
    """Produces the stored bytes of each `StoredTensor` from a preset's weight generator, in chunks.

    `chunks(t)` yields, in file order, C-contiguous arrays of t's stored dtype, or an int n meaning n
    zero bytes (written as a hole). Lazy `presets.HashedNormal` values are drawn `CHUNK_BYTES` at a
    time, so memory stays bounded by a few chunks plus the largest non-lazy tensor.
    """

    CHUNK_BYTES = 64 * 2**20

    def __init__(self, weights: presets.WeightFn, fp8_scale_dtype: str = "fp32"):
        self.weights, self.fp8_scale_dtype = weights, fp8_scale_dtype
        self._scales: dict[str, np.ndarray] = {}  # scale of an FP8 weight already produced

    def chunks(self, t: StoredTensor) -> Iterator[np.ndarray | int]:
        if t.part == "fp8_scale":
            if t.entry.name not in self._scales:
                raise RuntimeError(f"{t.name}: scale requested before its weight")
            yield self._checked(t, self._scales.pop(t.entry.name))
            return
        value = self.weights(t.entry, is_fp8_eligible(t.entry))
        if isinstance(value, presets.HashedNormal) and (value.fp8 or t.part == "value"):
            yield from self._lazy_chunks(t, value)
            return
        if isinstance(value, presets.HashedNormal):
            value = value.materialize()
        if t.part == "fp8_weight":
            arr, self._scales[t.entry.name] = _quantize(value, self.fp8_scale_dtype)
        elif isinstance(value, fp8.Fp8Block):
            arr = _dequantize(np.asarray(value.weight), np.asarray(value.scale), _NP_DTYPES[t.dtype])
        else:
            arr = np.asarray(value).astype(_NP_DTYPES[t.dtype], copy=False)
        yield self._checked(t, arr)

    def _lazy_chunks(self, t: StoredTensor, value: presets.HashedNormal) -> Iterator[np.ndarray | int]:
        """Row blocks (multiples of 128 rows) of a lazy tensor; all-zero trailing rows as one hole."""
        if value.shape != t.shape:
            raise RuntimeError(f"{t.name}: generator gave shape {list(value.shape)}, expected {list(t.shape)}")
        out_dtype, block = _NP_DTYPES[t.dtype], fp8.FP8_BLOCK
        if t.part == "fp8_weight":
            self._scales[t.entry.name] = value.scale.astype(_NP_DTYPES[_STORAGE[self.fp8_scale_dtype]])
        o, i = value.shape
        step = max(block, self.CHUNK_BYTES // (i * out_dtype.itemsize) // block * block)
        for lo in range(0, value.zero_from, step):
            hi = min(value.zero_from, lo + step)
            rows = value.rows(lo, hi)  # [hi - lo, I] E4M3 codes or bf16
            if value.fp8 and t.part == "value":
                rows = _dequantize(rows, value.scale[lo // block: -(-hi // block)], out_dtype)
            yield self._checked(t, rows.astype(out_dtype, copy=False), rows=hi - lo)
        if value.zero_from < o:
            yield (o - value.zero_from) * i * out_dtype.itemsize

    @staticmethod
    def _checked(t: StoredTensor, arr: np.ndarray, rows: int | None = None) -> np.ndarray:
        """arr as C-contiguous after checking it is (a row block of) t's dtype and shape."""
        want = t.shape if rows is None else (rows, *t.shape[1:])
        if arr.shape != want or arr.dtype != _NP_DTYPES[t.dtype]:
            raise RuntimeError(f"{t.name}: generator gave {arr.dtype}{list(arr.shape)}, "
                               f"expected {t.dtype}{list(want)}")
        return np.ascontiguousarray(arr)


# --------------------------------------------------------------------------------------------------
# writing files
# --------------------------------------------------------------------------------------------------


def safetensors_header(tensors: Sequence[StoredTensor]) -> bytes:
    """8-byte little-endian length + JSON header (space-padded so the data starts 8-aligned)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


class Progress:
    """Tensors / bytes written, on a stream (stderr), at most every `every_s` seconds."""

    def __init__(self, total_bytes: int, total_tensors: int, enabled: bool, stream: TextIO | None = None,
                 every_s: float = 2.0):
        self.total_bytes, self.total_tensors, self.enabled = total_bytes, total_tensors, enabled
        self.stream, self.every_s = stream or sys.stderr, every_s
        self.bytes = self.tensors = 0
        self.start = self.last = time.monotonic()

    def add(self, t: StoredTensor, shard: str) -> None:
        self.bytes += t.nbytes
        self.tensors += 1
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every_s or self.tensors == self.total_tensors):
            self.last = now
            rate = self.bytes / max(now - self.start, 1e-9) / 1e6
            print(f"make_checkpoint: {self.tensors}/{self.total_tensors} tensors, {self.bytes / 1e9:.2f}/"
                  f"{self.total_bytes / 1e9:.2f} GB, {rate:.0f} MB/s, {shard}", file=self.stream, flush=True)


def write_safetensors(path: str, tensors: Sequence[StoredTensor], source: TensorSource,
                      progress: Progress | None = None) -> None:
    """Streams one safetensors file: header first (all sizes are known), then tensor by tensor, chunk
    by chunk; a writer thread writes chunk k while chunk k+1 is drawn."""
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:
        f.write(safetensors_header(tensors))
        pending = None
        for t in tensors:
            written = 0
            for chunk in source.chunks(t):
                written += chunk if isinstance(chunk, int) else chunk.nbytes
                if pending is not None:
                    pending.result()
                pending = writer.submit(_write_chunk, f, chunk)
            if written != t.nbytes:
                raise RuntimeError(f"{t.name}: produced {written} bytes, expected {t.nbytes}")
            if progress:
                progress.add(t, os.path.basename(path))
        if pending is not None:
            pending.result()
        f.truncate(f.tell())  # materializes a trailing hole


def _write_chunk(f: BinaryIO, chunk: np.ndarray | int) -> None:
    """Writes an array's bytes, or skips `chunk` bytes (a hole that reads back as zeros)."""
    if isinstance(chunk, int):
        f.seek(chunk, os.SEEK_CUR)
    else:
        f.write(chunk.reshape(-1).view(np.uint8).data)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_text_files(tmp: str, config: dict, vocab_size: int) -> None:
    """config.json, generation_config.json, tokenizer.json, tokenizer_config.json."""
    _write_json(os.path.join(tmp, "config.json"), config)
    _write_json(os.path.join(tmp, "generation_config.json"), generation_config(vocab_size))
    with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
        f.write(tiny_tokenizer.tokenizer_json(vocab_size))
    max_len = config["text_config"]["max_position_embeddings"]
    _write_json(os.path.join(tmp, "tokenizer_config.json"), tiny_tokenizer.tokenizer_config(vocab_size, max_len))


def _write_weights(tmp: str, shards: list[list[StoredTensor]], source: TensorSource, progress: Progress) -> None:
    """The safetensors file(s) and, for several shards, model.safetensors.index.json."""
    names = shard_file_names(len(shards))
    for name, shard in zip(names, shards):
        write_safetensors(os.path.join(tmp, name), shard, source, progress)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
                 "weight_map": {t.name: name for name, s in zip(names, shards) for t in s}}
        _write_json(os.path.join(tmp, "model.safetensors.index.json"), index)


# --------------------------------------------------------------------------------------------------
# the output directory
# --------------------------------------------------------------------------------------------------


def _is_nonempty_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


def _check_destination(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointWriteError(f"{out_dir} exists and is not a directory")
    if _is_nonempty_dir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True / --overwrite)")


def _check_disk_space(parent: str, needed: int) -> None:
    free = shutil.disk_usage(parent).free
    if free < needed + 64 * 2**20:
        raise CheckpointWriteError(f"not enough disk space in {parent}: need {needed / 1e9:.2f} GB, "
                                   f"{free / 1e9:.2f} GB free")


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


def _validate_args(preset: str, dtype: str, seed: int, num_layers: int | None, max_shard_bytes: int,
                   fp8_scale_dtype: str) -> None:
    presets.get_preset(preset)
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


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def write_checkpoint(out_dir: str, preset: str = "tiny", dtype: str = "bf16", seed: int = 0,
                     num_layers: int | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     overwrite: bool = False, *, fp8_scale_dtype: str = "fp32",
                     progress: bool | None = None) -> str:
    """Writes a synthetic checkpoint to `out_dir` atomically and returns its absolute path.

    preset: a name of `presets.PRESETS`; dtype: 'bf16' | 'fp8' | 'fp32'; num_layers: a slice of the
    preset's decoder layers (None: all); fp8_scale_dtype: 'fp32' | 'bf16' (weight_scale_inv);
    progress: stderr progress (None: only for checkpoints >= 256 MiB). Refuses an existing
    non-empty `out_dir` (FileExistsError) unless `overwrite`.
    """
    _validate_args(preset, dtype, seed, num_layers, max_shard_bytes, fp8_scale_dtype)
    spec = presets.get_preset(preset)
    config = build_config(preset, dtype, seed, num_layers)
    cfg = qconfig.from_dict(config, source=f"preset {preset}")
    shards = shard_units(plan_tensors(cfg, dtype, fp8_scale_dtype), max_shard_bytes)
    total = sum(t.nbytes for s in shards for t in s)

    out_dir = os.path.abspath(out_dir)
    _check_destination(out_dir, overwrite)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    _check_disk_space(parent, total)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        _write_text_files(tmp, config, spec.tokenizer_vocab_size)
        show = total >= PROGRESS_MIN_BYTES if progress is None else progress
        source = TensorSource(spec.weights(cfg, seed), fp8_scale_dtype)
        _write_weights(tmp, shards, source, Progress(total, sum(map(len, shards)), show))
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_cache_dir() -> str:
    """$QMTP_CACHE, else ~/.cache/qmtp."""
    return os.environ.get("QMTP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qmtp")


def preset_dir_name(preset: str, dtype: str, seed: int, num_layers: int | None = None) -> str:
    """Cache subdirectory name: preset, dtype, seed, layer slice and generator version."""
    layers = f"-L{num_layers}" if num_layers is not None else ""
    return f"{preset}-{dtype}-seed{seed}{layers}-gen{presets.GENERATOR_VERSION}"


def ensure_preset(preset: str = "tiny", dtype: str = "bf16", seed: int = 0, cache_dir: str | None = None,
                  num_layers: int | None = None) -> str:
    """The cached checkpoint directory of (preset, dtype, seed[, num_layers]), written on first use.

    Cache: `cache_dir` or `default_cache_dir()`, subdir checkpoints/<preset_dir_name>. Never touches
    the network. Safe against concurrent callers (the loser of the final rename reuses the winner's).
    """
    path = os.path.join(cache_dir or default_cache_dir(), "checkpoints",
                        preset_dir_name(preset, dtype, seed, num_layers))
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    try:
        return write_checkpoint(path, preset, dtype, seed, num_layers)
    except FileExistsError:
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise


# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------

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
    flags.DEFINE_enum("preset", "tiny", list(presets.PRESETS),
                      "Model to write. " + "; ".join(f"{p.name}: {p.description}" for p in presets.PRESETS.values()),
                      flag_values=fv)
    flags.DEFINE_enum("dtype", "bf16", list(DTYPES),
                      "Storage: bf16 (all BF16), fp8 (block-FP8 E4M3 projections + weight_scale_inv, rest BF16, "
                      "A_log/dt_bias F32), fp32 (all F32, for tests). Same seed = same underlying weights.",
                      flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Seed of the random weights (non-negative).", lower_bound=0, flag_values=fv)
    flags.DEFINE_string("out", None, "Output directory (required); written atomically via a temp dir beside it.",
                        flag_values=fv)
    flags.DEFINE_integer("num_layers", None, "Keep only the first N decoder layers' pattern: interval pattern of "
                         "the preset, or [linear]*(N-1)+[full] when N is below the interval. Default: all.",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_string("max_shard_bytes", "4GiB", "Largest safetensors file before sharding into "
                        "model-0000i-of-0000N.safetensors + index.json; bytes or with a unit (4GiB, 500MB).",
                        flag_values=fv)
    flags.DEFINE_enum("fp8_scale_dtype", "fp32", list(SCALE_DTYPES),
                      "Dtype of weight_scale_inv in --dtype=fp8 checkpoints.", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "Replace --out if it exists and is not empty (otherwise an error).",
                      flag_values=fv)


_HELP_ARGS = ("-h", "-help", "--help", "--helpshort", "--helpfull", "-?")


def _usage(fv: flags.FlagValues) -> str:
    return (f"usage: python -m qmtp.tools.make_checkpoint --out=DIR [flags]\n\n"
            f"Writes a synthetic Qwen3.5-layout Hugging Face checkpoint (config, safetensors, tokenizer).\n\n"
            f"flags:\n{fv.get_help(prefix='  ', include_special_flags=False)}\n")


def _fail(message: str) -> int:
    print(f"make_checkpoint: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 usage error, 1 write failure)."""
    argv = list(sys.argv if argv is None else argv)
    fv = flags.FlagValues()
    define_flags(fv)
    args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if any(a in _HELP_ARGS for a in args):
        print(_usage(fv))
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
        shard_bytes = parse_size(fv.max_shard_bytes)
        start = time.monotonic()
        path = write_checkpoint(fv.out, fv.preset, fv.dtype, fv.seed, fv.num_layers, shard_bytes, fv.overwrite,
                                fp8_scale_dtype=fv.fp8_scale_dtype)
    except (ValueError, FileExistsError) as e:
        return _fail(str(e).splitlines()[0])
    except OSError as e:
        print(f"make_checkpoint: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({_dir_bytes(path) / 1e9:.3f} GB) in {time.monotonic() - start:.1f} s")
    return 0


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


if __name__ == "__main__":
    sys.exit(main())
