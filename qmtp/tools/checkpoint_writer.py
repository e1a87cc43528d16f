"""Storage plan (`plan_tensors`, `shard_units`) and streaming safetensors writer (`write_safetensors`: tensor
by tensor, lazy values chunk by chunk, all-zero tails as file holes) of synthetic checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Iterator, Sequence

import ml_dtypes  # registers bfloat16 / float8 with numpy; keep before any safetensors import
import numpy as np

from qmtp.model import config as qconfig, fp8, params
from qmtp.tools import presets

# Module names (substrings, as transformers matches them) an FP8 checkpoint keeps unquantized:
# MODEL_SPEC §5.2's list for the official Qwen3.6-27B-FP8 plus the MTP glue (mtp.fc and its norms).
MODULES_TO_NOT_CONVERT = (
    "lm_head", "model.language_model.embed_tokens", "model.language_model.norm", "input_layernorm",
    "post_attention_layernorm", "q_norm", "k_norm", "linear_attn.A_log", "linear_attn.conv1d", "linear_attn.dt_bias",
    "linear_attn.in_proj_ba", "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.norm",
    "mtp.fc", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm")
_NP_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
              "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
_STORAGE = {"bf16": "BF16", "fp32": "F32"}


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
    """True iff an FP8 checkpoint stores this tensor as E4M3 + weight_scale_inv (MODEL_SPEC §5.2; an MoE
    router and shared-expert gate stay BF16, as in the releases)."""
    module = entry.name.removesuffix(".weight")
    return (entry.role in (params.LINEAR, params.FUSED_QKVZ, params.EXPERTS) and entry.name.endswith(".weight")
            and entry.key not in ("router", "shared_gate")
            and not any(pattern in module for pattern in MODULES_TO_NOT_CONVERT))


def plan_tensors(cfg: qconfig.ModelConfig, dtype: str, fp8_scale_dtype: str = "fp32") -> list[list[StoredTensor]]:
    """The stored tensors of every `tensor_table(cfg)` entry, in table order; an FP8 weight and its
    scale form one unit (kept in one shard, weight first)."""
    units = []
    for entry in params.tensor_table(cfg):
        if dtype == "fp8" and is_fp8_eligible(entry):
            grid = fp8.scale_grid(*entry.shape)
            units.append([StoredTensor(entry.name, "F8_E4M3", entry.shape, entry, "fp8_weight"),
                          StoredTensor(entry.name + "_scale_inv", _STORAGE[fp8_scale_dtype], grid, entry, "fp8_scale")])
        else:
            stored = _STORAGE[dtype] if dtype != "fp8" else "F32" if entry.role == params.FP32 else "BF16"
            units.append([StoredTensor(entry.name, stored, entry.shape, entry, "value")])
    return units


def shard_units(units: Sequence[list[StoredTensor]], max_shard_bytes: int) -> list[list[StoredTensor]]:
    """Greedy in-order sharding like HF: a unit that does not fit starts a new shard; a unit larger
    than the limit gets a shard of its own."""
    shards: list[list[StoredTensor]] = []
    size = 0
    for unit in units:
        unit_bytes = sum(t.nbytes for t in unit)
        if not shards or size + unit_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1] += unit
        size += unit_bytes
    return shards


def shard_file_names(n_shards: int) -> list[str]:
    """HF file names: model.safetensors for one shard, model-0000i-of-0000N.safetensors otherwise."""
    if n_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]


_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(fp8.FP8_DTYPE).astype(np.float32)  # code -> value


def _dequantize(codes: np.ndarray, scale: np.ndarray, np_dtype: np.dtype) -> np.ndarray:
    """`fp8.dequantize_np(codes, scale)` cast to `np_dtype` (bit-identical), per 128-row block in threads.
    codes: [R, I] E4M3; scale: [ceil(R/128), ceil(I/128)]."""
    block, (n_rows, n_cols) = fp8.FP8_BLOCK, codes.shape
    codes, scale = codes.view(np.uint8), np.asarray(scale, np.float32)
    out = np.empty(codes.shape, np_dtype)

    def work(b: int) -> None:
        lo, hi = b * block, min(n_rows, (b + 1) * block)
        out[lo:hi] = (_E4M3_VALUES[codes[lo:hi]] * np.repeat(scale[b], block)[:n_cols]).astype(np_dtype)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(work, range(-(-n_rows // block))))
    return out


def quantize_stored(value: np.ndarray, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 [O, I], scale grid in the stored dtype) of float values, by `fp8.quantize_np`; with bf16
    scales the codes are recomputed against the bf16-rounded scales (dequant stays consistent)."""
    w = np.asarray(value, np.float32)
    q, scale = fp8.quantize_np(w)
    if scale_dtype == "bf16":
        scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
        expanded = np.repeat(np.repeat(scale, fp8.FP8_BLOCK, 0), fp8.FP8_BLOCK, 1)[:w.shape[0], :w.shape[1]]
        q = np.clip(w / expanded, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(fp8.FP8_DTYPE)
    return q, scale.astype(_NP_DTYPES[_STORAGE[scale_dtype]])


class TensorSource:
    """`chunks(t)` yields the stored bytes of a `StoredTensor` from a preset's weight generator, in file order:
    C-contiguous arrays of t's dtype, or an int n for n zero bytes (a hole). Lazy `HashedNormal` values are
    drawn `CHUNK_BYTES` at a time, so memory stays at a few chunks plus the largest other tensor."""

    CHUNK_BYTES = 64 * 2**20

    def __init__(self, weights: presets.WeightFn, fp8_scale_dtype: str = "fp32"):
        self.weights, self.fp8_scale_dtype = weights, fp8_scale_dtype
        self._scales: dict[str, np.ndarray] = {}  # scale of an FP8 weight already produced

    def chunks(self, t: StoredTensor) -> Iterator[np.ndarray | int]:
        if t.part == "fp8_scale":  # produced with its weight, just before (one unit)
            yield self._checked(t, self._scales.pop(t.entry.name))
            return
        value = self.weights(t.entry, is_fp8_eligible(t.entry))
        if isinstance(value, presets.HashedNormal) and (value.fp8 or t.part == "value"):
            yield from self._lazy_chunks(t, value)
            return
        if isinstance(value, presets.HashedNormal):
            value = value.materialize()
        if t.part == "fp8_weight":
            arr, self._scales[t.entry.name] = quantize_stored(value, self.fp8_scale_dtype)
        else:
            arr = np.asarray(value).astype(_NP_DTYPES[t.dtype], copy=False)
        yield self._checked(t, arr)

    def _lazy_chunks(self, t: StoredTensor, value: presets.HashedNormal) -> Iterator[np.ndarray | int]:
        """Row blocks (multiples of 128 rows) of a lazy tensor; all-zero trailing rows as one hole."""
        if value.shape != t.shape:
            raise RuntimeError(f"{t.name}: generator gave shape {list(value.shape)}, expected {list(t.shape)}")
        (o, i), out_dtype, block = value.shape, _NP_DTYPES[t.dtype], fp8.FP8_BLOCK
        if t.part == "fp8_weight":
            self._scales[t.entry.name] = value.scale.astype(_NP_DTYPES[_STORAGE[self.fp8_scale_dtype]])
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
    """Tensors / bytes written, on stderr, at most every 2 s and after the last tensor."""

    def __init__(self, total_bytes: int, total_tensors: int):
        self.total_bytes, self.total_tensors = total_bytes, total_tensors
        self.bytes = self.tensors = 0
        self.start = self.last = time.monotonic()

    def add(self, t: StoredTensor, shard: str) -> None:
        self.bytes += t.nbytes
        self.tensors += 1
        now = time.monotonic()
        if now - self.last >= 2.0 or self.tensors == self.total_tensors:
            self.last = now
            rate = self.bytes / max(now - self.start, 1e-9) / 1e6
            print(f"make_checkpoint: {self.tensors}/{self.total_tensors} tensors, {self.bytes / 1e9:.2f}/"
                  f"{self.total_bytes / 1e9:.2f} GB, {rate:.0f} MB/s, {shard}", file=sys.stderr, flush=True)


def write_safetensors(path: str, tensors: Sequence[StoredTensor], source: TensorSource,
                      progress: Progress | None = None) -> None:
    """Streams one safetensors file: header first (all sizes are known), then tensor by tensor, chunk
    by chunk; a writer thread writes chunk k while chunk k+1 is drawn."""
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:
        pending = writer.submit(f.write, safetensors_header(tensors))
        for t in tensors:
            written = 0
            for chunk in source.chunks(t):
                written += chunk if isinstance(chunk, int) else chunk.nbytes
                pending.result()
                pending = writer.submit(_write_chunk, f, chunk)
            if written != t.nbytes:
                raise RuntimeError(f"{t.name}: produced {written} bytes, expected {t.nbytes}")
            if progress:
                progress.add(t, os.path.basename(path))
        pending.result()
        f.truncate(f.tell())  # materializes a trailing hole


def _write_chunk(f: BinaryIO, chunk: np.ndarray | int) -> None:
    """Writes an array's bytes, or skips `chunk` bytes (a hole that reads back as zeros)."""
    if isinstance(chunk, int):
        f.seek(chunk, os.SEEK_CUR)
    else:
        f.write(chunk.reshape(-1).view(np.uint8).data)
