"""pallas_kernels/gdn.py: the references of the gated delta rule (per token, chunked) and of its
gates against float64 loops written here. (The decode / verify kernel is gdn_conv.py's:
tests/test_kernel_gdn_conv.py.)

Tolerances. Each token does Dk-term dot products in f32; with |k| = 1 and |q| = Dk^-0.5 the summed
terms are bounded by the scale of the state columns, so one token adds a relative rounding error of
at most Dk * u (u = 2^-24, the f32 unit roundoff), and the update S <- exp(g)(I - beta k k^T) S + ...
is a contraction (0 < beta < 1, g <= 0), so earlier errors are not amplified: T tokens stay within
T * Dk * u of the exact result. Any indexing or formula slip gives an O(1) relative error, far above
these bounds.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn
from tolerance import assert_close

F32_UNIT_ROUNDOFF = 2.0 ** -24


def f32_recurrence_tol(t: int, dk: int, implementations: int = 1) -> float:
    """Worst-case relative rounding of `implementations` f32 recurrences over t tokens of Dk terms."""
    return implementations * max(t, 1) * dk * F32_UNIT_ROUNDOFF


# ------------------------------------------------------------------------------------------------
# inputs and the independent float64 loop
# ------------------------------------------------------------------------------------------------


def make_inputs(b, t, hk, hv, dk, dv, seed=0, state_scale=0.5):
    """Model-like inputs: q, k L2-normalised (q scaled by Dk^-0.5), g < 0, 0 < beta < 1, a dense
    non-zero initial state (no zeros, so bit comparisons cannot hide a -0/+0 change)."""
    rng = np.random.default_rng(seed)
    l2 = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = l2(rng.standard_normal((b, t, hk, dk))) * dk ** -0.5
    k = l2(rng.standard_normal((b, t, hk, dk)))
    v = rng.standard_normal((b, t, hv, dv))
    g = -0.3 * np.exp(0.5 * rng.standard_normal((b, t, hv)))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, hv))))
    s0 = rng.standard_normal((b, hv, dk, dv)) * state_scale
    return tuple(np.asarray(a, np.float32) for a in (q, k, v, g, beta, s0))


def np_recurrence(q, k, v, g, beta, s0):
    """float64 loop over b, t, h, from the formula: value head h reads key head h // (Hv / Hk).
    Returns (o [B,T,Hv,Dv], final [B,Hv,Dk,Dv], states after each token [B,T,Hv,Dk,Dv])."""
    q, k, v, g, beta, s = (np.array(a, np.float64) for a in (q, k, v, g, beta, s0))
    b_n, t_n, hk, _ = q.shape
    hv = v.shape[2]
    r = hv // hk
    o = np.zeros(v.shape)
    states = np.zeros((b_n, t_n) + s.shape[1:])
    for b in range(b_n):
        for t in range(t_n):
            for h in range(hv):
                kt, qt = k[b, t, h // r], q[b, t, h // r]
                s[b, h] = np.exp(g[b, t, h]) * s[b, h]
                u = v[b, t, h] - s[b, h].T @ kt
                s[b, h] = s[b, h] + np.outer(kt, beta[b, t, h] * u)
                o[b, t, h] = s[b, h].T @ qt
            states[b, t] = s[b]
    return o, s, states


# ------------------------------------------------------------------------------------------------
# the reference against float64
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,t,hk,hv,dk,dv", [(2, 7, 2, 4, 16, 8), (1, 5, 2, 2, 32, 16), (3, 1, 1, 3, 8, 8)])
def test_ref_matches_float64_loop(b, t, hk, hv, dk, dv):
    args = make_inputs(b, t, hk, hv, dk, dv, seed=1)
    o, s, states = gdn.gdn_recurrence_ref(*map(jnp.asarray, args), return_states=True)
    want_o, want_s, want_states = np_recurrence(*args)
    tol = f32_recurrence_tol(t, dk)
    assert_close(o, want_o, tol, "ref o")
    assert_close(s, want_s, tol, "ref final state")
    assert_close(states, want_states, tol, "ref per-token states")


@pytest.mark.parametrize("t,chunk", [(7, 4), (9, 64), (12, 4)])
def test_chunked_ref_matches_float64_loop(t, chunk):
    """The chunked WY form, T not a multiple of the chunk (padded with g = beta = 0 tokens) and one
    chunk longer than T, against the same float64 loop (the chunk's solve adds C roundings per token)."""
    args = make_inputs(2, t, 2, 4, 16, 8, seed=t + chunk)
    o, s = gdn.gdn_chunked_ref(*map(jnp.asarray, args), chunk=chunk)
    want_o, want_s, _ = np_recurrence(*args)
    tol = f32_recurrence_tol(t, 16 + chunk, implementations=2)
    assert_close(o, want_o, tol, "chunked o")
    assert_close(s, want_s, tol, "chunked final state")


def np_gates(a, b, a_log, dt_bias):
    """MODEL_SPEC §3.6 step 4 in float64: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
    (softplus = identity above 20, as PyTorch's default threshold)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    x = a + np.asarray(dt_bias, np.float64)
    softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    return -np.exp(np.asarray(a_log, np.float64)) * softplus, 1 / (1 + np.exp(-b))


def test_gates_ref_matches_float64():
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((2, 5, 4)) * 3.0).astype(np.float32)
    a[0, 0, 0] = 30.0  # past the softplus threshold
    b = rng.standard_normal((2, 5, 4)).astype(np.float32)
    a_log, dt_bias = (rng.standard_normal(4) * 0.5).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    g, beta = gdn.gdn_gates_ref(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b), jnp.asarray(a_log), jnp.asarray(dt_bias))
    assert g.dtype == beta.dtype == jnp.float32
    want_g, want_beta = np_gates(np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)), b, a_log, dt_bias)
    assert_close(g, want_g, 8 * F32_UNIT_ROUNDOFF, "g")
    assert_close(beta, want_beta, 8 * F32_UNIT_ROUNDOFF, "beta")
