"""KernelConfig.deterministic in bfloat16: a sequence's greedy tokens do not depend on K or on its batch.

The tiny preset's random weights give nearly flat logits, so near-ties are everywhere: one rounding
difference between a row decoded alone, inside a verify pass or inside a batch flips a token within
a few dozen. The default Pallas kernels do flip them here (the control below); with deterministic=True
every mode must give the tokens of plain decoding at batch 1.
"""

import numpy as np
import pytest

import qmtp
from qmtp.tools.make_checkpoint import resolve_checkpoint

N_TOKENS = 24


def _modes(deterministic: bool, tp: int = 1) -> dict:
    """{mode: tokens} of 3 prompts (one prompt bucket) decoded alone, as a batch, and with MTP K = 3."""
    model = qmtp.load(resolve_checkpoint("preset:tiny"), dtype="bfloat16", impl="pallas", progress=False, tp=tp,
                      deterministic=deterministic, prefill_chunk=16)  # deterministic pads a prompt to a chunk
    prompts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (3, 16)).tolist()

    def run(group, k=0):
        return qmtp.generate(model, group, max_new_tokens=N_TOKENS, stop_token_ids=[], mtp_k=k).tokens

    return {"alone": [run([p])[0] for p in prompts], "batch 3": run(prompts), "batch 3, K=3": run(prompts, 3)}


def _differ(modes: dict) -> list[str]:
    alone = modes["alone"]
    return [name for name, tokens in modes.items()
            if any(t != a for t, a in zip(tokens, alone))]


def test_deterministic_tokens_equal_plain_batch1_in_every_mode():
    assert _differ(_modes(deterministic=True)) == []


@pytest.mark.slow  # CI time: the TP1 case above; TP2's partial sums of two shards add in either order alike
def test_deterministic_tokens_equal_plain_batch1_in_every_mode_under_tp2():
    assert _differ(_modes(deterministic=True, tp=2)) == []


@pytest.mark.slow
def test_default_kernels_flip_the_near_ties_of_this_model():
    """The control: the same comparison with the default kernels finds differences, so the test above
    compares at near-ties that a row-dependent rounding does flip."""
    assert _differ(_modes(deterministic=False)) != []


@pytest.mark.slow  # CI time: the pass shapes that make it hold are checked below; the GPU harness runs batches
def test_prompts_of_different_buckets_in_one_batch_give_their_tokens_alone():
    """A 10-token prompt (bucket 16) decoded alone and in a batch with a 40-token one (bucket 64, so the
    batch pads to 64): under deterministic every prefill pass has the shape [1, prefill_chunk] whatever
    the bucket, so the rows keep their tokens. prefill_chunk = 64: the 40-token prompt is one chunk."""
    model = qmtp.load(resolve_checkpoint("preset:tiny"), dtype="bfloat16", impl="pallas", progress=False,
                      deterministic=True, prefill_chunk=64)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (10, 40)]

    def run(group, k=0):
        return qmtp.generate(model, group, max_new_tokens=N_TOKENS, stop_token_ids=[], mtp_k=k).tokens

    alone = [run([p])[0] for p in prompts]
    assert run(prompts) == alone
    assert run(prompts, 2) == alone


@pytest.mark.parametrize("bucket", [16, 64])
def test_every_deterministic_prefill_pass_is_one_prompt_of_one_chunk(bucket, monkeypatch):
    """The shapes behind the test above, which the CPU cannot show (its reductions keep one order at any
    row count; the H200's do not): traced, every target and MTP pass of a deterministic prefill of two
    prompts in a bucket of 16 or 64 tokens sees tokens [1, prefill_chunk = 32]."""
    import functools

    import jax
    import jax.numpy as jnp

    from qmtp import api
    from qmtp.model import mtp, target
    from qmtp.runtime import loop, prefill
    from qmtp.runtime.kernel_config import KernelConfig

    model = qmtp.load(resolve_checkpoint("preset:tiny"), dtype="bfloat16", impl="pallas", progress=False,
                      deterministic=True, prefill_chunk=32)
    seen = []
    for module in (target, mtp):
        def recording(cfg, params, state, tokens, *a, _f=module.forward, **kw):
            seen.append(tokens.shape)
            return _f(cfg, params, state, tokens, *a, **kw)
        monkeypatch.setattr(module, "forward", recording)
    kernels = KernelConfig("pallas", deterministic=True, prefill_chunk=32)
    state = api._new_state(model, [bucket + 4] * 2)
    tokens = jnp.ones((2, bucket), jnp.int32)
    jax.eval_shape(functools.partial(prefill.prefill.__wrapped__, model.cfg, kernels, True), model.params, state, tokens,
                   jnp.array([3, bucket - 1], jnp.int32), jnp.array([4, 4], jnp.int32),
                   jnp.full((2, 1), loop.NO_STOP, jnp.int32))
    assert seen and set(seen) == {(1, 32)}, seen
