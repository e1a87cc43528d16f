"""ops.GDN_PLAIN_SLOTS: the plain decode loops (decode.greedy_loop, greedy_steps) carry each GDN layer's
conv and ssm state in two slots and alternate, so the conv kernel writes its conv state in place. The
tokens and the final state must be the unslotted loop's, bit for bit, on the reference path and through
the conv kernel (interpret mode), with rows that finish at different steps; the serving engine (plain)
keeps its state in the two slots between calls and gives generate's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp import decode, ops
from qmtp.api import _new_state, _prompt_batch
from serving_fixtures import make_engine
from spec_loops import load_controlled

RNG = np.random.default_rng(31)
WIDTH = 9


@pytest.fixture(scope="module")
def controlled(tmp_path_factory):
    return load_controlled(tmp_path_factory, "plain_slots")


@pytest.fixture
def plain_slots():
    """ops.GDN_PLAIN_SLOTS on for the test (jit caches cleared on both sides: the loops read it when traced)."""
    jax.clear_caches()
    before = ops.set_kernel_settings({"gdn_plain_slots": True})
    yield
    ops.set_kernel_settings(before)
    jax.clear_caches()


def _plain(model, prompts, max_new, impl):
    state = _new_state(model, [len(p) + WIDTH + 4 for p in prompts])
    tokens, n_valid = _prompt_batch(prompts)
    first, _, state = decode.prefill(model.cfg, model.params, state, tokens, n_valid, impl=impl)
    out, count, _, state = decode.greedy_loop(model.cfg, decode.LoopSpec(WIDTH, ()), model.params, state, first,
                                              jnp.asarray(max_new, jnp.int32), impl=impl)
    return np.asarray(out), np.asarray(count), state


@pytest.mark.parametrize("impl", ["ref", pytest.param("pallas", marks=pytest.mark.slow)])  # off by default: CI time
def test_greedy_loop_slotted_equals_unslotted(controlled, impl, monkeypatch):
    prompts = [[int(x) for x in RNG.integers(0, 380, 6)], [int(x) for x in RNG.integers(0, 380, 11)]]
    max_new = [WIDTH, 4]  # the second row finishes first and rides along done
    want_out, want_count, want = _plain(controlled, prompts, max_new, impl)
    from pallas_kernels import gdn_conv
    traced = []  # the state rank of every conv-kernel call traced (5: slotted)
    kernel = gdn_conv.gdn_conv_recurrence
    monkeypatch.setattr(gdn_conv, "gdn_conv_recurrence", lambda mixed, *a, **kw: traced.append(a[6].ndim)
                        or kernel(mixed, *a, **kw))
    jax.clear_caches()
    before = ops.set_kernel_settings({"gdn_plain_slots": True})
    try:
        out, count, got = _plain(controlled, prompts, max_new, impl)
    finally:
        ops.set_kernel_settings(before)
        jax.clear_caches()
    if impl == "pallas":
        assert 5 in traced, "the loop's steps call the conv kernel on the slotted state"
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(count, want_count)
    assert all(s.ndim == 4 for s in got.ssm) and all(c.ndim == 3 for c in got.conv), "one state per layer back"
    for a, b in zip(got.ssm + got.conv, want.ssm + want.conv):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # ~12 s; gdn_plain_slots is off by default (measured slower): CI time
def test_engine_keeps_two_slots(model, plain_slots):
    """The plain engine (mtp_k=0) keeps its GDN state in two slots between greedy_steps calls."""
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    engine = make_engine(model, 0)
    got = [h.result(300).tokens for h in [engine.submit(p, 10) for p in prompts]]
    assert engine.stop(5)
    device = engine._device
    assert all(s.shape[0] == 2 and s.ndim == 5 for s in device.state.ssm)
    assert all(c.shape[0] == 2 and c.ndim == 4 for c in device.state.conv)
    ops.set_kernel_settings({"gdn_plain_slots": False})
    jax.clear_caches()
    want = [qmtp.generate(model, [p], max_new_tokens=10).tokens[0] for p in prompts]
    assert got == want


def test_plain_loops_refuse_a_state_slotted_for_mtp(model):
    from qmtp import speculate
    state, _ = speculate.slotted_state(_new_state(model, [16]), 3, "ref")  # K+2 = 5 slots
    slots = decode.Slots.empty(1, model.cfg.hidden_size, 1, jnp.float32)
    with pytest.raises(ValueError, match="5 GDN state slots; the plain loops take 2"):
        decode.greedy_steps(model.cfg, 1, model.params, state, slots)


@pytest.mark.slow  # the switch is off by default; test_engine's TP2 test runs slotted (MTP) state under TP2
def test_tp2_engine_with_two_slots_and_a_snapshot(ckpt, model, plain_slots):
    """Under TP2 the two slots are sharded like the state; a snapshot taken from and restored into the
    slotted state gives the same tokens (generate on one device, unslotted)."""
    from serving_fixtures import PAGE
    tp2 = qmtp.load(ckpt, dtype="float32", page_size=PAGE, progress=False, tp=2)
    engine = make_engine(tp2, 0, snapshot_budget_bytes=1 << 20)
    prompts = [[7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1], [7, 1, 8, 2, 8]]  # the third is a snapshot hit
    results = [engine.generate(p, 9, timeout=300) for p in prompts]
    assert results[2].snapshot_hit
    assert all(s.shape[0] == 2 and s.ndim == 5 for s in engine._device.state.ssm), "two slots, sharded"
    assert engine.stop(5)
    ops.set_kernel_settings({"gdn_plain_slots": False})
    jax.clear_caches()
    want = [qmtp.generate(model, [p], max_new_tokens=9).tokens[0] for p in prompts]
    assert [r.tokens for r in results] == want
