"""pallas_kernels/gdn_conv.py: the conv + recurrence reference against a float64 loop written here, the
Pallas kernel (interpret mode on the CPU) against the float64 loop and the reference (the new conv
state bit for bit), its slotted form, its lowering for the H200 (from the CPU, in CI), and the kernel
on the GPU (`gpu` marker).

Shapes are awkward on purpose: Hv = 3 Hk (r = 3, as the 27B's 48 / 16), several Dv tiles per head,
n_valid < T (including n_valid < W-1, where the new conv state reaches back into the old one, and
n_valid = 0), and NaN in every input of the padding tokens.

Tolerances. Per token, each conv output sums W products (W roundings) and each L2 norm sums Dk
squares (Dk roundings) before the recurrence's Dk-term dot products (tests/test_kernel_gdn.py: the
update is a contraction, so per-token errors add up over T tokens without growing). One f32
implementation against float64 stays within T (2 Dk + W) u (u = 2^-24); two f32 implementations
against each other within twice that. An indexing or formula slip gives an O(1) relative error.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import attr_int, lower_for_h200, triton_calls
from pallas_kernels import gdn_conv
from tolerance import assert_close

F32_UNIT_ROUNDOFF = 2.0 ** -24
WIDTH = 4
NARROW = gdn_conv.RecurrenceConfig(block_v=8)  # Dv = 32: four tiles per value head


def conv_tol(t: int, dk: int, implementations: int = 1) -> float:
    return implementations * max(t, 1) * (2 * dk + WIDTH) * F32_UNIT_ROUNDOFF


def make_inputs(b, t, hk, hv, dk, dv, n_valid, seed=0, dtype=np.float32):
    """Raw in_proj-like inputs (mixed, conv_state, conv_w, a, b, A_log, dt_bias, state, n_valid) with
    NaN in mixed, a and b of the padding tokens t >= n_valid. A dense non-zero state and conv state."""
    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    mixed = rng.standard_normal((b, t, c))
    conv_state = rng.standard_normal((b, WIDTH - 1, c))
    conv_w = rng.standard_normal((c, WIDTH)) * 0.5
    a = rng.standard_normal((b, t, hv)) * 3.0
    if t:
        a[0, 0, 0] = 30.0  # past the softplus threshold (identity above 20)
    beta_logit = rng.standard_normal((b, t, hv))
    a_log, dt_bias = rng.standard_normal(hv) * 0.5, rng.standard_normal(hv)
    s0 = rng.standard_normal((b, hv, dk, dv)) * 0.5
    n_valid = np.asarray(n_valid, np.int32)
    pad = ~(np.arange(t)[None] < n_valid[:, None])  # [B, T]
    for x in (mixed, a, beta_logit):
        x[pad] = np.nan
    f = lambda x, dt=np.float32: np.asarray(x, dt)
    return (f(mixed, dtype), f(conv_state, dtype), f(conv_w, dtype), f(a, dtype), f(beta_logit, dtype), f(a_log),
            f(dt_bias), f(s0), n_valid)


def np_conv_recurrence(mixed, conv_state, conv_w, a, b, a_log, dt_bias, s0, n_valid, hk):
    """MODEL_SPEC §3.6 steps 2-7 in float64, one sequence and one token at a time, only over the
    n_valid tokens. Returns (o [B, T, Hv, Dv] with NaN at padding, final state, conv state)."""
    f64 = lambda x: np.asarray(np.asarray(x, np.float32), np.float64)
    mixed, conv_state, conv_w, a, b, a_log, dt_bias, s = map(f64, (mixed, conv_state, conv_w, a, b, a_log, dt_bias,
                                                                   s0))
    bsz, t_n, _ = mixed.shape
    hv, dk, dv = s.shape[1:]
    r = hv // hk
    o = np.full((bsz, t_n, hv, dv), np.nan)
    conv_out = np.zeros(conv_state.shape)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    for bi in range(bsz):
        inputs = list(conv_state[bi])  # every input so far, oldest first
        for t in range(n_valid[bi]):
            inputs.append(mixed[bi, t])
            acc = sum(conv_w[:, i] * inputs[len(inputs) - WIDTH + i] for i in range(WIDTH))
            y = acc / (1.0 + np.exp(-acc))  # silu
            q = l2(y[:hk * dk].reshape(hk, dk)) * dk ** -0.5
            k = l2(y[hk * dk:2 * hk * dk].reshape(hk, dk))
            v = y[2 * hk * dk:].reshape(hv, dv)
            x = a[bi, t] + dt_bias
            g = -np.exp(a_log) * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
            beta = 1.0 / (1.0 + np.exp(-b[bi, t]))
            for h in range(hv):
                kt, qt = k[h // r], q[h // r]
                s[bi, h] = np.exp(g[h]) * s[bi, h]
                u = v[h] - s[bi, h].T @ kt
                s[bi, h] = s[bi, h] + np.outer(kt, beta[h] * u)
                o[bi, t, h] = s[bi, h].T @ qt
        conv_out[bi] = np.stack(inputs[len(inputs) - (WIDTH - 1):])
    return o, s, conv_out


def bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# jitted once per module: tests of one shape share the compile (interpret mode compiles the kernel
# body with XLA, ~1-2 s a shape)
_REF = jax.jit(gdn_conv.gdn_conv_recurrence_ref, static_argnames=("key_heads", "scale"))
_KERNEL = jax.jit(gdn_conv.gdn_conv_recurrence, static_argnames=("key_heads", "scale", "interpret", "config"))


def run_ref(*args, hk):
    dk = args[7].shape[2]
    return tuple(np.asarray(x) for x in _REF(*map(jnp.asarray, args), key_heads=hk, scale=dk ** -0.5))


def run_kernel(*args, hk, interpret=True, config=NARROW):
    dk = args[7].shape[2]
    return tuple(np.asarray(x) for x in _KERNEL(*map(jnp.asarray, args), key_heads=hk, scale=dk ** -0.5,
                                                interpret=interpret, config=config))


def valid_mask(t, n_valid):
    return np.arange(t)[None] < np.asarray(n_valid)[:, None]


# 27B-like head ratio at small dims; n_valid: all, < W-1 (the conv state reaches into the old one), none
CASES = [(1, 1, [1]), (3, 4, [4, 1, 0]), (3, 5, [5, 3, 1])]
HK, HV, DK, DV = 2, 6, 16, 32


# ------------------------------------------------------------------------------------------------
# the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,t,n_valid", CASES)
def test_ref_matches_float64(b, t, n_valid):
    args = make_inputs(b, t, HK, HV, DK, DV, n_valid, seed=b * 10 + t)
    o, s, conv = run_ref(*args, hk=HK)
    want_o, want_s, want_conv = np_conv_recurrence(*args, hk=HK)
    keep = valid_mask(t, n_valid)
    tol = conv_tol(t, DK)
    assert_close(o[keep], want_o[keep], tol, "ref o (valid tokens)")
    assert_close(s, want_s, tol, "ref state")
    np.testing.assert_array_equal(conv, want_conv.astype(np.float32), "ref conv state (a copy of inputs)")
    for i in np.flatnonzero(np.asarray(n_valid) == 0):  # no valid token: both states untouched, bit for bit
        np.testing.assert_array_equal(bits(s[i]), bits(args[7][i]))
        np.testing.assert_array_equal(bits(conv[i]), bits(args[1][i]))


# ------------------------------------------------------------------------------------------------
# the kernel (interpret mode) against the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,t,n_valid", CASES[:2])  # T = 5: the bf16 test below (one compile less)
def test_kernel_matches_ref_and_ignores_poisoned_padding(b, t, n_valid):
    args = make_inputs(b, t, HK, HV, DK, DV, n_valid, seed=b * 10 + t)
    o, s, conv = run_kernel(*args, hk=HK)
    want_o, want_s, want_conv = run_ref(*args, hk=HK)
    keep = valid_mask(t, n_valid)
    assert o.dtype == s.dtype == np.float32 and conv.dtype == args[1].dtype
    tol = conv_tol(t, DK, implementations=2)
    assert_close(o[keep], want_o[keep], tol, "kernel o (valid tokens)")
    assert_close(s, want_s, tol, "kernel state")
    np.testing.assert_array_equal(bits(conv), bits(want_conv), "kernel conv state bits")
    for i in np.flatnonzero(np.asarray(n_valid) == 0):
        np.testing.assert_array_equal(bits(s[i]), bits(args[7][i]), "no valid token: state bits")


def test_kernel_bf16_inputs_and_an_f32_conv_state():
    """bf16 raw projections (as the model runs them) and an f32 conv state, B = 3, T = 5: the conv
    state joins the window rounded to bf16 (as the model's causal conv does), so the new conv state,
    which reaches back into the old one at n_valid = 1 and is the old one at n_valid = 0, matches
    the ref bit for bit."""
    b, t, n_valid = 3, 5, [5, 1, 0]
    mixed, conv_state, conv_w, a, beta_logit, a_log, dt_bias, s0, n = make_inputs(b, t, HK, HV, DK, DV, n_valid,
                                                                                  seed=5)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf(mixed), conv_state, bf(conv_w), bf(a), bf(beta_logit), a_log, dt_bias, s0, n)
    o, s, conv = run_kernel(*args, hk=HK)
    want_o, want_s, want_conv = run_ref(*args, hk=HK)
    assert conv.dtype == np.float32
    keep = valid_mask(t, n_valid)
    assert_close(o[keep], want_o[keep], conv_tol(t, DK, 2), "kernel o (bf16)")
    assert_close(s, want_s, conv_tol(t, DK, 2), "kernel state (bf16)")
    np.testing.assert_array_equal(bits(conv), bits(want_conv), "kernel conv state bits (bf16)")
    np.testing.assert_array_equal(bits(s[2]), bits(s0[2]), "no valid token: state bits")


def test_long_input_uses_the_token_loop_one_key_head_per_value_head_default_tile():
    """T > MAX_UNROLLED_TOKENS (the fori_loop path), r = 1 (Hk = Hv: every program writes its own q/k
    conv state) and the default tile (one Dv tile per head)."""
    t, n_valid = gdn_conv.MAX_UNROLLED_TOKENS + 2, [gdn_conv.MAX_UNROLLED_TOKENS + 2, 2]
    args = make_inputs(2, t, 2, 2, 16, 16, n_valid, seed=9)
    o, s, conv = run_kernel(*args, hk=2, config=None)
    want_o, want_s, want_conv = run_ref(*args, hk=2)
    keep = valid_mask(t, n_valid)
    assert_close(o[keep], want_o[keep], conv_tol(t, 16, 2), "kernel o (looped)")
    assert_close(s, want_s, conv_tol(t, 16, 2), "kernel state (looped)")
    np.testing.assert_array_equal(bits(conv), bits(want_conv), "kernel conv state bits (looped)")


def test_zero_tokens_returns_both_states():
    args = make_inputs(2, 0, HK, HV, DK, DV, [0, 0])
    o, s, conv = run_kernel(*args, hk=HK)
    assert o.shape == (2, 0, HV, DV)
    np.testing.assert_array_equal(bits(s), bits(args[7]))
    np.testing.assert_array_equal(bits(conv), bits(args[1]))


def test_wrapper_rejects_bad_inputs():
    args = list(make_inputs(2, 2, HK, HV, DK, DV, [2, 1]))
    call = lambda *a, hk=HK: gdn_conv.gdn_conv_recurrence(*a, key_heads=hk, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="C = 2 Hk Dk"):
        call(*args, hk=3)
    with pytest.raises(ValueError, match="conv_state"):
        call(args[0], args[1][:, :2], *args[2:])
    with pytest.raises(ValueError, match="conv_w"):
        call(*args[:2], args[2][:-1], *args[3:])
    with pytest.raises(ValueError, match="n_valid"):
        call(*args[:8], args[8].astype(np.float32))
    with pytest.raises(ValueError, match="power of two"):
        odd = make_inputs(1, 1, 1, 1, 12, 16, [1])
        call(*odd, hk=1)


def test_joined_gate_projections_read_in_place_give_the_same_bits():
    """ba = [b | a] (one projection through both gate weights): the kernel reads b at head h and a
    at Hv + h of it, so its outputs are the a, b form's bit for bit, and so are the reference's; a
    swapped join ([a | b]) must not pass."""
    b, t, n_valid = 3, 4, [4, 2, 0]
    args = make_inputs(b, t, HK, HV, DK, DV, n_valid, seed=21)
    a, beta_logit = args[3], args[4]
    ba = np.concatenate([beta_logit, a], axis=-1)  # [B, T, 2 Hv]
    kw = dict(key_heads=HK, scale=DK ** -0.5)
    split = [np.asarray(x) for x in gdn_conv.gdn_conv_recurrence(*map(jnp.asarray, args), interpret=True,
                                                                 config=NARROW, **kw)]
    fused_args = [jnp.asarray(x) for x in args]
    fused_args[3] = fused_args[4] = None
    joined = [np.asarray(x) for x in gdn_conv.gdn_conv_recurrence(*fused_args, interpret=True, config=NARROW,
                                                                  ba=jnp.asarray(ba), **kw)]
    for got, want, name in zip(joined, split, ("o", "state", "conv state")):
        np.testing.assert_array_equal(bits(got), bits(want), f"kernel {name} with ba")
    ref_split = gdn_conv.gdn_conv_recurrence_ref(*map(jnp.asarray, args), **kw)
    ref_joined = gdn_conv.gdn_conv_recurrence_ref(*fused_args, ba=jnp.asarray(ba), **kw)
    for got, want in zip(ref_joined, ref_split):
        np.testing.assert_array_equal(bits(got), bits(want), "reference with ba")
    swapped = gdn_conv.gdn_conv_recurrence(*fused_args, interpret=True, config=NARROW,
                                           ba=jnp.asarray(np.concatenate([a, beta_logit], axis=-1)), **kw)
    assert not np.array_equal(np.asarray(swapped[1]), split[1]), "the halves must be read as [b | a]"


def test_gate_projections_in_exactly_one_form():
    args = [jnp.asarray(x) for x in make_inputs(1, 2, HK, HV, DK, DV, [2])]
    ba = jnp.concatenate([args[4], args[3]], axis=-1)
    call = lambda *a, **kw: gdn_conv.gdn_conv_recurrence(*a, key_heads=HK, scale=1.0, interpret=True, **kw)
    with pytest.raises(ValueError, match="either as a and b or as ba"):
        call(*args, ba=ba)
    with pytest.raises(ValueError, match="either as a and b or as ba"):
        call(*args[:3], None, None, *args[5:])
    with pytest.raises(ValueError, match=r"ba \(1, 2, 6\) must be \[B, T, 2 Hv\]"):
        call(*args[:3], None, None, *args[5:], ba=ba[..., :HV])


# ------------------------------------------------------------------------------------------------
# the state chain: every token's conv first, then one reduction step per token from S_{t-1}
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,t,n_valid", [(3, 4, [4, 1, 0]), (2, 8, [8, 6])])
def test_kernel_matches_float64_and_ignores_poisoned_padding(b, t, n_valid):
    """Against the float64 loop (not the reference: an error they shared would hide), within one f32
    implementation's bound; the conv state bit for bit as the ref's; n_valid = 0 returns the old
    state's bits."""
    args = make_inputs(b, t, HK, HV, DK, DV, n_valid, seed=b * 10 + t)
    o, s, conv = run_kernel(*args, hk=HK)
    want_o, want_s, _ = np_conv_recurrence(*args, hk=HK)
    keep = valid_mask(t, n_valid)
    assert_close(o[keep], want_o[keep], conv_tol(t, DK), "kernel o (valid tokens)")
    assert_close(s, want_s, conv_tol(t, DK), "kernel state")
    np.testing.assert_array_equal(bits(conv), bits(run_ref(*args, hk=HK)[2]), "kernel conv state bits")
    for i in np.flatnonzero(np.asarray(n_valid) == 0):
        np.testing.assert_array_equal(bits(s[i]), bits(args[7][i]), "no valid token: state bits")


def test_state_chain_with_strongly_coupled_tokens():
    """o_t from S_{t-1} (exp(g) S^T q + (k.q) beta u) only differs from S_t^T q when the update is
    large: no decay (a = -30: g ~ 0), beta ~ 1 and nearly parallel keys (each token's raw input the
    previous one's plus a little noise); against the float64 loop."""
    b, t = 1, 8
    mixed, conv_state, conv_w, a, beta_logit, a_log, dt_bias, s0, n = make_inputs(b, t, HK, HV, DK, DV, [t], seed=3)
    rng = np.random.default_rng(4)
    mixed = (mixed[:, :1] + 0.05 * np.cumsum(rng.standard_normal(mixed.shape), axis=1)).astype(np.float32)
    a, beta_logit = np.full_like(a, -30.0), np.full_like(beta_logit, 5.0)
    args = (mixed, conv_state, conv_w, a, beta_logit, a_log, dt_bias, s0, n)
    o, s, _ = run_kernel(*args, hk=HK)
    want_o, want_s, _ = np_conv_recurrence(*args, hk=HK)
    assert_close(o, want_o, conv_tol(t, DK), "kernel o (coupled tokens)")
    assert_close(s, want_s, conv_tol(t, DK), "kernel state (coupled tokens)")


# ------------------------------------------------------------------------------------------------
# slotted state: [Ns, B, ...] read from each row's slot, token t's state and
# conv state written to slot (read + 1 + t) mod Ns
# ------------------------------------------------------------------------------------------------


def slotted_inputs(b, t, n_valid, reads, n_slots, seed):
    """make_inputs with the state and conv state in slots: row b's real ones in slot reads[b], noise in
    the others (which must come back as they were unless written)."""
    args = [jnp.asarray(x) for x in make_inputs(b, t, HK, HV, DK, DV, n_valid, seed=seed)]
    rng = np.random.default_rng(seed + 1)
    rows = jnp.arange(b)
    reads = jnp.asarray(reads, jnp.int32)
    state = jnp.asarray(rng.standard_normal((n_slots,) + args[7].shape), jnp.float32).at[reads, rows].set(args[7])
    conv = jnp.asarray(rng.standard_normal((n_slots,) + args[1].shape), args[1].dtype).at[reads, rows].set(args[1])
    return args, state, conv, reads


@pytest.mark.parametrize("b,t,n_valid,reads,n_slots", [(3, 4, [4, 2, 0], [0, 4, 2], 5),
                                                       (2, 10, [10, 7], [3, 10], 11),  # past MAX_UNROLLED_TOKENS: the loop
                                                       pytest.param(2, 3, [3, 1], [3, 1], 6, marks=pytest.mark.slow)])
def test_slotted_kernel_writes_every_prefix_state(b, t, n_valid, reads, n_slots):
    """Slot (read + 1 + t) mod Ns holds the state and conv state after min(t + 1, n_valid) tokens, as the
    float64 loop computes them over that prefix; the read slot and the slots past T come back bit for
    bit; o as the one-state kernel's. The kernel (interpret mode) and its ref twin both."""
    args, state, conv, r = slotted_inputs(b, t, n_valid, reads, n_slots, seed=8 + t)
    kw = {"key_heads": HK, "scale": DK ** -0.5, "slots": r}
    config = NARROW
    got = {"kernel": gdn_conv.gdn_conv_recurrence(*args[:1], conv, *args[2:7], state, args[8], interpret=True,
                                                   config=config, **kw),
           "ref": gdn_conv.gdn_conv_recurrence_ref(*args[:1], conv, *args[2:7], state, args[8], **kw)}
    o_single, _, _ = run_kernel(*args, hk=HK, config=config)
    keep = valid_mask(t, n_valid)
    for name, (o, slotted, slotted_conv) in got.items():
        slotted, slotted_conv = np.asarray(slotted), np.asarray(slotted_conv)
        assert_close(np.asarray(o)[keep], o_single[keep], conv_tol(t, DK, 2), f"{name}: o")
        for row in range(b):
            written = {(reads[row] + 1 + i) % n_slots: i for i in range(t)}
            for slot in range(n_slots):
                if slot not in written:
                    np.testing.assert_array_equal(bits(slotted[slot, row]), bits(np.asarray(state)[slot, row]),
                                                  f"{name}: row {row} slot {slot} untouched")
                    np.testing.assert_array_equal(bits(slotted_conv[slot, row]), bits(np.asarray(conv)[slot, row]),
                                                  f"{name}: row {row} conv slot {slot} untouched")
                    continue
                prefix = np.minimum(np.asarray(n_valid), written[slot] + 1)
                _, want_s, want_conv = np_conv_recurrence(*args[:8], prefix, hk=HK)
                assert_close(slotted[slot, row], want_s[row], conv_tol(t, DK), f"{name}: row {row} slot {slot}")
                np.testing.assert_array_equal(slotted_conv[slot, row], want_conv[row].astype(np.float32),
                                              f"{name}: row {row} conv slot {slot}")


def test_slotted_errors_name_the_shapes():
    args = [jnp.asarray(x) for x in make_inputs(1, 2, 1, 2, 8, 32, [2])]
    kw = {"key_heads": 1, "scale": 8 ** -0.5, "interpret": True, "slots": jnp.zeros((1,), jnp.int32)}
    with pytest.raises(ValueError, match=r"must be slotted \[Ns, B, Hv, Dk, Dv\]"):
        gdn_conv.gdn_conv_recurrence(*args, **kw)
    slot = lambda x, n: jnp.stack([x] * n)
    with pytest.raises(ValueError, match=r"only if Ns >= T \+ 1 = 3"):
        gdn_conv.gdn_conv_recurrence(args[0], slot(args[1], 2), *args[2:7], slot(args[7], 2), args[8], **kw)
    with pytest.raises(ValueError, match="must be f32"):
        gdn_conv.gdn_conv_recurrence(args[0], slot(args[1], 3), *args[2:7], slot(args[7], 3).astype(jnp.bfloat16),
                                     args[8], **kw)
    with pytest.raises(ValueError, match="and in place"):
        gdn_conv.gdn_conv_recurrence(args[0], slot(args[1], 3), *args[2:7], slot(args[7], 3), args[8],
                                     in_place=False, **kw)


def test_next_slots_is_the_prefix_slot():
    slots = jnp.asarray([0, 3, 4], jnp.int32)
    np.testing.assert_array_equal(gdn_conv.next_slots(slots, jnp.asarray([0, 2, 4]), 5), [0, 0, 3])


# ------------------------------------------------------------------------------------------------
# lowering for the H200, from the CPU (CI)
# ------------------------------------------------------------------------------------------------

HK27, HV27, DK27, DV27 = 16, 48, 128, 128  # Qwen3.5-27B GDN shapes
C27 = 2 * HK27 * DK27 + HV27 * DV27  # 10240


def real_shapes(b, t):
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    return (s((b, t, C27), bf), s((b, WIDTH - 1, C27), bf), s((C27, WIDTH), bf), s((b, t, HV27), bf),
            s((b, t, HV27), bf), s((HV27,), jnp.float32), s((HV27,), jnp.float32),
            s((b, HV27, DK27, DV27), jnp.float32), s((b,), jnp.int32))


def lower_real(b, t, config=None):
    fn = lambda *a: gdn_conv.gdn_conv_recurrence(*a, key_heads=HK27, scale=DK27 ** -0.5, config=config)
    return lower_for_h200(fn, real_shapes(b, t), donate_argnums=7)


@pytest.mark.parametrize("b,t", [(1, 1), (8, 4), (8, 5)])
def test_kernel_lowers_for_h200(b, t):
    lowered = lower_real(b, t)
    assert "tf.aliasing_output = 1" in lowered.as_text(), "the state input must alias the state output"
    [(cfg, triton_ir)] = triton_calls(lowered)
    grid = tuple(attr_int(cfg, f"grid_{a}") for a in "xyz")
    assert grid == (b, HV27, DV27 // gdn_conv.RECURRENCE_CONFIG.block_v), grid
    assert "tt.func public @gdn_conv_recurrence" in triton_ir
    assert "scf.if" in triton_ir, "one program per key head writes the q/k conv state"
    assert "scf.for" not in triton_ir, "T <= MAX_UNROLLED_TOKENS is unrolled"


def test_fresh_state_kernel_writes_a_new_buffer_with_the_same_bits():
    """in_place=False (for a verify pass whose input state the commit
    still reads): no input aliases an output in the lowering, and the outputs are the in-place
    kernel's bit for bit (interpret mode)."""
    def aliases(in_place):
        fn = lambda *a: gdn_conv.gdn_conv_recurrence(*a, key_heads=HK27, scale=DK27 ** -0.5, in_place=in_place)
        return "output_operand_aliases" in lower_for_h200(fn, real_shapes(1, 4)).as_text()  # the custom call's
    assert aliases(True) and not aliases(False)
    args = tuple(map(jnp.asarray, make_inputs(3, 4, HK, HV, DK, DV, [4, 1, 0], seed=7)))
    kw = {"key_heads": HK, "scale": DK ** -0.5, "interpret": True, "config": NARROW}
    fresh = gdn_conv.gdn_conv_recurrence(*args, in_place=False, **kw)
    aliased = gdn_conv.gdn_conv_recurrence(*args, **kw)
    for name, x, y in zip(("o", "state", "conv state"), fresh, aliased):
        np.testing.assert_array_equal(bits(np.asarray(x)), bits(np.asarray(y)), name)


@pytest.mark.parametrize("t,ns", [(4, 5), (1, 2)])  # the K=3 verify; a plain step in two slots
def test_slotted_kernel_lowers_for_h200(t, ns):
    """The slotted state at the 27B shapes (B = 1, T tokens, Ns slots): state and conv state alias
    their outputs; each token's state goes out from the unrolled chain."""
    shapes = list(real_shapes(1, t))
    shapes[1] = jax.ShapeDtypeStruct((ns,) + shapes[1].shape, shapes[1].dtype)
    shapes[7] = jax.ShapeDtypeStruct((ns,) + shapes[7].shape, jnp.float32)
    fn = lambda *a: gdn_conv.gdn_conv_recurrence(*a[:9], key_heads=HK27, scale=DK27 ** -0.5, slots=a[9])
    lowered = lower_for_h200(fn, shapes + [jax.ShapeDtypeStruct((1,), jnp.int32)], donate_argnums=(1, 7))
    text = lowered.as_text()
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text
    [(_, triton_ir)] = triton_calls(lowered)
    assert "tt.func public @gdn_conv_recurrence" in triton_ir
    assert "scf.for" not in triton_ir


def test_row_invariant_kernel_is_one_program_for_a_step_and_a_verify():
    """row_invariant at the 27B shapes, slotted: the Triton programs for T = 1 and T = 4 are the same up
    to integer constants (T's strides) and SSA names, so a decode step and a verify pass run the same
    arithmetic on a token; the unrolled form's are not (the control)."""
    def program(t, row_invariant):
        shapes = list(real_shapes(1, t))
        shapes[1] = jax.ShapeDtypeStruct((5,) + shapes[1].shape, shapes[1].dtype)
        shapes[7] = jax.ShapeDtypeStruct((5,) + shapes[7].shape, jnp.float32)
        fn = lambda *a: gdn_conv.gdn_conv_recurrence(*a[:9], key_heads=HK27, scale=DK27 ** -0.5, slots=a[9],
                                                     row_invariant=row_invariant)
        lowered = lower_for_h200(fn, shapes + [jax.ShapeDtypeStruct((1,), jnp.int32)], donate_argnums=(1, 7))
        [(_, triton_ir)] = triton_calls(lowered)
        return re.sub(r"%[\w#]+", "%v", re.sub(r"arith\.constant -?\d+ : i32", "arith.constant N : i32", triton_ir))

    assert program(1, True) == program(4, True)
    assert program(1, False) != program(4, False)


@pytest.mark.parametrize("t", [gdn_conv.MAX_UNROLLED_TOKENS + 1, gdn_conv.MAX_UNROLLED_TOKENS + 4])
def test_looped_kernel_lowers_for_h200(t):
    [(_, triton_ir)] = triton_calls(lower_real(1, t))
    assert "scf.for" in triton_ir


def verify_vs_steps(hk, hv, dk, dv, row_invariant, interpret=False, config=None):
    """Four sequences: a 4-token slotted pass against four 1-token passes from the same slots. Each
    token's output, slot state and conv slot that differ, bit for bit (a description per difference)."""
    mixed, conv_state, conv_w, a, beta_logit, a_log, dt_bias, s0, _ = make_inputs(4, 4, hk, hv, dk, dv, [4] * 4,
                                                                                 seed=11)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    kw = {"key_heads": hk, "scale": dk ** -0.5, "row_invariant": row_invariant, "interpret": interpret,
          "config": config}
    reads, rows = jnp.asarray([0, 2, 4, 1], jnp.int32), jnp.arange(4)
    fresh = lambda: (jnp.zeros((5,) + s0.shape, jnp.float32).at[reads, rows].set(jnp.asarray(s0)),
                     jnp.zeros((5,) + conv_state.shape, jnp.bfloat16).at[reads, rows].set(bf(conv_state)))
    call = lambda t0, t1, state, conv, slots: gdn_conv.gdn_conv_recurrence(  # tokens t0 .. t1-1
        bf(mixed[:, t0:t1]), conv, bf(conv_w), bf(a[:, t0:t1]), bf(beta_logit[:, t0:t1]), jnp.asarray(a_log),
        jnp.asarray(dt_bias), state, jnp.full((4,), t1 - t0, jnp.int32), slots=slots, **kw)
    o_all, s_all, c_all = map(np.asarray, call(0, 4, *fresh(), reads))
    state, conv = fresh()
    parted = []
    for t in range(4):
        o, state, conv = call(t, t + 1, state, conv, (reads + t) % 5)
        slot = np.asarray((reads + 1 + t) % 5)
        for b in range(4):
            for name, x, y in (("o", np.asarray(o)[b, 0], o_all[b, t]),
                               ("state", np.asarray(state)[slot[b], b], s_all[slot[b], b]),
                               ("conv", np.asarray(conv)[slot[b], b], c_all[slot[b], b])):
                if not np.array_equal(bits(x), bits(y)):
                    diff = np.max(np.abs(x.astype(np.float32) - y.astype(np.float32)))
                    parted.append(f"row {b} token {t} {name}: max |diff| {diff:.3g}")
    return parted


def test_row_invariant_verify_rows_equal_one_token_steps():
    """KernelConfig.deterministic's form: token t of a verify pass is the decode step's bits (on the
    CPU the unrolled form parts the outputs at ~1e-8)."""
    assert verify_vs_steps(HK, HV, DK, DV, row_invariant=True, interpret=True, config=NARROW) == []


# ------------------------------------------------------------------------------------------------
# on the GPU (deselected on the CPU): python -m pytest -q -m gpu tests/test_kernel_gdn_conv.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("b,t", [(1, 1), (8, 4)])
def test_gpu_kernel_matches_ref_real_shapes(b, t):
    n_valid = np.maximum(t - np.arange(b) % (t + 1), 0).astype(np.int32)  # t, t-1, .., 0, t, ...
    mixed, conv_state, conv_w, a, beta_logit, a_log, dt_bias, s0, n = make_inputs(
        b, t, HK27, HV27, DK27, DV27, n_valid, seed=b * t)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf(mixed), bf(conv_state), bf(conv_w), bf(a), bf(beta_logit), a_log, dt_bias, s0, n)
    o, s, conv = run_kernel(*args, hk=HK27, interpret=False, config=None)
    want_o, want_s, want_conv = run_ref(*args, hk=HK27)
    keep = valid_mask(t, n_valid)
    assert_close(o[keep], want_o[keep], conv_tol(t, DK27, 2), "gpu kernel o")
    assert_close(s, want_s, conv_tol(t, DK27, 2), "gpu kernel state")
    np.testing.assert_array_equal(bits(conv), bits(want_conv), "gpu kernel conv state bits")
    for i in np.flatnonzero(n_valid == 0):
        np.testing.assert_array_equal(bits(s[i]), bits(s0[i]), "no valid token: state bits")


@pytest.mark.gpu
def test_gpu_slotted_kernel_real_shapes():
    """The slotted form on the H200 at the 27B shapes, B = 2, T = 4, Ns = 5, reading slots 4 and 1: each
    token's slot as the one-state kernel over that prefix; the read slot untouched."""
    mixed, conv_state, conv_w, a, beta_logit, a_log, dt_bias, s0, n = make_inputs(
        2, 4, HK27, HV27, DK27, DV27, [4, 2], seed=3)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf(mixed), bf(conv_state), bf(conv_w), bf(a), bf(beta_logit), jnp.asarray(a_log), jnp.asarray(dt_bias))
    kw = {"key_heads": HK27, "scale": DK27 ** -0.5}
    reads, rows = jnp.asarray([4, 1], jnp.int32), jnp.arange(2)
    state = jnp.zeros((5,) + s0.shape, jnp.float32).at[reads, rows].set(jnp.asarray(s0))
    conv = jnp.zeros((5,) + conv_state.shape, jnp.bfloat16).at[reads, rows].set(args[1])
    _, got, got_conv = gdn_conv.gdn_conv_recurrence(args[0], conv, *args[2:], state, jnp.asarray(n), slots=reads, **kw)
    got, got_conv = np.asarray(got), np.asarray(got_conv)
    for row in range(2):
        np.testing.assert_array_equal(bits(got[int(reads[row]), row]), bits(s0[row]), "read slot")
        for t in range(4):
            slot = (int(reads[row]) + 1 + t) % 5
            _, want, want_conv = gdn_conv.gdn_conv_recurrence(*args, jnp.asarray(s0), jnp.minimum(jnp.asarray(n), t + 1),
                                                              **kw)
            assert_close(got[slot, row], np.asarray(want)[row], conv_tol(4, DK27, 2), f"row {row} token {t}")
            np.testing.assert_array_equal(bits(got_conv[slot, row]), bits(np.asarray(want_conv)[row]), "conv")



@pytest.mark.gpu
@pytest.mark.parametrize("row_invariant", [False, True])
def test_gpu_verify_rows_equal_one_token_steps(row_invariant):
    parted = verify_vs_steps(HK27, HV27, DK27, DV27, row_invariant=row_invariant)
    assert parted == [], "\n".join(parted[:16])
