"""The GDN slot ring, the loop's one commit: each GDN layer's conv and ssm state lives in K+2 slots
with a read slot per row (qmtp/runtime/loop.py); the verify pass writes the state after each of its tokens
to the slots after the read one, and the commit moves the read slot. Tokens and the final state must
be those of plain decoding, through the conv kernel (interpret mode) as on the reference path
(test_speculate's forced acceptance); the serving engine keeps its state in the ring between calls
and gives generate's tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp.runtime import loop, prefill
from qmtp.runtime.kernel_config import PALLAS, REF
from serving_fixtures import make_engine
from spec_loops import load_controlled, run_plain, run_spec
from tolerance import F32_MODEL, assert_close

RNG = np.random.default_rng(29)


@pytest.fixture(scope="module")
def controlled(tmp_path_factory):
    return load_controlled(tmp_path_factory, "slots")


def _check_against_plain(model, prompts, out, stats, state, max_new, accepted, what):
    want, plain_state = run_plain(model, prompts, max_new)
    np.testing.assert_array_equal(out, want, what)
    assert np.asarray(stats["accepted"]).tolist() == accepted, what
    assert all(s.ndim == 4 for s in state.ssm), "the loop hands back one state per layer, not the slots"
    assert all(c.ndim == 3 for c in state.conv), "one conv state per layer"
    assert_close(np.stack(state.ssm), np.stack(plain_state.ssm), F32_MODEL, f"ssm, {what}")
    assert_close(np.stack(state.conv), np.stack(plain_state.conv), F32_MODEL, f"conv, {what}")


def test_conv_kernel_slotted(controlled, monkeypatch):
    """impl="pallas": the verify pass calls the conv kernel on the ring with the rows' read slots."""
    k, rounds, a = 3, 2, 0
    max_new = 1 + rounds * (a + 1)
    prompts = [[int(x) for x in RNG.integers(0, 380, 5)], [int(x) for x in RNG.integers(0, 380, 9)]]
    from pallas_kernels import gdn_conv
    traced = []  # (tokens, state rank, slots given) of every kernel call traced
    kernel = gdn_conv.gdn_conv_recurrence
    monkeypatch.setattr(gdn_conv, "gdn_conv_recurrence", lambda mixed, *args, **kw: traced.append(
        (mixed.shape[1], args[6].ndim, kw.get("slots") is not None)) or kernel(mixed, *args, **kw))
    # a loop traced earlier in this process would not call the wrapper, nor would one traced after it; only
    # these two functions' caches (clearing all of JAX's would make the rest of the process trace again)
    fresh = lambda: (prefill.prefill.clear_cache(), loop.decode.clear_cache())  # noqa: E731
    fresh()
    out, stats, state = run_spec(controlled, prompts, k, max_new, cap=a, kernels=PALLAS)
    fresh()
    assert (k + 1, 5, True) in traced and all(slotted == (rank == 5) for _, rank, slotted in traced), traced
    _check_against_plain(controlled, prompts, out, stats, state, max_new, [rounds * a] * 2, f"pallas, a={a}")


@pytest.mark.slow  # CI time: every engine test with K > 0 runs the ring; test_engine.py checks their tokens
@pytest.mark.parametrize("k", [0, 3])
def test_engine_keeps_its_state_in_the_ring(model, k):
    """The one-device engine keeps its GDN state in K+2 slots between loop.decode calls (a few rounds
    each), the read slots in the carry: the same tokens as generate (plain), and the read slots have
    moved; plain decoding (K = 0) alternates between two slots."""
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    want = [qmtp.generate(model, [p], max_new_tokens=12).tokens[0] for p in prompts]
    engine = make_engine(model, k)
    got = [h.result(300).tokens for h in [engine.submit(p, 12) for p in prompts]]
    assert engine.stop(5)
    assert got == want
    device = engine._device
    assert all(s.shape[0] == k + 2 and s.ndim == 5 for s in device.state.ssm)
    assert all(c.shape[0] == k + 2 and c.ndim == 4 for c in device.state.conv)
    assert np.asarray(device.slots.gdn_slot).any(), "rounds move the read slots"


def test_decode_refuses_a_ring_made_for_another_k(model):
    from qmtp.api import _new_state
    from qmtp.runtime import loop
    state = loop.to_ring(_new_state(model, [16]), loop.ring_size(2))  # K+2 = 4 slots
    slots = loop.Slots.empty(1, model.cfg.hidden_size, model.cfg.vocab_size, 1, jnp.float32)
    with pytest.raises(ValueError, match="4 GDN state slots; K = 3 needs 5"):
        loop.decode(model.cfg, REF, 3, 1, model.params, state, slots)
