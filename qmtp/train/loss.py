"""The training objective of a target and its MTP head, written with qmtp's own model functions.

For a window of tokens x_0 .. x_{T-1} (one row of `tokens` [B, T]):

    h_p     = target hidden after the final norm at position p        target.forward       p = 0 .. T-1
    L_main  = mean_{p = 0 .. T-2}  CE(h_p @ lm_head.T, x_{p+1})                           next token
    m_p     = MTP(h_p, x_{p+1}) after mtp.norm, at position p         mtp.forward          p = 0 .. T-3
    L_mtp   = mean_{p = 0 .. T-3}  w_p CE(m_p @ lm_head.T, x_{p+2}) / mean w_p            token after next
    L       = L_main + lambda * L_mtp                                 (joint; lambda = mtp_weight, DeepSeek-V3 0.3)
    L       = L_mtp, h_p under stop_gradient                           (mtp_only: the target is frozen)

The MTP alignment is MODEL_SPEC §4.1-4.2 as inference runs it (KV at position p, lag-1); `w_p`
(default 1) masks labels. `accept` = mean_p [argmax(m_p @ lm_head.T) == argmax(h_{p+1} @ lm_head.T)],
the teacher-forced first-draft acceptance (`qmtp.api.mtp_logits().agreement`).
The forward is the inference code under the reference kernels (pure jnp, differentiable) over a fresh
decode state of one T-slot page per sequence; float32 masters are cast by `cast_for_compute`.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qmtp.model import mtp, target
from qmtp.model.config import ModelConfig
from qmtp.model.fp8 import Fp8Block
from qmtp.model.params import abstract_params
from qmtp.runtime.kernel_config import REF
from qmtp.runtime.state import init_state

OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "mlp_down")  # residual-branch outputs: init scaled by 1/sqrt(2 L)


def init_params(cfg: ModelConfig, seed: int, std: float = 0.02) -> dict:
    """Fresh float32 parameters (host numpy arrays) with the tree of `params.abstract_params(cfg)`.

    Linear weights and embeddings N(0, std) (o_proj / out_proj / mlp_down: std / sqrt(2 L), GPT-2);
    zero-centred norms 0 (scale 1); the GDN output norm (plain w) 1; A_log = log U(1, 16) and
    dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1] (Mamba / FLA); conv U(+-1/sqrt(W)).
    Each leaf draws from its own stream seeded by (seed, its tree path)."""
    scaled_std = std / math.sqrt(2 * cfg.num_hidden_layers)

    def init(path, leaf):
        name = str(path[-1].key) if hasattr(path[-1], "key") else str(path[-1])
        rng = np.random.default_rng([seed, zlib.crc32(jax.tree_util.keystr(path).encode())])
        shape = leaf.shape
        if name == "gdn_norm":
            return np.ones(shape, np.float32)
        if name.endswith("norm") or name.startswith("pre_fc_norm"):
            return np.zeros(shape, np.float32)
        if name == "A_log":
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        if name == "dt_bias":
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(0.1), shape))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus(dt_bias) = dt
        if name == "conv":
            bound = 1.0 / math.sqrt(shape[-1])
            return rng.uniform(-bound, bound, shape).astype(np.float32)
        s = scaled_std if name in OUTPUT_PROJECTIONS else std
        return (s * rng.standard_normal(shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(init, abstract_params(cfg, jnp.float32))


def cast_for_compute(params, dtype):
    """float32 leaves with >= 2 dims -> `dtype`; 1-D leaves and FP8 blocks unchanged."""
    def cast(x):
        if isinstance(x, Fp8Block) or x.ndim < 2 or x.dtype != jnp.float32:
            return x
        return x.astype(dtype)
    return jax.tree_util.tree_map(cast, params, is_leaf=lambda x: isinstance(x, Fp8Block))


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position CE [B, T'] of f32 logits [B, T', V] against int labels [B, T']."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.int32))


def mtp_chain(cfg: ModelConfig, params: dict, state, tokens: jax.Array, mh: jax.Array, depth: int,
              first: int = 2) -> list:
    """The MTP outputs of depths first..depth over tokens [B, T], from the depth first-1 outputs mh
    (depth 1: [B, T-2, E]; for first=1, the target hiddens [B, T, E]).

    Depth d at index p takes the token x_{p+d} and the depth d-1 output at index p (what drafting
    feeds the MTP layer after its first draft) and predicts x_{p+d+1}: [B, T-1-d, E]. Each depth is
    its own causal pass over the sequence (positions from 0, its own MTP KV entries)."""
    b, t = tokens.shape
    out, h = [], mh
    for d in range(first, depth + 1):
        h, _ = mtp.forward(cfg, params, state, tokens[:, d:-1], h[:, :t - 1 - d], jnp.zeros((b,), jnp.int32),
                           jnp.full((b,), t - 1 - d, jnp.int32), REF)
        out.append(h)
    return out


def losses(cfg: ModelConfig, params: dict, tokens: jax.Array, mtp_mask: jax.Array | None = None, *,
           mtp_weight: float = 0.3, mtp_only: bool = False, mtp_depth: int = 1,
           predictions: bool = False) -> tuple[jax.Array, dict]:
    """(L, {"loss", "main", "mtp", "accept"[, "mtp1" .. "mtpD"]}) for tokens [B, T] (T >= mtp_depth + 2);
    params in the compute dtype. mtp_mask: [B, T-2] weights of the labels x_{p+2} (None = all 1).
    mtp_depth D > 1 also trains the chain of `mtp_chain` (one shared MTP layer, teacher-forced
    tokens); L_mtp is then the mean over depths. predictions: also "predictions", the target's greedy
    next tokens [B, T-1] int32 (for qmtp.train.health)."""
    b, t = tokens.shape
    state = init_state(cfg, np.arange(b)[:, None], num_pages=b, page_size=t, dtype=params["embed"].dtype)
    hidden, state = target.forward(cfg, params, state, tokens, jnp.full((b,), t, jnp.int32), REF)  # [B, T, E]
    if mtp_only:
        hidden = jax.lax.stop_gradient(hidden)
    logits = target.logits_from_hidden(params, hidden[:, :-1], REF)  # [B, T-1, V] f32: predicts x_{p+1}
    main = jnp.mean(_cross_entropy(logits, tokens[:, 1:]))

    # MTP depth d over the target's state (its KV pages unused): [B, T-1-d, V] f32 logits predicting x_{p+d+1}
    mtp_logits = [target.logits_from_hidden(params, h, REF)
                  for h in mtp_chain(cfg, params, state, tokens, hidden, mtp_depth, first=1)]
    w = jnp.ones((b, t - 2), jnp.float32) if mtp_mask is None else mtp_mask.astype(jnp.float32)
    weighted = lambda x, wd: jnp.sum(wd * x) / jnp.maximum(jnp.sum(wd), 1.0)  # noqa: E731
    depth_losses = [weighted(_cross_entropy(lg, tokens[:, d + 1:]), w[:, d - 1:]) for d, lg in enumerate(mtp_logits, 1)]
    mtp_loss = sum(depth_losses) / len(depth_losses)

    accept = weighted(jnp.argmax(mtp_logits[0], -1) == jnp.argmax(logits[:, 1:], -1), w)  # draft == target at p+1
    total = mtp_loss if mtp_only else main + mtp_weight * mtp_loss
    metrics = {"loss": total, "main": main, "mtp": mtp_loss, "accept": accept}
    if mtp_depth > 1:
        metrics.update({f"mtp{d + 1}": x for d, x in enumerate(depth_losses)})
    if predictions:
        metrics["predictions"] = jnp.argmax(logits, -1).astype(jnp.int32)
    return total, metrics
