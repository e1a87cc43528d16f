"""MoE checkpoint layouts for tests: make_checkpoint writes the experts one tensor per expert (as
Qwen3-Next releases store them); `fuse_experts` rewrites a copy in the fused 3-D layout."""

import os
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file


def fuse_experts(src: str, dst: str) -> None:
    """A copy of checkpoint src with every layer's per-expert tensors (and FP8 scales) fused into
    mlp.experts.gate_up_proj [X, 2I, H] (gate rows, then up rows) and mlp.experts.down_proj [X, H, I]."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    prefixes = sorted({k[:k.index("experts.") + len("experts.")] for k in tensors if ".mlp.experts." in k})
    for prefix in prefixes:
        n = 1 + max(int(k[len(prefix):].split(".")[0]) for k in tensors if k.startswith(prefix))
        for suffix in ("weight", "weight_scale_inv"):
            if prefix + f"0.gate_proj.{suffix}" not in tensors:
                continue
            take = lambda proj: [tensors.pop(f"{prefix}{x}.{proj}.{suffix}") for x in range(n)]  # noqa: E731
            gate, up, down = take("gate_proj"), take("up_proj"), take("down_proj")
            tail = "" if suffix == "weight" else "_scale_inv"
            tensors[f"{prefix}gate_up_proj{tail}"] = np.stack([np.concatenate(gu) for gu in zip(gate, up)])
            tensors[f"{prefix}down_proj{tail}"] = np.stack(down)
    save_file(tensors, file)
