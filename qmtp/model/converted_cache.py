"""An orbax-checkpoint cache of the converted (and, with tp > 1, sharded) parameter tree, so the next
load of the same model restores it directly, each device reading only its own shards.

    root/<key>/state/      orbax StandardCheckpointHandler output: a flat dict {"p00000": leaf, ...}
    root/<key>/meta.json   format version, key, tp, cfg digest, the tree's skeleton (dicts, tuples,
                           Fp8Block nodes; each leaf's shape and dtype) and every file's size

`cache_key` digests the checkpoint's files (name, size, mtime_ns), dtype, tp and FORMAT_VERSION, so a
changed checkpoint or layout is a miss. An entry is written under a temporary name and renamed into
place when complete. A missing or resized file, or any restore error, is reported on stderr and is a
miss (the next save replaces the entry); bit flips in data files are not detected (OCDBT checksums
its index, not the arrays). The restore target is rebuilt from meta.json alone, placed by
`tp.param_shardings` (NamedSharding of `param_specs` under a mesh, else the default device).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid

import jax
import jax.numpy as jnp

from qmtp.model.config import ModelConfig
from qmtp.model.fp8 import Fp8Block
from qmtp.runtime import tp

FORMAT_VERSION = 1
_META = "meta.json"
_STATE = "state"


def cache_key(checkpoint_dir: str, dtype: str, tp: int) -> str:
    """Hex digest over the absolute path, each *.safetensors / index / config.json file's name, size
    and mtime_ns, the dtype, the tp degree and FORMAT_VERSION."""
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    h = hashlib.sha256()
    h.update(json.dumps({"format_version": FORMAT_VERSION, "path": checkpoint_dir, "dtype": dtype,
                         "tp": int(tp)}, sort_keys=True).encode())
    for name in sorted(n for n in os.listdir(checkpoint_dir)
                       if n.endswith((".safetensors", ".safetensors.index.json")) or n == "config.json"):
        st = os.stat(os.path.join(checkpoint_dir, name))
        h.update(f"\0{name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:40]


def read_config(checkpoint_dir: str) -> ModelConfig:
    """The ModelConfig `checkpoint.load` returns, without reading any weights (headers only)."""
    from qmtp.model import checkpoint
    cfg = ModelConfig.from_hf(checkpoint_dir)
    if cfg.mtp_num_hidden_layers is None:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=checkpoint.count_mtp_layers(
            checkpoint.read_headers(checkpoint_dir)))
    return cfg


def _identity(key: str, cfg: ModelConfig, mesh) -> dict:
    """The meta.json fields an entry must match to be restored."""
    return {"format_version": FORMAT_VERSION, "key": key, "tp": 1 if mesh is None else mesh.size,
            "cfg_sha256": hashlib.sha256(repr(cfg).encode()).hexdigest()}


def _warn(msg: str) -> None:
    print(f"converted cache: {msg}", file=sys.stderr, flush=True)


# ---- the tree <-> (skeleton, flat leaves) ----------------------------------------------------------
def _encode(node, leaves: list):
    """A JSON skeleton of the tree; array leaves are appended to `leaves` and named by index."""
    def leaf(a):
        leaves.append(a)
        return {"leaf": len(leaves) - 1, "shape": list(a.shape), "dtype": jnp.dtype(a.dtype).name}
    if isinstance(node, Fp8Block):
        return {"fp8": [leaf(node.weight), leaf(node.scale)]}
    if isinstance(node, dict):
        if not all(isinstance(k, str) for k in node):
            raise TypeError(f"non-string dict keys {list(node)}")
        return {"dict": {k: _encode(v, leaves) for k, v in node.items()}}
    if isinstance(node, (tuple, list)):
        return {"tuple": [_encode(v, leaves) for v in node]}
    if node is None:
        return {"none": True}
    if hasattr(node, "shape") and hasattr(node, "dtype"):
        return leaf(node)
    raise TypeError(f"cannot cache a {type(node).__name__} node")


def _decode(skel: dict, make_leaf):
    """Rebuilds the tree from its skeleton; make_leaf(spec) gives each array leaf."""
    if "leaf" in skel:
        return make_leaf(skel)
    if "fp8" in skel:
        w, s = skel["fp8"]
        return Fp8Block(make_leaf(w), make_leaf(s))
    if "dict" in skel:
        return {k: _decode(v, make_leaf) for k, v in skel["dict"].items()}
    if "tuple" in skel:
        return tuple(_decode(v, make_leaf) for v in skel["tuple"])
    if skel.get("none"):
        return None
    raise ValueError(f"bad skeleton node {sorted(skel)}")


def _abstract_leaf(s: dict) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(s["shape"]), jnp.dtype(s["dtype"]))


def _leaf_name(i: int) -> str:
    return f"p{i:05d}"


def _file_sizes(root: str) -> dict[str, int]:
    paths = [os.path.join(dirpath, f) for dirpath, _, files in os.walk(root) for f in files]
    return {os.path.relpath(p, root): os.path.getsize(p) for p in paths}


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp, ocp.Checkpointer(ocp.StandardCheckpointHandler())


# ---- save / load -------------------------------------------------------------------------------------
def save(cache_root: str, key: str, cfg: ModelConfig, params: dict, mesh=None) -> bool:
    """Writes `params` to cache_root/<key> (temporary name, then an atomic rename). Returns whether an
    entry was written; a failure is reported on stderr, never raised (the load already succeeded)."""
    cache_root = os.path.abspath(cache_root)
    final = os.path.join(cache_root, key)
    host = socket.gethostname().replace(os.sep, "_")
    tmp = os.path.join(cache_root, f".{key}.tmp-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(cache_root, exist_ok=True)
        _remove_stale_temps(cache_root, key, host)
        leaves: list = []
        skeleton = _encode(params, leaves)
        # the cache restores onto param_specs / the default device: refuse to store any other layout
        abstract = _decode(skeleton, _abstract_leaf)
        bad = [want for a, want in zip(jax.tree_util.tree_leaves(params),
                                       jax.tree_util.tree_leaves(tp.param_shardings(abstract, mesh)))
               if not isinstance(a, jax.Array) or not a.sharding.is_equivalent_to(want, a.ndim)]
        if bad:
            _warn(f"{len(bad)} leaves are not laid out as the cache restores them (e.g. {bad[0]}); not caching")
            return False
        ocp, ckpt = _checkpointer()
        os.makedirs(tmp)
        ckpt.save(os.path.join(tmp, _STATE), args=ocp.args.StandardSave(
            {_leaf_name(i): a for i, a in enumerate(leaves)}))
        meta = {**_identity(key, cfg, mesh), "skeleton": skeleton, "files": _file_sizes(tmp)}
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump(meta, f)
        if os.path.lexists(final):  # a stale or unreadable entry (a hit never reaches save)
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return True
    except Exception as e:  # noqa: BLE001 (a cache write must never fail the load)
        _warn(f"cannot write {final} ({type(e).__name__}: {e})")
        return False
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_temps(cache_root: str, key: str, host: str) -> None:
    """Temporary entries of this key left by dead processes of this host (a crashed save)."""
    for path in glob.glob(os.path.join(cache_root, f".{key}.tmp-{host}-*")):
        try:
            pid = int(path.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, OSError):
            pass


def load(cache_root: str, key: str, cfg: ModelConfig, mesh=None):
    """The cached parameter tree for `key` placed as `checkpoint.load` places it (NamedSharding with
    `param_specs` on `mesh`, else the default device), or None on a miss. A corrupt or unreadable
    entry is reported on stderr (naming its path) and is a miss."""
    path = os.path.join(os.path.abspath(cache_root), key)
    if not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, _META)) as f:
            meta = json.load(f)
        wrong = [f"{k}={meta.get(k)!r} (expected {v!r})" for k, v in _identity(key, cfg, mesh).items()
                 if meta.get(k) != v]
        if wrong:
            raise ValueError(f"written for a different {', '.join(wrong)}")
        state = os.path.join(path, _STATE)
        sizes = _file_sizes(state)
        recorded = {k[len(_STATE) + 1:]: v for k, v in meta["files"].items() if k.startswith(_STATE + os.sep)}
        bad = sorted(f for f in recorded if sizes.get(f) != recorded[f])
        if bad or not recorded:
            raise ValueError(f"missing or resized files: {', '.join(bad[:5]) or 'all'}")
        abstract = _decode(meta["skeleton"], _abstract_leaf)
        names = _decode(meta["skeleton"], lambda s: _leaf_name(s["leaf"]))
        flat = jax.tree_util.tree_leaves  # the three trees share one structure, so their leaves align
        target = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for n, a, sh in
                  zip(flat(names), flat(abstract), flat(tp.param_shardings(abstract, mesh)))}
        ocp, ckpt = _checkpointer()
        restored = ckpt.restore(state, args=ocp.args.StandardRestore(target))

        def take(n, want):
            a = restored[n]
            if a.shape != want.shape or a.dtype != want.dtype:
                raise ValueError(f"{n}: restored {a.dtype}{list(a.shape)}, expected {want.dtype}{list(want.shape)}")
            return a
        return jax.tree_util.tree_map(take, names, abstract)
    except Exception as e:  # noqa: BLE001 (an unreadable cache is a miss, never a failed load)
        _warn(f"{path} is unreadable ({type(e).__name__}: {str(e)[:300]}); reading the checkpoint instead")
        return None


def load_or_convert(cache_root: str, checkpoint_dir: str, dtype: str, progress: bool, mesh, convert):
    """(cfg, params) from the cache, or from `convert(checkpoint_dir, dtype=, progress=, mesh=)`
    (`qmtp.model.checkpoint.load`) followed by writing the cache. One stderr line when `progress`."""
    if not os.path.isdir(checkpoint_dir):  # let the reader raise its own error
        return convert(checkpoint_dir, dtype=dtype, progress=progress, mesh=mesh)
    t0 = time.perf_counter()
    key = cache_key(checkpoint_dir, dtype, 1 if mesh is None else mesh.size)
    cfg = read_config(checkpoint_dir)
    params = load(cache_root, key, cfg, mesh)
    if params is not None:
        jax.block_until_ready(params)
        if progress:
            _warn(f"hit {os.path.join(cache_root, key)} ({time.perf_counter() - t0:.2f} s)")
        return cfg, params
    cfg, params = convert(checkpoint_dir, dtype=dtype, progress=progress, mesh=mesh)
    t1 = time.perf_counter()
    written = save(cache_root, key, cfg, params, mesh)
    if progress:
        _warn(f"miss: read {checkpoint_dir} in {t1 - t0:.2f} s, "
              + (f"wrote {os.path.join(cache_root, key)} in {time.perf_counter() - t1:.2f} s" if written
                 else "cache not written"))
    return cfg, params
