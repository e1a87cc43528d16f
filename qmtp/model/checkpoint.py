"""Hugging Face safetensors -> parameter tree, strictly.

Conventions stated once here (MODEL_SPEC §2, §5):
  * names come from `params.tensor_table(cfg)`; `model.visual.*` tensors are ignored, anything
    else not in the table is an error, as is a missing, duplicated or misshapen tensor;
  * a weight is FP8 iff its dtype is F8_E4M3 and it has a `weight_scale_inv` sibling (BF16 or F32,
    shape [ceil(out/128), ceil(in/128)]); it stays an `Fp8Block` (never dequantized at load);
  * Qwen3-Next `in_proj_qkvz` / `in_proj_ba` rows are permuted once into the Qwen3.5 layout;
  * MoE experts, stored per expert or as fused 3-D tensors (`params` module doc), are stacked into
    [X, R, C] params (FP8: one [X, R/128, C/128] scale grid, so gate and up rows need I % 128 == 0);
  * `A_log`, `dt_bias` and norm weights are f32; conv [C, 1, W] becomes [C, W];
  * every other tensor is cast to the compute dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from qmtp.model import params as P, shard_layout
from qmtp.model.config import FP8_BLOCK, ModelConfig
from qmtp.model.fp8 import Fp8Block, scale_grid

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
IGNORED_PREFIXES = ("model.visual.", "visual.")
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
_BYTES = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message lists every offending tensor."""


@dataclasses.dataclass(frozen=True)
class _Header:
    file: str
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]


def read_headers(checkpoint_dir: str) -> dict[str, _Header]:
    """name -> (file, dtype, shape) over the single file or every shard of the index."""
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{checkpoint_dir}: no *.safetensors files and no model.safetensors.index.json")
    headers: dict[str, _Header] = {}
    duplicated: list[str] = []
    for name in files:
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{index}: lists {name}, which does not exist")
        for key, h in _file_headers(path).items():
            if key in headers:
                duplicated.append(f"{key} (in {headers[key].file} and {name})")
            headers[key] = h
    if duplicated:
        raise CheckpointError(f"{checkpoint_dir}: duplicated tensors: {', '.join(duplicated)}")
    if weight_map is not None:
        wrong = [f"{k} (index: {v}, file: {headers[k].file if k in headers else 'none'})"
                 for k, v in weight_map.items() if k not in headers or headers[k].file != v]
        if wrong:
            raise CheckpointError(f"{index}: index and shards disagree for {', '.join(wrong[:10])}")
    return headers


def _file_headers(path: str) -> dict[str, _Header]:
    """Header of one safetensors file; also checks the file is as long as its header says."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n))
        end = max([v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"], default=0)
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e!r})") from None
    size = os.path.getsize(path)
    if size < 8 + n + end:
        raise CheckpointError(f"{path}: truncated ({size} bytes, header needs {8 + n + end})")
    return {k: _Header(os.path.basename(path), v["dtype"], tuple(v["shape"]))
            for k, v in meta.items() if k != "__metadata__"}


def count_mtp_layers(headers: dict[str, _Header]) -> int:
    ids = {int(k.split(".")[2]) for k in headers if k.startswith("mtp.layers.") and k.split(".")[2].isdigit()}
    return max(ids) + 1 if ids else 0


def fused_experts(headers: dict[str, _Header]) -> bool:
    """Whether the checkpoint stores its MoE experts as fused 3-D tensors (else one per expert)."""
    return any(k.endswith(".mlp.experts.gate_up_proj") for k in headers)


def validate(cfg: ModelConfig, headers: dict[str, _Header], checkpoint_dir: str) -> list[P.TensorEntry]:
    """Checks names, shapes and FP8 scale grids against the table; raises one error listing all."""
    table = P.tensor_table(cfg, fused_experts(headers))
    expected = {e.name: e for e in table}
    problems: list[str] = []
    present = {k for k in headers if not k.startswith(IGNORED_PREFIXES) and not k.endswith(SCALE_SUFFIX)}
    for what, names in (("missing", set(expected) - present), ("unexpected", present - set(expected))):
        if names:
            problems.append(f"{what} tensors ({len(names)}): {', '.join(sorted(names)[:20])}"
                            + (" ..." if len(names) > 20 else ""))
    for name, entry in expected.items():
        h = headers.get(name)
        if h is None:
            continue
        if h.shape != entry.shape:
            problems.append(f"{name}: shape {list(h.shape)}, expected {list(entry.shape)}")
            continue
        scale = headers.get(name + SCALE_SUFFIX)
        if h.dtype == "F8_E4M3":
            grid = entry.shape[:-2] + scale_grid(*entry.shape[-2:])
            if entry.role not in (P.LINEAR, P.FUSED_QKVZ, P.FUSED_BA, P.EXPERTS, P.FUSED_EXPERTS):
                problems.append(f"{name}: F8_E4M3 is only supported for linear weights (role {entry.role})")
            elif scale is None:
                problems.append(f"{name}: F8_E4M3 weight without {name + SCALE_SUFFIX}")
            elif scale.shape != grid:
                problems.append(f"{name + SCALE_SUFFIX}: scale grid {list(scale.shape)}, expected "
                                f"{list(grid)} for weight {list(entry.shape)} in {FP8_BLOCK}x{FP8_BLOCK} blocks")
            elif entry.row0 % FP8_BLOCK:
                problems.append(f"{name}: FP8 experts need moe_intermediate_size % {FP8_BLOCK} == 0 (the up rows "
                                f"follow the gate rows at row {entry.row0} of one block grid)")
            elif scale.dtype not in ("BF16", "F32"):
                problems.append(f"{name + SCALE_SUFFIX}: dtype {scale.dtype}, expected BF16 or F32")
        elif scale is not None:
            problems.append(f"{name + SCALE_SUFFIX}: scale for a {h.dtype} weight (FP8 needs F8_E4M3)")
        elif h.dtype not in ("BF16", "F16", "F32"):
            problems.append(f"{name}: dtype {h.dtype} is not supported")
    orphans = sorted(k for k in headers if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] not in headers)
    if orphans:
        problems.append(f"scales without a weight: {', '.join(orphans)}")
    if problems:
        raise CheckpointError(f"{checkpoint_dir} does not match its config.json:\n  " + "\n  ".join(problems))
    return table


class _Progress:
    """Tensors / bytes loaded, printed to stderr for checkpoints of 256 MiB and more."""

    def __init__(self, total_tensors: int, total_bytes: int, enabled: bool):
        self.n, self.total_n, self.done, self.total = 0, total_tensors, 0, total_bytes
        self.enabled = enabled and total_bytes >= 256 << 20
        self.last, self.start = 0.0, time.time()

    def step(self, nbytes: int) -> None:
        self.n += 1
        self.done += nbytes
        now = time.time()
        if self.enabled and (now - self.last > 0.5 or self.n == self.total_n):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9) / 1e9
            end = "\n" if self.n == self.total_n else ""
            print(f"\rloading checkpoint: {self.n}/{self.total_n} tensors, "
                  f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({rate:.2f} GB/s)",
                  end=end, file=sys.stderr, flush=True)


def load(checkpoint_dir: str, dtype: str = "bfloat16", progress: bool = True, mesh=None) -> tuple[ModelConfig, dict]:
    """Reads config.json and the safetensors into (ModelConfig, params) on the default device, or with
    a tensor-parallel `mesh` straight into the TP layout (`shard_layout`), each device's shard read as
    slices of the files, so the host never holds more than one tensor's pieces at a time."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: supported {sorted(_DTYPES)}")
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory not found")
    cfg = ModelConfig.from_hf(checkpoint_dir)
    headers = read_headers(checkpoint_dir)
    if cfg.mtp_num_hidden_layers is None:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=count_mtp_layers(headers))
    table = validate(cfg, headers, checkpoint_dir)
    if mesh is not None and mesh.size > 1:
        from qmtp.runtime import tp
        tp.check_tp(cfg, mesh.size, fp8=any(n.endswith(SCALE_SUFFIX) for n in headers))
    else:
        mesh = None
    return cfg, _read_tree(cfg, table, headers, checkpoint_dir, _DTYPES[dtype], progress, mesh)


def _read_tree(cfg, table, headers, checkpoint_dir, compute, progress, mesh) -> dict:
    """The tree: split tensors read shard by shard and put on their device at once; the others read
    whole and put on the default device (every device under a mesh)."""
    from qmtp.runtime import tp
    tree = P.empty_tree(cfg)
    total = sum(_BYTES.get(headers[e.name].dtype, 4) * int(np.prod(headers[e.name].shape)) for e in table)
    bar = _Progress(len(table), total, progress)
    handles: dict[str, object] = {}
    stacks = _ExpertStacks(cfg, table, compute, mesh)
    try:
        for entry in table:
            h = headers[entry.name]
            fp8 = h.dtype == "F8_E4M3"
            sh = headers[entry.name + SCALE_SUFFIX] if fp8 else None
            if entry.role == P.EXPERTS:
                raw = _read(handles, checkpoint_dir, h.file, entry.name)
                scale = _read(handles, checkpoint_dir, sh.file, entry.name + SCALE_SUFFIX) if fp8 else None
                stacks.put(tree, entry, raw, scale)
                bar.step(_BYTES.get(h.dtype, 4) * int(np.prod(h.shape)))
                continue
            for key, rows in _key_rows(cfg, entry).items():
                dim = None if mesh is None else shard_layout.split_dim(key)
                if dim is None:  # whole: read once, place on the device (every device under TP)
                    raw = _select(handles, checkpoint_dir, h.file, entry.name, 0, rows)
                    scale = _select(handles, checkpoint_dir, sh.file, entry.name + SCALE_SUFFIX, 0,
                                    None if rows is None else _block_rows(rows, entry.name)) if fp8 else None
                    place = jnp.asarray if mesh is None else lambda a: jax.device_put(a, tp.replicated(mesh))
                    P.place(tree, entry, key, jax.tree_util.tree_map(place, _piece(entry, raw, scale, compute)))
                    continue
                def shard(s_i, idx, entry=entry, h=h, sh=sh, rows=rows, dim=dim):
                    src = [rows[i] for i in idx] if rows is not None and dim == 0 else idx
                    raw = _select(handles, checkpoint_dir, h.file, entry.name, dim, src)
                    scale = None
                    if sh is not None:
                        blocks = shard_layout.block_indices(src, f"{entry.name} (shard {s_i} of {mesh.size})")
                        scale = _select(handles, checkpoint_dir, sh.file, entry.name + SCALE_SUFFIX, dim, blocks)
                    return _piece(entry, raw, scale, compute)

                length = len(rows) if rows is not None and dim == 0 else h.shape[dim]
                P.place(tree, entry, key, _assemble_shards(cfg, key, length, dim, mesh, shard))
            bar.step(_BYTES.get(h.dtype, 4) * int(np.prod(h.shape)))
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(str(e)) from None
    finally:
        handles.clear()
    _check_uniform_fp8(tree)
    return P.finalize_tree(tree)


class _ExpertStacks:
    """Per-expert tensors gathered into their stacked [X, R, C] params (and [X, R/128, C/128] scales),
    each put into the tree when its last piece arrives, so the host holds one stack at a time; under a
    TP mesh the stack is split there into the devices' shards (`shard_layout`)."""

    def __init__(self, cfg: ModelConfig, table: list[P.TensorEntry], compute, mesh=None):
        self.cfg, self.compute, self.mesh, self.open = cfg, compute, mesh, {}
        self.left: dict[tuple, int] = {}
        for e in table:
            if e.role == P.EXPERTS:
                self.left[(e.group, e.index, e.key)] = self.left.get((e.group, e.index, e.key), 0) + 1

    def put(self, tree: dict, entry: P.TensorEntry, raw: np.ndarray, scale) -> None:
        slot = (entry.group, entry.index, entry.key)
        if slot not in self.open:
            shape = P.stacked_shape(self.cfg, entry.key)
            self.open[slot] = (np.empty(shape, raw.dtype if scale is not None else self.compute),
                               None if scale is None else np.empty(shape[:1] + scale_grid(*shape[1:]), np.float32))
        weight, grid = self.open[slot]
        if (grid is None) != (scale is None):
            raise CheckpointError(f"{entry.name}: the experts of one layer mix FP8 and non-FP8 {entry.key} tensors")
        rows = slice(entry.row0, entry.row0 + raw.shape[0])
        weight[entry.expert, rows] = raw
        if grid is not None:
            grid[entry.expert, entry.row0 // FP8_BLOCK:entry.row0 // FP8_BLOCK + scale.shape[0]] = scale
        self.left[slot] -= 1
        if self.left[slot] == 0:
            del self.open[slot]
            P.place(tree, entry, entry.key, self._split(entry, weight if grid is None else Fp8Block(weight, grid)))

    def _split(self, entry: P.TensorEntry, stack):
        """The stacked param on the device, or assembled from the mesh devices' shards of it."""
        if self.mesh is None:
            return jax.tree_util.tree_map(jnp.asarray, stack)
        dim, weight = shard_layout.split_dim(entry.key), getattr(stack, "weight", stack)

        def shard(s_i, idx):
            piece = np.take(weight, idx, axis=dim)
            if not isinstance(stack, Fp8Block):
                return piece
            what = f"{entry.key} of {entry.name.rsplit('.experts.', 1)[0]} (shard {s_i} of {self.mesh.size})"
            return Fp8Block(piece, np.take(stack.scale, shard_layout.block_indices(idx, what), axis=dim))

        return _assemble_shards(self.cfg, entry.key, weight.shape[dim], dim, self.mesh, shard)


def _assemble_shards(cfg: ModelConfig, key: str, length: int, dim: int, mesh, shard):
    """A param split along dim over the mesh: shard(s_i, idx) gives device s_i's host piece (an array or
    an Fp8Block), idx its indices of the length along dim (shard_layout.shard_indices); each piece goes
    straight to its device, then the pieces are one global array."""
    from qmtp.runtime import tp
    pieces = [jax.device_put(shard(s_i, shard_layout.shard_indices(cfg, key, length, mesh.size, s_i)), device)
              for s_i, device in enumerate(mesh.devices.flat)]
    return jax.tree_util.tree_map(lambda *xs: tp.assemble(list(xs), dim, mesh), *pieces)  # Fp8Block: leaf-wise


def _key_rows(cfg: ModelConfig, entry: P.TensorEntry) -> dict:
    """Param key(s) an entry fills -> the checkpoint rows each takes (None: all rows, in order)."""
    rows = {P.FUSED_QKVZ: P.fused_qkvz_rows, P.FUSED_BA: P.fused_ba_rows}.get(entry.role)
    return {entry.key: None} if rows is None else dict(zip(entry.key.split("+"), rows(cfg)))


def _piece(entry: P.TensorEntry, raw: np.ndarray, scale, compute):
    """A parameter (or a selected piece of one) in its final dtype (validate keeps FP8 to LINEAR roles)."""
    if entry.role in (P.NORM, P.FP32):
        return raw.astype(np.float32)
    if entry.role == P.CONV:
        return raw[:, 0, :].astype(compute)  # [C, 1, W] -> [C, W]
    return raw.astype(compute) if scale is None else Fp8Block(raw, scale.astype(np.float32))


def _select(handles: dict, checkpoint_dir: str, file: str, name: str, dim: int, indices) -> np.ndarray:
    """The given indices along `dim` of a stored tensor (None: the whole tensor), read as slices of
    the file: one read per run of consecutive indices."""
    if indices is None:
        return _read(handles, checkpoint_dir, file, name)
    parts = [_read_slice(handles, checkpoint_dir, file, name, dim, a, b)
             for a, b in shard_layout.ranges(list(indices))]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=dim)


def _read_slice(handles: dict, checkpoint_dir: str, file: str, name: str, dim: int, start: int,
                stop: int) -> np.ndarray:
    """Indices [start, stop) along `dim` of a stored tensor, without reading the rest."""
    def get(f):
        return f.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
    return _get(handles, checkpoint_dir, file, f"{name}[{':, ' * dim}{start}:{stop}]", get)


def _read(handles: dict, checkpoint_dir: str, file: str, name: str) -> np.ndarray:
    return _get(handles, checkpoint_dir, file, f"tensor {name}", lambda f: f.get_tensor(name))


def _get(handles: dict, checkpoint_dir: str, file: str, what: str, get) -> np.ndarray:
    """get(the file's safe_open handle, opened once per load), with errors naming the file."""
    path = os.path.join(checkpoint_dir, file)
    try:
        if file not in handles:
            handles[file] = safe_open(path, framework="numpy")
        return get(handles[file])
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e})") from None


def _block_rows(rows: list[int], name: str) -> list[int]:
    """Scale-grid rows for a row permutation that moves whole 128-row blocks (else an error)."""
    try:
        return shard_layout.block_indices(rows, name)
    except ValueError:
        raise CheckpointError(f"{name}: FP8 rows cannot be permuted into the Qwen3.5 layout because "
                              f"the pieces are not whole {FP8_BLOCK}-row blocks") from None


def _check_uniform_fp8(tree: dict) -> None:
    """Within a layer kind a projection is FP8 in every layer or in none (one compiled layer body)."""
    for group, layers in (("gdn", tree["gdn"]), ("attn", tree["attn"]), ("mtp.layers", tree["mtp"]["layers"])):
        for key in {key for layer in layers for key in layer}:
            kinds = {isinstance(layer[key], Fp8Block) for layer in layers if key in layer}
            if len(kinds) > 1:
                raise CheckpointError(f"{group} layers mix FP8 and non-FP8 {key} weights")
