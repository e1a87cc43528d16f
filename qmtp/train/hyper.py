"""The trainer's static settings (Hyper: learning-rate schedule and optimizer) and its trainable tree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qmtp.model.fp8 import dequantize_np, Fp8Block


@dataclasses.dataclass(frozen=True)
class Hyper:
    """Static (hashable) settings of the jitted step."""

    steps: int
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    adam_b1: float
    adam_b2: float
    mtp_loss_weight: float
    compute_dtype: str
    mtp_only: bool
    mtp_depth: int = 1

    def schedule(self):
        warmup = min(self.warmup_steps, self.steps - 1)
        return optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, warmup, self.steps,
                                                  self.learning_rate * self.min_lr_ratio)

    def optimizer(self) -> optax.GradientTransformation:
        decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p)
        return optax.chain(optax.clip_by_global_norm(self.grad_clip),
                           optax.adamw(self.schedule(), self.adam_b1, self.adam_b2, weight_decay=self.weight_decay,
                                       mask=decay_mask))


def float_tree(tree):
    """MTP params as trainable float32 (FP8 blocks dequantized)."""
    def conv(x):
        if isinstance(x, Fp8Block):
            return jnp.asarray(dequantize_np(np.asarray(x.weight), np.asarray(x.scale)))
        return jnp.asarray(x, jnp.float32)
    return jax.tree_util.tree_map(conv, tree, is_leaf=lambda x: isinstance(x, Fp8Block))
