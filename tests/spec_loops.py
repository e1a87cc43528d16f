"""The decode loop run directly (prefill.prefill + loop.decode) with a forced acceptance cap, returning
the tokens and the final decode state: shared by the speculative-decoding tests."""

import jax.numpy as jnp
import numpy as np

import qmtp
from qmtp.api import _new_state, _prompt_batch
from qmtp.runtime import loop, prefill
from qmtp.runtime.kernel_config import REF
from qmtp.tools import make_checkpoint

BUFFER = 13  # one output width for every forced-acceptance case


def load_controlled(tmp_path_factory, name: str):
    """The tiny controlled checkpoint (seed 5, fp32; its drafts are always right) written under a
    fresh temp dir and loaded in float32 with page size 4 (boundaries cross page edges)."""
    path = tmp_path_factory.mktemp(name) / "ckpt"
    return qmtp.load(make_checkpoint.write_checkpoint(str(path), "tiny_controlled", "fp32", seed=5), dtype="float32",
                     page_size=4)


def run_spec(model, prompts, k, max_new, cap=None, kernels=REF):
    """(tokens [B, BUFFER] (the first token, then the loop's; PAD_TOKEN after the end), stats, state)
    of K = k decoding (0: plain) with every round's accepted drafts capped at `cap` (None: no cap)."""
    b = len(prompts)
    state = _new_state(model, [len(p) + BUFFER + k + 1 for p in prompts])
    tokens, n_valid = _prompt_batch(prompts)
    budget = jnp.full((b,), max_new, jnp.int32)
    first, slots, state = prefill.prefill(model.cfg, kernels, k > 0, model.params, state, tokens, n_valid, budget,
                                       loop.stop_rows((), b))
    caps = None if cap is None else jnp.full((1, b), cap, jnp.int32)
    out, count, stats, state, _ = loop.decode(model.cfg, kernels, k, BUFFER, model.params, state, slots, caps)
    out = np.concatenate([np.asarray(first)[:, None], np.asarray(out)], axis=1)[:, :BUFFER]
    return out, stats, state


def run_plain(model, prompts, max_new, kernels=REF):
    out, _, state = run_spec(model, prompts, 0, max_new, kernels=kernels)
    return out, state
