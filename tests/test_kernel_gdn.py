"""pallas_kernels/gdn.py: the per-token reference against a float64 loop written here, the Pallas
recurrence kernel (interpret mode on the CPU) against the reference, its lowering for the H200
(checked from the CPU in CI), and the kernel on the GPU (`gpu` marker).

Tolerances. Each token does Dk-term dot products in f32; with |k| = 1 and |q| = Dk^-0.5 the summed
terms are bounded by the scale of the state columns, so one token adds a relative rounding error of
at most Dk * u (u = 2^-24, the f32 unit roundoff), and the update S <- exp(g)(I - beta k k^T) S + ...
is a contraction (0 < beta < 1, g <= 0), so earlier errors are not amplified: T tokens stay within
T * Dk * u of the exact result. Two f32 implementations compared with each other: twice that.
Any indexing or formula slip gives an O(1) relative error, far above these bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn
from tolerance import assert_close
from h200_lowering import H200, lower_for_h200, triton_calls

F32_UNIT_ROUNDOFF = 2.0 ** -24


def f32_recurrence_tol(t: int, dk: int, implementations: int = 1) -> float:
    """Worst-case relative rounding of `implementations` f32 recurrences over t tokens of Dk terms."""
    return implementations * max(t, 1) * dk * F32_UNIT_ROUNDOFF


def kernel_vs_ref_tol(t: int, dk: int) -> float:
    return f32_recurrence_tol(t, dk, implementations=2)


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


def mask_tokens(q, k, v, g, beta, keep, q_fill=np.nan):
    """What callers do for padding: g = beta = k = v = 0 on dropped tokens; q is left poisoned."""
    q, k, v, g, beta = (np.array(a) for a in (q, k, v, g, beta))
    drop = ~keep  # [B, T]
    q[drop], k[drop], v[drop], g[drop], beta[drop] = q_fill, 0.0, 0.0, 0.0, 0.0
    return q, k, v, g, beta


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def run_kernel(*args, fn=None, **kw):
    kw.setdefault("interpret", True)
    o, s = (fn or gdn.gdn_recurrence)(*map(jnp.asarray, args), **kw)
    return np.asarray(o), np.asarray(s)


def run_ref(*args):
    o, s = gdn.gdn_recurrence_ref(*map(jnp.asarray, args))
    return np.asarray(o), np.asarray(s)


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


# ------------------------------------------------------------------------------------------------
# the kernel (interpret mode) against the reference
# ------------------------------------------------------------------------------------------------

NARROW = gdn.RecurrenceConfig(block_v=8)  # several Dv tiles per head at test sizes


@pytest.mark.parametrize("dk,dv,config", [(16, 32, NARROW), (32, 16, None)], ids=["dk16-dv32-bv8", "dk32-dv16-default"])
@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("b", [1, 3])
def test_kernel_matches_ref(b, t, hk, hv, dk, dv, config):
    args = make_inputs(b, t, hk, hv, dk, dv, seed=b * 100 + t)
    o, s = run_kernel(*args, config=config)
    want_o, want_s = run_ref(*args)
    assert o.dtype == np.float32 and s.dtype == np.float32
    tol = kernel_vs_ref_tol(t, dk)
    assert_close(o, want_o, tol, "kernel o")
    assert_close(s, want_s, tol, "kernel final state")


@pytest.mark.parametrize("dv,block_v", [(24, 32), (48, 32)])
def test_kernel_dv_not_a_multiple_of_block_v(dv, block_v):
    """Dv with no power-of-two multiple of block_v: the tile shrinks to the largest power of two
    dividing Dv (24 -> 8, 48 -> 16) instead of reading past the head."""
    args = make_inputs(2, 3, 2, 4, 16, dv, seed=dv)
    o, s = run_kernel(*args, config=gdn.RecurrenceConfig(block_v=block_v))
    want_o, want_s = run_ref(*args)
    assert_close(o, want_o, kernel_vs_ref_tol(3, 16), "kernel o")
    assert_close(s, want_s, kernel_vs_ref_tol(3, 16), "kernel final state")


def test_kernel_against_float64_directly():
    args = make_inputs(2, 5, 2, 4, 32, 16, seed=7)
    o, s = run_kernel(*args)
    want_o, want_s, _ = np_recurrence(*args)
    assert_close(o, want_o, f32_recurrence_tol(5, 32), "kernel o vs float64")
    assert_close(s, want_s, f32_recurrence_tol(5, 32), "kernel state vs float64")


def test_kernel_bf16_qkv():
    q, k, v, g, beta, s0 = make_inputs(2, 5, 2, 4, 16, 16, seed=3)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    o, s = run_kernel(q, k, v, g, beta, s0)
    want_o, want_s = run_ref(q, k, v, g, beta, s0)  # the ref casts the same bf16 values to f32
    assert_close(o, want_o, kernel_vs_ref_tol(5, 16), "kernel o (bf16 inputs)")
    assert_close(s, want_s, kernel_vs_ref_tol(5, 16), "kernel state (bf16 inputs)")


def test_masked_tokens_leave_state_bit_identical_and_nan_q_cannot_reach_it():
    """Sequence 0 keeps all 5 tokens, 1 keeps 2 (right padding, what callers do), 2 keeps none,
    3 drops token 2 in the middle. Dropped tokens carry g = beta = k = v = 0 and q = NaN.

    A dropped token is an exact identity (exp(0) S + 0 (0 u)^T = S), so: no tokens kept -> the
    state's bits are untouched; right padding -> the bits of a run over the kept prefix (token i
    runs at position i in both). A token dropped in the middle shifts the later tokens' positions,
    and XLA (interpret mode) may compile position 0 (fused with the state load) differently from
    the others, so that case is compared within the f32 bound. Kept outputs stay finite; NaN q only
    reaches its own token's output."""
    b, t, hk, hv, dk, dv = 4, 5, 2, 4, 16, 16
    q, k, v, g, beta, s0 = make_inputs(b, t, hk, hv, dk, dv, seed=11)
    keep = np.ones((b, t), bool)
    keep[1, 2:] = False
    keep[2, :] = False
    keep[3, 2] = False
    mq, mk, mv, mg, mbeta = mask_tokens(q, k, v, g, beta, keep)
    o, s = run_kernel(mq, mk, mv, mg, mbeta, s0)
    o_ref, s_ref = run_ref(mq, mk, mv, mg, mbeta, s0)
    tol = kernel_vs_ref_tol(t, dk)
    for i in range(b):
        kept = np.flatnonzero(keep[i])
        sel = lambda a: a[i:i + 1, kept]
        o_i, s_i = run_kernel(sel(q), sel(k), sel(v), sel(g), sel(beta), s0[i:i + 1])
        assert np.all(np.isfinite(o[i, kept])) and np.all(np.isfinite(s[i]))
        assert np.all(np.isnan(o[i, ~keep[i]])), "a NaN q only reaches its own token's output"
        assert_close(s[i], s_ref[i], tol, f"sequence {i}: state vs ref")
        if i == 3:
            assert_close(s[i], s_i[0], tol, "middle drop: state vs a run over the kept tokens")
            assert_close(o[i, kept], o_i[0], tol, "middle drop: kept outputs")
        else:
            np.testing.assert_array_equal(bits(s[i]), bits(s_i[0]), f"sequence {i}: state bits")
            np.testing.assert_array_equal(bits(o[i, kept]), bits(o_i[0]), f"sequence {i}: kept outputs")
        if kept.size:
            assert_close(o[i, kept], o_ref[i, kept], tol, f"sequence {i}: o vs ref")
    np.testing.assert_array_equal(bits(s[2]), bits(s0[2]), "all tokens dropped: state untouched")


def test_one_call_equals_token_by_token_calls():
    """Verify (T = K+1 tokens in one call) and plain decode (T = 1 per call) compute the same
    recurrence; within the f32 bound on the CPU (interpret mode compiles each token position with
    XLA, which may round differently at position 0); bit for bit is checked on the GPU."""
    args = make_inputs(2, 5, 2, 4, 16, 32, seed=5)
    o_all, s_all = run_kernel(*args)
    s = args[5]
    for t in range(5):
        o_t, s = run_kernel(*(a[:, t:t + 1] for a in args[:5]), s)
        assert_close(o_all[:, t], o_t[:, 0], kernel_vs_ref_tol(t + 1, 16), f"o at token {t}")
    assert_close(s_all, s, kernel_vs_ref_tol(5, 16), "final state")


def test_nan_state_of_one_head_stays_in_that_head():
    """Programs must not read each other's tiles: a NaN state in (sequence 1, value head 2) leaves
    every other head's outputs and state equal to a clean run."""
    args = list(make_inputs(2, 3, 2, 4, 16, 16, seed=9))
    clean_o, clean_s = run_kernel(*args, config=NARROW)
    args[5] = args[5].copy()
    args[5][1, 2] = np.nan
    o, s = run_kernel(*args, config=NARROW)
    poisoned = np.zeros((2, 4), bool)
    poisoned[1, 2] = True
    np.testing.assert_array_equal(bits(o.transpose(0, 2, 1, 3)[~poisoned]),
                                  bits(clean_o.transpose(0, 2, 1, 3)[~poisoned]))
    np.testing.assert_array_equal(bits(s[~poisoned]), bits(clean_s[~poisoned]))
    assert np.all(np.isnan(s[1, 2])) and np.all(np.isnan(o[1, :, 2]))


def test_long_input_uses_the_token_loop():
    t = gdn.MAX_UNROLLED_TOKENS + 4
    args = make_inputs(1, t, 2, 4, 16, 16, seed=13)
    o, s = run_kernel(*args)
    want_o, want_s = run_ref(*args)
    assert_close(o, want_o, kernel_vs_ref_tol(t, 16), "kernel o (looped)")
    assert_close(s, want_s, kernel_vs_ref_tol(t, 16), "kernel state (looped)")


def test_zero_tokens_returns_the_state():
    args = make_inputs(2, 0, 2, 4, 16, 16)
    o, s = run_kernel(*args)
    assert o.shape == (2, 0, 4, 16)
    np.testing.assert_array_equal(bits(s), bits(args[5]))


def test_in_place_state_under_donation():
    """The state output aliases the state input: with the state donated under jit, XLA needs no
    copy (the donated buffer is consumed)."""
    args = [jnp.asarray(a) for a in make_inputs(1, 2, 2, 4, 16, 16, seed=4)]
    want_o, want_s = run_ref(*args)
    f = jax.jit(lambda *a: gdn.gdn_recurrence(*a, interpret=True), donate_argnums=5)
    assert "tf.aliasing_output" in f.lower(*args).as_text()
    o, s = f(*args)
    assert_close(s, want_s, kernel_vs_ref_tol(2, 16), "donated state")
    assert_close(o, want_o, kernel_vs_ref_tol(2, 16), "o with donated state")


def test_wrapper_rejects_bad_inputs():
    q, k, v, g, beta, s0 = make_inputs(1, 2, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="Hk | Hv"):
        gdn.gdn_recurrence(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], s0[:, :3])
    with pytest.raises(ValueError, match="state"):
        gdn.gdn_recurrence(q, k, v, g, beta, s0[..., :8])
    with pytest.raises(ValueError, match="power of two"):
        a = make_inputs(1, 2, 2, 4, 24, 16)
        gdn.gdn_recurrence(*a, interpret=True)
    with pytest.raises(ValueError, match="floating point"):
        gdn.gdn_recurrence(q, k, v, g.astype(np.int32), beta, s0, interpret=True)
    with pytest.raises(ValueError, match="bad config"):
        gdn.gdn_recurrence(q, k, v, g, beta, s0, interpret=True, config=gdn.RecurrenceConfig(block_v=24))


# ------------------------------------------------------------------------------------------------
# the fused-gate variant
# ------------------------------------------------------------------------------------------------


def make_gated_inputs(b, t, hk, hv, dk, dv, seed=0):
    q, k, v, _, _, s0 = make_inputs(b, t, hk, hv, dk, dv, seed=seed)
    rng = np.random.default_rng(seed + 1)
    a = rng.standard_normal((b, t, hv)) * 3.0
    a[0, 0, 0] = 30.0  # past the softplus threshold (identity above 20)
    beta_logit = rng.standard_normal((b, t, hv))
    a_log, dt_bias = rng.standard_normal(hv) * 0.5, rng.standard_normal(hv)
    f = lambda x: np.asarray(x, np.float32)
    return q, k, v, f(a), f(beta_logit), f(a_log), f(dt_bias), s0


def np_gates(a, b, a_log, dt_bias):
    """MODEL_SPEC §3.6 step 4 in float64: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
    (softplus = identity above 20, as PyTorch's default threshold)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    x = a + np.asarray(dt_bias, np.float64)
    softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    return -np.exp(np.asarray(a_log, np.float64)) * softplus, 1 / (1 + np.exp(-b))


def test_gated_ref_matches_float64():
    q, k, v, a, b, a_log, dt_bias, s0 = make_gated_inputs(2, 5, 2, 4, 16, 8, seed=3)
    n_valid = np.array([5, 3], np.int32)
    o, s = gdn.gdn_recurrence_gated_ref(*map(jnp.asarray, (q, k, v, a, b, a_log, dt_bias, s0, n_valid)))
    g, beta = np_gates(a, b, a_log, dt_bias)
    for i in range(2):
        n = n_valid[i]
        want_o, want_s, _ = np_recurrence(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], g[i:i + 1, :n],
                                          beta[i:i + 1, :n], s0[i:i + 1])
        assert_close(np.asarray(o)[i, :n], want_o[0], f32_recurrence_tol(5, 16), "gated ref o")
        assert_close(np.asarray(s)[i], want_s[0], f32_recurrence_tol(5, 16), "gated ref state")


@pytest.mark.parametrize("b,t", [(1, 1), (3, 5)])
def test_gated_kernel_matches_ref_and_ignores_poisoned_padding(b, t):
    """Padding tokens (t >= n_valid) get NaN in q, k, v, a and b: the state must be the bits of the
    kept-prefix run (the kernel selects the old state), kept outputs as the ref."""
    q, k, v, a, beta_logit, a_log, dt_bias, s0 = make_gated_inputs(b, t, 2, 4, 16, 32, seed=b + t)
    n_valid = np.array([t, t // 2, 0][:b], np.int32)
    drop = ~(np.arange(t)[None] < n_valid[:, None])
    poisoned = [x.copy() for x in (q, k, v, a, beta_logit)]
    for x in poisoned:
        x[drop] = np.nan
    args = (*poisoned, a_log, dt_bias, s0, n_valid)
    o, s = run_kernel(*args, fn=gdn.gdn_recurrence_gated, config=NARROW)
    want_o, want_s = map(np.asarray, gdn.gdn_recurrence_gated_ref(*map(jnp.asarray, args)))
    tol = kernel_vs_ref_tol(t, 16)
    assert_close(s, want_s, tol, "gated kernel state")
    assert_close(o[~drop], want_o[~drop], tol, "gated kernel kept outputs")
    for i in range(b):
        n = n_valid[i]
        sel = lambda x: x[i:i + 1, :n]
        _, s_i = run_kernel(sel(q), sel(k), sel(v), sel(a), sel(beta_logit), a_log, dt_bias, s0[i:i + 1],
                            np.array([n], np.int32), fn=gdn.gdn_recurrence_gated, config=NARROW)
        np.testing.assert_array_equal(bits(s[i]), bits(s_i[0]), f"sequence {i}: state bits")


def test_gated_wrapper_rejects_bad_inputs():
    q, k, v, a, b, a_log, dt_bias, s0 = make_gated_inputs(2, 2, 2, 4, 16, 16)
    n = np.array([2, 1], np.int32)
    with pytest.raises(ValueError, match="A_log"):
        gdn.gdn_recurrence_gated(q, k, v, a, b, a_log[:2], dt_bias, s0, n)
    with pytest.raises(ValueError, match="n_valid"):
        gdn.gdn_recurrence_gated(q, k, v, a, b, a_log, dt_bias, s0, n.astype(np.float32))
    with pytest.raises(ValueError, match="must be \\[B, T, Hv\\]"):
        gdn.gdn_recurrence_gated(q, k, v, a[:, :1], b, a_log, dt_bias, s0, n)


# ------------------------------------------------------------------------------------------------
# lowering for the H200, from the CPU (CI)
# ------------------------------------------------------------------------------------------------

HK, HV, DK, DV = 16, 48, 128, 128  # Qwen3.5-27B GDN shapes


def real_shapes(b, t, dtype=jnp.float32):
    s = jax.ShapeDtypeStruct
    return (s((b, t, HK, DK), dtype), s((b, t, HK, DK), dtype), s((b, t, HV, DV), dtype),
            s((b, t, HV), jnp.float32), s((b, t, HV), jnp.float32), s((b, HV, DK, DV), jnp.float32))






@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("b", [1, 8])
def test_kernel_lowers_for_h200(b, t):
    lowered = lower_for_h200(gdn.gdn_recurrence, real_shapes(b, t), donate_argnums=5)
    text = lowered.as_text()
    assert "tf.aliasing_output = 1" in text, "state input must alias the state output"
    [(cfg, triton_ir)] = triton_calls(lowered)
    bv = gdn.RECURRENCE_CONFIG.block_v
    grid = tuple(int(str(cfg[f"grid_{a}"]).split(":")[0]) for a in "xyz")
    assert grid == (b, HV, DV // bv), grid
    assert int(str(cfg["num_warps"]).split(":")[0]) == gdn.RECURRENCE_CONFIG.num_warps
    assert "tt.func public @gdn_recurrence" in triton_ir


def test_looped_kernel_lowers_for_h200():
    lowered = lower_for_h200(gdn.gdn_recurrence, real_shapes(1, 64))
    [(_, triton_ir)] = triton_calls(lowered)
    assert "scf.for" in triton_ir


@pytest.mark.parametrize("b,t", [(1, 1), (8, 5)])
def test_gated_kernel_lowers_for_h200(b, t):
    q, k, v, _, _, s = real_shapes(b, t)
    sds = jax.ShapeDtypeStruct
    args = (q, k, v, sds((b, t, HV), jnp.bfloat16), sds((b, t, HV), jnp.bfloat16), sds((HV,), jnp.float32),
            sds((HV,), jnp.float32), s, sds((b,), jnp.int32))
    lowered = lower_for_h200(gdn.gdn_recurrence_gated, args, donate_argnums=7)
    assert "tf.aliasing_output = 1" in lowered.as_text()
    [(_, triton_ir)] = triton_calls(lowered)
    assert "tt.func public @gdn_recurrence_gated" in triton_ir


# ------------------------------------------------------------------------------------------------
# on the GPU (deselected on the CPU): python -m pytest -q -m gpu tests/test_kernel_gdn.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_kernel_matches_ref_real_shapes(b, t):
    args = make_inputs(b, t, HK, HV, DK, DV, seed=b + t)
    o, s = run_kernel(*args, interpret=False)
    want_o, want_s = run_ref(*args)
    assert_close(o, want_o, kernel_vs_ref_tol(t, DK), "gpu kernel o")
    assert_close(s, want_s, kernel_vs_ref_tol(t, DK), "gpu kernel final state")
    o64, s64, _ = np_recurrence(*(a[:1] for a in args))
    assert_close(o[:1], o64, f32_recurrence_tol(t, DK), "gpu kernel o vs float64")
    assert_close(s[:1], s64, f32_recurrence_tol(t, DK), "gpu kernel state vs float64")


@pytest.mark.gpu
def test_gpu_masked_tokens_leave_state_bit_identical():
    b, t = 3, 5
    q, k, v, g, beta, s0 = make_inputs(b, t, HK, HV, DK, DV, seed=21)
    keep = np.ones((b, t), bool)
    keep[1, 2:] = False
    keep[2, :] = False
    mq, mk, mv, mg, mbeta = mask_tokens(q, k, v, g, beta, keep)
    o, s = run_kernel(mq, mk, mv, mg, mbeta, s0, interpret=False)
    assert np.all(np.isfinite(s)) and np.all(np.isfinite(o[keep]))
    np.testing.assert_array_equal(bits(s[2]), bits(s0[2]), "all tokens dropped: state untouched")
    _, s1 = run_kernel(q[1:2, :2], k[1:2, :2], v[1:2, :2], g[1:2, :2], beta[1:2, :2], s0[1:2], interpret=False)
    np.testing.assert_array_equal(bits(s[1]), bits(s1[0]), "right padding: state bits")


@pytest.mark.gpu
def test_gpu_verify_equals_decode_bitwise():
    """One call over T tokens (verify) vs T one-token calls (plain decode): in the Triton kernel each
    token runs the same register-level instruction sequence, so the states should agree bit for
    bit. A failure here is not a kernel error (the values agree within the f32 bound, checked
    first) but means speculative commits round differently from plain decoding."""
    args = make_inputs(8, 5, HK, HV, DK, DV, seed=22)
    _, s_all = run_kernel(*args, interpret=False)
    s_step = args[5]
    for i in range(5):
        _, s_step = run_kernel(*(a[:, i:i + 1] for a in args[:5]), s_step, interpret=False)
    assert_close(s_all, s_step, kernel_vs_ref_tol(5, DK), "T-token call vs T one-token calls")
    np.testing.assert_array_equal(bits(s_all), bits(s_step), "T-token call vs T one-token calls, bits")


@pytest.mark.gpu
def test_gpu_donated_state_in_place():
    args = [jnp.asarray(a) for a in make_inputs(8, 5, HK, HV, DK, DV, seed=2)]
    want_o, want_s = run_ref(*args)
    f = jax.jit(gdn.gdn_recurrence, donate_argnums=5)
    o, s = f(*args)
    assert args[5].is_deleted(), "the donated state buffer was not consumed"
    assert_close(s, want_s, kernel_vs_ref_tol(5, DK), "donated state")
    assert_close(o, want_o, kernel_vs_ref_tol(5, DK), "o")


@pytest.mark.gpu
@pytest.mark.parametrize("b,t", [(1, 1), (8, 5)])
def test_gpu_gated_kernel_matches_ref_real_shapes(b, t):
    q, k, v, a, beta_logit, a_log, dt_bias, s0 = make_gated_inputs(b, t, HK, HV, DK, DV, seed=b * t)
    n_valid = np.maximum(t - np.arange(b), 0).astype(np.int32)
    args = (q, k, v, a, beta_logit, a_log, dt_bias, s0, n_valid)
    o, s = run_kernel(*args, fn=gdn.gdn_recurrence_gated, interpret=False)
    want_o, want_s = map(np.asarray, gdn.gdn_recurrence_gated_ref(*map(jnp.asarray, args)))
    keep = np.arange(t)[None] < n_valid[:, None]
    assert_close(s, want_s, kernel_vs_ref_tol(t, DK), "gpu gated kernel state")
    assert_close(o[keep], want_o[keep], kernel_vs_ref_tol(t, DK), "gpu gated kernel kept outputs")
