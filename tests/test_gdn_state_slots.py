"""ops.GDN_STATE_SLOTS: the speculative loops carry each GDN layer's conv and ssm state in K+2 slots
with a read slot per row (qmtp.speculate.slotted_state); the verify pass writes the state after each
of its tokens to the slots after the read one, and the commit moves the read slot (no rebuild).
Tokens and the final state must be those of plain decoding: on the reference path (the conv kernel's
jnp twin) and through the conv kernel (interpret mode), with every draft rejected and one of three
accepted; model.commit_gdn must never run; the serving engine's resumed loop (speculate.spec_rounds)
gives generate's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp import model as model_lib, ops
from serving_fixtures import make_engine
from spec_loops import load_controlled, run_plain, run_spec, run_spec_with
from tolerance import F32_MODEL, assert_close

RNG = np.random.default_rng(29)


@pytest.fixture(scope="module")
def controlled(tmp_path_factory):
    return load_controlled(tmp_path_factory, "slots")


@pytest.fixture
def no_rebuild(monkeypatch):
    """model.commit_gdn poisoned (NaN states): a slotted loop must not call it."""
    real = model_lib.commit_gdn
    monkeypatch.setattr(model_lib, "commit_gdn", lambda *a, **kw: jax.tree.map(
        lambda x: jnp.full_like(x, jnp.nan), real(*a, **kw)))
    jax.clear_caches()  # the loop reads the module attribute when it is traced
    yield
    jax.clear_caches()


def _check_against_plain(model, prompts, out, stats, state, max_new, accepted, what):
    want, plain_state = run_plain(model, prompts, max_new)
    np.testing.assert_array_equal(out, want, what)
    assert np.asarray(stats["accepted"]).tolist() == accepted, what
    assert all(s.ndim == 4 for s in state.ssm), "the loop hands back one state per layer, not the slots"
    assert all(c.ndim == 3 for c in state.conv), "one conv state per layer"
    assert_close(np.stack(state.ssm), np.stack(plain_state.ssm), F32_MODEL, f"ssm, {what}")
    assert_close(np.stack(state.conv), np.stack(plain_state.conv), F32_MODEL, f"conv, {what}")


@pytest.mark.slow  # CI time (session 16): test_speculate's forced acceptance runs the slotted state in CI
@pytest.mark.parametrize("a", [1])  # every a in 0..3: test_speculate's forced acceptance, slotted by default
def test_reference_path_slotted(controlled, no_rebuild, a):
    assert ops.GDN_STATE_SLOTS, "the default"
    k, rounds = 3, 3
    max_new = 1 + rounds * (a + 1)
    prompts = [[int(x) for x in RNG.integers(0, 380, 6)], [int(x) for x in RNG.integers(0, 380, 13)]]
    out, stats, state = run_spec(controlled, prompts, k, max_new, cap=a)
    _check_against_plain(controlled, prompts, out, stats, state, max_new, [rounds * a] * 2, f"ref, a={a}")


def test_conv_kernel_slotted(controlled, no_rebuild, monkeypatch):
    """impl="pallas": the verify pass calls the conv kernel on slotted state with the rows' read slots."""
    k, rounds, a = 3, 2, 0
    max_new = 1 + rounds * (a + 1)
    prompts = [[int(x) for x in RNG.integers(0, 380, 5)], [int(x) for x in RNG.integers(0, 380, 9)]]
    from pallas_kernels import gdn_conv
    traced = []  # (tokens, state rank, slots given) of every kernel call traced
    kernel = gdn_conv.gdn_conv_recurrence
    monkeypatch.setattr(gdn_conv, "gdn_conv_recurrence", lambda mixed, *args, **kw: traced.append(
        (mixed.shape[1], args[6].ndim, kw.get("slots") is not None)) or kernel(mixed, *args, **kw))
    out, stats, state = run_spec_with({}, controlled, prompts, k, max_new, cap=a)
    assert (k + 1, 5, True) in traced and all(slotted == (rank == 5) for _, rank, slotted in traced), traced
    _check_against_plain(controlled, prompts, out, stats, state, max_new, [rounds * a] * 2, f"pallas, a={a}")


@pytest.mark.slow  # a switch off by default: CI time
def test_switch_off_rebuilds(controlled, no_rebuild):
    """gdn_state_slots=false: the rebuild path again (the poisoned commit shows in the state)."""
    prompts = [[int(x) for x in RNG.integers(0, 380, 7)]]
    before = ops.set_kernel_settings({"gdn_state_slots": False})
    try:
        _, _, state = run_spec(controlled, prompts, 3, 3, cap=1)
    finally:
        ops.set_kernel_settings(before)
        jax.clear_caches()
    assert np.isnan(np.stack(state.ssm)).all()


def test_engine_keeps_its_state_slotted(model):
    """The one-device engine keeps its GDN state in K+2 slots between speculate.spec_rounds calls (a
    few rounds each), the read slots in the carry: the same tokens as generate (plain), and the read
    slots have moved."""
    assert ops.GDN_STATE_SLOTS
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    want = [qmtp.generate(model, [p], max_new_tokens=12).tokens[0] for p in prompts]
    engine = make_engine(model, 3)
    got = [h.result(300).tokens for h in [engine.submit(p, 12) for p in prompts]]
    assert engine.stop(5)
    assert got == want
    device = engine._device
    assert all(s.shape[0] == 5 and s.ndim == 5 for s in device.state.ssm)
    assert all(c.shape[0] == 5 and c.ndim == 4 for c in device.state.conv)
    assert np.asarray(device.slots.gdn_slot).any(), "rounds move the read slots"


def test_spec_rounds_refuses_a_state_slotted_for_another_k(model):
    from qmtp import decode, speculate
    from qmtp.api import _new_state
    state, _ = speculate.slotted_state(_new_state(model, [16]), 2, "ref")  # K+2 = 4 slots
    slots = decode.Slots.empty(1, model.cfg.hidden_size, 1, jnp.float32)
    with pytest.raises(ValueError, match="4 GDN state slots; K = 3 needs K\\+2 = 5"):
        speculate.spec_rounds(model.cfg, 3, 1, model.params, state, slots)
