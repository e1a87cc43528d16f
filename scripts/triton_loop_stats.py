"""PTX instructions per chunk-loop iteration of the FP8 decode kernel, without a GPU.

Pallas lowers the kernel to Triton IR on this machine (tests/h200_lowering.py); a separate Python with
the `triton` package (not a project dependency: `python3.12 -m venv /tmp/vtri && /tmp/vtri/bin/pip install
triton`) compiles that IR for sm_90 and this script counts the instructions of the innermost loop, by
opcode. The compiler is pip's Triton, not the one inside XLA's CUDA plugin, so the counts are a guide
to what a change does to the loop, not the exact code the H200 runs.

  python scripts/triton_loop_stats.py --triton_python=/tmp/vtri/bin/python
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (M, O, I, weight dtype, DecodeConfig overrides of the default config)
CASES = {
    "up_m1": (1, 17408, 5120, "fp8", {}),
    "up_m1_x_f16": (1, 17408, 5120, "fp8", {"x_f16": True}),
    "up_m1_bf16_weights": (1, 17408, 5120, "bf16", {}),
    "down_m1": (1, 5120, 17408, "fp8", {}),
    "down_m1_x_f16": (1, 5120, 17408, "fp8", {"x_f16": True}),
    "up_m4_x_f16": (4, 17408, 5120, "fp8", {"x_f16": True}),
    # E4M3 activations (fp8_matmul(..., act_quant=True)): both dot operands FP8, no weight conversion
    "up_m1_a8": (1, 17408, 5120, "fp8_a8", {}),
    "down_m1_a8": (1, 5120, 17408, "fp8_a8", {}),
    "up_m4_a8": (4, 17408, 5120, "fp8_a8", {}),
    "up_m1_a8_xm": (1, 17408, 5120, "fp8_a8", {"swap_ab": False}),  # x on the dot's M side: no wgmma
    # 16 rows (a verify of 4 slots x 4 tokens): the default (x_f16, its 32 piece rows on the dot's M
    # side for the wide weights, W on the M side for the narrow ones) and the alternatives
    "up_m16": (16, 17408, 5120, "fp8", {}),
    "up_m16_wm": (16, 17408, 5120, "fp8", {"swap_ab": True}),
    "up_m16_wm_bo128": (16, 17408, 5120, "fp8", {"swap_ab": True, "block_o": 128, "num_warps": 8}),
    "up_m16_bf16x": (16, 17408, 5120, "fp8", {"x_f16": False}),
    "up_m16_bf16x_wm": (16, 17408, 5120, "fp8", {"x_f16": False, "swap_ab": True}),
    "down_m16": (16, 5120, 17408, "fp8", {}),
    "up_m16_a8": (16, 17408, 5120, "fp8_a8", {}),
    # o_proj / out_proj [5120, 6144], the launch below 80% of copy (session 15): its 3-stage default
    # against 4 stages (shared memory per program sets how many of its 640 programs fit one wave)
    "oproj_m1": (1, 5120, 6144, "fp8", {}),
    "oproj_m1_s4": (1, 5120, 6144, "fp8", {"num_stages": 4}),
    "oproj_m16": (16, 5120, 6144, "fp8", {}),
    "oproj_m16_s4": (16, 5120, 6144, "fp8", {"num_stages": 4}),
    # the tiled weight layout (pallas_kernels/fp8_layout.py): each chunk one contiguous run
    "oproj_m1_tiled": (1, 5120, 6144, "fp8_tiled", {}),
    "oproj_m16_tiled": (16, 5120, 6144, "fp8_tiled", {}),
    "up_m1_tiled": (1, 17408, 5120, "fp8_tiled", {}),
    # the scaled f16 piece made in the kernel per row and chunk (DecodeConfig.x_chunk_scaled)
    "oproj_m1_xchunk": (1, 5120, 6144, "fp8", {"x_f16": False, "x_f16_scaled": False, "x_chunk_scaled": True}),
    "oproj_m16_xchunk": (16, 5120, 6144, "fp8", {"x_f16": False, "x_f16_scaled": False, "x_chunk_scaled": True}),
    "up_m1_xchunk": (1, 17408, 5120, "fp8", {"x_f16": False, "x_f16_scaled": False, "x_chunk_scaled": True}),
    "up_m4_xchunk": (4, 17408, 5120, "fp8", {"x_f16": False, "x_f16_scaled": False, "x_chunk_scaled": True}),
    # the GEMM (M > DECODE_MAX_ROWS: PrefillConfig) on both layouts: a 128-row block of tiles is two tiles joined
    "oproj_gemm_m64": (64, 5120, 6144, "fp8", {}),
    "oproj_gemm_m64_tiled": (64, 5120, 6144, "fp8_tiled", {}),
    # the GEMM of a wide launch at a batched verify's 64 rows: bf16 x (the default) or one scaled f16
    # piece per row (PrefillConfig.x_f16_scaled: the weight converts to f16, not bf16)
    "up_gemm_m64_tiled": (64, 17408, 5120, "fp8_tiled", {"x_f16_scaled": False}),
    "up_gemm_m64_tiled_f16": (64, 17408, 5120, "fp8_tiled", {"x_f16_scaled": True}),
    "up_gemm_m512_tiled": (512, 17408, 5120, "fp8_tiled", {"x_f16_scaled": False}),
    "up_gemm_m512_tiled_f16": (512, 17408, 5120, "fp8_tiled", {"x_f16_scaled": True}),
    # a batched verify's 64 rows on the decode grid (tiled weights): 64-row programs against 128-row ones
    # joining two 64-row tiles per chunk (fp8_verify_narrow_block_o=128, measured 2x slower on the H200)
    "down_m64_tiled": (64, 5120, 17408, "fp8_tiled", {}),
    "down_m64_tiled_bo128": (64, 5120, 17408, "fp8_tiled", {"block_o": 128, "num_warps": 8}),
    "up_m64_tiled": (64, 17408, 5120, "fp8_tiled", {}),
    "oproj_m16_tiled_bo128": (16, 5120, 6144, "fp8_tiled", {"block_o": 128, "num_warps": 8}),
}

_COMPILE = r'''
import json, re, sys, collections, triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
lines = k.asm["ptx"].splitlines()
labels = {l.strip().split(":")[0]: i for i, l in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:", l.strip())}
span = None
for j, l in enumerate(lines):  # the longest backward branch: the chunk loop
    m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", l)
    if m and m.group(1) in labels and labels[m.group(1)] < j and (span is None or j - labels[m.group(1)] > span[1] - span[0]):
        span = (labels[m.group(1)], j)
ops = collections.Counter()
for l in lines[span[0]:span[1] + 1]:
    l = l.strip()
    if not l or l.startswith(("//", ".", "{", "}", "$")):
        continue
    op = l.split()[1] if l.startswith("@") else l.split()[0]
    ops[".".join(op.rstrip(";").split(".")[:2])] += 1
total = sum(1 for l in lines if l.strip() and not l.strip().startswith(("//", ".", "{", "}", "$")))
# registers per thread, from the ptxas Triton ships (with shared memory, they set the programs per SM)
import os, subprocess, tempfile
bins = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the newer of the two it ships reads the PTX version Triton writes
ptxas = next(p for p in (os.path.join(bins, "ptxas-blackwell"), os.path.join(bins, "ptxas")) if os.path.exists(p))
arch = re.search(r"^\.target\s+(\S+)", k.asm["ptx"], re.M).group(1)
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(k.asm["ptx"])
r = subprocess.run([ptxas, "-v", "--gpu-name", arch, f.name, "-o", os.devnull], capture_output=True, text=True)
os.unlink(f.name)
found = re.search(r"Used (\d+) registers", r.stderr)
regs = int(found.group(1)) if found else None
print(json.dumps({"triton": triton.__version__, "shared_bytes": k.metadata.shared, "loop_instructions": sum(ops.values()),
                  "outside_loop_instructions": total - sum(ops.values()), "registers": regs, "loop_ops": dict(ops.most_common())}))
'''


def dump_ttir(name: str, out_dir: str) -> tuple[str, object]:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from h200_lowering import lower_for_h200, triton_calls

    from pallas_kernels import fp8_matmul as fm

    m, o, i, wdt, overrides = CASES[name]
    if "gemm" in name:  # the GEMM's default tiles (at 33-64 rows the default may be the decode grid)
        config = dataclasses.replace(fm.fp8_config.prefill_config(m, o, i), **overrides)
    else:
        config = dataclasses.replace(fm.decode_config(m, o, i),
                                     **{**({"swap_ab": True} if wdt == "fp8_a8" else {}), **overrides})
    sds = jax.ShapeDtypeStruct
    if wdt == "bf16":
        fn, args = (lambda x, w: fm.bf16_matmul(x, w, config=config)), (sds((m, i), jnp.bfloat16), sds((o, i), jnp.bfloat16))
    else:
        fn = lambda x, w, s: fm.fp8_matmul(x, w, s, config=config, act_quant=wdt == "fp8_a8")  # noqa: E731
        w_shape = (o // 64, i // 128, 64, 128) if wdt == "fp8_tiled" else (o, i)
        args = (sds((m, i), jnp.bfloat16), sds(w_shape, jnp.float8_e4m3fn), sds((o // 128, i // 128), jnp.float32))
    [(_, text)] = triton_calls(lower_for_h200(fn, args))
    path = os.path.join(out_dir, f"{name}.ttir")
    with open(path, "w") as f:
        f.write(text)
    return path, config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton_python", required=True, help="a Python that can import triton")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--out", default=None, help="JSON file with every case's counts")
    args = ap.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:  # before any case compiles
        ap.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path, config = dump_ttir(name, tmp)
            p = subprocess.run([args.triton_python, "-c", _COMPILE, path, str(config.num_warps), str(config.num_stages)],
                               capture_output=True, text=True)
            if p.returncode:
                print(f"{name}: triton compile failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                return 1
            row = json.loads(p.stdout.strip().splitlines()[-1])
            results[name] = {"config": repr(config), **row}
            top = ", ".join(f"{k} {v}" for k, v in list(row["loop_ops"].items())[:8])
            print(f"{name:22s} {row['loop_instructions']:4d} instructions per loop iteration, "
                  f"{row['outside_loop_instructions']} outside, {row['shared_bytes']} B shared, {row['registers']} registers ({top})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
