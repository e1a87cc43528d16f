"""Speculative and plain greedy loops run directly (speculate.spec_loop / decode.greedy_loop) with a
forced acceptance cap, returning outputs and final decode states: shared by the speculate tests."""

import jax
import jax.numpy as jnp
import numpy as np

import qmtp
from qmtp import decode, ops, speculate
from qmtp.api import _new_state, _prompt_batch
from qmtp.tools import make_checkpoint

BUFFER = 13  # one output width for every forced-acceptance case: one compiled loop


def load_controlled(tmp_path_factory, name: str):
    """The tiny controlled checkpoint (seed 5, fp32; its drafts are always right) written under a
    fresh temp dir and loaded in float32 with page size 4 (boundaries cross page edges)."""
    path = tmp_path_factory.mktemp(name) / "ckpt"
    return qmtp.load(make_checkpoint.write_checkpoint(str(path), "tiny_controlled", "fp32", seed=5), dtype="float32",
                     page_size=4)


def run_spec(model, prompts, k, max_new, cap, impl="ref"):
    state = _new_state(model, [len(p) + BUFFER + k + 1 for p in prompts])
    tokens, n_valid = _prompt_batch(prompts)
    first, d1, mh, state = speculate.prefill(model.cfg, model.params, state, tokens, n_valid, impl=impl)
    spec = speculate.SpecConfig(k, BUFFER, ())
    cap = jnp.full((1, len(prompts)), cap, jnp.int32)
    out, count, stats, state = speculate.spec_loop(model.cfg, spec, model.params, state, first, d1, mh,
                                                   jnp.full((len(prompts),), max_new, jnp.int32), cap, impl=impl)
    return np.asarray(out), stats, state


def run_plain(model, prompts, max_new):
    state = _new_state(model, [len(p) + BUFFER + 4 for p in prompts])
    tokens, n_valid = _prompt_batch(prompts)
    first, _, state = decode.prefill(model.cfg, model.params, state, tokens, n_valid)
    out, _, _, state = decode.greedy_loop(model.cfg, decode.LoopSpec(BUFFER, ()), model.params, state, first,
                                          jnp.full((len(prompts),), max_new, jnp.int32))
    return np.asarray(out), state


def run_spec_with(settings: dict, model, prompts, k, max_new, cap):
    """run_spec with impl="pallas" under the kernel settings given (ops.set_kernel_settings), put back
    after. The jit caches are cleared on both sides: a loop compiled earlier with these shapes keeps
    the kernels it was traced with."""
    jax.clear_caches()
    before = ops.set_kernel_settings(settings)
    try:
        return run_spec(model, prompts, k, max_new, cap=cap, impl="pallas")
    finally:
        ops.set_kernel_settings(before)
        jax.clear_caches()
