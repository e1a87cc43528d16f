"""Adaptive K's round costs (seconds per loop round at each of adaptive_k.CANDIDATES) kept on disk beside
the compile cache, so a server that starts again on the same model, shapes and device skips timing them.

One JSON file per key. The key hashes what the costs depend on: the devices (kind and count), the JAX
version, the model's config and the shapes and dtypes of its parameters, its kernel config, and the
loop's shapes (batch slots, rounds per call, page-table width, stop-id width, the candidates). A change
to any of them is timed afresh; a file that cannot be read is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

from qmtp.runtime import adaptive_k

SUBDIR = "qmtp_round_costs"  # inside the compile-cache directory (JAX evicts only its own entries)


def key(engine) -> str:
    """The hex key of an engine's round costs (module doc)."""
    model, config = engine.model, engine.config
    devices = model.mesh.devices.flat if model.mesh is not None else jax.devices()[:1]
    shapes = jax.tree_util.tree_map(lambda a: (tuple(a.shape), str(a.dtype)), model.params)
    parts = (jax.__version__, [d.device_kind for d in devices], repr(model.cfg), repr(shapes), repr(model.kernels),
             config.batch_slots, config.rounds_per_call, engine.pages_per_slot, config.max_stop_ids,
             adaptive_k.CANDIDATES)
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def path(directory: str, engine) -> str:
    return os.path.join(directory, f"{key(engine)}.json")


def load(directory: str, engine) -> np.ndarray | None:
    """The stored costs [len(CANDIDATES)] f32, or None (none stored, or the file unreadable)."""
    try:
        with open(path(directory, engine)) as f:
            costs = np.asarray(json.load(f)["seconds_per_round"], np.float32)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if costs.shape != (len(adaptive_k.CANDIDATES),) or not np.all(np.isfinite(costs) & (costs > 0)):
        return None
    return costs


def save(directory: str, engine, costs: np.ndarray) -> str:
    """Writes the costs (atomically: a reader never sees half a file); returns the path. OSError when the
    directory cannot be written."""
    os.makedirs(directory, exist_ok=True)
    target = path(directory, engine)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"candidates": list(adaptive_k.CANDIDATES), "seconds_per_round": [float(c) for c in costs],
                   "batch_slots": engine.config.batch_slots, "rounds_per_call": engine.config.rounds_per_call,
                   "checkpoint": engine.model.checkpoint_dir}, f)
    os.replace(tmp, target)
    return target
