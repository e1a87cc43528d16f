"""Orbax checkpoints of a qmtp.train run directory: the manager, restoring a step, and early
stopping (the best held-out evaluation's parameters under OUT_DIR/best)."""

from __future__ import annotations

import json
import os

import jax

CKPT_DIR, DATA_DIR, BEST_DIR = "checkpoints", "data", "best"


def manager(run_dir: str, keep: int = 2, sub: str = CKPT_DIR):
    import orbax.checkpoint as ocp
    return ocp, ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, sub)),
                                      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                           enable_async_checkpointing=False))


def restore(run_dir: str, target: dict, step: int | None = None, sub: str = CKPT_DIR) -> dict:
    """{"params", "opt_state", "step"} of the checkpoint `step` (default latest), shaped like `target`."""
    ocp, mngr = manager(run_dir, sub=sub)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise ValueError(f"{run_dir}: no orbax checkpoint under {sub}/")
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    out = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    mngr.close()
    return out


class Best:
    """Early stopping: the parameters of the evaluation with the lowest held-out loss, as a host copy
    and as an orbax checkpoint under OUT_DIR/best (kept across --resume); best.json: its step and loss."""

    def __init__(self, run_dir: str, like: dict, resume: bool):
        self.ocp, self.mngr = manager(run_dir, 1, BEST_DIR)
        self.meta_path = os.path.join(run_dir, BEST_DIR, "best.json")
        self.step, self.loss, self.params = None, float("inf"), None
        if resume and os.path.isfile(self.meta_path) and self.mngr.latest_step() is not None:
            with open(self.meta_path) as f:
                meta = json.load(f)
            got = restore(run_dir, {"params": like}, sub=BEST_DIR)
            self.step, self.loss, self.params = meta["step"], meta["loss"], jax.device_get(got["params"])

    def offer(self, row: dict, params) -> None:
        if not row["loss"] < self.loss:
            return
        self.step, self.loss, self.params = row["step"], row["loss"], jax.device_get(params)
        self.mngr.save(self.step, args=self.ocp.args.StandardSave({"params": params}), force=True)
        self.mngr.wait_until_finished()
        with open(self.meta_path, "w") as f:
            json.dump({"step": self.step, "loss": self.loss}, f)

    def close(self) -> None:
        self.mngr.close()
