"""Orbax checkpoints of a qmtp.train run directory: the checkpoint manager, restoring a step,
early stopping (the best held-out evaluation's parameters under OUT_DIR/best) and exporting a
run's checkpoint as an HF-format directory (`python -m qmtp.export`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from qmtp import train_data, train_loss

CKPT_DIR, DATA_DIR, BEST_DIR = "checkpoints", "data", "best"


def manager(run_dir: str, keep: int = 2, sub: str = CKPT_DIR):
    import orbax.checkpoint as ocp
    return ocp, ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, sub)),
                                      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                           enable_async_checkpointing=False))


def restore(run_dir: str, target: dict, step: int | None = None) -> dict:
    """{"params", "opt_state", "step"} of the checkpoint `step` (default latest), shaped like `target`."""
    ocp, mngr = manager(run_dir)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise ValueError(f"{run_dir}: no orbax checkpoint under {CKPT_DIR}/")
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    out = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    mngr.close()
    return out


class Best:
    """Early stopping: the parameters of the evaluation with the lowest held-out loss, as a host
    copy and as an orbax checkpoint under OUT_DIR/best (so --resume keeps it); best.json holds
    its step and loss."""

    def __init__(self, run_dir: str, like: dict, resume: bool):
        self.ocp, self.mngr = manager(run_dir, 1, BEST_DIR)
        self.meta_path = os.path.join(run_dir, BEST_DIR, "best.json")
        self.step, self.loss, self.params = None, float("inf"), None
        if resume and os.path.isfile(self.meta_path) and self.mngr.latest_step() is not None:
            with open(self.meta_path) as f:
                meta = json.load(f)
            abstract = jax.tree_util.tree_map(self.ocp.utils.to_shape_dtype_struct, {"params": like})
            got = self.mngr.restore(self.mngr.latest_step(), args=self.ocp.args.StandardRestore(abstract))
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


def export_run(run_dir: str, out: str, step: int | None = None, dtype: str = "bf16",
               max_shard_bytes: int = 14 * 10**6, overwrite: bool = False) -> str:
    """Exports checkpoint `step` (default latest) of a run directory (`python -m qmtp.export`)."""
    from qmtp import checkpoint, config as qconfig, export
    from qmtp.train import Hyper, _float_tree  # lazily: qmtp.train imports this module
    with open(os.path.join(run_dir, "run_config.json")) as f:
        rc = json.load(f)
    tokenizer = train_data.prepare(os.path.join(run_dir, DATA_DIR), vocab_size=None).tokenizer
    hp = Hyper(rc["steps"], rc["learning_rate"], rc["warmup_steps"], rc["min_lr_ratio"], rc["weight_decay"],
               rc["grad_clip"], rc["adam_b1"], rc["adam_b2"], rc["mtp_loss_weight"], rc["compute_dtype"],
               rc["train_mtp_only"])
    if rc["train_mtp_only"]:
        cfg, params = checkpoint.load(rc["init_checkpoint"], dtype=rc["compute_dtype"], progress=False)
        trainable = {"mtp": _float_tree(params["mtp"])}
    else:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
        cfg = qconfig.from_dict(config, source=run_dir)
        trainable = jax.tree_util.tree_map(jnp.asarray, train_loss.init_params(cfg, 0))
    got = restore(run_dir, {"params": trainable, "opt_state": hp.optimizer().init(trainable), "step": jnp.int32(0)},
                  step)
    host = jax.device_get(got["params"])
    if rc["train_mtp_only"]:
        return export.write_back_mtp(rc["init_checkpoint"], out, cfg, host["mtp"], overwrite=overwrite)
    return export.export_checkpoint(out, config, host, tokenizer, dtype, max_shard_bytes, overwrite=overwrite)
