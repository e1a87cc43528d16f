"""Output types of a pallas_call inside shard_map.

With `check_vma=True`, shard_map types every value as invariant or varying across the mesh axes,
and a pallas_call must state its outputs' type. The kernels know nothing of meshes: an output
varies across every axis that any input varies across (a kernel of a sharded weight and a replicated
activation produces a sharded result), and each input is first cast to that type, as the type
rules ask of operands. Outside shard_map this is the plain ShapeDtypeStruct and a no-op.
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
