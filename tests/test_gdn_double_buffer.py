"""ops.GDN_DOUBLE_BUFFER: the speculative loops carry each GDN layer's state as a pair [2, B, Hv, Dk, Dv]
with a current-half index (qmtp.speculate.paired_state); verify reads the current half and writes the
other in place, the commit's rebuild reads the current half again, the index flips every round.
Tokens and the final state must be those of plain decoding, on the reference path (the layers'
generic read/write of a half) and through the conv kernel (interpret mode), with every draft
rejected (a rebuild each round) and one of three accepted; the serving
engine's resumed loop (speculate.spec_rounds) gives generate's tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import qmtp
from qmtp import ops
from serving_fixtures import make_engine
from spec_loops import load_controlled, run_plain, run_spec, run_spec_with
from tolerance import F32_MODEL, assert_close

RNG = np.random.default_rng(23)


@pytest.fixture(scope="module")
def controlled(tmp_path_factory):
    return load_controlled(tmp_path_factory, "controlled")


def _check_against_plain(model, prompts, out, stats, state, max_new, accepted, what):
    want, plain_state = run_plain(model, prompts, max_new)
    np.testing.assert_array_equal(out, want, what)
    assert np.asarray(stats["accepted"]).tolist() == accepted, what
    assert all(s.ndim == 4 for s in state.ssm), "the loop hands back one state per layer, not the pair"
    assert_close(np.stack(state.ssm), np.stack(plain_state.ssm), F32_MODEL, f"ssm, {what}")
    assert_close(np.stack(state.conv), np.stack(plain_state.conv), F32_MODEL, f"conv, {what}")


@pytest.mark.parametrize("a", [1])
def test_reference_path_double_buffered(controlled, a):
    k, rounds = 3, 3
    max_new = 1 + rounds * (a + 1)
    prompts = [[int(x) for x in RNG.integers(0, 380, 6)], [int(x) for x in RNG.integers(0, 380, 13)]]
    jax.clear_caches()
    before = ops.set_kernel_settings({"gdn_double_buffer": True})
    try:
        out, stats, state = run_spec(controlled, prompts, k, max_new, cap=a)
    finally:
        ops.set_kernel_settings(before)
        jax.clear_caches()
    _check_against_plain(controlled, prompts, out, stats, state, max_new, [rounds * a] * 2, f"ref, a={a}")


@pytest.mark.parametrize("a", [0])
def test_conv_kernel_double_buffered(controlled, monkeypatch, a):
    """impl="pallas": verify (and the rebuild) call the conv kernel on the pairs with halves (read, write)."""
    k, rounds = 3, 2
    max_new = 1 + rounds * (a + 1)
    prompts = [[int(x) for x in RNG.integers(0, 380, 5)], [int(x) for x in RNG.integers(0, 380, 9)]]
    from pallas_kernels import gdn_conv
    traced = []  # (tokens, state rank, halves given) of every kernel call traced
    kernel = gdn_conv.gdn_conv_recurrence
    monkeypatch.setattr(gdn_conv, "gdn_conv_recurrence", lambda mixed, *args, **kw: traced.append(
        (mixed.shape[1], args[6].ndim, kw.get("halves") is not None)) or kernel(mixed, *args, **kw))
    out, stats, state = run_spec_with({"gdn_double_buffer": True}, controlled, prompts, k, max_new, cap=a)
    assert (k + 1, 5, True) in traced and all(paired == (rank == 5) for _, rank, paired in traced), traced
    _check_against_plain(controlled, prompts, out, stats, state, max_new, [rounds * a] * 2, f"pallas, a={a}")


def test_engine_resumed_loop_double_buffered(model):
    """The engine runs speculate.spec_rounds a few rounds per call, pairing and unpairing each call:
    the same tokens as generate (plain), with the setting on."""
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    want = [qmtp.generate(model, [p], max_new_tokens=12).tokens[0] for p in prompts]
    jax.clear_caches()
    before = ops.set_kernel_settings({"gdn_double_buffer": True})
    try:
        engine = make_engine(model, 3)
        got = [h.result(300).tokens for h in [engine.submit(p, 12) for p in prompts]]
        assert engine.stop(5)
    finally:
        ops.set_kernel_settings(before)
        jax.clear_caches()
    assert got == want
