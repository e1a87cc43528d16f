"""Lowering Pallas (Triton) kernels for the H200 from a CPU-only process, for CI.

The Triton lowering asks the device for its compute capability (FP8 casts need sm >= 89), so a bare
`lower(lowering_platforms=("cuda",))` fails on a CPU jaxlib ("No supported GPU devices found"); under
an abstract mesh with an H200 AbstractDevice it works. What this cannot check is Triton's own compile
to PTX, which only happens inside XLA's CUDA plugin: the `gpu`-marked tests cover that on the device.
"""

import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(fn, args, **jit_kw):
    """jax.jit(fn, **jit_kw).trace(*args).lower(lowering_platforms=("cuda",)) for an abstract H200."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn, **jit_kw).trace(*args).lower(lowering_platforms=("cuda",))


def triton_calls(lowered):
    """[(backend_config, Triton module text)] of every Triton custom call; each module must verify."""
    from jax._src.lib.mlir import ir  # private, pinned jax 0.11.2: parse the embedded Triton bytecode
    from jax._src.pallas.triton import lowering as triton_lowering

    found = []

    def walk(op):
        op = op.operation
        if op.name == "stablehlo.custom_call" and "triton" in str(op.attributes["call_target_name"]):
            found.append(op.attributes["mhlo.backend_config"])
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    walk(child)

    walk(lowered.compiler_ir("stablehlo"))
    out = []
    for cfg in found:
        with triton_lowering._new_ir_context():
            module = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)
            assert module.operation.verify(), "the Triton module does not verify"
            out.append((cfg, str(module)))
    return out


def attr_int(cfg, key):
    """An integer attribute of a Triton backend config ("4 : i32" -> 4)."""
    return int(str(cfg[key]).split(":")[0])
