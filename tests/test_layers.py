"""Each layer function against the independent float64 formulas in numpy_ref."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_ref as ref
from pallas_kernels import fp8_matmul, gdn, paged_attention
from qmtp.model import layers
from qmtp.model.fp8 import quantize_np
from tolerance import F32_OP, F32_RECURRENCE, assert_close

RNG = np.random.default_rng(0)


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def test_rms_norm_is_zero_centred():
    x, w = randn(3, 5, 48), randn(48, scale=0.3)
    assert_close(layers.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6), ref.rms_norm(x, w, 1e-6), F32_OP, "rms_norm")


def test_gated_rms_norm_uses_plain_weight_and_silu_gate():
    x, z, w = randn(2, 3, 4, 16), randn(2, 3, 4, 16), 1 + randn(16, scale=0.2)
    got = layers.gated_rms_norm(jnp.asarray(x), jnp.asarray(z), jnp.asarray(w), 1e-6)
    assert_close(got, ref.gated_rms_norm(x, z, w, 1e-6), F32_OP, "gated_rms_norm")


@pytest.mark.parametrize("rotary_dim", [8, 32])
def test_partial_rope(rotary_dim):
    x = randn(2, 5, 3, 32)
    pos = np.array([[0, 1, 2, 700, 4095], [7, 8, 9, 10, 11]], np.int32)
    got = np.asarray(layers.rope(jnp.asarray(x), jnp.asarray(pos), rotary_dim, 10000.0))
    want = np.stack([np.stack([ref.rope(x[b, t], pos[b, t], rotary_dim, 10000.0) for t in range(5)])
                     for b in range(2)])
    # The angle pos * inv_freq is formed in f32 (as HF does): two roundings of up to 2^-24 relative
    # each, so the angle error is at most pos * 2^-23 radians; values are O(1).
    assert_close(got, want, F32_OP + pos.max() * 2.0 ** -23 * 2, "rope")
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


def _gdn_inputs(b, t, hk, hv, dk, dv):
    l2 = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = l2(randn(b, t, hk, dk)) * dk ** -0.5
    k = l2(randn(b, t, hk, dk))
    v = randn(b, t, hv, dv)
    g = -np.exp(randn(b, t, hv, scale=0.5)) * 0.3  # log-decay < 0
    beta = 1 / (1 + np.exp(-randn(b, t, hv)))
    s0 = randn(b, hv, dk, dv, scale=0.5)
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), s0


def test_gdn_recurrence_matches_numpy_with_gqa_heads():
    q, k, v, g, beta, s0 = _gdn_inputs(2, 7, 2, 6, 8, 4)
    o, s, states = gdn.gdn_recurrence_ref(*map(jnp.asarray, (q, k, v, g, beta, s0)), return_states=True)
    for b in range(2):
        want_o, want_s = ref.gdn_recurrence(q[b], k[b], v[b], g[b], beta[b], s0[b])
        assert_close(o[b], want_o, F32_RECURRENCE, "gdn o")
        assert_close(s[b], want_s, F32_RECURRENCE, "gdn state")
        _, s3 = ref.gdn_recurrence(q[b, :3], k[b, :3], v[b, :3], g[b, :3], beta[b, :3], s0[b])
        assert_close(states[b, 2], s3, F32_RECURRENCE, "state after token 3")


@pytest.mark.parametrize("t,chunk", [(70, 64), (150, 64), (5, 4)])
def test_chunked_gdn_equals_recurrence(t, chunk):
    q, k, v, g, beta, s0 = _gdn_inputs(2, t, 2, 4, 16, 8)
    args = tuple(map(jnp.asarray, (q, k, v, g, beta, s0)))
    o_rec, s_rec = gdn.gdn_recurrence_ref(*args)
    o_chk, s_chk = gdn.gdn_chunked_ref(*args, chunk=chunk)
    assert_close(o_chk, o_rec, F32_RECURRENCE, "chunked o")
    assert_close(s_chk, s_rec, F32_RECURRENCE, "chunked state")


def test_masked_gdn_tokens_leave_state_unchanged():
    q, k, v, g, beta, s0 = _gdn_inputs(1, 9, 2, 4, 8, 8)
    g[:, 5:], beta[:, 5:] = 0.0, 0.0
    args = tuple(map(jnp.asarray, (q, k, v, g, beta, s0)))
    _, s_full = gdn.gdn_chunked_ref(*args, chunk=4)
    _, s_five = gdn.gdn_recurrence_ref(*(a[:, :5] for a in args[:5]), args[5])
    assert_close(s_full, s_five, F32_RECURRENCE, "state after padding")


def test_causal_conv_with_state_and_ragged_valid():
    u, st, w = randn(2, 6, 10), randn(2, 3, 10), randn(10, 4, scale=0.5)
    n_valid = np.array([6, 4], np.int32)
    y, new = layers.causal_conv(jnp.asarray(u), jnp.asarray(st), jnp.asarray(w), jnp.asarray(n_valid))
    for b in range(2):
        n = n_valid[b]
        want_y, want_state = ref.causal_conv(u[b, :n], st[b], w)
        assert_close(np.asarray(y)[b, :n], want_y, F32_OP, "conv y")
        np.testing.assert_array_equal(np.asarray(new)[b], want_state.astype(np.float32))


def _paged(kv_seq, lengths, page_size, n_pages, rng):
    """Scatters per-sequence contiguous KV [B, N, H, D] into NaN-poisoned pages with a shuffled table."""
    b, n, h, d = kv_seq.shape
    per_seq = -(-n // page_size) + 1  # one spare (never-written) entry
    perm = rng.permutation(n_pages)[: b * per_seq].reshape(b, per_seq)
    pages = np.full((n_pages, page_size, h, d), np.nan, np.float32)
    for s in range(b):
        for j in range(lengths[s]):
            pages[perm[s, j // page_size], j % page_size] = kv_seq[s, j]
    return pages, perm.astype(np.int32)


@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_paged_attention_matches_contiguous_and_ignores_nan_slots(page_size):
    rng = np.random.default_rng(page_size)
    b, t, hq, hkv, d, n = 3, 4, 6, 2, 16, 11
    lengths = np.array([11, 5, 4], np.int32)  # KV length (includes the T new tokens)
    k, v, q = randn(b, n, hkv, d), randn(b, n, hkv, d), randn(b, t, hq, d)
    n_pages = 3 * (-(-n // page_size) + 1) + 2
    kp, table = _paged(k, lengths, page_size, n_pages, rng)
    vp, _ = _paged(v, lengths, page_size, n_pages, np.random.default_rng(page_size))
    qpos = lengths[:, None] - t + np.arange(t)[None]
    got = paged_attention.paged_attention_ref(*map(jnp.asarray, (q, kp, vp, table, qpos, lengths)), scale=d ** -0.5)
    for s in range(b):
        want = ref.attention(q[s], k[s, :lengths[s]], v[s, :lengths[s]], qpos[s], d ** -0.5)
        assert_close(np.asarray(got)[s], want, F32_OP * 4, f"paged attention seq {s}")


def test_write_kv_drops_invalid_and_out_of_table_positions():
    pages = jnp.zeros((4, 2, 1, 1))
    table = jnp.asarray([[2, 0]], jnp.int32)
    pos = jnp.asarray([[1, 2, 3, 4]], jnp.int32)  # 4 is beyond the 2-page table
    valid = jnp.asarray([[True, True, False, True]])
    new = jnp.arange(1.0, 5.0).reshape(1, 4, 1, 1)
    out = np.asarray(layers.write_kv(pages, table, pos, valid, new))[..., 0, 0]
    want = np.zeros((4, 2))
    want[2, 1] = 1.0  # position 1 -> page table[0] = 2, slot 1
    want[0, 0] = 2.0  # position 2 -> page table[1] = 0, slot 0; position 3 invalid; 4 dropped
    np.testing.assert_array_equal(out, want)


def test_write_kv_scatter_states_unique_indices():
    """The scatter XLA gets states unique indices (the rows are distinct even for dropped tokens), so
    it may write them without ordering the updates."""
    args = (jnp.zeros((4, 2, 1, 1)), jnp.asarray([[2, 0]], jnp.int32), jnp.asarray([[1, 2, 3, 4]], jnp.int32),
            jnp.asarray([[True, True, False, True]]), jnp.ones((1, 4, 1, 1)))
    assert "unique_indices = true" in jax.jit(layers.write_kv).lower(*args).as_text()


@pytest.mark.parametrize("out_f,in_f", [(272, 160), (64, 300), (128, 128)])
def test_fp8_matmul_ref_ragged_blocks(out_f, in_f):
    w32 = randn(out_f, in_f)
    wq, scale = quantize_np(w32)
    x = randn(3, in_f)
    got = fp8_matmul.fp8_matmul_ref(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(scale), out_dtype=jnp.float32)
    want = x.astype(np.float64) @ ref.fp8_dequant(wq, scale).T
    assert_close(got, want, F32_OP * 10, "fp8 matmul")
    with pytest.raises(ValueError, match="scale"):
        fp8_matmul.fp8_matmul_ref(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(scale[:, :-1]))
