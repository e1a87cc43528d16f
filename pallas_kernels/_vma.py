"""Output types of a pallas_call inside shard_map (check_vma=True): an output varies across every mesh axis
that any input varies across (sharded weight x replicated activation -> sharded), each input first cast to
that type as the type rules ask; outside shard_map the plain ShapeDtypeStruct. Kernels know no meshes.
"""

from __future__ import annotations

import jax
from jax.sharding import ManualAxisType


def _varying(inputs) -> frozenset:
    out = frozenset()
    for a in inputs:
        mat = getattr(jax.typeof(a), "mat", None)
        if mat is not None:
            out |= mat.varying
    return out


def align(*inputs):
    """(inputs cast to vary over the union of their varying axes, output ShapeDtypeStruct factory)."""
    varying = _varying(inputs)
    if not varying:
        return inputs, jax.ShapeDtypeStruct
    cast = tuple(jax.lax.pcast(a, tuple(varying - _varying([a])), to="varying") if varying - _varying([a]) else a
                 for a in inputs)
    mat = ManualAxisType(varying=varying)
    return cast, lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
