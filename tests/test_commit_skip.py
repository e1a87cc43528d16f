"""speculate.SKIP_FULL_COMMIT: a round whose live rows kept every verified token takes the verify
pass's GDN/conv state and skips model.commit_gdn; any shorter acceptance still rebuilds it.

The rebuild is poisoned (NaN states) to see which branch ran: with full acceptance the tokens and
the state must still be plain greedy's, with a shorter one the poison must show. The loops run without
slotted GDN state (ops.GDN_STATE_SLOTS, which has no rebuild to skip)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmtp import model as model_lib, ops, speculate
from spec_loops import load_controlled, run_plain, run_spec
from tolerance import F32_MODEL, assert_close

RNG = np.random.default_rng(23)


@pytest.fixture(scope="module")
def controlled(tmp_path_factory):
    return load_controlled(tmp_path_factory, "skip")


@pytest.fixture(scope="module")
def poisoned_commit():
    """model.commit_gdn returning NaN states of the right shapes, for the module; jit caches cleared
    around it (the spec loop reads the module attribute when it is traced)."""
    real = model_lib.commit_gdn

    def nan_commit(*args, **kwargs):
        conv, ssm = real(*args, **kwargs)
        return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), (conv, ssm))

    jax.clear_caches()
    model_lib.commit_gdn = nan_commit
    before = ops.set_kernel_settings({"gdn_state_slots": False})
    yield
    ops.set_kernel_settings(before)
    model_lib.commit_gdn = real
    jax.clear_caches()


def _case(k: int, a: int):
    """Two prompts of fixed lengths (one compiled loop for every case) and a budget of two rounds."""
    prompts = [[int(x) for x in RNG.integers(0, 380, n)] for n in (7, 12)]
    return prompts, 1 + 2 * (a + 1)  # each round emits a + 1 tokens


def test_full_acceptance_takes_the_verify_state(controlled, poisoned_commit):
    k = 3
    prompts, max_new = _case(k, k)
    out, stats, state = run_spec(controlled, prompts, k, max_new, cap=k)
    want, plain_state = run_plain(controlled, prompts, max_new)
    np.testing.assert_array_equal(out, want)
    assert np.asarray(stats["accepted"]).tolist() == [2 * k] * len(prompts)
    assert_close(np.stack(state.ssm), np.stack(plain_state.ssm), F32_MODEL, "ssm, commit skipped")
    assert_close(np.stack(state.conv), np.stack(plain_state.conv), F32_MODEL, "conv, commit skipped")


def test_partial_acceptance_still_rebuilds(controlled, poisoned_commit):
    prompts, max_new = _case(3, 1)
    _, _, state = run_spec(controlled, prompts, 3, max_new, cap=1)
    assert np.isnan(np.stack(state.ssm)).all() and np.isnan(np.stack(state.conv)).all()


@pytest.mark.slow  # a switch off by default: CI time
def test_switch_off_always_rebuilds(controlled, poisoned_commit, monkeypatch):
    monkeypatch.setattr(speculate, "SKIP_FULL_COMMIT", False)
    jax.clear_caches()  # the switch is read when the loop is traced
    prompts, max_new = _case(3, 3)
    _, _, state = run_spec(controlled, prompts, 3, max_new, cap=3)
    assert np.isnan(np.stack(state.ssm)).all()
